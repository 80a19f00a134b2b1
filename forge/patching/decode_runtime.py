"""The decoding-step runtime: one whole decoding step (every decoder layer, the final norm and the
LM head, the model's forward for one new token per sequence) captured in a CUDA graph on a
static KV cache, and replayed for every further token. ``forge.patching.decode`` installs it
into ``generate()``; this module knows nothing of generate.

A step's graph reads its inputs from static buffers (the token ids, the position ids and the
4-D attention masks transformers builds for a static cache, one per layer type) and writes the
logits to a static buffer; the KV cache's tensors (transformers' ``StaticCache``: keys, values
and each layer's ``cumulative_length`` counter, all updated in place by its ``update``) are read
and written by the graph at fixed addresses. A replay is: copy the inputs in, replay, and do the
bookkeeping the cache keeps in Python, which a replay does not run (a sliding-window layer's
``cumulative_length_int``).

Graphs are kept per call signature (the masks' shapes and dtypes, ``logits_to_keep``): the
first ``WARMUP`` steps of a signature run uncaptured (Triton compiles, cuBLAS and SDPA choose
their kernels), the next one captures and replays. A capture records kernels without running
them, but Python runs: the cache's Python-side counters are put back after it (and its device
counters, which a stand-in graph that does run the step, as the CPU tests use, has advanced).
"""
from __future__ import annotations

import contextlib
import gc
import warnings

import torch
import torch.nn.functional as F

from .guard import CAPTURE

WARMUP = 2  # uncaptured steps of a signature before its capture


def _packed_sdpa(orig, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                 **kwargs):
    """transformers' SDPA attention for one new token per sequence with grouped KV heads, without
    repeating the cache: the query heads of a KV head become that head's query rows, (B, H, 1, D)
    -> (B, H_kv, H / H_kv, D), and attend to the cache as it is. The same products and softmax
    per query head as ``repeat_kv`` + SDPA (transformers 5.17 repeats the whole static cache per
    layer and step: 1.4 GB of copies per step at batch 32 with a 512-token cache, Qwen2.5-0.5B).
    Any other call goes to ``orig``."""
    groups = getattr(module, "num_key_value_groups", 1)
    b, h, q, d = query.shape
    mask_ok = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1
                                         and attention_mask.shape[2] == 1)
    if (q != 1 or groups <= 1 or h != key.shape[1] * groups or not mask_ok or dropout
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or kwargs.get("output_attentions")):
        return orig(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    is_causal=is_causal, **kwargs)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[2]]  # (B, 1, 1, L): shared by the rows
    out = F.scaled_dot_product_attention(query.reshape(b, h // groups, groups, d), key, value,
                                         attn_mask=attention_mask, dropout_p=0.0, scale=scaling)
    return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def packed_gqa():
    """While a decoding step runs uncaptured or is captured: transformers' "sdpa" attention
    through :func:`_packed_sdpa` (a replay runs the kernels recorded then). The swap is
    process-wide for its duration; the packed function computes what the original does, so a
    concurrent caller elsewhere gets the same results."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns
    except ImportError:
        yield
        return
    local = getattr(fns, "_local_mapping", None)  # (GeneralInterface's per-instance overrides)
    if not isinstance(local, dict):
        yield
        return
    had, before = "sdpa" in local, local.get("sdpa")
    orig = fns["sdpa"]
    local["sdpa"] = lambda *a, **k: _packed_sdpa(orig, *a, **k)
    try:
        yield
    finally:
        if had:
            local["sdpa"] = before
        else:
            local.pop("sdpa", None)


class CudaGraphs:
    """Real CUDA graphs in the model's graph pool, captured on its capture stream (shared with
    forge.patching.graphs' layer sets: replays never overlap, so captures may reuse each other's
    temporaries). The CPU tests replace this object by one with the same three methods."""

    @staticmethod
    def why_not(device) -> str | None:
        if device.type != "cuda":
            return f"the model is on {device.type}, CUDA graphs need a CUDA device"
        return None

    @staticmethod
    def _stream(owner, dev):
        from .graphs import capture_stream  # the process's one capture stream per device

        side = capture_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        return side

    def warm(self, fn, owner, dev):
        """An uncaptured step on the capture stream (cuBLAS keeps a workspace per stream)."""
        side = self._stream(owner, dev)
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        return out

    def capture(self, fn, owner, dev):
        """(graph, fn's output tensor at its static address); the kernels are recorded, not run."""
        side = self._stream(owner, dev)
        if owner.pool is None:
            owner.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=owner.pool, stream=side):
            out = fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        return graph, out


BACKEND = CudaGraphs()


def _static(x):
    """A static-address copy of a mask (a tensor, None, or a dict of them by layer type)."""
    if isinstance(x, dict):
        return {k: _static(v) for k, v in x.items()}
    return None if x is None else x.detach().clone()


def _copy_into(dst, src):
    if isinstance(dst, dict):
        for k, v in dst.items():
            _copy_into(v, src[k])
    elif dst is not None:
        dst.copy_(src)


def mask_signature(mask):
    """The masks' structure, shapes and dtypes, or None if they are not tensors (e.g. flex
    attention's BlockMask), which a static buffer cannot hold."""
    if isinstance(mask, dict):
        items = []
        for k in sorted(mask):
            sig = mask_signature(mask[k])
            if sig is None:
                return None
            items.append((k, sig))
        return ("dict", tuple(items))
    if mask is None:
        return ("none",)
    if type(mask) is not torch.Tensor:
        return None
    return (tuple(mask.shape), mask.dtype, mask.device)


class _Step:
    __slots__ = ("graph", "ids", "pos", "mask", "logits", "template")


class CachedSteps:
    """The captured decoding steps on one static cache (one batch size, one capacity)."""

    def __init__(self, cache, batch: int, capacity: int):
        self.cache, self.batch, self.capacity = cache, batch, capacity
        self.filled = False  # the prompt is in the cache (decode.Decoder._prefill)
        self.sliding = [ly for ly in cache.layers if hasattr(ly, "cumulative_length_int")]
        self.steps: dict[tuple, _Step] = {}
        self.seen: dict[tuple, int] = {}
        self.failed: dict[tuple, str] = {}

    def reset(self):
        """Empty the cache in place (its tensors keep their addresses: the graphs stay valid)."""
        self.cache.reset()
        self.filled = False

    def full_window(self) -> bool:
        """A sliding-window layer holds its whole window: transformers' update then rolls the
        window, which runs uncaptured (it builds an index tensor from a Python list per call)."""
        return any(ly.cumulative_length_int >= ly.max_cache_len for ly in self.sliding)

    def run(self, forward, kw, sig, backend, owner, stats):
        """(output, why): the replayed step's output (a ModelOutput whose logits are the graph's
        static buffer) and None; a warm-up step's output and why it ran uncaptured; or None and
        why, for the caller to run the step uncaptured."""
        step = self.steps.get(sig)
        if step is None:
            if sig in self.failed:
                return None, self.failed[sig]
            n = self.seen.get(sig, 0)
            if n < WARMUP:
                self.seen[sig] = n + 1
                CAPTURE.on = True  # the kernels the capture will record (fused at every size)
                try:
                    with packed_gqa():
                        out = backend.warm(lambda: forward(**kw), owner, kw["input_ids"].device)
                    return out, "warm-up before capture"
                finally:
                    CAPTURE.on = False
            step = self._capture(forward, kw, sig, backend, owner, stats)
            if step is None:
                return None, self.failed[sig]
        else:
            step.ids.copy_(kw["input_ids"])
            step.pos.copy_(kw["position_ids"])
            _copy_into(step.mask, kw["attention_mask"])
        ints = [(ly, ly.cumulative_length_int) for ly in self.sliding]
        step.graph.replay()
        for ly, n in ints:  # what update() does in Python for one new token
            ly.cumulative_length_int = n + 1
        stats.decode_replayed += 1
        return type(step.template)(**dict(step.template.items())), None  # a fresh object, the same tensors

    def _capture(self, forward, kw, sig, backend, owner, stats):
        s = _Step()
        s.ids, s.pos = kw["input_ids"].clone(), kw["position_ids"].clone()
        s.mask = _static(kw["attention_mask"])
        held = {}

        def fn():
            out = forward(**{**kw, "input_ids": s.ids, "position_ids": s.pos, "attention_mask": s.mask})
            held["out"] = out
            return out.logits

        dev = s.ids.device
        saved = [(ly, ly.cumulative_length.clone(), getattr(ly, "cumulative_length_int", None))
                 for ly in self.cache.layers]
        gc.collect()  # garbage freed now, not by a collection mid-capture
        gc_was = gc.isenabled()
        gc.disable()
        CAPTURE.on = True
        try:
            with packed_gqa():
                s.graph, s.logits = backend.capture(fn, owner, dev)
        except Exception as e:  # noqa: BLE001 - never break generate(): this signature runs uncaptured
            self.failed[sig] = f"capture failed ({type(e).__name__}: {str(e)[:200]})"
            warnings.warn(f"forge decode: {self.failed[sig]}; such steps run uncaptured", RuntimeWarning,
                          stacklevel=2)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            return None
        finally:
            CAPTURE.on = False
            if gc_was:
                gc.enable()
            for ly, t, n in saved:  # the capture ran update()'s Python: put the counters back
                ly.cumulative_length.copy_(t)
                if n is not None:
                    ly.cumulative_length_int = n
        s.template = held.pop("out")
        self.steps[sig] = s
        self.seen.pop(sig, None)
        stats.decode_captures += 1
        return s
