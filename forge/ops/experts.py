"""The MoE expert block as one autograd node (spec and the pieces' contract:
forge/spec/experts.py), shared by every backend.

The routing is torch on the device (``forge.spec.experts.route``: no host sync); the backend
supplies the grouped pieces as a dict (its ``experts_pieces()``), made into :class:`ExpertsOps`:

  ``glu_fwd(x, row_token, offsets, gate_up_proj, act) -> (h, gu)``
  ``grouped_mm(a, w, offsets) -> a[s] @ w[e].T``       ``grouped_mm_t(a, w, offsets) -> a[s] @ w[e]``
  ``unpermute(y, slot_rows, weights | None) -> out``   ``unpermute_bwd(dout, y, slot_rows, weights)
  -> (dy, d_weights)``   ``glu_bwd(dy, gu, offsets, down_proj, act) -> (dgu, h)``
  ``grouped_wgrad(a, b, offsets, b_rows | None) -> dW``

The node keeps the routing, gu (S x 2I) and y (S x H, the down product per routed row, for the
score gradient) and x; h is recomputed in the down product's backward epilogue. It is eager
only: no torch.library op pair yet, so torch.compile sees it as opaque Python (a graph break).
Imports torch and forge.spec only (never a backend).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..spec import experts as spec
from . import autocast as _autocast
from ..spec._check import no_double_backward


@dataclasses.dataclass(frozen=True)
class ExpertsOps:
    glu_fwd: Callable
    grouped_mm: Callable
    unpermute: Callable
    unpermute_bwd: Callable
    glu_bwd: Callable
    grouped_mm_t: Callable
    grouped_wgrad: Callable
    device_type: str  # autocast is turned off inside the node for this device type


def _forward(ops, x, top_k_index, top_k_weights, gate_up_proj, down_proj, act):
    row_token, offsets, slot_rows = spec.route(top_k_index, gate_up_proj.shape[0])
    h, gu = ops.glu_fwd(x, row_token, offsets, gate_up_proj, act)
    y = ops.grouped_mm(h, down_proj, offsets)  # (S, H)
    return ops.unpermute(y, slot_rows, top_k_weights), (row_token, offsets, slot_rows, gu, y)


class ExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, gate_up_proj, down_proj, ops, act):
        with torch.autocast(ops.device_type, enabled=False):
            out, (row_token, offsets, slot_rows, gu, y) = _forward(
                ops, x, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
        ctx.save_for_backward(x, top_k_weights, gate_up_proj, down_proj, row_token, offsets, slot_rows, gu, y)
        ctx.ops, ctx.act = ops, act
        return out

    @staticmethod
    @no_double_backward("experts")
    def backward(ctx, dout):
        x, weights, gate_up_proj, down_proj, row_token, offsets, slot_rows, gu, y = ctx.saved_tensors
        ops, need = ctx.ops, ctx.needs_input_grad
        dx = d_weights = d_gate_up = d_down = None
        with torch.autocast(ops.device_type, enabled=False):
            dout = dout.contiguous()
            dy, d_weights = ops.unpermute_bwd(dout, y, slot_rows, weights)
            del y
            dgu, h = ops.glu_bwd(dy, gu, offsets, down_proj, ctx.act)
            if need[4]:
                d_down = ops.grouped_wgrad(dy, h, offsets, None)
            del h, dy
            if need[3]:
                d_gate_up = ops.grouped_wgrad(dgu, x, offsets, row_token)
            if need[0]:
                dx = ops.unpermute(ops.grouped_mm_t(dgu, gate_up_proj, offsets), slot_rows, None)
        return dx, None, d_weights if need[2] else None, d_gate_up, d_down, None, None


def apply(ops: ExpertsOps, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *, act="silu"):
    """The expert block's output (T, H); without grad mode or anything requiring grad, no node."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, top_k_weights, gate_up_proj, down_proj)):
        return ExpertsFunction.apply(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, ops, act)
    with torch.autocast(ops.device_type, enabled=False):
        return _forward(ops, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act)[0]


def build(pieces: dict, check_devices=None):
    """The spec-signature function ``experts(hidden, top_k_index, top_k_weights, gate_up_proj,
    down_proj, *, act="silu")`` of one backend from its pieces; checks each call's arguments."""
    ops = ExpertsOps(**pieces)

    def experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *, act="silu"):
        cast = _autocast.target(hidden.device.type, hidden, gate_up_proj, down_proj) \
            if isinstance(hidden, torch.Tensor) else None
        if cast is not None:
            # eager's expert products run in the autocast dtype (an fp32 model under the Trainer's
            # bf16=True): so do the node's, on differentiably cast inputs; the scores stay as the
            # router gave them and the output comes back in hidden's dtype, as eager's sum is
            out_dtype = hidden.dtype
            hidden, gate_up_proj, down_proj = (_autocast.cast(t, cast) for t in (hidden, gate_up_proj, down_proj))
            with _autocast.off(hidden.device.type):
                return experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act=act).to(out_dtype)
        spec.check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
        if check_devices is not None:
            check_devices(hidden=hidden, gate_up_proj=gate_up_proj, down_proj=down_proj)
        return apply(ops, hidden.contiguous(), top_k_index, top_k_weights.contiguous(),
                     gate_up_proj, down_proj, act=act)

    experts.ops = ops
    return experts
