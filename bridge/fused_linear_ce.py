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

With :data:`NATIVE_ROWS` on (the default since its GPU cases passed), where the native path runs (a CUDA
device: ``bridge.native``) and the row-chunk strategy is picked (the default wherever gradients
are wanted), the loss does not go through JAX at all:
:func:`_rows_native` runs the chunks' products through torch (forge.spec._products.row_chunks,
the Triton backend's loop) and launches the two Pallas kernels of each chunk natively on torch's
stream (``flce_chunk_stats``, ``flce_chunk_grad``), so nothing crosses DLPack and a CUDA graph
can capture the loss. The vocabulary tiles and float64 stay on the one jitted function.
"""
from __future__ import annotations

import torch

from forge.spec import _products
from forge.spec import fused_linear_ce as spec
from forge_pallas import fused_linear_ce as _k

from . import core, dlpack, native
from .kernels import check_devices

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
# The row chunks natively launched (:func:`_rows_native`): on by default since the native cases of
# `pytest -m gpu tests/test_fused_linear_ce.py` passed on an H100 (2026-12-05) and the Llama-3-8B
# full fine-tune step ran with it at 0.99x Triton's speed. False: the one jitted function, via DLPack.
NATIVE_ROWS = True
# one row chunk's kernels, natively launched (inputs: z, labels, state, or max, log sum-exp and row weights[, bias])
CHUNK_STATS = core.KernelDef("flce_chunk_stats", fwd=_k.flce_chunk_stats, bwd=None, diff=())
CHUNK_GRAD = core.KernelDef("flce_chunk_grad", fwd=_k.flce_chunk_grad, bwd=None, diff=())


def compute(tensors, static, need_h, need_w, need_b):
    """(loss, grad_h fp32 | None, grad_W | None, grad_b | None) as torch tensors."""
    static = dict(static)
    rows = static.pop("chunk_rows")
    if static["tile_vocab"] is None:  # the strategy depends on whether gradients are wanted
        n, v = tensors[0].shape[0], tensors[1].shape[0]
        rows = spec.row_chunk(n, v, rows, need_grad=need_h or need_w or need_b)
        if rows is None:
            static["tile_vocab"] = spec.tile_width(n, v, logits_fraction=LOGITS_FRACTION)
    if NATIVE_ROWS and rows and tensors[0].dtype != torch.float64 and native.available()[0]:
        with torch.autocast(tensors[0].device.type, enabled=False):  # the products keep fp32 logits
            return _rows_native(tensors, static, rows, need_h, need_w, need_b)
    skey = tuple(dict(static, grads_for=(need_h, need_w, need_b), chunk_rows=rows).items())
    (loss,), res = FLCE.fwd_fn(skey)(*dlpack.inputs_to_jax(FLCE, tensors))
    # every output through torch.from_dlpack before returning (bridge/dlpack.py's rule 2)
    loss, it = dlpack.to_torch(loss), iter([dlpack.to_torch(r) for r in res])
    return (loss, *(next(it) if want else None for want in (need_h, need_w, need_b)))


def _rows_native(tensors, static, rows, need_h, need_w, need_b):
    """The row-chunk strategy with torch's products around the natively launched chunk kernels
    (see the module docstring): (loss, grad_h fp32 | None, grad_W | None, grad_b | None)."""
    hidden, weight, labels, div = tensors[:4]
    bias = tensors[4:]  # () or (bias,)
    n, v = hidden.shape[0], weight.shape[0]
    acc = torch.float32
    eps, z_loss, softcap = static["label_smoothing"], static["z_loss"], static["softcap"]
    valid = labels != static["ignore_index"]
    div = div.to(acc)
    # 1 / div on valid rows (inf for a divisor of 0, as eager's sum / 0), 0 on ignored ones
    w_rows = torch.where(valid, 1.0 / div, torch.zeros((), dtype=acc, device=div.device))  # (N,)
    loss_rows = torch.empty(n, dtype=acc, device=hidden.device)
    coefs = dict(one_minus_eps=1.0 - eps, eps_over_v=eps / v, two_z_loss=2.0 * z_loss)
    dtype = str(hidden.dtype).removeprefix("torch.")

    def kernels(r0, r1, z):
        y_c, c = labels[r0:r1], r1 - r0
        zero = torch.zeros(c, dtype=acc, device=z.device)
        m, s, t, sz = core.run_fwd(CHUNK_STATS, z, y_c, torch.full_like(zero, float("-inf")), zero, zero, zero,
                                   *bias, softcap=softcap, smooth=eps > 0)
        ls = torch.log(s)
        loss_rows[r0:r1] = _k.row_loss(m, ls, t, sz, eps=eps, v=v, z_loss=z_loss)
        if not (need_h or need_w or need_b):
            return None
        return core.run_fwd(CHUNK_GRAD, z, y_c, m, ls, w_rows[r0:r1], *bias, softcap=softcap, dtype=dtype,
                            **coefs)[0]

    gh, gw, gb = _products.row_chunks(hidden, weight, rows, need_h, need_w, need_b, kernels)
    loss = torch.where(valid, loss_rows, 0.0).sum() / div
    return loss, gh, gw, None if gb is None else gb.to(hidden.dtype)


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
    check_devices(hidden=hidden, weight=weight, labels=labels, **({} if bias is None else {"bias": bias}))
    if not -2**31 <= ignore_index < 2**31:  # (the kernels compare int32 labels)
        raise ValueError(f"ignore_index must fit in int32 for the pallas backend, got {ignore_index}")
    spec.check_strategy(tile_vocab, chunk_rows)
    if tile_vocab is not None:
        tile_vocab = spec.tile_width(hidden.shape[0], weight.shape[0], tile_vocab)
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    div = spec.divisor(labels, ignore_index, reduction, num_items_in_batch, acc, hidden.device)
    static = dict(ignore_index=int(ignore_index), softcap=None if softcap is None else float(softcap),
                  label_smoothing=float(label_smoothing), z_loss=float(z_loss), tile_vocab=tile_vocab,
                  chunk_rows=chunk_rows)
    return (hidden, weight, labels, div) + (() if bias is None else (bias,)), static
