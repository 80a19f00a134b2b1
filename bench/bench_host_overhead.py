"""Where the host time of a Triton-backed call goes, layer by layer, against eager torch.

A 24-layer model makes ~1,400 kernel calls per forward; on a host-bound step each microsecond
of Python per call is ~1.4 ms per forward. This times, at a tiny shape (the GPU finishes each
kernel long before the host issues the next), a stream of calls of:

  eager        the torch ops the kernel replaces (HF's RMSNorm module, silu(g) * u)
  launch       the raw ``kernel[grid](...)`` launch into a preallocated output (Triton's path)
  fast         the same launch through forge_triton._launch.FastKernel (forge's path)
  alloc        the output allocation alone
  check        the spec's argument checks + the device check
  fn           the public function (checks, allocation, autograd.Function, launch), no grad
  fn+bwd       forward and backward of the public function; ``eager+bwd`` the same for eager

    python bench/bench_host_overhead.py [--calls 2000] [--quick]

Writes host_overhead-<device>.{json,csv} into --out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _common as bc  # noqa: E402


def _per_call_us(fn, calls, reps=5):
    fn()
    bc.sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        bc.sync()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def _with_bwd(fn, inputs):
    leaves = [t.detach().requires_grad_(True) for t in inputs]

    def run():
        y = fn(*leaves)
        y.backward(torch.ones_like(y))

    return run


def cases(dev, dtype):
    from forge.spec import rmsnorm as rms_spec
    from forge.spec import swiglu as swi_spec
    import importlib

    # the modules (``forge_triton.rmsnorm`` the attribute is the function)
    _common, glu, rmsnorm = (importlib.import_module(f"forge_triton.{m}") for m in ("_common", "glu", "rmsnorm"))

    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    rows, width, inter = 8, 896, 4864
    x = torch.randn(rows, width, device=dev, dtype=dtype)
    w = torch.ones(width, device=dev, dtype=dtype)
    hf = Qwen2RMSNorm(width, eps=1e-6).to(dev, dtype)
    y = torch.empty_like(x)
    rstd = torch.empty(rows, device=dev, dtype=torch.float32)
    g, u = (torch.randn(rows, inter, device=dev, dtype=dtype) for _ in range(2))
    gy = torch.empty_like(g)
    acc = _common.acc(dtype)

    def rms_launch():
        rmsnorm._rmsnorm_fwd_kernel[(rows,)](x, w, y, rstd, x.stride(0), y.stride(0), rows, width, 1e-6, 0.0,
                                            BLOCK_M=1, BLOCK_N=1024, num_warps=4, GEMMA=False, ACC=acc)

    def rms_fast():
        rmsnorm._fwd[(rows,)](x, w, y, rstd, x.stride(0), y.stride(0), rows, width, 1e-6, 0.0,
                              BLOCK_M=1, BLOCK_N=1024, num_warps=4, GEMMA=False, ACC=acc)

    def glu_fast():
        glu._fwd[(-(-g.numel() // glu.BLOCK),)](g, u, gy, g.numel(), BLOCK=glu.BLOCK, GELU=False, ACC=acc,
                                                num_warps=8)

    def glu_launch():
        glu._glu_fwd_kernel[(-(-g.numel() // glu.BLOCK),)](g, u, gy, g.numel(), BLOCK=glu.BLOCK, GELU=False, ACC=acc,
                                                  num_warps=8)

    def no_grad(fn, *a):
        def run():
            with torch.no_grad():
                fn(*a)
        return run

    yield "rmsnorm", "eager", no_grad(hf, x)
    yield "rmsnorm", "launch", rms_launch
    yield "rmsnorm", "fast", rms_fast
    yield "rmsnorm", "alloc", lambda: (torch.empty_like(x), torch.empty(rows, device=dev, dtype=torch.float32))
    yield "rmsnorm", "check", lambda: (rms_spec.check(x, w, 1e-6, "llama", 0.0), _common.check_device(x=x, weight=w))
    yield "rmsnorm", "fn", no_grad(rmsnorm.rmsnorm, x, w, 1e-6)
    yield "rmsnorm", "eager+bwd", _with_bwd(lambda a, b: hf(a) * b, [x, w])
    yield "rmsnorm", "fn+bwd", _with_bwd(lambda a, b: rmsnorm.rmsnorm(a, b, 1e-6), [x, w])
    yield "swiglu", "eager", no_grad(lambda: F.silu(g) * u)
    yield "swiglu", "launch", glu_launch
    yield "swiglu", "fast", glu_fast
    yield "swiglu", "alloc", lambda: torch.empty_like(g)
    yield "swiglu", "check", lambda: (swi_spec.check(g, u), _common.check_device(gate=g, up=u))
    yield "swiglu", "fn", no_grad(glu.swiglu, g, u)
    yield "swiglu", "eager+bwd", _with_bwd(lambda a, b: F.silu(a) * b, [g, u])
    yield "swiglu", "fn+bwd", _with_bwd(glu.swiglu, [g, u])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="few calls (a CPU smoke test, not a number)")
    ap.add_argument("--profile", action="store_true", help="also cProfile the fn+bwd streams (top functions)")
    bc.add_out_argument(ap)
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    calls = 3 if args.quick else args.calls
    rows = []
    for kernel, what, fn in cases(dev, dtype):
        us = _per_call_us(fn, calls, reps=1 if args.quick else 5)
        rows.append(dict(kernel=kernel, measure=what, us_per_call=us))
    bc.print_table(rows, ["kernel", "measure", "us_per_call"])
    if args.profile:
        import cProfile
        import pstats

        for kernel, what, fn in cases(dev, dtype):
            if what != "fn+bwd":
                continue
            fn()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                fn()
            bc.sync()
            prof.disable()
            print(f"--- cProfile {kernel} {what}: {calls} calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    j, c = bc.write_results(args.out, "host_overhead", rows, {"calls": calls})
    print(f"wrote {j}\n      {c}")


if __name__ == "__main__":
    main()
