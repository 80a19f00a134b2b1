"""Fused LoRA projections as JAX + Pallas: ``lora_qkv`` and ``lora_mlp`` (specs, signatures and
backward derivations: forge/spec/lora_qkv.py, forge/spec/lora_mlp.py). Pure JAX, no torch.

The large matrix products are XLA ``dot`` s (cuBLAS-class GEMMs on the GPU). Pallas kernels fuse
what sits around them: ``_lora_add_kernel`` adds ``bias + scale * xa B^T`` onto a base GEMM's
output tile by tile, computing the rank-r product in registers (the (M, N) LoRA term is never
materialised); ``_lora_glu_fwd_kernel`` does that for gate and up, then act(g) * u, in one pass;
``_lora_glu_bwd_kernel`` adds the down adapter's term to dh, recomputes act from the saved
pre-activations and writes dg, du and h. One jitted fwd and one jitted bwd per kernel (the bridge
jits them). Ranks are zero-padded to a power of two >= 16 (the dot's minimum K); the padded
columns contribute exact zeros.

Rounding: the adapters are read in x's dtype (peft's fp32 adapters on a bf16 model are rounded
to bf16), every adapter product takes x-dtype operands with fp32 accumulation and the adapters'
gradients come out in their own dtype (fp32 for fp32 adapters); g and u are rounded to x's dtype
before act, act(g) before the product, as eager Hugging Face does.

peft's lora_dropout arrives as one uint8 keep-mask per projection, after the weights, with the
static ``drops`` holding each projection's scale 1 / (1 - p) (None: no mask; forge/spec/
lora_dropout.py has the math). A masked projection's down-projection and its gradients read
the dropped-out input, recomputed from x and the mask in backward; the down adapter's mask is
applied to its term of dh inside ``_lora_glu_bwd_kernel``. Without masks nothing changes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _common as C
from .glu import _act as _glu_act  # one activation (and derivative) for both GLU kernels

BLOCK_M = 64
BLOCK_N = 64
PROJ = 3  # q, k, v


def _launch(kernel, *, name, grid, out_shape, aliases):
    """``aliases`` lets an output reuse an input's buffer (the base GEMM output becomes the
    result in place)."""
    return C.triton_call(kernel, name=name, grid=grid, out_shape=out_shape, num_warps=4,
                         aliases=aliases)


def _padded_rank(r: int) -> int:
    return max(16, C.next_power_of_2(r))


def _precision(dtype):
    # fp32 adapters: full fp32 products (Pallas' Triton lowering and XLA default to tf32 on GPU)
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, dims=((1,), (0,))):
    """a @ b (or a contraction given by ``dims``) with the precision rule above, fp32+ output."""
    acc = C.acc_dtype(a.dtype)
    return lax.dot_general(a, b, (dims, ((), ())), precision=_precision(a.dtype), preferred_element_type=acc)


def _tile(i, j, m, n):
    rows = i * BLOCK_M + jnp.arange(BLOCK_M)
    cols = j * BLOCK_N + jnp.arange(BLOCK_N)
    rmask, cmask = rows < m, cols < n
    return pl.ds(i * BLOCK_M, BLOCK_M), pl.ds(j * BLOCK_N, BLOCK_N), rmask, cmask, rmask[:, None] & cmask[None, :]


def _lowrank(p_ref, q_ref, rs, cs, rmask, cmask, col, rp, dt, acc):
    """(P[rs, col:col+rp] Q[cs, :]^T) for P (M, *) and Q (N, rp): the rank-rp product of a tile,
    both rounded to ``dt`` (x's dtype) for the product."""
    kmask = jnp.arange(rp) < rp  # (RP,) all true: full-shape masks for the Triton lowering
    p = C.load(p_ref.at[rs, pl.ds(col, rp)], mask=rmask[:, None] & kmask[None, :], other=0.0)  # (BM, RP)
    q = C.load(q_ref.at[cs, pl.ds(0, rp)], mask=cmask[:, None] & kmask[None, :], other=0.0)  # (BN, RP)
    return _dot(p.astype(dt), q.astype(dt), ((1,), (1,))).astype(acc)


def _round(v, dtype, acc):
    return v.astype(dtype).astype(acc)


def _masks(arrays, drops):
    """The keep-masks in projection order, None where ``drops`` has no scale."""
    it = iter(arrays)
    return tuple(None if d is None else next(it) for d in drops)


def _drop(t, keep, scale):
    """Dropout with a given mask (lora_dropout.apply): t * scale where kept, 0 elsewhere. A
    product, as torch's dropout, and of primitives the native launch translates (no select)."""
    if keep is None:
        return t
    acc = C.acc_dtype(t.dtype)  # one rounding, as torch's: bf16 * (1 / (1 - p)) in fp32
    return (t.astype(acc) * (keep.astype(acc) * scale)).astype(t.dtype)


def _adapter_in(x, a_list, rp, keeps, drops):
    """(M, n RP) x a_p^T in x's dtype for n adapters reading x (each A rounded to x's dtype and
    zero-padded to RP rows); one dot unless an adapter has dropout (each then reads its own
    dropped-out x)."""
    dt = x.dtype
    padded = [_pad_rows(a.astype(dt), rp) for a in a_list]
    if all(k is None for k in keeps):
        return _dot(x, jnp.concatenate(padded), ((1,), (1,))).astype(dt)
    return jnp.concatenate([_dot(_drop(x, k, d), a, ((1,), (1,))).astype(dt)
                            for a, k, d in zip(padded, keeps, drops)], axis=1)


def _masked_dx(dxa, a_list, keeps, drops):
    """sum_p drop_p(dxa_p a_p), the adapters' path of d x when some have dropout: per adapter
    (each its own mask), x-dtype operands, fp32+ accumulation."""
    return sum(_drop(_dot(d, a.astype(d.dtype)), k, s) for d, a, k, s in zip(dxa, a_list, keeps, drops))


# out (M, N) = base + bias + scale * xa[:, col:col+rp] b^T, written over base
def _lora_add_kernel(base_ref, bias_ref, xa_ref, b_ref, m_ref, o_ref, *, col, rp, scale, has_bias):
    m, n = C.read_rows(m_ref), base_ref.shape[1]  # rows at run time (see _common.rows_operand)
    acc = C.acc_dtype(o_ref.dtype)
    rs, cs, rmask, cmask, mask = _tile(pl.program_id(0), pl.program_id(1), m, n)
    lo = _lowrank(xa_ref, b_ref, rs, cs, rmask, cmask, col, rp, o_ref.dtype, acc)
    out = C.load(base_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    if has_bias:
        out = out + C.load(bias_ref.at[cs], mask=cmask, other=0.0).astype(acc)[None, :]
    C.store(o_ref.at[rs, cs], (out + scale * lo).astype(o_ref.dtype), mask=mask)


def lora_add(base, bias, xa, b, *, col, scale):
    """base (M, N) + bias (N,) or None + scale * xa[:, col:col+RP] @ b^T, b (N, RP) zero-padded."""
    m, n = base.shape
    rp = b.shape[1]
    has_bias = bias is not None
    bias = bias if has_bias else jnp.zeros((1,), base.dtype)
    kern = functools.partial(_lora_add_kernel, col=col, rp=rp, scale=float(scale), has_bias=has_bias)
    return _launch(kern, name="lora_add", grid=(C.row_programs(C.cdiv(m, BLOCK_M)), C.cdiv(n, BLOCK_N)),
                   out_shape=jax.ShapeDtypeStruct(base.shape, base.dtype), aliases={0: 0})(base, bias, xa, b, C.rows_operand(m))


# g, u (M, I): base GEMMs in; out g + s_g xa_g B_g^T and u + s_u xa_u B_u^T (rounded to x's
# dtype; backward recomputes act from them) and h = act(g) * u
def _lora_glu_fwd_kernel(g_ref, u_ref, xa_ref, bg_ref, bu_ref, m_ref, go_ref, uo_ref, h_ref, *, rp, scale_g, scale_u,
                         gelu):
    m, n = C.read_rows(m_ref), g_ref.shape[1]
    dt = h_ref.dtype
    acc = C.acc_dtype(dt)
    rs, cs, rmask, cmask, mask = _tile(pl.program_id(0), pl.program_id(1), m, n)
    g = C.load(g_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    u = C.load(u_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    g = _round(g + scale_g * _lowrank(xa_ref, bg_ref, rs, cs, rmask, cmask, 0, rp, dt, acc), dt, acc)
    u = _round(u + scale_u * _lowrank(xa_ref, bu_ref, rs, cs, rmask, cmask, rp, rp, dt, acc), dt, acc)
    a, _ = _glu_act(g, "geglu" if gelu else "swiglu")
    C.store(go_ref.at[rs, cs], g.astype(dt), mask=mask)
    C.store(uo_ref.at[rs, cs], u.astype(dt), mask=mask)
    C.store(h_ref.at[rs, cs], (_round(a, dt, acc) * u).astype(dt), mask=mask)


# dh = dh_base + drop(dha @ A_down) (dha = s_down dy B_down, A_down^T zero-padded to (I, RP); drop
# the down adapter's dropout when drop_scale is set, keep-mask in keep_ref);
# h = act(g) * u  =>  dg = dh * u * act'(g),  du = dh * act(g); h recomputed over dh_base
def _lora_glu_bwd_kernel(dh_ref, g_ref, u_ref, dha_ref, adt_ref, keep_ref, m_ref, dg_ref, du_ref, h_ref, *, rp, gelu,
                         drop_scale):
    m, n = C.read_rows(m_ref), g_ref.shape[1]
    dt = g_ref.dtype
    acc = C.acc_dtype(dt)
    rs, cs, rmask, cmask, mask = _tile(pl.program_id(0), pl.program_id(1), m, n)
    dh = C.load(dh_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    lo = _lowrank(dha_ref, adt_ref, rs, cs, rmask, cmask, 0, rp, dt, acc)
    if drop_scale is not None:  # the adapter saw drop(h): its gradient reaches h only where kept
        lo = _drop(lo, C.load(keep_ref.at[rs, cs], mask=mask, other=0), drop_scale)
    dh = dh + lo
    g = C.load(g_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    u = C.load(u_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    a, da = _glu_act(g, "geglu" if gelu else "swiglu")
    C.store(dg_ref.at[rs, cs], (dh * u * da).astype(dt), mask=mask)
    C.store(du_ref.at[rs, cs], (dh * a).astype(dt), mask=mask)
    C.store(h_ref.at[rs, cs], (_round(a, dt, acc) * u).astype(dt), mask=mask)


def _pad_rows(a, rp):  # (r, H) -> (RP, H)
    return jnp.pad(a, ((0, rp - a.shape[0]), (0, 0)))


def _pad_cols(b, rp):  # (N, r) -> (N, RP)
    return jnp.pad(b, ((0, 0), (0, rp - b.shape[1])))


def _base(x2, w):  # (M, H) @ (N, H)^T -> (M, N) in x's dtype, XLA GEMM
    return lax.dot_general(x2, w, (((1,), (1,)), ((), ())), precision=_precision(x2.dtype))


# ---------------------------------------------------------------------------------------- qkv
def _unpack_qkv(inputs, has_bias):
    """(x, [(w, bias, a, b)] * 3) from the flat input tuple (biases absent when not has_bias)."""
    x, rest = inputs[0], inputs[1:]
    step = 4 if has_bias else 3
    projs = []
    for p in range(PROJ):
        t = rest[p * step:(p + 1) * step]
        projs.append(tuple(t) if has_bias else (t[0], None, t[1], t[2]))
    return x, projs


def _split_qkv(inputs, has_bias, drops):
    n = 1 + PROJ * (4 if has_bias else 3)
    return (*_unpack_qkv(inputs[:n], has_bias), _masks(inputs[n:], drops))


def lora_qkv_fwd(*inputs, scales, has_bias, drops=(None,) * PROJ):
    """x (M, H), per projection w, [bias,] a, b, then the keep-masks (M, H) of the projections
    with a scale in ``drops`` -> ((q, k, v), (xa,)); xa (M, 3 RP) padded."""
    x, projs, keeps = _split_qkv(inputs, has_bias, drops)
    rp = _padded_rank(max(p[2].shape[0] for p in projs))
    # (M, 3 RP); without dropout x is read once for all three
    xa = _adapter_in(x, [a for _, _, a, _ in projs], rp, keeps, drops)
    outs = tuple(lora_add(_base(x, w), bias, xa, _pad_cols(b, rp), col=i * rp, scale=s)
                 for i, ((w, bias, _, b), s) in enumerate(zip(projs, scales)))
    return outs, (xa,)


def lora_qkv_bwd(inputs, res, grads, *, scales, has_bias, needs, drops=(None,) * PROJ):
    """-> one gradient per input: x, then per projection None (w), [None (bias),] d a, d b, then
    None per mask."""
    x, projs, keeps = _split_qkv(inputs, has_bias, drops)
    (xa,) = res
    rp = xa.shape[1] // PROJ
    dt, ldt = x.dtype, projs[0][2].dtype
    step = 4 if has_bias else 3
    dx = None
    dxa, out = [], []
    for i, ((w, _, a, b), g, s) in enumerate(zip(projs, grads, scales)):
        r = a.shape[0]
        xa_p = xa[:, i * rp:i * rp + r]  # (M, r)
        dxa_p = (s * _dot(g, b.astype(dt))).astype(dt)  # (M, r) = s g_p B_p
        dxa.append(dxa_p)
        na, nb = needs[1 + i * step + step - 2], needs[1 + i * step + step - 1]
        da = _dot(dxa_p, _drop(x, keeps[i], drops[i]), ((0,), (0,))).astype(ldt) if na else None
        db = (s * _dot(g, xa_p, ((0,), (0,)))).astype(ldt) if nb else None  # (N_p, r)
        out += [None, None, da, db] if has_bias else [None, da, db]
        if needs[0]:
            t = _dot(g, w)  # (M, H) base path g_p w_p, fp32 accumulation across the three
            dx = t if dx is None else dx + t
    if needs[0]:
        if all(k is None for k in keeps):
            a_cat = jnp.concatenate([p[2] for p in projs]).astype(x.dtype)  # (R, H)
            dx = dx + _dot(jnp.concatenate(dxa, axis=1).astype(x.dtype), a_cat)
        else:
            dx = dx + _masked_dx(dxa, [p[2] for p in projs], keeps, drops)
        dx = dx.astype(x.dtype)
    return (dx, *out, *(None for d in drops if d is not None))


# ---------------------------------------------------------------------------------------- mlp
def lora_mlp_fwd(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, *masks, scales, gelu,
                 drops=(None,) * 3):
    """x (M, H), the nine weights, the keep-masks of gate, up ((M, H)) and down ((M, I)) that have a
    scale in ``drops`` -> ((y,), (g, u, xa, ha)); g, u (M, I) pre-activations."""
    s_g, s_u, s_d = scales
    k_g, k_u, k_d = _masks(masks, drops)
    m, inter = x.shape[0], w_gate.shape[0]
    dt = x.dtype
    rp = _padded_rank(max(a_gate.shape[0], a_up.shape[0]))
    xa = _adapter_in(x, [a_gate, a_up], rp, (k_g, k_u), drops[:2])  # (M, 2 RP)
    kern = functools.partial(_lora_glu_fwd_kernel, rp=rp, scale_g=float(s_g), scale_u=float(s_u), gelu=gelu)
    sds = jax.ShapeDtypeStruct((m, inter), x.dtype)
    g, u, h = _launch(kern, name="lora_glu_fwd", grid=(C.row_programs(C.cdiv(m, BLOCK_M)), C.cdiv(inter, BLOCK_N)),
                      out_shape=(sds, sds, sds), aliases={0: 0, 1: 1})(
        _base(x, w_gate), _base(x, w_up), xa, _pad_cols(b_gate, rp), _pad_cols(b_up, rp), C.rows_operand(m))
    rpd = _padded_rank(a_down.shape[0])
    ha = _dot(_drop(h, k_d, drops[2]), _pad_rows(a_down.astype(dt), rpd), ((1,), (1,))).astype(dt)  # (M, RPd)
    y = lora_add(_base(h, w_down), None, ha, _pad_cols(b_down, rpd), col=0, scale=s_d)
    return (y,), (g, u, xa, ha)


def lora_mlp_bwd(inputs, res, grads, *, scales, gelu, needs, drops=(None,) * 3):
    """-> (dx, None, d a_gate, d b_gate, None, d a_up, d b_up, None, d a_down, d b_down, None per mask)."""
    x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down = inputs[:10]
    k_g, k_u, k_d = _masks(inputs[10:], drops)
    g, u, xa, ha = res
    (dy,) = grads
    s_g, s_u, s_d = scales
    m, inter = g.shape
    dt, ldt = x.dtype, a_gate.dtype
    rp, rpd = xa.shape[1] // 2, ha.shape[1]
    r_g, r_u, r_d = a_gate.shape[0], a_up.shape[0], a_down.shape[0]
    dha = (s_d * _dot(dy, _pad_cols(b_down.astype(dt), rpd))).astype(dt)  # (M, RPd), padded columns zero
    d_b_down = (s_d * _dot(dy, ha[:, :r_d], ((0,), (0,)))).astype(ldt) if needs[9] else None  # (H, r)
    kern = functools.partial(_lora_glu_bwd_kernel, rp=rpd, gelu=gelu, drop_scale=drops[2])
    sds = jax.ShapeDtypeStruct((m, inter), g.dtype)
    dg, du, h = _launch(kern, name="lora_glu_bwd", grid=(C.row_programs(C.cdiv(m, BLOCK_M)), C.cdiv(inter, BLOCK_N)),
                        out_shape=(sds, sds, sds), aliases={0: 2})(
        _dot(dy, w_down).astype(g.dtype), g, u, dha, _pad_rows(a_down, rpd).T,
        jnp.zeros((1, 1), jnp.uint8) if k_d is None else k_d, C.rows_operand(m))
    hd = _drop(h, k_d, drops[2])
    d_a_down = _dot(dha[:, :r_d], hd, ((0,), (0,))).astype(ldt) if needs[8] else None  # (r, I)
    dxa_g = (s_g * _dot(dg, b_gate.astype(dt))).astype(dt)  # (M, r_g)
    dxa_u = (s_u * _dot(du, b_up.astype(dt))).astype(dt)
    d_b_gate = (s_g * _dot(dg, xa[:, :r_g], ((0,), (0,)))).astype(ldt) if needs[3] else None
    d_b_up = (s_u * _dot(du, xa[:, rp:rp + r_u], ((0,), (0,)))).astype(ldt) if needs[6] else None
    d_a_gate = _dot(dxa_g, _drop(x, k_g, drops[0]), ((0,), (0,))).astype(ldt) if needs[2] else None
    d_a_up = _dot(dxa_u, _drop(x, k_u, drops[1]), ((0,), (0,))).astype(ldt) if needs[5] else None
    dx = None
    if needs[0]:
        dx = _dot(dg, w_gate) + _dot(du, w_up)  # (M, H), fp32 accumulation of all four terms
        dt = x.dtype
        if k_g is None and k_u is None:
            dx = dx + _dot(dxa_g.astype(dt), a_gate.astype(dt)) + _dot(dxa_u.astype(dt), a_up.astype(dt))
        else:
            dx = dx + _masked_dx([dxa_g, dxa_u], [a_gate, a_up], (k_g, k_u), drops[:2])
        dx = dx.astype(dt)
    return (dx, None, d_a_gate, d_b_gate, None, d_a_up, d_b_up, None, d_a_down, d_b_down,
            *(None for d in drops if d is not None))
