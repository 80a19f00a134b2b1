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

peft's LoRA on the expert weights (``target_parameters``) registers a parametrization around each
call: the weight plus ``scaling * lhs @ rhs`` per expert, lhs and rhs views of the adapter's B
and A. Where that is all a weight's parametrization does, the kernel takes the frozen weight and
the factors as an adapter (forge.ops.experts: rank-r grouped products joining the weight's, so
the adapted weight, one more expert stack per weight and layer, is never made, nor its gradient);
any other parametrization is read as the module's own forward reads it, and the kernel runs on
the weight it gives.
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
# lhs @ rhs (one baddbmm), lhs (E, out, r) and rhs (E, r, in) views of the adapter's B and A
_PEFT_FACTORS = "_LoraFactorsProxy"


def _low_rank(mod):
    """((gate_up, down) plain weights, (gate_up, down) adapters (a, b, scale) or None) where every
    parametrized expert weight of ``mod`` is peft's factored LoRA alone; else None (then the
    weights are read through their parametrizations, as the module's own forward reads them)."""
    weights, adapters = [], []
    for name in WEIGHTS:
        if not parametrize.is_parametrized(mod, name):
            weights.append(getattr(mod, name))
            adapters.append(None)
            continue
        plist = mod.parametrizations[name]
        proxy = plist[0] if len(plist) == 1 else None
        if type(proxy).__name__ != _PEFT_FACTORS:
            return None
        b, a, scale = (getattr(proxy, k, None) for k in ("lhs", "rhs", "scaling"))
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(scale, (int, float))):
            return None
        weights.append(plist.original)
        adapters.append((a, b, float(scale)))
    return tuple(weights), tuple(adapters)


def forward_of(kernel, act_type, orig, ks, compiling):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        low = _low_rank(self) if parametrize.is_parametrized(self) else None
        if low is not None:  # peft's LoRA on the expert weights: rank-r products, the adapted weights never made
            (gu, dn), adapters = low
        else:  # the weights as the module's own forward reads them (through any parametrization)
            (gu, dn), adapters = (self.gate_up_proj, self.down_proj), None
        if (type(self._modules.get("act_fn")) is not act_type or hidden_states.dim() != 2
                or hidden_states.dtype != gu.dtype or gu.dim() != 3 or dn.dim() != 3):
            if not compiling():
                ks.fallback += 1
            return orig(self, hidden_states, top_k_index, top_k_weights)
        if not compiling():
            ks.fused += 1
        return kernel(hidden_states, top_k_index, top_k_weights, gu, dn, act="silu", adapters=adapters)

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
