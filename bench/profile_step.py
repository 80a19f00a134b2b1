"""Where a whole-model step's time goes: host (CPU) against device (GPU), per variant.

For each variant (eager, forge with all kernels, forge with one kernel) in one process: the
median wall time of a step, then one step under torch.profiler: the device's busy time (sum of
kernel durations; JAX's kernels included), the host's time in torch ops, and the top host ops
and device kernels, and (CUDA) the device's idle gaps charged to the host ops that launched the
work after them (``device_gaps``). A step whose wall time is well above its device time is
host-bound, and only less host work per call makes it faster.

    python bench/profile_step.py --mode train --batch 4 --seq-len 1024 \
        --variants eager,all,fused_linear_ce [--backend triton] [--min-elements 0] [--compile]

With ``--compile`` each variant's model (eager: unpatched; otherwise patched first) runs under
``torch.compile`` (default mode), compiled before it is timed; the table gives the compile time.

Writes profile_step-<model>-<mode>-<B>x<S>-<backend>[-compile][-cudagraphs]-<device>.{json,csv} into
--out (``-cudagraphs`` when a variant has ``~graphs``).
"""
from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as bc  # noqa: E402
import forge  # noqa: E402
from bench_patch_bisect import _lora, _step_fn, _time  # noqa: E402
from presets import PRESETS, add_step_arguments, build  # noqa: E402


_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "kernel2")
_ATTN = ("flash", "fmha", "attention", "sdpa")


def _kind(name: str) -> str:
    """A device kernel's kind, from its name: matrix products (cuBLAS/CUTLASS), attention,
    inductor's generated kernels (``triton_*``), other Triton kernels (forge's), the rest."""
    low = name.lower()
    if any(k in low for k in _ATTN):
        return "attention"
    if any(k in low for k in _GEMM):
        return "gemm"
    if low.startswith("triton_"):
        return "inductor"
    if low.startswith("_") or "pallas" in low:
        return "forge"
    return "other"


def _profile(step, top):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
        bc.sync()
    gaps = {}
    if torch.cuda.is_available():
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(f"{tmp}/trace.json")
            with open(f"{tmp}/trace.json") as f:
                gaps = device_gaps(json.load(f), top=top)
    from torch.autograd import DeviceType

    avg = prof.key_averages()
    # kernels only: a CPU op's row also carries its kernels' time (counting both doubles it)
    dev = [(e.key, e.self_device_time_total / 1e3, e.count) for e in avg
           if e.device_type != DeviceType.CPU and e.self_device_time_total > 0]
    host = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in avg if e.device_type == DeviceType.CPU]
    dev.sort(key=lambda r: -r[1])
    host.sort(key=lambda r: -r[1])
    by_kind = {}
    for key, ms, _ in dev:
        by_kind[_kind(key)] = by_kind.get(_kind(key), 0.0) + ms
    return {
        "device_busy_ms": sum(r[1] for r in dev),
        "device_by_kind_ms": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "host_self_ms": sum(r[1] for r in host),
        "top_device": [list(r) for r in dev[:top]],
        "top_host": [list(r) for r in host[:top]],
        **gaps,
    }


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def device_gaps(trace: dict, min_us: float = 20.0, top: int = 8) -> dict:
    """Where the device waits, from a chrome trace of one profiled step: every gap of more than
    ``min_us`` between one device event's end (or the first host op's start) and the next device
    event's start, charged to the host ops
    that launched the event after it (the outermost two and the innermost of the ops enclosing
    its launch call). A gap whose next event was launched less than ``min_us`` before it started
    is the host's: the device had run out of queued work. Returns the idle total, the host's
    share, and the largest charges (ms, gaps)."""
    evs = trace.get("traceEvents", [])
    dev = sorted((e for e in evs if e.get("cat") in _DEVICE_CATS and "dur" in e), key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e for e in evs
              if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
    ops = sorted((e for e in evs if e.get("cat") == "cpu_op" and "dur" in e), key=lambda e: (e["ts"], -e["dur"]))
    starts = [e["ts"] for e in ops]

    def chain(ts):
        inside = [e for e in ops[:bisect.bisect_right(starts, ts)] if e["ts"] + e["dur"] >= ts]
        names = [e["name"] for e in inside]
        return " > ".join(names[:2] + (["..."] if len(names) > 3 else []) + names[2:][-1:]) or "?"

    idle = host = 0.0
    charged: dict = {}
    # the step's start counts as a device event's end: the wait for the first launch (dynamo's
    # guards, the graph's prologue) is a gap too
    end = ops[0]["ts"] if ops else (dev[0]["ts"] if dev else 0.0)
    for nxt in dev:
        gap, end = nxt["ts"] - end, max(end, nxt["ts"] + nxt["dur"])
        if gap <= min_us:
            continue
        idle += gap
        call = launch.get(nxt.get("args", {}).get("correlation"))
        late = call is not None and nxt["ts"] - call["ts"] < min_us + call.get("dur", 0)
        host += gap if late else 0.0
        key = "? (no launch recorded)" if call is None else chain(call["ts"]) + ("" if late else " (launched early)")
        ms, n = charged.get(key, (0.0, 0))
        charged[key] = (ms + gap / 1e3, n + 1)
    return {
        "device_idle_ms": round(idle / 1e3, 3),
        "device_idle_host_bound_ms": round(host / 1e3, 3),
        "idle_by_launcher": [[k, round(ms, 3), n] for k, (ms, n) in
                             sorted(charged.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def _frame(frames) -> str:
    """Where a block was allocated: the innermost Python frames outside torch's own packages
    (inductor's generated code and forge's modules count as outside), up to three of them."""
    keep = [f for f in frames if f.get("filename", "").endswith(".py")
            and ("/torch/" not in f["filename"] or "torchinductor" in f["filename"])]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in keep[:3]) or "?"


def _memory(step, top):
    """One step under torch's allocator history: the step's peak above what was allocated
    before it, and the blocks alive at that peak, by size and by allocating frame."""
    bc.sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    try:
        step()
        bc.sync()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    alive, total, peak, at_peak = {}, 0, 0, {}
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            alive[ev["addr"]] = (ev["size"], _frame(ev.get("frames", [])))
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, dict(alive)
        elif ev["action"] == "free_completed" and ev["addr"] in alive:
            total -= alive.pop(ev["addr"])[0]
    by_size, by_frame = {}, {}
    for size, where in at_peak.values():
        n, b = by_size.get(size, (0, 0))
        by_size[size] = (n + 1, b + size)
        n, b = by_frame.get(where, (0, 0))
        by_frame[where] = (n + 1, b + size)
    mib = 2**20
    return {
        "mem_base_MiB": round(base / mib, 1),
        "mem_step_peak_MiB": round(peak / mib, 1),
        "mem_at_peak_by_size": [[round(s / mib, 2), n, round(b / mib, 1)]
                                for s, (n, b) in sorted(by_size.items(), key=lambda kv: -kv[1][1])[:top]],
        "mem_at_peak_by_frame": [[w, n, round(b / mib, 1)]
                                 for w, (n, b) in sorted(by_frame.items(), key=lambda kv: -kv[1][1])[:top]],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(p)
    p.add_argument("--variants", default="eager,all",
                   help="eager, all, or kernel keys; with --compile a variant may end in @<compile_kernels> "
                        "(all@all: every kernel forge's op in the trace; all@rmsnorm+rope); a patched "
                        "variant may add ~graphs (graphs=True) and ~recompute (recompute_mlp=True): all~graphs")
    p.add_argument("--backend", default="triton")
    p.add_argument("--min-elements", type=int, default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--compile", action="store_true", help="torch.compile each variant's model (patched first)")
    p.add_argument("--memory", action="store_true",
                   help="also one step under the allocator's history (CUDA): the step's peak and what is alive at it")
    p.add_argument("--lora", nargs="?", const="16,32,0.05", default=None, metavar="R,ALPHA,DROPOUT[,MODULE...]",
                   help="peft LoRA, as bench_patch_bisect.py's --lora")
    p.add_argument("--quick", action="store_true", help="tiny preset on the CPU")
    p.add_argument("--experts-impl", default="grouped_mm",
                   help="a mixture of experts' implementation in transformers for the unpatched model")
    bc.add_out_argument(p)
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() and not a.quick else "cpu"
    name = "tiny" if a.quick else a.model
    model = build(name, torch.bfloat16 if dev == "cuda" else torch.float32, dev, layers=None if a.quick else a.layers)
    if hasattr(model, "set_experts_implementation") and (getattr(model.config, "num_experts", None)
                                                           or getattr(model.config, "num_local_experts", None)):
        model.set_experts_implementation(a.experts_impl)
    if a.lora:
        model = _lora(model, a.lora)
    model.train(a.mode == "train")
    vocab = model.config.vocab_size
    b, s = (1, 16) if a.quick else (a.batch, a.seq_len)
    ids = torch.randint(0, vocab, (b, s), device=dev)
    rows = []
    for v in a.variants.split(","):
        which, *opts = v.split("~")
        which, _, ck = which.partition("@")
        if which != "eager":
            kw = {} if which == "all" else {"kernels": [which]}
            for o in opts:
                if o not in ("graphs", "recompute"):
                    raise SystemExit(f"unknown variant option ~{o} in {v!r}")
                kw["graphs" if o == "graphs" else "recompute_mlp"] = True
            if ck:
                kw["compile_kernels"] = ck if ck in ("all", "auto") else ck.split("+")
            forge.patch(model, mode=a.mode, backend=a.backend, min_elements=a.min_elements, **kw)
        target, compile_s = model, None
        if a.compile:
            torch._dynamo.reset()
            target = torch.compile(model)
            t0 = time.perf_counter()
            _step_fn(target, a.mode, ids)()
            bc.sync()
            compile_s = time.perf_counter() - t0
        step = _step_fn(target, a.mode, ids)
        ms = statistics.median(_time(step, 2 if a.quick else a.steps, 1 if a.quick else 3))
        row = {"variant": v + (" + compile" if a.compile else ""), "ms": ms, "compile_s": compile_s,
               **_profile(step, a.top)}
        if a.memory and dev == "cuda":
            row.update(_memory(step, a.top))
        if which != "eager":
            row["guard"] = model._forge_guard_stats.as_dict()
            if dev == "cuda" and "graphs" in opts:  # replays allocate nothing: the pool holds the activations
                from forge.patching.graphs import graph_pool_bytes

                row["graph_pool_MiB"] = round(graph_pool_bytes(model, whole=True) / 2**20, 1)
                row["graphs"] = repr(model._forge_graphs.stats)
            forge.unpatch(model)
        rows.append(row)
        print(f"== {row['variant']}: {ms:.1f} ms/step wall, device busy {row['device_busy_ms']:.1f} ms, "
              f"host self {row['host_self_ms']:.1f} ms (under the profiler)")
        print("   device by kind:", row["device_by_kind_ms"])
        print("   top device:", "; ".join(f"{k[:60]} {t:.2f} ms x{c}" for k, t, c in row["top_device"]))
        print("   top host:  ", "; ".join(f"{k[:40]} {t:.2f} ms x{c}" for k, t, c in row["top_host"]))
        if "device_idle_ms" in row:
            print(f"   device idle {row['device_idle_ms']} ms in gaps, {row['device_idle_host_bound_ms']} ms of it "
                  "waiting for the host; by the ops that launched the work after each gap (ms, gaps):")
            for k, ms, n in row["idle_by_launcher"]:
                print(f"     {ms:8.3f} ms {n:5d} x {k[:160]}")
        if "graph_pool_MiB" in row:
            print(f"   graph pool {row['graph_pool_MiB']} MiB; {row['graphs']}")
        if "mem_step_peak_MiB" in row:
            print(f"   memory: {row['mem_base_MiB']} MiB before the step, its peak {row['mem_step_peak_MiB']} MiB above;"
                  " alive at the peak, by block size (MiB, count, MiB):", row["mem_at_peak_by_size"])
            for w, n, mb in row["mem_at_peak_by_frame"]:
                print(f"     {mb:9.1f} MiB {n:5d} x {w}")
    cols = ["variant", "ms", "device_busy_ms", "host_self_ms"] + (["compile_s"] if a.compile else [])
    bc.print_table([{k: r[k] for k in cols} for r in rows], cols)
    bc.write_results(a.out, "profile_step", rows, {"args": vars(a)},
                     case=f"{name}-{a.mode}-{b}x{s}{'-lora' if a.lora else ''}-{a.backend}{'-compile' if a.compile else ''}"
                          f"{'-cudagraphs' if '~graphs' in a.variants else ''}")


if __name__ == "__main__":
    main()
