"""RMSNorm forward and backward as Pallas kernels (spec: forge/spec/rmsnorm.py).

Rows of width N; ``block_m`` rows per program so narrow rows (per-head norms, N = 64) still fill
a program. Both casting conventions: "llama" rounds the normalised row to x's dtype before the
weight multiply, "gemma" stays in fp32 to the end; either way one rounding of the output.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _common as C


def _rmsnorm_fwd_kernel(x_ref, w_ref, m_ref, y_ref, rstd_ref, *, n, eps, casting, offset, block_m, block_n):
    m = C.read_rows(m_ref)  # at run time: the module does not depend on the row count
    acc = C.acc_dtype(x_ref.dtype)
    i = pl.program_id(0)
    rows = i * block_m + jnp.arange(block_m)  # (BM,)
    cols = jnp.arange(block_n)  # (BN,)
    rmask, cmask = rows < m, cols < n
    mask = rmask[:, None] & cmask[None, :]  # (BM, BN)
    rs, cs = C.ds(i * block_m, block_m), C.ds(0, block_n)
    x = C.load(x_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)  # (BM, BN)
    w = C.load(w_ref.at[cs], mask=cmask, other=0.0).astype(acc)  # (BN,)
    rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / n + eps)  # (BM,)
    normed = x * rstd[:, None]
    if casting == "gemma":
        y = normed * (offset + w)[None, :]
    else:  # HF llama: normed.to(x.dtype) before the weight multiply
        y = (w + offset)[None, :] * normed.astype(x_ref.dtype).astype(acc)
    C.store(y_ref.at[rs, cs], y.astype(y_ref.dtype), mask=mask)
    C.store(rstd_ref.at[rs], rstd.astype(rstd_ref.dtype), mask=rmask)


# Backward, per row with r = rstd, n_hat = x * r, w' = w + offset, dn = dy * w':
#   y = w' * n_hat  =>  dx = r * (dn - n_hat * mean(dn * n_hat)),   dw = sum_rows dy * n_hat
# (llama: n_hat rounded to x's dtype in dw, as in the forward; the cast is the identity for dx).
# dw without atomics: a persistent grid of G programs, each looping over row blocks
# pid, pid + G, ... and accumulating a (BM, BN) fp32 tile, summed over its rows once at the end
# (not once per block: that cross-warp reduction per iteration doubled the kernel's time at
# width 896); then one (G, N) -> (N,) sum in XLA (natively launched: a torch sum and a
# conversion, faster here than a Pallas reduction kernel; docs/pallas-native.md).
def _rmsnorm_bwd_kernel(x_ref, w_ref, rstd_ref, dy_ref, m_ref, dx_ref, dwp_ref, *, n, casting, offset,
                        block_m, block_n):
    m = C.read_rows(m_ref)
    acc = C.acc_dtype(x_ref.dtype)
    pid = pl.program_id(0)
    # the grid size as rmsnorm_bwd sets it, from the run-time row count (pl.num_programs would
    # be the traced grid's constant)
    g = _bwd_programs(C.cdiv_traced(m, block_m), jnp.minimum, jnp.maximum).astype(jnp.int32)
    cols = jnp.arange(block_n)
    cmask = cols < n
    cs = C.ds(0, block_n)
    w = C.load(w_ref.at[cs], mask=cmask, other=0.0).astype(acc) + offset  # (BN,)

    def body(j, dw_acc):
        blk = pid + j * g
        rows = blk * block_m + jnp.arange(block_m)
        rmask = rows < m
        mask = rmask[:, None] & cmask[None, :]
        rs = C.ds(blk * block_m, block_m)
        x = C.load(x_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)  # (BM, BN)
        dy = C.load(dy_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
        r = C.load(rstd_ref.at[rs], mask=rmask, other=0.0).astype(acc)  # (BM,)
        n_hat = x * r[:, None]
        dn = dy * w[None, :]
        c = jnp.sum(dn * n_hat, axis=1) / n  # (BM,)
        dx = r[:, None] * (dn - n_hat * c[:, None])
        C.store(dx_ref.at[rs, cs], dx.astype(dx_ref.dtype), mask=mask)
        if casting != "gemma":
            n_hat = n_hat.astype(x_ref.dtype).astype(acc)
        return dw_acc + dy * n_hat

    nblk = C.cdiv_traced(m, block_m)
    trips = jax.lax.div((nblk - pid + g - 1).astype(jnp.int32), g)  # this program's row blocks (all operands >= 0)
    dw = jax.lax.fori_loop(0, trips, body, jnp.zeros((block_m, block_n), acc))
    C.store(dwp_ref.at[pid, cs], jnp.sum(dw, axis=0).astype(dwp_ref.dtype), mask=cmask)


def _bwd_programs(blocks, lo=min, hi=max):
    """The backward's persistent grid: about 4 programs per SM, at most one per row block
    (at least two, _common.row_programs); ``lo``/``hi`` let the kernel compute it traced."""
    return hi(2, lo(blocks, 4 * C.num_cores()))


def _config(n):
    block_n = C.next_power_of_2(n)
    # ~4K values per program: one row at hidden sizes, many rows of a 64-wide head; not
    # narrowed for few rows (the masked rows cost nothing), so the row count stays out of it
    block_m = max(1, min(4096 // block_n, 64))
    tile = block_m * block_n  # warps as forge_triton's RMSNorm takes them
    return block_m, block_n, 4 if tile <= 2048 else (8 if tile <= 8192 else 16)


def out_dtype(x_dtype, w_dtype, casting):
    return jnp.dtype(x_dtype) if casting == "gemma" else jnp.promote_types(x_dtype, w_dtype)


# The lowering choice for this kernel lives here (Triton lowering; see _common).
_launch = C.triton_call


def rmsnorm_fwd(x, w, *, eps, casting, offset):
    """x (..., N), w (N,) -> ((y shaped like x,), (rstd (M,),)), M the rows of x. (The reshapes
    cost nothing natively launched: bridge/native/ passes the kernel the tensor itself.)"""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    m, n = x.shape
    block_m, block_n, warps = _config(n)
    kernel = functools.partial(_rmsnorm_fwd_kernel, n=n, eps=eps, casting=casting, offset=offset,
                               block_m=block_m, block_n=block_n)
    y, rstd = _launch(
        kernel, name="rmsnorm_fwd", grid=(C.row_programs(C.cdiv(m, block_m)),), num_warps=warps,
        out_shape=(jax.ShapeDtypeStruct((m, n), out_dtype(x.dtype, w.dtype, casting)),
                   jax.ShapeDtypeStruct((m,), C.acc_dtype(x.dtype))),
    )(x, w, C.rows_operand(m))
    return (y.reshape(shape),), (rstd,)


def rmsnorm_bwd(inputs, res, grads, *, eps, casting, offset):
    """(x, w), (rstd,), (dy,) -> (dx, dw); x and dy (..., N), as the forward took x."""
    del eps
    x, w = inputs
    (rstd,), (dy,) = res, grads
    shape = x.shape
    x, dy = x.reshape(-1, shape[-1]), dy.reshape(-1, shape[-1])
    m, n = x.shape
    block_m, block_n, warps = _config(n)
    nprog = _bwd_programs(C.cdiv(m, block_m))
    kernel = functools.partial(_rmsnorm_bwd_kernel, n=n, casting=casting, offset=offset,
                               block_m=block_m, block_n=block_n)
    dx, dw_partial = _launch(
        kernel, name="rmsnorm_bwd", grid=(nprog,), num_warps=warps,
        out_shape=(jax.ShapeDtypeStruct((m, n), x.dtype),
                   jax.ShapeDtypeStruct((nprog, n), C.acc_dtype(x.dtype))),
    )(x, w, rstd, dy, C.rows_operand(m))
    return dx.reshape(shape), jnp.sum(dw_partial, axis=0).astype(w.dtype)
