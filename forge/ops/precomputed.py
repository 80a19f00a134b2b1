"""Scalar losses whose gradients are computed in the forward: one autograd node for every
backend (today the fused linear cross-entropy, Triton and Pallas).

A fused loss that already walks the data to form the loss can form its gradients in the same
walk; the loss is a scalar, so the true gradients are those times the loss's cotangent c (a 0-dim
device tensor). The backend supplies ``compute(need_h, need_w, need_b) -> (loss, grad_h | None,
grad_W | None, grad_b | None)``; :func:`apply` runs it inside the Function (or bare, when
autograd wants nothing), keeps the gradients on ctx, and the backward multiplies them by c IN
PLACE: a new scaled copy would hold a second grad_W-sized buffer while the first is alive
(2x grad_W at the op's peak; grad_W is the largest thing it keeps: (V, H), 1 GB at llama3 8B).
The buffer autograd hands to AccumulateGrad is the forward's own (it becomes ``weight.grad``).

The gradients must be fresh buffers owned by nobody else: no input, no cached value (a backend
that produces them elsewhere, e.g. JAX through DLPack, hands over a buffer its runtime no
longer uses). Nothing reads a value back to the host, so the loss stays sync-free and
graph-capturable.

The backend hands its pieces over through the registry (forge.ops): ``prepare(...)`` (the
spec's checks, the device tensors the loss needs), ``compute(tensors, static, need_h, need_w,
need_b)`` and optionally a one-pass scaling kernel ``scale(g, c)`` (returns None where it does
not apply). Under torch.compile the node is one op, ``torch.ops.forge.<backend>_fused_linear_ce_fwd``
(:class:`NodeAdaptor`), whose registered backward is the scaling in plain torch ops: the
compiled backward holds it, and inductor writes it over the saved gradients' own buffers (an op
of its own could only scale copies, holding each gradient twice for a moment). Imports torch and
its sibling _adaptor only (never a backend).
"""
from __future__ import annotations

import torch

from ..spec._check import no_double_backward
from ._adaptor import NodeAdaptorBase

__all__ = ["apply", "scale_"]

# fp32 scratch of the low-precision path of ``scale_``: at most 1/16 of the gradient's elements
# per step (1/8 of a bf16 gradient's bytes), at least 2^20 (fewer, the launches dominate)
_CHUNK_FRACTION = 16
_CHUNK_MIN = 2**20


_WARM: set = set()  # (kernel, dtype) pairs the one-pass kernel was compiled for


def _prepare_scale(one_pass, *ts) -> None:
    """Compile the one-pass kernel for these gradients' dtypes now, on the forward's thread:
    the backward runs on autograd's device thread, where that should not happen first (a
    Pallas-backend process that had not imported Triton aborted there on the H200)."""
    for t in ts:
        if t is None or not t.is_cuda or (one_pass, t.dtype) in _WARM or t.element_size() >= 4:
            continue
        one_pass(torch.zeros(64, dtype=t.dtype, device=t.device), torch.ones((), device=t.device))
        _WARM.add((one_pass, t.dtype))


def scale_(g: torch.Tensor, c: torch.Tensor, one_pass=None) -> torch.Tensor:
    """g *= c in place, in c's precision with one rounding to g's dtype. No host sync.

    On CUDA, torch's own ``g.mul_(c)`` casts the 0-dim device tensor c to g's dtype first, so a
    bf16 g would be scaled by c rounded to bf16 (a systematic error of up to 2^-9 on every
    element), and no torch op scales a bf16 tensor by an fp32 device scalar in one pass. A
    narrower contiguous CUDA g therefore goes through ``one_pass`` (the registry passes the
    Triton backend's one small kernel, read + write g once, whichever backend produced g:
    triton ships with torch's CUDA builds). Without it, g
    goes through c's dtype a chunk at a time (bounded scratch, 5x the traffic: 4.5 ms against
    0.65 ms for a 128256 x 4096 bf16 grad_W on the H200)."""
    if g.element_size() >= c.element_size():  # c converts to g's dtype exactly
        return g.mul_(c)
    if one_pass is not None and g.is_contiguous():
        if one_pass(g, c) is not None:
            return g
    if not g.is_contiguous():
        return g.copy_(g.to(c.dtype) * c)  # not produced by forge's kernels; a full-size temp
    flat = g.view(-1)
    step = max(_CHUNK_MIN, -(-flat.numel() // _CHUNK_FRACTION))
    for piece in flat.split(step):
        piece.copy_(piece.to(c.dtype).mul_(c))
    return g


class PrecomputedGradLoss(torch.autograd.Function):
    """loss = compute(...)[0]; d(loss)/d(hidden, weight, bias) = the rest, times grad_output."""

    @staticmethod
    def forward(ctx, compute, scale, hidden, weight, bias):
        # apply() enters here only with grad mode on, so needs_input_grad is what autograd wants
        need_h, need_w, need_b = ctx.needs_input_grad[2:5]
        loss, gh, gw, gb = compute(need_h, need_w, need_b)
        ctx.grads = (gh if need_h else None, gw if need_w else None, gb if need_b else None)
        ctx.scale, ctx.h_dtype = scale, hidden.dtype
        return loss

    @staticmethod
    @no_double_backward("fused_linear_ce")
    def backward(ctx, grad_out):  # grad_out: () in the loss's dtype, on the device
        if ctx.grads is None:
            raise RuntimeError(
                "this loss computes its gradients in the forward and scales them in place in the "
                "backward, so its backward can run only once per forward (retain_graph=True does "
                "not help): run the forward again")
        gh, gw, gb = ctx.grads
        ctx.grads = None  # (also drops ctx's reference: autograd's is the only one left)
        if gh is not None:  # the (N, H) accumulator may be wider (fp32) than hidden
            gh = ctx.scale(gh, grad_out).to(ctx.h_dtype)
        if gw is not None:
            ctx.scale(gw, grad_out)
        if gb is not None:
            ctx.scale(gb, grad_out)
        return None, None, gh, gw, gb


class DeferredGradLoss(torch.autograd.Function):
    """float16 inputs: the loss alone in the forward, the gradients in the backward from
    ``rescaled(c)``, a ``compute`` whose rows are weighted by c / divisor, so the cotangent c is
    in dL/dz before it is rounded to fp16. Formed in the forward and scaled afterwards, dL/dz =
    p / divisor underflows fp16 (its smallest step is 6e-8) wherever the divisor is large: a
    loss scaler's factor (the Trainer's ``fp16=True``, torch's GradScaler) came too late, and
    lm_head's gradient was 95% zeros at 1e6 items. The price: the logits product runs once more
    (in the backward), as in eager."""

    @staticmethod
    def forward(ctx, compute, rescaled, hidden, weight, bias):
        ctx.rescaled, ctx.h_dtype = rescaled, hidden.dtype
        ctx.save_for_backward(hidden, weight, bias)  # (only to catch in-place changes before the backward)
        return compute(False, False, False)[0]

    @staticmethod
    @no_double_backward("fused_linear_ce")
    def backward(ctx, grad_out):
        ctx.saved_tensors  # noqa: B018  (raises if an input was modified in place since the forward)
        _, gh, gw, gb = ctx.rescaled(grad_out)(*ctx.needs_input_grad[2:5])
        return None, None, None if gh is None else gh.to(ctx.h_dtype), gw, gb


def apply(compute, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          *, one_pass=None, rescaled=None) -> torch.Tensor:
    """The loss from ``compute``, differentiable in hidden, weight and bias through the
    gradients ``compute`` returns. ``compute(need_h, need_w, need_b)`` gets which gradients
    autograd wants (all False without grad mode or trainable inputs: then only the loss is
    formed and no graph is built) and returns (loss, grad_h, grad_W, grad_b), None for the
    unwanted ones. ``one_pass(g, c)``: a backend's fused in-place scaling (None where it does not
    apply), used by :func:`scale_`. ``rescaled(c)``: where given (float16), the gradients are
    formed in the backward by the ``compute`` it returns, its rows weighted by the cotangent c
    (:class:`DeferredGradLoss`)."""
    grad = torch.is_grad_enabled()
    if not (grad and (hidden.requires_grad or weight.requires_grad
                      or (bias is not None and bias.requires_grad))):
        return compute(False, False, False)[0]
    if rescaled is not None:
        return DeferredGradLoss.apply(compute, rescaled, hidden, weight, bias)
    if one_pass is not None:
        _prepare_scale(one_pass, weight, bias)
    return PrecomputedGradLoss.apply(compute, _scaler(one_pass), hidden, weight, bias)


_SCALERS: dict = {}


def _scaler(one_pass):
    fn = _SCALERS.get(one_pass)
    if fn is None:
        fn = _SCALERS[one_pass] = (lambda g, c: scale_(g, c, one_pass)) if one_pass is not None else scale_
    return fn


# ------------------------------------------------------------------------- the op pair
class _Def:
    name = "fused_linear_ce"
    names = ("hidden", "weight", "labels", "div", "bias")
    diff = ("hidden", "weight", "bias")


DEF = _Def()


class NodeAdaptor(NodeAdaptorBase):
    """The fused loss of one backend as a forge.ops.library op: ``compute`` is the backend's
    piece. Static: the backend's options plus ``need`` (which of grad_h, grad_W, grad_b the
    forward forms, decided while tracing)."""

    DEF = DEF

    def __init__(self, compute):
        self.compute = compute

    def input_names(self, kdef, n):
        return kdef.names[:n]

    def diff_names(self, kdef, n):
        return tuple(d for d in kdef.diff if d in kdef.names[:n])

    def saved_present(self, kdef, present):
        return tuple(False for _ in present)  # the backward reads only the forward's gradients

    def run_fwd(self, kdef, tensors, static):
        static = dict(static)
        need = static.pop("need")
        loss, *grads = self.compute(tuple(t for t in tensors if t is not None), static, *need)
        return (loss,), tuple(g for g in grads if g is not None)

    def fake_fwd(self, kdef, tensors, static):
        hidden, weight = tensors[0], tensors[1]
        bias = tensors[4] if len(tensors) > 4 else None
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        need_h, need_w, need_b = static["need"]
        grads = [hidden.new_empty(hidden.shape, dtype=acc) if need_h else None,
                 torch.empty_like(weight) if need_w else None,
                 torch.empty_like(bias) if need_b else None]
        return (hidden.new_empty((), dtype=acc),), tuple(g for g in grads if g is not None)

    def _grads(self, res, static):
        it = iter(res)
        return {n: next(it) for n, w in zip(("hidden", "weight", "bias"), static["need"]) if w}

    def traced_bwd(self, kdef):
        return self._scaled

    def _scaled(self, inputs, res, grads, needs, static, dtypes):
        """The compiled backward: each gradient times c in c's precision, one rounding to its
        dtype (as :func:`scale_`), in plain torch ops. The gradients are saved tensors nobody
        else sees, so inductor's backward may write the product over their own buffers (AOT
        autograd "donates" such tensors to the backward): no second grad_W-sized buffer."""
        (c,) = grads
        h_dtype = getattr(torch, dtypes[0].removeprefix("torch."))
        return {name: (g.to(c.dtype) * c).to(h_dtype if name == "hidden" else g.dtype)
                for name, g in self._grads(res, static).items() if needs.get(name)}


def traced_apply(adaptor: NodeAdaptor, tensors, static, hidden, weight, bias):
    """The node under torch.compile: its forward op, the gradients it forms decided now."""
    grad = torch.is_grad_enabled()
    need = (grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    padded = tuple(tensors[:4]) + ((tensors[4],) if len(tensors) > 4 else ())
    return adaptor.traced(DEF, padded, dict(static, need=need))[0]
