"""The MoE expert modules (transformers 5.x ``*Experts`` of qwen3_moe, mixtral and olmoe: 3-D
``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) behind ``use_experts_implementation``)
get forge's expert block (forge.spec.experts, the node forge.ops.experts) as their instance
forward, whichever experts implementation the config names ("eager", "grouped_mm", ...): the
auxiliary loss and everything around the module are left as they are, the routers but for the
calls below.

The routers (``*TopKRouter``, each sparse block's ``gate``) get a forward of the same key, not
counted: a call without gradients (inference, a decoding step) keeps the router's product and
takes the softmax, top-k and renormalisation from the backend's ``top_k`` piece (one launch where
torch's code takes ~6 a layer; forge.ops.experts.top_k). A call that wants gradients, and any
call while torch.compile traces, runs the router's own forward. The chosen experts are torch's;
their scores agree to fp32 rounding, and equal logits are chosen in expert order.

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
the weight it gives. peft's wrapper around the module (the outermost, where several weights are
targeted) gets a forward of forge's too, which reads the factors from the wrappers and calls the
kernel without registering the parametrizations at all: torch evaluates a parametrization when it
is registered, which made and dropped the adapted expert stack once per weight, layer and step.
Where peft would do anything else (adapters disabled or merged, several active adapters) its own
forward runs, and the module's forward above takes what it registers.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from ..ops import experts as _ops
from . import arch as _arch

KEY = "experts"
SUFFIX = "Experts"
WEIGHTS = ("gate_up_proj", "down_proj")
# use_experts_implementation's layout flags and the values the kernel computes
LAYOUT = {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True,
          "has_post_expert_norm": False}


# transformers' routers of the three architectures: (the attribute that says whether the chosen
# scores are renormalised, None where they always are; whether they return in the logits' dtype)
ROUTERS = {"OlmoeTopKRouter": ("norm_topk_prob", True), "Qwen3MoeTopKRouter": ("norm_topk_prob", True),
           "MixtralTopKRouter": (None, False)}


def is_router(cls, mod) -> bool:
    w = getattr(mod, "weight", None)
    return (cls.__name__ in ROUTERS and isinstance(w, torch.Tensor) and w.dim() == 2
            and isinstance(getattr(mod, "top_k", None), int))


def router_forward_of(ops, orig, renorm_attr, cast, compiling):
    """A router's forward: the backend's top_k after the router's own product for a call without
    gradients in eval mode, the router's own forward for any other (or while torch.compile
    traces). Training mode keeps torch's choice even without gradients: reentrant checkpointing
    runs a layer's forward without them, then again with them for the backward, and where logits
    tie the two top-ks may choose different experts (the loss from one routing, the gradients
    from the other)."""
    def forward(self, hidden_states):
        w = self.weight
        if compiling() or self.training or (
                torch.is_grad_enabled() and (w.requires_grad or hidden_states.requires_grad)):
            return orig(self, hidden_states)
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), w)
        renorm = True if renorm_attr is None else bool(getattr(self, renorm_attr))
        scores, index = _ops.top_k(ops, logits, self.top_k, renorm, logits.dtype if cast else torch.float32)
        return logits, scores, index

    return forward


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
    def takes(self, hidden_states, gu, dn) -> bool:
        return (type(self._modules.get("act_fn")) is act_type and hidden_states.dim() == 2
                and hidden_states.dtype == gu.dtype and gu.dim() == 3 and dn.dim() == 3)

    def run(hidden_states, top_k_index, top_k_weights, gu, dn, adapters):
        if not compiling():
            ks.fused += 1
        return kernel(hidden_states, top_k_index, top_k_weights, gu, dn, act="silu", adapters=adapters)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        low = _low_rank(self) if parametrize.is_parametrized(self) else None
        if low is not None:  # peft's LoRA on the expert weights: rank-r products, the adapted weights never made
            (gu, dn), adapters = low
        else:  # the weights as the module's own forward reads them (through any parametrization)
            (gu, dn), adapters = (self.gate_up_proj, self.down_proj), None
        if not takes(self, hidden_states, gu, dn):
            if not compiling():
                ks.fallback += 1
            return orig(self, hidden_states, top_k_index, top_k_weights)
        return run(hidden_states, top_k_index, top_k_weights, gu, dn, adapters)

    forward.takes, forward.run = takes, run
    return forward


# ---------------------------------------------------------------------------------------------
# peft's wrappers around an expert module (one ParamWrapper per targeted weight, nested). Each
# call of peft's own forward registers its parametrization, and torch evaluates a parametrization
# once when it is registered (a check of its shape and dtype): the whole adapted expert stack is
# made and dropped, per weight, layer and step, before the module runs. The outermost wrapper's
# forward is replaced by one that reads the factors from every wrapper and calls the kernel.

def _is_peft_param_wrapper(m) -> bool:
    return (isinstance(getattr(m, "base_layer", None), torch.nn.Module)
            and isinstance(getattr(m, "parameter_name", None), str)
            and callable(getattr(m, "get_delta_factors", None)))


def _peft_chain(root, experts_mods):
    """{id(expert module): [its peft ParamWrappers, innermost first]} for the modules that have any."""
    wrapper_of = {id(m.base_layer): m for m in root.modules() if _is_peft_param_wrapper(m)}
    chains = {}
    for mod in experts_mods:
        chain, cur = [], mod
        while id(cur) in wrapper_of:
            cur = wrapper_of[id(cur)]
            chain.append(cur)
        if chain:
            chains[id(mod)] = chain
    return chains


def _peft_adapters(mod, chain):
    """The (gate_up, down) adapters (a, b, scale), or None for a weight without one, that peft's
    wrappers ``chain`` would fold into ``mod``'s weights as W + scale * b @ a with one baddbmm
    (one active adapter, several experts, adapters enabled and not merged); None where peft would
    do anything else (its own forward then runs)."""
    found = {}
    for w in chain:
        if w.disable_adapters or w.merged:
            return None
        names = [a for a in w.active_adapters if a in w.lora_A]
        if not names:
            continue  # no adapter on this weight: peft leaves it as it is
        name = w.parameter_name
        if len(names) != 1 or getattr(w, "num_experts", 1) <= 1 or name not in WEIGHTS or name in found:
            return None
        b, a, scale = w.get_delta_factors(names[0])
        if not isinstance(scale, (int, float)):
            return None
        found[name] = (a, b, float(scale))
    return tuple(found.get(n) for n in WEIGHTS)


def peft_forward_of(mod, fwd, chain, orig):
    """The outermost wrapper's forward: the kernel on the frozen weights and every wrapper's
    factors, or peft's own forward (``orig``) where the call or the adapters ask for it."""
    def forward(self, hidden_states, *args, **kwargs):
        adapters = None
        if len(args) == 2 and not kwargs and not parametrize.is_parametrized(mod):  # (plain weights)
            gu, dn = mod.gate_up_proj, mod.down_proj
            if fwd.takes(mod, hidden_states, gu, dn):
                adapters = _peft_adapters(mod, chain)
        if adapters is None:
            return orig(self, hidden_states, *args, **kwargs)
        return fwd.run(hidden_states, *args, gu, dn, adapters)

    return forward


def apply(p, found, ready, compiling, root=None, routers=()) -> None:
    """``found``: (name, module) of every expert module; ``ready()``: the kernel
    (forge.ops.get("experts", backend)), or None where the key is declined; ``root``: the module
    to look for peft's wrappers of the expert weights in; ``routers``: the router modules."""
    if not found:
        if p.wants(KEY):
            p.skip(KEY, f"{p.arch.model_type} has no mixture-of-experts modules", applies=False)
        return
    kernel = ready()
    if kernel is None:
        return
    ks, why = p.stats.counter(KEY), []
    chains = _peft_chain(root, [m for _, m in found]) if root is not None else {}
    for name, mod in found:
        if p.is_replaced(mod):
            continue
        reason = _decline(name, mod)
        if reason:
            why.append(reason)
            continue
        fwd = forward_of(kernel, type(mod._modules["act_fn"]), type(mod).forward, ks, compiling)
        p.replace_forward(mod, KEY, types.MethodType(fwd, mod))
        outer = chains.get(id(mod), [None])[-1]
        if outer is not None and "forward" not in outer.__dict__:  # (not one someone else replaced)
            p.replace_forward(outer, KEY, types.MethodType(peft_forward_of(mod, fwd, chains[id(mod)],
                                                                           type(outer).forward), outer), count=False)
    ops = getattr(kernel, "ops", None)
    for mod in routers if ops is not None and KEY in p.counts else ():
        renorm_attr, cast = ROUTERS[type(mod).__name__]
        if not p.is_replaced(mod):
            p.replace_forward(mod, KEY, types.MethodType(
                router_forward_of(ops, renorm_attr=renorm_attr, cast=cast, compiling=compiling,
                                  orig=type(mod).forward), mod), count=False)
    if why:
        more = f" (+{len(why) - 3} more)" if len(why) > 3 else ""
        p.skip(KEY, f"{len(why)} of {len(found)} expert modules keep their own forward: "
                    + "; ".join(why[:3]) + more)
