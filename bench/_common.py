"""Shared benchmark plumbing: environment record, device-time measurement, result files.

Results go to one folder per run (``--out DIR``; default ``$FORGE_BENCH_OUT``, else
``./forge-bench-results`` in the current directory, never inside the installed package). File
names are stable, ``<script>[-<case>]-<device>.{json,csv}`` with ``<script>`` the benchmark's file
name without ``.py``: a re-run of the same case overwrites its latest result, the date lives in
the JSON, and one summary row per run is appended to ``history.csv`` in the same folder. The
project's own results are recorded in bench/results (``--out bench/results``, or
``python bench/record.py FILE.json ...`` for files made elsewhere).

A run on a CPU (both backends in their interpreters) or with ``--quick`` is a smoke test: every
table it prints and every file it writes says so (:func:`smoke_test`).
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
QUICK = "--quick" in sys.argv[1:]
if QUICK and not torch.cuda.is_available():
    # the interpreted Pallas kernels are compiled by XLA for the CPU (about a second each); its
    # cheapest optimisation level halves that, and a smoke test's numbers mean nothing anyway
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

DEFAULT_OUT = "forge-bench-results"
# the H200's measured ceilings (docs/hardware.md says what was measured and how)
COPY_CEILING_GBS = 4220.0  # device-to-device copy, bytes read + written
MATMUL_CEILING_TFLOPS = 790.0  # bf16 8192^3 matmul on random data

# per benchmark, what one history row keeps of a run: (the result's list holding the rows,
# columns naming a row, columns measured); benchmarks not listed keep no summary
SUMMARY = {
    "bench_backends": ("rows", ["kernel", "shape", "backend"], ["fwd_us", "bwd_us"]),
    "bench_guard": ("summary", ["kernel", "backend"], ["crossover_infer", "crossover_train"]),
    "bench_patch_bisect": ("rows", ["variant"], ["step_ms", "speedup", "mem_frac"]),
    "bench_compile": ("rows", ["variant"], ["step_ms", "vs_compile", "mem_vs_compile"]),
    "bench_bridge_overhead": ("rows", ["kernel", "measure", "shape"], ["triton_us", "pallas_us"]),
    "bench_flce": ("rows", ["case", "impl"], ["ms", "extra_mib"]),
    "diag_flce_grad_w": ("rows", ["impl", "vocab", "hidden", "rows", "chunks"], ["ms", "total_mib"]),
    "bench_host_overhead": ("rows", ["kernel", "measure"], ["us_per_call"]),
    "profile_step": ("rows", ["variant"], ["ms", "device_busy_ms", "host_self_ms"]),
    "bench_generate": ("rows", ["batch", "prompt", "variant"], ["tok_s", "speedup", "ttft_ms"]),
    "tune_triton": ("rows", ["kernel", "shape", "tile", "progs_per_sm", "warps"], ["fwd_us", "bwd_us"]),
    "bench_lora_curve": ("summary", [], ["gap_forge_eager", "gap_dropout_noise", "gap_rounding", "within"]),
    "bench_max_seq": ("rows", ["variant", "checkpointing"], ["max_len", "vs_eager", "reached_limit"]),
    "bench_fsdp": ("rows", ["case", "checkpointing", "variant"], ["step_ms", "speedup", "reserved_frac"]),
    "gemv_bw": ("rows", ["rows", "product"], ["cublas_frac", "triton_frac"]),
}
# the names results carried before they were named after their scripts (older JSON files)
RENAMED = {"bridge_overhead": "bench_bridge_overhead", "flce": "bench_flce", "flce_grad_w": "diag_flce_grad_w",
           "host_overhead": "bench_host_overhead", "first_call": "bench_first_call", "op_overhead": "bench_op_overhead"}
HISTORY_COLUMNS = ["date", "benchmark", "case", "device", "file", "command", "summary"]
_SAID: set[str] = set()  # smoke-test notes printed by this process


def smoke_test() -> str | None:
    """Why this run's numbers measure nothing (a CPU, or ``--quick``), else None."""
    if not torch.cuda.is_available():
        return ("SMOKE TEST, NOT A MEASUREMENT: no CUDA device, so forge's kernels ran in the Triton and "
                "Pallas interpreters on the CPU; these times and speed-ups only show that the benchmark "
                "runs (measure on a GPU)")
    if QUICK:
        return ("SMOKE TEST, NOT A MEASUREMENT: --quick runs tiny shapes a few times; these times and "
                "speed-ups only show that the benchmark runs (run it without --quick to measure)")
    return None


def say_smoke_test() -> None:
    """Print :func:`smoke_test`'s note (each table a run prints carries it once)."""
    note = smoke_test()
    if note:
        print(note)
        _SAID.add(note)


def script_name(default: str) -> str:
    """The running benchmark's file name without ``.py`` (a script under bench/, diagnostics
    included); ``default`` when no such script runs (a test calling :func:`write_results`)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main and BENCH in Path(main).resolve().parents:
        return Path(main).stem
    return RENAMED.get(default, default)


def save_figure(fig, title: str, path):
    """Title, lay out and write a matplotlib figure; returns ``path``."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """``--out DIR``, the folder a run writes its results into (created when missing)."""
    default = os.environ.get("FORGE_BENCH_OUT") or DEFAULT_OUT
    parser.add_argument("--out", type=Path, default=Path(default),
                        help=f"result folder (default: $FORGE_BENCH_OUT, else ./{DEFAULT_OUT}; "
                             "the project's recorded results: bench/results)")


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


def device_tag(name: str) -> str:
    """A short name for a device in file names: the chip's model word ("NVIDIA H200" -> h200,
    "NVIDIA H100 80GB HBM3" -> h100), else the name's last word."""
    words = [w for w in re.split(r"[\s_-]+", name.lower()) if w]
    return next((w for w in words if re.fullmatch(r"[a-z]{1,2}\d{2,4}[a-z]?", w)), words[-1] if words else "")


def _device_tag() -> str:
    return "cpu" if not torch.cuda.is_available() else device_tag(torch.cuda.get_device_name())


def write_results(out: Path, bench: str, rows: list[dict], extra: dict | None = None,
                  case: str = "", history: bool = True) -> tuple[Path, Path]:
    """``<out>/<script>[-<case>]-<device>.{json,csv}`` (overwritten by the next run of that case),
    plus one row appended to ``<out>/history.csv`` (not for a partial write: ``history=False``).
    ``<script>`` is the running benchmark's file name without ``.py``, whatever ``bench`` says
    (:func:`script_name`), so every result is named after the script that wrote it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    bench = script_name(bench)
    base = "-".join(x for x in (bench, case, _device_tag()) if x)
    meta = {"environment": environment(), "benchmark": bench, "case": case, **(extra or {}), "rows": rows}
    note = smoke_test()
    if note:
        meta["smoke_test"] = note
        if note not in _SAID:  # a script that prints no table of ours still says it once
            say_smoke_test()
    jpath = out / (base + ".json")
    jpath.write_text(json.dumps(meta, indent=2, default=str))
    cpath = out / (base + ".csv")
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    with cpath.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    if history:
        append_history(out, history_row(meta, jpath.stem))
    return jpath, cpath


def history_row(meta: dict, file: str) -> dict:
    """One run's line of history.csv: when, what, and its main numbers in one text cell."""
    env = meta.get("environment", {})
    bench = meta.get("benchmark", "")
    bench = RENAMED.get(bench, bench)
    key, labels, values = SUMMARY.get(bench, ("rows", [], []))
    parts = []
    held = meta.get(key) or []
    for r in [held] if isinstance(held, dict) else held:  # (a dict: the run's one summary row)
        # a column the row has but left None is a result (bench_guard: no crossover), one it
        # lacks is not (a backend that did not run)
        vals = [f"{c}={r[c]:.4g}" if isinstance(r[c], float) else f"{c}={r[c]}" for c in values if c in r]
        if vals:
            label = " ".join(str(r[c]) for c in labels if r.get(c) is not None)
            parts.append((label + ": " if label else "") + " ".join(vals))
    dev = env.get("device", "")
    return {"date": env.get("date", ""), "benchmark": bench, "case": meta.get("case", ""),
            "device": "cpu" if dev == "cpu" else device_tag(dev),
            "file": file, "command": env.get("command", ""), "summary": "; ".join(parts)}


def append_history(out: Path, row: dict) -> Path:
    path = Path(out) / "history.csv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=HISTORY_COLUMNS)
        if new:
            w.writeheader()
        w.writerow(row)
    return path


def print_table(rows: list[dict], cols: list[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return "" if v is None else str(v)

    say_smoke_test()
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

        # disable=None: bars only where stderr is a terminal, so output sent to a file holds
        # the tables alone
        return tqdm(it, desc=desc, file=sys.stderr, leave=False, disable=None)
    except ImportError:
        return it
