"""The longest sequence one GPU trains: batch 1, peft LoRA (or a full fine-tune with --full),
eager against forge, with and without transformers' gradient checkpointing. Each variant steps
the length up (doubling from --start) until a training step runs out of memory, then bisects
between the last length that fit and the first that did not, to --granularity tokens.

    python bench/bench_max_seq.py --model llama3-8b [--lora R,ALPHA,DROPOUT] [--backend triton]
                                  [--checkpointing both|on|off] [--limit 262144] [--upto-ratio 4]
                                  [--recompute-mlp | --recompute-only] [--quick]

A length at --limit (or at --upto-ratio times eager's, which forge then probes first) is reported
as reached, not as the maximum. On a CPU (--quick) nothing
runs out of memory: the search only shows that every step runs.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import _common as bc  # noqa: E402
import forge  # noqa: E402
from bench_patch_bisect import _lora  # noqa: E402
from presets import PRESETS, build  # noqa: E402

COLUMNS = ["variant", "checkpointing", "max_len", "vs_eager", "reached_limit", "limit", "step_ms_at_max",
           "peak_MiB_at_max", "probes"]


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _step(model, length, device):
    """One training step at batch 1 x ``length``: its time (ms) and peak allocated MiB, or None
    when it ran out of memory."""
    ids = torch.randint(0, model.config.vocab_size, (1, length), device=device)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        bc.sync()
    except torch.OutOfMemoryError:
        return None
    finally:
        for p in model.parameters():
            p.grad = None
        del ids
        _free()
    ms = (time.perf_counter() - t0) * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    return ms, peak


def longest(model, a, device, limit=None, cap_first=False):
    """(longest length that trained, (ms, MiB) of its step, whether ``limit`` (default --limit)
    was reached, probes). ``cap_first``: probe ``limit`` itself first (one step answers a bar's
    question when it fits; the doubling search follows when it does not)."""
    limit = limit or a.limit
    ok, ok_stats, bad, probes = 0, None, None, 0
    if cap_first:
        probes += 1
        r = _step(model, limit, device)
        if r is not None:
            return limit, r, True, probes
    n = a.start
    while n <= limit:  # doubling until a step fails
        probes += 1
        r = _step(model, n, device)
        if r is None:
            bad = n
            break
        ok, ok_stats = n, r
        if n == limit:
            break
        n = min(2 * n, limit)
    if bad is None:
        return ok, ok_stats, True, probes
    lo, hi = ok, bad
    while hi - lo > a.granularity:  # bisect between the last fit and the first failure
        mid = (lo + hi) // 2 // a.granularity * a.granularity
        if mid <= lo:
            break
        probes += 1
        r = _step(model, mid, device)
        if r is None:
            hi = mid
        else:
            lo, ok_stats = mid, r
    return lo, ok_stats, False, probes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--lora", default="16,32,0.05", help="peft LoRA R,ALPHA,DROPOUT[,MODULE...] (default: all seven "
                    "projections); ignored with --full")
    ap.add_argument("--full", action="store_true", help="a full fine-tune instead of LoRA")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--checkpointing", default="both", choices=["both", "on", "off"])
    ap.add_argument("--start", type=int, default=4096)
    ap.add_argument("--limit", type=int, default=262144)
    ap.add_argument("--granularity", type=int, default=1024)
    ap.add_argument("--upto-ratio", type=float, default=None, metavar="R",
                    help="search forge only up to R x eager's length (a bar's question, answered with fewer "
                         "of the longest, slowest probes); reached_limit then means at least R x")
    ap.add_argument("--recompute-mlp", action="store_true",
                    help="also forge.patch(recompute_mlp=True): the gated MLP (or the fused LoRA MLP) keeps only "
                         "its input for the backward, two products more per layer")
    ap.add_argument("--recompute-only", action="store_true",
                    help="forge with recompute_mlp only (not plain forge.patch too)")
    ap.add_argument("--quick", action="store_true", help="tiny preset on the CPU: a smoke test")
    bc.add_out_argument(ap)
    a = ap.parse_args(argv)
    if a.quick:
        a.model, a.start, a.limit, a.granularity = "tiny", 16, 32, 8
    bc.say_smoke_test()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build(a.model, dtype, device)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, a.limit)
    if not a.full:
        model = _lora(model, a.lora)
    settings = {"both": [False, True], "on": [True], "off": [False]}[a.checkpointing]
    rows, eager_len = [], {}
    for ckpt in settings:
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if not a.full:
                model.enable_input_require_grads()
        else:
            model.gradient_checkpointing_disable()
        model.train()
        variants = ["eager"] + ([] if a.recompute_only else [f"forge {a.backend}"]) + (
            [f"forge {a.backend} recompute_mlp"] if a.recompute_mlp or a.recompute_only else [])
        for variant in variants:
            if variant != "eager":
                forge.patch(model, backend=a.backend, recompute_mlp=variant.endswith("recompute_mlp"))
            cap = None
            if variant != "eager" and a.upto_ratio and eager_len.get(ckpt):
                cap = min(a.limit, max(a.start, int(a.upto_ratio * eager_len[ckpt]) // a.granularity * a.granularity))
            n, stats, reached, probes = longest(model, a, device, cap, cap_first=cap is not None)
            if variant != "eager":
                forge.unpatch(model)
            _free()
            if variant == "eager":
                eager_len[ckpt] = n
            rows.append({"variant": variant, "checkpointing": "on" if ckpt else "off", "max_len": n,
                         "vs_eager": n / eager_len[ckpt] if eager_len.get(ckpt) else None,
                         "reached_limit": reached, "limit": cap or a.limit,
                         "step_ms_at_max": stats[0] if stats else None,
                         "peak_MiB_at_max": stats[1] if stats else None, "probes": probes})
            print(f"{variant:16s} checkpointing {rows[-1]['checkpointing']:3s}: {n} tokens"
                  f"{' (the limit)' if reached else ''}", flush=True)
    what = "full fine-tune" if a.full else f"LoRA {a.lora}"
    print(f"{a.model}, {what}, batch 1: the longest sequence a training step fits")
    bc.print_table(rows, COLUMNS)
    case = f"{a.model}-{'full' if a.full else 'lora'}-{a.backend}-ckpt-{a.checkpointing}"
    bc.write_results(a.out, "bench_max_seq", rows, extra={"args": {k: str(v) for k, v in vars(a).items()}}, case=case)


if __name__ == "__main__":
    main()
