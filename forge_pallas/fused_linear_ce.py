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
instead (``_flce_rows``: eager's three products per chunk of rows, all columns at once; the
logits and grad_h products XLA's, grad_W's update the Pallas kernel ``_gw_accumulate``, in
place). Gradients come out of the forward unscaled (the loss is a scalar); the caller scales
them by the loss's cotangent (bridge/fused_linear_ce.py hands them to forge.ops.precomputed, which
does it in place on the torch side). Pure JAX, no torch.
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


def _flce_stats_kernel(z_ref, b_ref, yl_ref, m_ref, s_ref, t_ref, sz_ref, n_ref,
                       mo_ref, so_ref, to_ref, szo_ref, *, vc, softcap, has_bias, smooth,
                       block_m, block_n):
    n = C.read_rows(n_ref)  # rows at run time (see _common.rows_operand)
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
# w_i = valid_i / divisor, with p = exp((z - m) - log s) (m the row's max, s its sum-exp: kept
# apart, so lse's rounding, relative to |lse|, does not reach every probability):
#   dL/dz_j = w_i (p_j (1 + 2 z_loss lse) - (1-eps)[j == y] - eps/V)
#   softcap z = c tanh(r / c):  dL/dr = dL/dz (1 - tanh^2)
def _flce_grad_kernel(z_ref, b_ref, yl_ref, m_ref, ls_ref, w_ref, n_ref, g_ref, *, vc, softcap, has_bias,
                      one_minus_eps, eps_over_v, two_z_loss, block_m, block_n):
    n = C.read_rows(n_ref)
    i = pl.program_id(0)
    rows = i * block_m + jnp.arange(block_m)
    rmask = rows < n
    rs = pl.ds(i * block_m, block_m)
    yl = C.load(yl_ref.at[rs], mask=rmask, other=-1)  # (BM,)
    m = C.load(m_ref.at[rs], mask=rmask, other=0.0)
    ls = C.load(ls_ref.at[rs], mask=rmask, other=0.0)
    w = C.load(w_ref.at[rs], mask=rmask, other=0.0)
    pc = (w * (1.0 + two_z_loss * (m + ls)))[:, None]

    def body(j, carry):
        j = j.astype(jnp.int32)
        cols = j * block_n + jnp.arange(block_n)
        cmask = cols < vc
        mask = rmask[:, None] & cmask[None, :]
        cs = pl.ds(j * block_n, block_n)
        z, th = _logits(z_ref, b_ref, rs, cs, rmask, cmask, softcap=softcap, has_bias=has_bias)
        hot = jnp.where(cols[None, :] == yl[:, None], one_minus_eps, 0.0)
        g = pc * jnp.exp((z - m[:, None]) - ls[:, None]) - w[:, None] * (eps_over_v + hot)
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
    return _launch(kern, name="flce_stats", grid=(C.row_programs(C.cdiv(n, bm)),), out_shape=out,
                   num_warps=warps)(z, b, yl, *state, C.rows_operand(n))


def _grad(z, b, yl, m, ls, w, dtype, *, softcap, **coefs):
    n, vc = z.shape
    if n == 0:
        return jnp.zeros((n, vc), dtype)
    bm, bn, warps = _config(vc)
    kern = functools.partial(_flce_grad_kernel, vc=vc, softcap=softcap, has_bias=b is not None,
                             block_m=bm, block_n=bn, **coefs)
    b = b if b is not None else m
    return _launch(kern, name="flce_grad", grid=(C.row_programs(C.cdiv(n, bm)),), num_warps=warps,
                   out_shape=jax.ShapeDtypeStruct((n, vc), dtype))(z, b, yl, m, ls, w, C.rows_operand(n))


# grad_W += dz^T @ h for one chunk of rows, in place (the grad_W input aliased to the output).
# XLA computes such a product into a (V, H) buffer of its own and adds it in a second pass
# (measured on the H200 at 16384 x 4096 x 128256: a 1 GB product alive beside grad_W, 10.9 ms
# of adds over 16 chunks). Here each program owns one (BV, BH) tile of grad_W: it accumulates
# dz[:, tile]^T @ h[:, tile] over the chunk's rows in fp32 and adds it to the tile once, so
# grad_W is rounded once per chunk and no second (V, H) buffer exists. Programs along H are
# launched next to each other: they share one column block of dz, read from HBM about once.
_GW_BLOCKS = (128, 256, 64)  # (BV, BH, BK): grad_W rows, grad_W columns, chunk rows per step
_GW_WARPS, _GW_STAGES = 8, 4


def _smem_budget():
    """Bytes of pipelined input blocks a program may keep in shared memory: most of a Hopper
    SM's 227 KiB (measured on the H200), of an A100's 163 or of other GPUs' ~100 (not run on
    either)."""
    if C.interpret():
        return 200 * 1024
    cc = str(getattr(jax.devices("gpu")[0], "compute_capability", "0.0"))
    return {"9.0": 200 * 1024, "8.0": 144 * 1024}.get(cc, 80 * 1024)


def _in_bounds(start, block, size):
    """The lanes of a block that fall inside ``size``; None when every block is full."""
    return None if size % block == 0 else start + jnp.arange(block) < size


def _both(rows, cols, shape):
    """The 2-D mask of two optional 1-D masks; None when neither is needed."""
    if rows is None and cols is None:
        return None
    m = jnp.ones(shape, bool)
    m = m if rows is None else m & rows[:, None]
    return m if cols is None else m & cols[None, :]


def _load(ref, mask):
    """A load masked only where a block can be ragged (the Triton lowering takes ``other``
    only with a mask)."""
    return C.load(ref) if mask is None else C.load(ref, mask=mask, other=0.0)


def _gw_acc_kernel(gw_ref, g_ref, h_ref, c_ref, out_ref, *, block_v, block_h, block_k, ragged, prec):
    v, hd = gw_ref.shape
    c = C.read_rows(c_ref)  # the chunk's rows at run time; ``ragged``: not a multiple of block_k
    acc = C.acc_dtype(gw_ref.dtype)
    j, i = pl.program_id(0), pl.program_id(1)  # H block fastest (see above), then V block
    vmask = _in_bounds(i * block_v, block_v, v)
    hmask = _in_bounds(j * block_h, block_h, hd)
    vs, hs = pl.ds(i * block_v, block_v), pl.ds(j * block_h, block_h)

    def body(k, tile):
        k = k.astype(jnp.int32)
        kmask = k * block_k + jnp.arange(block_k) < c if ragged else None
        ks = pl.ds(k * block_k, block_k)
        a = _load(g_ref.at[ks, vs], _both(kmask, vmask, (block_k, block_v)))  # (BK, BV)
        b = _load(h_ref.at[ks, hs], _both(kmask, hmask, (block_k, block_h)))  # (BK, BH)
        return tile + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=prec,
                                          preferred_element_type=acc)

    tile = jax.lax.fori_loop(0, jax.lax.div(c + (block_k - 1), C.i32(block_k)), body, jnp.zeros((block_v, block_h), acc))
    mask = _both(vmask, hmask, (block_v, block_h))
    old = _load(gw_ref.at[vs, hs], mask).astype(acc)
    C.store(out_ref.at[vs, hs], (old + tile).astype(out_ref.dtype), mask=mask)


def _gw_accumulate(gw, g, h, *, blocks=None, warps=None, stages=None):
    """gw + g^T @ h (gw: (V, H), g: (C, V), h: (C, H)), written over gw's buffer. float64
    (derivative checks only; Triton's dot has no float64) takes XLA's product and add."""
    if gw.dtype == jnp.float64:
        return gw + jnp.dot(g.T, h, precision=jax.lax.Precision.HIGHEST)
    (v, hd), c = gw.shape, g.shape[0]
    bv, bh, bk = blocks or _GW_BLOCKS
    # Triton's dot wants every side >= 16; smaller inputs take narrower (masked) blocks
    bv, bh, bk = (min(b, max(16, C.next_power_of_2(d))) for b, d in ((bv, v), (bh, hd), (bk, c)))
    prec = jax.lax.Precision.HIGHEST if gw.dtype == jnp.float32 else None
    # Triton's pipeline keeps stages - 1 blocks of both inputs in shared memory (fp32 at four
    # stages asked for 288 KiB on the H200, which has 227): fewer stages for wider dtypes
    per_stage = bk * (bv + bh) * jnp.dtype(g.dtype).itemsize
    stages = max(2, min(stages or _GW_STAGES, 1 + _smem_budget() // per_stage))
    kern = functools.partial(_gw_acc_kernel, block_v=bv, block_h=bh, block_k=bk, ragged=c % bk != 0, prec=prec)
    return _launch(kern, name="flce_grad_w", grid=(C.cdiv(hd, bh), C.cdiv(v, bv)),
                   out_shape=jax.ShapeDtypeStruct(gw.shape, gw.dtype), aliases={0: 0},
                   num_warps=warps or _GW_WARPS, num_stages=stages)(gw, g, h, C.rows_operand(c))


def tile_width(n, v, tile_vocab):
    del n
    return max(1, min(int(tile_vocab), v))


def row_loss(m, ls, t, sz, *, eps, v, z_loss):
    """Each row's loss (1-eps)(lse - z_y) + eps(lse - mean z) + z_loss lse^2 from its statistics,
    lse = m + ls (max, log sum-exp), formed as (1-eps)(m - z_y) + eps(m - mean z) + ls: m - z_y is
    exact where lse - z_y would carry lse's rounding, relative to |lse| (large logits).
    Arithmetic only: JAX arrays or torch tensors alike (bridge/fused_linear_ce.py uses it on
    torch's side)."""
    lse = m + ls
    loss = (1.0 - eps) * (m - t) + ls + z_loss * lse * lse
    return loss + (eps * m - (eps / v) * sz) if eps else loss


def _row_weights(valid, div, acc):
    """(N,) each row's weight in the mean: 1 / divisor where valid (inf for a divisor of 0, as
    eager's sum / 0 with num_items_in_batch=0), 0 where ignored (by selection: no 0 * inf)."""
    return jnp.where(valid, 1 / div, 0).astype(acc)


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
    ls = jnp.log(s)  # (N,)
    rows = row_loss(m, ls, t, sz, eps=eps, v=v, z_loss=z_loss)
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
        g = _grad(z, b, labels - v0, m, ls, w, dt, softcap=softcap, **coefs)  # (N, Vc)
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
    h[chunk] (``_gw_accumulate``, in place, rounded once per chunk). Three products, eager's
    count. The chunks are a static Python loop; each chunk's inputs pass through an
    optimization barrier with the previous chunk's loss rows and grad_h rows, so XLA runs them
    one after another (about one chunk's logits alive at a time) instead of all at once."""
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
    # grad_W starts at zero, not as the first chunk's XLA product: with that product JAX's
    # peak was 2,390 MiB at 16384 x 4096 x 128256 on the H200, from zero 2,130, the compiled
    # function itself needing 2,007 (the first call's compile, GEMM autotuning included,
    # allocates beside it)
    gw = jnp.zeros_like(weight) if need_w else None
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
        ls = jnp.log(s)
        losses.append(row_loss(m, ls, t, sz, eps=eps, v=v, z_loss=z_loss))
        if not need_grad:
            continue
        g = _grad(z, bias, y_c, m, ls, w_rows[r0:r1], dt, softcap=softcap, **coefs)  # (C, V)
        if need_h:
            gh_parts.append(jnp.dot(g, w_all, preferred_element_type=acc, precision=prec))  # (C, H)
        if need_w:  # every chunk adds into grad_W in place
            gw = _gw_accumulate(gw, g, h_c)  # (V, H)
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


# ------------------------------------------------------- one row chunk (natively launched)
# The row-chunk strategy with the products in torch (bridge/fused_linear_ce.py drives it with
# forge.spec._products.row_chunks, as the Triton backend does): per chunk only the two kernels
# run here, each a pass of its own that the bridge launches natively on torch's stream.
def flce_chunk_stats(z, yl, m0, s0, t0, sz0, bias=None, *, softcap, smooth):
    """z (C, V) fp32 logits of one chunk, yl (C,) its labels, the running state (max -inf, the
    rest 0; inputs, so the pass is the kernel alone) -> ((max, sum-exp, target logit, logit
    sum), ())."""
    return _stats(z, bias, yl, (m0, s0, t0, sz0), softcap=softcap, smooth=smooth), ()


def flce_chunk_grad(z, yl, m, ls, w, bias=None, *, softcap, dtype, one_minus_eps, eps_over_v, two_z_loss):
    """dL/dz (C, V) in ``dtype`` (a name) for one chunk from its logits, labels, row max, log
    sum-exp and row weights (valid / divisor) -> ((dz,), ())."""
    return (_grad(z, bias, yl, m, ls, w, jnp.dtype(dtype), softcap=softcap, one_minus_eps=one_minus_eps,
                  eps_over_v=eps_over_v, two_z_loss=two_z_loss),), ()
