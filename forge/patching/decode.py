"""generate() with captured decoding steps: installed by ``forge.patch(model, mode="infer",
graphs=True)`` (the runtime, ``decode_runtime.py``, captures and replays; this module decides
when, and owns the static caches). docs/generate.md is the user's page.

Three instance attributes of the ``*ForCausalLM`` are taken over (``forge.unpatch`` restores
them, which frees the graphs and the caches):

- ``generate``: marks the call as one forge may serve, and forgets its cache when it returns;
- ``_prepare_cache_for_generation`` (transformers' own step that picks generate's KV cache, same
  signature in 5.17 and 5.24): after transformers has resolved the generation config, the batch
  size and the cache length, forge hands generate a ``transformers.StaticCache`` of its own in
  place of the empty ``DynamicCache`` (and turns off transformers' automatic torch.compile,
  which a static cache would start), or declines with the reason counted in
  ``model._forge_graphs.stats.why`` as ``"generate: <reason>"`` and generate runs as before;
- ``forward``: a call with that cache and one new token per sequence is a decoding step: it
  replays the step's graph (``decode_runtime.CachedSteps``); any other call (the prefill, a call
  outside generate) runs the forward as patched;
- ``prepare_inputs_for_generation``: once a step's graph builds its masks itself (see
  decode_runtime), a decoding step of the call in flight gets its inputs without the 4-D masks
  transformers would build on the host: the last token and position ids (views), the cache, and
  the 2-D padding mask wrapped in a marker the forward recognises, which replays at once; any
  other call, and every step until then, runs transformers' own.

Static caches are kept between calls, one per batch size (at most ``MAX_CACHES``, least recently
used dropped), sized to the call's length rounded up to ``BUCKET`` tokens. A later call that
needs more grows the cache (a new, larger one, captured again); a call needing less than half
of it gets a new smaller one (every step attends over the whole cache). Nothing is truncated.

The prefill runs as into a fresh DynamicCache, whose updates write the prompt's keys and values
straight into the static cache (``Decoder._prefill``).
"""
from __future__ import annotations

import copy
import functools
import itertools
import logging
import types
import weakref

import torch
from torch import nn

from .. import ops
from ..ops.gated_mlp import _any_autocast
from . import decode_loop
from .graphs import _inert_recorder
from . import decode_runtime as rt
from .patcher import TORCH

BUCKET = 256  # static cache lengths are multiples of this
MAX_CACHES = 4  # static caches kept (one per batch size)
ATTN_OK = ("sdpa", "eager")
MODES = ("greedy_search", "sample")
# the decoding steps write the cache with the attention backend's kv_append (one launch a layer,
# forge.spec.kv_append) instead of transformers' three: on, as it takes 1-3% off a batch-1 call on
# an H100 (docs/generate.md, "The cache write in one launch"); read when a model is patched
KV_APPEND = True
# a decoding step's products of one row (batch 1: q/k/v, o, routers, the LM head) run the
# attention backend's row_linear (forge.spec.row_linear) instead of cuBLAS, in the steps captured
# (decode_runtime.step_kernels): on, as it takes 2-6% off a batch-1 call on an H100 (docs/generate.md,
# "One-row products"); read when a model is patched
ROW_LINEAR = True
# with ROW_LINEAR, a one-row product whose output a decoder layer adds to its residual stream next
# (o_proj, a dense MLP's down) writes that sum in the same launch, and the addition takes it
# (decode_runtime._RowProducts): on, as it took 1-2% off a batch-1 Llama-3-8B token and 6% off a
# Qwen3-30B-A3B one on an H100, side by side (docs/generate.md, "Residual sums and the gated
# activation with the products"); read when a model is patched
ROW_SUMS = True
# with ROW_LINEAR, a dense gated MLP's gate/up product over its weights stored together and its
# activation in one launch (the backend's row_glu; forwards._stacked_glu): off until measured
# (docs/generate.md, the same section); read when a model is patched
ROW_GLU = False
CACHE_NAMES = ("cache", "past_key_values")  # generate's name for it in transformers 5.24 / 5.17
_STEP_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache", "logits_to_keep",
                          "return_dict", "output_attentions", "output_hidden_states"})
_PREFILL_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache", "logits_to_keep",
                             "return_dict", "cache_position"})
# what generate passes prepare_inputs_for_generation for a decoding step (5.17 and 5.24, besides
# the cache): anything more and transformers' own prepare runs
_PREPARE_KWARGS = frozenset({"next_sequence_length", "attention_mask", "position_ids", "use_cache", "logits_to_keep"})
NEEDED = ("forward", "generate", "_prepare_cache_for_generation")  # taken over, or no decoding path
TAKEN = NEEDED + ("prepare_inputs_for_generation",)  # the last where no one else has it on the instance
_module_mod = nn.modules.module
log = logging.getLogger("forge")


def _capturable(backend) -> bool:
    """Whether a CUDA graph captures ``backend``'s kernels here (the op layer's registry says).
    A key that runs torch's own operations (``TORCH``: the one product over q, k and v stored
    together) is captured like the model's other torch calls."""
    return backend == TORCH or (backend in ops.BACKENDS and ops.on_stream(backend)[0])


def why_not(root, backends) -> str | None:
    """Why the decoding path cannot be installed on ``root``, or None."""
    bad = sorted(k for k, b in backends.items() if not _capturable(b))
    if bad:
        return (f"forge's {', '.join(bad)} kernel(s) run on {backends[bad[0]]!r}, whose calls a CUDA graph "
                f"cannot capture here (capturable: Triton, and Pallas where it launches natively on torch's stream)")
    cls = type(root)
    if not all(callable(getattr(cls, n, None)) for n in ("generate", "_prepare_cache_for_generation")):
        return f"{cls.__name__} has no transformers generate() with _prepare_cache_for_generation"
    for name in NEEDED:
        if name in root.__dict__:
            return f"{cls.__name__}.{name} is already replaced on the instance (by another library)"
    try:
        from transformers import StaticCache  # noqa: F401
    except ImportError:
        return "this transformers has no StaticCache"
    return None


def install(root, graphs, p):
    """Take over ``root``'s generate, _prepare_cache_for_generation, prepare_inputs_for_generation
    and forward (records in ``p``, restored by unpatch); returns the Decoder, or None with the
    reason in ``_forge_skipped["decode"]``."""
    why = why_not(root, p.backends())
    if why is not None:
        p.skip("decode", why)
        return None
    d = Decoder(root, graphs, *_attention(p.backends()))
    cls = type(root)

    @functools.wraps(cls.forward)  # generate reads the forward's signature
    def forward(self, *args, **kwargs):
        out = d.step(self, args, kwargs)
        return out if out is not None else cls.forward(self, *args, **kwargs)

    @functools.wraps(cls.generate)
    def generate(self, *args, **kwargs):
        return d.generate(self, args, kwargs)

    @functools.wraps(cls._prepare_cache_for_generation)
    def prepare_cache(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *a, **k):
        given = any(model_kwargs.get(n) is not None for n in CACHE_NAMES)
        out = cls._prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                                max_cache_length, *a, **k)
        d.offer(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, given)
        return out

    @functools.wraps(cls.prepare_inputs_for_generation)
    def prepare_inputs(self, *args, **kwargs):
        return d.prepare(self, args, kwargs)

    p.replace_forward(root, "decode", types.MethodType(forward, root))
    p.replace_method(root, "generate", types.MethodType(generate, root))
    p.replace_method(root, "_prepare_cache_for_generation", types.MethodType(prepare_cache, root))
    if "prepare_inputs_for_generation" in root.__dict__:  # someone else's: transformers' masks every step
        d.servable = False
        log.info("forge decode: %s.prepare_inputs_for_generation is replaced on the instance: decoding steps "
                 "replay with the 4-D masks generate builds", cls.__name__)
    else:
        p.replace_method(root, "prepare_inputs_for_generation", types.MethodType(prepare_inputs, root))
    return d


def _attention(backends):
    """(kernel, its backend): the decoding attention kernel (``forge.spec.decode_attention``) of
    the backend that runs the model's RoPE (else its first kernel's); (None, "sdpa") where that
    backend has none: then the decoding steps use SDPA."""
    kernels = (b for b in backends.values() if b != TORCH)  # (TORCH: the q/k/v product stored together)
    backend = backends.get("rope") or next(kernels, None)
    if backend is None:
        return None, "sdpa"
    kernel = _kernel_or_none("decode_attention", backend, "decoding steps attend with SDPA")
    return (None, "sdpa") if kernel is None else (kernel, backend)


def _kernel_or_none(key, backend, instead):
    """``backend``'s kernel ``key``, or None (logged with what is done ``instead``) where it has none."""
    from ..errors import BackendUnavailableError

    try:
        return ops.get(key, backend)
    except BackendUnavailableError as e:
        log.info("forge decode: %s (%s)", instead, e)
        return None


class StepMask:
    """What ``Decoder.prepare`` hands the forward as ``attention_mask`` for a decoding step it
    served: the step to replay and the 2-D padding mask (None: no padding) its graph builds the
    masks from. Only forge's forward sees it."""

    __slots__ = ("slot", "step", "mask2d")

    def __init__(self, slot, step, mask2d):
        self.slot, self.step, self.mask2d = slot, step, mask2d

    def masks(self):
        """The masks transformers would have built (checked equal before the step was captured)."""
        if self.step.form is None:
            return None  # a step captured with no mask: the model builds its own
        self.slot.load_keep(self.mask2d)
        return self.slot.build(self.step.form)


@functools.lru_cache(maxsize=None)
def _prefill_cache(base):
    """A subclass of ``base`` (transformers' DynamicCache) for the prompt's forward: to the model
    an empty DynamicCache (what generate's prefill gets), whose ``update`` writes each layer's
    keys and values straight into the static cache and returns views of them there. A real
    DynamicCache would hold a second copy of the prompt's keys and values for the whole forward
    (batch x prompt x 12 KiB for Qwen2.5-0.5B: 48 MiB at batch 32, prompt 128), to be copied into
    the static cache after it."""

    class PrefillIntoStatic(base):
        def __init__(self, static):
            super().__init__()
            self.static, self.written = static, 0

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            ly = self.static.layers[layer_idx]
            if not ly.is_initialized:
                ly.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            ly.keys[:, :, :n].copy_(key_states)
            ly.values[:, :, :n].copy_(value_states)
            self.written += 1
            return ly.keys[:, :, :n], ly.values[:, :, :n]

    return PrefillIntoStatic


def _criteria_length(args, kwargs) -> int:
    """The longest ``max_length`` among the ``MaxLengthCriteria`` a generate() call passes in its
    ``stopping_criteria`` (by name or fourth in position), else 0."""
    crit = kwargs.get("stopping_criteria", args[3] if len(args) > 3 else None)
    if not crit:
        return 0
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    return max((c.max_length for c in crit if isinstance(c, MaxLengthCriteria)), default=0)


def _same_made(a, b) -> bool:
    """Two ``Decoder._made()`` states alike: the same mode and the same tensors at the same addresses."""
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
        x is y and p == q for (x, p), (y, q) in zip(a[1], b[1]))


def _handed(cache, dynamic_cache):
    """The cache a ``return_dict_in_generate`` call returns, in place of forge's own, which forge
    keeps for its next call of that batch size (that call would reset and refill it under a
    caller continuing a conversation with it) and whose layers take forge's one-token update
    (which writes nothing past the capacity). Where every layer attends to the whole cache:
    ``dynamic_cache`` (transformers' DynamicCache, what the unpatched model returns) holding
    copies of the filled positions; else a copy of the static cache with its own tensors and
    transformers' own layer update (continuing past its length raises, as a static cache does)."""
    from transformers.cache_utils import StaticLayer

    if all(type(ly) is StaticLayer and getattr(ly, "is_initialized", False) for ly in cache.layers):
        twin = dynamic_cache()
        for i, ly in enumerate(cache.layers):
            n = int(ly.cumulative_length)
            twin.update(ly.keys[:, :, :n].clone(), ly.values[:, :, :n].clone(), i)
        return twin
    twin = copy.deepcopy(cache)
    for ly in twin.layers:
        ly.__dict__.pop("update", None)
    return twin


class Decoder:
    """Per patched model: its static caches with their captured steps, and the generate call in
    flight."""

    def __init__(self, root, graphs, attention=None, attends="sdpa"):
        self.root = root
        self.graphs = weakref.proxy(graphs)  # graphs holds this object: no reference cycle
        self.attention = attention  # the decoding steps' attention kernel, or None: SDPA
        self.attends = attends  # who computes it: a backend's name, or "sdpa"
        # the decoding steps' cache write (forge.spec.kv_append) from the same backend where
        # KV_APPEND is on, else None: two index_copy_ and a counter addition (read when a cache is made)
        self.append = None if attention is None or not KV_APPEND else _kernel_or_none(
            "kv_append", attends, "decoding steps write the cache with index_copy_")
        # the one-row product kernel of the same backend where ROW_LINEAR is on, else None: cuBLAS
        self.linear = None if attention is None or not ROW_LINEAR else _kernel_or_none(
            "row_linear", attends, "decoding steps' one-row products run cuBLAS")
        self.sums = ROW_SUMS
        self.glu = None if self.linear is None or not ROW_GLU else _kernel_or_none(
            "row_glu", attends, "decoding steps' gate/up products and activations run apart")
        self.slots: dict[int, rt.CachedSteps] = {}  # batch size -> its cache; least recently used first
        self.armed = False  # inside a generate() call of root
        self.slot: rt.CachedSteps | None = None  # the cache handed to the generate call in flight
        self.cache_name = None
        self.device = None  # the model's, for the call in flight
        self.prefills = 0  # prompts run as into a DynamicCache, written into the static one
        self.prepared = 0  # decoding steps whose inputs forge prepared (no 4-D masks on the host)
        self.device_loop = decode_loop.DEVICE_LOOP  # serve whole calls on the device (decode_loop.py)
        self.loop_calls = 0  # generate() calls the device loop served
        self.loop_tokens = 0  # tokens it generated (new positions x batch)
        self.longest = 0  # the longest MaxLengthCriteria the call in flight passed (0: none)
        self.pending = None  # (input_ids handed to the forward, the 2-D mask, prepare's key): the
        # decoding step transformers' prepare just ran for, whose masks the forward may check
        self._mods = list(root.modules())
        cls = type(root)
        # transformers' own input preparation and updates (a model class may override them)
        from transformers.generation.utils import GenerationMixin

        self.servable = (cls.prepare_inputs_for_generation is GenerationMixin.prepare_inputs_for_generation
                         and cls._update_model_kwargs_for_generation
                         is GenerationMixin._update_model_kwargs_for_generation
                         and getattr(cls, "create_masks_for_generate", None) is None
                         and not root.config.is_encoder_decoder
                         and not (getattr(root, "is_remote_code", None) and root.is_remote_code()))

    # -- generate() ----------------------------------------------------------------------------
    def generate(self, model, args, kwargs):
        if model is not self.root or self.armed:
            return type(model).generate(model, *args, **kwargs)
        self.armed = True
        self.longest = _criteria_length(args, kwargs)
        if self.device_loop:
            why = decode_loop.why_not_hook(args, kwargs)
            if why is None:
                kwargs = {**kwargs, "custom_generate": functools.partial(decode_loop.generate, self)}
            else:
                self.graphs.stats.count("device loop: " + why)
        try:
            with rt.BACKEND.serve(model.device):  # (on the capture stream: see CudaGraphs.serve)
                out = type(model).generate(model, *args, **kwargs)
            if self.slot is not None and getattr(out, "past_key_values", None) is self.slot.cache:
                out.past_key_values = _handed(self.slot.cache, self.graphs._dynamic_cache)
            return out
        finally:
            if self.slot is not None:  # (after the call: what forge itself set up in it counts)
                self.slot.made = self._made()
            self.armed, self.slot, self.cache_name, self.pending, self.longest = False, None, None, None, 0

    def offer(self, model, cfg, model_kwargs, mode, batch_size, max_cache_length, given):
        if model is not self.root or not self.armed or self.slot is not None:
            return
        why = self._why_not(cfg, model_kwargs, mode, given)
        if why is not None:
            self.graphs.stats.count("generate: " + why)
            return
        name = next((n for n in CACHE_NAMES if type(model_kwargs.get(n)) is self.graphs._dynamic_cache), None)
        if name is None:
            self.graphs.stats.count("generate: transformers prepared no DynamicCache to stand in for")
            return
        # (a caller's MaxLengthCriteria replaces transformers' own, and may run past the config's length)
        needed = max(max_cache_length, self.longest - 1)
        slot = self._slot(batch_size * max(cfg.num_beams or 1, cfg.num_return_sequences or 1), needed)
        if slot.stale():  # their graphs point at a freed cuBLAS workspace: never replayed
            slot.drop_steps()
            self.graphs.stats.count("generate: decoding steps captured again (torch's cuBLAS workspaces were "
                                    "cleared since their capture, e.g. by torch.compile's CUDA graphs)")
        slot.reset()
        model_kwargs[name] = slot.cache
        cfg.disable_compile = True  # generate's own config copy: no torch.compile of the forward
        self.slot, self.cache_name, self.device = slot, name, model.device

    def _why_not(self, cfg, model_kwargs, mode, given):
        if given:
            return "a cache passed by the caller"
        if cfg.cache_implementation is not None:
            return f"cache_implementation={cfg.cache_implementation!r}"
        if cfg.use_cache is False:
            return "use_cache=False"
        mode = getattr(mode, "value", str(mode))
        if mode not in MODES:
            return f"generation mode {mode} (captured: {', '.join(MODES)})"
        for flag in ("output_attentions", "output_hidden_states"):
            if getattr(cfg, flag, False) or getattr(self.root.config, flag, False):
                return flag
        if getattr(cfg, "prefill_chunk_size", None) is not None:
            return "prefill_chunk_size"
        why = rt.BACKEND.why_not(self.root.device)
        if why is not None:
            return why
        attn = getattr(self.root.config, "_attn_implementation", None)
        if attn not in ATTN_OK:
            return f"attention implementation {attn!r} not in {ATTN_OK}"
        if _any_autocast():
            return "autocast"
        if torch.compiler.is_compiling():
            return "torch.compile"
        if self._hooked():
            return "module hooks"
        return None

    def _hooked(self) -> bool:
        """Forward hooks a replay would skip (root's own run around its forward). transformers'
        output-capturing hooks, installed for good the first time hidden states or attentions
        are asked for, do nothing in a call that asks for neither (such calls are declined)."""
        if _module_mod._global_forward_hooks or _module_mod._global_forward_pre_hooks:
            return True
        for m in self._mods[1:]:
            if m._forward_pre_hooks or not all(map(_inert_recorder, m._forward_hooks.values())):
                return True
        return False

    def _made(self):
        """What a cache and its captured steps depend on besides shapes: every parameter and
        buffer of the model at its address (the graphs read them there; ``model.to(...)``, a
        cast or a replaced module moves them), and whether inference mode is on (tensors made
        under ``torch.inference_mode`` cannot be updated in place outside it)."""
        return (torch.is_inference_mode_enabled(),
                [(t, t.data_ptr()) for t in itertools.chain(self.root.parameters(), self.root.buffers())])

    def _slot(self, batch, needed):
        from transformers import StaticCache

        made = self._made()
        for b in [b for b, s in self.slots.items() if not _same_made(s.made, made)]:
            del self.slots[b]  # a cache whose steps read weights no longer there: dropped, freed
            self.graphs.stats.count("generate: decoding steps captured again (the model's weights moved, were cast "
                                    "or replaced, or inference mode changed, since their capture)")
        cap = -(-needed // BUCKET) * BUCKET
        slot = self.slots.pop(batch, None)
        if slot is not None and not needed <= slot.capacity <= 2 * cap:
            slot = None  # too short (grows), or twice too long: a new cache, captured again
        if slot is None:
            while len(self.slots) >= MAX_CACHES:
                self.slots.pop(next(iter(self.slots)))
            slot = rt.CachedSteps(StaticCache(config=self.root.config, max_cache_len=cap), batch, cap,
                                  self.attention, self.root.get_output_embeddings(), self.append, self.linear,
                                  self.sums, self.glu)
            slot.made = made
            self.graphs.stats.decode_caches += 1
        self.slots[batch] = slot  # most recently used last
        return slot

    # -- prepare_inputs_for_generation() ------------------------------------------------------
    def prepare(self, model, args, kwargs):
        """A decoding step's inputs: without its 4-D masks (a StepMask in their place) where a
        graph that builds them serves this kind of step; else transformers' own (for a decoding
        step of the call in flight, its 2-D mask is kept for the forward, which checks the masks
        transformers built from it and then lets later such steps come here)."""
        self.pending = None
        key = self._prepare_key(model, args, kwargs)
        if key is None:
            return type(model).prepare_inputs_for_generation(model, *args, **kwargs)
        slot, (ids, pos, mask2d) = self.slot, key[-1]
        key = key[:-1]
        step = slot.fast.get(key)
        if step is None:
            out = type(model).prepare_inputs_for_generation(model, *args, **kwargs)
            self.pending = (out.get("input_ids"), key, mask2d)  # the forward matches it by the ids
            return out
        self.prepared += 1
        out = {"input_ids": ids[:, -1:], "position_ids": pos[:, -1:], self.cache_name: slot.cache,
               "attention_mask": StepMask(slot, step, mask2d)}
        for name in ("use_cache", "logits_to_keep"):
            if name in kwargs:
                out[name] = kwargs[name]
        return out

    def _prepare_key(self, model, args, kwargs):
        """For a decoding step of the call in flight whose inputs forge may prepare: the kind of
        step (what a graph serving it depends on) and, last, (ids, position ids, 2-D mask); else
        None."""
        slot, n = self.slot, kwargs.get("next_sequence_length")
        if (slot is None or model is not self.root or not self.servable or not slot.buildable
                or len(args) != 1 or type(n) is not int or n != 1  # (a tensor in 5.24's prefill on a used cache)
                or kwargs.get(self.cache_name) is not slot.cache
                or not kwargs.keys() - {self.cache_name} <= _PREPARE_KWARGS or model._forward_pre_hooks):
            return None
        ids, pos, mask2d = args[0], kwargs.get("position_ids"), kwargs.get("attention_mask")
        if (type(ids) is not torch.Tensor or type(pos) is not torch.Tensor or ids.dim() != 2 or pos.dim() != 2
                or ids.shape[0] != slot.batch or pos.shape[0] != slot.batch or pos.device != ids.device
                or ids.device != self.device):
            return None
        if mask2d is not None and (type(mask2d) is not torch.Tensor or mask2d.dim() != 2
                                   or mask2d.shape[0] != slot.batch or mask2d.shape[1] > slot.capacity
                                   or mask2d.device != ids.device):
            return None
        return (kwargs.get("logits_to_keep", 0), kwargs.get("use_cache"), ids.dtype, pos.dtype,
                mask2d is None or mask2d.dtype, getattr(model.config, "_attn_implementation", None),
                (ids, pos, mask2d))

    # -- forward() -----------------------------------------------------------------------------
    def step(self, model, args, kwargs):
        """A decoding step's output (replayed, or run uncaptured with the reason counted), or None
        when the call is not a decoding step of the generate call in flight."""
        slot = self.slot
        fast = kwargs.get("attention_mask")
        if type(fast) is StepMask:  # prepared by self.prepare: replay at once
            if fast.slot is slot and model is self.root and not args:
                st = fast.step
                st.ids.copy_(kwargs["input_ids"])
                st.pos.copy_(kwargs["position_ids"])
                if st.form is not None:
                    slot.load_keep(fast.mask2d)
                return slot.replay(st, self.graphs.stats)
            kwargs["attention_mask"] = fast.masks()  # (not expected) the masks, and on as usual
        pending, self.pending = self.pending, None
        if slot is None or model is not self.root or args or kwargs.get(self.cache_name) is not slot.cache:
            return None
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return None
        if ids.shape[1] != 1:
            return self._prefill(model, kwargs, ids, slot)
        g = self.graphs
        sig, why = self._signature(kwargs, ids, slot)
        # the 2-D mask transformers built this step's masks from, where prepare saw it
        mask2d = pending[2] if pending is not None and pending[0] is ids else False
        g.paused = True
        try:
            out = None
            if why is None:
                out, why = slot.run(functools.partial(type(model).forward, model), kwargs, sig, rt.BACKEND, g, g.stats,
                                    mask2d)
                if why is None:
                    st = slot.steps[sig]
                    if mask2d is not False and (st.form is not None or st.mask is None):
                        slot.fast[pending[1]] = st  # its masks checked: prepare serves such steps from now on
                    return out
            g.stats.uncaptured += 1
            g.stats.count("decoding step: " + why)
            return out if out is not None else type(model).forward(model, **kwargs)
        finally:
            g.paused = False

    def _prefill(self, model, kwargs, ids, slot):
        """The prompt's forward as into a fresh DynamicCache, as without forge's cache (a causal
        SDPA call per layer with no mask where no row is padded; the layer graphs stand aside),
        its keys and values written into the static cache as it goes (``_prefill_cache``) and
        attended there over the prompt's length only. Run against the static cache
        itself, every layer would attend over the cache's whole capacity under a 4-D mask
        (time to first token 36 ms against eager's 20 ms at batch 32, prompt 128, on the H200).
        None (run as before) for a cache with sliding-window layers or a mask it cannot read. A
        prompt with no padded row usually comes with no mask at all (SDPA's causal flag serves it):
        that case is the common one, batch 1 among them."""
        from transformers.cache_utils import StaticLayer

        if (slot.sliding or slot.filled or set(kwargs) - _PREFILL_KWARGS - {self.cache_name}
                or not all(type(ly) is StaticLayer for ly in slot.cache.layers)):
            return None
        mask = kwargs.get("attention_mask")
        if isinstance(mask, dict):
            mask = mask.get("full_attention", False) if len(mask) == 1 else False
        n = ids.shape[1]
        if mask is None:
            pad2d = None  # no mask: transformers left causality to SDPA, as it does when no row is padded
        elif type(mask) is not torch.Tensor or mask.dim() != 4 or mask.shape[0] != ids.shape[0] or mask.shape[2] != n:
            return None
        else:
            # the last prompt position attends to every key that is not padding: its row of the
            # causal 4-D mask is the 2-D padding mask (bool: True attends; float: 0 attends)
            last = mask[:, 0, -1, :n]
            pad2d = (last if last.dtype is torch.bool else last == 0).long()
        dyn = _prefill_cache(self.graphs._dynamic_cache)(slot.cache)
        # uncaptured, as with graphs off: the layer graphs would capture each new prompt shape and
        # keep its activations in their pool (5.1 GB against eager's 2.5 peak at batch 32, prompt
        # 1024, H200), for a first token that the fused kernels already bring in under eager's
        self.graphs.paused = True
        try:
            out = type(model).forward(model, **{**kwargs, "attention_mask": pad2d, self.cache_name: dyn})
        finally:
            self.graphs.paused = False
        if dyn.written != len(slot.cache.layers):
            raise RuntimeError(f"forge decode: the prompt's forward wrote {dyn.written} of the cache's "
                               f"{len(slot.cache.layers)} layers")
        for ly in slot.cache.layers:
            ly.cumulative_length.fill_(n)
        slot.filled = True
        self.prefills += 1
        out.past_key_values = slot.cache
        return out

    def _signature(self, kwargs, ids, slot):
        extra = kwargs.keys() - _STEP_KWARGS - {self.cache_name}
        if extra:
            return None, f"arguments {sorted(extra)}"
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            return None, "output_attentions or output_hidden_states"
        if kwargs.get("use_cache") is False:
            return None, "use_cache=False"
        pos = kwargs.get("position_ids")
        if ids.shape[0] != slot.batch or not isinstance(pos, torch.Tensor) or pos.shape != ids.shape:
            return None, "input_ids or position_ids not (batch, 1)"
        keep = kwargs.get("logits_to_keep", 0)
        if not isinstance(keep, int):
            return None, "logits_to_keep not an int"
        mask = rt.mask_signature(kwargs.get("attention_mask"))
        if mask is None:
            return None, "attention mask not a tensor or a dict of tensors"
        if slot.full_window():
            return None, "a sliding window is full (transformers' rolling update runs uncaptured)"
        return (mask, keep, ids.dtype, pos.dtype, kwargs.get("return_dict"), kwargs.get("use_cache")), None
