"""The grouped products of the mixture-of-experts block (spec and the pieces' contract:
forge/spec/experts.py; forge_pallas/experts.py calls them), written for Pallas' Triton lowering.
Pure JAX, no torch.

Rows are sorted by expert; ``offsets`` (E,) int32 holds each group's end row (group e is rows
[offsets[e-1], offsets[e]), offsets[-1] read as 0). The offsets live on the device and the kernels
read them from a ref: nothing waits on the host, and the launch grid is sized for the worst case.

Row slots (the grouping): rows are cut in *aligned* blocks of ``BM`` (block b holds rows
b BM .. b BM + BM - 1), and an expert e with rows owns one slot per aligned block from
floor(start_e / BM) to floor(end_e / BM), both included (one more than it may need: a count that
is a difference of two floors); an expert without rows owns none. With n_e the experts with rows
among 0..e (a cumulative sum over the offsets' lanes), the slots of experts 0..e number
C_e = floor(end_e / BM) + n_e, so slot t belongs to the expert e = #{e' : C_e' <= t} (C never
falls, and rises at every expert with rows: one vector comparison, no loop), and its block is
t - n_(e-1). There are floor(S / BM) + min(E, S) slots at most, whatever the routing: a decoding
step's few rows over many experts (8 rows, 128 experts) launch 9 row slots, not 128 mostly idle
ones. A block shared by two experts is computed once for each, each storing only its own rows; a
slot without rows (the one extra slot, slots past the last expert) stores nothing. Rows past
offsets[E-1] (invalid ids) are never read or written.

Gathers and scatters index a ref with two broadcast index vectors (rows, columns): the Triton
lowering turns that into one pointer tile, and the interpreter into a numpy-style index. An
index vector's masked-off lanes point past the array (``_off_rows``), never at a row another
lane writes: the interpreter writes a masked store's old value back, dropping only what falls
outside.
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

# Each grouped kernel's launch, (rows, columns, reduction step, warps, stages) of its tile: the
# products (row block, column block, K step), and for the weight gradient (rows and columns of
# the (N, K) output tile, the group's rows per step), as forge_triton.experts.TILES orders them
# (the winners of bench/diagnostics/tune_experts_pallas.py --sweep on the H100 at the
# Qwen3-30B-A3B shape: Pallas' lowering favours narrower row blocks than Triton's; docs/moe.md)
TILES = {"plain": (64, 128, 64, 4, 4), "glu": (64, 256, 64, 8, 3), "glu_bwd": (64, 256, 64, 8, 3),
         "wgrad": (128, 256, 64, 8, 3)}
_INTERPRET_TILES = (64, 64, 32, 4, None)  # the interpreter: few programs, each a numpy step
ROW_BLOCK = 16  # tokens per program of the un-permute
COL_BLOCK = 128
_FAR = 1 << 30  # an end row no slot reaches, a row past any array


# Few rows (S up to FEW_ROWS: a decoding step): narrow row tiles, more column programs (as
# forge_triton.experts.TILES_FEW; bench/diagnostics/tune_experts_pallas.py --few)
FEW_ROWS = 256
TILES_FEW = {"plain": (16, 64, 128, 4, 4), "glu": (16, 64, 128, 4, 4)}


def _tiles(kind, dt, rows=None):
    """TILES[kind] (TILES_FEW[kind] for at most FEW_ROWS ``rows``) for elements of ``dt``: they
    hold 2-byte elements' K step, wider elements a step as many bytes deep (the pipeline's stages
    then fit the shared memory)."""
    if C.interpret():
        return _INTERPRET_TILES
    few = rows is not None and rows <= FEW_ROWS and kind in TILES_FEW
    bm, bn, bk, warps, stages = (TILES_FEW if few else TILES)[kind]
    return bm, bn, max(16, bk * 2 // jnp.dtype(dt).itemsize), warps, stages


def slots(s: int, n_exp: int, bm: int) -> int:
    """Grid slots along the rows for ``s`` sorted rows over ``n_exp`` experts (module docstring)."""
    return C.row_programs(s // bm + min(n_exp, s))


def _tile_rows(off_ref, *, n_exp, bm):
    """(expert, any rows?, first row of the aligned block, its rows, their mask) of this program's slot. Called at the
    kernel's top level: the interpreter substitutes program ids there only."""
    t = pl.program_id(0)
    lane = jnp.arange(C.next_power_of_2(n_exp), dtype=jnp.int32)
    live = lane < n_exp
    ends = C.load(off_ref.at[C.ds(0, lane.size)], mask=live, other=_FAR)  # (EP,)
    starts = C.load(off_ref.at[jnp.clip(lane - 1, 0, n_exp - 1)], mask=live & (lane > 0), other=0)
    has = (live & (ends > starts)).astype(jnp.int32)
    n_with = jnp.cumsum(has)  # experts with rows among 0..lane
    before = jnp.sum((lax.div(ends, jnp.int32(bm)) + n_with <= t).astype(jnp.int32))
    e = jnp.minimum(before, n_exp - 1)
    lo = jnp.where(e > 0, C.load(off_ref.at[pl.ds(jnp.maximum(e - 1, 0), 1)])[0], 0)
    hi = jnp.where(before < n_exp, C.load(off_ref.at[pl.ds(e, 1)])[0], lo)
    block = t - jnp.sum(jnp.where(lane < e, has, 0))
    rows = block * bm + jnp.arange(bm, dtype=jnp.int32)
    rmask = (rows >= lo) & (rows < hi)
    return e, jnp.maximum(lo, block * bm) < jnp.minimum(hi, block * bm + bm), block * bm, rows, rmask


def _off_rows(rows, mask):
    """``rows`` where ``mask``, else distinct rows past any array (see the module docstring; a
    constant, so the lowered module names no row count)."""
    return jnp.where(mask, rows, _FAR + jnp.arange(rows.shape[0], dtype=jnp.int32))


def _product(a_ref, src, w_ref, e, j, rmask, col0s, n, *, trans_w, bn, bk, init=None, scale=None):
    """Per column offset c0 of ``col0s``, the (BM, BN) fp32 tile a[src] @ W_e[:, c0 + j BN + ...]
    where W_e is w[e]^T (w (E, N', K), ``trans_w``) or w[e] (w (E, K, N')); ``src`` the (BM,)
    rows of a (M, K) to read (masked by ``rmask``). ``init``: tiles to add the product to;
    ``scale``: a's tiles are multiplied by it (in fp32, then rounded to a's dtype) before the
    product (a LoRA adapter's rank-r term joining its weight's product)."""
    kdim = a_ref.shape[1]
    acc = C.acc_dtype(a_ref.dtype)
    cmask = j * bn + jnp.arange(bn) < n
    src = _off_rows(src, rmask)[:, None]

    def body(kb, accs):
        k0 = kb * bk
        kcols = k0 + jnp.arange(bk, dtype=jnp.int32)
        kmask = kcols < kdim
        ks = pl.ds(k0, bk)
        a = C.load(a_ref.at[src, kcols[None, :]], mask=rmask[:, None] & kmask[None, :], other=0.0)  # (BM, BK)
        if scale is not None:
            a = (a.astype(acc) * scale).astype(a_ref.dtype)
        out = []
        for t, c0 in zip(accs, col0s):
            cs = pl.ds(c0 + j * bn, bn)
            if trans_w:
                w = C.load(w_ref.at[e, cs, ks], mask=cmask[:, None] & kmask[None, :], other=0.0)  # (BN, BK)
                out.append(t + dot(a, w.astype(a.dtype), ((1,), (1,))))
            else:
                w = C.load(w_ref.at[e, ks, cs], mask=kmask[:, None] & cmask[None, :], other=0.0)  # (BK, BN)
                out.append(t + dot(a, w.astype(a.dtype)))
        return tuple(out)

    if init is None:
        init = tuple(jnp.zeros((rmask.shape[0], bn), acc) for _ in col0s)
    return lax.fori_loop(C.i32(0), C.i32(C.cdiv(kdim, bk)), body, tuple(init))


def _with_low(accs, low_refs, rows, e, j, rmask, col0s, n, *, trans_w, bn, bk, scale):
    """``accs`` + scale * a2[rows] @ W2_e (``low_refs`` = (a2_ref, w2_ref), or () for none): a LoRA
    adapter's rank-r term in the same accumulators as its weight's product, in K steps no deeper
    than the weight's (``bk``: a wide rank then loops, and the tiles fit as the weight's do)."""
    if not low_refs:
        return accs
    a2_ref, w2_ref = low_refs
    bk2 = max(16, min(bk, C.next_power_of_2(a2_ref.shape[1])))
    return _product(a2_ref, rows, w2_ref, e, j, rmask, col0s, n, trans_w=trans_w, bn=bn, bk=bk2, init=accs,
                    scale=scale)


# out (S, N) = a (S, K) @ W_e per row's expert e (W_e = w[e]^T for w (E, N, K), w[e] for (E, K, N))
def _gmm_kernel(a_ref, w_ref, off_ref, *refs, n_exp, trans_w, bm, bn, bk, scale):
    *low_refs, o_ref = refs
    e, any_rows, row0, rows, rmask = _tile_rows(off_ref, n_exp=n_exp, bm=bm)
    n, j = o_ref.shape[1], pl.program_id(1)
    cols = j * bn + jnp.arange(bn)

    def run():
        accs = _product(a_ref, rows, w_ref, e, j, rmask, (0,), n, trans_w=trans_w, bn=bn, bk=bk)
        (y,) = _with_low(accs, low_refs, rows, e, j, rmask, (0,), n, trans_w=trans_w, bn=bn, bk=bk, scale=scale)
        C.store(o_ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)], y.astype(o_ref.dtype),
                mask=rmask[:, None] & (cols < n)[None, :])

    pl.when(any_rows)(run)


def gmm(a, w, offsets, *low, trans_w, scale=None):
    """(S, N) in a's dtype: each row of a (S, K) times its expert's matrix (``_gmm_kernel``);
    ``low`` = (a2 (S, r), w2): plus ``scale`` times a2's rows times their expert's w2, read as w."""
    s = a.shape[0]
    n_exp = w.shape[0]
    n = w.shape[1] if trans_w else w.shape[2]
    bm, bn, bk, warps, stages = _tiles("plain", a.dtype, s)
    kern = functools.partial(_gmm_kernel, n_exp=n_exp, trans_w=trans_w, bm=bm, bn=bn, bk=bk, scale=scale)
    return C.triton_call(kern, name="experts_gmm" if trans_w else "experts_gmm_t",
                         grid=(slots(s, n_exp, bm), C.cdiv(n, bn)), num_warps=warps, num_stages=stages,
                         out_shape=jax.ShapeDtypeStruct((s, n), a.dtype))(a, w, offsets, *low)


# the GLU kernels' tile: its expert and rows (_tile_rows), its column block j of the I-wide h,
# the dtypes, the (rows x columns) mask and the row slice
def _glu_tile(off_ref, h_ref, *, n_exp, bm, bn):
    e, any_rows, row0, rows, rmask = _tile_rows(off_ref, n_exp=n_exp, bm=bm)
    inter, j = h_ref.shape[1], pl.program_id(1)
    dt = h_ref.dtype
    cols = j * bn + jnp.arange(bn)
    mask = rmask[:, None] & (cols < inter)[None, :]
    return e, any_rows, rows, rmask, inter, j, dt, C.acc_dtype(dt), mask, pl.ds(row0, bm)


# gu = x[row_token] @ w[e]^T (w (E, 2I, H): gate rows then up rows; the token rows gathered in the
# load), g and u rounded to x's dtype; h = act(g) * u in the epilogue (act(g) rounded first, as
# eager rounds it); gu (S, 2I) kept for backward
def _glu_fwd_kernel(x_ref, tok_ref, w_ref, off_ref, *refs, n_exp, kind, bm, bn, bk, scale):
    *low_refs, h_ref, gu_ref = refs
    e, any_rows, rows, rmask, inter, j, dt, acc, mask, rs = _glu_tile(off_ref, h_ref, n_exp=n_exp, bm=bm, bn=bn)

    def run():
        src = C.load(tok_ref.at[rs], mask=rmask, other=0)
        accs = _product(x_ref, src, w_ref, e, j, rmask, (0, inter), inter, trans_w=True, bn=bn, bk=bk)
        g, u = _with_low(accs, low_refs, rows, e, j, rmask, (0, inter), inter, trans_w=True, bn=bn, bk=bk, scale=scale)
        g, u = g.astype(dt), u.astype(dt)
        a, _ = _glu_act(g.astype(acc), kind)
        C.store(gu_ref.at[rs, pl.ds(j * bn, bn)], g, mask=mask)
        C.store(gu_ref.at[rs, pl.ds(inter + j * bn, bn)], u, mask=mask)
        C.store(h_ref.at[rs, pl.ds(j * bn, bn)], (a.astype(dt).astype(acc) * u.astype(acc)).astype(dt), mask=mask)

    pl.when(any_rows)(run)


def glu_fwd(x, row_token, offsets, gate_up_proj, *low, kind, scale=None):
    """(h (S, I), gu (S, 2I)) for x (T, H), row_token (S,), gate_up_proj (E, 2I, H); ``low`` =
    (a2 (S, r), b (E, 2I, r)): the adapter's term ``scale`` a2 b_e^T joins the product."""
    s = row_token.shape[0]
    n_exp, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    bm, bn, bk, warps, stages = _tiles("glu", x.dtype, s)
    kern = functools.partial(_glu_fwd_kernel, n_exp=n_exp, kind=kind, bm=bm, bn=bn, bk=bk, scale=scale)
    return C.triton_call(kern, name="experts_glu_fwd", grid=(slots(s, n_exp, bm), C.cdiv(inter, bn)),
                         num_warps=warps, num_stages=stages, out_shape=(jax.ShapeDtypeStruct((s, inter), x.dtype),
                                                      jax.ShapeDtypeStruct((s, two_i), x.dtype)))(
        x, row_token, gate_up_proj, offsets, *low)


# dh = dy @ w[e] (w (E, H, I): the down projection), rounded as a separate product's output would
# be; the GLU's backward in the epilogue: h = act(g) * u  =>  dg = dh * u * act'(g),
# du = dh * act(g); h recomputed as the forward computed it (the down weight's gradient reads it)
def _glu_bwd_kernel(dy_ref, w_ref, gu_ref, off_ref, *refs, n_exp, kind, bm, bn, bk, scale):
    *low_refs, dgu_ref, h_ref = refs
    e, any_rows, rows, rmask, inter, j, dt, acc, mask, rs = _glu_tile(off_ref, h_ref, n_exp=n_exp, bm=bm, bn=bn)

    def run():
        accs = _product(dy_ref, rows, w_ref, e, j, rmask, (0,), inter, trans_w=False, bn=bn, bk=bk)
        (dh,) = _with_low(accs, low_refs, rows, e, j, rmask, (0,), inter, trans_w=False, bn=bn, bk=bk, scale=scale)
        dh = dh.astype(dt).astype(acc)
        g = C.load(gu_ref.at[rs, pl.ds(j * bn, bn)], mask=mask, other=0.0).astype(acc)
        u = C.load(gu_ref.at[rs, pl.ds(inter + j * bn, bn)], mask=mask, other=0.0).astype(acc)
        a, da = _glu_act(g, kind)
        C.store(dgu_ref.at[rs, pl.ds(j * bn, bn)], (dh * u * da).astype(dt), mask=mask)
        C.store(dgu_ref.at[rs, pl.ds(inter + j * bn, bn)], (dh * a).astype(dt), mask=mask)
        C.store(h_ref.at[rs, pl.ds(j * bn, bn)], (a.astype(dt).astype(acc) * u).astype(dt), mask=mask)

    pl.when(any_rows)(run)


def glu_bwd(dy, gu, offsets, down_proj, *low, kind, scale=None):
    """(dgu (S, 2I), h (S, I)) for dy (S, H), gu (S, 2I) from :func:`glu_fwd`, down_proj (E, H, I);
    ``low`` = (a2 (S, r), a (E, r, I)): the adapter's term ``scale`` a2 a_e joins dh."""
    s = dy.shape[0]
    n_exp, _, inter = down_proj.shape
    bm, bn, bk, warps, stages = _tiles("glu_bwd", dy.dtype)
    kern = functools.partial(_glu_bwd_kernel, n_exp=n_exp, kind=kind, bm=bm, bn=bn, bk=bk, scale=scale)
    return C.triton_call(kern, name="experts_glu_bwd", grid=(slots(s, n_exp, bm), C.cdiv(inter, bn)),
                         num_warps=warps, num_stages=stages, out_shape=(jax.ShapeDtypeStruct((s, 2 * inter), dy.dtype),
                                                      jax.ShapeDtypeStruct((s, inter), dy.dtype)))(
        dy, down_proj, gu, offsets, *low)


# dw[e] (N, K) = sum over the rows s of group e of a[s]^T b[src(s)] (src = b_rows, or s): one
# program per (expert, N tile, K tile), stepping over its group's rows; an expert without rows
# writes zeros
def _wgrad_kernel(a_ref, b_ref, brow_ref, off_ref, dw_ref, *, gather, bm, bn, bk):
    e, jn, jk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n, kdim = a_ref.shape[1], b_ref.shape[1]
    acc = C.acc_dtype(a_ref.dtype)
    lo = jnp.where(e > 0, C.load(off_ref.at[pl.ds(jnp.maximum(e - 1, 0), 1)])[0], 0)
    hi = C.load(off_ref.at[pl.ds(e, 1)])[0]
    ncols = jn * bn + jnp.arange(bn, dtype=jnp.int32)
    kcols = jk * bk + jnp.arange(bk, dtype=jnp.int32)
    nmask, kmask = ncols < n, kcols < kdim

    def body(i, total):
        r0 = lo + i * bm
        rows = r0 + jnp.arange(bm, dtype=jnp.int32)
        rmask = rows < hi
        src = C.load(brow_ref.at[pl.ds(r0, bm)], mask=rmask, other=0) if gather else rows
        src = _off_rows(src, rmask)[:, None]
        a = C.load(a_ref.at[pl.ds(r0, bm), pl.ds(jn * bn, bn)], mask=rmask[:, None] & nmask[None, :], other=0.0)
        b = C.load(b_ref.at[src, kcols[None, :]], mask=rmask[:, None] & kmask[None, :], other=0.0)  # (BM, BK)
        return total + dot(a, b.astype(a.dtype), ((0,), (0,)))

    total = lax.fori_loop(C.i32(0), C.cdiv_traced(hi - lo, bm), body, jnp.zeros((bn, bk), acc))
    C.store(dw_ref.at[e, pl.ds(jn * bn, bn), pl.ds(jk * bk, bk)], total.astype(dw_ref.dtype),
            mask=nmask[:, None] & kmask[None, :])


def grouped_wgrad(a, b, offsets, b_rows):
    """(E, N, K) in a's dtype: per expert, the sum over its group's rows of a[s]^T b[b_rows[s] or s]
    (a (S, N), b (R, K), b_rows (S,) or None)."""
    n_exp = offsets.shape[0]
    n, k = a.shape[1], b.shape[1]
    gather = b_rows is not None
    bn, bk, bm, warps, stages = _tiles("wgrad", a.dtype)  # (output rows, output columns, group rows per step)
    kern = functools.partial(_wgrad_kernel, gather=gather, bm=bm, bn=bn, bk=bk)
    return C.triton_call(kern, name="experts_wgrad", grid=(n_exp, C.cdiv(n, bn), C.cdiv(k, bk)),
                         num_warps=warps, num_stages=stages, out_shape=jax.ShapeDtypeStruct((n_exp, n, k), a.dtype))(
        a, b, b_rows if gather else jnp.zeros((1,), jnp.int32), offsets)
