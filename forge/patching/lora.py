"""peft LoRA -> forge's fused ``lora_qkv`` and ``lora_mlp`` (called by ``core.patch`` as
``apply(model, patcher)`` before the generic walker, so the modules taken over here are left alone
by the rmsnorm / swiglu / geglu passes).

What is fused: a peft ``lora.Linear`` over a plain ``nn.Linear`` whose one active adapter is
vanilla LoRA: any ``lora_dropout`` (``nn.Dropout``, not in place, or Identity), no DoRA or other
variant, no LoRA bias, not merged, not disabled, no ``fan_in_fan_out``, base weight (and bias)
frozen. Anything else is left to peft and named in ``model._forge_skipped[key]`` (modules that
fit are still fused; counts say how many).

Dropout: when an adapter's ``nn.Dropout`` is in training mode with p > 0 (its own ``training``
flag, as peft reads it), the replaced forward draws that projection's keep-mask with
``forge.spec.lora_dropout.draw`` in peft's order (q, k, v; gate, up, down), on the input's
shape and the adapter's dtype, and hands it to the kernel: with the same RNG state the fused
call drops exactly what peft would. Otherwise no mask: the call is the one without dropout.

- ``lora_mlp``: the MLP module's forward (``down(act(gate(x)) * up(x))`` in every supported
  architecture) becomes one ``lora_mlp`` call; act from the config (silu -> swiglu,
  gelu_pytorch_tanh -> geglu). Count: one per MLP.
- ``lora_qkv``: HF attention forwards call q_proj, k_proj and v_proj one after another on the same
  hidden_states. q_proj's forward computes q, k and v in one fused call and leaves k and v in a
  one-shot slot keyed by the input tensor's identity and version (forge.patching.qkv's slots,
  which its q/k/v fusion uses too); k_proj's and v_proj's forwards take them from the slot, or
  run peft's own forward when the slot does not match (another input, another order, a changed
  input). No per-model code. Count: one per attention module.

Everything is looked up at call time: weights (FSDP2 swaps them), the active adapter, its
scaling, dropout, merge and disable state. A call whose state does not fit (adapters disabled or
merged, another adapter made active that is DoRA, base weights unfrozen, extra arguments,
DTensor weights outside an FSDP2 forward) runs peft's path for that call. Under autocast the
fused call runs in the autocast dtype, as every matmul of eager peft then does.

Adapters added after ``forge.patch``: an adapter added to (or activated on) layers that were LoRA
layers at patch time is picked up at call time, fused when it fits. LoRA layers created after it
(``get_peft_model`` or ``inject_adapter`` on a patched model) are not: ``forge.unpatch`` and
``forge.patch`` again. The replaced forwards are methods bound to the MLP / attention module
(``copy.deepcopy`` of the model rebinds them to the copy) and capture no tensor. A q/k/v slot
that is never taken keeps that layer's k and v alive until the attention's next call.
"""
from __future__ import annotations

import types

import torch
from torch import nn

from ..spec import lora_dropout as _drop
from ..spec import lora_mlp as _mlp_spec
from ..spec import lora_qkv as _qkv_spec
from . import arch as _arch
from .forwards import _compiling
from .qkv import QKV, slot_forwards

_QKV_NAMES = _qkv_spec.TENSORS[:13]  # x, then w, bias, a, b per projection (the masks are keywords)
_MLP_NAMES = _mlp_spec.TENSORS[:10]  # x, then w, a, b per projection
_ACT = {name: act for act, names in (("silu", _arch.GLU_ACTS["swiglu"]), ("gelu_tanh", _arch.GLU_ACTS["geglu"]))
        for name in names}


def _peft_linear():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def misfit(layer, lora_linear, *, bias_ok: bool, call: bool = True) -> str | None:
    """Why ``layer`` cannot run fused (None when it can), in words for ``_forge_skipped``. At
    patch time (``call=False``) the weight's type is not checked (FSDP2 has it sharded until the
    forward). ``fused_params`` is the same test for every call."""
    if type(layer) is not lora_linear:
        return f"{type(layer).__name__} is not a plain peft lora.Linear (quantized or other layer type)"
    base = layer.base_layer
    if type(base) is not nn.Linear:
        return f"base layer is {type(base).__name__}, not nn.Linear"
    if layer.disable_adapters:
        return "adapters are disabled"
    if layer.merged:
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
        if lb._parameters.get("bias") is not None:
            return None
        w, bias, a = base._parameters["weight"], base._parameters["bias"], la._parameters["weight"]
        if w.requires_grad or (bias is not None and (bias.requires_grad or not bias_ok)):
            return None
        if (type(w) is not nn.Parameter and type(w) is not torch.Tensor) or (
                a.dtype != w.dtype and not d.get("cast_input_dtype_enabled", True)):
            return None
        return w, bias, a, lb._parameters["weight"], float(d["scaling"][name]), _p_now(drop)
    except (KeyError, AttributeError, TypeError):  # another peft layout: the readable path
        return None if misfit(layer, lora_linear, bias_ok=bias_ok) else _params(layer)


def _compute_dtype(x, args, kwargs, w):
    """The dtype the fused call runs in, or None to defer to peft. Under autocast that is the
    autocast dtype (eager peft runs every matmul of the layer in it); otherwise x's, which must be
    the base weight's (as F.linear requires)."""
    if args or kwargs:
        return None
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype if x.dtype == w.dtype else None


def _masks(x, names, ps, widths) -> dict:
    """``mask_<name>``/``dropout_<name>`` for the projections with dropout now, drawn in ``names``'
    order as peft's forwards would draw them: on the projection input's shape (x's rows, then
    ``width``) in the adapter's dtype (peft casts the input to lora_A's dtype before dropout)."""
    out = {}
    for name, p, width in zip(names, ps, widths):
        if p[5]:
            out[f"mask_{name}"] = _drop.draw((*x.shape[:-1], width), p[5], p[2].dtype, x.device)
            out[f"dropout_{name}"] = p[5]
    return out


def _cast(dtype, *ts):
    # autocast's casts, done here once (differentiable: fp32 adapters get fp32 gradients)
    return [t if t is None or t.dtype == dtype else t.to(dtype) for t in ts]


# ------------------------------------------------------------------------------------ mlp
def _mlp_forward(kernel, act, act_types, lora_linear, ks):
    """``act_types``: the act_fn classes computing ``act``; a call finding another (act_fn
    swapped after patching) runs the module's own forward."""
    def forward(self, x, *args, **kwargs):
        mods = self._modules
        ps = [fused_params(mods[n], lora_linear, False) for n in _arch.MLP_PROJ]
        if None in ps or type(mods.get("act_fn")) not in act_types:
            if not _compiling():
                ks.fallback += 1
            return type(self).forward(self, x, *args, **kwargs)
        (wg, _, ag, bg, sg, _), (wu, _, au, bu, su, _), (wd, _, ad, bd, sd, _) = ps
        cd = _compute_dtype(x, args, kwargs, wg)
        if cd is None or not (ag.dtype == au.dtype == ad.dtype):
            if not _compiling():
                ks.fallback += 1
            return type(self).forward(self, x, *args, **kwargs)
        ts = (x, wg, ag, bg, wu, au, bu, wd, ad, bd)
        if torch.is_autocast_enabled(x.device.type):
            ts = _cast(cd, *ts)
        drop = _masks(x, ("gate", "up", "down"), ps, (x.shape[-1], x.shape[-1], wg.shape[0]))
        if not _compiling():
            ks.fused += 1
        # every tensor bound to its spec name (forge.spec.lora_mlp.TENSORS), never by position
        return kernel(**dict(zip(_MLP_NAMES, ts)), scale_gate=sg, scale_up=su, scale_down=sd, act=act, **drop)

    return forward


# ------------------------------------------------------------------------------------ qkv
def _qkv_forwards(kernel, lora_linear, ks):
    """(q_proj forward, k_proj forward, v_proj forward), each bound to the attention module:
    q, k and v from one fused call, handed on through forge.patching.qkv's slots."""
    def compute(attn, x, args, kwargs):
        ps = [fused_params(attn._modules[n], lora_linear, True) for n in QKV]
        if None in ps:
            return None
        cd = _compute_dtype(x, args, kwargs, ps[0][0])
        if cd is None or not ps[0][2].dtype == ps[1][2].dtype == ps[2][2].dtype:
            return None
        ts = [x] + [t for w, bias, a, b, _, _ in ps for t in (w, bias, a, b)]
        if torch.is_autocast_enabled(x.device.type):
            ts = _cast(cd, *ts)
        drop = _masks(x, "qkv", ps, (x.shape[-1],) * 3)
        # every tensor bound to its spec name (forge.spec.lora_qkv.TENSORS)
        return kernel(**dict(zip(_QKV_NAMES, ts)), scale_q=ps[0][4], scale_k=ps[1][4], scale_v=ps[2][4], **drop)

    return slot_forwards(compute, ks)


# ------------------------------------------------------------------------------------ apply
def _hf_code(mod) -> bool:
    return getattr(type(mod).forward, "__module__", "").startswith("transformers.")


def _free(mod) -> bool:
    # an instance-level forward means someone else (forge, accelerate hooks) already owns it
    return "forward" not in mod.__dict__


def _ready(p, key, found):
    if not p.wants(key) or not found:
        return None
    try:
        return p.kernel(key)
    except Exception as e:  # noqa: BLE001  (a missing backend is a skip, never a crash)
        p.skip(key, f"{key}: {e}")
        return None


def apply(model, p) -> None:
    """Replace the forwards of LoRA'd attention and MLP modules of ``model`` (see module doc)."""
    lora_linear = _peft_linear()
    if lora_linear is None:
        for key in ("lora_qkv", "lora_mlp"):
            if p.wants(key):
                p.skip(key, "peft is not importable")
        return
    found = {"lora_qkv": [], "lora_mlp": []}
    partial = {"lora_qkv": [], "lora_mlp": []}
    for name, mod in model.named_modules():
        cname = type(mod).__name__
        for key, suffix, names in (("lora_qkv", _arch.ATTN_SUFFIX, QKV),
                                   ("lora_mlp", _arch.MLP_SUFFIX, _arch.MLP_PROJ)):
            if not cname.endswith(suffix):
                continue
            has = [n for n in names if isinstance(getattr(mod, n, None), lora_linear)]
            if len(has) == len(names):
                found[key].append((name, mod))
            elif has:  # e.g. peft's default target_modules: q_proj and v_proj only
                missing = [n for n in names if n not in has]
                partial[key].append(f"{name}: no LoRA on {', '.join(missing)}")
    _apply_mlp(model, p, found["lora_mlp"], lora_linear, partial["lora_mlp"])
    _apply_qkv(p, found["lora_qkv"], lora_linear, partial["lora_qkv"])


def _split(mods, names, lora_linear, bias_ok):
    """(modules whose layers all fit, ["name.layer: reason", ...] for the others)."""
    fit, why = [], []
    for name, mod in mods:
        bad = next(((n, w) for n in names
                    if (w := misfit(getattr(mod, n), lora_linear, bias_ok=bias_ok, call=False))), None)
        if bad is None:
            fit.append(mod)
        else:
            why.append(f"{name}.{bad[0]}: {bad[1]}")
    return fit, why


def _skip_some(p, key, why, total, what):
    if why:
        more = f" (+{len(why) - 3} more)" if len(why) > 3 else ""
        p.skip(key, f"{len(why)} of {total} {what} left to peft: " + "; ".join(why[:3]) + more)


def _apply_mlp(model, p, mlps, lora_linear, partial):
    key = "lora_mlp"
    if not p.wants(key) or not (mlps or partial):
        return
    act_name = getattr(model.config, p.arch.act_attr, None)
    act = _ACT.get(act_name)
    if act is None:
        p.skip(key, f"config.{p.arch.act_attr}={act_name!r}: the fused MLP computes silu or gelu_pytorch_tanh only")
        return
    free = [(n, m) for n, m in mlps if _free(m) and not p.is_replaced(m)]
    # the activation the MLP calls, whatever the config names (a user may swap act_fn)
    glu = "swiglu" if act == "silu" else "geglu"
    swapped = [f"{n}: act_fn is {type(m._modules.get('act_fn')).__name__}, not the config's {act_name}"
               for n, m in free if _arch.glu_of(m._modules.get("act_fn")) != glu]
    free = [(n, m) for n, m in free if _arch.glu_of(m._modules.get("act_fn")) == glu]
    # the fused call computes down(act(gate(x)) * up(x)): trust that only in transformers' own code
    why = swapped + [f"{n}: {type(m).__name__}.forward is not transformers' own" for n, m in free if not _hf_code(m)]
    fit, bad = _split([(n, m) for n, m in free if _hf_code(m)], _arch.MLP_PROJ, lora_linear, bias_ok=False)
    why = partial + why + bad
    kernel = _ready(p, key, fit)
    if kernel is not None:
        act_types = frozenset(type(m._modules["act_fn"]) for m in fit)
        fwd = _mlp_forward(kernel, act, act_types, lora_linear, p.stats.counter(key))
        for mod in fit:
            p.replace_forward(mod, key, types.MethodType(fwd, mod))
    _skip_some(p, key, why, len(mlps) + len(partial), "LoRA MLPs")


def _apply_qkv(p, attns, lora_linear, partial):
    key = "lora_qkv"
    if not p.wants(key) or not (attns or partial):
        return
    free = [(n, m) for n, m in attns if all(_free(getattr(m, x)) for x in QKV)]
    fit, why = _split(free, QKV, lora_linear, bias_ok=True)
    why = partial + why
    kernel = _ready(p, key, fit)
    if kernel is not None:
        q_fwd, k_fwd, v_fwd = _qkv_forwards(kernel, lora_linear, p.stats.counter(key))
        for attn in fit:
            p.replace_forward(attn.q_proj, key, types.MethodType(q_fwd, attn))
            # (q_proj carries the one count per attention module: one fused call per forward)
            p.replace_forward(attn.k_proj, key, types.MethodType(k_fwd, attn), count=False)
            p.replace_forward(attn.v_proj, key, types.MethodType(v_fwd, attn), count=False)
    _skip_some(p, key, why, len(attns) + len(partial), "LoRA attention modules")
