"""Decoding attention in Triton: one query token per sequence, the cache split along its length
(spec: forge/spec/decode_attention.py).

A decoding step has one query row per head, so a kernel that gives each (sequence, head) one
program leaves most of the GPU idle: at batch 1 with Qwen2.5-0.5B's 2 KV heads that is 2 of 132
SMs walking a 1,280-key cache. Here one program takes one KV head's G query heads (as the rows
of one ``tl.dot``: the cache's keys and values are read once per KV head, never repeated) and
one chunk of the cache; the chunks' partial softmax states (running max, sum, weighted values,
fp32) are merged by a second, small kernel, one program per query head holding every chunk's
state at once (a loop over the chunks cost 8.7 us per layer at 20 chunks on the H200: a chain of
dependent loads). The number of chunks is picked so that about two programs run per SM (at most
64); with one chunk the first kernel writes the output itself.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from forge.spec import decode_attention as spec
from forge.spec import kv_append as append_spec

from . import _common, _launch

BLOCK_N = 64  # keys per tile
PROGRAMS_PER_SM = 2
MAX_SPLITS = 64  # the merge holds every chunk's state for one head in registers


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, part_ptr, stat_ptr, o_ptr,
    sqb, sqh, skb, skh, sks, svb, svh, svs, smb, sms, sob, soh,
    HKV, G, S, D, CHUNK, NSPLIT, scale,
    HAS_MASK: tl.constexpr, BOOL_MASK: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    hk = (pid % HKV).to(tl.int64)
    rows = tl.arange(0, BLOCK_G)
    dcol = tl.arange(0, BLOCK_D)
    dmask = dcol < D
    q = tl.load(q_ptr + b * sqb + (hk * G + rows)[:, None] * sqh + dcol[None, :],
                mask=(rows < G)[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    start = sp * CHUNK
    end = tl.minimum(start + CHUNK, S)
    kb = k_ptr + b * skb + hk * skh
    vb = v_ptr + b * svb + hk * svh
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        valid = cols < end
        c64 = cols.to(tl.int64)
        kv_mask = valid[:, None] & dmask[None, :]
        kt = tl.load(kb + c64[:, None] * sks + dcol[None, :], mask=kv_mask, other=0.0)
        vt = tl.load(vb + c64[:, None] * svs + dcol[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt)) * scale  # (BLOCK_G, BLOCK_N), fp32
        if HAS_MASK:
            mv = tl.load(m_ptr + b * smb + c64 * sms, mask=valid, other=0)
            if BOOL_MASK:
                valid = valid & (mv != 0)
            else:
                s = s + mv.to(tl.float32)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with nothing attended yet
        alpha = _common.exp(m_i - m_safe)
        p = _common.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * sob + (hk * G + rows)[:, None] * soh + dcol[None, :],
                 _common.cast(out, o_ptr.dtype.element_ty), mask=(rows < G)[:, None] & dmask[None, :])
    else:
        at = pid.to(tl.int64) * NSPLIT + sp
        tl.store(part_ptr + at * (BLOCK_G * BLOCK_D) + rows[:, None] * BLOCK_D + dcol[None, :], acc)
        tl.store(stat_ptr + at * (2 * BLOCK_G) + rows, m_i)
        tl.store(stat_ptr + at * (2 * BLOCK_G) + BLOCK_G + rows, l_i)


@triton.jit
def _merge_kernel(part_ptr, stat_ptr, o_ptr, sob, soh, H, G, D, NSPLIT,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    # one program per (sequence, query head): every chunk's state for that head loaded at once
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    bk = b * (H // G) + h // G  # the (sequence, KV head) program of the split kernel
    row = h % G
    sp = tl.arange(0, BLOCK_S)
    dcol = tl.arange(0, BLOCK_D)
    live = sp < NSPLIT
    at = bk * NSPLIT + sp
    m = tl.load(stat_ptr + at * (2 * BLOCK_G) + row, mask=live, other=float("-inf"))
    lsum = tl.load(stat_ptr + at * (2 * BLOCK_G) + BLOCK_G + row, mask=live, other=0.0)
    part = tl.load(part_ptr + at[:, None] * (BLOCK_G * BLOCK_D) + row * BLOCK_D + dcol[None, :],
                   mask=live[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    w = _common.exp(m - m_max)  # a chunk with nothing attended (m = -inf) weighs 0
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
    tl.store(o_ptr + b * sob + h * soh + dcol, _common.cast(out, o_ptr.dtype.element_ty), mask=dcol < D)


_split = _launch.FastKernel(_split_kernel)
_merge = _launch.FastKernel(_merge_kernel)
_CFG = _common.BoundedCache()  # (b, hkv, g, s, d, device) -> launch configuration


def _cfg(b, hkv, g, s, d, device):
    key = (b, hkv, g, s, d, device)
    cfg = _CFG.get(key)
    if cfg is None:
        block_g, block_d = max(16, _common.next_pow2(g)), max(16, _common.next_pow2(d))
        tiles = _common.cdiv(s, BLOCK_N)  # (s >= 1: the spec refuses an empty cache)
        want = _common.cdiv(PROGRAMS_PER_SM * _common.num_sms(device), b * hkv)
        chunk = _common.cdiv(tiles, min(tiles, want, MAX_SPLITS)) * BLOCK_N
        nsplit = _common.cdiv(s, chunk)
        warps = 4 if block_g * block_d <= 4096 else 8
        block_s = _common.next_pow2(nsplit)
        merge_warps = 4 if block_s * block_d <= 4096 else 8
        cfg = _CFG[key] = (block_g, block_d, chunk, nsplit, warps, block_s, merge_warps)
    return cfg


def decode_attention(q, k, v, mask=None, scale=None):
    """Triton decoding attention with the signature of ``forge.spec.decode_attention.reference``:
    q (B, H, D), k and v (B, H_kv, S, D), mask (B, S) bool or float or None; returns (B, H, D)."""
    spec.check(q, k, v, mask, scale)
    _common.check_device(q=q, k=k, v=v, mask=mask)
    if q.dtype is torch.float64:
        raise TypeError("decode_attention (triton) takes float16, bfloat16 or float32 (it accumulates in float32), "
                        "got float64")
    b, h, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    out = _common.empty((b, h, d), q.dtype, q.device)
    if not (b and h and d):
        return out
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    has_mask, bool_mask = mask is not None, mask is not None and mask.dtype is torch.bool
    if bool_mask:
        mask = mask.view(torch.uint8)  # (same bytes; Triton loads it as integers)
    sm = mask.stride() if has_mask else (0, 0)
    block_g, block_d, chunk, nsplit, warps, block_s, merge_warps = _cfg(b, hkv, g, s, d, q.device)
    direct = nsplit == 1
    if direct:
        part = stat = out
    else:
        part = torch.empty((b * hkv * nsplit, block_g, block_d), dtype=torch.float32, device=q.device)
        stat = torch.empty((b * hkv * nsplit, 2, block_g), dtype=torch.float32, device=q.device)
    sq, sk, sv, so = q.stride(), k.stride(), v.stride(), out.stride()
    _split[(b * hkv, nsplit)](
        q, k, v, mask if has_mask else q, part, stat, out,
        sq[0], sq[1], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sm[0], sm[1], so[0], so[1],
        hkv, g, s, d, chunk, nsplit, scale,
        HAS_MASK=has_mask, BOOL_MASK=bool_mask, DIRECT=direct,
        BLOCK_G=block_g, BLOCK_N=BLOCK_N, BLOCK_D=block_d, UPCAST=_common.dot_upcast(), num_warps=warps,
    )
    if not direct:
        _merge[(b * h,)](part, stat, out, so[0], so[1], h, g, d, nsplit,
                         BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_S=block_s, num_warps=merge_warps)
    return out


# -- the cache write (forge/spec/kv_append.py): one launch for keys, values and the length ------
APPEND_ROWS = 8  # (sequence, head) rows per program


@triton.jit
def _kv_append_kernel(keys_ptr, values_ptr, k_ptr, v_ptr, cnt_ptr, ROWS, H, C, D, skb, skh, svb, svh,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pos = tl.load(cnt_ptr)  # the low word: the position (read before this program's ticket)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    b, h = r // H, r % H
    live = tl.where((pos >= 0) & (pos < C), ROWS, 0)  # (outside the cache no row is written)
    ok = (r < live)[:, None] & (d < D)[None, :]
    at = (r * C + pos)[:, None] * D + d[None, :]
    kt = tl.load(k_ptr + (b * skb + h * skh)[:, None] + d[None, :], mask=ok)
    vt = tl.load(v_ptr + (b * svb + h * svh)[:, None] + d[None, :], mask=ok)
    tl.store(keys_ptr + at, kt, mask=ok)
    tl.store(values_ptr + at, vt, mask=ok)
    ticket = tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel")  # the high word
    if ticket == tl.num_programs(0) - 1:  # the last program to read the position advances it
        tl.store(cnt_ptr, pos + 1)
        tl.store(cnt_ptr + 1, 0)


_append = _launch.FastKernel(_kv_append_kernel)


def kv_append(keys, values, k, v, n):
    """Triton cache write with the signature of ``forge.spec.kv_append.reference``: k and v (B, H,
    1, D) into keys and values (B, H, C, D) at position ``n`` (0-dim int64), then n += 1; in place."""
    append_spec.check(keys, values, k, v, n)
    _common.check_device(keys=keys, values=values, k=k, v=v, n=n)
    b, h, c, d = keys.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    rows = b * h
    grid = (max(1, _common.cdiv(rows, APPEND_ROWS)),)  # (no rows: one program still advances n)
    _append[grid](keys, values, k, v, append_spec.counter_words(n), rows, h, c, d,
                  k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  BLOCK_R=APPEND_ROWS, BLOCK_D=max(16, _common.next_pow2(d)), num_warps=1)
