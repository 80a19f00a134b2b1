"""The MoE expert block's pieces in Triton (spec and contract: forge/spec/experts.py; the autograd
node that strings them together: forge/ops/experts.py).

Rows are sorted by expert; ``offsets`` (E,) holds each group's end row on the device. A grouped
kernel's grid is sized for the worst case, ``cdiv(S, BLOCK_M) + min(E, S)`` row tiles (each group
with rows adds at most one partial tile, and at most min(E, S) groups have rows), and each program
finds its expert and row range by one vector pass over the offsets; programs past the last tile do
nothing. No host sync anywhere: the launch sizes depend on S, E and the widths only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forge.spec import experts as X

from . import _common, _launch
from ._common import cast
from .glu import _act_and_grad
from .lora_kernels import _dot

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
       torch.float64: tl.float64}
EPI_PLAIN, EPI_GLU, EPI_GLU_BWD = 0, 1, 2


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per kernel use on the GPU: "plain" the
# grouped product, "glu" the gate/up product (two accumulators), "glu_bwd" the down product's
# backward with its epilogue, "wgrad" the weight gradients (K runs over a group's rows); the
# winners of bench/diagnostics/tune_experts_pallas.py --sweep-triton on the H200 at the
# Qwen3-30B-A3B shape (docs/moe.md)
TILES = {"plain": (128, 256, 64, 8, 4), "glu": (128, 128, 64, 8, 4), "glu_bwd": (64, 256, 64, 8, 3),
         "wgrad": (128, 128, 64, 8, 3)}


# Few rows (S = tokens x top-k up to FEW_ROWS: a decoding step) leave most experts without rows
# and the rest with a handful: the forward products then stream their experts' weights through
# narrow row tiles and more column programs (bench/diagnostics/tune_experts_pallas.py --few)
FEW_ROWS = 256
TILES_FEW = {"plain": (16, 64, 128, 4, 4), "glu": (16, 64, 128, 4, 4)}


def _tiles(kind, dt, rows=None):
    # the interpreter runs each program in Python over numpy blocks: few programs, wide tiles
    if _common.INTERPRET:
        return 16, 64, 64, 4, 1
    # TILES are chosen for 2-byte elements: wider ones take a K step as many bytes deep, so the
    # pipeline's stages fit the shared memory (128 x 256 fp32 tiles at K 64 would need 294 KB)
    few = rows is not None and rows <= FEW_ROWS and kind in TILES_FEW
    bm, bn, bk, warps, stages = (TILES_FEW if few else TILES)[kind]
    return bm, bn, max(16, bk * 2 // dt.itemsize), warps, stages


def row_tiles(s_rows: int, e_n: int, bm: int) -> int:
    """Row tiles of a grouped launch over ``s_rows`` sorted rows and ``e_n`` experts, for any
    routing (module docstring). Bounded by the rows as well as the experts: a decoding step's few
    rows (8 at batch 1, top-8) over 128 experts would otherwise launch 129 row tiles where 9 can
    hold them; the empty programs cost the down product half its time there (docs/moe.md, "The
    grouped launches' row grid")."""
    return _common.cdiv(s_rows, bm) + min(e_n, s_rows)


@triton.jit
def _find_tile(off_ptr, pid_m, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, group end) of row tile ``pid_m``; expert -1 past the last tile. One
    vector pass over the offsets: each group's tile count, their running sum, and the first
    expert whose running sum passes ``pid_m`` (empty groups add no tile)."""
    re = tl.arange(0, BLOCK_E)
    emask = re < E
    ends = tl.load(off_ptr + re, mask=emask, other=0)
    starts = tl.load(off_ptr + re - 1, mask=emask & (re > 0), other=0)
    n_t = tl.where(emask, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(n_t, 0)
    e = tl.sum((cum <= pid_m).to(tl.int32), 0)
    mine = re == e
    first = tl.sum(tl.where(mine, cum - n_t, 0), 0)
    row0 = tl.sum(tl.where(mine, starts, 0), 0) + (pid_m - first) * BLOCK_M
    end = tl.sum(tl.where(mine, ends, 0), 0)
    return tl.where(e < E, e, -1), row0, end


@triton.jit
def _k_step(a, w_base, rk, kmask, rn, nmask, N, s_wk, s_wn, acc, acc_u, EPI: tl.constexpr, DT: tl.constexpr,
            ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One K step of the grouped product: acc += a @ W[rk, rn] and, for the gate/up product
    (EPI 1), acc_u += a @ W[rk, N + rn] (W(n, k) read through the strides)."""
    wmask = kmask[:, None] & nmask[None, :]
    w = tl.load(w_base + rk[:, None] * s_wk + rn[None, :].to(tl.int64) * s_wn, mask=wmask, other=0.0)
    acc = _dot(a, w, acc, DT, ACC, UPCAST, IEEE)
    if EPI == 1:
        wu = tl.load(w_base + rk[:, None] * s_wk + (N + rn[None, :]).to(tl.int64) * s_wn, mask=wmask, other=0.0)
        acc_u = _dot(a, wu, acc_u, DT, ACC, UPCAST, IEEE)
    return acc, acc_u


# out[s, n] = sum_k a[src(s), k] * W[e](n, k) for the rows s of expert e's group, where
# src(s) = idx[s] with GATHER (the gate/up product reads token rows) else s, and W(n, k) is read
# through strides (the host swaps them for a[s] @ W[e] against a[s] @ W[e].T).
# EPI_GLU: two accumulators, gate rows n and up rows I + n of W; writes gu = [g, u] and
#   h = act(g) * u (act(g) rounded to the output dtype first, as eager rounds it).
# EPI_GLU_BWD: acc = dh; with g, u from gu: writes dgu = [dh * u * act'(g), dh * act(g)] and
#   h = act(g) * u (recomputed for the down weight's gradient).
# LOW: a LoRA adapter's rank-r term joins the product before any rounding or epilogue:
#   acc += (scale2 * a2[s]) @ W2[e], a2 (S, K2) the rows' rank-r activations (rounded to the
#   operands' dtype after the scale, as the product's operands are), W2 read through strides as W is.
@triton.jit
def _experts_grouped_kernel(a_ptr, idx_ptr, w_ptr, off_ptr, out_ptr, gu_ptr, h_ptr, a2_ptr, w2_ptr,
                            E, N, K, K2, scale2, s_am, s_we, s_wn, s_wk, s_om, s_gm, s_hm, s_a2m, s_w2e, s_w2n,
                            s_w2k, GATHER: tl.constexpr, EPI: tl.constexpr, LOW: tl.constexpr, DT: tl.constexpr,
                            ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_K2: tl.constexpr,
                            BLOCK_E: tl.constexpr):
    e, row0, end = _find_tile(off_ptr, tl.program_id(0), E, BLOCK_M, BLOCK_E)
    if e >= 0:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < end
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        src = rows.to(tl.int64)
        if GATHER:
            src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        w_base = w_ptr + e.to(tl.int64) * s_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            a = tl.load(a_ptr + src[:, None] * s_am + rk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            acc, acc_u = _k_step(a, w_base, rk, kmask, rn, nmask, N, s_wk, s_wn, acc, acc_u, EPI, DT, ACC, UPCAST,
                                 IEEE)
        if LOW:  # + scale2 * a2[s] @ W2[e] (a low-rank adapter's term, a2 in the rows' order), same acc
            w2_base = w2_ptr + e.to(tl.int64) * s_w2e
            for k0 in range(0, K2, BLOCK_K2):
                rk = k0 + tl.arange(0, BLOCK_K2)
                kmask = rk < K2
                a2 = tl.load(a2_ptr + rows[:, None].to(tl.int64) * s_a2m + rk[None, :],
                             mask=rmask[:, None] & kmask[None, :], other=0.0).to(ACC) * scale2
                acc, acc_u = _k_step(a2, w2_base, rk, kmask, rn, nmask, N, s_w2k, s_w2n, acc, acc_u, EPI, DT, ACC,
                                     UPCAST, IEEE)
        omask = rmask[:, None] & nmask[None, :]
        r64 = rows[:, None].to(tl.int64)
        if EPI == 0:
            tl.store(out_ptr + r64 * s_om + rn[None, :], cast(acc, DT), mask=omask)
        else:
            if EPI == 1:
                g = cast(acc, DT).to(ACC)
                u = cast(acc_u, DT).to(ACC)
                tl.store(gu_ptr + r64 * s_gm + rn[None, :], cast(g, DT), mask=omask)
                tl.store(gu_ptr + r64 * s_gm + N + rn[None, :], cast(u, DT), mask=omask)
            else:
                g = tl.load(gu_ptr + r64 * s_gm + rn[None, :], mask=omask, other=0.0).to(ACC)
                u = tl.load(gu_ptr + r64 * s_gm + N + rn[None, :], mask=omask, other=0.0).to(ACC)
            act, dact = _act_and_grad(g, False)
            if EPI == 2:
                dh = cast(acc, DT).to(ACC)
                tl.store(out_ptr + r64 * s_om + rn[None, :], cast(dh * u * dact, DT), mask=omask)
                tl.store(out_ptr + r64 * s_om + N + rn[None, :], cast(dh * act, DT), mask=omask)
            act = cast(act, DT).to(ACC)
            tl.store(h_ptr + r64 * s_hm + rn[None, :], cast(act * u, DT), mask=omask)


# dW[e] = sum over the rows s of group e of a[s]^T b[src(s)]: one (BLOCK_M, BLOCK_N) tile of one
# expert per program, looping over the group's rows; an empty group writes zeros.
@triton.jit
def _experts_wgrad_kernel(a_ptr, b_ptr, idx_ptr, off_ptr, dw_ptr, M, N, s_am, s_bm, s_de, s_dm,
                          GATHER: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
                          IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    e = tl.program_id(0)
    start = tl.load(off_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(off_ptr + e)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for s0 in range(start, end, BLOCK_K):
        rs = s0 + tl.arange(0, BLOCK_K)
        smask = rs < end
        src = rs.to(tl.int64)
        if GATHER:
            src = tl.load(idx_ptr + rs, mask=smask, other=0).to(tl.int64)
        at = tl.load(a_ptr + rs[None, :].to(tl.int64) * s_am + rm[:, None], mask=mmask[:, None] & smask[None, :],
                     other=0.0)  # (BLOCK_M, BLOCK_K)
        b = tl.load(b_ptr + src[:, None] * s_bm + rn[None, :], mask=smask[:, None] & nmask[None, :], other=0.0)
        acc = _dot(at, b, acc, DT, ACC, UPCAST, IEEE)
    tl.store(dw_ptr + e.to(tl.int64) * s_de + rm[:, None].to(tl.int64) * s_dm + rn[None, :],
             cast(acc, dw_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


# out[t] = sum_k w[t, k] * y[slot_rows[t, k]] over the valid slots, in k order (no atomics)
@triton.jit
def _experts_unpermute_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, H, s_ym, s_om,
                              K: tl.constexpr, WEIGHTED: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = rh < H
    acc = tl.zeros((BLOCK_H,), dtype=ACC)
    for k in tl.static_range(K):
        r = tl.load(rows_ptr + t * K + k)
        y = tl.load(y_ptr + r.to(tl.int64) * s_ym + rh, mask=hmask & ((rh * 0 + r) >= 0), other=0.0).to(ACC)
        if WEIGHTED:
            y = y * tl.load(w_ptr + t * K + k).to(ACC)
        acc += y
    tl.store(out_ptr + t.to(tl.int64) * s_om + rh, cast(acc, out_ptr.dtype.element_ty), mask=hmask)


# out[t] = sum_k w_k y_k  =>  dy_k = w_k * dout[t] (one writer per row: the slot that owns it),
# dw_k = dout[t] . y_k; one program per (token, slot), looping over H.
@triton.jit
def _experts_unpermute_bwd_kernel(dout_ptr, y_ptr, rows_ptr, w_ptr, dy_ptr, dw_ptr, H, s_dm, s_ym,
                                  K: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    k = tl.program_id(1)
    r = tl.load(rows_ptr + t * K + k)
    w = tl.load(w_ptr + t * K + k).to(ACC)
    dot = tl.zeros((BLOCK_H,), dtype=ACC)
    r64 = r.to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        m = (rh < H) & ((rh * 0 + r) >= 0)
        d = tl.load(dout_ptr + t.to(tl.int64) * s_dm + rh, mask=m, other=0.0).to(ACC)
        y = tl.load(y_ptr + r64 * s_ym + rh, mask=m, other=0.0).to(ACC)
        dot += d * y
        tl.store(dy_ptr + r64 * s_ym + rh, cast(d * w, dy_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + t * K + k, cast(tl.sum(dot, 0), dw_ptr.dtype.element_ty))


# The routing of forge/spec/experts.py (``route``) in one program, for up to its ROUTE_ROWS routed
# rows (a decoding step: torch's sort, search and scatter are ~13 launches there). A row's key is its expert id,
# or E where the id is outside [0, E); its sorted position (its rank) counts the rows with a
# smaller key and those with the same key before it: the stable sort's order, by comparisons.
# slot_rows[i] = rank[i] (-1 where the key is E), row_token[rank[i]] = i // K, offsets[e] = the
# rows with key <= e. Bit-equal to torch's route.
@triton.jit
def _route_key(ids_ptr, r, mask, E):
    idx = tl.load(ids_ptr + r, mask=mask, other=0)
    key = tl.where((idx >= 0) & (idx < E), idx, E).to(tl.int32)
    return tl.where(mask, key, E + 1)  # (lanes past the rows: after every row, never counted)


@triton.jit
def _experts_route_kernel(ids_ptr, tok_ptr, off_ptr, slot_ptr, S, E, K: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr):
    ri = tl.arange(0, BLOCK_S)
    imask = ri < S
    key_i = _route_key(ids_ptr, ri, imask, E)
    rank = tl.zeros((BLOCK_S,), dtype=tl.int32)
    for j0 in range(0, S, BLOCK_J):
        rj = j0 + tl.arange(0, BLOCK_J)
        key_j = _route_key(ids_ptr, rj, rj < S, E)
        before = (key_j[None, :] < key_i[:, None]) | ((key_j[None, :] == key_i[:, None]) & (rj[None, :] < ri[:, None]))
        rank += tl.sum(before.to(tl.int32), 1)
    tl.store(slot_ptr + ri, tl.where(key_i < E, rank, -1), mask=imask)
    tl.store(tok_ptr + rank, ri // K, mask=imask)
    for e0 in range(0, E, BLOCK_E):
        re = e0 + tl.arange(0, BLOCK_E)
        tl.store(off_ptr + re, tl.sum((key_i[None, :] <= re[:, None]).to(tl.int32), 1), mask=re < E)


# The router's choice (forge/spec/experts.py, ``top_k``) in one launch: a program holds BLOCK_T
# rows of logits whole; K picks by the logits (equal ones to the lower expert id), each pick's
# softmax probability from the row's max and sum, renormalised where asked. A row whose logits
# match no maximum (NaN) picks its lowest expert left, so every index stays in [0, E).
@triton.jit
def _experts_top_k_kernel(x_ptr, s_ptr, i_ptr, T, E, stride_x, K: tl.constexpr, RENORM: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    re = tl.arange(0, BLOCK_E)
    rk = tl.arange(0, BLOCK_K)
    tmask = rt < T
    alive = tmask[:, None] & (re[None, :] < E)
    x = tl.load(x_ptr + rt.to(tl.int64)[:, None] * stride_x + re[None, :], mask=alive,
                other=float("-inf")).to(tl.float32)
    top = tl.where(tmask, tl.max(x, 1), 0.0)  # (rows past T: finite, never stored)
    tot = tl.where(tmask, tl.sum(tl.where(alive, tl.exp(x - top[:, None]), 0.0), 1), 1.0)
    scores = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    index = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(K):
        v = tl.max(tl.where(alive, x, float("-inf")), 1)
        pick = tl.min(tl.where(alive & (x == v[:, None]), re[None, :], BLOCK_E), 1)
        pick = tl.where(pick == BLOCK_E, tl.min(tl.where(alive, re[None, :], BLOCK_E), 1), pick)
        alive = alive & (re[None, :] != pick[:, None])
        scores = tl.where(rk[None, :] == j, (tl.exp(v - top) / tot)[:, None], scores)
        index = tl.where(rk[None, :] == j, pick[:, None], index)
    if RENORM:
        scores = scores / tl.where(tmask, tl.sum(scores, 1), 1.0)[:, None]
    out = rt.to(tl.int64)[:, None] * K + rk[None, :]
    omask = tmask[:, None] & (rk[None, :] < K)
    tl.store(s_ptr + out, cast(scores, s_ptr.dtype.element_ty), mask=omask)
    tl.store(i_ptr + out, index.to(tl.int64), mask=omask)


# launched through forge's direct path (forge_triton/_launch.py), as every forge Triton kernel
_GROUPED = _launch.FastKernel(_experts_grouped_kernel)
_WGRAD = _launch.FastKernel(_experts_wgrad_kernel)
_UNPERMUTE = _launch.FastKernel(_experts_unpermute_kernel)
_UNPERMUTE_BWD = _launch.FastKernel(_experts_unpermute_bwd_kernel)
_ROUTE = _launch.FastKernel(_experts_route_kernel)
_TOP_K = _launch.FastKernel(_experts_top_k_kernel)


def _meta(dt):
    return dict(DT=_TL[dt], ACC=_common.acc(dt), UPCAST=_common.dot_upcast(), IEEE=dt == torch.float32)


def _grouped(a, idx, w, offsets, n, s_wn, s_wk, epi, gu=None, low=None, trans=True):
    """One launch of the grouped kernel over S = len(idx or a) rows; returns (out, gu, h).
    ``low``: None or (a2 (S, r), w2, scale), the adapter term added to the product, w2 (E, N, r)
    read like w when ``trans`` (a[s] @ W[e].T) else w2 (E, r, N)."""
    s_rows = idx.numel() if idx is not None else a.shape[0]
    bm, bn, bk, warps, stages = _tiles(("plain", "glu", "glu_bwd")[epi], a.dtype, s_rows)
    e_n = w.shape[0]
    k = a.shape[1]
    out = h = None
    if epi == EPI_PLAIN:
        out = _common.empty((s_rows, n), a.dtype, a.device)
    else:
        h = _common.empty((s_rows, n), a.dtype, a.device)
        if epi == EPI_GLU:
            gu = _common.empty((s_rows, 2 * n), a.dtype, a.device)
        else:
            out = _common.empty((s_rows, 2 * n), a.dtype, a.device)
    if s_rows and n:
        dummy = h if out is None else out
        grid = (row_tiles(s_rows, e_n, bm), _common.cdiv(n, bn))
        a2, w2, scale2 = low if low is not None else (a, w, 1.0)
        a2 = _dense(a2)
        k2 = a2.shape[1] if low is not None else 0
        s_w2n, s_w2k = (w2.stride(1), w2.stride(2)) if trans else (w2.stride(2), w2.stride(1))
        _GROUPED[grid](
            a, idx if idx is not None else offsets, w, offsets, dummy, gu if gu is not None else dummy,
            h if h is not None else dummy, a2, w2, e_n, n, k, k2, float(scale2), a.stride(0), w.stride(0), s_wn,
            s_wk, dummy.stride(0), gu.stride(0) if gu is not None else 0, h.stride(0) if h is not None else 0,
            a2.stride(0), w2.stride(0), s_w2n, s_w2k, GATHER=idx is not None, EPI=epi, LOW=low is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_K2=max(16, min(bk, _common.next_pow2(max(k2, 1)))),
            BLOCK_E=max(2, _common.next_pow2(e_n)), num_warps=warps, num_stages=stages, **_meta(a.dtype))
    return out, gu, h


def _dense(t):
    return t if t.is_contiguous() else t.contiguous()


def glu_fwd(x, row_token, offsets, gate_up_proj, act, low=None):
    x = _dense(x)
    i = gate_up_proj.shape[1] // 2
    _, gu, h = _grouped(x, row_token, gate_up_proj, offsets, i, gate_up_proj.stride(1), gate_up_proj.stride(2),
                        EPI_GLU, low=low)
    return h, gu


def grouped_mm(a, w, offsets, low=None):
    return _grouped(_dense(a), None, w, offsets, w.shape[1], w.stride(1), w.stride(2), EPI_PLAIN, low=low)[0]


def grouped_mm_t(a, w, offsets, low=None):
    return _grouped(_dense(a), None, w, offsets, w.shape[2], w.stride(2), w.stride(1), EPI_PLAIN, low=low,
                    trans=False)[0]


def glu_bwd(dy, gu, offsets, down_proj, act, low=None):
    dgu, _, h = _grouped(_dense(dy), None, down_proj, offsets, down_proj.shape[2], down_proj.stride(2),
                         down_proj.stride(1), EPI_GLU_BWD, gu=_dense(gu), low=low, trans=False)
    return dgu, h


def grouped_wgrad(a, b, offsets, b_rows):
    bm, bn, bk, warps, stages = _tiles("wgrad", a.dtype)
    a, b = _dense(a), _dense(b)
    e_n, m, n = offsets.numel(), a.shape[1], b.shape[1]
    dw = _common.empty((e_n, m, n), a.dtype, a.device)
    if e_n and m and n:
        grid = (e_n, _common.cdiv(m, bm), _common.cdiv(n, bn))
        _WGRAD[grid](a, b, b_rows if b_rows is not None else offsets, offsets, dw, m, n,
                     a.stride(0), b.stride(0), dw.stride(0), dw.stride(1),
                     GATHER=b_rows is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                     num_warps=warps, num_stages=stages, **_meta(a.dtype))
    return dw


def unpermute(y, slot_rows, weights):
    y = _dense(y)
    t, k = slot_rows.shape
    h = y.shape[1]
    out = _common.empty((t, h), y.dtype, y.device)
    if t and h:
        bh = min(1024, _common.next_pow2(h))
        _UNPERMUTE[(t, _common.cdiv(h, bh))](
            y, _dense(slot_rows), _dense(weights) if weights is not None else y, out, h, y.stride(0),
            out.stride(0), K=k, WEIGHTED=weights is not None, ACC=_common.acc(y.dtype), BLOCK_H=bh)
    return out


def unpermute_bwd(dout, y, slot_rows, weights):
    dout, y = _dense(dout), _dense(y)
    t, k = slot_rows.shape
    h = y.shape[1]
    dy = _common.empty_like(y)
    dw = _common.empty((t, k), weights.dtype, weights.device)
    if t:
        _UNPERMUTE_BWD[(t, k)](dout, y, _dense(slot_rows), _dense(weights), dy, dw, h,
                               dout.stride(0), y.stride(0), K=k, ACC=_common.acc(y.dtype),
                               BLOCK_H=min(1024, _common.next_pow2(max(h, 1))))
    return dy, dw


def route(top_k_index, n_experts):
    """forge.spec.experts.route in one launch, for at most its ROUTE_ROWS routed rows (the op
    layer routes more in torch)."""
    t, k = top_k_index.shape
    dev = top_k_index.device
    row_token = _common.empty((t * k,), torch.int32, dev)
    offsets = _common.empty((n_experts,), torch.int32, dev)
    slot_rows = _common.empty((t, k), torch.int32, dev)
    bs, bj, be = X.route_blocks(t * k, n_experts)
    _ROUTE[(1,)](_dense(top_k_index), row_token, offsets, slot_rows, t * k, n_experts, K=k, BLOCK_S=bs,
                 BLOCK_J=bj, BLOCK_E=be, num_warps=4)
    return row_token, offsets, slot_rows


def top_k(logits, k, renorm, dtype=torch.float32):
    """forge.spec.experts.top_k in one launch, for at most its TOP_K_EXPERTS experts (the op layer
    takes torch's past that)."""
    t, e = logits.shape
    dev = logits.device
    scores = _common.empty((t, k), dtype, dev)
    index = _common.empty((t, k), torch.int64, dev)
    if t:
        bt, be, bk = X.top_k_blocks(t, e, k)
        x = logits if logits.stride(1) == 1 else logits.contiguous()
        _TOP_K[(triton.cdiv(t, bt),)](x, scores, index, t, e, x.stride(0), K=k, RENORM=bool(renorm),
                                      BLOCK_T=bt, BLOCK_E=be, BLOCK_K=bk, num_warps=X.top_k_warps(bt, be))
    return scores, index


def experts_pieces() -> dict:
    """The pieces forge.ops.experts builds the expert block's node from."""
    return {"glu_fwd": glu_fwd, "grouped_mm": grouped_mm, "unpermute": unpermute,
            "unpermute_bwd": unpermute_bwd, "glu_bwd": glu_bwd, "grouped_mm_t": grouped_mm_t,
            "grouped_wgrad": grouped_wgrad, "route": route, "top_k": top_k,
            "device_type": "cpu" if _common.INTERPRET else "cuda"}
