"""Which peft LoRA layers (and plain projections beside them) the fused LoRA kernels can run, in
words at patch time (:func:`misfit`, :func:`plain_misfit`) and as a fast test on every call
(:func:`fused_params`, :func:`plain_params`, :func:`proj_params`), which return what the kernel
reads: ``(w, bias, a, b, scale, dropout p now)``; a plain projection has ``a = b = None``.
"""
from __future__ import annotations

import torch
from torch import nn

from . import copying


def peft_linear():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def _hooked(mod) -> bool:
    """``mod`` has hooks or a forward of its own instance (peft's per-call ``adapter_names``
    pre-hooks, accelerate's offloading hooks, a user's hook): the fused kernels read its weights
    without calling it, so its own code must run instead."""
    d = mod.__dict__  # (an nn.Module's hook dicts are always there; read on every call: no getattr)
    if d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]:
        return True
    f = d.get("forward")
    return f is not None and not copying.ours(f)  # (forge's own: the q/k/v slots, lora_o's)


def _hooked_reason(*mods) -> str | None:
    for m in mods:
        if m is not None and _hooked(m):
            return (f"{type(m).__name__} has hooks or its own forward (peft's adapter_names, accelerate's "
                    "offloading, a user's hook): its code runs, not the kernels' direct weight reads")
    return None


def misfit(layer, lora_linear, *, bias_ok: bool, call: bool = True) -> str | None:
    """Why ``layer`` cannot run fused (None when it can), in words for ``_forge_skipped``. At
    patch time (``call=False``) the weight's type is not checked (FSDP2 has it sharded until the
    forward). ``fused_params`` is the same test for every call."""
    if type(layer) is not lora_linear:
        return f"{type(layer).__name__} is not a plain peft lora.Linear (quantized or other layer type)"
    base = layer.base_layer
    if type(base) is not nn.Linear:
        return f"base layer is {type(base).__name__}, not nn.Linear"
    # (states a call checks: patched while merged or disabled, the layer fuses once unmerged or
    # enabled again, as one patched before does; a deep copy patches itself in the state it has)
    if call and layer.disable_adapters:
        return "adapters are disabled"
    if call and layer.merged:
        return "the adapter is merged into the base weight"
    active = layer.active_adapters
    if len(active) != 1:
        return f"{len(active)} active adapters (the fused kernel takes exactly one)"
    name = active[0]
    if name not in layer.lora_A:
        return f"active adapter {name!r} has no LoRA weights on this layer"
    if layer.use_dora.get(name, False) or name in layer.lora_variant:
        return f"adapter {name!r} is DoRA or another LoRA variant"
    drop = layer.lora_dropout[name]
    if type(drop) is not nn.Identity and type(drop) is not nn.Dropout:
        return f"adapter {name!r} has a lora_dropout of type {type(drop).__name__} (fused: nn.Dropout or Identity)"
    if getattr(drop, "inplace", False):
        return f"adapter {name!r} has an in-place lora_dropout (it would edit the layer's input)"
    if layer.lora_bias.get(name, False) or layer.lora_B[name].bias is not None or layer.lora_A[name].bias is not None:
        return f"adapter {name!r} has a LoRA bias"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out layer"
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "base weight is trainable (the fused kernels keep it frozen)"
    if base.bias is not None and not bias_ok:
        return "base layer has a bias"
    hooked = _hooked_reason(layer, base, layer.lora_A[name], layer.lora_B[name])
    if hooked:
        return hooked
    if base.weight.is_meta:
        return "base weight is on the meta device (offloaded or not loaded)"
    a = layer.lora_A[name].weight
    if call and type(base.weight) is not nn.Parameter and type(base.weight) is not torch.Tensor:
        return f"base weight is a {type(base.weight).__name__} (sharded or quantized)"
    if a.dtype != base.weight.dtype and not getattr(layer, "cast_input_dtype_enabled", True):
        return "input dtype casting is disabled with adapters in another dtype"
    return None


def _p_now(drop) -> float:
    """The dropout probability a call applies now: peft reads the Dropout module's own mode."""
    return float(drop.p) if type(drop) is nn.Dropout and drop.training and drop.p > 0 else 0.0


def _params(layer):
    """(w, bias, a, b, scale, dropout p now) of the active adapter, read now."""
    name = layer.active_adapters[0]
    base = layer.base_layer
    return (base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name]),
            _p_now(layer.lora_dropout[name]))


def fused_params(layer, lora_linear, bias_ok: bool):
    """(w, bias, a, b, scale, p) if ``layer`` can run fused now, else None: ``misfit`` with
    ``call=True`` and ``_params`` in one pass over the instance ``__dict__`` (nn.Module attribute
    lookups made the readable version cost ~100 us a layer on a slow host, every forward).
    FSDP2 swaps parameters through ``_parameters`` too, so this sees what it installed."""
    if type(layer) is not lora_linear:
        return None
    d = layer.__dict__
    try:
        if d["_disable_adapters"] or d["merged_adapters"] or d.get("fan_in_fan_out"):
            return None
        name = d["_active_adapter"]
        if not isinstance(name, str):
            if len(name) != 1:
                return None
            name = name[0]
        mods = d["_modules"]
        la = mods["lora_A"]._modules.get(name)
        if la is None or name in d.get("lora_variant", ()) or d["use_dora"].get(name):
            return None
        if d.get("lora_bias", {}).get(name):
            return None
        drop = mods["lora_dropout"]._modules[name]
        dt = type(drop)
        if dt is not nn.Identity and (dt is not nn.Dropout or drop.inplace):
            return None
        lb, base = mods["lora_B"]._modules[name], mods["base_layer"]
        if type(base) is not nn.Linear or la._parameters.get("bias") is not None:
            return None
        if _hooked(layer) or _hooked(base) or _hooked(la) or _hooked(lb):
            return None
        if lb._parameters.get("bias") is not None:
            return None
        w, bias, a = base._parameters["weight"], base._parameters["bias"], la._parameters["weight"]
        if w.requires_grad or (bias is not None and (bias.requires_grad or not bias_ok)) or w.is_meta:
            return None
        if (type(w) is not nn.Parameter and type(w) is not torch.Tensor) or (
                a.dtype != w.dtype and not d.get("cast_input_dtype_enabled", True)):
            return None
        return w, bias, a, lb._parameters["weight"], float(d["scaling"][name]), _p_now(drop)
    except (KeyError, AttributeError, TypeError):  # another peft layout: the readable path
        return None if misfit(layer, lora_linear, bias_ok=bias_ok) else _params(layer)


def plain_misfit(mod, *, bias_ok: bool, call: bool = True) -> str | None:
    """Why the projection ``mod`` without an adapter cannot run its base product inside a fused
    call (None when it can)."""
    if type(mod) is not nn.Linear:
        return f"{type(mod).__name__} is neither a peft lora.Linear nor a plain nn.Linear"
    if mod.weight.requires_grad or (mod.bias is not None and mod.bias.requires_grad):
        return "weight is trainable (the fused kernels keep base weights frozen)"
    if mod.bias is not None and not bias_ok:
        return "has a bias"
    hooked = _hooked_reason(mod)
    if hooked:
        return hooked
    if mod.weight.is_meta:
        return "weight is on the meta device (offloaded or not loaded)"
    if call and type(mod.weight) is not nn.Parameter and type(mod.weight) is not torch.Tensor:
        return f"weight is a {type(mod.weight).__name__} (sharded or quantized)"
    return None


def plain_params(mod, bias_ok: bool):
    """(w, bias, None, None, 1.0, 0.0) if the plain projection ``mod`` fits now, else None."""
    if type(mod) is not nn.Linear:
        return None
    ps = mod._parameters
    w, bias = ps["weight"], ps["bias"]
    if w.requires_grad or (bias is not None and (bias.requires_grad or not bias_ok)) or w.is_meta or _hooked(mod):
        return None
    if type(w) is not nn.Parameter and type(w) is not torch.Tensor:
        return None
    return w, bias, None, None, 1.0, 0.0


def proj_params(mod, lora_linear, bias_ok: bool):
    """The call's parameters of one projection of a fused call: a LoRA layer's, or a plain
    projection's (its base product only); None when it does not fit now."""
    if type(mod) is lora_linear:
        return fused_params(mod, lora_linear, bias_ok)
    return plain_params(mod, bias_ok)


def proj_misfit(mod, lora_linear, *, bias_ok: bool) -> str | None:
    """Patch time: :func:`misfit` for a LoRA layer, :func:`plain_misfit` for anything else."""
    if isinstance(mod, lora_linear):
        return misfit(mod, lora_linear, bias_ok=bias_ok, call=False)
    return plain_misfit(mod, bias_ok=bias_ok, call=False)
