"""Where a kernel call's host time goes, per backend, on the GPU: for rmsnorm, swiglu, geglu and
rope at a tiny shape (the loop is host-bound), the no-grad forward and forward + backward of
``forge.ops.get(key, backend)`` timed side by side (alternating rounds), the CUDA launches and
aten ops per call (torch.profiler), and cProfile's top functions by own time. Prints only; the
numbers that count are bench_bridge_overhead.py's.

    python bench/diag_host_paths.py [--kernels rmsnorm,rope] [--top 14]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import _common as bc  # noqa: E402
import bench_bridge_overhead as bo  # noqa: E402
from forge import ops  # noqa: E402

TINY = {"rmsnorm": (8, 896), "swiglu": (8, 896), "geglu": (8, 896), "rope": (1, 14, 2, 8, 64)}


def _launches(fn, calls=20):
    """(kernel launches, aten ops) per call, from torch.profiler's CPU-side events."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    bc.sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        bc.sync()
    names = [e.name for e in prof.events()]
    launches = sum(n in ("cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaLaunchKernelExC")
                   for n in names)
    aten = sum(n.startswith("aten::") for n in names)
    return launches / calls, aten / calls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="rmsnorm,swiglu,geglu,rope")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for key in a.kernels.split(","):
        args, kwargs, diff, _, _ = bo._inputs(key, TINY[key], torch.bfloat16, dev)
        fns = {be: ops.get(key, be) for be in ("triton", "pallas")}
        for what, make in (("fwd", lambda f: bo._fwd(f, args, kwargs)),
                           ("fwd+bwd", lambda f: bo._fwd_bwd(f, args, kwargs, diff))):
            runs = {be: make(f) for be, f in fns.items()}
            times = {be: [] for be in runs}
            for _ in range(7):
                for be, run in runs.items():
                    times[be].append(bc.wall_us(run, iters=200, reps=1))
            med = {be: statistics.median(v) for be, v in times.items()}
            counts = {be: _launches(run) for be, run in runs.items()}
            print(f"\n=== {key} {what}: " + ", ".join(
                f"{be} {med[be]:.1f} us ({counts[be][0]:.0f} launches, {counts[be][1]:.0f} aten ops)" for be in runs)
                + f"; pallas/triton {med['pallas'] / med['triton']:.2f}x")
            for be, run in runs.items():
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(a.calls):
                    run()
                bc.sync()
                prof.disable()
                print(f"--- cProfile {key} {what} {be}: {a.calls} calls")
                pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
