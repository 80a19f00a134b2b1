"""The closure factory: the forwards forge installs, and the function rebuilding behind RoPE and
the fused loss (see ``core.py`` for how they are installed and removed).

Each factory captures only static things (the kernel function, the class's original forward,
casting constants, the guard threshold and its counter) and returns a function of ``self``,
which ``core`` binds to the module instance. Weights are read from ``self`` at call time: FSDP2
swaps sharded and gathered parameters around each forward. (A deep copy of the model does not
share these closures: ``copying.py`` copies it unpatched and patches the copy.) The guard is one integer comparison plus one counter bump per call
(about 150 ns on a CPU core, and ~160 ns more for the torch.compile check before the bump). While
``graphs.py`` captures the decoder layers (``CAPTURE.on``) every call fuses: a replay pays no
host time per kernel, which is what the thresholds weigh.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import itertools
import sys
import types
import typing
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.gated_mlp import _any_autocast
from ..spec.fused_linear_ce import check_labels
from ..spec.rope import tables_need_grad
from . import stacking
from .guard import CAPTURE, STEP


def rmsnorm_forward(kernel, orig, eps_attr, casting, offset, threshold, ks, defer=False):
    """``defer``: inside a torch.compile trace run ``orig`` (forge.patch(compile_kernels=)); the
    check sits on the compile branch only, so an eager call pays nothing for it."""
    def forward(self, x):
        if x.numel() >= threshold or CAPTURE.on:
            if not _compiling():
                ks.fused += 1
            elif defer:
                return orig(self, x)
            return kernel(x, self.weight, getattr(self, eps_attr), casting=casting, offset=offset)
        if not _compiling():
            ks.fallback += 1
        return orig(self, x)

    return forward


# The guard counters are not bumped inside torch.compile's tracing: dynamo would specialise on
# each count and recompile every call (it hit its recompile limit on the H200, session 6).
_compiling = torch.compiler.is_compiling

_PLAIN_PARAMS = (nn.Parameter, torch.Tensor)
_module_mod = nn.modules.module


def _plain_linear(m, dtype) -> bool:
    """An nn.Linear without bias, hooks or an instance-level forward whose weight is a plain
    tensor of ``dtype`` (not an FSDP2 DTensor shard, not quantized): the gated MLP may read its
    weight directly."""
    return (type(m) is nn.Linear and m.bias is None and type(m.weight) in _PLAIN_PARAMS
            and m.weight.dtype is dtype and "forward" not in m.__dict__  # (no instance override)
            and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks))


def head_declines(model) -> str | None:
    """Why the fused loss cannot stand in for ``model.lm_head`` followed by the model's loss on
    a call (None when it can). Checked at patch time and again on every training call, since a
    peft adapter on lm_head (a later ``add_adapter``, or ``get_peft_model`` over a patched
    model), a hook, an accelerate wrapper or a loss function may arrive after patching; the
    fused path calls neither the head module nor the loss function, so any of them would be
    silently skipped."""
    lm = getattr(model, "lm_head", None)
    if type(lm) is not nn.Linear or "forward" in lm.__dict__:
        pkg = type(lm).__module__.partition(".")[0]
        return (f"lm_head is a {type(lm).__name__}{' with its own forward' * isinstance(lm, nn.Linear)}"
                + (f" (from {pkg})" if pkg != "torch" else ""))
    if (lm._forward_hooks or lm._forward_pre_hooks or lm._backward_hooks or lm._backward_pre_hooks
            or _module_mod._global_forward_hooks or _module_mod._global_forward_pre_hooks):
        return "lm_head has module hooks (the fused loss never calls it)"
    if ("_loss_function" in model.__dict__ or getattr(model, "loss_type", None) not in (None, "ForCausalLM")
            or _class_loss(type(model))):
        return "the model has a custom loss function"
    return None


_CLASS_LOSS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # (a class made at run time can go)


def _class_loss(cls) -> bool:
    """``cls`` (a subclass) defines a loss of its own: ``loss_function`` other than transformers'
    property, or a class-level ``_loss_function``."""
    hit = _CLASS_LOSS.get(cls)
    if hit is None:
        from transformers import PreTrainedModel

        hit = _CLASS_LOSS[cls] = (inspect.getattr_static(cls, "loss_function", None)
                                  is not inspect.getattr_static(PreTrainedModel, "loss_function", None)
                                  or inspect.getattr_static(cls, "_loss_function", None) is not None)
    return hit


def _bare_calls_ok() -> bool:
    """Whether the projections may run as bare F.linear calls instead of module calls: no
    autocast (a module call would cast) and no global module hooks (they would not run)."""
    return not (_any_autocast() or _module_mod._global_forward_hooks or _module_mod._global_forward_pre_hooks)


def glu_forward(kernel, mlp, train, act, act_type, orig, width, threshold, ks, recompute=False, defer=False,
                stack=False):
    """``mlp``: the gated MLP (forge.spec.gated_mlp): in train mode one autograd node under
    autograd; without autograd (either mode) bare F.linear calls around the kernel (no module
    call overhead). Taken when the three projections are plain bias-free Linears (no autocast,
    no hooks, weights not sharded); otherwise the projections run as modules around ``kernel``.
    ``act_type``: the class of the module's ``act_fn`` whose activation ``kernel`` computes; a
    call finding another there (swapped after patching), or hooks on it, runs ``orig``, counted
    as a fallback.
    ``recompute``: the gated MLP keeps only its input for backward (forge.patch(recompute_mlp=)).
    ``defer``: as rmsnorm_forward's, but through :func:`_traced_glu`. Unfused calls inside a
    torch.compile trace take it too. ``stack``: gate and up are stored together
    (forge.patching.stacking): a call of at most ``stacking.GLU_ROWS`` rows reads them with one
    product."""
    def forward(self, x):
        a = self._modules.get("act_fn")  # (a dict read: no Module.__getattr__)
        if type(a) is not act_type or a._forward_hooks or a._forward_pre_hooks:  # (the kernel never calls it)
            if not _compiling():
                ks.fallback += 1
            return orig(self, x)
        rows = x.numel() // x.shape[-1]
        fuse = rows * width >= threshold or CAPTURE.on  # activation elements: rows x intermediate width
        if stack and fuse and rows <= stacking.GLU_ROWS and not _compiling():
            y = _stacked_glu(self, x, kernel, act)  # (a decoding step the guard fuses: one product less too)
            if y is not None:
                ks.fused += 1
                return y
        if fuse:
            if not _compiling():
                ks.fused += 1
            elif defer:
                return _traced_glu(self, x, orig)
            gp, up, dp = self.gate_proj, self.up_proj, self.down_proj
            if (mlp is not None and (train or not torch.is_grad_enabled()) and _plain_linear(gp, x.dtype)
                    and _plain_linear(up, x.dtype) and _plain_linear(dp, x.dtype) and _bare_calls_ok()):
                return mlp(x, gp.weight, up.weight, dp.weight, act=act, recompute=recompute)
            return dp(kernel(gp(x), up(x)))
        if not _compiling():
            ks.fallback += 1
            return orig(self, x)
        return _traced_glu(self, x, orig)

    return forward


def _stacked_glu(mlp, x, kernel, act):
    """down(act(gate(x)) * up(x)) with gate and up read by one product over their weights stored
    together, else None (not stacked, biases, a gradient wanted, autocast, hooks). Inside a
    decoding step whose mode has a gated one-row kernel (``STEP.rows``; decode.ROW_GLU) that
    product and the activation are one launch."""
    gp, up, dp = (mlp._modules[n] for n in ("gate_proj", "up_proj", "down_proj"))
    if not (_plain_linear(gp, x.dtype) and _plain_linear(up, x.dtype) and _plain_linear(dp, x.dtype)
            and _bare_calls_ok()):
        return None  # (hooks or a forward set on a projection: its module call runs)
    wb = stacking.weights(mlp, stacking.GATE_UP, x)
    if wb is None or wb[1] is not None:
        return None
    rows = STEP.rows
    if rows is not None:
        y = rows.gated(x, wb[0], act)
        if y is not None:
            return F.linear(y, dp.weight)
    g, u = F.linear(x, wb[0]).split(mlp._modules["gate_proj"].weight.shape[0], dim=-1)
    return F.linear(kernel(g, u), dp.weight)


def _act_mul(act, g, u):
    return act(g) * u


def _traced_glu(self, x, orig):
    """The GLU left to inductor inside a torch.compile trace: the module's own code, except in a
    training trace, where ``act(g) * u`` sits in an activation checkpoint. Inductor's partitioner
    otherwise saves that product (rows x intermediate, the down projection's input) beside g
    and u for the backward; checkpointed, the backward makes it again from g and u (one
    pointwise pass), as forge's gated MLP node does: one rows x intermediate block less per
    layer."""
    act = getattr(self, "act_fn", None)
    if act is None or not torch.is_grad_enabled():
        return orig(self, x)
    g, u = self.gate_proj(x), self.up_proj(x)
    if not (g.requires_grad or u.requires_grad):
        return self.down_proj(_act_mul(act, g, u))
    return self.down_proj(torch.utils.checkpoint.checkpoint(_act_mul, act, g, u, use_reentrant=False))


class RebuildError(Exception):
    pass


def innermost(fn):
    for _ in range(32):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            return fn
        fn = inner
    raise RebuildError(f"{fn!r}: __wrapped__ chain too deep")


def copy_function(fn, globals_, closure, wrapped=None):
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = copy.copy(fn.__kwdefaults__)
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    if wrapped is not None:
        new.__wrapped__ = wrapped
    return new


def rebuild(fn, make_inner):
    """``fn`` with its innermost function replaced by ``make_inner(innermost)``: each decorator
    wrapper on the ``__wrapped__`` chain is re-created with the closure cell that held its inner
    function pointing at the rebuilt inner one (same code, globals and other cells)."""
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is None:
        return make_inner(fn)
    if not isinstance(fn, types.FunctionType):
        raise RebuildError(f"{fn!r} is not a plain function")
    cells = fn.__closure__ or ()

    def holds(c):
        try:
            return c.cell_contents is wrapped
        except ValueError:  # empty cell
            return False

    hits = [i for i, c in enumerate(cells) if holds(c)]
    if len(hits) != 1:
        raise RebuildError(f"decorator {fn.__qualname__} does not hold its wrapped function in one closure cell")
    new_inner = rebuild(wrapped, make_inner)
    closure = tuple(types.CellType(new_inner) if i == hits[0] else c for i, c in enumerate(cells))
    return copy_function(fn, fn.__globals__, closure, wrapped=new_inner)


_GLOBALS_SEQ = itertools.count()


def _globals_module(g: dict) -> types.ModuleType:
    """A module whose ``__dict__`` is a copy of a module's globals, under a name of its own, for
    ``sys.modules`` (:func:`rebuilt_with` registers it): torch.compile finds a function's globals
    through the module named by ``__name__`` (it guards on them there), so a plain dict copy that
    still says HF's module name would be read back as HF's module. The entry goes when the last
    function using these globals does (weakref.finalize on the rebuilt forward)."""
    name = f"forge._patched_globals.{g.get('__name__', 'module')}.{next(_GLOBALS_SEQ)}"
    mod = types.ModuleType(name)
    mod.__dict__.update(g)
    mod.__dict__["__name__"] = name
    return mod


def rebuilt_with(fn, inner, names: dict):
    """``fn`` (a class's forward, ``inner`` its innermost function) rebuilt over a copy of
    ``inner``'s module globals in which each of ``names`` is replaced: the module itself, and
    every other model using it, keep theirs. The copy's ``sys.modules`` entry goes with the
    rebuilt function (or at once, if the rebuild fails)."""
    mod = _globals_module(inner.__globals__)
    g = mod.__dict__
    g.update(names)
    try:  # (the entry is made inside: an interrupt anywhere from here takes it out again)
        sys.modules[mod.__name__] = mod
        built = rebuild(fn, lambda f: copy_function(f, g, f.__closure__))
        weakref.finalize(built, sys.modules.pop, mod.__name__, None)
    except BaseException:  # (RebuildError, or an interrupt)
        sys.modules.pop(mod.__name__, None)
        raise
    return built


def rope_function(kernel, orig, threshold, ks, defer=False):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # forge's kernel takes HF's 4-argument call (optionally unsqueeze_dim) with full-width
        # (B or 1, S, D) cos/sin that ask no gradient (the kernel gives them none); anything else
        # (partial rotary, legacy position_ids, a learned rotary table, 2-D tables from 1-D
        # position_ids) runs HF's function, which also raises HF's own error where it does
        if (not args and (not kwargs or kwargs.keys() == {"unsqueeze_dim"})
                and (q.numel() + k.numel() >= threshold or CAPTURE.on) and cos.shape[-1] == q.shape[-1]
                and cos.dim() == 3 and not tables_need_grad(cos, sin)):
            if not _compiling():
                ks.fused += 1
            elif defer:
                return orig(q, k, cos, sin, *args, **kwargs)
            return kernel(q, k, cos, sin, kwargs.get("unsqueeze_dim", 1))
        if not _compiling():
            ks.fallback += 1
        return orig(q, k, cos, sin, *args, **kwargs)

    return apply_rotary_pos_emb


# The mask builders a decoder's forward calls (transformers.masking_utils), and the sliding one.
MASK_BUILDERS = {"create_causal_mask": False, "create_sliding_window_causal_mask": True}
# what they may be called with for the mask to be a plain causal one (anything else: HF builds it)
_MASK_ARGS = frozenset({"config", "inputs_embeds", "input_embeds", "attention_mask", "cache", "past_key_values",
                        "position_ids", "cache_position", "layer_idx", "or_mask_function", "and_mask_function",
                        "block_sequence_ids", "allow_is_causal_skip"})
_MASK_NONE_ARGS = ("attention_mask", "or_mask_function", "and_mask_function", "block_sequence_ids")


def _plain_causal(kw, sliding) -> bool:
    """Whether HF's mask builder, called with ``kw``, describes plain causal attention over the
    call's own tokens, which SDPA's ``is_causal`` gives without a mask: SDPA attention, no
    padding mask and no extra mask functions, no cached tokens before these, and (sliding
    window) a window that covers every query's past."""
    cfg = kw.get("config")
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or not kw.keys() <= _MASK_ARGS:
        return False
    if any(kw.get(k) is not None for k in _MASK_NONE_ARGS) or kw.get("allow_is_causal_skip") is False:
        return False
    emb = kw.get("inputs_embeds", kw.get("input_embeds"))
    if not isinstance(emb, torch.Tensor) or emb.dim() < 2:
        return False
    cache = kw.get("cache", kw.get("past_key_values"))
    if cache is not None:
        seen = getattr(cache, "get_seq_length", None)
        n = seen() if callable(seen) else None
        if type(n) is not int or n != 0:  # (a static cache answers with a tensor)
            return False
    window = getattr(cfg, "sliding_window", None) if sliding else None
    return window is None or emb.shape[1] <= window


def causal_mask_builder(orig, sliding):
    """HF's mask builder ``orig`` as a patched decoder's forward calls it while torch.compile
    traces a call without an attention mask or position ids: None (SDPA then attends causally
    through ``is_causal``) where the mask would be plain causal, else ``orig``'s mask.

    Why: while dynamo traces, transformers cannot tell that no mask is needed (with torch before
    2.14 its skip test reads as "exporting" and it always builds one; given position ids it
    builds a mask that separates packed sequences), so the compiled model hands SDPA a dense
    mask. On the H200 that made the compiled model's attention 2.7x slower (cuDNN's kernel with
    a mask, and no causal skipping of tiles: 41 against 15 ms of a train 8x2048 step). A call
    without position ids numbers its tokens 0..S-1 itself, so there are no packed sequences."""
    def builder(*args, **kwargs):
        if not args and _plain_causal(kwargs, sliding):
            return None
        return orig(*args, **kwargs)

    return builder


def causal_decoder_forward(orig, plain, where):
    """A decoder model's forward: while torch.compile traces a call that passes no attention
    mask and no position ids, the rebuilt forward ``plain`` (its mask builders are
    :func:`causal_mask_builder`'s); every other call, and every eager call, ``orig``.
    ``where``: the positional index of each of those two arguments (after self)."""
    names = tuple(where.items())

    def forward(self, *args, **kwargs):
        if _compiling():
            for name, i in names:
                v = args[i] if i < len(args) else kwargs.get(name)
                if v is not None:
                    break
            else:
                return plain(self, *args, **kwargs)
        return orig(self, *args, **kwargs)

    return forward


def _output_class(inner):
    """The output dataclass HF's forward ``inner`` returns (its return annotation: MoE models give
    MoeCausalLMOutputWithPast, with aux_loss and router_logits), else CausalLMOutputWithPast."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    try:
        ret = typing.get_type_hints(inner).get("return")
    except Exception:  # noqa: BLE001  (an annotation that does not resolve: the plain class)
        ret = None
    for c in (ret, *typing.get_args(ret)):
        if isinstance(c, type) and dataclasses.is_dataclass(c) and {"loss", "logits"} <= {
                f.name for f in dataclasses.fields(c)}:
            return c
    return CausalLMOutputWithPast


@functools.cache
def _fused_output_types(base):
    """The fused loss's outputs: ``base``, the model's own output class (isinstance holds), whose ``to_tuple``
    keeps eager's positions. HF's ``to_tuple`` (what ``return_dict=False`` returns, and what an
    int index reads) drops every None field, so eager's tuple is ``(loss, logits[, cache]
    [, hidden_states][, attentions])`` and the plain output's would be ``(loss, ...)``: the
    logits slot goes missing and everything after it moves up. These keep None in the logits
    slot and, in the second type, in the cache slot too, for a call where eager would have
    built a KV cache and the fused path did not (no ``use_cache`` given). Same length, same
    positions; only the values forge never computes are None."""
    class FusedLossOutput(base):
        _empty_slots = (None,)  # logits

        def to_tuple(self):
            t = super().to_tuple()  # (loss, [cache], [hidden_states], [attentions])
            return t[:1] + self._empty_slots + t[1:]

    class FusedLossOutputNoCache(FusedLossOutput):
        _empty_slots = (None, None)  # logits, the cache eager builds

    return FusedLossOutput, FusedLossOutputNoCache


def _eager_builds_cache(decoder) -> bool:
    """Whether HF's decoder, given no ``use_cache``, returns a KV cache: the config's use_cache,
    turned off under gradient checkpointing in training with autograd on (transformers'
    ``merge_with_config_defaults``; tests/test_flce_contract.py compares with eager's tuple)."""
    if not getattr(decoder.config, "use_cache", False):
        return False
    return not (getattr(decoder, "gradient_checkpointing", False) and decoder.training
                and torch.is_grad_enabled())


def _masks_blind_to_cache(a) -> bool:
    """Whether HF's decoder, called with the bound arguments ``a`` and no KV cache, builds the
    attention masks it builds with the empty cache eager's call makes (config ``use_cache``).
    transformers' mask builders (``masking_utils._preprocess_mask_arguments``) read an empty
    cache for its sizes (zero tokens seen: the same as none) and, without one, look for packed
    sequences: given ``position_ids`` and no attention mask they build a mask that keeps each
    packed sequence to itself, which with a cache they do not. So: no cache of the caller's,
    and either no ``position_ids`` (the decoder numbers the tokens 0..S-1: nothing packed) or an
    attention mask the builders take as it is (2-D over exactly this call's tokens, or 4-D, or a
    prepared mapping). Anything else runs as eager's call (test_patching_faithful.py)."""
    if a.get("cache") is not None or a.get("past_key_values") is not None:
        return False
    mask = a.get("attention_mask")
    if mask is None:
        return a.get("position_ids") is None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        x = a.get("input_ids")
        x = a.get("inputs_embeds") if x is None else x
        return isinstance(x, torch.Tensor) and x.dim() >= 2 and mask.shape[-1] == x.shape[1]
    return True


def fused_ce_forward(kernel, inner, softcap_attr, ks):
    """The CausalLM forward of the fused loss (training with labels): the decoder, then the
    lm_head and the loss in one kernel call, ``logits=None``. Labels are checked for their dtype
    before the decoder runs (eager's loss refuses int32 only after it); their range is checked
    by the kernel's entry (forge.spec.fused_linear_ce.check_label_range). The decoder is asked
    for no KV cache unless the caller passes ``use_cache`` or going without one would change its
    attention masks (:func:`_masks_blind_to_cache`); with ``return_dict=False`` the tuple
    still has eager's length and positions (``_fused_output_types``)."""
    base = _output_class(inner)
    output_types = _fused_output_types(base)
    sig = inspect.signature(inner)
    params = list(sig.parameters.values())[1:]  # minus self
    varkw = next((q.name for q in params if q.kind is q.VAR_KEYWORD), None)
    named = [q.name for q in params if q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL)]
    passthrough = [f.name for f in dataclasses.fields(base) if f.name not in ("loss", "logits")]

    @functools.wraps(inner)  # keeps HF's signature visible (generate() inspects logits_to_keep)
    def forward(self, *args, **kwargs):
        if not self.training:
            if not _compiling():
                ks.fallback += 1
            return inner(self, *args, **kwargs)
        a = sig.bind(self, *args, **kwargs).arguments
        labels, keep = a.get("labels"), a.get("logits_to_keep", 0)
        w = self.lm_head.weight
        # a sharded lm_head (FSDP2 DTensor) is gathered only by its own forward: let HF call it
        plain = type(w) is nn.Parameter or type(w) is torch.Tensor
        router = a.get("output_router_logits")  # MoE: the auxiliary loss needs eager's forward
        router = getattr(self.config, "output_router_logits", False) if router is None else router
        if (labels is None or not (isinstance(keep, int) and keep == 0) or not plain or router
                or head_declines(self) is not None):
            if not _compiling():
                ks.fallback += 1
            return inner(self, *args, **kwargs)
        extra = dict(a.get(varkw) or {}) if varkw else {}
        ignore_index = extra.get("ignore_index", -100)
        shift = extra.get("shift_labels")
        check_labels(labels if shift is None else shift)  # before the pad below (uint8 fails in it)
        if shift is None:  # HF's ForCausalLMLoss: position t predicts label t + 1
            shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        # the decoder gets what HF's forward passes it: every named input but the two consumed
        # here, plus the extra kwargs (HF passes num_items_in_batch etc. to both)
        model_kwargs = {n: a[n] for n in named if n in a and n not in ("labels", "logits_to_keep")}
        model_kwargs.update(extra)
        decoder = getattr(self, self.base_model_prefix)
        out_type = output_types[0]
        # A loss without logits has no use for a KV cache, which in training is a copy of every
        # layer's keys and values (and a call with one is never replayed by graphs=True). But
        # the cache changes the attention masks transformers builds for packed sequences, so
        # the decoder goes without one only where the masks come out the same; elsewhere it
        # gets what eager's call gives it (docs/patching.md, "Packed sequences").
        if "use_cache" in named and "use_cache" not in a and (
                not _eager_builds_cache(decoder) or _masks_blind_to_cache(a)):
            model_kwargs["use_cache"] = False
            # (a conditional, not output_types[bool]: dynamo in torch 2.11 refuses a bool index)
            out_type = output_types[1] if _eager_builds_cache(decoder) else output_types[0]
        outputs = decoder(**model_kwargs)
        hidden = outputs.last_hidden_state  # (B, S, H)
        lm = self.lm_head
        h = hidden.reshape(-1, hidden.shape[-1])  # (B*S, H)
        # autocast over fp32 weights: compute in fp32, at least as exact. Without autocast the
        # dtypes must match, as eager's lm_head needs (the kernel's check names both)
        if h.dtype != w.dtype and torch.is_autocast_enabled(h.device.type):
            h = h.to(w.dtype)
        softcap = getattr(self.config, softcap_attr, None) if softcap_attr else None
        loss = kernel(h, w, shift.reshape(-1).to(h.device), lm.bias, ignore_index=ignore_index,
                      num_items_in_batch=extra.get("num_items_in_batch"), softcap=softcap)
        if not _compiling():
            ks.fused += 1
        return out_type(loss=loss, logits=None, **{f: getattr(outputs, f, None) for f in passthrough})

    return forward
