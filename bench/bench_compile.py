"""forge under torch.compile against torch.compile alone, timed side by side: each variant is
its own copy of the model (same weights), patched and compiled once, then every variant runs in
each of --rounds rotations, so this host's drift (tens of percent over minutes) falls on all of
them alike. The ratio that counts is each variant's median over rounds of its step time divided
by torch.compile's in the same round (``vs_compile``).

    python bench/bench_compile.py --mode train --batch 8 --seq-len 2048 \
        [--variants eager,compile,forge+compile,forge-recompute+compile,forge-all+compile]
    python bench/bench_compile.py --quick        # tiny CPU smoke test (aot_eager)

Variants: ``eager`` (unpatched), ``compile`` (torch.compile of the unpatched model), ``forge``
(patched, eager), ``forge-graphs`` (patched with graphs=True), and
``forge[-recompute][-min0][-all|-glu|-norm|-normglu]+compile``: forge.patch (``-recompute``:
recompute_mlp=True; ``-min0``: min_elements=0, no call below the guard's threshold runs unfused;
``-all``: compile_kernels="all"; ``-glu`` / ``-norm`` / ``-normglu``: only the GLU / RMSNorm / both kept
forge's in the trace; ``-noqkv``: without the q/k/v fusion (``kernels=`` every key but ``qkv``);
``-t16``: the Triton fused loss's vocabulary tiles at 1/16 of the fp32
logits, its width before they grew to 3/32 (the op is opaque to the trace: the same compiled
graph runs, only the loss's tile count differs)), then
torch.compile (default mode; a variant ending in ``-ro``, such as ``compile-ro``:
mode="reduce-overhead", CUDA graphs over the compiled step). Peak memory is the variant's own: its model's parameters plus
the most its step allocated above what every copy holds at rest, plus the whole of its graph
pool with ``graphs=True``; for a ``-ro`` variant, the most bytes alive at once while inductor
recorded its CUDA graphs (its first steps), which is what each replay holds at its peak (a replay
allocates nothing; free space left between the pool's blocks is not counted, as the allocator's
cache is not in the other variants: ``diag_step_memory.py`` gives both, a variant per process). Each round also runs the same number of steps back to back, with one
sync after the last (``b2b_ms``, per step, and ``b2b_vs_compile``): a training loop that reads
nothing back between steps (HF's Trainer between its logging steps) lets the host run ahead into
the next step while the device finishes the last one, so a step whose device work outlasts its
host time is timed by its device work there, where the synced step (``step_ms``) also counts the
host's wait at each step's start. Writes
bench_compile-<model>-<mode>-<B>x<S>-<backend>[-cudagraphs]-<device>.{json,csv} into --out
(``-cudagraphs`` when a variant uses CUDA graphs: ``-ro`` or ``forge-graphs``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import _common as bc  # noqa: E402
import forge  # noqa: E402
from bench_patch_bisect import _step_fn  # noqa: E402
from forge.patching.graphs import graph_pool_bytes  # noqa: E402
from presets import PRESETS, add_step_arguments, build  # noqa: E402

COLUMNS = ["variant", "step_ms", "vs_compile", "b2b_ms", "b2b_vs_compile", "speedup", "peak_MiB", "mem_vs_compile",
           "compile_s", "graph_breaks", "note"]
DEFAULT = "eager,compile,forge,forge+compile,forge-recompute+compile,forge-all+compile"


# variant parts naming which of the deferrable kernels stay forge's under torch.compile
_KEEP = {"glu": ("swiglu", "geglu"), "norm": ("rmsnorm",), "normglu": ("rmsnorm", "swiglu", "geglu")}


def _patch_kw(name: str) -> dict | None:
    """forge.patch keywords of a variant (None: not patched)."""
    base = name.removesuffix("+compile-ro").removesuffix("+compile")
    if base in ("eager", "compile", "compile-ro"):
        return None
    if not base.startswith("forge"):
        raise SystemExit(f"unknown variant {name!r}")
    kw = {}
    for part in base.split("-")[1:]:
        if part == "recompute":
            kw["recompute_mlp"] = True
        elif part == "all":
            kw["compile_kernels"] = "all"
        elif part == "min0":  # every patched call fused, whatever its size (min_elements=0)
            kw["min_elements"] = 0
        elif part in _KEEP:  # these kernels stay forge's in the trace, the others go to inductor
            kw["compile_kernels"] = list(_KEEP[part])
        elif part == "graphs":
            kw["graphs"] = True
        elif part == "noqkv":  # every patch key but the q/k/v fusion
            from forge.patching.core import PATCH_KEYS

            kw["kernels"] = [k for k in PATCH_KEYS if k != "qkv"]
        elif part in _LOSS_FRACTION:  # not a patch keyword: set around each step (_loss_tiles)
            pass
        else:
            raise SystemExit(f"unknown variant part {part!r} in {name!r}")
    return kw


_LOSS_FRACTION = {"t16": 1 / 16}  # variant part -> the Triton loss's LOGITS_FRACTION


def _loss_tiles(name: str, step):
    """``step``, run with the Triton fused loss's tile fraction a ``-t16``-like part names (the
    module global is read per call, so it is set and restored around each step)."""
    parts = [p for p in name.removesuffix("+compile-ro").removesuffix("+compile").split("-")
             if p in _LOSS_FRACTION]
    if not parts:
        return step
    from forge_triton import fused_linear_ce as flce

    frac = _LOSS_FRACTION[parts[-1]]

    def run():
        old, flce.LOGITS_FRACTION = flce.LOGITS_FRACTION, frac
        try:
            return step()
        finally:
            flce.LOGITS_FRACTION = old
    return run


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_arguments(p)
    p.add_argument("--backend", default="triton", choices=["triton", "pallas"])
    p.add_argument("--variants", default=DEFAULT)
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cold", action="store_true",
                   help="every compile without inductor's caches (force_disable_caches: compile_s like for like; "
                        "otherwise later variants find what earlier ones cached)")
    p.add_argument("--quick", action="store_true", help="tiny preset on the CPU (aot_eager)")
    bc.add_out_argument(p)
    a = p.parse_args(argv)
    if a.quick:
        a.model, a.batch, a.seq_len, a.steps, a.warmup, a.rounds = "tiny", 1, 16, 1, 1, 2
    cuda = torch.cuda.is_available() and not a.quick
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if a.cold:
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True
    names = a.variants.split(",")
    if "compile" not in names:  # (the -ro variants' ratios are to it too)
        raise SystemExit("--variants must include 'compile' (the ratios are to it)")
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, PRESETS[a.model]["vocab_size"], (a.batch, a.seq_len), generator=g).to(dev)

    runs = {}
    for name in names:  # build, patch, compile (the first call) each variant's own copy
        torch.manual_seed(0)
        model = build(a.model, dtype, dev, layers=a.layers)
        model.train(a.mode == "train")
        if a.mode == "train":
            model.requires_grad_(True)
        kw = _patch_kw(name)
        if kw is not None:
            forge.patch(model, mode=a.mode, backend=a.backend, **kw)
        target, row, recorded = model, {"variant": name}, None
        if cuda and name.endswith("-ro"):  # its peak is taken over its first steps (below)
            torch.cuda.synchronize()
            rest0 = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if "+compile" in name or name.startswith("compile"):
            torch._dynamo.utils.counters.clear()
            ro = name.endswith("-ro") and cuda
            target = torch.compile(model, backend="inductor" if cuda else "aot_eager",
                                   mode="reduce-overhead" if ro else None)
            t0 = time.perf_counter()
            _loss_tiles(name, _step_fn(target, a.mode, ids))()
            bc.sync()
            row["compile_s"] = time.perf_counter() - t0
            row["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
            # dynamo's cache is shared: a variant whose trace equals an earlier one's (the same
            # code under the same guards) runs that compiled graph and compiles nothing
            row["reused"] = not torch._dynamo.utils.counters["stats"]["unique_graphs"]
        step = _loss_tiles(name, _step_fn(target, a.mode, ids))
        for _ in range(a.warmup):
            step()
        bc.sync()
        if cuda and name.endswith("-ro"):
            # the most bytes alive at once while its CUDA graphs were recorded: a replay writes
            # the same addresses with the same lifetimes and allocates nothing, so the steady
            # steps' peak below misses them (the pool's free space between blocks, like the
            # allocator's cache in every other variant, is not counted)
            recorded = torch.cuda.max_memory_allocated() - rest0 + _param_bytes(model)
        runs[name] = (model, step, row, [], [] if recorded is None else [recorded], [])
        print(f"ready: {name} {row.get('compile_s', 0):.1f} s compile", flush=True)

    for _ in bc.progress(range(a.rounds), "rounds"):
        for name, (model, step, row, per_round, peaks, b2b) in runs.items():
            step()  # one untimed step: this copy's buffers back in the allocator's hands
            bc.sync()
            if cuda:
                torch.cuda.empty_cache()
                rest = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            ts = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                step()
                bc.sync()
                ts.append((time.perf_counter() - t0) * 1e3)
            per_round.append(statistics.median(ts))
            if cuda:
                # forge's graphs replay in their own pool (all of it this copy's, none of it in
                # memory_allocated's peak above rest)
                peaks.append(torch.cuda.max_memory_allocated() - rest + _param_bytes(model)
                             + graph_pool_bytes(model, whole=True))
            t0 = time.perf_counter()  # the same steps back to back: one sync, after the last
            for _ in range(a.steps):
                step()
            bc.sync()
            b2b.append((time.perf_counter() - t0) * 1e3 / a.steps)

    ref, ref_b2b = runs["compile"][3], runs["compile"][5]
    rows = []
    for name, (model, _step, row, per_round, peaks, b2b) in runs.items():
        row["step_ms"] = statistics.median(per_round)
        ratios = [c / x for x, c in zip(per_round, ref)]
        row["vs_compile"] = statistics.median(ratios)  # > 1: faster than torch.compile
        row["b2b_ms"] = statistics.median(b2b)
        row["b2b_vs_compile"] = statistics.median(c / x for x, c in zip(b2b, ref_b2b))
        row["note"] = ("ran an earlier variant's compiled graph (identical trace); " if row.pop("reused", False)
                       else "") + (f"round medians {min(per_round):.1f}-{max(per_round):.1f} ms; per-round speed vs compile "
                       f"{min(ratios):.3f}-{max(ratios):.3f}")
        if peaks:
            row["peak_MiB"] = max(peaks) / 2**20
        rows.append(row)
    first = rows[0]
    comp = next(r for r in rows if r["variant"] == "compile")
    for r in rows:
        r["speedup"] = first["step_ms"] / r["step_ms"]
        if r.get("peak_MiB") and comp.get("peak_MiB"):
            r["mem_vs_compile"] = r["peak_MiB"] / comp["peak_MiB"]
    title = f"{a.model} {a.mode} {a.batch}x{a.seq_len} ({a.backend}): forge and torch.compile, paired rounds"
    print(title)
    bc.print_table(rows, COLUMNS)
    jpath, cpath = bc.write_results(a.out, "bench_compile", rows, {"args": vars(a), "title": title},
                                    case=f"{a.model}-{a.mode}-{a.batch}x{a.seq_len}-{a.backend}"
                                    + ("-cudagraphs" if any("-ro" in n or "graphs" in n for n in names) else ""))
    print(f"wrote {jpath}\n      {cpath}")
    return rows


if __name__ == "__main__":
    main()
