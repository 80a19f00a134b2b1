"""The MoE expert block as one autograd node (spec and the pieces' contract:
forge/spec/experts.py), shared by every backend.

The routing is on the device (``forge.spec.experts.route`` in torch, or the backend's ``route``
piece, the same result in fewer launches: no host sync); the backend supplies the grouped pieces
as a dict (its ``experts_pieces()``), made into :class:`ExpertsOps`:

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
    route: Callable = spec.route  # a backend's own takes up to spec.ROUTE_ROWS rows in one launch (same result)
    top_k: Callable = spec.top_k  # the router's choice; a backend's own in one launch (calls without grad)


def route(ops, top_k_index, n_experts):
    """(row_token, offsets, slot_rows): the backend's route piece for up to spec.ROUTE_ROWS routed
    rows (a decoding step), torch's route for more."""
    fn = ops.route if 0 < top_k_index.numel() <= spec.ROUTE_ROWS else spec.route
    return fn(top_k_index, n_experts)


_TOP_K_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def top_k(ops, logits, k: int, renorm: bool, dtype=torch.float32):
    """(scores (T, k) in ``dtype``, index (T, k) int64): a router's top-k of softmax(logits)
    (forge.spec.experts.top_k), by the backend's piece for up to spec.TOP_K_ROWS tokens and
    spec.TOP_K_EXPERTS experts in 16 or 32 bits, by torch otherwise. Forward only: a call that
    wants gradients runs the router's own code (forge.patching.experts)."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"experts top_k: logits must be a 2-D float tensor (tokens, experts), "
                         f"got {tuple(logits.shape)} {logits.dtype}")
    if not isinstance(k, int) or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"experts top_k: k={k!r} must be an int in [1, {logits.shape[1]}] (the experts)")
    t, e = logits.shape
    piece = (logits.dtype in _TOP_K_DTYPES and dtype in _TOP_K_DTYPES and 0 < t <= spec.TOP_K_ROWS
             and e <= spec.TOP_K_EXPERTS)
    return (ops.top_k if piece else spec.top_k)(logits, k, bool(renorm), dtype)


def _forward(ops, x, top_k_index, top_k_weights, gate_up_proj, down_proj, act):
    row_token, offsets, slot_rows = route(ops, top_k_index, gate_up_proj.shape[0])
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


# ------------------------------------------------- low-rank adapters on the expert weights
# LoRA on the 3-D weights (peft's target_parameters): W_e + s B_e A_e per expert, never formed.
# ``adapters`` = (gate_up, down), each None or (a (E, r, in), b (E, out, r), scale). The rank-r
# down-projection (x A_e^T, or dY B_e for a gradient) is a grouped product of its own, (S, r);
# its up-projection joins the weight's own product as a second operand pair (``low=`` of the
# pieces): the same accumulator, so the fused epilogues (the GLU, its backward) see W_e x + s B_e
# A_e x whole, and no (S, out) tensor is made for the adapter's term. The adapters' weight
# gradients are rank-r grouped products; no (E, out, in) tensor is made for them.
def _forward_lora(ops, x, top_k_index, top_k_weights, gate_up_proj, down_proj, act, adapters):
    ad_gu, ad_dn = adapters
    row_token, offsets, slot_rows = route(ops, top_k_index, gate_up_proj.shape[0])
    xa = ha = low = None
    if ad_gu is not None:
        a, b, scale = ad_gu
        xa = ops.grouped_mm(x.index_select(0, row_token), a, offsets)  # (S, r): x A_e^T
        low = (xa, b, scale)
    h, gu = ops.glu_fwd(x, row_token, offsets, gate_up_proj, act, low=low)
    low = None
    if ad_dn is not None:
        a, b, scale = ad_dn
        ha = ops.grouped_mm(h, a, offsets)  # (S, r)
        low = (ha, b, scale)
    y = ops.grouped_mm(h, down_proj, offsets, low=low)
    return ops.unpermute(y, slot_rows, top_k_weights), (row_token, offsets, slot_rows, gu, y, xa, ha)


def _backward_lora(ops, act, dout, saved, adapters, need):
    """Gradients of (x, scores, gate_up_proj, down_proj, a_gu, b_gu, a_dn, b_dn); ``need`` their
    flags (an adapter's pair only where it is given). An adapter's gradient is its rank-r
    product (in the block's dtype, the adapters' too: check_adapters) scaled in place, which
    computes in fp32 and rounds once, as an fp32 product and cast would."""
    x, weights, gate_up_proj, down_proj, row_token, offsets, slot_rows, gu, y, xa, ha = saved
    ad_gu, ad_dn = adapters
    out = [None] * 8
    dy, d_weights = ops.unpermute_bwd(dout.contiguous(), y, slot_rows, weights)
    out[1] = d_weights if need[1] else None
    low = None
    if ad_dn is not None:
        a, b, scale = ad_dn
        dyb = ops.grouped_mm_t(dy, b, offsets)  # (S, r): dY B_e
        low = (dyb, a, scale)
    dgu, h = ops.glu_bwd(dy, gu, offsets, down_proj, act, low=low)  # dh = dY W_e + s dY B_e A_e
    if ad_dn is not None:
        if need[6]:
            out[6] = ops.grouped_wgrad(dyb, h, offsets, None).mul_(scale)
        if need[7]:
            out[7] = ops.grouped_wgrad(dy, ha, offsets, None).mul_(scale)
    if need[3]:
        out[3] = ops.grouped_wgrad(dy, h, offsets, None)
    del h, dy
    if need[2]:
        out[2] = ops.grouped_wgrad(dgu, x, offsets, row_token)
    low = None
    if ad_gu is not None:
        a, b, scale = ad_gu
        dgb = ops.grouped_mm_t(dgu, b, offsets)  # (S, r)
        if need[4]:
            out[4] = ops.grouped_wgrad(dgb, x, offsets, row_token).mul_(scale)
        if need[5]:
            out[5] = ops.grouped_wgrad(dgu, xa, offsets, None).mul_(scale)
        low = (dgb, a, scale)
    if need[0]:
        out[0] = ops.unpermute(ops.grouped_mm_t(dgu, gate_up_proj, offsets, low=low), slot_rows, None)
    return out


def check_adapters(adapters, gate_up_proj, down_proj, dtype) -> None:
    """Each adapter (a (E, r, in), b (E, out, r), scale) fits its weight (E, out, in), in ``dtype``."""
    if not (isinstance(adapters, tuple) and len(adapters) == 2):
        raise TypeError("adapters must be (gate_up, down), each None or (a, b, scale)")
    for name, w, ad in (("gate_up_proj", gate_up_proj, adapters[0]), ("down_proj", down_proj, adapters[1])):
        if ad is None:
            continue
        a, b, _scale = ad
        e, out, inp = w.shape
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != e or b.shape[0] != e or a.shape[2] != inp \
                or b.shape[1] != out or b.shape[2] != a.shape[1]:
            raise ValueError(f"{name}'s adapter: a {tuple(a.shape)} and b {tuple(b.shape)} do not make a "
                             f"low-rank update of its weight {tuple(w.shape)} (a (E, r, in), b (E, out, r))")
        if a.dtype != dtype or b.dtype != dtype:
            raise TypeError(f"{name}'s adapter is {a.dtype}/{b.dtype}, the expert block computes in {dtype}")


def merged(gate_up_proj, down_proj, adapters):
    """The weights with their adapters added (W + scale b a), for the paths that take plain weights."""
    return tuple(w if ad is None else torch.baddbmm(w, ad[1], ad[0], alpha=ad[2])
                 for w, ad in zip((gate_up_proj, down_proj), adapters))


class ExpertsLoraFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, gate_up_proj, down_proj, a_gu, b_gu, a_dn, b_dn, ops, act,
                scales):
        adapters = _adapters(a_gu, b_gu, a_dn, b_dn, scales)
        with torch.autocast(ops.device_type, enabled=False):
            out, res = _forward_lora(ops, x, top_k_index, top_k_weights, gate_up_proj, down_proj, act, adapters)
        ctx.save_for_backward(x, top_k_weights, gate_up_proj, down_proj, *adapters_tensors(adapters), *res)
        ctx.ops, ctx.act, ctx.scales = ops, act, scales
        return out

    @staticmethod
    @no_double_backward("experts")
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        x, weights, gate_up_proj, down_proj, a_gu, b_gu, a_dn, b_dn = saved[:8]
        adapters = _adapters(a_gu, b_gu, a_dn, b_dn, ctx.scales)
        n = ctx.needs_input_grad
        need = (n[0], n[2], n[3], n[4], n[5], n[6], n[7], n[8])
        with torch.autocast(ctx.ops.device_type, enabled=False):
            g = _backward_lora(ctx.ops, ctx.act, dout, (x, weights, gate_up_proj, down_proj, *saved[8:]),
                               adapters, need)
        return g[0], None, g[1], g[2], g[3], g[4], g[5], g[6], g[7], None, None, None


def _adapters(a_gu, b_gu, a_dn, b_dn, scales):
    return (None if a_gu is None else (a_gu, b_gu, scales[0]),
            None if a_dn is None else (a_dn, b_dn, scales[1]))


def adapters_tensors(adapters):
    """(a_gu, b_gu, a_dn, b_dn), None where a weight has no adapter."""
    return tuple(t for ad in adapters for t in ((None, None) if ad is None else ad[:2]))


def apply_lora(ops, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, adapters, *, act="silu"):
    """The expert block with low-rank adapters on its weights (see above), (T, H)."""
    a_gu, b_gu, a_dn, b_dn = (None if t is None else t.contiguous() for t in adapters_tensors(adapters))
    scales = tuple(1.0 if ad is None else float(ad[2]) for ad in adapters)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (
            hidden, top_k_weights, gate_up_proj, down_proj, a_gu, b_gu, a_dn, b_dn)):
        return ExpertsLoraFunction.apply(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                         a_gu, b_gu, a_dn, b_dn, ops, act, scales)
    with torch.autocast(ops.device_type, enabled=False):
        return _forward_lora(ops, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act,
                             _adapters(a_gu, b_gu, a_dn, b_dn, scales))[0]


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
