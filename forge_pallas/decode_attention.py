"""Decoding attention as Pallas kernels: one query token per sequence, the cache split along its
length (spec: forge/spec/decode_attention.py; the Triton twin is forge_triton/decode_attention.py).

Grid (B * H_kv, chunks): a program takes one KV head's G query heads as the rows of one matrix
product against one chunk of that head's cache, keeping the softmax state (running max and sum,
weighted values; fp32) as it walks the chunk's tiles; a second kernel, one program per query
head, merges every chunk's state for that head at once. The cache comes folded to
(B H_kv S, D) rows, the queries to (B H, D), the mask to (B, S): no extent but the head sizes
is a constant of the lowered module. The mask is one of "none", "bool" (uint8 bytes, nonzero =
attend) or "float" (added to the scores), static.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import _common as C

BLOCK_N = 64  # keys per tile
PROGRAMS_PER_CORE = 2
MAX_SPLITS = 64
MASKS = ("none", "bool", "float")


def _split_kernel(q_ref, k_ref, v_ref, m_ref, seq_ref, part_ref, stat_ref, *, hkv, g, d, chunk, nsplit, mask_kind,
                  scale, block_g, block_d, block_n):
    seq = C.read_rows(seq_ref)
    bk, sp = pl.program_id(0), pl.program_id(1)
    b = jax.lax.div(bk, C.i32(hkv))
    rows, dcol = jnp.arange(block_g), jnp.arange(block_d)
    dmask = dcol < d
    q = C.load(q_ref.at[C.ds(bk * g, block_g), C.ds(0, block_d)],
               mask=(rows < g)[:, None] & dmask[None, :], other=0.0)
    start = sp * chunk
    end = jnp.minimum(start + chunk, seq)

    def tile(t, carry):
        m_i, l_i, acc = carry
        n0 = start + t * block_n
        cols = n0 + jnp.arange(block_n)
        valid = cols < end
        kv_mask = valid[:, None] & dmask[None, :]
        at = (C.ds(bk * seq + n0, block_n), C.ds(0, block_d))
        kt = C.load(k_ref.at[at], mask=kv_mask, other=0.0)
        vt = C.load(v_ref.at[at], mask=kv_mask, other=0.0)
        s = jax.lax.dot_general(q, kt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        if mask_kind != "none":
            mv = C.load(m_ref.at[b, C.ds(n0, block_n)], mask=valid, other=0)
            if mask_kind == "bool":
                valid = valid & (mv != 0)
            else:
                s = s + mv.astype(jnp.float32)[None, :]
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing attended yet
        alpha = jnp.exp(m_i - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l_i = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jax.lax.dot_general(p.astype(vt.dtype), vt, (((1,), (0,)), ((), ())),
                                                         preferred_element_type=jnp.float32)
        return m_new, l_i, acc

    init = (jnp.full((block_g,), -jnp.inf, jnp.float32), jnp.zeros((block_g,), jnp.float32),
            jnp.zeros((block_g, block_d), jnp.float32))
    ntiles = jax.lax.div(jnp.maximum(end - start, 0) + C.i32(block_n - 1), C.i32(block_n))
    m_i, l_i, acc = jax.lax.fori_loop(C.i32(0), ntiles, tile, init)
    slot = bk * nsplit + sp
    C.store(part_ref.at[slot, C.ds(0, block_g), C.ds(0, block_d)], acc)
    C.store(stat_ref.at[slot, C.ds(0, block_g)], m_i)
    C.store(stat_ref.at[slot, C.ds(block_g, block_g)], l_i)


def _merge_kernel(part_ref, stat_ref, o_ref, *, g, d, nsplit, block_g, block_s, block_d):
    pid = pl.program_id(0)
    bk = jax.lax.div(pid, C.i32(g))  # (b H + h) // G = b H_kv + h // G
    row = jax.lax.rem(pid, C.i32(g))
    live = jnp.arange(block_s) < nsplit
    sl = C.ds(bk * nsplit, block_s)
    m = C.load(stat_ref.at[sl, row], mask=live, other=-jnp.inf)
    lsum = C.load(stat_ref.at[sl, block_g + row], mask=live, other=0.0)
    part = C.load(part_ref.at[sl, row, C.ds(0, block_d)], mask=live[:, None], other=0.0)
    w = jnp.exp(m - jnp.max(m))  # a chunk with nothing attended (m = -inf) weighs 0
    out = jnp.sum(part * w[:, None], axis=0) / jnp.sum(lsum * w)
    C.store(o_ref.at[pid, C.ds(0, block_d)], out.astype(o_ref.dtype), mask=jnp.arange(block_d) < d)


_launch = C.triton_call


def _plan(b, hkv, s):
    """(chunk, chunks): about PROGRAMS_PER_CORE programs per SM, at most MAX_SPLITS chunks."""
    tiles = C.cdiv(s, BLOCK_N)  # (s >= 1: the spec refuses an empty cache)
    want = C.cdiv(PROGRAMS_PER_CORE * C.num_cores(), b * hkv)
    chunk = C.cdiv(tiles, min(tiles, want, MAX_SPLITS)) * BLOCK_N
    return chunk, C.cdiv(s, chunk)


def decode_attention_fwd(q, k, v, mask, *, mask_kind, scale):
    """q (B, H, D), k and v (B, H_kv, S, D), mask (B, S) (a placeholder for "none") -> ((out,), ())."""
    if mask_kind not in MASKS:
        raise ValueError(f"mask_kind must be one of {MASKS}, got {mask_kind!r}")
    b, h, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    block_g, block_d = max(16, C.next_power_of_2(g)), max(16, C.next_power_of_2(d))
    chunk, nsplit = _plan(b, hkv, s)
    warps = 4 if block_g * block_d <= 4096 else 8
    part_sds = jax.ShapeDtypeStruct((b * hkv * nsplit, block_g, block_d), jnp.float32)
    stat_sds = jax.ShapeDtypeStruct((b * hkv * nsplit, 2 * block_g), jnp.float32)
    split = functools.partial(_split_kernel, hkv=hkv, g=g, d=d, chunk=chunk, nsplit=nsplit, mask_kind=mask_kind,
                              scale=scale,
                              block_g=block_g, block_d=block_d, block_n=BLOCK_N)
    part, stat = _launch(split, name="decode_attention_split", grid=(b * hkv, nsplit), num_warps=warps,
                         out_shape=(part_sds, stat_sds))(
        q.reshape(b * h, d), k.reshape(-1, d), v.reshape(-1, d), mask, C.rows_operand(s))
    block_s = C.next_power_of_2(nsplit)
    merge = functools.partial(_merge_kernel, g=g, d=d, nsplit=nsplit, block_g=block_g, block_s=block_s,
                              block_d=block_d)
    out = _launch(merge, name="decode_attention_merge", grid=(b * h,),
                  num_warps=4 if block_s * block_d <= 4096 else 8,
                  out_shape=jax.ShapeDtypeStruct((b * h, d), q.dtype))(part, stat)
    return (out.reshape(b, h, d),), ()


# The cache write (forge/spec/kv_append.py) in one launch: a program per (sequence, head) row
# copies that row's new key and value into the cache at the position the counter's low word
# holds; each then takes a ticket on the high word, and the last one advances the position.
def _append_kernel(k_ref, v_ref, keys_in, values_in, cnt_in, keys_ref, values_ref, cnt_ref, *, rows, c, d,
                   block_d):
    del keys_in, values_in, cnt_in  # (the buffers of the outputs they alias)
    pos = cnt_ref[0]
    r = pl.program_id(0)
    cols = jnp.arange(block_d)
    ok = (cols < d) & (r < rows) & (pos >= 0) & (pos < c)  # (outside the cache nothing is written)
    at = (r * C.i32(c) + pos, C.ds(0, block_d))
    C.store(keys_ref.at[at], C.load(k_ref.at[r, C.ds(0, block_d)], mask=ok, other=0), mask=ok)
    C.store(values_ref.at[at], C.load(v_ref.at[r, C.ds(0, block_d)], mask=ok, other=0), mask=ok)
    # (acquire-release: every read above comes before the ticket). A scalar atomic: Triton hands
    # its old value to every thread of the program; a one-element vector's is defined only in the
    # thread that ran it, and the program's last ticket went unseen on an H100
    high = r * 0 + 1  # (the high word's index, traced: Pallas' atomic takes no Python int)
    ticket = plt.atomic_add(cnt_ref, high, jnp.int32(1))

    @pl.when(ticket == pl.num_programs(0) - 1)
    def _():
        cnt_ref[0] = pos + 1
        cnt_ref[1] = jnp.int32(0)


def kv_append_fwd(keys, values, k, v, words):
    """keys and values (B H C, D) rows, k and v (B H, D), words (2,) int32 -> ((keys, values,
    words) updated in place: outputs aliasing those inputs), ())."""
    rows, d = k.shape
    c = keys.shape[0] // max(rows, 1)
    append = functools.partial(_append_kernel, rows=rows, c=c, d=d, block_d=max(16, C.next_power_of_2(d)))
    out = _launch(append, name="kv_append", grid=(C.row_programs(rows),), num_warps=1,
                  out_shape=(jax.ShapeDtypeStruct(keys.shape, keys.dtype),
                             jax.ShapeDtypeStruct(values.shape, values.dtype),
                             jax.ShapeDtypeStruct(words.shape, words.dtype)),
                  aliases={2: 0, 3: 1, 4: 2})(k, v, keys, values, words)
    return tuple(out), ()
