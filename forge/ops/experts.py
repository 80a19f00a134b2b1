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
score gradient) and x; h is recomputed in the down product's backward epilogue. Under
torch.compile the node is one op pair, ``torch.ops.forge.<backend>_experts_fwd`` / ``_bwd``
(forge.ops.library, :class:`NodeAdaptor`): the same pieces, the routing and activations as the
forward op's residuals. The functional API over both (argument checks, autocast, the route):
forge.ops._nodes.experts. Imports torch and forge.spec only (never a backend).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..spec import experts as spec
from ..spec._check import no_double_backward
from ._adaptor import NodeAdaptorBase


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


def _backward(ops, act, dout, saved, need):
    """(dx, d_weights, d_gate_up, d_down) from the node's saved tensors; ``need`` the four
    flags in that order (None where not needed)."""
    x, weights, gate_up_proj, down_proj, row_token, offsets, slot_rows, gu, y = saved
    dx = d_gate_up = d_down = None
    dout = dout.contiguous()
    dy, d_weights = ops.unpermute_bwd(dout, y, slot_rows, weights)
    del y
    dgu, h = ops.glu_bwd(dy, gu, offsets, down_proj, act)
    if need[3]:
        d_down = ops.grouped_wgrad(dy, h, offsets, None)
    del h, dy
    if need[2]:
        d_gate_up = ops.grouped_wgrad(dgu, x, offsets, row_token)
    if need[0]:
        dx = ops.unpermute(ops.grouped_mm_t(dgu, gate_up_proj, offsets), slot_rows, None)
    return dx, d_weights if need[1] else None, d_gate_up, d_down


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
        need = ctx.needs_input_grad
        with torch.autocast(ctx.ops.device_type, enabled=False):
            dx, d_weights, d_gate_up, d_down = _backward(ctx.ops, ctx.act, dout, ctx.saved_tensors,
                                                         (need[0], need[2], need[3], need[4]))
        return dx, None, d_weights, d_gate_up, d_down, None, None


# ------------------------------------------------------------------------- the op pair
class _Def:
    name = "experts"
    names = ("hidden", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")


DEF = _Def()
_DIFF = ("hidden", "top_k_weights", "gate_up_proj", "down_proj")


class NodeAdaptor(NodeAdaptorBase):
    """The expert block of one backend as forge.ops.library ops (``forge::<backend>_experts_fwd``
    / ``_bwd``): under torch.compile the block is one opaque op pair, its fakes from the shapes
    alone (the routing keeps every one of the T x K routed rows, so no size depends on data)."""

    DEF = DEF

    def __init__(self, ops: ExpertsOps):
        self.ops = ops

    def input_names(self, kdef, n):
        return DEF.names

    def diff_names(self, kdef, n):
        return _DIFF

    def saved_present(self, kdef, present):
        return tuple(present)

    def run_fwd(self, kdef, tensors, static):
        with torch.autocast(self.ops.device_type, enabled=False):
            out, res = _forward(self.ops, *tensors, static["act"])
        return (out,), res

    def fake_fwd(self, kdef, tensors, static):
        x, idx, _w, gate_up_proj, _down = tensors
        (t, k), s = idx.shape, idx.numel()
        i32 = dict(dtype=torch.int32, device=x.device)
        return (x.new_empty(t, x.shape[1]),), (torch.empty(s, **i32), torch.empty(gate_up_proj.shape[0], **i32),
                                               torch.empty(t, k, **i32), x.new_empty(s, gate_up_proj.shape[1]),
                                               x.new_empty(s, x.shape[1]))

    def run_bwd(self, kdef, inputs, res, grads, needs, static, dtypes):
        x, _idx, weights, gate_up_proj, down_proj = inputs
        with torch.autocast(self.ops.device_type, enabled=False):
            got = _backward(self.ops, static["act"], grads[0], (x, weights, gate_up_proj, down_proj, *res),
                            tuple(needs[n] for n in _DIFF))
        return {n: g for n, g in zip(_DIFF, got) if needs[n]}

    def fake_bwd(self, kdef, inputs, res, grads, needs, static, dtypes):
        return {n: torch.empty_like(t) for n, t in zip(DEF.names, inputs) if needs.get(n)}


def apply(ops: ExpertsOps, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *, act="silu"):
    """The expert block's output (T, H); without grad mode or anything requiring grad, no node."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (hidden, top_k_weights, gate_up_proj, down_proj)):
        return ExpertsFunction.apply(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, ops, act)
    with torch.autocast(ops.device_type, enabled=False):
        return _forward(ops, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act)[0]
