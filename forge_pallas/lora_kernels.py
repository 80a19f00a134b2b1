"""The Pallas kernels of the fused LoRA projections (forge_pallas/lora.py drives them), written
for Pallas' Triton lowering like Triton's own (forge_triton/lora_kernels.py): the same tiles,
the same products, the same dropout hash. Pure JAX, no torch.

Every adapter product takes x's dtype as operands (A and B read in their own dtype, rounded in
registers) with fp32 accumulation (fp64 for fp64). Ranks are not padded: loads along a rank are
masked to it. Dropout on an adapter's input is drawn where the input is read, from the call's
seed (two int32 words, an operand) and the adapter's stream: the words of
forge/spec/lora_dropout.py computed on int32 with logical shifts and wrapping products, so each
keep bit equals the Triton kernels' and the torch reference's.

Up to three adapters read one input: a kernel takes them as *slots*, static
``(column offset, rank, salt word, threshold, scale)`` tuples (scale None: no dropout).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from forge import _runtime

from . import _common as C
from .glu import _act as _glu_act  # one activation (and derivative) for both GLU kernels

BLOCK_M = 64
BLOCK_N = 64
DOWN_BLOCK_M = 32
DOWN_BLOCK_K = 64
# the largest rank whose low-rank term in a tile kernel runs as r outer products of a column and a
# row (CUDA cores) rather than one dot: Triton's CFG option, where the dot won every case on an
# H100 at r=16 (docs/performance.md); untimed for Pallas (0: dot always).
# Read when a kernel is traced: a change needs fresh traces (jax.clear_caches and the bridge's).
FMA_UPTO = 0


def _signed(word: int) -> int:
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= 1 << 31 else word


_MUL1, _MUL2, _GOLDEN = _signed(0x7FEB352D), _signed(0x846CA68B), _signed(0x9E3779B9)


def _launch(kernel, *, name, grid, out_shape, aliases=None, num_stages=None):
    """``aliases`` lets an output reuse an input's buffer (the base GEMM output becomes the
    result in place)."""
    return C.triton_call(kernel, name=name, grid=grid, out_shape=out_shape, num_warps=4, aliases=aliases,
                         num_stages=num_stages)


@functools.lru_cache(maxsize=256)
def _stages(stage_bytes: int) -> int:
    """Pipeline stages of a row kernel's loop (down, grad_a) whose tiles take ``stage_bytes``
    of shared memory per stage: the most up to the lowering's default 3 that fit the GPU (three
    stages of three rank-256 adapters in bf16 would need ~300 KB; the column block stays)."""
    return _runtime.pipeline_fit(DOWN_BLOCK_K, lambda _: stage_bytes, _runtime.shared_memory(),
                                 smallest=DOWN_BLOCK_K)[1]


def rank_block(r: int) -> int:
    """A power of two >= max(16, r) (the dot's minimum K): a tile's whole rank."""
    return max(16, C.next_power_of_2(r))


def precision(dtype):
    # fp32 models: full fp32 products (Pallas' Triton lowering and XLA default to tf32 on GPU)
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def dot(a, b, dims=((1,), (0,))):
    """a @ b (or a contraction given by ``dims``) with the precision rule above, fp32+ output."""
    return lax.dot_general(a, b, (dims, ((), ())), precision=precision(a.dtype),
                           preferred_element_type=C.acc_dtype(a.dtype))


# ---------------------------------------------------------------------------------------- the hash
def _i32(v):
    return jnp.int32(v)


def _mix(h):
    """forge/spec/lora_dropout.py's ``mix`` on int32 words."""
    h = h ^ lax.shift_right_logical(h, _i32(16))
    h = h * _i32(_MUL1)
    h = h ^ lax.shift_right_logical(h, _i32(15))
    h = h * _i32(_MUL2)
    return h ^ lax.shift_right_logical(h, _i32(16))


def _stream(seed_ref, salt):
    """(key_row, key_col) of stream (seed, salt word)."""
    lo = C.load(seed_ref.at[C.ds(0, 1)])[0]
    hi = C.load(seed_ref.at[C.ds(1, 1)])[0]
    k_row = _mix(lo ^ _mix(hi ^ _i32(_signed(salt))))
    return k_row, _mix(k_row ^ _i32(_GOLDEN))


def _index_keys(idx, key):
    return _mix(idx.astype(jnp.int32) ^ key)


def _drop_factor(row_keys, col_keys, thr, scale, acc):
    """(rows, cols) of ``scale`` where kept, 0 where dropped: the factor dropout multiplies by (a
    product, as torch's dropout, of primitives the native launch translates)."""
    bits = _mix(row_keys[:, None] ^ col_keys[None, :])
    keep = lax.shift_right_logical(bits, _i32(8)) >= _i32(thr)
    return keep.astype(acc) * scale


def _keys(seed_ref, slots, rows):
    """Per slot (key_col, row keys of ``rows``), None for a slot without dropout."""
    out = []
    for _, _, salt, _, scale in slots:
        if scale is None:
            out.append(None)
        else:
            k_row, k_col = _stream(seed_ref, salt)
            out.append((k_col, None if rows is None else _index_keys(rows, k_row), k_row))
    return out


def _dropped(x, keys, cols, slot, acc):
    """drop(x) for a (rows, cols) tile, rounded to x's dtype as torch's product."""
    if keys is None:
        return x
    k_col, row_keys, _ = keys
    _, _, _, thr, scale = slot
    return (x.astype(acc) * _drop_factor(row_keys, _index_keys(cols, k_col), thr, scale, acc)).astype(x.dtype)


def _tile(i, j, m, n, bm=BLOCK_M, bn=BLOCK_N):
    rows = i * bm + jnp.arange(bm)
    cols = j * bn + jnp.arange(bn)
    rmask, cmask = rows < m, cols < n
    return rows, cols, pl.ds(i * bm, bm), pl.ds(j * bn, bn), rmask, cmask


def lowrank(p_ref, q_ref, rs, cs, rmask, cmask, pcol, qoff, r, dt, acc, *, q_rows):
    """(P[rs, pcol:pcol+r] Q_r)[:, cs] for a tile: P (M, *) holds the rank-r activations, Q the
    adapter (``q_rows``: stored (R, N), rows qoff..qoff+r; else (N, R), columns qoff..). Both
    rounded to ``dt`` for the product; loads masked to the rank. Up to rank FMA_UPTO: r outer
    products instead of the dot (each product of two ``dt``-rounded values exact in ``acc``)."""
    if r <= FMA_UPTO:
        out = jnp.zeros((rmask.shape[0], cmask.shape[0]), acc)
        for k in range(r):  # (static: the slot's rank)
            p = C.load(p_ref.at[rs, pl.ds(pcol + k, 1)], mask=rmask[:, None], other=0.0)  # (BM, 1)
            if q_rows:
                q = C.load(q_ref.at[pl.ds(qoff + k, 1), cs], mask=cmask[None, :], other=0.0)  # (1, BN)
            else:
                q = C.load(q_ref.at[cs, pl.ds(qoff + k, 1)], mask=cmask[:, None], other=0.0).T  # (1, BN)
            out = out + _round(p, dt, acc) * _round(q, dt, acc)
        return out
    rb = rank_block(r)
    kmask = jnp.arange(rb) < r
    p = C.load(p_ref.at[rs, pl.ds(_at(pcol, _zero()), rb)], mask=rmask[:, None] & kmask[None, :], other=0.0)  # (BM, RB)
    if q_rows:
        q = C.load(q_ref.at[pl.ds(_at(qoff, _zero()), rb), cs], mask=kmask[:, None] & cmask[None, :], other=0.0)  # (RB, BN)
        return dot(p.astype(dt), q.astype(dt)).astype(acc)
    q = C.load(q_ref.at[cs, pl.ds(_at(qoff, _zero()), rb)], mask=cmask[:, None] & kmask[None, :], other=0.0)  # (BN, RB)
    return dot(p.astype(dt), q.astype(dt), ((1,), (1,))).astype(acc)


def _zero():
    """A traced 0 (read at a kernel's top level: the interpreter substitutes program ids there only)."""
    return pl.program_id(0) * 0


def _at(off: int, zero):
    """A slice start of ``off`` that JAX does not check against the array's bounds at trace time
    (``zero`` from :func:`_zero`): a slot's rank block may run past the last slot's columns (its
    loads and stores are masked there), which a static start would be refused for. Triton folds
    the sum to the constant."""
    return zero + C.i32(off) if off else 0


def _round(v, dtype, acc):
    return v.astype(dtype).astype(acc)


# ---------------------------------------------------------------------------------------- kernels
# out (M, N) = base + bias + scale * xa[:, col:col+r] B^T (B (N, r) in its own dtype), over base
def _lora_add_kernel(base_ref, bias_ref, xa_ref, b_ref, m_ref, o_ref, *, col, r, scale, has_bias):
    m, n = C.read_rows(m_ref), base_ref.shape[1]  # rows at run time (see _common.rows_operand)
    dt = o_ref.dtype
    acc = C.acc_dtype(dt)
    _, _, rs, cs, rmask, cmask = _tile(pl.program_id(0), pl.program_id(1), m, n)
    mask = rmask[:, None] & cmask[None, :]
    lo = lowrank(xa_ref, b_ref, rs, cs, rmask, cmask, col, 0, r, dt, acc, q_rows=False)
    out = C.load(base_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    if has_bias:
        out = out + C.load(bias_ref.at[cs], mask=cmask, other=0.0).astype(acc)[None, :]
    C.store(o_ref.at[rs, cs], (out + scale * lo).astype(dt), mask=mask)


def lora_add(base, bias, xa, b, *, col, scale):
    """base (M, N) + bias (N,) or None + scale * xa[:, col:col+r] @ b^T, b (N, r)."""
    m, n = base.shape
    has_bias = bias is not None
    bias = bias if has_bias else jnp.zeros((1,), base.dtype)
    kern = functools.partial(_lora_add_kernel, col=col, r=b.shape[1], scale=float(scale), has_bias=has_bias)
    return _launch(kern, name="lora_add", grid=(C.row_programs(C.cdiv(m, BLOCK_M)), C.cdiv(n, BLOCK_N)),
                   out_shape=jax.ShapeDtypeStruct(base.shape, base.dtype), aliases={0: 0})(
        base, bias, xa, b, C.rows_operand(m))


# part (P * M, R): part[p M + i, off:off+r] = drop_slot(x[i, cols of part p]) A_slot[:, cols of p]^T for
# each slot; x (M, K) read once for all slots, its columns split in P parts of k_per_part (a run-time
# operand: a few thousand rows make too few row blocks to keep the GPU's memory busy); the caller
# adds the parts up
def _lora_down_kernel(x_ref, a_ref, seed_ref, m_ref, kpp_ref, o_ref, *, slots, rb):
    m, kdim = C.read_rows(m_ref), x_ref.shape[1]
    kpp = C.read_rows(kpp_ref)
    dt = x_ref.dtype
    acc = C.acc_dtype(dt)
    i, part = pl.program_id(0), pl.program_id(1)
    rows = i * DOWN_BLOCK_M + jnp.arange(DOWN_BLOCK_M)
    rmask, rs = rows < m, pl.ds(i * DOWN_BLOCK_M, DOWN_BLOCK_M)
    keys = _keys(seed_ref, slots, rows)
    kr = jnp.arange(rb)
    starts = [_at(slot[0], _zero()) for slot in slots]
    k_start = part * kpp
    k_end = jnp.minimum(k_start + kpp, kdim)

    def body(kb, accs):
        k0 = k_start + kb.astype(jnp.int32) * DOWN_BLOCK_K
        cols = k0 + jnp.arange(DOWN_BLOCK_K)
        cmask, ks = cols < k_end, pl.ds(k0, DOWN_BLOCK_K)
        x = C.load(x_ref.at[rs, ks], mask=rmask[:, None] & cmask[None, :], other=0.0)  # (BM, BK)
        new = []
        for slot, key, a_acc, start in zip(slots, keys, accs, starts):
            r = slot[1]
            a = C.load(a_ref.at[pl.ds(start, rb), ks], mask=(kr < r)[:, None] & cmask[None, :], other=0.0)  # (RB, BK)
            xd = _dropped(x, key, cols, slot, acc)
            new.append(a_acc + dot(xd, a.astype(dt), ((1,), (1,))))
        return tuple(new)

    init = tuple(jnp.zeros((DOWN_BLOCK_M, rb), acc) for _ in slots)
    n_blocks = jnp.maximum(k_end - k_start + (DOWN_BLOCK_K - 1), 0) // DOWN_BLOCK_K
    accs = lax.fori_loop(C.i32(0), n_blocks.astype(jnp.int32), body, init)
    out_rows = pl.ds(part * m + i * DOWN_BLOCK_M, DOWN_BLOCK_M)
    for (_, r, *_), a_acc, start in zip(slots, accs, starts):
        C.store(o_ref.at[out_rows, pl.ds(start, rb)], a_acc.astype(o_ref.dtype),
                mask=rmask[:, None] & (kr < r)[None, :])


def lora_down(x, a_cat, seed, *, slots):
    """(M, R) in x's dtype: each slot's drop(x) A^T, from the slots' A stacked in a_cat (R, K)."""
    m, k = x.shape
    rtot = a_cat.shape[0]
    acc = C.acc_dtype(x.dtype)
    row_blocks, col_blocks = C.cdiv(m, DOWN_BLOCK_M), C.cdiv(k, DOWN_BLOCK_K)
    parts = max(1, min(col_blocks, C.cdiv(2 * C.num_cores(), row_blocks)))
    kpp = C.cdiv(C.cdiv(k, parts), DOWN_BLOCK_K) * DOWN_BLOCK_K
    parts = C.row_programs(C.cdiv(k, kpp))  # (two at least: see row_programs; a spare part adds zeros)
    rb = rank_block(max(s[1] for s in slots))
    kern = functools.partial(_lora_down_kernel, slots=tuple(slots), rb=rb)
    size = jnp.dtype(x.dtype).itemsize
    stages = _stages((DOWN_BLOCK_M + len(slots) * rb) * DOWN_BLOCK_K * size)  # x (BM, BK), A_i (RB, BK)
    part = _launch(kern, name="lora_down", grid=(C.row_programs(row_blocks), parts),
                   out_shape=jax.ShapeDtypeStruct((parts * m, rtot), acc), num_stages=stages)(
        x, a_cat, seed, C.rows_operand(m), C.rows_operand(kpp))
    return part.reshape(parts, m, rtot).sum(axis=0).astype(x.dtype)


# part (P * R, K): part[p R + off + j, k] = sum over the rows of part p of dxa[:, off + j] drop(x)[:, k]
def _lora_grad_a_kernel(x_ref, dxa_ref, seed_ref, m_ref, rpp_ref, o_ref, *, slots, rb, rtot):
    m, kdim = C.read_rows(m_ref), x_ref.shape[1]
    rpp = C.read_rows(rpp_ref)  # rows per part, at run time
    dt = x_ref.dtype
    acc = C.acc_dtype(dt)
    j, part = pl.program_id(0), pl.program_id(1)
    cols = j * DOWN_BLOCK_K + jnp.arange(DOWN_BLOCK_K)
    cmask, ks = cols < kdim, pl.ds(j * DOWN_BLOCK_K, DOWN_BLOCK_K)
    keys = _keys(seed_ref, slots, None)
    col_keys = [None if k is None else _index_keys(cols, k[0]) for k in keys]
    kr = jnp.arange(rb)
    start = part * rpp
    end = jnp.minimum(start + rpp, m)
    cuts = [_at(slot[0], _zero()) for slot in slots]

    def body(b, accs):
        b = b.astype(jnp.int32)
        row0 = start + b * DOWN_BLOCK_M
        rows = row0 + jnp.arange(DOWN_BLOCK_M)
        rmask, rs = rows < end, pl.ds(row0, DOWN_BLOCK_M)
        x = C.load(x_ref.at[rs, ks], mask=rmask[:, None] & cmask[None, :], other=0.0)  # (BM, BK)
        new = []
        for slot, key, ck, a_acc, cut in zip(slots, keys, col_keys, accs, cuts):
            _, r, _, thr, scale = slot
            xd = x
            if key is not None:
                factor = _drop_factor(_index_keys(rows, key[2]), ck, thr, scale, acc)
                xd = (x.astype(acc) * factor).astype(dt)
            d = C.load(dxa_ref.at[rs, pl.ds(cut, rb)], mask=rmask[:, None] & (kr < r)[None, :], other=0.0)  # (BM, RB)
            new.append(a_acc + dot(d.astype(dt), xd, ((0,), (0,))))  # (RB, BK)
        return tuple(new)

    n_blocks = jnp.maximum(end - start + (DOWN_BLOCK_M - 1), 0) // DOWN_BLOCK_M
    init = tuple(jnp.zeros((rb, DOWN_BLOCK_K), acc) for _ in slots)
    accs = lax.fori_loop(C.i32(0), n_blocks.astype(jnp.int32), body, init)
    for (off, r, *_), a_acc in zip(slots, accs):
        C.store(o_ref.at[pl.ds(part * rtot + off, rb), ks], a_acc.astype(o_ref.dtype),
                mask=(kr < r)[:, None] & cmask[None, :])


def lora_grad_a(x, dxa, seed, *, slots, parts):
    """(R, K) in the accumulation dtype: each slot's dxa^T drop(x), the rows split in ``parts``."""
    m, k = x.shape
    rtot = dxa.shape[1]
    acc = C.acc_dtype(x.dtype)
    rpp = C.cdiv(C.cdiv(m, parts), DOWN_BLOCK_M) * DOWN_BLOCK_M
    parts = max(1, C.cdiv(m, rpp))
    rb = rank_block(max(s[1] for s in slots))
    kern = functools.partial(_lora_grad_a_kernel, slots=tuple(slots), rb=rb, rtot=rtot)
    size = jnp.dtype(x.dtype).itemsize
    stages = _stages((DOWN_BLOCK_K + len(slots) * rb) * DOWN_BLOCK_M * size)  # x (BM, BK), dxa_i (BM, RB)
    part = _launch(kern, name="lora_grad_a", grid=(C.cdiv(k, DOWN_BLOCK_K), C.row_programs(parts)),
                   out_shape=jax.ShapeDtypeStruct((C.row_programs(parts) * rtot, k), acc), num_stages=stages)(
        x, dxa, seed, C.rows_operand(m), C.rows_operand(rpp))
    part = part.reshape(C.row_programs(parts), rtot, k)
    return part.sum(axis=0)


# gx (M, K) + sum_slot drop_slot(dxa[:, off:off+r] A_slot), written over gx
def _lora_dx_kernel(gx_ref, dxa_ref, a_ref, seed_ref, m_ref, o_ref, *, slots):
    m, n = C.read_rows(m_ref), gx_ref.shape[1]
    dt = gx_ref.dtype
    acc = C.acc_dtype(dt)
    rows, cols, rs, cs, rmask, cmask = _tile(pl.program_id(0), pl.program_id(1), m, n)
    mask = rmask[:, None] & cmask[None, :]
    out = C.load(gx_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    for slot, key in zip(slots, _keys(seed_ref, slots, rows)):
        off, r, _, thr, scale = slot
        lo = lowrank(dxa_ref, a_ref, rs, cs, rmask, cmask, off, off, r, dt, acc, q_rows=True)
        if key is not None:  # the adapter saw drop(x): its gradient reaches x only where x was kept
            lo = lo * _drop_factor(key[1], _index_keys(cols, key[0]), thr, scale, acc)
        out = out + lo
    C.store(o_ref.at[rs, cs], out.astype(dt), mask=mask)


def _seed(seed, dropping: bool):
    """The seed operand: a fixed (2,) int32 where nothing drops (the kernel never reads it)."""
    return seed if dropping else jnp.zeros((2,), jnp.int32)


def lora_dx(gx, dxa, a_cat, seed, *, slots):
    seed = _seed(seed, any(s[4] is not None for s in slots))
    m, n = gx.shape
    kern = functools.partial(_lora_dx_kernel, slots=tuple(slots))
    return _launch(kern, name="lora_dx", grid=(C.row_programs(C.cdiv(m, BLOCK_M)), C.cdiv(n, BLOCK_N)),
                   out_shape=jax.ShapeDtypeStruct(gx.shape, gx.dtype), aliases={0: 0})(
        gx, dxa, a_cat, seed, C.rows_operand(m))


# g, u (M, I): base GEMMs in; out g + s_g xa_g B_g^T and u + s_u xa_u B_u^T (each when it has an
# adapter; rounded to x's dtype: backward recomputes act from them) and h = act(g) * u
def _lora_glu_fwd_kernel(g_ref, u_ref, xa_ref, bg_ref, bu_ref, m_ref, go_ref, uo_ref, h_ref, *, r_g, r_u, scale_g,
                         scale_u, gelu):
    m, n = C.read_rows(m_ref), g_ref.shape[1]
    dt = h_ref.dtype
    acc = C.acc_dtype(dt)
    _, _, rs, cs, rmask, cmask = _tile(pl.program_id(0), pl.program_id(1), m, n)
    mask = rmask[:, None] & cmask[None, :]
    g = C.load(g_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    u = C.load(u_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    if r_g:
        g = g + scale_g * lowrank(xa_ref, bg_ref, rs, cs, rmask, cmask, 0, 0, r_g, dt, acc, q_rows=False)
    if r_u:  # up's columns of xa follow gate's
        u = u + scale_u * lowrank(xa_ref, bu_ref, rs, cs, rmask, cmask, r_g, 0, r_u, dt, acc, q_rows=False)
    g, u = _round(g, dt, acc), _round(u, dt, acc)
    a, _ = _glu_act(g, "geglu" if gelu else "swiglu")
    C.store(go_ref.at[rs, cs], g.astype(dt), mask=mask)
    C.store(uo_ref.at[rs, cs], u.astype(dt), mask=mask)
    C.store(h_ref.at[rs, cs], (_round(a, dt, acc) * u).astype(dt), mask=mask)


def lora_glu_fwd(g, u, xa, b_gate, b_up, *, scales, gelu):
    """(g, u, h) with the gate and up adapters' terms added (b_* None: no adapter)."""
    m, inter = g.shape
    r_g = 0 if b_gate is None else b_gate.shape[1]
    r_u = 0 if b_up is None else b_up.shape[1]
    kern = functools.partial(_lora_glu_fwd_kernel, r_g=r_g, r_u=r_u, scale_g=float(scales[0]),
                             scale_u=float(scales[1]), gelu=gelu)
    sds = jax.ShapeDtypeStruct((m, inter), g.dtype)
    filler = jnp.zeros((1, 1), g.dtype)  # (an operand no load reads)
    return _launch(kern, name="lora_glu_fwd", grid=(C.row_programs(C.cdiv(m, BLOCK_M)), C.cdiv(inter, BLOCK_N)),
                   out_shape=(sds, sds, sds), aliases={0: 0, 1: 1})(
        g, u, filler if xa is None else xa, filler if b_gate is None else b_gate, filler if b_up is None else b_up,
        C.rows_operand(m))


# dh = dh_base + drop(dha @ A_down) (when down has an adapter: A_down (r, I); drop its dropout);
# h = act(g) * u  =>  dg = dh * u * act'(g),  du = dh * act(g); h recomputed over dh_base
def _lora_glu_bwd_kernel(dh_ref, g_ref, u_ref, dha_ref, ad_ref, seed_ref, m_ref, dg_ref, du_ref, h_ref, *, r, gelu,
                         drop):
    m, n = C.read_rows(m_ref), g_ref.shape[1]
    dt = g_ref.dtype
    acc = C.acc_dtype(dt)
    rows, cols, rs, cs, rmask, cmask = _tile(pl.program_id(0), pl.program_id(1), m, n)
    mask = rmask[:, None] & cmask[None, :]
    dh = C.load(dh_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    if r:
        lo = lowrank(dha_ref, ad_ref, rs, cs, rmask, cmask, 0, 0, r, dt, acc, q_rows=True)
        if drop is not None:  # the adapter saw drop(h): its gradient reaches h only where kept
            salt, thr, scale = drop
            k_row, k_col = _stream(seed_ref, salt)
            lo = lo * _drop_factor(_index_keys(rows, k_row), _index_keys(cols, k_col), thr, scale, acc)
        dh = dh + lo
    g = C.load(g_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    u = C.load(u_ref.at[rs, cs], mask=mask, other=0.0).astype(acc)
    a, da = _glu_act(g, "geglu" if gelu else "swiglu")
    C.store(dg_ref.at[rs, cs], (dh * u * da).astype(dt), mask=mask)
    C.store(du_ref.at[rs, cs], (dh * a).astype(dt), mask=mask)
    C.store(h_ref.at[rs, cs], (_round(a, dt, acc) * u).astype(dt), mask=mask)


def lora_glu_bwd(dh, g, u, dha, a_down, seed, *, gelu, drop):
    """(dg, du, h); ``drop``: (salt word, threshold, scale) of the down adapter's dropout, or None."""
    m, inter = g.shape
    r = 0 if a_down is None else a_down.shape[0]
    kern = functools.partial(_lora_glu_bwd_kernel, r=r, gelu=gelu, drop=drop)
    sds = jax.ShapeDtypeStruct((m, inter), g.dtype)
    filler = jnp.zeros((1, 1), g.dtype)
    return _launch(kern, name="lora_glu_bwd", grid=(C.row_programs(C.cdiv(m, BLOCK_M)), C.cdiv(inter, BLOCK_N)),
                   out_shape=(sds, sds, sds), aliases={0: 2})(
        dh, g, u, filler if dha is None else dha, filler if a_down is None else a_down,
        _seed(seed, drop is not None), C.rows_operand(m))
