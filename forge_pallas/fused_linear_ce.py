"""Fused linear cross-entropy in JAX + Pallas (spec: forge/spec/fused_linear_ce.py).

The same two-pass scheme as the Triton backend, in one jitted function: the vocabulary is
walked in tiles of Vc columns over all rows, so the (N, V) logits never exist.

  pass 1, per tile: z = h @ W[tile]^T (XLA dot, fp32 out); ``_flce_stats_kernel`` (Pallas)
          folds it into each row's running max, sum-exp, target logit and logit sum.
  pass 2, only for the gradients wanted (static ``grads_for``), per tile: recompute z;
          ``_flce_grad_kernel`` (Pallas) writes dL/dz in the input dtype; then
          grad_W[tile] = dz^T @ h (written once) and grad_h += dz @ W[tile] (fp32 carry).

Full tiles run in a ``fori_loop`` (one compiled body whatever V is); a ragged last tile runs
once after it with its own static width. With ``chunk_rows`` the row-chunk strategy runs
instead (``_flce_rows``: eager's three products per chunk of rows, all columns at once).
Gradients come out of the forward unscaled (the loss
is a scalar); the caller scales them by the loss's cotangent (bridge/fused_linear_ce.py hands
them to forge._precomputed, which does it in place on the torch side). Pure JAX, no torch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _common as C

# The tile width comes from the caller (bridge/fused_linear_ce.py sizes it with the spec's rule)
_BLOCK_M = 4  # rows per program
_BLOCK_N = 1024  # columns per step


def _logits(z_ref, b_ref, rs, cs, rmask, cmask, *, softcap, has_bias):
    acc = C.acc_dtype(z_ref.dtype)
    mask = rmask[:, None] & cmask[None, :]
    z = C.load(z_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)  # (BM, BN)
    if has_bias:
        z = z + C.load(b_ref.at[cs], mask=cmask, other=0.0).astype(acc)[None, :]
    th = None
    if softcap is not None:
        th = jnp.tanh(z / softcap)
        z = softcap * th
    return z, th


def _flce_stats_kernel(z_ref, b_ref, yl_ref, m_ref, s_ref, t_ref, sz_ref,
                       mo_ref, so_ref, to_ref, szo_ref, *, vc, softcap, has_bias, smooth,
                       block_m, block_n):
    n = z_ref.shape[0]
    acc = C.acc_dtype(z_ref.dtype)
    i = pl.program_id(0)
    rows = i * block_m + jnp.arange(block_m)  # (BM,)
    rmask = rows < n
    rs = pl.ds(i * block_m, block_m)
    yl = C.load(yl_ref.at[rs], mask=rmask, other=-1)  # (BM,) label - tile start

    def body(j, carry):
        m, s, t, sz = carry
        j = j.astype(jnp.int32)  # same index type as program_id, also under x64
        cols = j * block_n + jnp.arange(block_n)  # (BN,)
        cmask = cols < vc
        mask = rmask[:, None] & cmask[None, :]
        z, _ = _logits(z_ref, b_ref, rs, pl.ds(j * block_n, block_n), rmask, cmask,
                       softcap=softcap, has_bias=has_bias)
        zm = jnp.where(mask, z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(zm, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(zm - m_new[:, None]), axis=1)
        t = t + jnp.sum(jnp.where(cols[None, :] == yl[:, None], z, 0), axis=1)
        if smooth:
            sz = sz + jnp.sum(jnp.where(mask, z, 0), axis=1)
        return m_new, s, t, sz

    zero = jnp.zeros((block_m,), acc)
    init = (jnp.full((block_m,), -jnp.inf, acc), zero, zero, zero)
    m, s, t, sz = jax.lax.fori_loop(0, C.cdiv(vc, block_n), body, init)
    # merge with the tiles before this one (m_old = -inf on the first: exp(-inf) = 0)
    m_old = C.load(m_ref.at[rs], mask=rmask, other=0.0)
    m_new = jnp.maximum(m, m_old)
    s = C.load(s_ref.at[rs], mask=rmask, other=0.0) * jnp.exp(m_old - m_new) + s * jnp.exp(m - m_new)
    C.store(mo_ref.at[rs], m_new, mask=rmask)
    C.store(so_ref.at[rs], s, mask=rmask)
    C.store(to_ref.at[rs], t + C.load(t_ref.at[rs], mask=rmask, other=0.0), mask=rmask)
    C.store(szo_ref.at[rs], sz + C.load(sz_ref.at[rs], mask=rmask, other=0.0), mask=rmask)


# Backward of the row loss (1-eps)(lse - z_y) + eps(lse - mean z) + z_loss lse^2, weighted by
# w_i = valid_i / divisor, with p = exp(z - lse):
#   dL/dz_j = w_i (p_j (1 + 2 z_loss lse) - (1-eps)[j == y] - eps/V)
#   softcap z = c tanh(r / c):  dL/dr = dL/dz (1 - tanh^2)
def _flce_grad_kernel(z_ref, b_ref, yl_ref, lse_ref, w_ref, g_ref, *, vc, softcap, has_bias,
                      one_minus_eps, eps_over_v, two_z_loss, block_m, block_n):
    n = z_ref.shape[0]
    i = pl.program_id(0)
    rows = i * block_m + jnp.arange(block_m)
    rmask = rows < n
    rs = pl.ds(i * block_m, block_m)
    yl = C.load(yl_ref.at[rs], mask=rmask, other=-1)  # (BM,)
    lse = C.load(lse_ref.at[rs], mask=rmask, other=0.0)
    w = C.load(w_ref.at[rs], mask=rmask, other=0.0)
    pc = (w * (1.0 + two_z_loss * lse))[:, None]

    def body(j, carry):
        j = j.astype(jnp.int32)
        cols = j * block_n + jnp.arange(block_n)
        cmask = cols < vc
        mask = rmask[:, None] & cmask[None, :]
        cs = pl.ds(j * block_n, block_n)
        z, th = _logits(z_ref, b_ref, rs, cs, rmask, cmask, softcap=softcap, has_bias=has_bias)
        hot = jnp.where(cols[None, :] == yl[:, None], one_minus_eps, 0.0)
        g = pc * jnp.exp(z - lse[:, None]) - w[:, None] * (eps_over_v + hot)
        if softcap is not None:
            g = g * (1.0 - th * th)
        C.store(g_ref.at[rs, cs], g.astype(g_ref.dtype), mask=mask)
        return carry

    jax.lax.fori_loop(0, C.cdiv(vc, block_n), body, 0)


_launch = C.triton_call  # the lowering choice for this kernel (Triton lowering; see _common)


def _config(vc):
    block_n = min(_BLOCK_N, C.next_power_of_2(vc))
    return _BLOCK_M, block_n, C.warps_for(_BLOCK_M * block_n)


def _stats(z, b, yl, state, *, softcap, smooth):
    n, vc = z.shape
    if n == 0:  # no rows: nothing to launch (a zero-size grid)
        return state
    bm, bn, warps = _config(vc)
    kern = functools.partial(_flce_stats_kernel, vc=vc, softcap=softcap, has_bias=b is not None,
                             smooth=smooth, block_m=bm, block_n=bn)
    out = tuple(jax.ShapeDtypeStruct((n,), a.dtype) for a in state)
    b = b if b is not None else state[0]  # never read without a bias
    return _launch(kern, name="flce_stats", grid=(C.cdiv(n, bm),), out_shape=out,
                   num_warps=warps)(z, b, yl, *state)


def _grad(z, b, yl, lse, w, dtype, *, softcap, **coefs):
    n, vc = z.shape
    if n == 0:
        return jnp.zeros((n, vc), dtype)
    bm, bn, warps = _config(vc)
    kern = functools.partial(_flce_grad_kernel, vc=vc, softcap=softcap, has_bias=b is not None,
                             block_m=bm, block_n=bn, **coefs)
    b = b if b is not None else lse
    return _launch(kern, name="flce_grad", grid=(C.cdiv(n, bm),), num_warps=warps,
                   out_shape=jax.ShapeDtypeStruct((n, vc), dtype))(z, b, yl, lse, w)


def tile_width(n, v, tile_vocab):
    del n
    return max(1, min(int(tile_vocab), v))


def _row_loss(lse, t, sz, *, eps, v, z_loss):
    """Each row's loss (1-eps)(lse - z_y) + eps(lse - mean z) + z_loss lse^2 from its statistics."""
    return lse - (1.0 - eps) * t - (eps / v) * sz + z_loss * lse * lse


def _row_weights(valid, div, acc):
    """(N,) each row's weight in the mean: valid / divisor (0 when the divisor is 0)."""
    return jnp.where(valid, jnp.where(div == 0, 0, 1 / div), 0).astype(acc)


def _over_tiles(v, vc, step, carry):
    """carry = step(v0, width, carry) over full tiles (fori_loop) and the ragged tail."""
    full = v // vc
    if full:
        carry = jax.lax.fori_loop(0, full, lambda k, c: step(k * vc, vc, c), carry)
    if v % vc:
        carry = step(full * vc, v % vc, carry)
    return carry


def flce_fwd(hidden, weight, labels, div, bias=None, *, ignore_index, softcap, label_smoothing,
             z_loss, tile_vocab, grads_for, chunk_rows=None):
    """hidden (N, H), weight (V, H), labels (N,) int, div () float, bias (V,) | None ->
    ((loss (),), residuals): the wanted ones of grad_h (N, H) fp32, grad_W (V, H), grad_b (V,).
    Row chunks of ``chunk_rows`` rows when it is given (:func:`_flce_rows`), else vocabulary
    tiles of ``tile_vocab`` columns."""
    if chunk_rows:
        return _flce_rows(hidden, weight, labels, div, bias, ignore_index=ignore_index,
                          softcap=softcap, label_smoothing=label_smoothing, z_loss=z_loss,
                          chunk_rows=chunk_rows, grads_for=grads_for)
    n, hd = hidden.shape
    v = weight.shape[0]
    dt = hidden.dtype
    acc = C.acc_dtype(dt)
    # fp32 inputs: full fp32 products (XLA defaults to tf32 on the GPU); bf16 keeps the default
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    vc = tile_width(n, v, tile_vocab)
    eps = float(label_smoothing)
    labels = labels.astype(jnp.int32)
    valid = labels != ignore_index

    def logits(v0, width):
        wt = jax.lax.dynamic_slice_in_dim(weight, v0, width)  # (Vc, H)
        z = jnp.dot(hidden, wt.T, preferred_element_type=acc, precision=prec)  # (N, Vc)
        b = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, v0, width)
        return z, b, wt

    def pass1(v0, width, state):
        z, b, _ = logits(v0, width)
        return _stats(z, b, labels - v0, state, softcap=softcap, smooth=eps > 0)

    zero = jnp.zeros((n,), acc)
    m, s, t, sz = _over_tiles(v, vc, pass1, (jnp.full((n,), -jnp.inf, acc), zero, zero, zero))
    lse = m + jnp.log(s)  # (N,)
    rows = _row_loss(lse, t, sz, eps=eps, v=v, z_loss=z_loss)
    loss = jnp.sum(jnp.where(valid, rows, 0)) / div.astype(acc)

    need_h, need_w, need_b = grads_for
    if not (need_h or need_w or need_b):
        return (loss,), ()
    div = div.astype(acc)
    w = _row_weights(valid, div, acc)
    coefs = dict(one_minus_eps=1.0 - eps, eps_over_v=eps / v, two_z_loss=2.0 * z_loss)

    def pass2(v0, width, grads):
        gh, gw, gb = grads
        z, b, wt = logits(v0, width)
        g = _grad(z, b, labels - v0, lse, w, dt, softcap=softcap, **coefs)  # (N, Vc)
        if need_w:
            gw_tile = jnp.dot(g.T, hidden, preferred_element_type=acc, precision=prec).astype(dt)  # (Vc, H)
            gw = jax.lax.dynamic_update_slice_in_dim(gw, gw_tile, v0, 0)
        if need_h:
            gh = gh + jnp.dot(g, wt, preferred_element_type=acc, precision=prec)
        if need_b:
            gb_tile = jnp.sum(g.astype(acc), 0).astype(dt)  # (Vc,)
            gb = jax.lax.dynamic_update_slice_in_dim(gb, gb_tile, v0, 0)
        return gh, gw, gb

    init = (jnp.zeros((n, hd), acc) if need_h else None,
            jnp.zeros_like(weight) if need_w else None,
            jnp.zeros((v,), dt) if need_b else None)
    grads = _over_tiles(v, vc, pass2, init)
    return (loss,), tuple(x for x in grads if x is not None)  # the bridge keeps arrays only


def _flce_rows(hidden, weight, labels, div, bias, *, ignore_index, softcap, label_smoothing, z_loss,
               chunk_rows, grads_for):
    """Row chunks, every column at once (both backends' second strategy): per chunk of C rows,
    z = h[chunk] @ W^T (C, V) fp32, the stats kernel over the whole row (one tile), the grad
    kernel's dL/dz (C, V) in the input dtype, grad_h[chunk] = dz @ W and grad_W += dz^T @
    h[chunk] (the product and the sum each rounded to the input dtype: XLA does not fold the add
    into the product here). Three products, eager's count. The chunks are a static Python loop;
    each chunk's inputs pass through an optimization barrier with the previous chunk's loss rows
    and grad_h rows, so XLA runs them one after another (about one chunk's logits alive at a
    time) instead of all at once."""
    n, hd = hidden.shape
    v = weight.shape[0]
    dt = hidden.dtype
    acc = C.acc_dtype(dt)
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    eps = float(label_smoothing)
    labels = labels.astype(jnp.int32)
    valid = labels != ignore_index
    need_h, need_w, need_b = grads_for
    need_grad = need_h or need_w or need_b
    div = div.astype(acc)
    w_rows = _row_weights(valid, div, acc)
    coefs = dict(one_minus_eps=1.0 - eps, eps_over_v=eps / v, two_z_loss=2.0 * z_loss)
    losses, gh_parts = [], []
    gw = jnp.zeros_like(weight) if need_w and n == 0 else None
    gb = jnp.zeros((v,), acc) if need_b else None
    last = ()  # the previous chunk's results: the next chunk's inputs wait for them
    for r0 in range(0, n, chunk_rows):
        r1 = min(r0 + chunk_rows, n)
        h_all, w_all, _ = jax.lax.optimization_barrier((hidden, weight, last))
        h_c, y_c = h_all[r0:r1], labels[r0:r1]
        z = jnp.dot(h_c, w_all.T, preferred_element_type=acc, precision=prec)  # (C, V)
        zero = jnp.zeros((r1 - r0,), acc)
        m, s, t, sz = _stats(z, bias, y_c, (jnp.full((r1 - r0,), -jnp.inf, acc), zero, zero, zero),
                             softcap=softcap, smooth=eps > 0)
        lse = m + jnp.log(s)
        losses.append(_row_loss(lse, t, sz, eps=eps, v=v, z_loss=z_loss))
        if not need_grad:
            continue
        g = _grad(z, bias, y_c, lse, w_rows[r0:r1], dt, softcap=softcap, **coefs)  # (C, V)
        if need_h:
            gh_parts.append(jnp.dot(g, w_all, preferred_element_type=acc, precision=prec))  # (C, H)
        if need_w:  # (in the input dtype; each chunk's sum behind a barrier: without it XLA
            # fused the chunks' adds into one at the end, every chunk's (V, H) product alive)
            prod = jnp.dot(g.T, h_c, preferred_element_type=dt, precision=prec)  # (V, H)
            gw = prod if gw is None else jax.lax.optimization_barrier(gw + prod)
        if need_b:
            gb = gb + jnp.sum(g.astype(acc), 0)
        last = (losses[-1], gh_parts[-1] if need_h else None, gb)
    rows = jnp.concatenate(losses) if losses else jnp.zeros((0,), acc)
    loss = jnp.sum(jnp.where(valid, rows, 0)) / div
    if not need_grad:
        return (loss,), ()
    gh = (jnp.concatenate(gh_parts) if gh_parts else jnp.zeros((n, hd), acc)) if need_h else None
    if gb is not None:
        gb = gb.astype(dt)
    return (loss,), tuple(x for x in (gh, gw, gb) if x is not None)
