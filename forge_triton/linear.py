"""A few rows by a weight in Triton (spec: forge/spec/row_linear.py): the decoding steps' dense
products at batch 1.

Grid (N / BLOCK_N, M): a program takes BLOCK_N output features of one row and walks the whole of
K in BLOCK_K-wide tiles, multiplying each weight tile by the row's slice element by element into
an fp32 (BLOCK_N, BLOCK_K) block that it sums along K once at the end. No tensor cores: with one
row there is nothing for them to share, and the loads of eight 1 KiB weight rows a tile keep the
memory system busy. The setting (8 features, 512-wide tiles, 8 warps; 4 warps for the wide LM
heads) is the best of bench/diagnostics/gemv_bw.py's grid at Llama-3-8B's and Qwen3-30B-A3B's
decode shapes on the H100 and H200.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forge.spec import row_linear as spec

from . import _common, _launch
from . import glu as _glu

BLOCK_N = 8  # output features per program
MAX_BLOCK_K = 512
WIDE = 1 << 16  # from this many output features (an LM head), 4 warps a program instead of 8


@triton.jit
def _row_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, s_ptr, N, K, sxm, sym, srm, HAS_BIAS: tl.constexpr,
                       HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pn = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
        x = tl.load(x_ptr + m * sxm + rk, mask=km, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    y = _common.cast(y, y_ptr.dtype.element_ty)
    tl.store(y_ptr + m * sym + rn, y, mask=nmask)
    if HAS_RES:  # (the sum of the rounded product and the residual, as torch's y + r rounds it)
        r = tl.load(r_ptr + m * srm + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(s_ptr + m * sym + rn, _common.cast(y.to(tl.float32) + r, y_ptr.dtype.element_ty), mask=nmask)


_kernel = _launch.FastKernel(_row_linear_kernel)


@triton.jit
def _row_glu_kernel(x_ptr, w_ptr, y_ptr, I, K, sxm, sym, GELU: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    # BLOCK_N features of the gate's rows and the same of the up's (I rows further on), summed
    # each as _row_linear_kernel sums a feature, rounded as its output is, then act(g) * u as the
    # GLU kernel computes it
    pn = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < I
    g_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    u_rows = w_ptr + (rn.to(tl.int64) + I)[:, None] * K
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        wm = nmask[:, None] & km[None, :]
        x = tl.load(x_ptr + m * sxm + rk, mask=km, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(g_rows + rk[None, :], mask=wm, other=0.0).to(tl.float32) * x
        acc_u += tl.load(u_rows + rk[None, :], mask=wm, other=0.0).to(tl.float32) * x
    dt = y_ptr.dtype.element_ty
    g = _common.cast(tl.sum(acc_g, axis=1), dt).to(tl.float32)
    u = _common.cast(tl.sum(acc_u, axis=1), dt).to(tl.float32)
    a, _ = _glu._act_and_grad(g, GELU)
    a = _common.cast(a, dt).to(tl.float32)
    tl.store(y_ptr + m * sym + rn, _common.cast(a * u, dt), mask=nmask)


_glu_kernel = _launch.FastKernel(_row_glu_kernel)


def settings(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_K, warps) for an (N, K) weight."""
    return min(MAX_BLOCK_K, max(16, _common.next_pow2(k))), 4 if n >= WIDE else 8


def row_linear(x, w, b=None, r=None):
    """Triton product with the signature of ``forge.spec.row_linear.reference``."""
    spec.check(x, w, b, r)
    _common.check_device(x=x, w=w, b=b, r=r)
    m, k = x.shape
    n = w.shape[0]
    if not (m and n and k):
        return spec.reference(x, w, b, r)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    s = y if r is None else torch.empty_like(y)
    block_k, warps = settings(n, k)
    _kernel[(_common.cdiv(n, BLOCK_N), m)](x, w, w if b is None else b.contiguous(), y, y if r is None else r, s, n, k,
                                          x.stride(0), y.stride(0), 0 if r is None else r.stride(0),
                                          HAS_BIAS=b is not None, HAS_RES=r is not None, BLOCK_N=BLOCK_N,
                                          BLOCK_K=block_k, num_warps=warps)
    return y if r is None else (y, s)


def row_glu(x, w, act):
    """Triton product and gated activation with the signature of
    ``forge.spec.row_linear.glu_reference``."""
    spec.check_glu(x, w, act)
    _common.check_device(x=x, w=w)
    m, k = x.shape
    i = w.shape[0] // 2
    if not (m and i and k):
        return spec.glu_reference(x, w, act)
    y = torch.empty(m, i, device=x.device, dtype=x.dtype)
    block_k, warps = settings(2 * i, k)
    _glu_kernel[(_common.cdiv(i, BLOCK_N), m)](x, w, y, i, k, x.stride(0), y.stride(0), GELU=act == "gelu_tanh",
                                              BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=warps)
    return y
