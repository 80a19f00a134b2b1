"""Shared benchmark plumbing: environment record, device-time measurement, result files."""
from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# FORGE_BENCH_RESULTS redirects output (CI smoke tests write to a temporary folder)
RESULTS = Path(os.environ.get("FORGE_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
COPY_CEILING_GBS = 4220.0  # H200 device-to-device copy, bytes read + written (MEASURED.md)
MATMUL_CEILING_TFLOPS = 790.0  # bf16 8192^3 on random data (MEASURED.md)


def environment() -> dict:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    for mod in ("triton", "jax", "transformers", "peft", "liger_kernel"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages
            env[mod] = None
    return env


def write_results(stem: str, rows: list[dict], extra: dict | None = None) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    dev = "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name().split()[-1].lower()
    base = f"{stem}-{dev}-{tag}"  # stems hold dots (qwen2.5-0.5b): add suffixes, never replace
    meta = {"environment": environment(), **(extra or {}), "rows": rows}
    jpath = RESULTS / (base + ".json")
    jpath.write_text(json.dumps(meta, indent=2, default=str))
    cpath = RESULTS / (base + ".csv")
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    with cpath.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    return jpath, cpath


def print_table(rows: list[dict], cols: list[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_time_us(fn, iters: int = 30, warmup: int = 5) -> float:
    """Median-free mean GPU time of fn per call (us), summed over every CUDA kernel it launches
    on any stream (torch.profiler/CUPTI sees JAX's kernels too). CPU: wall clock."""
    for _ in range(warmup):
        fn()
    sync()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e6
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        sync()
    total = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total += getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)
    return total / iters


def wall_us(fn, iters: int = 50, warmup: int = 5, reps: int = 5) -> float:
    """Median over reps of host wall time per call including a final sync (us)."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(out)


def progress(it, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(it, desc=desc, file=sys.stderr, leave=False)
    except ImportError:
        return it
