"""The gated MLP as one autograd node (spec: forge/spec/gated_mlp.py), shared by every backend.

The matrix products are torch's (cuBLAS, as eager's); the backend supplies the activation's two
kernels (its ``mlp_act(act)`` pieces, made into :class:`ActOps` by the registry):

  ``act(g, u) -> h``                      the forward (h = act(g) * u), no autograd
  ``act_bwd(dh, g, u) -> (dg, du, h)``    the backward, recomputing h for d_w_down

The node keeps x, g and u (not h: one rows x I activation less per layer than eager autograd,
which keeps h as the down projection's input) and is one autograd node where eager has four
(three linears and the activation): less host time per layer in forward and backward. With
``recompute`` it keeps x alone and makes g and u again in backward (x @ w_gate^T, x @ w_up^T).

A backend whose ``act_bwd`` writes its results over g, u and dh (``inplace=True``, Triton: the
saved activations are dead after this backward, so the step allocates nothing rows x I but dh)
bumps the saved tensors' version counters, so a second backward through the same graph
(``retain_graph=True``) raises torch's usual "modified by an inplace operation" error instead of
reading overwritten activations.

Under torch.compile the node is one op pair, ``torch.ops.forge.<backend>_gated_mlp_fwd`` /
``_bwd`` (registered through forge.ops.library by :class:`NodeAdaptor`): the same products and
pieces, the backward step into fresh tensors (an op may not write over its inputs), the fakes
from the shapes. Imports torch, forge.spec and its sibling _adaptor only (never a backend).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from ..spec._check import no_double_backward
from ._adaptor import NodeAdaptorBase


@dataclasses.dataclass(frozen=True)
class ActOps:
    act: Callable
    act_bwd: Callable
    inplace: bool
    device_type: str  # autocast is turned off inside the node for this device type
    act_bwd_fresh: Callable | None = None  # act_bwd into fresh tensors (inplace backends)


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: torch.is_autocast_enabled())
_NULL = contextlib.nullcontext()


def _no_autocast(ops):
    """Autocast off inside the node (the products run in the inputs' dtype), entered only when
    autocast is on: the context manager costs microseconds of host time per call."""
    return torch.autocast(ops.device_type, enabled=False) if _any_autocast() else _NULL


class GatedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, ops, recompute):
        with _no_autocast(ops):
            g = F.linear(x, w_gate)  # (..., I); F.linear: one dispatcher call per product
            u = F.linear(x, w_up)
            y = F.linear(ops.act(g, u), w_down)  # h dies here
        if recompute:  # keep x only: g and u are products of x, made again in backward
            ctx.save_for_backward(x, w_gate, w_up, w_down)
        else:
            ctx.save_for_backward(x, g, u, w_gate, w_up, w_down)
        ctx.ops, ctx.recompute = ops, recompute
        return y

    @staticmethod
    @no_double_backward("gated MLP")
    def backward(ctx, dy):
        ops, need = ctx.ops, ctx.needs_input_grad
        if getattr(ctx, "spent", False):
            raise RuntimeError(
                "forge's gated MLP backward can run only once per forward with this backend: it overwrites its "
                "saved activations with their gradients (the memory of two rows x I activations). A second "
                "backward(retain_graph=True) needs the forward run again (or backend='pallas' for the MLP, or "
                "forge.patch(recompute_mlp=True))")
        if ctx.recompute:
            x, w_gate, w_up, w_down = ctx.saved_tensors
        else:
            x, g, u, w_gate, w_up, w_down = ctx.saved_tensors
        with _no_autocast(ops):
            dy2 = dy.reshape(-1, dy.shape[-1])
            dh = torch.mm(dy2, w_down)  # (M, I)
            if ctx.recompute:
                x2 = x.reshape(-1, x.shape[-1])
                g, u = torch.mm(x2, w_gate.t()), torch.mm(x2, w_up.t())
            dg, du, h = ops.act_bwd(dh, g.view(dh.shape), u.view(dh.shape))
            if ops.inplace and not ctx.recompute:
                torch.autograd.graph.increment_version((g, u))
                ctx.spent = True
            d_down = torch.mm(dy2.t(), h) if need[3] else None
            del h
            x2 = x.reshape(-1, x.shape[-1])
            d_gate = torch.mm(dg.t(), x2) if need[1] else None
            d_up = torch.mm(du.t(), x2) if need[2] else None
            dx = None
            if need[0]:
                dx = torch.mm(dg, w_gate)
                dx.addmm_(du, w_up)
                dx = dx.view(x.shape)
        return dx, d_gate, d_up, d_down, None, None


def apply(ops: ActOps, x, w_gate, w_up, w_down, recompute=False):
    """y of the gated MLP; without grad mode or anything requiring grad, no node is built.
    ``recompute``: the node keeps x only and makes g and u again in backward (two rows x I
    activations less per layer, for two more matrix products)."""
    if torch.is_grad_enabled() and (x.requires_grad or w_gate.requires_grad or w_up.requires_grad
                                    or w_down.requires_grad):
        return GatedMLPFunction.apply(x, w_gate, w_up, w_down, ops, recompute)
    with _no_autocast(ops):
        return F.linear(ops.act(F.linear(x, w_gate), F.linear(x, w_up)), w_down)


# ------------------------------------------------------------------------- the op pair
class _Def:
    name = "gated_mlp"
    names = ("x", "w_gate", "w_up", "w_down")


DEF = _Def()


class NodeAdaptor(NodeAdaptorBase):
    """The gated MLP of one backend as forge.ops.library ops (see forge.ops.library for the
    adaptor's functions). ``ops_for(act) -> ActOps``: the backend's pieces."""

    DEF = DEF

    def __init__(self, ops_for):
        self.ops_for = ops_for

    def input_names(self, kdef, n):
        return kdef.names

    def diff_names(self, kdef, n):
        return kdef.names

    def saved_present(self, kdef, present):
        return tuple(present)

    def run_fwd(self, kdef, tensors, static):
        x, w_gate, w_up, w_down = tensors
        ops = self.ops_for(static["act"])
        with _no_autocast(ops):
            g, u = F.linear(x, w_gate), F.linear(x, w_up)
            y = F.linear(ops.act(g, u), w_down)
        return (y,), (() if static["recompute"] else (g, u))

    def fake_fwd(self, kdef, tensors, static):
        x, w_gate, _w_up, w_down = tensors
        lead = tuple(x.shape[:-1])
        y = x.new_empty(lead + (w_down.shape[0],))
        if static["recompute"]:
            return (y,), ()
        return (y,), (x.new_empty(lead + (w_gate.shape[0],)), x.new_empty(lead + (w_gate.shape[0],)))

    def run_bwd(self, kdef, inputs, res, grads, needs, static, dtypes):
        x, w_gate, w_up, w_down = inputs
        ops = self.ops_for(static["act"])
        (dy,) = grads
        with _no_autocast(ops):
            dy2 = dy.reshape(-1, dy.shape[-1])
            dh = torch.mm(dy2, w_down)  # (M, I)
            x2 = x.reshape(-1, x.shape[-1])
            if static["recompute"]:
                g, u = torch.mm(x2, w_gate.t()), torch.mm(x2, w_up.t())
                dg, du, h = ops.act_bwd(dh, g, u)  # g and u are this call's own
            else:
                g, u = res
                dg, du, h = (ops.act_bwd_fresh or ops.act_bwd)(dh, g.reshape(dh.shape), u.reshape(dh.shape))
            out = {}
            if needs["w_down"]:
                out["w_down"] = torch.mm(dy2.t(), h)
            if needs["w_gate"]:
                out["w_gate"] = torch.mm(dg.t(), x2)
            if needs["w_up"]:
                out["w_up"] = torch.mm(du.t(), x2)
            if needs["x"]:
                dx = torch.mm(dg, w_gate)
                dx.addmm_(du, w_up)
                out["x"] = dx.view(x.shape)
        return out

    def fake_bwd(self, kdef, inputs, res, grads, needs, static, dtypes):
        return {n: torch.empty_like(t) for n, t in zip(kdef.names, inputs) if needs[n]}


def traced_apply(adaptor: NodeAdaptor, x, w_gate, w_up, w_down, act, recompute):
    """The node under torch.compile: its forward op (autograd registered)."""
    return adaptor.traced(DEF, (x, w_gate, w_up, w_down), {"act": act, "recompute": bool(recompute)})[0]
