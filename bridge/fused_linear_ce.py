"""Fused linear cross-entropy through the bridge: ``forge_pallas.fused_linear_ce`` on torch tensors.

One bridged call runs the whole loss (both passes over the vocabulary, the XLA matmuls and the
Pallas kernels) and, when autograd wants them, the gradients; which ones is decided from
``requires_grad`` and passed as a static argument, so a frozen lm_head never pays for grad_W.
The autograd side is not the bridge's generic Function (its backward would be a second JAX call
building scaled copies of grad_W while the forward's are alive: 2x grad_W at the peak) but the op
layer's node (forge/ops/precomputed.py, shared with the Triton backend, built from this module's
:func:`prepare` and :func:`compute`): the call runs bare through the kernel's
jitted forward, its gradients come back as torch tensors (zero copy) and the backward scales
them in place. That is safe: they are outputs of a finished JAX computation, fresh buffers that
JAX holds no other use of once the arrays are dropped (nothing is donated or forwarded), and
``torch.from_dlpack`` orders torch's stream after JAX's (see bridge/dlpack.py's docstring).
"""
from __future__ import annotations

import torch

from forge.spec import fused_linear_ce as spec
from forge_pallas import fused_linear_ce as _k

from . import core, dlpack

# XLA keeps more scratch live around the tiled loop than the Triton path (measured on the H200:
# 814 MiB extra at 4096 x 896 x 151936 with the Triton path's 1/16), so its tiles are narrower
LOGITS_FRACTION = 1 / 32
# Row chunks: forge.spec.fused_linear_ce.row_chunk, as the Triton path (dL/dz is a separate
# (C, V) buffer here, where the Triton path writes it over the logits)

# inputs: hidden, weight, labels, div[, bias]. Only its jitted forward is used (``fwd_fn``),
# never ``core.apply``: the op layer's node differentiates it, so there is no bwd. It stays on
# the DLPack path: its tiles loop in XLA (fori_loop, dynamic slices), and one call per step
# makes the ~0.1 ms of import cost per tensor negligible beside its milliseconds of matmuls.
FLCE = core.KernelDef("fused_linear_ce", fwd=_k.flce_fwd, bwd=None, diff=())


def compute(tensors, static, need_h, need_w, need_b):
    """(loss, grad_h fp32 | None, grad_W | None, grad_b | None) as torch tensors."""
    static = dict(static)
    rows = static.pop("chunk_rows")
    if static["tile_vocab"] is None:  # the strategy depends on whether gradients are wanted
        n, v = tensors[0].shape[0], tensors[1].shape[0]
        rows = spec.row_chunk(n, v, rows, need_grad=need_h or need_w or need_b)
        if rows is None:
            static["tile_vocab"] = spec.tile_width(n, v, logits_fraction=LOGITS_FRACTION)
    skey = tuple(dict(static, grads_for=(need_h, need_w, need_b), chunk_rows=rows).items())
    (loss,), res = FLCE.fwd_fn(skey)(*dlpack.inputs_to_jax(FLCE, tensors))
    # every output through torch.from_dlpack before returning (bridge/dlpack.py's rule 2)
    loss, it = dlpack.to_torch(loss), iter([dlpack.to_torch(r) for r in res])
    return (loss, *(next(it) if want else None for want in (need_h, need_w, need_b)))


def prepare(hidden, weight, labels, bias=None, *, ignore_index=-100, reduction="mean",
            num_items_in_batch=None, softcap=None, label_smoothing=0.0, z_loss=0.0, tile_vocab=None,
            chunk_rows=None):
    """Check the arguments (forge.spec.fused_linear_ce) and return what :func:`compute` takes:
    (tensors, static). Extra, optional: ``tile_vocab`` walks vocabulary tiles of that width,
    ``chunk_rows`` row chunks of that many rows (at most one of them); neither, and
    ``forge.spec.fused_linear_ce.row_chunk`` picks, the tiles sized by
    ``tile_width``."""
    spec.check(hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
               num_items_in_batch=num_items_in_batch, softcap=softcap,
               label_smoothing=label_smoothing, z_loss=z_loss)
    spec.check_strategy(tile_vocab, chunk_rows)
    if tile_vocab is not None:
        tile_vocab = spec.tile_width(hidden.shape[0], weight.shape[0], tile_vocab)
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    div = spec.divisor(labels, ignore_index, reduction, num_items_in_batch, acc, hidden.device)
    static = dict(ignore_index=int(ignore_index), softcap=None if softcap is None else float(softcap),
                  label_smoothing=float(label_smoothing), z_loss=float(z_loss), tile_vocab=tile_vocab,
                  chunk_rows=chunk_rows)
    return (hidden, weight, labels, div) + (() if bias is None else (bias,)), static
