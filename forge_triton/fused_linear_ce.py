"""Fused linear cross-entropy in Triton + cuBLAS (spec: forge/spec/fused_linear_ce.py).

The full (N, V) logits never exist. Two strategies, picked by ``spec.row_chunk``:

Vocabulary tiles (the default without gradients, or for a vocabulary too wide for row chunks of
ROW_CHUNK_MIN rows; ``tile_vocab=`` forces them): the vocabulary is walked in tiles of Vc
columns, all rows at once, so every matmul is large even at hidden 896:

  pass 1, per tile: z = h @ W[tile]^T in fp32 (cuBLAS); ``_flce_stats_kernel`` folds the tile
          into each row's running max / sum-exp, target logit and logit sum (smoothing); the
          last tile turns them into the row's loss (and keeps max and log sum-exp apart).
  pass 2, only when a gradient is wanted, per tile (the last first: its z is kept from
          pass 1): recompute z; ``_flce_grad_kernel`` turns it into dL/dz in the input dtype,
          written over z's own bytes (a bf16 row over the first half of its fp32 row);
          then grad_W[tile] = dz^T @ h (one exact write per tile) and grad_h += dz @ W[tile]
          (fp32 accumulator).

  Four matmuls (less one tile's) instead of eager's three, and one (N, Vc) fp32 tile instead of
  the logits. The host launches about six calls per tile, so the tiles are as wide as the
  memory budget allows: where a step is host-bound, the tile count is its cost.

Row chunks (``_flce_rows``; the default wherever gradients are wanted, C rows as 1 GiB of fp32
logits holds, ``spec.row_chunk``):
  per chunk of C rows, all V columns: z = h[chunk] @ W^T, both kernels on whole rows, dL/dz
  written over z's own bytes, grad_h[chunk] = dz @ W and grad_W += dz^T @ h[chunk]. Eager's
  three matmuls; grad_W is rounded once per chunk (two at 4096 x 128256) instead of once.

The loss is a scalar, so the gradients are computed in the forward and the backward only
scales them by grad_output, in place: the autograd node is the op layer's
(forge/ops/precomputed.py, both backends share it); this module hands it :func:`prepare`,
:func:`compute` and :func:`scale_` (its one-pass scaling). Nothing reads a value back to the
host: the mean's divisor is a device tensor the kernels load.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forge.spec import _products as P
from forge.spec import fused_linear_ce as spec

from . import _common, _launch

_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: torch.is_autocast_enabled())

# Tile width: forge.spec.fused_linear_ce.tile_width. 3/32 of the fp32 logits: dL/dz overlays
# the tile, so this is the footprint that 1/16 plus a separate bf16 dL/dz had (pass 2's tile
# is alive beside grad_W, where a compiled 4x1024 step peaks), in two thirds of the tiles.
LOGITS_FRACTION = 3 / 32
_BLOCK = 2048  # columns per kernel step


@triton.jit
def _tanh(x):
    # tanh from exp: libdevice.tanh is not available in Triton's interpreter
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _flce_stats_kernel(
    z_ptr, bias_ptr, labels_ptr,  # (N, Vc) raw logits of this tile, (V,), (N,)
    m_ptr, s_ptr, t_ptr, sz_ptr, loss_ptr,  # (N,) each: running max, sum-exp, target, logit sum
    stride_z, v0, vc, V, softcap, ignore_index, one_minus_eps, eps_over_v, z_loss,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    y = tl.load(labels_ptr + row).to(tl.int64)
    m = tl.full((), float("-inf"), ACC)
    s = tl.zeros((), ACC)
    t = tl.zeros((), ACC)
    sz = tl.zeros((), ACC)
    for start in range(0, vc, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vc
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(ACC)
        if HAS_BIAS:
            z += tl.load(bias_ptr + v0 + cols, mask=mask, other=0.0).to(ACC)
        if SOFTCAP:
            z = softcap * _tanh(z / softcap)
        zm = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(zm, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(zm - m_new), axis=0)
        m = m_new
        t += tl.sum(tl.where(cols == y - v0, z, 0.0), axis=0)
        if SMOOTH:
            sz += tl.sum(tl.where(mask, z, 0.0), axis=0)
    if not FIRST:  # merge with the tiles before this one
        m_old = tl.load(m_ptr + row)
        m_new = tl.maximum(m, m_old)
        s = tl.load(s_ptr + row) * tl.exp(m_old - m_new) + s * tl.exp(m - m_new)
        m = m_new
        t += tl.load(t_ptr + row)
        if SMOOTH:
            sz += tl.load(sz_ptr + row)
    if LAST:
        # loss_i = (1-eps)(lse - z_y) + eps(lse - mean_j z_j) + z_loss lse^2 with lse = m + log s,
        # formed as (1-eps)(m - z_y) + eps(m - mean_j z_j) + log s (+ z_loss lse^2): m - z_y is
        # exact where lse - z_y would carry lse's rounding, relative to |lse| (large logits).
        # For the same reason m_ptr keeps m and s_ptr log s for the grad kernel, not their sum.
        log_s = tl.log(s)
        lse = m + log_s
        loss = one_minus_eps * (m - t) + log_s + z_loss * lse * lse
        if SMOOTH:
            loss += (1.0 - one_minus_eps) * m - eps_over_v * sz
        tl.store(loss_ptr + row, tl.where(y != ignore_index, loss, 0.0))
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, log_s)
    else:
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(t_ptr + row, t)
        if SMOOTH:
            tl.store(sz_ptr + row, sz)


# Backward of the row loss above with p = softmax(z) = exp((z - m) - log s), y the label, w_i = valid_i /
# divisor:  dL/dz_j = w_i (p_j (1 + 2 z_loss lse) - (1-eps)[j == y] - eps/V);
# softcap z = c tanh(r / c):  dL/dr = dL/dz (1 - tanh^2).
# ``g_ptr`` may be ``z_ptr`` itself when both are fp32 (same element, same thread), or, with SYNC,
# a narrower view of z's own bytes that starts where each z row starts: block k of g lands on
# z's columns [k B / 2, (k + 1) B / 2), which every warp has read by block k once they meet at
# the barrier.
@triton.jit
def _flce_grad_kernel(
    z_ptr, g_ptr, bias_ptr, labels_ptr, m_ptr, log_s_ptr, scale_ptr,  # (N, Vc) (N, Vc) (V,) (N,) (N,) (N,) ()
    stride_z, stride_g, v0, vc, softcap, ignore_index, one_minus_eps, eps_over_v, two_z_loss,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr,
    SYNC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y = tl.load(labels_ptr + row).to(tl.int64)
    m = tl.load(m_ptr + row)
    log_s = tl.load(log_s_ptr + row)
    w = tl.where(y != ignore_index, tl.load(scale_ptr).to(ACC), 0.0)
    p_coef = w * (1.0 + two_z_loss * (m + log_s))
    for start in range(0, vc, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vc
        z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(ACC)
        if HAS_BIAS:
            z += tl.load(bias_ptr + v0 + cols, mask=mask, other=0.0).to(ACC)
        if SOFTCAP:
            th = _tanh(z / softcap)
            z = softcap * th
        g = p_coef * tl.exp((z - m) - log_s) - w * (eps_over_v + tl.where(cols == y - v0, one_minus_eps, 0.0))
        if SOFTCAP:
            g = g * (1.0 - th * th)
        if SYNC:  # g's row overlays the first half of z's row: every warp has read this block
            tl.debug_barrier()  # (and so every earlier one) before any warp stores over it
        tl.store(g_ptr + row * stride_g + cols, _common.cast(g, g_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flce_scale_kernel(g_ptr, c_ptr, numel, BLOCK: tl.constexpr):
    # g *= c in fp32 with one rounding (a bf16 tensor times a 0-dim fp32 tensor in torch rounds
    # c to bf16 first)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    c = tl.load(c_ptr)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    tl.store(g_ptr + offs, _common.cast(g.to(c.dtype) * c, g_ptr.dtype.element_ty), mask=mask)


_STATS = _launch.FastKernel(_flce_stats_kernel)
_GRAD = _launch.FastKernel(_flce_grad_kernel)
_SCALE = _launch.FastKernel(_flce_scale_kernel)


def scale_kernel(g, c):
    """g *= c in place, g contiguous and narrower than c: one pass over g (read + write), where
    torch needs a chunked round trip through c's dtype for a one-rounding result (5x the
    traffic). The op layer's scaling (forge.ops.precomputed.scale_) uses it for CUDA tensors of
    either backend."""
    if g.numel():
        block = 4096
        _SCALE[(_common.cdiv(g.numel(), block),)](g, c.contiguous(), g.numel(), BLOCK=block)
    return g


def scale_(g, c):
    """The scaling this backend's loss uses, in place: the one-pass kernel where it applies (on
    the CPU too, in the interpreter, so the kernel is tested), else None: the op layer's own."""
    if g.is_contiguous() and g.element_size() < c.element_size():
        return scale_kernel(g, c)
    return None


# ------------------------------------------------------------------------------- matmuls
# torch's products with the spec's roundings, and the row-chunk strategy's loop around this
# module's kernels: forge.spec._products (the Pallas backend's loss shares them)
_mm_f32, _addmm_f32_, _mm_into = P.mm_f32, P.addmm_f32_, P.mm_into


def _dz_over(z, dt):
    """dL/dz's buffer, over the fp32 logits z's own bytes (both strategies): z itself when dL/dz
    is fp32 too (each element read and written by the same thread), else each row of the
    narrower dtype over the first half of z's row (row stride twice z's width), which the grad
    kernel writes behind its barrier (SYNC, set where this is not z)."""
    if z.dtype not in (torch.float32, torch.float64):  # never overlay a narrower tile: the rows
        # would be written past its end (a product that returned the autocast dtype did this)
        raise RuntimeError(f"fused_linear_ce: the logits tile is {z.dtype}, expected float32; was a product "
                           "autocast inside the loss?")
    return z if z.dtype == dt else z.view(dt)[:, : z.shape[1]]


def _tiles(n, v, tile_vocab):
    """Tile boundaries over the vocabulary: ``tile_vocab`` columns, or as wide as the memory
    budget allows, balanced so the last tile is not a sliver."""
    tile_vocab = spec.tile_width(n, v, tile_vocab, logits_fraction=LOGITS_FRACTION)
    return [(v0, min(v0 + tile_vocab, v)) for v0 in range(0, v, tile_vocab)]


def _setup(hidden, weight, labels, bias, width, *, ignore_index, softcap, label_smoothing):
    """What both strategies hand the kernels: contiguous labels, the five (N,) row buffers
    (running max, sum-exp (its log after the last tile), target logit, logit sum, row loss),
    the kernels' common scalar arguments and flags for tiles of ``width`` columns, and the bias
    argument."""
    n, v = hidden.shape[0], weight.shape[0]
    dt = hidden.dtype
    acc_t = _common.acc_torch(dt)
    bufs = tuple(torch.empty(n, dtype=acc_t, device=hidden.device) for _ in range(5))
    eps = float(label_smoothing)
    common = dict(softcap=float(softcap or 1.0), ignore_index=ignore_index, one_minus_eps=1.0 - eps,
                  eps_over_v=eps / v)
    flags = dict(HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, ACC=_common.acc(dt),
                 BLOCK=min(_BLOCK, triton.next_power_of_2(max(width, 16))))
    # (the kernels index the bias as contiguous; bufs[0] is never read without HAS_BIAS)
    bias_arg = bias.contiguous() if bias is not None else bufs[0]
    return labels.contiguous(), bufs, common, flags, bias_arg


def _row_scale(div, acc_t):
    """A valid row's weight in the loss, 1 / divisor, as a () tensor on the device: inf for a
    divisor of 0 (the grad kernel gives ignored rows 0 by selection, not by product), so
    num_items_in_batch=0 with valid labels gives eager's non-finite gradients, not zeros."""
    return (1.0 / div).to(acc_t)


def flce_forward(hidden, weight, labels, bias, div, *, ignore_index, softcap, label_smoothing,
                 z_loss, need_h, need_w, need_b, tile_vocab=None, chunk_rows=None):
    """Loss and (unscaled) gradients. Returns (loss, grad_h fp32 | None, grad_W | None, grad_b | None).
    Row chunks when ``chunk_rows`` is given or :func:`spec.row_chunk` picks them, else vocabulary
    tiles."""
    n, v = hidden.shape[0], weight.shape[0]
    if tile_vocab is None:
        chunk_rows = spec.row_chunk(n, v, chunk_rows, need_grad=need_h or need_w or need_b)
        if chunk_rows:
            return _flce_rows(hidden, weight, labels, bias, div, ignore_index=ignore_index,
                              softcap=softcap, label_smoothing=label_smoothing, z_loss=z_loss,
                              need_h=need_h, need_w=need_w, need_b=need_b, chunk_rows=chunk_rows)
    dev, dt = hidden.device, hidden.dtype
    acc_t = _common.acc_torch(dt)
    labels, (m_buf, s_buf, t_buf, sz_buf, rows), common, flags, bias_arg = _setup(
        hidden, weight, labels, bias, min(tile_vocab or v, v), ignore_index=ignore_index,
        softcap=softcap, label_smoothing=label_smoothing)
    eps = float(label_smoothing)
    tiles = _tiles(n, v, tile_vocab)
    w_tiles = [weight[v0:v1] for v0, v1 in tiles]  # (views made once: host time per tile counts)
    grid = (n,)
    need_grad = need_h or need_w or need_b
    for i, (v0, v1) in enumerate(tiles):
        z = _mm_f32(hidden, w_tiles[i].t())  # (N, Vc)
        if n:
            _STATS[grid](
                z, bias_arg, labels, m_buf, s_buf, t_buf, sz_buf, rows, z.stride(0), v0, v1 - v0, v,
                **common, z_loss=float(z_loss), SMOOTH=eps > 0, FIRST=i == 0, LAST=i == len(tiles) - 1,
                **flags, num_warps=8,
            )
        if not (need_grad and i == len(tiles) - 1):
            del z  # the last tile's logits are kept: pass 2 starts with them (one matmul fewer)
    loss = rows.sum() / div
    gh = gw = gb = None
    if not need_grad:
        return loss, gh, gw, gb
    scale = _row_scale(div, acc_t)
    if need_h:
        gh = torch.zeros((n, hidden.shape[1]), dtype=acc_t, device=dev)  # (N, H) accumulator
    if need_w:
        gw = _common.empty(weight.shape, weight.dtype, dev)  # (V, H), every row written once
    if need_b:
        gb = _common.empty((v,), bias.dtype, dev)
    for i in reversed(range(len(tiles))):
        (v0, v1), w_t = tiles[i], w_tiles[i]
        if v1 != v:
            z = _mm_f32(hidden, w_t.t())  # (N, Vc) acc dtype
        g = _dz_over(z, dt)  # (N, Vc)
        if n:
            _GRAD[grid](
                z, g, bias_arg, labels, m_buf, s_buf, scale, z.stride(0), g.stride(0), v0, v1 - v0,
                **common, two_z_loss=2.0 * float(z_loss), **flags, SYNC=g is not z, num_warps=8,
            )
        else:
            g.zero_()
        if need_w:
            _mm_into(gw[v0:v1], g.t(), hidden)  # (Vc, H), one exact write per tile
        if need_h:
            _addmm_f32_(gh, g, w_t)  # (N, H) += (N, Vc) @ (Vc, H)
        if need_b:
            gb[v0:v1] = g.sum(0, dtype=acc_t)
        del z, g
    return loss, gh, gw, gb


def _flce_rows(hidden, weight, labels, bias, div, *, ignore_index, softcap, label_smoothing, z_loss,
               need_h, need_w, need_b, chunk_rows):
    """Row chunks, every column at once (forge.spec._products.row_chunks runs the products):
    per chunk of C rows the stats kernel forms each row's lse and loss in one tile over
    z = h[chunk] @ W^T (C, V) fp32, and the grad kernel writes dL/dz over z's own bytes (bf16
    over the first half of each fp32 row). Three matmuls, eager's count, against the vocabulary
    tiles' four; the price is one rounding of the low-precision grad_W per chunk (one per tile
    there) and a read + write of grad_W per chunk after the first, which is why spec.row_chunk
    makes the chunks as tall as its budget allows."""
    v = weight.shape[0]
    dt = hidden.dtype
    acc_t = _common.acc_torch(dt)
    labels, (m_buf, s_buf, t_buf, sz_buf, rows), common, flags, bias_arg = _setup(
        hidden, weight, labels, bias, v, ignore_index=ignore_index, softcap=softcap,
        label_smoothing=label_smoothing)
    eps = float(label_smoothing)
    need_grad = need_h or need_w or need_b
    if need_grad:
        scale = _row_scale(div, acc_t)

    def kernels(r0, r1, z):
        y_c, m_c, log_s_c = labels[r0:r1], m_buf[r0:r1], s_buf[r0:r1]
        _STATS[(r1 - r0,)](
            z, bias_arg, y_c, m_c, log_s_c, t_buf[r0:r1], sz_buf[r0:r1], rows[r0:r1],
            z.stride(0), 0, v, v, **common, z_loss=float(z_loss), SMOOTH=eps > 0, FIRST=True,
            LAST=True, **flags, num_warps=8,
        )
        if not need_grad:
            return None
        g = _dz_over(z, dt)  # (C, V)
        _GRAD[(r1 - r0,)](
            z, g, bias_arg, y_c, m_c, log_s_c, scale, z.stride(0), g.stride(0), 0, v, **common,
            two_z_loss=2.0 * float(z_loss), **flags, SYNC=g is not z, num_warps=8,
        )
        return g

    gh, gw, gb = P.row_chunks(hidden, weight, chunk_rows, need_h, need_w, need_b, kernels, _common.empty)
    loss = rows.sum() / div
    if gb is not None:
        gb = gb.to(bias.dtype)
    return loss, gh, gw, gb


def prepare(hidden, weight, labels, bias=None, *, ignore_index=-100, reduction="mean",
            num_items_in_batch=None, softcap=None, label_smoothing=0.0, z_loss=0.0, tile_vocab=None,
            chunk_rows=None):
    """Check the arguments (forge.spec.fused_linear_ce) and return what :func:`compute` takes:
    (tensors, static): (hidden, weight, labels, div[, bias]) and the hashable options. Extra,
    optional: ``tile_vocab`` walks vocabulary tiles of that width, ``chunk_rows`` row chunks of
    that many rows (at most one of them); neither, and ``forge.spec.fused_linear_ce.row_chunk``
    picks (row chunks only when they are tall enough to win), the tiles sized by ``tile_width``."""
    spec.check(hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
               num_items_in_batch=num_items_in_batch, softcap=softcap,
               label_smoothing=label_smoothing, z_loss=z_loss)
    _common.check_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    spec.check_strategy(tile_vocab, chunk_rows)
    acc_t = _common.acc_torch(hidden.dtype)
    div = spec.divisor(labels, ignore_index, reduction, num_items_in_batch, acc_t, hidden.device)
    static = dict(ignore_index=int(ignore_index), softcap=None if softcap is None else float(softcap),
                  label_smoothing=float(label_smoothing), z_loss=float(z_loss), tile_vocab=tile_vocab,
                  chunk_rows=chunk_rows)
    return (hidden, weight, labels, div) + (() if bias is None else (bias,)), static


def compute(tensors, static, need_h, need_w, need_b):
    """(loss, grad_h fp32 | None, grad_W | None, grad_b | None), the gradients unscaled (the
    op layer's node scales them by the loss's cotangent)."""
    hidden, weight, labels, div = tensors[:4]
    bias = tensors[4] if len(tensors) > 4 else None
    if _any_autocast():  # (the op layer casts at its entry; a compiled graph may call this
        # op with the caller's autocast on): the products here must keep their fp32 outputs, the
        # gradient kernel writes dL/dz over the fp32 logits' own bytes
        with torch.autocast(hidden.device.type, enabled=False):
            return flce_forward(hidden, weight, labels, bias, div, need_h=need_h, need_w=need_w,
                                need_b=need_b, **static)
    return flce_forward(hidden, weight, labels, bias, div, need_h=need_h, need_w=need_w, need_b=need_b, **static)
