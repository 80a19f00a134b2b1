"""Fused linear cross-entropy, forward + backward (grads for hidden and lm_head weight), bf16:
eager (F.linear + F.cross_entropy on fp32 logits), forge triton, forge pallas, Liger-Kernel.

Each (case, implementation) runs in its own subprocess, so peak-memory counters start clean and
JAX's peak (not resettable, invisible to torch) belongs to that one run. Reported per run:
median wall time of a synchronised fwd+bwd step, and peak memory above the inputs: torch's
``max_memory_allocated`` minus what was allocated before the step (the gradients it returns are
counted), plus, for pallas, JAX's ``peak_bytes_in_use`` (its pool: tiles, residuals, grads).
Targets (issue 4): extra memory <= 1/10 of eager's and time <= 1.1x eager's.

    python bench/bench_flce.py                       # both cases, every implementation
    python bench/bench_flce.py --cases small --impls eager,triton
    python bench/bench_flce.py --quick               # tiny case on the CPU (interpreters): a smoke test

Writes flce-<cases>-<device>.{json,csv} into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

# tokens, hidden, vocab; "tiny" is a plumbing check that also runs on a CPU (interpreters)
CASES = {"small": (4096, 896, 151936), "large": (16384, 4096, 128256), "tiny": (64, 32, 1000)}
IMPLS = ("eager", "triton", "pallas", "liger")
# also accepted in --impls: <backend>-tiles / <backend>-rows force that backend's vocabulary
# tiles / row chunks (sized by its default rules) whichever its default would pick
FORCED = ("triton-tiles", "triton-rows", "pallas-tiles", "pallas-rows")
IGNORED = 0.1  # fraction of labels = -100, as in the reference figures (docs/hardware.md)


def _impl(name, tile_vocab=None, n=0, v=0):
    import functools

    import torch.nn.functional as F

    if name in FORCED:
        from forge import ops
        from forge.spec import fused_linear_ce as spec

        backend, strategy = name.split("-")
        fn = ops.get("fused_linear_ce", backend)
        # (each package's attribute of that name is the function: the modules by their path)
        mod = sys.modules["forge_triton.fused_linear_ce" if backend == "triton" else "bridge.fused_linear_ce"]
        if strategy == "tiles":
            return functools.partial(fn, tile_vocab=tile_vocab or spec.tile_width(
                n, v, logits_fraction=mod.LOGITS_FRACTION))
        return functools.partial(fn, chunk_rows=spec.row_chunk(n, v) or spec.ROW_CHUNK_MIN)
    if name == "eager":
        return lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y)
    if name in ("triton", "pallas"):
        from forge import ops

        fn = ops.get("fused_linear_ce", name)
        return functools.partial(fn, tile_vocab=tile_vocab) if tile_vocab else fn
    if name == "liger":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: loss(w, h, y)
    raise ValueError(name)


def _top_kernels(step, sync, top=10):
    """One step under torch.profiler (JAX's kernels included): (name, ms, calls), slowest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    rows = [(e.key[:90], e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return [list(r) for r in rows[:top]]


def run_one(case: str, impl: str, iters: int, warmup: int, profile: bool = False,
            tile_vocab: int | None = None) -> dict:
    """One (case, implementation) in this process; returns its row."""
    import torch

    n, hd, v = CASES[case]
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(n, hd, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, hd, device=dev, generator=g) * hd**-0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    y[torch.rand(n, device=dev, generator=g) < IGNORED] = -100
    try:
        fn = _impl(impl, tile_vocab, n, v)
    except ImportError as e:
        return {"case": case, "impl": impl, "skipped": f"not importable: {e}"}

    def step():
        loss = fn(h, w, y)
        loss.backward()
        return loss

    t0 = time.perf_counter()
    for i in range(warmup):
        step()
        h.grad = w.grad = None
        if i == 0:
            sync()
            first_call_s = time.perf_counter() - t0  # compiles included (Triton, XLA)
    sync()
    # memory: one step from a clean peak counter, inputs already allocated
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    loss = step()
    sync()
    torch_extra = torch.cuda.max_memory_allocated() - base if cuda else 0
    loss_val = float(loss.detach())
    gnorm = (float(h.grad.float().norm()), float(w.grad.float().norm()))
    h.grad = w.grad = None
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        h.grad = w.grad = None
    kernels = None
    if profile and cuda:
        kernels = _top_kernels(step, sync)
        h.grad = w.grad = None
    jax_peak = None
    if impl.startswith("pallas") and cuda:
        import jax

        jax_peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    extra = torch_extra + (jax_peak or 0)
    useful = 6.0 * n * hd * v  # eager's three matmuls, the work any implementation must do
    ms = statistics.median(times)
    return {"case": case, "impl": impl, "tokens": n, "hidden": hd, "vocab": v, "ms": ms,
            "ms_min": min(times), "extra_mib": extra / 2**20, "torch_extra_mib": torch_extra / 2**20,
            "jax_peak_mib": None if jax_peak is None else jax_peak / 2**20,
            "tflops_useful": useful / ms / 1e9, "loss": loss_val, "grad_h_norm": gnorm[0],
            "grad_w_norm": gnorm[1], "times": times, "first_call_s": first_call_s if warmup else None,
            **({"top_kernels": kernels} if kernels else {})}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="small,large")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="processes per implementation, in rotation")
    ap.add_argument("--tile-vocab", type=int, default=None,
                    help="forge's vocabulary tile width (default: the backend's own rule)")
    ap.add_argument("--profile", action="store_true", help="print each run's slowest kernels")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny case on the CPU, eager/triton/pallas, one process each: a smoke test")
    ap.add_argument("--one", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)
    import _common

    _common.add_out_argument(ap)
    args = ap.parse_args()
    if args.quick:
        args.cases, args.impls, args.iters, args.warmup, args.repeats = "tiny", "eager,triton,pallas", 1, 1, 1
    if args.one:
        print("ROW " + json.dumps(run_one(*args.one, args.iters, args.warmup, args.profile,
                                           args.tile_vocab)), flush=True)
        # The row is complete and flushed; leave without the interpreter's teardown. With torch
        # and jax in one process a runtime's thread pool can abort while static objects are
        # destroyed ("terminate called without an active exception": seen once on the H200 and
        # once in CPU CI, in neither case reproducible), which is no part of what was measured.
        sys.stderr.flush()
        os._exit(0)
    rows = []
    # keep the caller's PYTHONPATH (a carried Liger-Kernel wheel lives there)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x))
    if args.quick:  # the CPU even where a GPU is present, as the other benchmarks' --quick
        env["CUDA_VISIBLE_DEVICES"] = ""
    for case in args.cases.split(","):
        # each implementation in its own process, in rotation --repeats times: a process's
        # speed varies by several percent, so every implementation samples several processes
        got = {}
        for _ in range(args.repeats):
            for impl in args.impls.split(","):
                if impl in got and "ms" not in got[impl]:
                    continue  # failed or skipped once: do not retry
                cmd = [sys.executable, __file__, "--one", case, impl, "--iters", str(args.iters),
                       "--warmup", str(args.warmup)] + (["--profile"] if args.profile else []) \
                    + (["--tile-vocab", str(args.tile_vocab)] if args.tile_vocab else [])
                p = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = [x for x in p.stdout.splitlines() if x.startswith("ROW ")]
                if not line:
                    got[impl] = {"case": case, "impl": impl, "error": (p.stderr or p.stdout)[-2000:]}
                    print(f"{case} {impl}: FAILED (rc {p.returncode})\n{got[impl]['error']}", file=sys.stderr)
                    continue
                row = json.loads(line[0][4:])
                if p.returncode:  # measured, then the process died on its way out: say so
                    row["exit_rc"], row["exit_error"] = p.returncode, p.stderr[-2000:]
                    print(f"{case} {impl}: measured, then exited with rc {p.returncode}\n"
                          f"{p.stderr[-1000:]}", file=sys.stderr)
                for k, t, c in row.get("top_kernels") or []:
                    print(f"  {case} {impl} kernel: {t:8.2f} ms x{c:<4} {k}")
                if impl in got:  # merge: the step times of every process
                    got[impl]["times"] += row["times"]
                    got[impl]["extra_mib"] = max(got[impl]["extra_mib"], row["extra_mib"])
                else:
                    got[impl] = row
        for row in got.values():
            times = row.pop("times", None)
            if times:
                row["ms"], row["ms_min"] = statistics.median(times), min(times)
                row["tflops_useful"] = 6.0 * row["tokens"] * row["hidden"] * row["vocab"] / row["ms"] / 1e9
                row["processes"] = args.repeats
            rows.append(row)
    for case in args.cases.split(","):
        eager = next((r for r in rows if r["case"] == case and r["impl"] == "eager" and "ms" in r), None)
        for r in rows:
            if r["case"] == case and "ms" in r and eager:
                r["time_vs_eager"] = r["ms"] / eager["ms"]
                r["mem_vs_eager"] = r["extra_mib"] / eager["extra_mib"] if eager["extra_mib"] else None
                r["loss_diff_vs_eager"] = abs(r["loss"] - eager["loss"])
                if r["impl"] in ("triton", "pallas") + FORCED:
                    r["meets_target"] = r["time_vs_eager"] <= 1.1 and (r["mem_vs_eager"] or 0) <= 0.1
    cols = ["case", "impl", "ms", "first_call_s", "extra_mib", "jax_peak_mib", "tflops_useful", "time_vs_eager",
            "mem_vs_eager", "loss", "loss_diff_vs_eager", "meets_target", "exit_rc", "skipped"]
    _common.print_table(rows, cols)
    cases = sorted(args.cases.split(","))
    jpath, cpath = _common.write_results(args.out, "flce", rows, {"cases": {k: CASES[k] for k in cases},
                                                                  "ignored_fraction": IGNORED}, case="-".join(cases))
    print(f"wrote {jpath} and {cpath}")


if __name__ == "__main__":
    main()
