"""RoPE in Triton: q and k rotated in one launch (spec: forge/spec/rope.py).

One program per (batch, position): it loads the cos/sin row once and rotates every q head and
every k head at that position. Strides are honoured, so HF's transposed (B, H, S, D) views need
no copy; outputs take the inputs' strides.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forge.spec import rope as spec
from forge.spec._check import no_double_backward

from . import _common, _launch, _ops
from ._common import cast


@triton.jit
def _rotate_heads(x_ptr, o_ptr, sxh, soh, H, c1, c2, s1, s2, HALF,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr, ACC: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < H) & (cols < HALF)
    x1 = tl.load(x_ptr + heads * sxh + cols, mask=mask, other=0.0).to(ACC)  # (H, D/2)
    x2 = tl.load(x_ptr + heads * sxh + HALF + cols, mask=mask, other=0.0).to(ACC)
    if BACKWARD:
        # dx = g * cos + R^T(g * sin), R^T(v) = [v2, -v1]
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        # y = x * cos + R(x) * sin, R(x) = [-x2, x1]
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    dt = o_ptr.dtype.element_ty
    tl.store(o_ptr + heads * soh + cols, cast(o1, dt), mask=mask)
    tl.store(o_ptr + heads * soh + HALF + cols, cast(o2, dt), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
    sqb, sqh, sqs, skb, skh, sks, sqob, sqoh, sqos, skob, skoh, skos, scb, scs,
    S, HQ, HK, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
    ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // S).to(tl.int64)
    s = (pid % S).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    cmask = cols < HALF
    cbase = b * scb + s * scs
    c1 = tl.load(cos_ptr + cbase + cols, mask=cmask, other=0.0).to(ACC)  # (1, D/2)
    c2 = tl.load(cos_ptr + cbase + HALF + cols, mask=cmask, other=0.0).to(ACC)
    s1 = tl.load(sin_ptr + cbase + cols, mask=cmask, other=0.0).to(ACC)
    s2 = tl.load(sin_ptr + cbase + HALF + cols, mask=cmask, other=0.0).to(ACC)
    _rotate_heads(q_ptr + b * sqb + s * sqs, qo_ptr + b * sqob + s * sqos, sqh, sqoh, HQ,
                  c1, c2, s1, s2, HALF, BLOCK_HQ, BLOCK_D, BACKWARD, ACC)
    _rotate_heads(k_ptr + b * skb + s * sks, ko_ptr + b * skob + s * skos, skh, skoh, HK,
                  c1, c2, s1, s2, HALF, BLOCK_HK, BLOCK_D, BACKWARD, ACC)


WARPS = None  # None: by tile size; bench/diagnostics/tune_triton.py sweeps it

_kernel = _launch.FastKernel(_rope_kernel)
_CFG = _common.BoundedCache()  # (hq, hk, d) -> launch configuration


def _cfg(hq, hk, d):
    hq, hk, d = int(hq), int(hk), int(d)  # (symbolic while torch.compile traces: the blocks fix them)
    cfg = _CFG.get((hq, hk, d))
    if cfg is None:
        cfg = _CFG[(hq, hk, d)] = (d // 2, _common.next_pow2(d // 2), _common.next_pow2(hq), _common.next_pow2(hk))
    return cfg


def _unit(t):
    """(t with unit stride in its last dimension, its strides)."""
    st = t.stride()
    if st[-1] != 1:
        t = t.contiguous()
        st = t.stride()
    return t, st


def _out_like(t, dtype):
    # empty_like keeps a dense permuted layout (HF's transposed views); anything else is compact
    out = _common.empty_like(t, dtype=dtype)
    return out if out.stride(-1) == 1 else _common.empty(t.shape, dtype, t.device)


def rope_apply(q, k, cos, sin, backward: bool, out_dtype=None):
    """Rotate q (B,HQ,S,D) and k (B,HK,S,D); backward=True applies the transpose rotation.
    ``out_dtype``: the outputs' dtype; by default torch's promotion of q's and cos's (``q * cos``
    in the reference: bf16 q with fp32 cos, as HF hands them under autocast over an fp32 model,
    gives fp32), computed in that dtype's accumulator."""
    q, sq = _unit(q)
    k, sk = _unit(k)
    cos, sc = _unit(cos)
    sin, ss = _unit(sin)
    if sc != ss:
        cos, sin = cos.contiguous(), sin.contiguous()
        sc = cos.stride()
    if out_dtype is None:  # (the common case, one dtype, without a promotion call)
        out_dtype = q.dtype if cos.dtype is q.dtype else torch.promote_types(q.dtype, cos.dtype)
    wide = out_dtype if out_dtype is q.dtype else torch.promote_types(q.dtype, out_dtype)
    qo, ko = _out_like(q, out_dtype), _out_like(k, out_dtype)
    b, hq, s, d = q.shape
    hk = k.shape[1]
    if not (b * s and (hq or hk) and d):
        return qo, ko
    sqo, sko = qo.stride(), ko.stride()
    half, block_d, block_hq, block_hk = _cfg(hq, hk, d)
    warps = WARPS or (4 if (block_hq + block_hk) * block_d <= 4096 else 8)
    _kernel[(b * s,)](
        q, k, qo, ko, cos, sin,
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sqo[0], sqo[1], sqo[2], sko[0], sko[1], sko[2],
        0 if cos.shape[0] == 1 else sc[0], sc[1], s, hq, hk, half,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, BACKWARD=backward,
        ACC=_common.acc(wide), num_warps=warps,
    )
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.in_dtype = q.dtype
        return rope_apply(q, k, cos, sin, backward=False)

    @staticmethod
    @no_double_backward("rope")
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = rope_apply(dq, dk, cos, sin, backward=True, out_dtype=ctx.in_dtype)
        return dq_in, dk_in, None, None


def _op_fwd(q, k, cos, sin):
    return rope_apply(q, k, cos, sin, backward=False), ()


def _op_bwd(inputs, res, grads, needs):
    _q, _k, cos, sin = inputs  # (q is not saved: autograd casts the gradients to q's dtype)
    dq, dk = rope_apply(grads[0], grads[1], cos, sin, backward=True)
    return {"q": dq, "k": dk}


ROPE = _ops.register(_ops.KernelDef("rope", _op_fwd, _op_bwd, names=("q", "k", "cos", "sin"), diff=("q", "k"),
                                    n_out=2, save=("cos", "sin"), inductor=True))


def _rope_op(q, k, cos, sin):
    return _ops.call(ROPE, q, k, cos, sin)


def rope(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Triton RoPE with the signature of ``forge.spec.rope.reference``; returns (q_out, k_out)."""
    compiling = _ops._compiling()
    if compiling or not _hot(q, k, cos, sin, unsqueeze_dim):
        spec.check(q, k, cos, sin, unsqueeze_dim)
        _common.check_device(q=q, k=k, cos=cos, sin=sin)
    if compiling:
        fn = _rope_op
    else:
        fn = RoPEFunction.apply if _common.needs_autograd(q, k, cos, sin) else _rope_bare
    if unsqueeze_dim == 2:  # (B, S, H, D): rotate the (B, H, S, D) view, hand back the same layout
        qo, ko = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return qo.transpose(1, 2), ko.transpose(1, 2)
    return fn(q, k, cos, sin)


def _hot(q, k, cos, sin, unsqueeze_dim) -> bool:
    """What spec.check accepts, in the layout HF passes (unsqueeze_dim 1, cos (B|1, S, D))."""
    if (unsqueeze_dim != 1 or not _common.hot_tensors(q, k, cos, sin) or q.dtype is not k.dtype
            or cos.dtype is not sin.dtype):
        return False
    if spec.tables_need_grad(cos, sin):  # the spec's check refuses it
        return False
    qs, ks, cs = q.shape, k.shape, cos.shape
    return (len(qs) == 4 and len(ks) == 4 and len(cs) == 3 and cs == sin.shape
            and ks[0] == qs[0] and ks[2] == qs[2] and ks[3] == qs[3] and not qs[3] & 1
            and cs[1] == qs[2] and cs[2] == qs[3] and cs[0] in (1, qs[0])
            and q.get_device() == k.get_device() == cos.get_device() == sin.get_device())


def _rope_bare(q, k, cos, sin):
    return rope_apply(q, k, cos, sin, backward=False)
