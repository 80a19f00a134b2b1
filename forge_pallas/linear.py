"""A few rows by a weight as a Pallas kernel (spec: forge/spec/row_linear.py; the Triton twin is
forge_triton/linear.py, whose docstring says why the program takes this shape).

Grid (N / block_n, M): a program takes block_n output features of one row, walks K in
block_k-wide tiles into an fp32 (block_n, block_k) block, and sums it along K at the end.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _common as C
from . import glu as _glu

BLOCK_N = 8
MAX_BLOCK_K = 512
WIDE = 1 << 16  # (as the Triton twin: 4 warps from this many output features, else 8)


def _row_linear_kernel(x_ref, w_ref, b_ref, r_ref, y_ref, *s_ref, n, k, has_bias, block_n, block_k):
    pn, m = pl.program_id(0), pl.program_id(1)
    feats = pn * block_n + jnp.arange(block_n)
    nmask = feats < n
    rows = C.ds(pn * block_n, block_n)

    def tile(t, acc):
        k0 = t * block_k
        km = (k0 + jnp.arange(block_k)) < k
        cols = C.ds(k0, block_k)
        w = C.load(w_ref.at[rows, cols], mask=nmask[:, None] & km[None, :], other=0.0)
        x = C.load(x_ref.at[m, cols], mask=km, other=0.0)
        return acc + w.astype(jnp.float32) * x.astype(jnp.float32)[None, :]

    acc = jax.lax.fori_loop(C.i32(0), C.i32(C.cdiv(k, block_k)), tile, jnp.zeros((block_n, block_k), jnp.float32))
    y = jnp.sum(acc, axis=1)
    if has_bias:
        y = y + C.load(b_ref.at[rows], mask=nmask, other=0.0).astype(jnp.float32)
    y = y.astype(y_ref.dtype)
    C.store(y_ref.at[m, rows], y, mask=nmask)
    if s_ref:  # (with a residual: the sum of the rounded product and it, as torch's y + r rounds it)
        r = C.load(r_ref.at[m, rows], mask=nmask, other=0.0).astype(jnp.float32)
        C.store(s_ref[0].at[m, rows], (y.astype(jnp.float32) + r).astype(y_ref.dtype), mask=nmask)


_launch = C.triton_call


def settings(n: int, k: int) -> tuple[int, int]:
    """(block_k, warps) for an (N, K) weight, as the Triton twin's ``settings``."""
    return min(MAX_BLOCK_K, max(16, C.next_power_of_2(k))), 4 if n >= WIDE else 8


def row_linear_fwd(x, w, b, r, *, has_bias, has_res):
    """x (M, K), w (N, K), b (N,), r (M, N) (placeholders without bias or residual) -> ((y (M, N),
    and s = y + r (M, N) with a residual), ()); K >= 1."""
    m, k = x.shape
    n = w.shape[0]
    block_k, warps = settings(n, k)
    kern = functools.partial(_row_linear_kernel, n=n, k=k, has_bias=has_bias, block_n=BLOCK_N, block_k=block_k)
    out = jax.ShapeDtypeStruct((m, n), x.dtype)
    outs = _launch(kern, name="row_linear", grid=(C.cdiv(n, BLOCK_N), m), num_warps=warps,
                   out_shape=(out, out) if has_res else (out,))(x, w, b, r)
    return tuple(outs), ()


def _row_glu_kernel(x_ref, w_ref, y_ref, *, i, k, kind, block_n, block_k):
    # block_n features of the gate's rows and the same of the up's (i rows further on), each
    # summed as _row_linear_kernel sums a feature and rounded as its output is, then act(g) * u
    # as this backend's GLU kernel computes it (forge_pallas/glu.py)
    pn, m = pl.program_id(0), pl.program_id(1)
    nmask = (pn * block_n + jnp.arange(block_n)) < i
    g_rows, u_rows = C.ds(pn * block_n, block_n), C.ds(i + pn * block_n, block_n)

    def tile(t, accs):
        k0 = t * block_k
        km = (k0 + jnp.arange(block_k)) < k
        cols = C.ds(k0, block_k)
        x = C.load(x_ref.at[m, cols], mask=km, other=0.0).astype(jnp.float32)[None, :]
        wm = nmask[:, None] & km[None, :]
        g = C.load(w_ref.at[g_rows, cols], mask=wm, other=0.0).astype(jnp.float32)
        u = C.load(w_ref.at[u_rows, cols], mask=wm, other=0.0).astype(jnp.float32)
        return accs[0] + g * x, accs[1] + u * x

    zero = jnp.zeros((block_n, block_k), jnp.float32)
    acc_g, acc_u = jax.lax.fori_loop(C.i32(0), C.i32(C.cdiv(k, block_k)), tile, (zero, zero))
    g = jnp.sum(acc_g, axis=1).astype(y_ref.dtype).astype(jnp.float32)
    u = jnp.sum(acc_u, axis=1).astype(y_ref.dtype).astype(jnp.float32)
    a, _ = _glu._act(g, kind)
    C.store(y_ref.at[m, C.ds(pn * block_n, block_n)], (a * u).astype(y_ref.dtype), mask=nmask)


def row_glu_fwd(x, w, *, kind):
    """x (M, K), w (2I, K): the gate's rows, then the up's -> ((act(x W_g^T) * x W_u^T (M, I),), ());
    kind "swiglu" or "geglu"; K >= 1."""
    m, k = x.shape
    i = w.shape[0] // 2
    block_k, warps = settings(2 * i, k)
    kern = functools.partial(_row_glu_kernel, i=i, k=k, kind=kind, block_n=BLOCK_N, block_k=block_k)
    y = _launch(kern, name="row_glu", grid=(C.cdiv(i, BLOCK_N), m), num_warps=warps,
                out_shape=jax.ShapeDtypeStruct((m, i), x.dtype))(x, w)
    return (y,), ()
