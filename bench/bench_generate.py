"""generate() end to end: eager, forge defaults, forge with graphs (decoding steps captured on a
static cache, forge.patching.decode) and transformers' static cache with its automatic
torch.compile, in one process on one model.

    python bench/bench_generate.py [--out DIR] [--batches 1,8,32] [--prompts 128,1024] [--new 256]
    python bench/bench_generate.py --quick      # tiny CPU smoke test
    # the device loop against forge's host loop at the Llama-3.1-8B shape (H200):
    python bench/bench_generate.py --model llama3-8b --batches 1,8,32 --prompts 128,2048 --new 256 \
        --variants "eager,forge graphs,forge graphs loop,static + compile"

Per (batch, prompt length) and variant: greedy generate() of --new tokens (min_new_tokens too,
so every run decodes them all) from random prompts. ``first_s`` is the variant's first call
(forge graphs: its captures; static + compile: its compilation; ``first_extra_s`` is what it took
beyond a timed call), ``ttft_ms`` the median time of
``TTFT_CALLS`` calls of generate(max_new_tokens=1), ``ms_token`` the wall time per decoding
step after the first token ((total_s - ttft) / (new - 1)), ``ttft_eager_ms`` that of an unpatched copy's
calls interleaved with them, plain generate (compare these two: the host's speed drifts between
variants), ``total_s`` the median of --reps timed full calls, ``tok_s`` =
batch x new / total_s and ``decode_tok_s`` = batch x (new - 1) / (total_s - ttft). ``peak_MiB``
is torch's peak allocated memory during the timed calls plus, with graphs, the graph pool's
bytes no live tensor holds (``pool_MiB``: torch's counter does not see what replays write there);
``reserved_MiB`` is the caching allocator's peak reservation over the same calls (what the
process holds from the device: a compiled run's CUDA-graph pools and any allocator fragmentation
count here, for every variant alike). Every variant starts with no cuBLAS workspace allocated (as in
a process of its own; see ``_teardown``).
``same_tokens`` is the fraction of sequences identical to eager's and ``agree_tokens`` the mean
number of new tokens before a sequence first differs from eager's (random bf16 weights give
near ties at many steps, so over 256 tokens most sequences part from eager's somewhere, for
transformers' compiled static cache too: not every difference is an error; tests/test_decode.py
holds the correctness rule).
Writes <out>/bench_generate-<model>-<gpu>-<stamp>.{json,csv,png}.
"""
from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as bc  # noqa: E402
import forge  # noqa: E402
from forge.patching.graphs import graph_pool_bytes  # noqa: E402
from presets import PRESETS, build, is_moe  # noqa: E402

TTFT_CALLS = 10  # generate(max_new_tokens=1) calls per case, median taken (tens of ms each; 3 left the
# median at batch 1 wandering by 10 ms between runs)
VARIANTS = ("eager", "forge", "forge graphs", "forge graphs loop", "static + compile")
# "forge graphs": generate()'s own loop around replayed steps (decode.device_loop off);
# "forge graphs loop": the same with the device loop on (forge/patching/decode_loop.py)
# diagnostic, by --variants only: forge graphs with SDPA in the decoding steps in place of the
# backend's decoding attention kernel (what the kernel is worth, side by side)
EXTRA_VARIANTS = ("forge graphs sdpa", "forge pallas graphs", "forge graphs apart", "forge graphs loop index_copy",
                  "forge pallas graphs index_copy", "forge graphs loop cublas", "forge pallas graphs cublas",
                  "forge graphs loop nosums", "forge pallas graphs nosums",
                  "forge graphs loop glu", "forge pallas graphs glu", "forge graphs loop nosums glu")
# (the second: the Pallas backend, min_elements=0; the third: forge graphs loop with q/k/v and
# gate/up weights each in their own memory, forge.patching.stacking.STACK_INFER off; then Triton
# and Pallas writing the cache with transformers' index_copy_ calls, forge.patching.decode.KV_APPEND
# off (on by default: the backend's kv_append); then the two with batch 1's one-row products by
# cuBLAS, decode.ROW_LINEAR off (on by default: the backend's row_linear); then the two with the
# residual additions after o and down done apart, decode.ROW_SUMS off (on by default: those products
# write the sums); then with the MLPs' gate/up products and activations in one launch, decode.ROW_GLU
# on, with and without the sums. A
# variant name ending in a key of SWITCHES sets that switch for the variant before it)
SWITCHES = {" index_copy": ("KV_APPEND", False), " cublas": ("ROW_LINEAR", False), " nosums": ("ROW_SUMS", False),
            " glu": ("ROW_GLU", True)}
COLUMNS = ["batch", "prompt", "variant", "tok_s", "speedup", "decode_tok_s", "ms_token", "ttft_ms", "ttft_eager_ms", "total_s",
           "first_s", "first_extra_s", "peak_MiB", "pool_MiB", "reserved_MiB", "same_tokens", "agree_tokens", "note"]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def _forget_compiled(model):
    # transformers keeps its compiled forward, and the longest static cache so far (later caches
    # are never shorter), on the model: each case compiles, and sizes its cache, afresh
    for name in ("_compiled_call", "_previous_max_cache_length"):
        model.__dict__.pop(name, None)
    torch._dynamo.reset()


def _setup(model, variant, quick):
    """Patch (or not) for the variant; returns generate's extra keywords."""
    _forget_compiled(model)
    kernels = ["fused_linear_ce"] if quick else None  # --quick: no interpreted kernels (seconds, not minutes)
    if variant == "forge":
        forge.patch(model, mode="infer", backend="triton", kernels=kernels)
    elif variant.endswith(tuple(SWITCHES)):
        from forge.patching import decode

        suffix = next(s for s in SWITCHES if variant.endswith(s))
        name, value = SWITCHES[suffix]
        was = getattr(decode, name)
        setattr(decode, name, value)  # read at patch time only
        try:
            return _setup(model, variant.removesuffix(suffix), quick)
        finally:
            setattr(decode, name, was)
    elif variant == "forge pallas graphs":
        forge.patch(model, mode="infer", backend="pallas", kernels=kernels, graphs=True, min_elements=0)
    elif variant == "forge graphs apart":
        from forge.patching import stacking

        was, stacking.STACK_INFER = stacking.STACK_INFER, False  # read at patch time only
        try:
            forge.patch(model, mode="infer", backend="triton", kernels=kernels, graphs=True)
        finally:
            stacking.STACK_INFER = was
    elif variant in ("forge graphs", "forge graphs sdpa", "forge graphs loop"):
        forge.patch(model, mode="infer", backend="triton", kernels=kernels, graphs=True)
        model._forge_graphs.decode.device_loop = variant == "forge graphs loop"
        if variant == "forge graphs sdpa":
            model._forge_graphs.decode.attention = None  # (read when a cache is made: none is yet)
    return {"cache_implementation": "static"} if variant == "static + compile" else {}


def _teardown(model):
    forge.unpatch(model)
    _forget_compiled(model)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        # torch keeps a cuBLAS workspace per stream for the life of the process (33 MiB on the
        # H200); one a variant used would otherwise count in the peak of every later one (eager's
        # peak at batch 1, prompt 1024 read 33 MiB higher after a forge graphs case than as the
        # first case). Every variant starts with none, as in a process of its own. (Only with no
        # CUDA graph alive: one captured over a workspace would be left pointing at freed memory.)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def _ttft(model, twin, ids, kw, twin_kw, calls):
    """(median ms of generate(max_new_tokens=1) on ``model``, the same for ``twin``, an unpatched
    copy, its calls interleaved with the model's; twin None: the model's own twice). This host's
    speed wanders by up to 2x over seconds (batch 1, prompt 128: eager's first token took 21 to
    47 ms within 15 consecutive calls), which a comparison of medians taken a minute apart does
    not survive."""
    one = lambda m, k: _timed(lambda: m.generate(ids, max_new_tokens=1, **k))[0]  # noqa: E731
    mine, eager = [], []
    for _ in range(calls):
        mine.append(one(model, kw))
        eager.append(one(twin, twin_kw) if twin is not None else mine[-1])
    return 1e3 * statistics.median(mine), 1e3 * statistics.median(eager)


# the unpatched twin (time to first token) is kept where the model's weights take at most this
# share of the device's memory: the twin joins them there for its calls (Qwen3-30B-A3B's 48
# layers, 61 GB, do not fit twice on an 80 GB card)
TWIN_SHARE = 0.45


def _cpu_twin(model):
    """An unpatched copy of ``model`` on the CPU, or None where it would not fit beside the model
    on the device (TWIN_SHARE). Its tensors are copied straight to the CPU: a deepcopy on the
    device first would hold a second copy of the weights there."""
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    dev = next(model.parameters()).device
    if dev.type == "cuda" and weights > TWIN_SHARE * torch.cuda.get_device_properties(dev).total_memory:
        print(f"no unpatched twin: the weights ({weights / 2**30:.1f} GiB) would not fit twice on the device; "
              "ttft_eager_ms is left empty")
        return None
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        c = t.detach().to("cpu", copy=True)
        memo[id(t)] = torch.nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else c
    return copy.deepcopy(model, memo)


def run_case(model, variant, ids, mask, new, reps, quick, want, pristine):
    """One variant at one (batch, prompt). ``pristine``: an unpatched copy of the model kept on
    the CPU, brought to the device only for the time-to-first-token calls, after the memory is
    read (its weights, and the cuBLAS workspace its calls take on the default stream, would
    count in the variant's peak); None: no eager first token beside the variant's."""
    row = {"batch": ids.shape[0], "prompt": ids.shape[1], "variant": variant}
    if variant == "static + compile" and not torch.cuda.is_available():
        row["note"] = "skipped: transformers compiles only on an accelerator"
        return row, None
    extra = _setup(model, variant, quick)
    plain = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    kw = {**plain, **extra}
    full = lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)  # noqa: E731
    try:
        row["first_s"], _ = _timed(full)
        _timed(full)  # forge graphs: the first call's steps warm up and capture; this one replays
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # (reserved: what the timed calls need, not an earlier case's cache)
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps):
            t, out = _timed(full)
            times.append(t)
        if torch.cuda.is_available():
            row["pool_MiB"] = graph_pool_bytes(model) / 2**20
            row["peak_MiB"] = torch.cuda.max_memory_allocated() / 2**20 + row["pool_MiB"]
            row["reserved_MiB"] = torch.cuda.max_memory_reserved() / 2**20
        twin = pristine.to(ids.device) if variant != "eager" and pristine is not None else None  # (moved in place)
        try:
            row["ttft_ms"], row["ttft_eager_ms"] = _ttft(model, twin, ids, kw, plain, 3 if quick else TTFT_CALLS)
            if twin is None and variant != "eager":
                row["ttft_eager_ms"] = None  # (no twin: _ttft's second figure is the model's own)
        finally:
            if twin is not None:
                twin.to("cpu")
        row["total_s"] = statistics.median(times)
        row["first_extra_s"] = max(row["first_s"] - row["total_s"], 0.0)  # compile / warm-up and capture
        b = ids.shape[0]
        row["tok_s"] = b * new / row["total_s"]
        decode_s = row["total_s"] - row["ttft_ms"] / 1e3
        row["decode_tok_s"] = b * (new - 1) / decode_s if decode_s > 0 else None  # (CPU noise)
        row["ms_token"] = 1e3 * decode_s / (new - 1) if decode_s > 0 and new > 1 else None  # wall time per decoding step
        if want is not None:
            row["same_tokens"] = (out == want).all(-1).float().mean().item()
            new_out, new_want = out[:, ids.shape[1]:], want[:, ids.shape[1]:]
            lead = (new_out == new_want).long().cumprod(-1).sum(-1)  # tokens before the first difference
            row["agree_tokens"] = lead.float().mean().item()
        g = getattr(model, "_forge_graphs", None)
        if g is not None:
            st = g.stats
            why = {k: v for k, v in st.why.items() if "generate" in k or "decoding" in k or "loop" in k}
            loop = g.decode.loop_calls if g.decode is not None else 0
            row["note"] = (f"decode replays {st.decode_replayed}, captures {st.decode_captures}, device-loop calls "
                           f"{loop}" + (f", uncaptured {why}" if why else ""))
        return row, out
    except Exception as e:  # noqa: BLE001 - report, do not hide
        row["note"] = f"failed: {type(e).__name__}: {e}"[:300]
        return row, None
    finally:
        _teardown(model)


def _plot(rows, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cases = sorted({(r["batch"], r["prompt"]) for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    shown = [v for v in VARIANTS + EXTRA_VARIANTS if any(r["variant"] == v for r in rows)]
    width = 0.8 / len(shown)
    for j, v in enumerate(shown):
        for ax, key in zip(axes, ("tok_s", "ttft_ms", "peak_MiB")):
            vals = [next((r.get(key) or 0 for r in rows if (r["batch"], r["prompt"]) == c and r["variant"] == v), 0)
                    for c in cases]
            ax.bar([i + j * width for i in range(len(cases))], vals, width, label=v)
    for ax, label in zip(axes, ("tokens/s", "time to first token (ms)", "peak memory (MiB)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels([f"b{b} p{p}" for b, p in cases])
        ax.set_ylabel(label)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    return bc.save_figure(fig, title, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompts", default="128,1024")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--reps", type=int, default=2, help="timed full generate() calls per case")
    p.add_argument("--variants", default=",".join(VARIANTS))
    bc.add_out_argument(p)
    p.add_argument("--quick", action="store_true", help="tiny preset on CPU, a few seconds")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--experts-impl", default="grouped_mm", choices=["grouped_mm", "eager"],
                   help="MoE presets: transformers' experts implementation the unpatched variants run")
    a = p.parse_args(argv)
    if a.quick:
        a.model, a.batches, a.prompts, a.new, a.reps = "tiny-moe" if is_moe(a.model) else "tiny", "2", "8", 12, 1
    variants = [v.strip() for v in a.variants.split(",")]
    bad = [v for v in variants if v not in VARIANTS + EXTRA_VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; known: {VARIANTS + EXTRA_VARIANTS}")
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build(a.model, dtype, dev, layers=a.layers).eval()
    if is_moe(a.model):  # (eager and static + compile run it; forge's variants patch the experts)
        model.set_experts_implementation(a.experts_impl)
    model.generation_config.eos_token_id = None  # random weights: every run decodes all --new tokens
    pristine = _cpu_twin(model)  # eager's twin for time to first token (run_case)
    vocab = PRESETS[a.model]["vocab_size"]
    rows = []
    title = f"generate(): {a.model}, {a.new} new tokens, {dev.type} {str(dtype).split('.')[-1]}"
    if is_moe(a.model):
        title += f", experts {a.experts_impl}"
    layers = f"-l{a.layers}" if a.layers else ""
    name = f"{a.model}{layers}-b{a.batches.replace(',', '-')}-p{a.prompts.replace(',', '-')}"
    for b in (int(x) for x in a.batches.split(",")):
        for plen in (int(x) for x in a.prompts.split(",")):
            g = torch.Generator().manual_seed(b * 7919 + plen)
            ids = torch.randint(1, vocab, (b, plen), generator=g).to(dev)
            mask = torch.ones_like(ids)
            want, case = None, []
            for v in bc.progress(variants, f"b{b} p{plen}"):
                row, out = run_case(model, v, ids, mask, a.new, a.reps, a.quick, want, pristine)
                if v == "eager":
                    want = out
                case.append(row)
            base = next((r for r in case if r["variant"] == "eager" and r.get("tok_s")), None)
            for r in case:
                if base and r.get("tok_s"):
                    r["speedup"] = r["tok_s"] / base["tok_s"]
            rows += case
            # written after every case (a run cut short by a time limit keeps the cases it finished)
            bc.write_results(a.out, "bench_generate", rows, {"args": vars(a), "title": title}, case=name,
                             history=False)
    print(title)
    bc.print_table(rows, COLUMNS)
    jpath, cpath = bc.write_results(a.out, "bench_generate", rows, {"args": vars(a), "title": title}, case=name)
    png = _plot(rows, jpath.with_suffix(".png"), title)
    print(f"wrote {jpath}\n      {cpath}" + (f"\n      {png}" if png else ""))
    return rows


if __name__ == "__main__":
    main()
