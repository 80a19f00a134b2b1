"""Where a decoding step's host time goes in generate(): transformers' loop around the forward,
forge's step wrapper, and what remains, per generated token.

    python bench/diagnostics/profile_decode_host.py                  # GPU: forge graphs and static + compile, b 1/8/32
    python bench/diagnostics/profile_decode_host.py --device cpu --layers 2 --vocab 1024
    python bench/diagnostics/profile_decode_host.py --sample         # temperature / top-k / top-p sampling

Each case runs generate() twice untimed (warm-up, capture or compilation), then times --reps
calls and shows the fastest (on a shared machine noise only adds). The decoding phase is timed
from the second call of ``prepare_inputs_for_generation`` (the first decoding step; the first
call is the prefill's) to generate's return, divided by its steps (new tokens - 1). Within it,
host time is split by wrapping, for that call only:

- ``prepare_inputs``: the instance's ``prepare_inputs_for_generation`` (transformers': slicing and
  the 4-D masks; forge's, once its graph builds the masks: two views and a dict);
- ``forward``: the call generate makes for a step: forge's forward (the copies into the graph's
  inputs and the replay's launch), from the inside of ``nn.Module.__call__`` (whose dispatch
  counts under ``rest``), or transformers' compiled call;
- ``update_kwargs``: ``_update_model_kwargs_for_generation`` (mask and position ids grown);
- ``processors``: the logits processors (temperature, top-k, top-p, ...);
- ``stopping``: the stopping criteria (max length, EOS);
- ``stop_check``: transformers' per-step ``unfinished_sequences.max() == 0`` read: on a GPU this
  waits for the device, so it holds the device time the host did not hide;
- ``rest``: the loop's own lines (logits copy, argmax or sampling, EOS masking, the ids' cat,
  Module dispatch) and anything not listed.

On a CPU the graph replay is replaced by a no-op (capture runs the step once for its logits
buffer; a replay launches nothing), so the model's compute does not hide the host work; static +
compile is GPU only. With ``--device cuda`` the forge case also prints its graph's device time
per step (50 back-to-back replays), and each batch size ends with the two variants' ratio.
``--pad`` left-pads the first row. A diagnosis tool: it writes nothing but its printout.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers

from forge import _runtime  # noqa: E402

_runtime.ensure_triton_mode()

import torch  # noqa: E402

import forge  # noqa: E402
from forge.patching import decode_runtime  # noqa: E402
from presets import PRESETS, build  # noqa: E402

PARTS = ("prepare_inputs", "forward", "update_kwargs", "processors", "stopping", "stop_check")


class _NoReplay:
    def replay(self):
        pass


class NoOpGraphs(decode_runtime.CudaGraphs):
    """A CPU stand-in for decode_runtime.CudaGraphs whose replay does nothing: the capture runs the
    step once (its logits tensor is the output buffer), every replay leaves it as it is (``serve``
    is CudaGraphs' own, which does nothing off a CUDA device)."""

    @staticmethod
    def why_not(device):
        return None

    @staticmethod
    def warm(fn, owner, dev):
        return fn()

    @staticmethod
    def capture(fn, owner, dev):
        return _NoReplay(), fn()


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class HostTimer:
    """Wraps generate's per-step calls (instance attributes and, for the call's duration, the
    classes of its processors, criteria and stop check) and sums their host time over the
    decoding phase."""

    def __init__(self, model):
        self.model = model
        self.acc = dict.fromkeys(PARTS, 0.0)
        self.prepares = 0
        self.t0 = None

    def _timed(self, name, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            if self.t0 is None:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.acc[name] += time.perf_counter() - t

        return run

    @contextlib.contextmanager
    def around(self, compiled: bool):
        from transformers.generation import logits_process, stopping_criteria, utils

        m, saved = self.model, {}
        prep = m.prepare_inputs_for_generation

        @functools.wraps(prep)
        def prepare(*a, **k):
            self.prepares += 1
            if self.prepares == 2:  # the first decoding step (the first call is the prefill's)
                self.t0 = time.perf_counter()
            return self._timed("prepare_inputs", prep)(*a, **k)

        inst = {"prepare_inputs_for_generation": prepare,
                "_update_model_kwargs_for_generation": self._timed("update_kwargs",
                                                                   m._update_model_kwargs_for_generation)}
        if compiled:
            get = m.get_compiled_call
            inst["get_compiled_call"] = lambda *a, **k: self._timed("forward", get(*a, **k))
        else:
            inst["forward"] = self._timed("forward", m.forward)
        for name, fn in inst.items():
            saved[name] = m.__dict__.get(name)
            m.__dict__[name] = fn
        cls_saved = []
        for cls, name in ((logits_process.LogitsProcessorList, "processors"),
                          (stopping_criteria.StoppingCriteriaList, "stopping"), (utils.StopCheck, "stop_check")):
            cls_saved.append((cls, cls.__dict__["__call__"]))
            cls.__call__ = self._timed(name, cls.__dict__["__call__"])
        try:
            yield self
        finally:
            for cls, fn in cls_saved:
                cls.__call__ = fn
            for name, fn in saved.items():
                if fn is None:
                    m.__dict__.pop(name, None)
                else:
                    m.__dict__[name] = fn


def _graph_device_us(model, dev, n=50):
    """Device time of one replayed decoding step: n back-to-back replays of the last call's graph
    from cache position 0 (each replay writes one position; the next call resets the cache)."""
    d = getattr(getattr(model, "_forge_graphs", None), "decode", None)
    slots = [slot for slot in (d.slots.values() if d else ()) if slot.steps]
    if dev.type != "cuda" or not slots:
        return None
    slot = slots[-1]
    g = next(iter(slot.steps.values())).graph
    n = min(n, slot.capacity - 2)
    for ly in slot.cache.layers:
        ly.cumulative_length.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize(dev)
    return start.elapsed_time(end) * 1e3 / n


def _memory(model, dev, base):
    """Where forge's memory beyond the model goes after the timed calls (CUDA): torch's peak over
    ``base`` (what was allocated before the first call), the static caches' bytes, and the graph
    pool's segments: their size and the bytes live tensors hold in them (the rest is what
    replays write: intermediates, and the allocator's segment rounding)."""
    g = getattr(model, "_forge_graphs", None)
    if dev.type != "cuda" or g is None:
        return None
    cache = sum(t.nbytes for slot in g.decode.slots.values() for ly in slot.cache.layers
                for t in (getattr(ly, "keys", None), getattr(ly, "values", None)) if t is not None)
    segs = [(seg["total_size"], sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"))
            for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", (0, 0))) == g.pool]
    mib = 2**20
    return (f"peak over the model {(torch.cuda.max_memory_allocated(dev) - base) / mib:.1f} MiB, "
            f"static caches {cache / mib:.1f} MiB, graph pool {sum(s for s, _ in segs) / mib:.1f} MiB in "
            f"{len(segs)} segments ({sum(a for _, a in segs) / mib:.1f} MiB held by live tensors; "
            f"segment sizes MiB: {sorted((round(s / mib, 1) for s, _ in segs), reverse=True)[:12]}); "
            f"by stream: {_by_stream(dev, g.pool)}")


def _by_stream(dev, pool):
    """The caching allocator's segments by stream (the default one, forge's capture stream, any
    other) and pool (the graphs' own, the rest): size and bytes held by live blocks, in MiB. What
    sits on the capture stream outside the graph pool was allocated while forge warmed steps up
    there: cuBLAS keeps its workspace per (handle, stream) in this allocator."""
    from forge.patching.graphs import capture_stream

    side = capture_stream(dev).cuda_stream
    acc = {}
    for seg in torch.cuda.memory_snapshot():
        st = seg.get("stream", 0)
        who = "default" if st == 0 else ("capture" if st == side else "other")
        where = "graph pool" if tuple(seg.get("segment_pool_id", (0, 0))) == pool else "allocator"
        live = sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        t = acc.setdefault(f"{who} stream, {where}", [0, 0])
        t[0] += seg["total_size"]
        t[1] += live
    return "; ".join(f"{k} {v[0] / 2**20:.1f} ({v[1] / 2**20:.1f} live)" for k, v in sorted(acc.items()))


def run_case(model, variant, ids, kw, dev, reps):
    gen_kw = dict(kw)
    if variant == "forge graphs":
        forge.patch(model, mode="infer", backend="triton", graphs=True,
                    kernels=None if dev.type == "cuda" else ["fused_linear_ce"])
        model._forge_graphs.decode.device_loop = False  # this tool splits transformers' own loop
    else:
        gen_kw["cache_implementation"] = "static"
    try:
        base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        for _ in range(2):
            model.generate(ids, **gen_kw)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        runs = []
        for _ in range(reps):
            _sync(dev)
            timer = HostTimer(model)
            with timer.around(compiled=variant != "forge graphs"):
                t_start = time.perf_counter()
                out = model.generate(ids, **gen_kw)
                _sync(dev)
                t_end = time.perf_counter()
            steps = timer.prepares - 1
            assert steps == kw["max_new_tokens"] - 1 and out.shape[1] == ids.shape[1] + kw["max_new_tokens"], \
                (steps, out.shape)
            decode = t_end - timer.t0
            r = {k: v / steps * 1e6 for k, v in timer.acc.items()}
            r["rest"] = decode / steps * 1e6 - sum(r.values())
            r["step"] = decode / steps * 1e6
            r["total_ms"] = (t_end - t_start) * 1e3
            runs.append(r)
        res = min(runs, key=lambda r: r["step"])  # the fastest call, split as timed (noise only adds)
        res["graph_us"] = _graph_device_us(model, dev) if variant == "forge graphs" else None
        if variant == "forge graphs":
            res["stats"] = dict(model._forge_graphs.stats.as_dict(),
                                prepared=getattr(model._forge_graphs.decode, "prepared", None))
            res["memory"] = _memory(model, dev, base)
        return res
    finally:
        forge.unpatch(model)
        for name in ("_compiled_call", "_previous_max_cache_length"):  # each case compiles afresh
            model.__dict__.pop(name, None)
        torch._dynamo.reset()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's; on a CPU "
                   "a small one keeps the argmax and logits copy over the vocabulary from dominating)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--variants", default=None, help="comma list of: forge graphs, static + compile")
    p.add_argument("--reps", type=int, default=3, help="timed calls per case (the fastest is shown)")
    p.add_argument("--sample", action="store_true", help="do_sample with temperature 0.7, top_k 50, top_p 0.9")
    p.add_argument("--pad", action="store_true", help="left-pad the first row by a third of the prompt")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if a.layers:
        PRESETS[a.model] = dict(PRESETS[a.model], num_hidden_layers=a.layers)
    if a.vocab:
        PRESETS[a.model] = dict(PRESETS[a.model], vocab_size=a.vocab)
    if dev.type == "cpu":
        decode_runtime.BACKEND = NoOpGraphs()
        torch.set_num_threads(1)  # host time, not intra-op parallelism on a shared machine
    variants = (a.variants.split(",") if a.variants else
                ["forge graphs"] + (["static + compile"] if dev.type == "cuda" else []))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build(a.model, dtype, dev).eval()
    vocab = model.config.vocab_size
    import transformers

    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (no-op replay)"
    print(f"# {a.model} layers={model.config.num_hidden_layers} vocab={vocab} {dtype} {where} "
          f"transformers {transformers.__version__} "
          f"torch {torch.__version__} prompt {a.prompt} new {a.new} {'sampling' if a.sample else 'greedy'}"
          f"{' left-padded' if a.pad else ''}; host us per decoding step")
    print(f"{'batch':>5} {'variant':<17} {'step':>7} " + " ".join(f"{k:>14}" for k in PARTS + ("rest",))
          + f" {'graph dev':>9} {'call ms':>8}")
    for b in map(int, a.batches.split(",")):
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(1, vocab, (b, a.prompt), generator=g).to(dev)
        mask = torch.ones_like(ids)
        if a.pad and b > 1:
            mask[0, : a.prompt // 3] = 0
        kw = dict(attention_mask=mask, max_new_tokens=a.new, min_new_tokens=a.new, pad_token_id=0)
        kw.update(dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9) if a.sample else dict(do_sample=False))
        steps = {}
        for variant in variants:
            torch.manual_seed(0)
            r = steps[variant] = run_case(model, variant, ids, kw, dev, a.reps)
            gd = "-" if r["graph_us"] is None else f"{r['graph_us']:.0f}"
            print(f"{b:>5} {variant:<17} {r['step']:>7.0f} " + " ".join(f"{r[k]:>14.0f}" for k in PARTS + ("rest",))
                  + f" {gd:>9} {r['total_ms']:>8.1f}", flush=True)
            if "stats" in r:
                print("      stats:", r["stats"])
            if r.get("memory"):
                print("      memory:", r["memory"])
        if len(steps) == 2:
            (n1, r1), (n2, r2) = steps.items()
            print(f"      batch {b}: {n1} {r1['step']:.0f} us/step, {n2} {r2['step']:.0f} us/step: "
                  f"{n2} / {n1} = {r2['step'] / r1['step']:.2f}x")
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
