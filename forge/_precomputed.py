"""Scalar losses whose gradients are computed in the forward: one autograd.Function for every
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
graph-capturable. Imports torch only (no backend), so ``import forge`` stays backend-free.
"""
from __future__ import annotations

import torch

__all__ = ["apply", "scale_"]

# fp32 scratch of the low-precision path of ``scale_``: at most 1/16 of the gradient's elements
# per step (1/8 of a bf16 gradient's bytes), at least 2^20 (fewer, the launches dominate)
_CHUNK_FRACTION = 16
_CHUNK_MIN = 2**20


_ONE_PASS: list = []  # [Triton's one-pass scaling kernel, or None], resolved on first use
_WARM: set = set()  # dtypes the one-pass kernel was compiled for on the calling thread


def _one_pass():
    if not _ONE_PASS:
        try:
            from forge_triton.fused_linear_ce import _scale_kernel_launch
        except Exception:  # noqa: BLE001 - no triton (or no compiler): torch's chunks below
            _scale_kernel_launch = None
        _ONE_PASS.append(_scale_kernel_launch)
    return _ONE_PASS[0]


def _prepare_scale(*ts) -> None:
    """Import and compile the one-pass kernel for these gradients' dtypes now, on the forward's
    thread: the backward runs on autograd's device thread, where neither should happen first
    (a Pallas-backend process that had not imported Triton aborted there on the H200)."""
    for t in ts:
        if t is None or not t.is_cuda or t.dtype in _WARM or t.element_size() >= 4:
            continue
        one_pass = _one_pass()
        if one_pass is not None:
            one_pass(torch.zeros(64, dtype=t.dtype, device=t.device), torch.ones((), device=t.device))
        _WARM.add(t.dtype)


def scale_(g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """g *= c in place, in c's precision with one rounding to g's dtype. No host sync.

    On CUDA, torch's own ``g.mul_(c)`` casts the 0-dim device tensor c to g's dtype first, so a
    bf16 g would be scaled by c rounded to bf16 (a systematic error of up to 2^-9 on every
    element), and no torch op scales a bf16 tensor by an fp32 device scalar in one pass. A
    narrower contiguous CUDA g therefore goes through one small Triton kernel (read + write g
    once) whichever backend produced it: triton ships with torch's CUDA builds. Without it, g
    goes through c's dtype a chunk at a time (bounded scratch, 5x the traffic: 4.5 ms against
    0.65 ms for a 128256 x 4096 bf16 grad_W on the H200)."""
    if g.element_size() >= c.element_size():  # c converts to g's dtype exactly
        return g.mul_(c)
    if g.is_cuda and g.is_contiguous():
        one_pass = _one_pass()
        if one_pass is not None:
            return one_pass(g, c)
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
    @torch.autograd.function.once_differentiable
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


def apply(compute, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          *, scale=scale_) -> torch.Tensor:
    """The loss from ``compute``, differentiable in hidden, weight and bias through the
    gradients ``compute`` returns. ``compute(need_h, need_w, need_b)`` gets which gradients
    autograd wants (all False without grad mode or trainable inputs: then only the loss is
    formed and no graph is built) and returns (loss, grad_h, grad_W, grad_b), None for the
    unwanted ones. ``scale(g, c)`` multiplies g by the 0-dim c in place (default
    :func:`scale_`; a backend may pass a fused kernel)."""
    grad = torch.is_grad_enabled()
    if not (grad and (hidden.requires_grad or weight.requires_grad
                      or (bias is not None and bias.requires_grad))):
        return compute(False, False, False)[0]
    if scale is scale_:
        _prepare_scale(weight, bias)
    return PrecomputedGradLoss.apply(compute, scale, hidden, weight, bias)
