"""Where the host time of a Triton-backed call goes, layer by layer, against eager torch.

A 24-layer model makes ~1,400 kernel calls per forward; on a host-bound step each microsecond
of Python per call is ~1.4 ms per forward. This times, at a tiny shape (the GPU finishes each
kernel long before the host issues the next), a stream of calls of:

  eager        the torch ops the kernel replaces (HF's RMSNorm module, silu(g) * u)
  body         the kernel's forward body (``forge_triton.rmsnorm.rmsnorm_fwd``,
               ``forge_triton.glu.glu_fwd``): its outputs allocated and the kernel launched
               through forge's direct launch path
  body (triton launch)   the same with the launch through Triton's own ``kernel[grid](...)``
               (``forge_triton.plain_launches()``): the difference is what forge's path saves
  alloc        the output allocation alone
  check        the spec's argument checks + the device check (``forge_triton.check_devices``)
  fn           the public function (checks, allocation, autograd.Function, launch), no grad
  fn+bwd       forward and backward of the public function; ``eager+bwd`` the same for eager

    python bench/bench_host_overhead.py [--calls 2000] [--quick]

Writes host_overhead-<device>.{json,csv} into --out.
"""
from __future__ import annotations

import argparse
import contextlib
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
    """(kernel, measure, fn, through Triton's own launch path) per row."""
    import forge_triton
    from forge.spec import rmsnorm as rms_spec
    from forge.spec import swiglu as swi_spec
    from forge_triton.glu import glu_fwd
    from forge_triton.rmsnorm import rmsnorm_fwd
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    rows, width, inter = 8, 896, 4864
    x = torch.randn(rows, width, device=dev, dtype=dtype)
    w = torch.ones(width, device=dev, dtype=dtype)
    hf = Qwen2RMSNorm(width, eps=1e-6).to(dev, dtype)
    g, u = (torch.randn(rows, inter, device=dev, dtype=dtype) for _ in range(2))
    check_devices = forge_triton.check_devices

    def no_grad(fn, *a):
        def run():
            with torch.no_grad():
                fn(*a)
        return run

    def rms_body():
        rmsnorm_fwd(x, w, 1e-6, "llama", 0.0)

    def glu_body():
        glu_fwd(g, u, False)

    yield "rmsnorm", "eager", no_grad(hf, x), False
    yield "rmsnorm", "body (triton launch)", rms_body, True
    yield "rmsnorm", "body", rms_body, False
    yield "rmsnorm", "alloc", lambda: (torch.empty_like(x), torch.empty(rows, device=dev, dtype=torch.float32)), False
    yield "rmsnorm", "check", lambda: (rms_spec.check(x, w, 1e-6, "llama", 0.0), check_devices(x=x, weight=w)), False
    yield "rmsnorm", "fn", no_grad(forge_triton.rmsnorm, x, w, 1e-6), False
    yield "rmsnorm", "eager+bwd", _with_bwd(lambda a, b: hf(a) * b, [x, w]), False
    yield "rmsnorm", "fn+bwd", _with_bwd(lambda a, b: forge_triton.rmsnorm(a, b, 1e-6), [x, w]), False
    yield "swiglu", "eager", no_grad(lambda: F.silu(g) * u), False
    yield "swiglu", "body (triton launch)", glu_body, True
    yield "swiglu", "body", glu_body, False
    yield "swiglu", "alloc", lambda: torch.empty_like(g), False
    yield "swiglu", "check", lambda: (swi_spec.check(g, u), check_devices(gate=g, up=u)), False
    yield "swiglu", "fn", no_grad(forge_triton.swiglu, g, u), False
    yield "swiglu", "eager+bwd", _with_bwd(lambda a, b: F.silu(a) * b, [g, u]), False
    yield "swiglu", "fn+bwd", _with_bwd(forge_triton.swiglu, [g, u]), False


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
    import forge_triton

    for kernel, what, fn, plain in cases(dev, dtype):
        with forge_triton.plain_launches() if plain else contextlib.nullcontext():
            us = _per_call_us(fn, calls, reps=1 if args.quick else 5)
        rows.append(dict(kernel=kernel, measure=what, us_per_call=us))
    bc.print_table(rows, ["kernel", "measure", "us_per_call"])
    if args.profile:
        import cProfile
        import pstats

        for kernel, what, fn, _ in cases(dev, dtype):
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
