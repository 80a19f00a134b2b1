"""LoRA kernels through the bridge: ``forge_pallas.lora`` on torch tensors, in the signatures of
forge/spec/lora_qkv.py, lora_o.py and lora_mlp.py.

Base weights and biases are frozen (no gradient, ValueError if one requires grad while grad is
enabled). Biases: all three None uses the no-bias kernel; some None are replaced by zeros.
Zero rows return the spec's torch reference.

The kernels' inputs sit at fixed positions (their names are the spec's), so which of them are
differentiable and saved is fixed per kernel: a projection without an adapter, and the seed of
a call without dropout, take a base weight in their place (the static ``adapters`` and
``drops`` say nothing reads it). The seed goes in as its two int32 words (JAX without x64 would
narrow an int64); ``drops`` carries each projection's salt word, threshold and scale
(forge/spec/lora_dropout.py), None for a projection without dropout.
"""
from __future__ import annotations

import torch

from forge.spec import lora_dropout as drop_spec
from forge.spec import lora_mlp as mlp_spec
from forge.spec import lora_o as o_spec
from forge.spec import lora_qkv as qkv_spec
from forge_pallas import lora as _k

from . import core
from .kernels import check_devices, checked

# The kernels' inputs, by the spec's names (forge.spec.lora_qkv.TENSORS, lora_mlp.TENSORS): x, then
# per projection w, bias, a, b (w, a, b without biases), then the seed. Which positions are
# differentiable and saved follows from the names, never written as positions.
QKV_INPUTS = qkv_spec.TENSORS
QKV_INPUTS_NOBIAS = tuple(n for n in qkv_spec.TENSORS if not n.startswith("bias_"))
MLP_INPUTS = mlp_spec.TENSORS


def _at(names, wanted) -> tuple:
    return tuple(i for i, n in enumerate(names) if n in wanted)


LORA_QKV = core.KernelDef("lora_qkv", _k.lora_qkv_fwd, _k.lora_qkv_bwd, diff=_at(QKV_INPUTS, qkv_spec.TRAINABLE),
                          save=_at(QKV_INPUTS, set(QKV_INPUTS) - {"bias_q", "bias_k", "bias_v"}), needs_mask=True)
LORA_QKV_NOBIAS = core.KernelDef("lora_qkv_nobias", _k.lora_qkv_fwd, _k.lora_qkv_bwd,
                                 diff=_at(QKV_INPUTS_NOBIAS, qkv_spec.TRAINABLE), needs_mask=True)
LORA_MLP = core.KernelDef("lora_mlp", _k.lora_mlp_fwd, _k.lora_mlp_bwd, diff=_at(MLP_INPUTS, mlp_spec.TRAINABLE),
                          needs_mask=True)


def _sig(name, tensors, static):
    return (name, static, *((t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else (type(t),)
                            for t in tensors))


def _drops(names, ps) -> tuple:
    """Per projection (salt word, threshold, scale) of its dropout, or None."""
    return tuple((drop_spec.salt_word(drop_spec.SALT[n]), drop_spec.threshold(p), drop_spec.scale(p)) if p else None
                 for n, p in zip(names, ps))


def _seed_words(seed, ps, filler):
    return drop_spec.words(seed) if seed is not None and any(ps) else filler


def _static(names, adapters, ps) -> dict:
    """The static keywords for adapters and dropout, left out when they are the defaults (every
    adapter, no dropout: the very call, and compile, of a plain model)."""
    out = {}
    if not all(adapters):
        out["adapters"] = tuple(adapters)
    if any(ps):
        out["drops"] = _drops(names, ps)
    return out


def _check_qkv(ts, scales, drop):
    qkv_spec.check(*ts, scale_q=scales[0], scale_k=scales[1], scale_v=scales[2], **drop)
    check_devices(**{n: t for n, t in zip(QKV_INPUTS, ts) if t is not None})


def lora_qkv(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
             *, scale_q, scale_k, scale_v, seed=None, dropout_q=0.0, dropout_k=0.0, dropout_v=0.0):
    """Pallas LoRA q, k, v projections (forge.spec.lora_qkv) -> (q, k, v)."""
    ts = (x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v)
    scales = (scale_q, scale_k, scale_v)
    drop = dict(seed=seed, dropout_q=dropout_q, dropout_k=dropout_k, dropout_v=dropout_v)
    ps = (dropout_q, dropout_k, dropout_v)
    sig = _sig("lora_qkv", ts + (seed,), (scales, ps))
    checked(sig, _check_qkv, ts, scales, drop)
    qkv_spec.frozen(torch.is_grad_enabled(), w_q=w_q, bias_q=bias_q, w_k=w_k, bias_k=bias_k, w_v=w_v, bias_v=bias_v)
    adapters = tuple(a is not None for a in (a_q, a_k, a_v))
    if x.numel() == 0 or not any(adapters):
        return qkv_spec.reference(*ts, scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, **drop)
    x2 = x.reshape(-1, x.shape[-1])  # (M, H)
    projs = ((w_q, bias_q, a_q, b_q), (w_k, bias_k, a_k, b_k), (w_v, bias_v, a_v, b_v))
    seed_in = _seed_words(seed, ps, w_q)
    static = dict(scales=tuple(float(s) for s in scales), **_static(qkv_spec.PROJ, adapters, ps))
    if all(p[1] is None for p in projs):
        flat = [t for w, _, a, b in projs for t in (w, w if a is None else a, w if b is None else b)]
        outs = core.apply(LORA_QKV_NOBIAS, x2, *flat, seed_in, has_bias=False, **static)
    else:
        flat = [t for w, bias, a, b in projs
                for t in (w, bias if bias is not None else w.new_zeros(w.shape[0]), w if a is None else a,
                          w if b is None else b)]
        outs = core.apply(LORA_QKV, x2, *flat, seed_in, has_bias=True, **static)
    lead = x.shape[:-1]
    return tuple(o.view(*lead, o.shape[-1]) for o in outs)


def _check_mlp(ts, scales, act, drop):
    mlp_spec.check(*ts, scale_gate=scales[0], scale_up=scales[1], scale_down=scales[2], act=act, **drop)
    check_devices(**{n: t for n, t in zip(MLP_INPUTS, ts) if t is not None})


def lora_mlp(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
             *, scale_gate, scale_up, scale_down, act="silu", seed=None, dropout_gate=0.0, dropout_up=0.0,
             dropout_down=0.0, recompute=False):
    """Pallas gated MLP with LoRA on gate, up and down (forge.spec.lora_mlp) -> y. ``recompute``:
    keep x, not the (M, I) pre-activations, for the backward (two products more there)."""
    ts = (x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down)
    scales = (scale_gate, scale_up, scale_down)
    drop = dict(seed=seed, dropout_gate=dropout_gate, dropout_up=dropout_up, dropout_down=dropout_down)
    ps = (dropout_gate, dropout_up, dropout_down)
    sig = _sig("lora_mlp", ts + (seed,), (scales, act, ps))
    checked(sig, _check_mlp, ts, scales, act, drop)
    mlp_spec.frozen(torch.is_grad_enabled(), w_gate=w_gate, w_up=w_up, w_down=w_down)
    adapters = tuple(a is not None for a in (a_gate, a_up, a_down))
    if x.numel() == 0:
        return mlp_spec.reference(*ts, scale_gate=scale_gate, scale_up=scale_up, scale_down=scale_down, act=act,
                                  **drop)
    flat = []
    for w, a, b in ((w_gate, a_gate, b_gate), (w_up, a_up, b_up), (w_down, a_down, b_down)):
        flat += [w, w if a is None else a, w if b is None else b]
    h = x.shape[-1]
    y = core.apply(LORA_MLP, x.reshape(-1, h), *flat, _seed_words(seed, ps, w_gate),
                   scales=tuple(float(s) for s in scales), gelu=act == "gelu_tanh", recompute=bool(recompute),
                   **_static(mlp_spec.PROJ, adapters, ps))
    return y.view(*x.shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------------------------- o
O_INPUTS = o_spec.TENSORS
O_INPUTS_NOBIAS = tuple(n for n in o_spec.TENSORS if n != "bias")
LORA_O = core.KernelDef("lora_o", _k.lora_o_fwd, _k.lora_o_bwd, diff=_at(O_INPUTS, o_spec.TRAINABLE),
                        save=_at(O_INPUTS, set(O_INPUTS) - {"bias"}), needs_mask=True)
LORA_O_NOBIAS = core.KernelDef("lora_o_nobias", _k.lora_o_fwd, _k.lora_o_bwd,
                               diff=_at(O_INPUTS_NOBIAS, o_spec.TRAINABLE), needs_mask=True)


def _check_o(ts, scale, drop):
    o_spec.check(*ts, scale=scale, **drop)
    check_devices(**{n: t for n, t in zip(O_INPUTS, ts) if t is not None})


def lora_o(x, w, bias, a, b, *, scale, seed=None, dropout=0.0):
    """Pallas LoRA linear (forge.spec.lora_o) -> y."""
    ts = (x, w, bias, a, b)
    drop = dict(seed=seed, dropout=dropout)
    checked(_sig("lora_o", ts + (seed,), (scale, dropout)), _check_o, ts, scale, drop)
    o_spec.frozen(torch.is_grad_enabled(), w=w, bias=bias)
    if x.numel() == 0:
        return o_spec.reference(*ts, scale=scale, **drop)
    static = {"drop": _drops(("o",), (dropout,))[0]} if dropout else {}
    k = x.shape[-1]
    seed_in = _seed_words(seed, (dropout,), w)
    if bias is None:
        y = core.apply(LORA_O_NOBIAS, x.reshape(-1, k), w, a, b, seed_in, scale=float(scale), has_bias=False, **static)
    else:
        y = core.apply(LORA_O, x.reshape(-1, k), w, bias, a, b, seed_in, scale=float(scale), has_bias=True, **static)
    return y.view(*x.shape[:-1], y.shape[-1])
