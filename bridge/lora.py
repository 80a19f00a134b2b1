"""LoRA kernels through the bridge: ``forge_pallas.lora`` on torch tensors, in the signatures of
forge/spec/lora_qkv.py and forge/spec/lora_mlp.py.

Base weights and biases are frozen (no gradient, ValueError if one requires grad while grad is
enabled). Biases: all three None uses the no-bias
kernel; some None are replaced by zeros. Zero rows return the spec's torch reference.

lora_dropout: the bool keep-masks go in after the weights, as uint8 views of the same memory
(one byte an element, saved for backward like any input), and the static ``drops`` carries each
projection's scale (forge/spec/lora_dropout.py), None for a projection without a mask.
"""
from __future__ import annotations

import torch

from forge.spec import lora_dropout as drop_spec
from forge.spec import lora_mlp as mlp_spec
from forge.spec import lora_qkv as qkv_spec
from forge_pallas import lora as _k

from . import core
from .kernels import check_devices, checked

# The kernels' inputs, by the spec's names (forge.spec.lora_qkv.TENSORS, lora_mlp.TENSORS): x, then
# per projection w, bias, a, b (w, a, b without biases), then the masks that are given. Which
# positions are differentiable and saved follows from the names, never written as positions.
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
    return (name, static, *((None,) if t is None else (t.shape, t.dtype, t.device) for t in tensors))


def _drops(masks, widths, ps):
    """(uint8 (M, width) keep-masks of the projections that have one, their static ``drops``)."""
    rows = [drop_spec.rows(m, w) for m, w in zip(masks, widths)]
    return ([m.view(torch.uint8) for m in rows if m is not None],
            tuple(None if m is None else drop_spec.scale(float(p)) for m, p in zip(rows, ps)))


def _check_qkv(ts, scales, drop):
    qkv_spec.check(*ts, scale_q=scales[0], scale_k=scales[1], scale_v=scales[2], **drop)
    check_devices(**{n: t for n, t in zip(QKV_INPUTS, ts) if t is not None})


def lora_qkv(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
             *, scale_q, scale_k, scale_v, mask_q=None, mask_k=None, mask_v=None,
             dropout_q=0.0, dropout_k=0.0, dropout_v=0.0):
    """Pallas LoRA q, k, v projections (forge.spec.lora_qkv) -> (q, k, v)."""
    ts = (x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v)
    scales = (scale_q, scale_k, scale_v)
    drop = dict(mask_q=mask_q, mask_k=mask_k, mask_v=mask_v, dropout_q=dropout_q, dropout_k=dropout_k,
                dropout_v=dropout_v)
    sig = _sig("lora_qkv", ts + (mask_q, mask_k, mask_v), (scales, dropout_q, dropout_k, dropout_v))
    checked(sig, _check_qkv, ts, scales, drop)
    qkv_spec.frozen(torch.is_grad_enabled(), w_q=w_q, bias_q=bias_q, w_k=w_k, bias_k=bias_k, w_v=w_v, bias_v=bias_v)
    if x.numel() == 0:
        return qkv_spec.reference(*ts, scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, **drop)
    x2 = x.reshape(-1, x.shape[-1])  # (M, H)
    scales = tuple(float(s) for s in scales)
    keeps, drops = _drops((mask_q, mask_k, mask_v), (x.shape[-1],) * 3, (dropout_q, dropout_k, dropout_v))
    extra = {} if not keeps else {"drops": drops}  # no masks: the very call (and compile) of before
    projs = ((w_q, bias_q, a_q, b_q), (w_k, bias_k, a_k, b_k), (w_v, bias_v, a_v, b_v))
    if all(p[1] is None for p in projs):
        flat = [t for w, _, a, b in projs for t in (w, a, b)]
        outs = core.apply(LORA_QKV_NOBIAS, x2, *flat, *keeps, scales=scales, has_bias=False, **extra)
    else:
        flat = [t for w, bias, a, b in projs
                for t in (w, bias if bias is not None else w.new_zeros(w.shape[0]), a, b)]
        outs = core.apply(LORA_QKV, x2, *flat, *keeps, scales=scales, has_bias=True, **extra)
    lead = x.shape[:-1]
    return tuple(o.view(*lead, o.shape[-1]) for o in outs)


def _check_mlp(ts, scales, act, drop):
    mlp_spec.check(*ts, scale_gate=scales[0], scale_up=scales[1], scale_down=scales[2], act=act, **drop)
    check_devices(**dict(zip(MLP_INPUTS, ts)))


def lora_mlp(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
             *, scale_gate, scale_up, scale_down, act="silu", mask_gate=None, mask_up=None, mask_down=None,
             dropout_gate=0.0, dropout_up=0.0, dropout_down=0.0):
    """Pallas gated MLP with LoRA on gate, up and down (forge.spec.lora_mlp) -> y."""
    ts = (x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down)
    scales = (scale_gate, scale_up, scale_down)
    drop = dict(mask_gate=mask_gate, mask_up=mask_up, mask_down=mask_down, dropout_gate=dropout_gate,
                dropout_up=dropout_up, dropout_down=dropout_down)
    sig = _sig("lora_mlp", ts + (mask_gate, mask_up, mask_down), (scales, act, dropout_gate, dropout_up, dropout_down))
    checked(sig, _check_mlp, ts, scales, act, drop)
    mlp_spec.frozen(torch.is_grad_enabled(), w_gate=w_gate, w_up=w_up, w_down=w_down)
    if x.numel() == 0:
        return mlp_spec.reference(*ts, scale_gate=scale_gate, scale_up=scale_up, scale_down=scale_down, act=act,
                                  **drop)
    h, inter = x.shape[-1], w_gate.shape[0]
    keeps, drops = _drops((mask_gate, mask_up, mask_down), (h, h, inter), (dropout_gate, dropout_up, dropout_down))
    extra = {} if not keeps else {"drops": drops}
    y = core.apply(LORA_MLP, x.reshape(-1, h), *ts[1:], *keeps, scales=tuple(float(s) for s in scales),
                   gelu=act == "gelu_tanh", **extra)
    return y.view(*x.shape[:-1], y.shape[-1])
