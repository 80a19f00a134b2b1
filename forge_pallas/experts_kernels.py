"""Grouped matrix products of the mixture-of-experts kernel (forge_pallas/experts.py drives them),
written for Pallas' Triton lowering. Pure JAX, no torch.

The rows of the input are sorted by expert; ``offsets`` (E + 1,) int32 says where each expert's
rows start (offsets[E] = M). The offsets live on the device and are read by the kernels: nothing
is synchronised with the host, and the launch grid is sized for the worst case.

Row tiles (the grouping): rows are cut in *aligned* blocks of ``BM`` (block b holds rows
b*BM .. b*BM + BM - 1) and expert e owns slots for the aligned blocks its rows
[offsets[e], offsets[e+1]) touch, counted as floor(offsets[e+1] / BM) - floor(offsets[e] / BM) + 1
(one more than it may need, so that an expert's count is a difference of two floors). Slot t of
the grid then belongs to the last expert e with s_e = floor(offsets[e] / BM) + e <= t (s_e rises
strictly with e), found by one vector comparison over the offsets, no cumulative sum; its block
is floor(offsets[e] / BM) + t - s_e. There are floor(M / BM) + E slots in all, whatever the
routing. A block shared by two experts is computed once for each, each storing only its own
rows (masked); a slot with no rows (an expert without tokens, the spare slot) stores nothing.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _common as C
from .glu import _act as _glu_act
from .lora_kernels import dot

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32
WG_BLOCK_M = 32  # rows per step of the weight gradient's reduction
WG_BLOCK_N = 64
WG_BLOCK_K = 64
_WARPS = 4
_FAR = 1 << 30  # a slot start no program id reaches (lanes past the last expert)


def slots(m: int, n_exp: int, bm: int = BLOCK_M) -> int:
    """Grid slots along the rows for ``m`` sorted rows over ``n_exp`` experts (module docstring)."""
    return C.row_programs(m // bm + n_exp)


def _slot(off_ref, t, *, n_exp, bm):
    """(expert, first row, end row, aligned block) of grid slot ``t``; first >= end: no rows."""
    ep = C.next_power_of_2(n_exp)
    lane = jnp.arange(ep, dtype=jnp.int32)
    offs = C.load(off_ref.at[C.ds(0, ep)], mask=lane < n_exp, other=_FAR)  # (EP,)
    starts = lax.div(offs, jnp.int32(bm)) + lane  # s_e
    e = jnp.sum((starts <= t).astype(jnp.int32)) - 1
    e = jnp.clip(e, 0, n_exp - 1)  # (t past every expert's slots: the last one, with no rows left)
    lo = C.load(off_ref.at[pl.ds(e, 1)])[0]
    hi = C.load(off_ref.at[pl.ds(e + 1, 1)])[0]
    block = t - e  # floor(lo / BM) + (t - s_e)
    first = jnp.maximum(lo, block * bm)
    end = jnp.minimum(hi, block * bm + bm)
    return e, first, end, block


def _product(x_ref, w_ref, e, j, rs, rmask, col0s, n, *, trans_w, bn, bk):
    """Per column offset c0 of ``col0s``, the (BM, BN) fp32 tile x[rs] @ W_e[:, c0 + cols] where
    W_e is w[e]^T (w (E, N', K), ``trans_w``) or w[e] (w (E, K, N')); x (M, K); ``j`` the column
    tile (program ids are read at the kernel's top level: the interpreter substitutes them there only)."""
    kdim = x_ref.shape[1]
    acc = C.acc_dtype(x_ref.dtype)
    cmask = j * bn + jnp.arange(bn) < n

    def body(kb, accs):
        k0 = kb * bk
        kmask = k0 + jnp.arange(bk) < kdim
        ks = pl.ds(k0, bk)
        x = C.load(x_ref.at[rs, ks], mask=rmask[:, None] & kmask[None, :], other=0.0)  # (BM, BK)
        out = []
        for a, c0 in zip(accs, col0s):
            cs = pl.ds(c0 + j * bn, bn)
            if trans_w:
                w = C.load(w_ref.at[e, cs, ks], mask=cmask[:, None] & kmask[None, :], other=0.0)  # (BN, BK)
                out.append(a + dot(x, w.astype(x.dtype), ((1,), (1,))))
            else:
                w = C.load(w_ref.at[e, ks, cs], mask=kmask[:, None] & cmask[None, :], other=0.0)  # (BK, BN)
                out.append(a + dot(x, w.astype(x.dtype)))
        return tuple(out)

    init = tuple(jnp.zeros((rs.size, bn), acc) for _ in col0s)
    return lax.fori_loop(C.i32(0), C.i32(C.cdiv(kdim, bk)), body, init)


def _tile_rows(off_ref, *, n_exp, bm):
    e, first, end, block = _slot(off_ref, pl.program_id(0), n_exp=n_exp, bm=bm)
    rows = block * bm + jnp.arange(bm)
    return e, first < end, pl.ds(block * bm, bm), (rows >= first) & (rows < end)


# y (M, N) = x (M, K) @ W_e per row's expert e (W_e = w[e]^T for w (E, N, K), w[e] for (E, K, N))
def _gmm_kernel(x_ref, w_ref, off_ref, y_ref, *, n_exp, trans_w, bm, bn, bk):
    e, any_rows, rs, rmask = _tile_rows(off_ref, n_exp=n_exp, bm=bm)
    n, j = y_ref.shape[1], pl.program_id(1)
    cols = j * bn + jnp.arange(bn)
    cs = pl.ds(j * bn, bn)

    def run():
        (y,) = _product(x_ref, w_ref, e, j, rs, rmask, (0,), n, trans_w=trans_w, bn=bn, bk=bk)
        C.store(y_ref.at[rs, cs], y.astype(y_ref.dtype), mask=rmask[:, None] & (cols < n)[None, :])

    pl.when(any_rows)(run)


def gmm(x, w, offsets, *, trans_w):
    """(M, N) in x's dtype: each row of x (M, K) times its expert's matrix (``_gmm_kernel``)."""
    m = x.shape[0]
    n_exp = w.shape[0]
    n = w.shape[1] if trans_w else w.shape[2]
    kern = functools.partial(_gmm_kernel, n_exp=n_exp, trans_w=trans_w, bm=BLOCK_M, bn=BLOCK_N, bk=BLOCK_K)
    return C.triton_call(kern, name="experts_gmm", grid=(slots(m, n_exp), C.cdiv(n, BLOCK_N)), num_warps=_WARPS,
                         out_shape=jax.ShapeDtypeStruct((m, n), x.dtype))(x, w, offsets)


# gu = x @ w[e]^T (w (E, 2I, K): gate rows then up rows), g and u rounded to x's dtype;
# h = act(g) * u (the GLU in the product's epilogue); g and u kept (as gu (M, 2I)) for backward
def _gmm_glu_kernel(x_ref, w_ref, off_ref, h_ref, gu_ref, *, n_exp, kind, bm, bn, bk):
    e, any_rows, rs, rmask = _tile_rows(off_ref, n_exp=n_exp, bm=bm)
    inter = h_ref.shape[1]
    dt = h_ref.dtype
    acc = C.acc_dtype(dt)
    j = pl.program_id(1)
    cols = j * bn + jnp.arange(bn)
    mask = rmask[:, None] & (cols < inter)[None, :]

    def run():
        g, u = _product(x_ref, w_ref, e, j, rs, rmask, (0, inter), inter, trans_w=True, bn=bn, bk=bk)
        g, u = g.astype(dt), u.astype(dt)
        a, _ = _glu_act(g.astype(acc), kind)
        C.store(gu_ref.at[rs, pl.ds(j * bn, bn)], g, mask=mask)
        C.store(gu_ref.at[rs, pl.ds(inter + j * bn, bn)], u, mask=mask)
        C.store(h_ref.at[rs, pl.ds(j * bn, bn)], (a.astype(dt).astype(acc) * u.astype(acc)).astype(dt), mask=mask)

    pl.when(any_rows)(run)


def gmm_glu(x, w_gate_up, offsets, *, kind):
    """(h (M, I), gu (M, 2I)) for x (M, K), w_gate_up (E, 2I, K)."""
    m = x.shape[0]
    n_exp, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    kern = functools.partial(_gmm_glu_kernel, n_exp=n_exp, kind=kind, bm=BLOCK_M, bn=BLOCK_N, bk=BLOCK_K)
    return C.triton_call(kern, name="experts_gmm_glu", grid=(slots(m, n_exp), C.cdiv(inter, BLOCK_N)),
                         num_warps=_WARPS, out_shape=(jax.ShapeDtypeStruct((m, inter), x.dtype),
                                                      jax.ShapeDtypeStruct((m, two_i), x.dtype)))(
        x, w_gate_up, offsets)


# dh = dy @ w[e] (w (E, N, I): the down projection), then the GLU's backward in the epilogue:
# h = act(g) * u  =>  dg = dh * u * act'(g),  du = dh * act(g); h recomputed as the forward did
def _gmm_glu_bwd_kernel(dy_ref, w_ref, gu_ref, off_ref, dgu_ref, h_ref, *, n_exp, kind, bm, bn, bk):
    e, any_rows, rs, rmask = _tile_rows(off_ref, n_exp=n_exp, bm=bm)
    inter = h_ref.shape[1]
    dt = h_ref.dtype
    acc = C.acc_dtype(dt)
    j = pl.program_id(1)
    cols = j * bn + jnp.arange(bn)
    mask = rmask[:, None] & (cols < inter)[None, :]

    def run():
        (dh,) = _product(dy_ref, w_ref, e, j, rs, rmask, (0,), inter, trans_w=False, bn=bn, bk=bk)
        dh = dh.astype(dt).astype(acc)  # (rounded as a separate product's output would be)
        g = C.load(gu_ref.at[rs, pl.ds(j * bn, bn)], mask=mask, other=0.0).astype(acc)
        u = C.load(gu_ref.at[rs, pl.ds(inter + j * bn, bn)], mask=mask, other=0.0).astype(acc)
        a, da = _glu_act(g, kind)
        C.store(dgu_ref.at[rs, pl.ds(j * bn, bn)], (dh * u * da).astype(dt), mask=mask)
        C.store(dgu_ref.at[rs, pl.ds(inter + j * bn, bn)], (dh * a).astype(dt), mask=mask)
        C.store(h_ref.at[rs, pl.ds(j * bn, bn)], (a.astype(dt).astype(acc) * u).astype(dt), mask=mask)

    pl.when(any_rows)(run)


def gmm_glu_bwd(dy, w_down, gu, offsets, *, kind):
    """(dgu (M, 2I), h (M, I)) for dy (M, N), w_down (E, N, I), gu (M, 2I) from :func:`gmm_glu`."""
    m = dy.shape[0]
    n_exp, _, inter = w_down.shape
    kern = functools.partial(_gmm_glu_bwd_kernel, n_exp=n_exp, kind=kind, bm=BLOCK_M, bn=BLOCK_N, bk=BLOCK_K)
    return C.triton_call(kern, name="experts_gmm_glu_bwd", grid=(slots(m, n_exp), C.cdiv(inter, BLOCK_N)),
                         num_warps=_WARPS, out_shape=(jax.ShapeDtypeStruct((m, 2 * inter), dy.dtype),
                                                      jax.ShapeDtypeStruct((m, inter), dy.dtype)))(
        dy, w_down, gu, offsets)


# dw[e] (N, K) = a[rows of e]^T (M, N) @ b[rows of e] (M, K): one program per (expert, N tile,
# K tile), looping over its expert's rows; an expert without rows writes zeros
def _wgrad_kernel(a_ref, b_ref, off_ref, dw_ref, *, bm, bn, bk):
    e, jn, jk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n, kdim = a_ref.shape[1], b_ref.shape[1]
    acc = C.acc_dtype(a_ref.dtype)
    lo = C.load(off_ref.at[pl.ds(e, 1)])[0]
    hi = C.load(off_ref.at[pl.ds(e + 1, 1)])[0]
    ncols, kcols = jn * bn + jnp.arange(bn), jk * bk + jnp.arange(bk)
    nmask, kmask = ncols < n, kcols < kdim
    ns, ks = pl.ds(jn * bn, bn), pl.ds(jk * bk, bk)

    def body(i, total):
        r0 = lo + i * bm
        rmask = r0 + jnp.arange(bm) < hi
        rs = pl.ds(r0, bm)
        a = C.load(a_ref.at[rs, ns], mask=rmask[:, None] & nmask[None, :], other=0.0)  # (BM, BN)
        b = C.load(b_ref.at[rs, ks], mask=rmask[:, None] & kmask[None, :], other=0.0)  # (BM, BK)
        return total + dot(a, b.astype(a.dtype), ((0,), (0,)))

    steps = C.cdiv_traced(hi - lo, bm)
    total = lax.fori_loop(C.i32(0), steps, body, jnp.zeros((bn, bk), acc))
    C.store(dw_ref.at[e, ns, ks], total.astype(dw_ref.dtype), mask=nmask[:, None] & kmask[None, :])


def wgrad(a, b, offsets, *, n_exp, dtype):
    """(E, N, K) in ``dtype``: per expert e, a[rows of e]^T @ b[rows of e] (a (M, N), b (M, K))."""
    n, k = a.shape[1], b.shape[1]
    kern = functools.partial(_wgrad_kernel, bm=WG_BLOCK_M, bn=WG_BLOCK_N, bk=WG_BLOCK_K)
    return C.triton_call(kern, name="experts_wgrad", grid=(n_exp, C.cdiv(n, WG_BLOCK_N), C.cdiv(k, WG_BLOCK_K)),
                         num_warps=_WARPS, out_shape=jax.ShapeDtypeStruct((n_exp, n, k), dtype))(a, b, offsets)
