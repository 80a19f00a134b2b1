"""Fused LoRA projections as JAX + Pallas: ``lora_qkv``, ``lora_o`` and ``lora_mlp`` (specs,
signatures and backward derivations: forge/spec/lora_qkv.py, lora_o.py, lora_mlp.py; the
kernels: forge_pallas/lora_kernels.py). Pure JAX, no torch.

The large matrix products are XLA ``dot`` s (cuBLAS-class GEMMs on the GPU; natively launched,
bridge/native.py runs them as torch's products). Pallas kernels fuse what sits around them: the
rank-r up-projection ``bias + scale * xa B^T`` is added onto a base GEMM's output tile by tile
(``lora_add``); gate's and up's terms, then act(g) * u, are one pass (``lora_glu_fwd``); the down
adapter's term of dh, the activation's recompute and its derivative another (``lora_glu_bwd``);
the adapters' down-projection (``lora_down``), its gradient (``lora_grad_a``) and the adapters'
part of the input's gradient (``lora_dx``) read the input once for every adapter, dropping each
adapter's copy in registers where it has dropout. One jitted fwd and one jitted bwd per kernel
(the bridge jits them, or launches them natively).

Rounding: the adapters are read in x's dtype (peft's fp32 adapters on a bf16 model are rounded
to bf16), every adapter product takes x-dtype operands with fp32 accumulation and the adapters'
gradients come out in their own dtype (fp32 for fp32 adapters); g and u are rounded to x's dtype
before act, act(g) before the product, as eager Hugging Face does.

Inputs come flat: x, then per projection w, [bias,] a, b, then the seed (two int32 words). A
projection without an adapter (static ``adapters`` False) and a call without dropout hand any
array in those places (the bridge passes a base weight); nothing reads it. ``drops`` holds, per
projection, ``(salt word, threshold, scale)`` of its dropout or None (forge/spec/lora_dropout.py).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import _common as C
from . import lora_kernels as K

PROJ = 3  # q, k, v


def _base(x2, w):  # (M, H) @ (N, H)^T -> (M, N) in x's dtype, XLA GEMM
    return lax.dot_general(x2, w, (((1,), (1,)), ((), ())), precision=K.precision(x2.dtype))


def _slots(ranks, drops):
    """The kernels' static slots: (column offset, rank, salt word, threshold, scale or None)."""
    out, off = [], 0
    for r, d in zip(ranks, drops):
        out.append((off, r, *(d if d is not None else (0, 0, None))))
        off += r
    return tuple(out)


def _dropping(slots) -> bool:
    return any(s[4] is not None for s in slots)


def _parts(m: int, k: int) -> int:
    """Row parts of lora_grad_a: about two programs per core over the column blocks."""
    return max(1, min(C.cdiv(m, K.DOWN_BLOCK_M), C.cdiv(2 * C.num_cores(), C.cdiv(k, K.DOWN_BLOCK_K))))


def _down(x, a_list, slots, seed):
    """(xa (M, R), a_cat (R, K)): every adapter's down-projection of x in x's dtype, and their A
    stacked in x's dtype. Without dropout one XLA product; with it one kernel."""
    a_cat = jnp.concatenate(a_list).astype(x.dtype) if len(a_list) > 1 else a_list[0].astype(x.dtype)
    if not _dropping(slots):
        return K.dot(x, a_cat, ((1,), (1,))).astype(x.dtype), a_cat
    return K.lora_down(x, a_cat, seed, slots=slots), a_cat


def _grads_a(x, dxa, a_list, slots, seed, ldt):
    """[d a_i] = [dxa_i^T drop_i(x)] in the adapters' dtype."""
    if _dropping(slots):
        ga = K.lora_grad_a(x, dxa, seed, slots=slots, parts=_parts(x.shape[0], x.shape[1]))
    else:
        ga = K.dot(dxa, x, ((0,), (0,)))  # (R, K): a sum over rows, fp32
    return [ga[off:off + r].astype(ldt) for off, r, *_ in slots]


def _dxa(g, b, s, dt):
    return (s * K.dot(g, b.astype(dt))).astype(dt)  # (M, r) = s g B


def _grad_b(g, xa_p, s, ldt):
    return (s * K.dot(g, xa_p, ((0,), (0,)))).astype(ldt)  # (N, r) = s g^T xa


# ---------------------------------------------------------------------------------------- qkv
def _split_qkv(inputs, has_bias):
    """(x, [(w, bias, a, b)] * 3, seed) from the flat input tuple."""
    x, rest = inputs[0], inputs[1:]
    step = 4 if has_bias else 3
    projs = []
    for p in range(PROJ):
        t = rest[p * step:(p + 1) * step]
        projs.append(tuple(t) if has_bias else (t[0], None, t[1], t[2]))
    return x, projs, rest[PROJ * step]


def lora_qkv_fwd(*inputs, scales, has_bias, adapters=(True,) * PROJ, drops=(None,) * PROJ):
    """-> ((q, k, v), (xa,)); xa (M, R) the adapters' down-projections of x."""
    x, projs, seed = _split_qkv(inputs, has_bias)
    idx = [i for i in range(PROJ) if adapters[i]]
    slots = _slots([projs[i][2].shape[0] for i in idx], [drops[i] for i in idx])
    xa, _ = _down(x, [projs[i][2] for i in idx], slots, seed)
    outs = []
    for i, (w, bias, _, b) in enumerate(projs):
        if i in idx:
            off = slots[idx.index(i)][0]
            outs.append(K.lora_add(_base(x, w), bias, xa, b, col=off, scale=scales[i]))
        else:
            base = _base(x, w)
            outs.append(base if bias is None else (base.astype(C.acc_dtype(x.dtype)) + bias).astype(x.dtype))
    return tuple(outs), (xa,)


def lora_qkv_bwd(inputs, res, grads, *, scales, has_bias, needs, adapters=(True,) * PROJ, drops=(None,) * PROJ):
    """-> one gradient per input: x, then per projection None (w), [None (bias),] d a, d b, then
    None for the seed."""
    x, projs, seed = _split_qkv(inputs, has_bias)
    (xa,) = res
    dt = x.dtype
    idx = [i for i in range(PROJ) if adapters[i]]
    slots = _slots([projs[i][2].shape[0] for i in idx], [drops[i] for i in idx])
    step = 4 if has_bias else 3
    out, dxa, dx = [], [], None
    for i, ((w, _, a, b), g) in enumerate(zip(projs, grads)):
        if needs[0]:  # the base path, one rounding a term as the Triton backend's chained addmm
            t = K.dot(g, w).astype(dt)
            dx = t if dx is None else dx + t
        da = db = None
        if i in idx:
            off, r = slots[idx.index(i)][:2]
            dxa.append(_dxa(g, b, scales[i], dt))
            if needs[1 + i * step + step - 1]:
                db = _grad_b(g, xa[:, off:off + r], scales[i], b.dtype)
        out += [None, None, da, db] if has_bias else [None, da, db]
    if idx:
        dxa = jnp.concatenate(dxa, axis=1) if len(dxa) > 1 else dxa[0]  # (M, R)
        a_list = [projs[i][2] for i in idx]
        if any(needs[1 + i * step + step - 2] for i in idx):
            for i, ga in zip(idx, _grads_a(x, dxa, a_list, slots, seed, a_list[0].dtype)):
                out[i * step + step - 2] = ga
        if needs[0]:
            a_cat = jnp.concatenate(a_list).astype(dt) if len(a_list) > 1 else a_list[0].astype(dt)
            dx = K.lora_dx(dx, dxa, a_cat, seed, slots=slots)
    return (dx, *out, None)


# ---------------------------------------------------------------------------------------- mlp
def lora_mlp_fwd(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, seed, *, scales, gelu,
                 adapters=(True,) * 3, drops=(None,) * 3, recompute=False):
    """x (M, H), the nine weights, the seed -> ((y,), (g, u, xa, ha)); g, u (M, I) pre-activations
    (fillers with ``recompute``: the backward makes them again from x), xa (M, R) gate's and up's
    down-projections of x, ha (M, r) down's of h (a filler without one)."""
    dt = x.dtype
    filler = jnp.zeros((1, 1), dt)
    gu = [i for i in range(2) if adapters[i]]
    a_gu, b_gu = (a_gate, a_up), (b_gate, b_up)
    slots = _slots([a_gu[i].shape[0] for i in gu], [drops[i] for i in gu])
    xa = _down(x, [a_gu[i] for i in gu], slots, seed)[0] if gu else None
    g, u, h = K.lora_glu_fwd(_base(x, w_gate), _base(x, w_up), xa, b_gate if adapters[0] else None,
                             b_up if adapters[1] else None, scales=scales, gelu=gelu)
    y, ha = _base(h, w_down), filler
    if adapters[2]:
        ha, _ = _down(h, [a_down], _slots([a_down.shape[0]], drops[2:]), seed)
        y = K.lora_add(y, None, ha, b_down, col=0, scale=scales[2])
    if recompute:
        g = u = filler
    return (y,), (g, u, filler if xa is None else xa, ha)


def lora_mlp_bwd(inputs, res, grads, *, scales, gelu, needs, adapters=(True,) * 3, drops=(None,) * 3,
                 recompute=False):
    """-> (dx, None, d a_gate, d b_gate, None, d a_up, d b_up, None, d a_down, d b_down, None)."""
    x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, seed = inputs
    g, u, xa, ha = res
    if recompute:  # the forward's products and kernel again (its activation output unused)
        g, u, _ = K.lora_glu_fwd(_base(x, w_gate), _base(x, w_up), xa,
                                 b_gate if adapters[0] else None, b_up if adapters[1] else None, scales=scales,
                                 gelu=gelu)
    (dy,) = grads
    s_g, s_u, s_d = scales
    dt = x.dtype
    out = [None] * 11
    dha = None
    if adapters[2]:
        dha = _dxa(dy, b_down, s_d, dt)  # (M, r)
        if needs[9]:
            out[9] = _grad_b(dy, ha, s_d, b_down.dtype)  # (H, r)
    dg, du, h = K.lora_glu_bwd(K.dot(dy, w_down).astype(dt), g, u, dha, a_down if adapters[2] else None,
                               seed, gelu=gelu, drop=drops[2] if adapters[2] else None)
    if adapters[2] and needs[8]:
        (out[8],) = _grads_a(h, dha, [a_down], _slots([a_down.shape[0]], drops[2:]), seed, a_down.dtype)
    gu = [i for i in range(2) if adapters[i]]
    dx = K.dot(dg, w_gate).astype(dt) + K.dot(du, w_up).astype(dt) if needs[0] else None
    if gu:
        a_gu, b_gu, d_gu, s_gu = (a_gate, a_up), (b_gate, b_up), (dg, du), (s_g, s_u)
        slots = _slots([a_gu[i].shape[0] for i in gu], [drops[i] for i in gu])
        parts = []
        for (off, r, *_), i in zip(slots, gu):
            parts.append(_dxa(d_gu[i], b_gu[i], s_gu[i], dt))
            if needs[3 + 3 * i]:
                out[3 + 3 * i] = _grad_b(d_gu[i], xa[:, off:off + r], s_gu[i], b_gu[i].dtype)
        dxa = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        a_list = [a_gu[i] for i in gu]
        if any(needs[2 + 3 * i] for i in gu):
            for i, ga in zip(gu, _grads_a(x, dxa, a_list, slots, seed, a_list[0].dtype)):
                out[2 + 3 * i] = ga
        if needs[0]:
            a_cat = jnp.concatenate(a_list).astype(dt) if len(a_list) > 1 else a_list[0].astype(dt)
            dx = K.lora_dx(dx, dxa, a_cat, seed, slots=slots)
    out[0] = dx
    return tuple(out)


# ---------------------------------------------------------------------------------------- o
def _split_o(inputs, has_bias):
    x, w, *rest = inputs
    bias, a, b, seed = rest if has_bias else (None, *rest)
    return x, w, bias, a, b, seed


def lora_o_fwd(*inputs, scale, has_bias, drop=None):
    """x (M, K), w, [bias,] a, b, the seed -> ((y,), (xa,)): one LoRA linear, xa (M, r)."""
    x, w, bias, a, b, seed = _split_o(inputs, has_bias)
    slots = _slots([a.shape[0]], (drop,))
    xa, _ = _down(x, [a], slots, seed)
    return (K.lora_add(_base(x, w), bias, xa, b, col=0, scale=scale),), (xa,)


def lora_o_bwd(inputs, res, grads, *, scale, has_bias, needs, drop=None):
    """-> (dx, None (w), [None (bias),] d a, d b, None (seed))."""
    x, w, bias, a, b, seed = _split_o(inputs, has_bias)
    (xa,), (g,) = res, grads
    dt = x.dtype
    slots = _slots([a.shape[0]], (drop,))
    i_a = 3 if has_bias else 2
    dxa = _dxa(g, b, scale, dt)  # (M, r)
    db = _grad_b(g, xa, scale, b.dtype) if needs[i_a + 1] else None
    (da,) = _grads_a(x, dxa, [a], slots, seed, a.dtype) if needs[i_a] else (None,)
    dx = None
    if needs[0]:
        dx = K.lora_dx(K.dot(g, w).astype(dt), dxa, a.astype(dt), seed, slots=slots)
    return (dx, None, None, da, db, None) if has_bias else (dx, None, da, db, None)
