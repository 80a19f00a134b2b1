"""Fused linear cross-entropy through the bridge: ``forge_pallas.fused_linear_ce`` on torch tensors.

One bridged call runs the whole loss (both passes over the vocabulary, the XLA matmuls and the
Pallas kernels) and, when autograd wants them, the gradients; the backward is a second small
call that scales them by the loss's cotangent. Which gradients to compute is decided here from
``requires_grad`` and passed as a static argument, so a frozen lm_head never pays for grad_W.
"""
from __future__ import annotations

import torch

from forge.spec import fused_linear_ce as spec
from forge_pallas import fused_linear_ce as _k

from . import core

# inputs: hidden, weight, labels, div[, bias]; the kernel needs only its residuals in backward
FLCE = core.KernelDef("fused_linear_ce", fwd=_k.flce_fwd, bwd=_k.flce_bwd, diff=(0, 1),
                      cache_inputs=(1,), save=())
FLCE_BIAS = core.KernelDef("fused_linear_ce_bias", fwd=_k.flce_fwd, bwd=_k.flce_bwd, diff=(0, 1, 4),
                           cache_inputs=(1, 4), save=())


def fused_linear_ce(hidden, weight, labels, bias=None, *, ignore_index=-100, reduction="mean",
                    num_items_in_batch=None, softcap=None, label_smoothing=0.0, z_loss=0.0,
                    tile_vocab=None):
    """Pallas fused linear cross-entropy with the signature of
    ``forge.spec.fused_linear_ce.reference``; ``tile_vocab`` (extra, optional) fixes the width of
    the vocabulary tiles, else they are sized from ``forge_pallas.fused_linear_ce.TILE_BUDGET_BYTES``."""
    spec.check(hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
               num_items_in_batch=num_items_in_batch, softcap=softcap,
               label_smoothing=label_smoothing, z_loss=z_loss)
    if tile_vocab is not None and (not isinstance(tile_vocab, int) or tile_vocab < 1):
        raise ValueError(f"tile_vocab must be a positive int, got {tile_vocab!r}")
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    div = spec.divisor(labels, ignore_index, reduction, num_items_in_batch, acc, hidden.device)
    grad = torch.is_grad_enabled()
    grads_for = (grad and hidden.requires_grad, grad and weight.requires_grad,
                 grad and bias is not None and bias.requires_grad)
    static = dict(ignore_index=int(ignore_index), softcap=None if softcap is None else float(softcap),
                  label_smoothing=float(label_smoothing), z_loss=float(z_loss),
                  tile_vocab=tile_vocab, grads_for=grads_for,
                  h_dtype=str(hidden.dtype).removeprefix("torch."))
    if bias is None:
        return core.apply(FLCE, hidden, weight, labels, div, **static)
    return core.apply(FLCE_BIAS, hidden, weight, labels, div, bias, **static)
