"""The MoE expert block's Pallas pieces on torch tensors (``forge_pallas.experts``), in the
contract of forge/spec/experts.py; ``experts_pieces()`` hands them to the op layer's autograd
node (forge/ops/experts.py), which checks the arguments (the spec's ``check``) before any runs.

Each piece is a kernel without autograd of its own (``diff=()``, no backward: the node strings
the backward pieces together), launched natively on torch's stream where a plan serves it, like
every bridged kernel. A call with no rows to compute returns empty (or zero) tensors in torch:
there is nothing to launch.
"""
from __future__ import annotations

import torch

from forge.spec import experts as X
from forge_pallas import experts as _k

from . import core, runtime

GLU_FWD = core.KernelDef("experts_glu_fwd", _k.glu_fwd, None, diff=())
GROUPED_MM = core.KernelDef("experts_grouped_mm", _k.grouped_mm, None, diff=())
GROUPED_MM_T = core.KernelDef("experts_grouped_mm_t", _k.grouped_mm_t, None, diff=())
GLU_BWD = core.KernelDef("experts_glu_bwd", _k.glu_bwd, None, diff=())
WGRAD = core.KernelDef("experts_grouped_wgrad", _k.grouped_wgrad, None, diff=())
# (the un-permutes unroll their loop over a token's top-k slots: slot_rows' width is read as an int)
UNPERMUTE = core.KernelDef("experts_unpermute", _k.unpermute, None, diff=(), static_dims=((1, 1),))
UNPERMUTE_BWD = core.KernelDef("experts_unpermute_bwd", _k.unpermute_bwd, None, diff=(), static_dims=((2, 1),))
ROUTE = core.KernelDef("experts_route", _k.route, None, diff=())
TOP_K = core.KernelDef("experts_top_k", _k.top_k, None, diff=())


def _one(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _low(low):
    """(tensors, static keywords) of a low-rank term ``low`` = None or (a2, w2, scale)."""
    return ((), {}) if low is None else ((low[0].contiguous(), low[1]), {"scale": float(low[2])})


def glu_fwd(x, row_token, offsets, gate_up_proj, act, low=None):
    s, two_i = row_token.shape[0], gate_up_proj.shape[1]
    if s == 0:
        return x.new_empty(0, two_i // 2), x.new_empty(0, two_i)
    extra, kw = _low(low)
    return tuple(core.apply(GLU_FWD, x, row_token, offsets, gate_up_proj, *extra, act=act, **kw))


def grouped_mm(a, w, offsets, low=None):
    if a.shape[0] == 0:
        return a.new_empty(0, w.shape[1])
    extra, kw = _low(low)
    return _one(core.apply(GROUPED_MM, a, w, offsets, *extra, **kw))


def grouped_mm_t(a, w, offsets, low=None):
    if a.shape[0] == 0:
        return a.new_empty(0, w.shape[2])
    extra, kw = _low(low)
    return _one(core.apply(GROUPED_MM_T, a, w, offsets, *extra, **kw))


def glu_bwd(dy, gu, offsets, down_proj, act, low=None):
    if dy.shape[0] == 0:
        return gu.new_empty(gu.shape), gu.new_empty(0, gu.shape[1] // 2)
    extra, kw = _low(low)
    return tuple(core.apply(GLU_BWD, dy, gu, offsets, down_proj, *extra, act=act, **kw))


def grouped_wgrad(a, b, offsets, b_rows):
    if a.shape[0] == 0:
        return a.new_zeros(offsets.shape[0], a.shape[1], b.shape[1])
    rows = () if b_rows is None else (b_rows,)
    return _one(core.apply(WGRAD, a, b, offsets, *rows))


def unpermute(y, slot_rows, weights):
    if slot_rows.numel() == 0:
        return y.new_zeros(slot_rows.shape[0], y.shape[1])
    return _one(core.apply(UNPERMUTE, y, slot_rows, *(() if weights is None else (weights,))))


def unpermute_bwd(dout, y, slot_rows, weights):
    if slot_rows.numel() == 0:
        return dout.new_empty(y.shape), weights.new_zeros(weights.shape)
    return tuple(core.apply(UNPERMUTE_BWD, dout, y, slot_rows, weights))


def route(top_k_index, n_experts):
    """forge.spec.experts.route in one Pallas launch, for at most its ROUTE_ROWS routed rows (the
    op layer routes more in torch)."""
    t, k = top_k_index.shape
    ids = top_k_index.reshape(t * k)
    if ids.dtype == torch.int64:  # (narrowed to int32 on the way to JAX: no id past int32 may wrap into range)
        ids = ids.clamp(-1, n_experts)
    row_token, offsets, slot_rows = core.apply(ROUTE, ids, n_exp=n_experts, top_k=k,
                                               blocks=X.route_blocks(t * k, n_experts))
    return row_token, offsets, slot_rows.view(t, k)


def top_k(logits, k, renorm, dtype=torch.float32):
    """forge.spec.experts.top_k in one Pallas launch, for at most its TOP_K_EXPERTS experts (the op
    layer takes torch's past that); the indices come back as int32, widened to torch's int64."""
    t, e = logits.shape
    if t == 0:
        return logits.new_empty(0, k, dtype=dtype), logits.new_empty(0, k, dtype=torch.int64)
    blocks = X.top_k_blocks(t, e, k)
    scores, index = core.apply(TOP_K, logits.contiguous(), top_k=k, renorm=bool(renorm), blocks=blocks,
                               warps=X.top_k_warps(*blocks[:2]), dtype=str(dtype).removeprefix("torch."))
    return scores, index.long()


def experts_pieces() -> dict:
    """The pieces forge.ops.experts builds the expert block's node from."""
    return {"glu_fwd": glu_fwd, "grouped_mm": grouped_mm, "unpermute": unpermute,
            "unpermute_bwd": unpermute_bwd, "glu_bwd": glu_bwd, "grouped_mm_t": grouped_mm_t,
            "grouped_wgrad": grouped_wgrad, "route": route, "top_k": top_k,
            "device_type": "cpu" if runtime.interpret() else "cuda"}
