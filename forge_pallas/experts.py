"""The MoE expert block's pieces as Pallas kernels (the contract: forge/spec/experts.py; the
grouped products: forge_pallas/experts_kernels.py; the autograd node that strings the pieces
together: forge/ops/experts.py). Pure JAX, no torch.

Here: the weighted un-permute (each token's sum over its K routed rows, weighted by the
router's scores, in k order with an fp32 sum: no atomics) and its backward (the rows' gradient
scattered back, one writer per row, and the score gradient as a row dot), and the pieces'
signatures as the bridge calls them (each returns ``(outputs, ())``: no residuals, the node keeps
what backward needs).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _common as C
from . import experts_kernels as K

_KIND = {"silu": "swiglu"}


def _slot_rows(rows_ref, scale_ref, ts, tmask, k, acc):
    """(row of slot k per token, valid?, score) for tokens ``ts``; the score is 1 without scores."""
    k = jnp.int32(k)  # (a Python int index is refused by the interpreter)
    rows = C.load(rows_ref.at[ts, k], mask=tmask, other=-1)
    valid = tmask & (rows >= 0)
    score = None if scale_ref is None else C.load(scale_ref.at[ts, k], mask=tmask, other=0.0).astype(acc)
    return jnp.where(valid, rows, 0), valid, score


# out[t] = sum_k score[t, k] * y[slot_rows[t, k]] over the valid slots (fp32, k order)
def _unpermute_kernel(y_ref, rows_ref, *rest, top_k, bt, bh):
    scale_ref, o_ref = rest if len(rest) == 2 else (None, rest[0])
    n_tok, width = o_ref.shape
    acc = C.acc_dtype(y_ref.dtype)
    toks = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    cols = pl.program_id(1) * bh + jnp.arange(bh, dtype=jnp.int32)
    tmask, cmask = toks < n_tok, cols < width
    ts = pl.ds(pl.program_id(0) * bt, bt)
    total = jnp.zeros((bt, bh), acc)
    for k in range(top_k):
        rows, valid, score = _slot_rows(rows_ref, scale_ref, ts, tmask, k, acc)
        y = C.load(y_ref.at[K._off_rows(rows, valid)[:, None], cols[None, :]], mask=valid[:, None] & cmask[None, :],
                   other=0.0).astype(acc)
        total = total + (y if score is None else y * score[:, None])
    C.store(o_ref.at[ts, pl.ds(pl.program_id(1) * bh, bh)], total.astype(o_ref.dtype),
            mask=tmask[:, None] & cmask[None, :])


def unpermute(y, slot_rows, *weights):
    """((out (T, H),), ()): the weighted (``weights``: (T, K), or absent: ones) sum of each token's rows."""
    weights = weights[0] if weights else None
    t, top_k = slot_rows.shape
    width = y.shape[1]
    kern = functools.partial(_unpermute_kernel, top_k=top_k, bt=K.ROW_BLOCK, bh=K.COL_BLOCK)
    args = (y, slot_rows) if weights is None else (y, slot_rows, weights)
    out = C.triton_call(kern, name="experts_unpermute" if weights is not None else "experts_gather",
                        grid=(C.row_programs(C.cdiv(t, K.ROW_BLOCK)), C.cdiv(width, K.COL_BLOCK)), num_warps=4,
                        out_shape=jax.ShapeDtypeStruct((t, width), y.dtype))(*args)
    return (out,), ()


# dy[slot_rows[t, k]] = score[t, k] * dout[t] (each routed row has one (t, k): one writer);
# d_score[t, k] = dout[t] . y[slot_rows[t, k]], 0 for an invalid slot
def _unpermute_bwd_kernel(dout_ref, y_ref, rows_ref, scale_ref, dy_ref, ds_ref, *, top_k, bt, bh):
    n_tok, width = dout_ref.shape
    acc = C.acc_dtype(dout_ref.dtype)
    toks = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    tmask = toks < n_tok
    ts = pl.ds(pl.program_id(0) * bt, bt)
    kp = C.next_power_of_2(top_k)
    kcols = jnp.arange(kp, dtype=jnp.int32)
    d_score = jnp.zeros((bt, kp), acc)
    for k in range(top_k):
        rows, valid, score = _slot_rows(rows_ref, scale_ref, ts, tmask, k, acc)
        far = K._off_rows(rows, valid)[:, None]

        def body(c, dot_acc):
            cols = c * bh + jnp.arange(bh, dtype=jnp.int32)
            m = valid[:, None] & (cols < width)[None, :]
            d = C.load(dout_ref.at[ts, pl.ds(c * bh, bh)], mask=tmask[:, None] & (cols < width)[None, :],
                       other=0.0).astype(acc)
            y = C.load(y_ref.at[far, cols[None, :]], mask=m, other=0.0).astype(acc)
            C.store(dy_ref.at[far, cols[None, :]], (d * score[:, None]).astype(dy_ref.dtype), mask=m)
            return dot_acc + jnp.sum(d * y, axis=1)

        dots = lax.fori_loop(C.i32(0), C.i32(C.cdiv(width, bh)), body, jnp.zeros((bt,), acc))
        d_score = d_score + jnp.where(kcols[None, :] == k, dots[:, None], 0.0)
    C.store(ds_ref.at[ts, pl.ds(0, kp)], d_score.astype(ds_ref.dtype),
            mask=tmask[:, None] & (kcols < top_k)[None, :])


def unpermute_bwd(dout, y, slot_rows, weights):
    """((dy (S, H), d_weights (T, K)), ()); dy's rows of invalid ids are left unwritten."""
    t, top_k = slot_rows.shape
    kern = functools.partial(_unpermute_bwd_kernel, top_k=top_k, bt=K.ROW_BLOCK, bh=K.COL_BLOCK)
    dy, dw = C.triton_call(kern, name="experts_unpermute_bwd", grid=(C.row_programs(C.cdiv(t, K.ROW_BLOCK)),),
                           num_warps=4, out_shape=(jax.ShapeDtypeStruct(y.shape, dout.dtype),
                                                   jax.ShapeDtypeStruct((t, top_k), weights.dtype)))(
        dout, y, slot_rows, weights)
    return (dy, dw), ()


# The routing of forge/spec/experts.py (``route``) in one program, for up to its ROUTE_ROWS routed
# rows (a decoding step): a row's key is its expert id, or E outside [0, E); its sorted position
# counts the rows with a smaller key and those with the same key before it (the stable sort's
# order, by comparisons). slot_rows[i] = rank[i] (-1 for key E), row_token[rank[i]] = i // K,
# offsets[e] = the rows with key <= e: bit-equal to torch's route.


def _route_key(ids_ref, rows, mask, n_exp):
    idx = C.load(ids_ref.at[rows], mask=mask, other=0)
    key = jnp.where((idx >= 0) & (idx < n_exp), idx, n_exp).astype(jnp.int32)
    return jnp.where(mask, key, n_exp + 1)  # (lanes past the rows: after every row, never counted)


def _route_kernel(ids_ref, tok_ref, off_ref, slot_ref, *, n_exp, top_k, bs, bj, be):
    s = ids_ref.shape[0]
    ri = jnp.arange(bs, dtype=jnp.int32)
    imask = ri < s
    key_i = _route_key(ids_ref, C.ds(0, bs), imask, n_exp)

    def body(jb, rank):
        rj = jb * bj + jnp.arange(bj, dtype=jnp.int32)
        key_j = _route_key(ids_ref, pl.ds(jb * bj, bj), rj < s, n_exp)
        before = (key_j[None, :] < key_i[:, None]) | ((key_j[None, :] == key_i[:, None]) & (rj[None, :] < ri[:, None]))
        return rank + jnp.sum(before.astype(jnp.int32), axis=1)

    rank = lax.fori_loop(C.i32(0), C.i32(C.cdiv(s, bj)), body, jnp.zeros((bs,), jnp.int32))
    C.store(slot_ref.at[C.ds(0, bs)], jnp.where(key_i < n_exp, rank, -1), mask=imask)
    C.store(tok_ref.at[K._off_rows(rank, imask)], lax.div(ri, jnp.int32(top_k)), mask=imask)
    for e0 in range(0, n_exp, be):
        es = e0 + jnp.arange(be, dtype=jnp.int32)
        C.store(off_ref.at[C.ds(e0, be)], jnp.sum((key_i[None, :] <= es[:, None]).astype(jnp.int32), axis=1),
                mask=es < n_exp)


def route(ids, *, n_exp, top_k, blocks):
    """((row_token (S,), offsets (E,), slot_rows (S,)), ()) of the flat expert ids (S,), int32;
    ``blocks`` (rows, compared rows per step, experts per step): forge.spec.experts.route_blocks."""
    s = ids.shape[0]
    bs, bj, be = blocks
    kern = functools.partial(_route_kernel, n_exp=n_exp, top_k=top_k, bs=bs, bj=bj, be=be)
    i32 = jnp.int32
    outs = C.triton_call(kern, name="experts_route", grid=(1,), num_warps=4,
                         out_shape=(jax.ShapeDtypeStruct((s,), i32), jax.ShapeDtypeStruct((n_exp,), i32),
                                    jax.ShapeDtypeStruct((s,), i32)))(ids)
    return tuple(outs), ()


# The router's choice (forge/spec/experts.py, ``top_k``) in one launch: a program holds bt rows
# of logits whole; k picks by the logits (equal ones to the lower expert id), each pick's softmax
# probability from the row's max and sum, renormalised where asked. A row whose logits match no
# maximum (NaN) picks its lowest expert left, so every index stays in [0, E).
def _top_k_kernel(x_ref, s_ref, i_ref, *, top_k, renorm, bt, be, bk):
    n_tok, n_exp = x_ref.shape
    f32, ninf = jnp.float32, jnp.float32(-jnp.inf)
    rt = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    re = jnp.arange(be, dtype=jnp.int32)
    rk = jnp.arange(bk, dtype=jnp.int32)
    tmask = rt < n_tok
    alive = tmask[:, None] & (re < n_exp)[None, :]
    ts = pl.ds(pl.program_id(0) * bt, bt)
    x = C.load(x_ref.at[ts, C.ds(0, be)], mask=alive, other=-jnp.inf).astype(f32)
    top = jnp.where(tmask, jnp.max(x, axis=1), 0.0)  # (rows past T: finite, never stored)
    tot = jnp.where(tmask, jnp.sum(jnp.where(alive, jnp.exp(x - top[:, None]), 0.0), axis=1), 1.0)
    scores, index = jnp.zeros((bt, bk), f32), jnp.zeros((bt, bk), jnp.int32)
    for j in range(top_k):
        v = jnp.max(jnp.where(alive, x, ninf), axis=1)
        pick = jnp.min(jnp.where(alive & (x == v[:, None]), re[None, :], be), axis=1)
        pick = jnp.where(pick == be, jnp.min(jnp.where(alive, re[None, :], be), axis=1), pick)
        alive = alive & (re[None, :] != pick[:, None])
        scores = jnp.where(rk[None, :] == j, (jnp.exp(v - top) / tot)[:, None], scores)
        index = jnp.where(rk[None, :] == j, pick[:, None], index)
    if renorm:
        scores = scores / jnp.where(tmask, jnp.sum(scores, axis=1), 1.0)[:, None]
    omask = tmask[:, None] & (rk < top_k)[None, :]
    C.store(s_ref.at[ts, C.ds(0, bk)], scores.astype(s_ref.dtype), mask=omask)
    C.store(i_ref.at[ts, C.ds(0, bk)], index, mask=omask)


def top_k(logits, *, top_k, renorm, blocks, warps, dtype):
    """((scores (T, k) in ``dtype``, index (T, k) int32), ()) of the logits (T, E); ``blocks``
    (rows, experts, chosen) and ``warps``: forge.spec.experts.top_k_blocks and top_k_warps."""
    t = logits.shape[0]
    bt, be, bk = blocks
    kern = functools.partial(_top_k_kernel, top_k=top_k, renorm=renorm, bt=bt, be=be, bk=bk)
    outs = C.triton_call(kern, name="experts_top_k", grid=(C.row_programs(C.cdiv(t, bt)),),
                         num_warps=warps,
                         out_shape=(jax.ShapeDtypeStruct((t, top_k), jnp.dtype(dtype)),
                                    jax.ShapeDtypeStruct((t, top_k), jnp.int32)))(logits)
    return tuple(outs), ()


# ``low``: none, or (a2 (S, r), w2) with the static ``scale``: a LoRA adapter's rank-r term that
# joins the product (forge/ops/experts.py)
def glu_fwd(x, row_token, offsets, gate_up_proj, *low, act, scale=None):
    return K.glu_fwd(x, row_token, offsets, gate_up_proj, *low, kind=_KIND[act], scale=scale), ()


def glu_bwd(dy, gu, offsets, down_proj, *low, act, scale=None):
    return K.glu_bwd(dy, gu, offsets, down_proj, *low, kind=_KIND[act], scale=scale), ()


def grouped_mm(a, w, offsets, *low, scale=None):
    return (K.gmm(a, w, offsets, *low, trans_w=True, scale=scale),), ()


def grouped_mm_t(a, w, offsets, *low, scale=None):
    return (K.gmm(a, w, offsets, *low, trans_w=False, scale=scale),), ()


def grouped_wgrad(a, b, offsets, *b_rows):
    return (K.grouped_wgrad(a, b, offsets, b_rows[0] if b_rows else None),), ()
