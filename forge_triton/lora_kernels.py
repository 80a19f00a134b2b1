"""The Triton kernels of the fused LoRA projections (forge_triton/lora.py drives them) and their
launchers. Shape tags: M rows (tokens), K an input width (hidden, or intermediate for down's
input h), N an output width, R the ranks of the adapters reading one input, stacked.

Every adapter product takes x's dtype (DT) as operands, reading A and B in their own dtype and
rounding them in registers, with ACC (fp32; fp64 for fp64) accumulation. Dropout on an adapter's
input (forge/spec/lora_dropout.py) is drawn here, where the input is read: the keep bit of
element (r, c) of stream (seed, salt) is a hash of the two indices and the stream's keys, so the
forward and the backward compute the same mask and nothing mask-sized is kept.

Up to three adapters read one input (q, k, v; gate, up): a kernel takes them as *slots* 0..NA-1,
each with its rank (its rows of the stacked A, its columns of the stacked rank-r activations
``xa``), salt, threshold and scale, and a constexpr DROP flag.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from forge import _runtime
from forge.spec import lora_dropout as drop_spec

from . import _common, _launch
from ._common import cast  # rounds bf16 to nearest even in the interpreter too
from .glu import _act_and_grad

SLOTS = 3

# Launch settings per kernel: the tile kernels (add, dx, glu_fwd, glu_bwd) as (BLOCK_M, BLOCK_N,
# num_warps, the largest rank whose low-rank term runs as outer products on the CUDA cores rather
# than tl.dot; 0: never, the dot won every case on an H100 at r=16); the rank-r reductions over a row (down, grad_a) as (BLOCK_M, BLOCK_K, num_warps,
# programs per SM they split their work to fill). Module data, so that
# bench/diagnostics/tune_lora_kernels.py can time alternatives at the 8B shapes.
CFG = {  # chosen by that diagnostic on the H200 at 4096 rows (docs/performance.md has the table)
    "add": (32, 128, 4, 0),
    "dx": (32, 128, 4, 0),
    "glu_fwd": (32, 128, 4, 0),
    "glu_bwd": (32, 64, 8, 0),
    "down": (32, 128, 4, 4),
    "grad_a": (64, 128, 4, 4),
}


def _block_r(r) -> int:
    # tl.dot needs K >= 16; ranks above 64 loop over K (host-side int math: triton's
    # next_power_of_2 is a constexpr_function on Triton 3.6, microseconds a call; it stays for a
    # symbolic rank, which the op layer's fakes may carry)
    return max(16, min(64, _common.next_pow2(r) if type(r) is int else triton.next_power_of_2(r)))


def _block_r_whole(r) -> int:
    """A power of two >= max(16, r): the down-projection kernels hold a slot's whole rank."""
    return max(16, _common.next_pow2(r) if type(r) is int else triton.next_power_of_2(r))


# ---------------------------------------------------------------------------------------- the hash
# The words of forge/spec/lora_dropout.py on uint32 (Triton's unsigned shifts and wrapping
# products); a keep decision is one mix per element, the row and column keys one per row and
# column of a tile.
@triton.jit
def _mix(h):
    h ^= h >> 16
    h *= 0x7FEB352D
    h ^= h >> 15
    h *= 0x846CA68B
    h ^= h >> 16
    return h


@triton.jit
def _stream(seed_ptr, salt):
    """(key_row, key_col) of stream (seed, salt); ``salt`` is the salt word as an int32."""
    lo = tl.load(seed_ptr).to(tl.uint32, bitcast=True)
    hi = tl.load(seed_ptr + 1).to(tl.uint32, bitcast=True)
    k_row = _mix(lo ^ _mix(hi ^ salt.to(tl.uint32, bitcast=True)))
    return k_row, _mix(k_row ^ 0x9E3779B9)


@triton.jit
def _index_keys(idx, key):
    """mix(index ^ key) per row (or column) index (int64, read mod 2**32)."""
    return _mix(idx.to(tl.uint32) ^ key)


@triton.jit
def _drop_factor(row_keys, col_keys, thr, scale, ACC: tl.constexpr):
    """(rows, cols) of ``scale`` where kept, 0 where dropped: the factor dropout multiplies by."""
    bits = _mix(row_keys[:, None] ^ col_keys[None, :])
    keep = (bits >> 8).to(tl.int32) >= thr
    return tl.where(keep, scale, 0.0).to(ACC)


@triton.jit
def _dot(p, q, acc, DT: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + p @ q, both rounded to DT first."""
    p = cast(p, DT)
    q = cast(q, DT)
    if UPCAST:  # interpreter: bf16 tl.dot is wrong there; float64 stays float64
        p = p.to(ACC)
        q = q.to(ACC)
    if IEEE:  # fp32 models: full fp32 products, as cuBLAS does for eager, not tf32
        acc += tl.dot(p, q, input_precision="ieee")
    else:
        acc += tl.dot(p, q)
    return acc


@triton.jit
def _lowrank_tile(p_ptr, q_ptr, rm, rn, M, N, K, s_pm, s_pk, s_qk, s_qn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr,
                  ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, FMA: tl.constexpr):
    """(P Q)[rm, rn] for P (M, K) and Q (K, N) given by strides, K small (the LoRA rank).

    FMA: K outer products of a column of P and a row of Q on the CUDA cores instead of tl.dot,
    so the tile keeps the layout of the element-wise loads around it (a dot's result layout
    makes those loads and stores narrow); operands rounded to DT as the dot's are, each product
    exact in ACC."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    if FMA:
        for k in range(0, K):
            p = tl.load(p_ptr + rm * s_pm + k * s_pk, mask=rm < M, other=0.0)  # (BM,)
            q = tl.load(q_ptr + k * s_qk + rn * s_qn, mask=rn < N, other=0.0)  # (BN,)
            acc += cast(p, DT).to(ACC)[:, None] * cast(q, DT).to(ACC)[None, :]
    else:
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            p = tl.load(p_ptr + rm[:, None] * s_pm + rk[None, :] * s_pk,
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # (BM, BK)
            q = tl.load(q_ptr + rk[:, None] * s_qk + rn[None, :] * s_qn,
                        mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)  # (BK, BN)
            acc = _dot(p, q, acc, DT, ACC, UPCAST, IEEE)
    return acc


# out (M, N) += scale * P (M, K) @ Q (K, N); out is the base GEMM's output, updated in place
@triton.jit
def _lora_add_kernel(out_ptr, p_ptr, q_ptr, M, N, K, scale, s_om, s_on, s_pm, s_pk, s_qk, s_qn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr,
                     ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, FMA: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = _lowrank_tile(p_ptr, q_ptr, rm, rn, M, N, K, s_pm, s_pk, s_qk, s_qn,
                       BLOCK_M, BLOCK_N, BLOCK_K, DT, ACC, UPCAST, IEEE, FMA)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = out_ptr + rm[:, None] * s_om + rn[None, :] * s_on
    base = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
    tl.store(ptrs, cast(base + scale * lo, out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------- the adapters' down-projection
@triton.jit
def _dropped(x, row_keys, rk, k_col, thr, scale, DROP: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr):
    """drop(x) for a (rows, BK) tile whose columns are ``rk``, rounded to DT as torch's product."""
    if DROP:
        x = cast(x.to(ACC) * _drop_factor(row_keys, _index_keys(rk, k_col), thr, scale, ACC), DT)
    return x


@triton.jit
def _down_step(acc, xd, a_ptr, rr, rk, r, K, s_ar, s_ak,
               DT: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc (BM, BR) + xd (BM, BK) A[rr, rk]^T for one slot's A (r, K)."""
    a = tl.load(a_ptr + rr[None, :] * s_ar + rk[:, None] * s_ak, mask=(rr[None, :] < r) & (rk[:, None] < K),
                other=0.0)  # (BK, BR)
    return _dot(xd, a, acc, DT, ACC, UPCAST, IEEE)


# xa (M, R): xa[:, off_i:off_i + r_i] = drop_i(x) A_i^T for each slot i < NA (off_0 = 0,
# off_1 = r_0, off_2 = r_0 + r_1), x (M, K) read once for all slots, A (R, K) the slots' A stacked.
# The columns of x may be split in parts of k_per_part (a few thousand rows make too few row
# blocks to keep the GPU's memory busy): each part then writes its partial sums (ACC) to its
# slice of xa_ptr, (parts, M, R), which the caller adds up.
@triton.jit
def _lora_down_kernel(x_ptr, a_ptr, xa_ptr, seed_ptr, M, K, k_per_part, s_xm, s_xk, s_ar, s_ak, s_om, s_op,
                      r0, r1, r2, salt0, salt1, salt2, thr0, thr1, thr2, sc0, sc1, sc2,
                      NA: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DT: tl.constexpr,
                      ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    part = tl.program_id(1).to(tl.int64)
    k_start = part * k_per_part
    k_end = tl.minimum(k_start + k_per_part, K)
    rr = tl.arange(0, BLOCK_R)
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=ACC)
    kr0, kc0 = _stream(seed_ptr, salt0)
    kr1, kc1 = _stream(seed_ptr, salt1)
    kr2, kc2 = _stream(seed_ptr, salt2)
    rw0, rw1, rw2 = _index_keys(rm, kr0), _index_keys(rm, kr1), _index_keys(rm, kr2)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :] * s_xk, mask=(rm[:, None] < M) & (rk[None, :] < k_end),
                    other=0.0)  # (BM, BK)
        acc0 = _down_step(acc0, _dropped(x, rw0, rk, kc0, thr0, sc0, D0, DT, ACC), a_ptr, rr, rk, r0, K, s_ar, s_ak,
                          DT, ACC, UPCAST, IEEE)
        if NA > 1:
            acc1 = _down_step(acc1, _dropped(x, rw1, rk, kc1, thr1, sc1, D1, DT, ACC), a_ptr + r0 * s_ar, rr, rk,
                              r1, K, s_ar, s_ak, DT, ACC, UPCAST, IEEE)
        if NA > 2:
            acc2 = _down_step(acc2, _dropped(x, rw2, rk, kc2, thr2, sc2, D2, DT, ACC), a_ptr + (r0 + r1) * s_ar, rr,
                              rk, r2, K, s_ar, s_ak, DT, ACC, UPCAST, IEEE)
    row = rm[:, None] < M
    out = xa_ptr + part * s_op + rm[:, None] * s_om + rr[None, :]
    odt = xa_ptr.dtype.element_ty
    tl.store(out, cast(acc0, odt), mask=row & (rr[None, :] < r0))
    if NA > 1:
        tl.store(out + r0, cast(acc1, odt), mask=row & (rr[None, :] < r1))
    if NA > 2:
        tl.store(out + r0 + r1, cast(acc2, odt), mask=row & (rr[None, :] < r2))


# d A_i = dxa_i^T drop_i(x): the rows are split into S parts, each program sums its part's rows
# for one block of columns into part (S, R, K) (ACC); the caller sums the S parts
@triton.jit
def _grad_a_step(acc, dxa_ptr, xd, rm, rr, row_ok, r, s_dm, DT: tl.constexpr, ACC: tl.constexpr,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr):
    d = tl.load(dxa_ptr + rm[:, None] * s_dm + rr[None, :], mask=row_ok[:, None] & (rr[None, :] < r),
                other=0.0)  # (BM, BR)
    return _dot(tl.trans(d), xd, acc, DT, ACC, UPCAST, IEEE)  # (BR, BK)


@triton.jit
def _lora_grad_a_kernel(x_ptr, dxa_ptr, part_ptr, seed_ptr, M, K, rows_per_part, s_xm, s_xk, s_dm, s_pp, s_pr,
                        r0, r1, r2, salt0, salt1, salt2, thr0, thr1, thr2, sc0, sc1, sc2,
                        NA: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DT: tl.constexpr,
                        ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    rk = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    part = tl.program_id(1).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    acc0 = tl.zeros((BLOCK_R, BLOCK_K), dtype=ACC)
    acc1 = tl.zeros((BLOCK_R, BLOCK_K), dtype=ACC)
    acc2 = tl.zeros((BLOCK_R, BLOCK_K), dtype=ACC)
    kr0, kc0 = _stream(seed_ptr, salt0)
    kr1, kc1 = _stream(seed_ptr, salt1)
    kr2, kc2 = _stream(seed_ptr, salt2)
    start = part * rows_per_part
    end = tl.minimum(start + rows_per_part, M)
    for m0 in range(start, end, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        row_ok = rm < end
        x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :] * s_xk, mask=row_ok[:, None] & (rk[None, :] < K),
                    other=0.0)  # (BM, BK)
        acc0 = _grad_a_step(acc0, dxa_ptr, _dropped(x, _index_keys(rm, kr0), rk, kc0, thr0, sc0, D0, DT, ACC),
                            rm, rr, row_ok, r0, s_dm, DT, ACC, UPCAST, IEEE)
        if NA > 1:
            acc1 = _grad_a_step(acc1, dxa_ptr + r0, _dropped(x, _index_keys(rm, kr1), rk, kc1, thr1, sc1, D1, DT, ACC),
                                rm, rr, row_ok, r1, s_dm, DT, ACC, UPCAST, IEEE)
        if NA > 2:
            acc2 = _grad_a_step(acc2, dxa_ptr + r0 + r1,
                                _dropped(x, _index_keys(rm, kr2), rk, kc2, thr2, sc2, D2, DT, ACC),
                                rm, rr, row_ok, r2, s_dm, DT, ACC, UPCAST, IEEE)
    out = part_ptr + part * s_pp + rr[:, None] * s_pr + rk[None, :]
    col = rk[None, :] < K
    tl.store(out, acc0, mask=(rr[:, None] < r0) & col)
    if NA > 1:
        tl.store(out + r0 * s_pr, acc1, mask=(rr[:, None] < r1) & col)
    if NA > 2:
        tl.store(out + (r0 + r1) * s_pr, acc2, mask=(rr[:, None] < r2) & col)


# gx (M, K) += sum_i drop_i(dxa_i A_i), the adapters' path of the input's gradient, in place
@triton.jit
def _dx_term(acc, dxa_ptr, a_ptr, rm, rn, M, K, r, s_dm, s_ar, s_ak, kr, kc, thr, sc,
             DROP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
             DT: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, FMA: tl.constexpr):
    lo = _lowrank_tile(dxa_ptr, a_ptr, rm, rn, M, K, r, s_dm, 1, s_ar, s_ak, BLOCK_M, BLOCK_N, BLOCK_R, DT, ACC,
                       UPCAST, IEEE, FMA)
    if DROP:  # the adapter saw drop(x): its gradient reaches x only where x was kept
        lo = lo * _drop_factor(_index_keys(rm, kr), _index_keys(rn, kc), thr, sc, ACC)
    return acc + lo


@triton.jit
def _lora_dx_kernel(gx_ptr, dxa_ptr, a_ptr, seed_ptr, M, K, s_gm, s_gk, s_dm, s_ar, s_ak,
                    r0, r1, r2, salt0, salt1, salt2, thr0, thr1, thr2, sc0, sc1, sc2,
                    NA: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DT: tl.constexpr,
                    ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, FMA: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    kr0, kc0 = _stream(seed_ptr, salt0)
    acc = _dx_term(acc, dxa_ptr, a_ptr, rm, rn, M, K, r0, s_dm, s_ar, s_ak, kr0, kc0, thr0, sc0, D0,
                   BLOCK_M, BLOCK_N, BLOCK_R, DT, ACC, UPCAST, IEEE, FMA)
    if NA > 1:
        kr1, kc1 = _stream(seed_ptr, salt1)
        acc = _dx_term(acc, dxa_ptr + r0, a_ptr + r0 * s_ar, rm, rn, M, K, r1, s_dm, s_ar, s_ak, kr1, kc1, thr1, sc1,
                       D1, BLOCK_M, BLOCK_N, BLOCK_R, DT, ACC, UPCAST, IEEE, FMA)
    if NA > 2:
        kr2, kc2 = _stream(seed_ptr, salt2)
        acc = _dx_term(acc, dxa_ptr + r0 + r1, a_ptr + (r0 + r1) * s_ar, rm, rn, M, K, r2, s_dm, s_ar, s_ak, kr2,
                       kc2, thr2, sc2, D2, BLOCK_M, BLOCK_N, BLOCK_R, DT, ACC, UPCAST, IEEE, FMA)
    mask = (rm[:, None] < M) & (rn[None, :] < K)
    ptrs = gx_ptr + rm[:, None] * s_gm + rn[None, :] * s_gk
    tl.store(ptrs, cast(tl.load(ptrs, mask=mask, other=0.0).to(ACC) + acc, gx_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------- the gated MLP
# g, u (M, I) hold the base GEMMs x W^T; add each LoRA term (HAS_G / HAS_U: gate / up have an
# adapter), store the full pre-activations back (backward recomputes act from them) and
# h = act(g) * u. g and u are rounded to the storage dtype before act, and act(g) before the
# product, as eager Hugging Face computes them.
@triton.jit
def _lora_glu_fwd_kernel(g_ptr, u_ptr, h_ptr, xa_ptr, bg_ptr, bu_ptr, M, N, K_G, K_U, scale_g, scale_u,
                         s_xm, s_xk, s_bgk, s_bgn, s_buk, s_bun,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         HAS_G: tl.constexpr, HAS_U: tl.constexpr, GELU: tl.constexpr, DT: tl.constexpr,
                         ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, FMA: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]  # g, u, h are contiguous (M, N)
    dt = h_ptr.dtype.element_ty
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    if HAS_G:
        lg = _lowrank_tile(xa_ptr, bg_ptr, rm, rn, M, N, K_G, s_xm, s_xk, s_bgk, s_bgn,
                           BLOCK_M, BLOCK_N, BLOCK_K, DT, ACC, UPCAST, IEEE, FMA)
        g = cast(g.to(ACC) + scale_g * lg, dt)
        tl.store(g_ptr + offs, g, mask=mask)
    if HAS_U:  # up's xa sits K_G columns after gate's in the shared (M, K_G + K_U) buffer
        lu = _lowrank_tile(xa_ptr + K_G * s_xk, bu_ptr, rm, rn, M, N, K_U, s_xm, s_xk, s_buk, s_bun,
                           BLOCK_M, BLOCK_N, BLOCK_K, DT, ACC, UPCAST, IEEE, FMA)
        u = cast(u.to(ACC) + scale_u * lu, dt)
        tl.store(u_ptr + offs, u, mask=mask)
    a, _ = _act_and_grad(g.to(ACC), GELU)
    tl.store(h_ptr + offs, cast(cast(a, dt).to(ACC) * u.to(ACC), dt), mask=mask)


# dh = dh_base + drop(dha @ A_down) with dh_base = dy W_down in dh_ptr, dha = scale_down * dy B_down
# (HAS_D: down has an adapter) and drop the down adapter's dropout (DROP: stream (seed, salt));
# then h = act(g) * u  =>  dg = dh * u * act'(g),  du = dh * act(g). h is recomputed (for
# d A_down = dha^T drop(h)) and written over dh_ptr, which is not needed afterwards.
@triton.jit
def _lora_glu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, dha_ptr, ad_ptr, seed_ptr, salt, thr, drop_scale,
                         M, N, K, s_dm, s_dk, s_ak, s_an,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_D: tl.constexpr,
                         DROP: tl.constexpr, GELU: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
                         UPCAST: tl.constexpr, IEEE: tl.constexpr, FMA: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    dt = dh_ptr.dtype.element_ty
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(ACC)
    if HAS_D:
        lo = _lowrank_tile(dha_ptr, ad_ptr, rm, rn, M, N, K, s_dm, s_dk, s_ak, s_an,
                           BLOCK_M, BLOCK_N, BLOCK_K, DT, ACC, UPCAST, IEEE, FMA)
        if DROP:  # the adapter saw drop(h): its gradient reaches h only where h was kept
            k_row, k_col = _stream(seed_ptr, salt)
            lo = lo * _drop_factor(_index_keys(rm, k_row), _index_keys(rn, k_col), thr, drop_scale, ACC)
        dh += lo
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(ACC)
    a, da = _act_and_grad(g, GELU)
    tl.store(dg_ptr + offs, cast(dh * u * da, dt), mask=mask)
    tl.store(du_ptr + offs, cast(dh * a, dt), mask=mask)
    tl.store(dh_ptr + offs, cast(cast(a, dt).to(ACC) * u, dt), mask=mask)


# FastKernel: the compiled launcher called directly once a specialisation is known (Triton's own
# launch path is ~10 us more host time a call; several launches a decoder layer)
_LORA_ADD = _launch.FastKernel(_lora_add_kernel)
_LORA_DOWN = _launch.FastKernel(_lora_down_kernel)
_LORA_GRAD_A = _launch.FastKernel(_lora_grad_a_kernel)
_LORA_DX = _launch.FastKernel(_lora_dx_kernel)
_LORA_GLU_FWD = _launch.FastKernel(_lora_glu_fwd_kernel)
_LORA_GLU_BWD = _launch.FastKernel(_lora_glu_bwd_kernel)

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}


def _consts_of(dt: torch.dtype) -> dict:
    return dict(DT=_TL[dt], ACC=_common.acc(dt), UPCAST=_common.dot_upcast(), IEEE=dt == torch.float32)


_consts = functools.lru_cache(maxsize=16)(_consts_of)  # the constexpr keywords of products in ``dt``


def _tiles(name, m, n, rank):
    """(grid, launch keywords) of tile kernel ``name`` over an (m, n) output, its low-rank term
    of rank ``rank`` (the largest, where several adapters)."""
    bm, bn, warps, fma_upto = CFG[name]
    return (_common.cdiv(m, bm), _common.cdiv(n, bn)), dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                                            FMA=rank <= fma_upto)


def lora_add_(out, p, q, scale: float):
    """out (M, N) += scale * p (M, K) @ q (K, N), in place; strided p and q are fine (products in
    out's dtype)."""
    m, n = out.shape
    if m and n:
        grid, launch = _tiles("add", m, n, p.shape[1])
        _LORA_ADD[grid](out, p, q, m, n, p.shape[1], float(scale), out.stride(0), out.stride(1),
                        p.stride(0), p.stride(1), q.stride(0), q.stride(1), BLOCK_K=_block_r(p.shape[1]),
                        **_consts(out.dtype), **launch)
    return out


# ---------------------------------------------------------------------------------------- slots
def _slots(ranks, ps, salts):
    """The slot arguments of the dropout kernels (ranks, salt words, thresholds, scales; three
    each, unused slots padded) and their constexprs (NA, D0..D2)."""
    n = len(ranks)
    pad = SLOTS - n
    r = list(ranks) + [0] * pad
    words = [drop_spec.signed(drop_spec.salt_word(drop_spec.SALT[s])) for s in salts] + [0] * pad
    thr = [drop_spec.threshold(p) for p in ps] + [0] * pad
    sc = [drop_spec.scale(p) for p in ps] + [0.0] * pad
    flags = {f"D{i}": bool(i < n and ps[i]) for i in range(SLOTS)}
    return (*r, *words, *thr, *sc), dict(NA=n, **flags)


def _row_launch_of(name: str, cfg: tuple, r: int, na: int, dt: torch.dtype, device) -> tuple:
    """(BLOCK_M, BLOCK_K, num_warps, num_stages, BLOCK_R) of row kernel ``name`` ("down",
    "grad_a") for ``na`` adapters of rank up to ``r``: CFG's tiles, with the stages (and if need
    be a narrower BLOCK_K) whose tiles fit the device's shared memory (float64, or wide ranks:
    three stages of a rank-256 q/k/v call in bf16 need ~600 KB)."""
    bm, bk, warps, _ = cfg
    br, size = _block_r_whole(r), dt.itemsize
    if name == "down":  # x (BM, BK) and each A_i (BK, BR) per stage
        per_stage = lambda k: (bm * k + na * k * br) * size  # noqa: E731
    else:  # grad_a: x (BM, BK) and each d xa_i (BM, BR)
        per_stage = lambda k: (bm * k + na * bm * br) * size  # noqa: E731
    bk, stages = _runtime.pipeline_fit(bk, per_stage, _runtime.shared_memory(device))
    return bm, bk, warps, stages, br


_row_launch_cached = functools.lru_cache(maxsize=256)(_row_launch_of)


def _row_launch(name, cfg, r, na, dt, device) -> tuple:
    # (a rank traced as a SymInt, under torch.compile's dynamic shapes, is not hashable)
    return (_row_launch_cached if type(r) is int else _row_launch_of)(name, cfg, r, na, dt, device)


def _down_launch(ranks, dt, device) -> tuple:
    """(BLOCK_M, BLOCK_K, num_warps, num_stages, BLOCK_R) of the down-projection kernel."""
    return _row_launch("down", CFG["down"], max(ranks), len(ranks), dt, device)


def col_parts(m: int, k: int, device, bk: int) -> int:
    """Parts the down-projection splits x's columns (in blocks of ``bk``) into: CFG["down"]'s
    programs per SM."""
    bm, _, _, per_sm = CFG["down"]
    row_blocks, col_blocks = _common.cdiv(m, bm), _common.cdiv(k, bk)
    return max(1, min(col_blocks, _common.cdiv(per_sm * _common.num_sms(device), row_blocks)))


def down(x2, a_cat, seed, ranks, ps, salts):
    """(M, R) in x's dtype: [drop_i(x) A_i^T]_i for the slots' A stacked in a_cat (R, K)."""
    m, k = x2.shape
    dt = x2.dtype
    rtot = a_cat.shape[0]
    if not m:
        return _common.empty((m, rtot), dt, x2.device)
    bm, bk, warps, stages, br = _down_launch(ranks, dt, x2.device)
    parts = col_parts(m, k, x2.device, bk)
    k_per_part = _common.cdiv(_common.cdiv(k, parts), bk) * bk
    parts = _common.cdiv(k, k_per_part)
    # one part writes xa itself; several write their sums in ACC, added up below
    out = _common.empty((parts, m, rtot), dt if parts == 1 else _common.acc_torch(dt), x2.device)
    args, flags = _slots(ranks, ps, salts)
    _LORA_DOWN[(_common.cdiv(m, bm), parts)](
        x2, a_cat, out, seed, m, k, k_per_part, x2.stride(0), x2.stride(1), a_cat.stride(0), a_cat.stride(1),
        out.stride(1), out.stride(0), *args, **flags, BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br, **_consts(dt),
        num_warps=warps, num_stages=stages)
    return out[0] if parts == 1 else out.sum(0, dtype=out.dtype).to(dt)


def grad_a(x2, dxa, seed, ranks, ps, salts):
    """(R, K) in the accumulation dtype: [dxa_i^T drop_i(x)]_i stacked (dxa (M, R), unit column
    stride)."""
    m, k = x2.shape
    acc = _common.acc_torch(x2.dtype)
    rtot = sum(ranks)
    if not m:
        return torch.zeros((rtot, k), dtype=acc, device=x2.device)
    per_sm = CFG["grad_a"][3]
    bm, bk, warps, stages, br = _row_launch("grad_a", CFG["grad_a"], max(ranks), len(ranks), x2.dtype, x2.device)
    kb = _common.cdiv(k, bk)
    row_blocks = _common.cdiv(m, bm)
    parts = max(1, min(row_blocks, _common.cdiv(per_sm * _common.num_sms(x2.device), kb)))
    rows_per_part = _common.cdiv(row_blocks, parts) * bm
    parts = _common.cdiv(m, rows_per_part)
    part = _common.empty((parts, rtot, k), acc, x2.device)
    args, flags = _slots(ranks, ps, salts)
    _LORA_GRAD_A[(kb, parts)](
        x2, dxa, part, seed, m, k, rows_per_part, x2.stride(0), x2.stride(1), dxa.stride(0), part.stride(0),
        part.stride(1), *args, **flags, BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br, **_consts(x2.dtype),
        num_warps=warps, num_stages=stages)
    return part[0] if parts == 1 else part.sum(0)


def add_dx_(gx, dxa, a_cat, seed, ranks, ps, salts):
    """gx (M, K) += sum_i drop_i(dxa_i A_i), in place (dxa (M, R) unit column stride)."""
    m, k = gx.shape
    if m and k:
        args, flags = _slots(ranks, ps, salts)
        grid, launch = _tiles("dx", m, k, max(ranks))
        _LORA_DX[grid](
            gx, dxa, a_cat, seed, m, k, gx.stride(0), gx.stride(1), dxa.stride(0), a_cat.stride(0), a_cat.stride(1),
            *args, **flags, BLOCK_R=_block_r(max(ranks)), **_consts(gx.dtype), **launch)
    return gx


def glu_fwd_(g, u, h, xa, b_gate, b_up, r_g, r_u, s_g, s_u, gelu):
    """g, u (M, I) += their adapters' terms (b_* None: no adapter), h = act(g) * u."""
    m, n = g.shape
    if m and n:
        bg = b_gate if b_gate is not None else g
        bu = b_up if b_up is not None else g
        grid, launch = _tiles("glu_fwd", m, n, max(r_g, r_u))
        _LORA_GLU_FWD[grid](
            g, u, h, xa, bg, bu, m, n, r_g, r_u, float(s_g), float(s_u), xa.stride(0), xa.stride(1),
            bg.stride(1), bg.stride(0), bu.stride(1), bu.stride(0), BLOCK_K=_block_r(max(r_g, r_u, 1)),
            HAS_G=b_gate is not None, HAS_U=b_up is not None, GELU=gelu, **_consts(g.dtype), **launch)


def glu_bwd_(dh, g, u, dg, du, dha, a_down, seed, p, gelu):
    """dg, du from dh (+ the down adapter's drop(dha A_down) when a_down is given); h over dh."""
    m, n = g.shape
    if m and n:
        has_d = a_down is not None
        ad = a_down if has_d else g
        da = dha if has_d else g
        r = a_down.shape[0] if has_d else 1
        word = drop_spec.signed(drop_spec.salt_word(drop_spec.SALT["down"]))
        grid, launch = _tiles("glu_bwd", m, n, r)
        _LORA_GLU_BWD[grid](
            dh, g, u, dg, du, da, ad, seed if p else g, word, drop_spec.threshold(p), drop_spec.scale(p), m, n, r,
            da.stride(0), da.stride(1), ad.stride(0), ad.stride(1), BLOCK_K=_block_r(r), HAS_D=has_d,
            DROP=bool(has_d and p), GELU=gelu, **_consts(g.dtype), **launch)
