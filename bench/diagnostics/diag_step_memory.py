"""One variant's training-step memory, alone in its process: the allocator's peak of live bytes
and of reserved bytes, and for a ``-ro`` variant (mode="reduce-overhead") how inductor's CUDA
graph pool is used: its reserved segments against the most bytes alive in it while the graphs
were recorded (a replay allocates nothing, so the recording step is where its peak shows).

    python bench/diagnostics/diag_step_memory.py --variant forge+compile-ro [--batch 4 --seq-len 1024]
        [--history snapshot.pickle.gz]   # the first steps' allocation history, and what is alive at its peak

Variants as in bench_compile.py. Prints one JSON line (the first steps' peaks, the steady steps'
peaks, the pool, inductor's cudagraph counters); nothing is timed here (bench_compile.py times the
variants side by side).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import forge  # noqa: E402
from bench_compile import _param_bytes, _patch_kw  # noqa: E402
from bench_patch_bisect import _step_fn  # noqa: E402
from presets import PRESETS, add_step_arguments, build  # noqa: E402

MiB = 2**20


def _pool_segments():
    """The segments of the CUDA graph pool that ``mode="reduce-overhead"`` (inductor's CUDA graph
    trees) records into on this device: one per device and thread, shared by every compiled
    function that uses the mode."""
    from torch._inductor import cudagraph_trees

    mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if mgr is None:
        return []
    pool = tuple(mgr.cuda_graphs_thread_pool)
    return [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) == pool]


def _live_at_peak(snapshot, top: int = 20):
    """Replays the recorded allocation history: the most bytes alive at once (of those allocated
    while recording), and the largest blocks alive then, each with the frames that made it."""
    live, total, best, at = {}, 0, 0, {}
    for ev in snapshot["device_traces"][torch.cuda.current_device()]:
        act, addr = ev["action"], ev["addr"]
        if act == "alloc":
            live[addr] = ev
            total += ev["size"]
            if total > best:
                best, at = total, dict(live)
        elif act == "free_completed" and addr in live:
            total -= live.pop(addr)["size"]

    def where(ev):
        fr = [f for f in ev.get("frames", []) if "/torch/" not in f["filename"]
              or "_inductor" in f["filename"]][:3]
        return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in fr)
    blocks = sorted(at.values(), key=lambda e: -e["size"])[:top]
    return {"most_alive_MiB": best / MiB, "blocks_alive_then": len(at),
            "largest_then": [(round(e["size"] / MiB, 1), where(e)) for e in blocks]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_arguments(p)
    p.add_argument("--variant", required=True)
    p.add_argument("--backend", default="triton", choices=["triton", "pallas"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--history", default=None, help="record the first steps' allocation history, print what is alive at its peak, write it here (gzip)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    name, dev = a.variant, torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, PRESETS[a.model]["vocab_size"], (a.batch, a.seq_len), generator=g).to(dev)
    torch.manual_seed(0)
    model = build(a.model, torch.bfloat16, dev, layers=a.layers)
    model.train(a.mode == "train")
    model.requires_grad_(a.mode == "train")
    kw = _patch_kw(name)
    if kw is not None:
        forge.patch(model, mode=a.mode, backend=a.backend, **kw)
    target = model
    ro = name.endswith("-ro")
    if "compile" in name:
        target = torch.compile(model, mode="reduce-overhead" if ro else None)
    step = _step_fn(target, a.mode, ids)
    torch.cuda.synchronize()
    rest = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if a.history:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=400_000)
    for _ in range(3):  # compile + cudagraph trees' warm-up and recording runs
        step()
    torch.cuda.synchronize()
    peak_live = None
    if a.history:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak_live = _live_at_peak(snap)
        import gzip
        import pickle

        with gzip.open(a.history, "wb") as f:
            pickle.dump(snap, f)
    first = {"alloc_peak_MiB": (torch.cuda.max_memory_allocated() - rest + _param_bytes(model)) / MiB,
             "reserved_peak_MiB": torch.cuda.max_memory_reserved() / MiB}
    torch.cuda.empty_cache()
    rest = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    segs = _pool_segments()
    pool = sum(s["total_size"] for s in segs)
    steady = {"alloc_peak_MiB": (torch.cuda.max_memory_allocated() - rest + _param_bytes(model)) / MiB,
              "alloc_peak_plus_pool_MiB": (torch.cuda.max_memory_allocated() - rest + _param_bytes(model) + pool) / MiB,
              "reserved_peak_MiB": torch.cuda.max_memory_reserved() / MiB}
    blocks = sorted(((b["size"], b["state"]) for s in segs for b in s["blocks"]), reverse=True)
    summary = {
        "variant": name, "shape": f"{a.batch}x{a.seq_len}", "params_MiB": _param_bytes(model) / MiB,
        "first_steps": first, "steady": steady,
        "pool": {"segments": len(segs), "total_MiB": pool / MiB,
                 "allocated_at_rest_MiB": sum(s["allocated_size"] for s in segs) / MiB,
                 "largest_blocks_MiB": [(round(sz / MiB, 1), st) for sz, st in blocks[:16]],
                 "segment_sizes_MiB": sorted((round(s["total_size"] / MiB, 1) for s in segs), reverse=True)[:24]},
        "recorded_history": peak_live,
        "counters_inductor": {k: v for k, v in torch._dynamo.utils.counters["inductor"].items() if "cudagraph" in k},
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
