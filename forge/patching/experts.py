"""The MoE expert modules (transformers 5.x ``*Experts`` of qwen3_moe, mixtral and olmoe: 3-D
``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) behind ``use_experts_implementation``)
get forge's expert block (forge.spec.experts, the node forge.ops.experts) as their instance
forward, whichever experts implementation the config names ("eager", "grouped_mm", ...): the
router, the auxiliary loss and everything around the module are left as they are.

A module is declined, with its reason under ``experts`` in ``_forge_skipped``, where the kernel
would compute something else: an activation other than silu, biases, transposed or interleaved
weights, no gate. A call the kernel does not take (the act_fn swapped after patching, hidden not
2-D, hidden in another dtype than the weights, e.g. under autocast, or parametrized weights that
are not 3-D) runs the module's own forward, counted as a fallback.

The weights are read as the module's own forward reads them, through any parametrization: peft's
LoRA on the expert weights (``target_parameters``) registers one around each call (the weight
plus ``scaling * lhs @ rhs`` per expert, from factors of the adapter's A and B), so the kernel
runs on the adapted weights and autograd takes their gradient on to A and B. Where every
parametrization of a weight is peft's factored one, the node does not keep the adapted weight
(one more expert stack per weight and layer) for its backward but what makes it (the frozen
weight and the rank-r factors), and the backward rebuilds it.
"""
from __future__ import annotations

import types

import torch
from torch.nn.utils import parametrize

from . import arch as _arch

KEY = "experts"
SUFFIX = "Experts"
WEIGHTS = ("gate_up_proj", "down_proj")
# use_experts_implementation's layout flags and the values the kernel computes
LAYOUT = {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True,
          "has_post_expert_norm": False}


def is_experts(cls, mod) -> bool:
    return cls.__name__.endswith(SUFFIX) and all(
        isinstance(getattr(mod, n, None), torch.nn.Parameter) for n in WEIGHTS)


def _decline(name, mod) -> str | None:
    if _arch.glu_of(mod._modules.get("act_fn")) != "swiglu":
        return f"{name} calls {type(mod._modules.get('act_fn')).__name__}, not silu"
    odd = [f"{k}={getattr(mod, k)!r}" for k, v in LAYOUT.items() if getattr(mod, k, v) != v]
    if odd:
        return f"{name} has {', '.join(odd)}"
    gu, dn = mod.gate_up_proj, mod.down_proj
    if gu.dim() != 3 or dn.dim() != 3:
        return f"{name} expert weights are not 3-D"
    return None


# peft's parametrization of a targeted weight with one adapter and several experts: W + scaling *
# lhs @ rhs (one baddbmm); a deterministic function of the frozen weight and two small factors
_PEFT_FACTORS = "_LoraFactorsProxy"


class _Rebuilt:
    """What the node keeps in place of an adapted weight: the parametrizations that made it from
    the original, run again (without grad: the adapter's gradient flows through the forward's
    graph of the weight, not through the saved copy) when the backward asks for it."""

    __slots__ = ("original", "chain")

    def __init__(self, original, chain):
        self.original, self.chain = original, chain

    def get(self):
        with torch.no_grad():
            w = self.original
            for m in self.chain:
                w = m(w)
            return w


def _rebuildable(mod, name, value) -> tuple | None:
    """(signature of ``value``, _Rebuilt) when ``value`` is weight ``name`` as peft's factored
    LoRA made it."""
    if type(value) is not torch.Tensor or not parametrize.is_parametrized(mod, name):  # (plain tensors only)
        return None
    plist = mod.parametrizations[name]
    if not len(plist) or any(type(m).__name__ != _PEFT_FACTORS for m in plist):
        return None
    return _signature(value), _Rebuilt(plist.original, tuple(plist))


def _signature(t) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _unpack(p):
    return p.get() if isinstance(p, _Rebuilt) else p


def _keep_recipes(items):
    """saved_tensors_hooks that save each adapted weight of ``items`` (found by its signature:
    every saved tensor keeps both hooks, which therefore hold no weight) as its _Rebuilt."""
    def pack(t):
        if type(t) is not torch.Tensor:  # (a subclass, e.g. a DTensor: not one of the weights)
            return t
        sig = _signature(t)
        for s, rebuilt in items:
            if s == sig:
                return rebuilt
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _outer_hooks() -> bool:
    """Whether saved-tensor hooks are active already (non-reentrant gradient checkpointing,
    ``save_on_cpu``, ...): forge's would hide the call's saved tensors from them, so the node
    then saves as usual (under checkpointing the adapted weight is recomputed anyway). Where this
    torch cannot tell, assume they are."""
    return _top_hooks is None or _top_hooks(False) is not None


def forward_of(kernel, act_type, orig, ks, compiling):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        gu, dn = self.gate_up_proj, self.down_proj  # through peft's parametrizations, if any
        if (type(self._modules.get("act_fn")) is not act_type or hidden_states.dim() != 2
                or hidden_states.dtype != gu.dtype or gu.dim() != 3 or dn.dim() != 3):
            if not compiling():
                ks.fallback += 1
            return orig(self, hidden_states, top_k_index, top_k_weights)
        args = (hidden_states, top_k_index, top_k_weights, gu, dn)
        if compiling():  # (the compiled graph decides what it saves)
            return kernel(*args, act="silu")
        ks.fused += 1
        items = [r for r in (_rebuildable(self, n, v) for n, v in zip(WEIGHTS, (gu, dn))) if r]
        if items and torch.is_grad_enabled() and not _outer_hooks():
            with _keep_recipes(items):
                return kernel(*args, act="silu")
        return kernel(*args, act="silu")

    return forward


def apply(p, found, ready, compiling) -> None:
    """``found``: (name, module) of every expert module; ``ready()``: the kernel
    (forge.ops.get("experts", backend)), or None where the key is declined."""
    if not found:
        if p.wants(KEY):
            p.skip(KEY, f"{p.arch.model_type} has no mixture-of-experts modules", applies=False)
        return
    kernel = ready()
    if kernel is None:
        return
    ks, why = p.stats.counter(KEY), []
    for name, mod in found:
        if p.is_replaced(mod):
            continue
        reason = _decline(name, mod)
        if reason:
            why.append(reason)
            continue
        fwd = forward_of(kernel, type(mod._modules["act_fn"]), type(mod).forward, ks, compiling)
        p.replace_forward(mod, KEY, types.MethodType(fwd, mod))
    if why:
        more = f" (+{len(why) - 3} more)" if len(why) > 3 else ""
        p.skip(KEY, f"{len(why)} of {len(found)} expert modules keep their own forward: "
                    + "; ".join(why[:3]) + more)
