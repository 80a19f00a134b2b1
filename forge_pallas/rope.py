"""Rotary position embedding (HF rotate_half), q and k in one launch, as a Pallas kernel
(spec: forge/spec/rope.py).

One program per (batch, block of positions), on one grid axis: it loads that block's cos/sin rows once (full
width, as two halves, so any cos/sin is exact) and loops over every q head, then every k head,
a few heads a step (all their loads before their stores).
Each tensor comes in one of two physical layouts, static per tensor: "bhsd" (B, H, S, D) or
"bshd" (B, S, H, D). HF builds q as a (B, S, H, D) projection viewed as (B, H, S, D) through a
transpose, so the bridge hands over the (B, S, H, D) storage with layout "bshd": no copy.
cos, sin: (B or 1, S, D). Outputs keep their input's layout.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _common as C

LAYOUTS = ("bhsd", "bshd")


# x = [x1, x2] (halves of D), R(x) = [-x2, x1];  forward: out = x * cos + R(x) * sin, i.e.
#   out1 = x1 c1 - x2 s1,   out2 = x2 c2 + x1 s2.
# Backward: dx = g * cos + R^T(g * sin) with R^T(v) = [v2, -v1], i.e.
#   dx1 = g1 c1 + g2 s2,    dx2 = g2 c2 - g1 s1,
# the forward formula with (s1, s2) -> (-s2, -s1): one kernel, ``backward`` static.
#
# The kernel sees every tensor with the batch and sequence folded into its leading dimension,
# so no stride depends on them: "bhsd" as (B H S, D) (row (b H + h) S + s), "bshd" as
# (B S, H, D) (row b S + s), cos/sin as (B S, D) or (S, D). S and cos's batch count (B or 1) come
# at run time (``seq_ref``, ``cosb_ref``), B through the grid size: the lowered module depends
# on neither the batch nor the sequence length, only on the positions per program
# (``_block_s``, a bucket of B S).
def _rope_kernel(q_ref, k_ref, cos_ref, sin_ref, seq_ref, cosb_ref, qo_ref, ko_ref, *, q_layout, k_layout,
                 q_heads, k_heads, half, block_s, block_h, heads_per_step, backward):
    acc = C.acc_dtype(jnp.promote_types(q_ref.dtype, cos_ref.dtype))
    seq = C.read_rows(seq_ref)
    # one grid axis of B x (position blocks, at least two: see _common.row_programs); the
    # batch count is never needed, so it stays a launch argument
    nblk = jnp.maximum(jax.lax.div(seq + (block_s - 1), C.i32(block_s)), 2)
    pid = pl.program_id(0)
    b, j = jax.lax.div(pid, nblk), jax.lax.rem(pid, nblk)
    # cos/sin hold one entry per batch entry (B) or one shared by all (1): b mod that count,
    # read at run time like S (a static choice would lower B = 1 and B > 1 differently)
    cb = jax.lax.rem(b, C.read_rows(cosb_ref))
    s0 = j * block_s
    smask = s0 + jnp.arange(block_s) < seq  # (BS,)
    mask = smask[:, None] & (jnp.arange(block_h) < half)[None, :]  # (BS, BH)
    # the second half's lanes run past D when half is not a power of two (masked); Pallas
    # rejects a static out-of-range slice start, so then make the start a traced value
    hstart = half if 2 * half >= half + block_h else half + 0 * b
    lo, hi = C.ds(0, block_h), C.ds(hstart, block_h)

    def ld(ref, *idx):
        return C.load(ref.at[idx], mask=mask, other=0.0).astype(acc)

    cs = C.ds(cb * seq + s0, block_s)
    c1, c2 = ld(cos_ref, cs, lo), ld(cos_ref, cs, hi)
    s1, s2 = ld(sin_ref, cs, lo), ld(sin_ref, cs, hi)
    if backward:
        s1, s2 = -s2, -s1

    def rotate_heads(x_ref, o_ref, layout, heads):
        def index(h):
            if layout == "bhsd":
                return (C.ds((b * heads + h) * seq + s0, block_s),)
            return (C.ds(b * seq + s0, block_s), h)

        def group(h0, n):
            # every load of the group's n heads before any store: the compiler cannot move a
            # load above a store that may alias it, so this is what keeps n heads' reads in flight
            idx = [index(h0 + i) for i in range(n)]
            xs = [(ld(x_ref, *ix, lo), ld(x_ref, *ix, hi)) for ix in idx]
            for ix, (x1, x2) in zip(idx, xs):
                C.store(o_ref.at[(*ix, lo)], (x1 * c1 - x2 * s1).astype(o_ref.dtype), mask=mask)
                C.store(o_ref.at[(*ix, hi)], (x2 * c2 + x1 * s2).astype(o_ref.dtype), mask=mask)

        per = max(1, min(heads_per_step, heads))
        if heads // per:
            jax.lax.fori_loop(C.i32(0), C.i32(heads // per), lambda i, c: (group(i * per, per), c)[1], 0)
        if heads % per:  # the last heads, fewer than a step's; a traced first head, as in the
            # loop (JAX's CPU interpreter cannot index a head axis by a Python int)
            group(heads - heads % per + 0 * b, heads % per)

    rotate_heads(q_ref, qo_ref, q_layout, q_heads)
    rotate_heads(k_ref, ko_ref, k_layout, k_heads)


# The lowering choice for this kernel lives here (Triton lowering; see _common).
_launch = C.triton_call


# programs per SM that _block_s aims at, warps per program (None: by tile size), and heads
# rotated per loop step (their loads all issued before their stores); bench/diagnostics/tune_pallas.py
# swept them (docs/pallas-native.md): 4 heads a step took rope at the large shape from
# 1.09-1.10x Triton's time to 1.06-1.07x and at the model's from 1.00x to 0.69x; 2 heads a step
# ran 1.25x at the large shape; programs per SM moved it by less than 0.02x, fixed warps no better
_PROGS_PER_SM = 4
_WARPS = None
_HEADS_PER_STEP = 4


def _block_s(rows, seq, block_h, sms=None):
    """Positions per program for ``rows`` = B S positions: enough programs to fill the GPU
    (about ``_PROGS_PER_SM`` = 4 per SM), tiles of at most ~2K values per half, no more than S
    (rounded up):

        min(next_pow2(ceil(B S / (4 SMs))), next_pow2(S), 2048 / block_h)

    It is the one row-dependent choice in the lowered module, so rope lowers to one module per
    value of this (a bucket), at most log2(2048 / block_h) + 1 of them: 7 at head dim 64 (1 to
    64 positions), 6 at 128 (1 to 32). The buckets move with the SM count: with 132 SMs the top
    one starts at B S = 64 * 528 (docs/pallas-native.md)."""
    sms = C.num_cores() if sms is None else sms
    want = C.next_power_of_2(max(1, C.cdiv(rows, _PROGS_PER_SM * sms)))
    return max(1, min(want, C.next_power_of_2(max(seq, 1)), max(1, 2048 // block_h)))


def _fold(x, layout):
    """(B, H, S, D) -> (B H S, D); (B, S, H, D) -> (B S, H, D)."""
    return x.reshape(-1, x.shape[-1]) if layout == "bhsd" else x.reshape(-1, *x.shape[2:])


def _rope(q, k, cos, sin, out_dtype, *, q_layout, k_layout, backward):
    if q_layout not in LAYOUTS or k_layout not in LAYOUTS:
        raise ValueError(f"layouts must be in {LAYOUTS}, got {q_layout!r}, {k_layout!r}")
    bsz, seq, d = q.shape[0], cos.shape[1], q.shape[-1]
    half = d // 2
    block_h = C.next_power_of_2(half)
    block_s = _block_s(bsz * seq, seq, block_h)
    heads = {"bhsd": 1, "bshd": 2}
    kernel = functools.partial(_rope_kernel, q_layout=q_layout, k_layout=k_layout,
                               q_heads=q.shape[heads[q_layout]], k_heads=k.shape[heads[k_layout]],
                               half=half,
                               block_s=block_s, block_h=block_h, heads_per_step=_HEADS_PER_STEP,
                               backward=backward)
    qf, kf = _fold(q, q_layout), _fold(k, k_layout)
    qo, ko = _launch(
        kernel, name="rope_bwd" if backward else "rope_fwd", grid=(bsz * C.row_programs(C.cdiv(seq, block_s)),),
        num_warps=_WARPS or C.warps_for(2 * block_s * block_h) // 2 or 1,
        out_shape=(jax.ShapeDtypeStruct(qf.shape, out_dtype), jax.ShapeDtypeStruct(kf.shape, out_dtype)),
    )(qf, kf, cos.reshape(-1, d), sin.reshape(-1, d), C.rows_operand(seq), C.rows_operand(cos.shape[0]))
    return qo.reshape(q.shape), ko.reshape(k.shape)


def _swap(x, have, want):
    """x, laid out as ``have``, as layout ``want``: axes 1 and 2 swapped where the two differ
    (``have`` or ``want`` None: as it is)."""
    return x if have is None or want is None or have == want else jnp.swapaxes(x, 1, 2)


def rope_fwd(q, k, cos, sin, *, q_layout, k_layout, in_dtype, view=None):
    """q, k in their layouts, cos/sin (B|1, S, D) -> ((q_out, k_out), ()).

    ``in_dtype`` (q's dtype name) is for the backward, which then needs neither q nor k.
    ``view``: None, or the layout q and k come in (and their outputs go out) where the kernel
    reads them in ``q_layout``/``k_layout``: HF's q is a (B, H, S, D) view of a (B, S, H, D)
    projection, and natively launched the swap of axes is a free view of that storage
    (bridge/native/), where the bridge's own transposes would each be an autograd node."""
    del in_dtype
    q, k = _swap(q, view, q_layout), _swap(k, view, k_layout)
    out = jnp.promote_types(q.dtype, cos.dtype)  # torch's q * cos promotes the same way
    qo, ko = _rope(q, k, cos, sin, out, q_layout=q_layout, k_layout=k_layout, backward=False)
    return (_swap(qo, q_layout, view), _swap(ko, k_layout, view)), ()


def rope_bwd(inputs, res, grads, *, q_layout, k_layout, in_dtype, view=None):
    """(_, _, cos, sin), (), (dq_out, dk_out) -> (dq, dk, None, None); q and k are not needed."""
    del res
    _, _, cos, sin = inputs
    dqo, dko = _swap(grads[0], view, q_layout), _swap(grads[1], view, k_layout)
    dq, dk = _rope(dqo, dko, cos, sin, jnp.dtype(in_dtype), q_layout=q_layout, k_layout=k_layout,
                   backward=True)
    return _swap(dq, q_layout, view), _swap(dk, k_layout, view), None, None
