"""Rotary position embedding (HF rotate_half), q and k in one launch, as a Pallas kernel
(spec: forge/spec/rope.py).

One program per (batch, block of positions): it loads that block's cos/sin rows once (full
width, as two halves, so any cos/sin is exact) and loops over every q head, then every k head.
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
def _rope_kernel(q_ref, k_ref, cos_ref, sin_ref, qo_ref, ko_ref, *, q_layout, k_layout, half,
                 block_s, block_h, backward):
    acc = C.acc_dtype(jnp.promote_types(q_ref.dtype, cos_ref.dtype))
    b, j = pl.program_id(0), pl.program_id(1)
    seq = cos_ref.shape[1]
    cb = b * int(cos_ref.shape[0] > 1)  # broadcast cos over batch (a traced index, not a Python 0)
    smask = j * block_s + jnp.arange(block_s) < seq  # (BS,)
    mask = smask[:, None] & (jnp.arange(block_h) < half)[None, :]  # (BS, BH)
    # the second half's lanes run past D when half is not a power of two (masked); Pallas
    # rejects a static out-of-range slice start, so then make the start a traced value
    hstart = half if 2 * half >= half + block_h else half + 0 * b
    ss, lo, hi = C.ds(j * block_s, block_s), C.ds(0, block_h), C.ds(hstart, block_h)

    def ld(ref, *idx):
        return C.load(ref.at[idx], mask=mask, other=0.0).astype(acc)

    c1, c2 = ld(cos_ref, cb, ss, lo), ld(cos_ref, cb, ss, hi)
    s1, s2 = ld(sin_ref, cb, ss, lo), ld(sin_ref, cb, ss, hi)
    if backward:
        s1, s2 = -s2, -s1

    def rotate_heads(x_ref, o_ref, layout):
        def one_head(h, carry):
            idx = (b, h, ss) if layout == "bhsd" else (b, ss, h)
            x1, x2 = ld(x_ref, *idx, lo), ld(x_ref, *idx, hi)
            C.store(o_ref.at[(*idx, lo)], (x1 * c1 - x2 * s1).astype(o_ref.dtype), mask=mask)
            C.store(o_ref.at[(*idx, hi)], (x2 * c2 + x1 * s2).astype(o_ref.dtype), mask=mask)
            return carry

        heads = x_ref.shape[1] if layout == "bhsd" else x_ref.shape[2]
        jax.lax.fori_loop(C.i32(0), C.i32(heads), one_head, 0)

    rotate_heads(q_ref, qo_ref, q_layout)
    rotate_heads(k_ref, ko_ref, k_layout)


# The lowering choice for this kernel lives here (Triton lowering; see _common).
_launch = C.triton_call


def _rope(q, k, cos, sin, out_dtype, *, q_layout, k_layout, backward):
    if q_layout not in LAYOUTS or k_layout not in LAYOUTS:
        raise ValueError(f"layouts must be in {LAYOUTS}, got {q_layout!r}, {k_layout!r}")
    bsz, seq, d = q.shape[0], cos.shape[1], q.shape[-1]
    half = d // 2
    block_h = C.next_power_of_2(half)
    # enough programs to fill the GPU (about 4 per SM), tiles of at most ~2K values per half
    want = C.next_power_of_2(max(1, C.cdiv(bsz * seq, 4 * C.num_cores())))
    block_s = max(1, min(want, C.next_power_of_2(max(seq, 1)), max(1, 2048 // block_h)))
    kernel = functools.partial(_rope_kernel, q_layout=q_layout, k_layout=k_layout, half=half,
                               block_s=block_s, block_h=block_h, backward=backward)
    return _launch(
        kernel, name="rope_bwd" if backward else "rope_fwd", grid=(bsz, C.cdiv(seq, block_s)),
        num_warps=C.warps_for(2 * block_s * block_h) // 2 or 1,
        out_shape=(jax.ShapeDtypeStruct(q.shape, out_dtype), jax.ShapeDtypeStruct(k.shape, out_dtype)),
    )(q, k, cos, sin)


def rope_fwd(q, k, cos, sin, *, q_layout, k_layout, in_dtype):
    """q, k in their layouts, cos/sin (B|1, S, D) -> ((q_out, k_out), ()).

    ``in_dtype`` (q's dtype name) is for the backward, which then needs neither q nor k."""
    del in_dtype
    out = jnp.promote_types(q.dtype, cos.dtype)  # torch's q * cos promotes the same way
    return _rope(q, k, cos, sin, out, q_layout=q_layout, k_layout=k_layout, backward=False), ()


def rope_bwd(inputs, res, grads, *, q_layout, k_layout, in_dtype):
    """(_, _, cos, sin), (), (dq_out, dk_out) -> (dq, dk, None, None); q and k are not needed."""
    del res
    _, _, cos, sin = inputs
    dqo, dko = grads
    dq, dk = _rope(dqo, dko, cos, sin, jnp.dtype(in_dtype), q_layout=q_layout, k_layout=k_layout,
                   backward=True)
    return dq, dk, None, None
