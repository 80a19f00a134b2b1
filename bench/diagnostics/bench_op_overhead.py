"""Host cost of a torch.ops.forge op call against the direct call it wraps (the op layer,
forge/ops/library.py): why eager calls keep the direct path and only torch.compile's traced
code goes through the ops.

Per kernel (rmsnorm, swiglu, rope; Triton), a stream of calls at a tiny shape of:

  direct       the backend's forward body as eager runs it (forge_triton.<kernel> module code)
  op           the same body behind torch.ops.forge.triton_<kernel>_fwd (the dispatcher, the
               custom op's Python wrapper, the static-argument string lookup)
  api          the public function ``forge.ops.get(key, "triton")`` as a patched model calls it
               (no grad): the direct path plus its checks

On a CPU (Triton's interpreter) the launches are skipped in all three (``_launch.mode("skip")``),
so what is timed is host Python alone; with --launch on a GPU the kernels are launched too
(there the device finishes each tiny kernel long before the host issues the next).

    python bench/diagnostics/bench_op_overhead.py [--calls 2000] [--launch] [--quick]

Writes op_overhead-<device>.{json,csv} into --out.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import _common as bc  # noqa: E402


def per_call_us(fn, calls, reps=5):
    fn()
    bc.sync()
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        bc.sync()
        best.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(best)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--launch", action="store_true", help="launch the kernels (a GPU): host + launch cost")
    p.add_argument("--quick", action="store_true", help="200 calls (the test suite's smoke run)")
    bc.add_out_argument(p)
    a = p.parse_args(argv)
    calls = 200 if a.quick else a.calls
    from forge import ops
    from forge.ops import library

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ops.get("rmsnorm", "triton")  # registers the Triton ops
    import importlib

    from forge_triton import _launch

    R, G, P = (importlib.import_module(f"forge_triton.{m}") for m in ("rmsnorm", "glu", "rope"))
    x, w = torch.randn(8, 64, device=dev), torch.randn(64, device=dev)
    g, u = torch.randn(8, 64, device=dev), torch.randn(8, 64, device=dev)
    q, k = torch.randn(1, 2, 4, 16, device=dev), torch.randn(1, 1, 4, 16, device=dev)
    cos, sin = torch.randn(1, 4, 16, device=dev), torch.randn(1, 4, 16, device=dev)
    def st(n, **kw):  # the static string the traced path hands the op (n tensors, none None)
        return library.encode(kw.items(), ((True,) * n, ("torch.float32",) * n))

    cases = {
        "rmsnorm": (lambda: R.rmsnorm_fwd(x, w, 1e-6, "llama", 0.0),
                    lambda s=st(2, eps=1e-6, casting="llama", offset=0.0): torch.ops.forge.triton_rmsnorm_fwd([x, w], s),
                    lambda f=ops.get("rmsnorm", "triton"): f(x, w, 1e-6)),
        "swiglu": (lambda: G.glu_fwd(g, u, False),
                   lambda s=st(2, gelu=False): torch.ops.forge.triton_glu_fwd([g, u], s),
                   lambda f=ops.get("swiglu", "triton"): f(g, u)),
        "rope": (lambda: P.rope_apply(q, k, cos, sin, False),
                 lambda s=st(4): torch.ops.forge.triton_rope_fwd([q, k, cos, sin], s),
                 lambda f=ops.get("rope", "triton"): f(q, k, cos, sin)),
    }
    mode = contextlib.nullcontext() if a.launch else _launch.mode("skip")
    rows = []
    with torch.no_grad(), mode:
        for name, (direct, op, api) in cases.items():
            row = {"kernel": name, "direct_us": per_call_us(direct, calls), "op_us": per_call_us(op, calls),
                   "api_us": per_call_us(api, calls)}
            row["op_minus_direct_us"] = row["op_us"] - row["direct_us"]
            rows.append(row)
    bc.print_table(rows, ["kernel", "direct_us", "op_us", "api_us", "op_minus_direct_us"])
    bc.write_results(Path(a.out), "op_overhead", rows, extra={"calls": calls, "launch": a.launch})


if __name__ == "__main__":
    main()
