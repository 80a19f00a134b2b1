"""Fused linear cross-entropy: the lm_head projection and the token loss in one op.

Equivalent torch (rows already aligned: the patching layer shifts the labels)::

    z = F.linear(hidden.float(), weight.float(), bias)        # (N, V) logits, fp32 always
    if softcap: z = softcap * torch.tanh(z / softcap)          # gemma2 final_logit_softcapping
    ce = F.cross_entropy(z, labels, ignore_index=ignore_index,
                         reduction="none", label_smoothing=label_smoothing)
    ce = ce + z_loss * torch.logsumexp(z, -1) ** 2 * (labels != ignore_index)
    loss = ce.sum() / divisor      # divisor: 1 for "sum"; num_items_in_batch if given, else the
                                   # count of non-ignored labels, for "mean"

The loss is a 0-dim fp32 tensor (fp64 for fp64 inputs). A batch whose labels are all ignored
gives exactly what torch gives: NaN for "mean" (0 / 0), 0 for "sum", and zero gradients.
``num_items_in_batch`` follows Hugging Face's ``fixed_cross_entropy``: with it the sum is divided
by it instead of by the count (gradient accumulation); it may be an int or a 0-dim tensor.
Labels follow eager ``F.cross_entropy`` (``check_labels``, ``check_label_range``): int64 only
(eager refuses int32 too), each in ``[0, V)`` or equal to ``ignore_index``. An out-of-range label
is an IndexError naming it on the CPU and a device-side assert elsewhere, as in torch's own
kernels: checked on the device, with no host sync (docs/fused_linear_ce.md).

Gradients (the kernels' backward), per row i with p = softmax(z_i), y the label, eps the
smoothing, s = 1/divisor, t = 1 for valid rows and 0 for ignored ones::

    dL/dz_ij = s * t * (p_j - (1 - eps) [j == y] - eps / V + 2 z_loss lse_i p_j)
    dL/draw  = dL/dz * (1 - (z / softcap)^2)                   # softcap only
    grad_h = dL/draw @ W,   grad_W = dL/draw^T @ h,   grad_b = sum_i dL/draw
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import LabelDtypeError
from . import _check

REDUCTIONS = ("mean", "sum")


def check(hidden, weight, labels, bias=None, *, ignore_index=-100, reduction="mean",
          num_items_in_batch=None, softcap=None, label_smoothing=0.0, z_loss=0.0) -> None:
    check_labels(labels)  # first: a wrong label dtype is named as such, whatever else is wrong
    _check.tensor("hidden", hidden, min_dim=2)
    _check.tensor("weight", weight, min_dim=2)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D (tokens, hidden), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (vocab, hidden), got shape {tuple(weight.shape)}")
    _check.no_empty_dims("weight", weight, "the output layer (vocabulary and width)")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight has width {weight.shape[1]} but hidden has width {hidden.shape[1]}")
    _check.same_dtype("hidden", hidden, "weight", weight)
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must have shape ({hidden.shape[0]},) to match hidden's rows, "
                         f"got {tuple(labels.shape)}")
    if bias is not None:
        _check.tensor("bias", bias)
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        _check.same_dtype("bias", bias, "weight", weight)
    _check.same_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if num_items_in_batch is not None:
        if reduction != "mean":
            raise ValueError("num_items_in_batch replaces the divisor of reduction='mean'; "
                             f"it cannot be used with reduction={reduction!r}")
        if isinstance(num_items_in_batch, torch.Tensor):
            if num_items_in_batch.numel() != 1:
                raise ValueError("num_items_in_batch must be a scalar, got shape "
                                 f"{tuple(num_items_in_batch.shape)}")
            if num_items_in_batch.device not in (hidden.device, torch.device("cpu")):
                raise ValueError(f"num_items_in_batch is on {num_items_in_batch.device}; it must be on hidden's "
                                 f"device ({hidden.device}) or a CPU scalar")
        elif not isinstance(num_items_in_batch, int | float) or isinstance(num_items_in_batch, bool):
            raise TypeError("num_items_in_batch must be a number or a tensor, got "
                            f"{type(num_items_in_batch).__name__}")
        elif num_items_in_batch < 0:  # 0 is allowed: HF then gets sum / 0 (NaN), so do we
            raise ValueError(f"num_items_in_batch must be non-negative, got {num_items_in_batch!r}")
    if softcap is not None and not (isinstance(softcap, int | float) and softcap > 0):
        raise ValueError(f"softcap must be None or a positive number, got {softcap!r}")
    if not (isinstance(label_smoothing, int | float) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not (isinstance(z_loss, int | float) and z_loss >= 0.0):
        raise ValueError(f"z_loss must be a non-negative number, got {z_loss!r}")
    check_label_range(labels, weight.shape[0], ignore_index)


def check_labels(labels) -> None:
    """An int64 tensor, or LabelDtypeError (a TypeError and, as eager's, a RuntimeError) naming
    the dtype given: every other dtype, uint8 included (eager ``F.cross_entropy`` takes uint8
    class indices, but uint8 cannot hold a negative ignore_index, nor any LM's vocabulary, and
    Hugging Face's own label shift fails on it). Called first by :func:`check`, and by a patched
    model's forward before the decoder runs."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype is not torch.int64:
        raise LabelDtypeError(f"labels must be int64 (torch.long) class indices, as F.cross_entropy "
                              f"requires, got {labels.dtype}; convert them with labels.long()")


def check_label_range(labels, vocab: int, ignore_index: int) -> None:
    """Every label in [0, vocab) or equal to ignore_index. On the CPU an IndexError naming the
    first bad label, as eager's. On other devices ``torch._assert_async``: a device-side assert
    like the one torch's own CUDA loss kernels raise, queued with no host sync (a few tiny
    launches over N labels); it surfaces at the next call that synchronises and, as torch's,
    leaves the CUDA context unusable. Under torch.compile ``torch._assert_async`` on the CPU too
    (a RuntimeError when the compiled step runs; reading the labels while tracing would break
    the graph). The kernels must never see such a label: they would give a finite but
    meaningless loss (and the Pallas path narrows labels to int32 without x64)."""
    ok = ((labels >= 0) & (labels < vocab)) | (labels == ignore_index)  # (N,)
    if labels.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(ok.all(), f"fused_linear_ce: a label is out of bounds: labels must be "
                                      f"in [0, {vocab}) or ignore_index={ignore_index}")
    elif not bool(ok.all()):
        bad = labels[~ok]
        raise IndexError(f"label {int(bad[0])} is out of bounds for vocabulary size {vocab} (labels "
                         f"must be in [0, {vocab}) or ignore_index={ignore_index}; {bad.numel()} "
                         f"bad label(s))")


def divisor(labels, ignore_index, reduction, num_items_in_batch, dtype, device):
    """The loss's divisor as a 0-dim tensor on ``device``: no host sync (a tensor count stays on
    the device; a 0-dim CPU tensor is used as a scalar by torch's arithmetic)."""
    if reduction == "sum":
        return torch.ones((), dtype=dtype, device=device)
    if num_items_in_batch is None:
        return (labels != ignore_index).sum().to(dtype)
    one = torch.ones((), dtype=dtype, device=device)
    if isinstance(num_items_in_batch, torch.Tensor):
        # a 0-dim CPU tensor multiplies a device tensor as a host scalar: no copy, no sync
        return one * num_items_in_batch.reshape(()).to(dtype)
    return one * float(num_items_in_batch)


def reference(hidden, weight, labels, bias=None, *, ignore_index=-100, reduction="mean",
              num_items_in_batch=None, softcap=None, label_smoothing=0.0, z_loss=0.0):
    check(hidden, weight, labels, bias, ignore_index=ignore_index, reduction=reduction,
          num_items_in_batch=num_items_in_batch, softcap=softcap,
          label_smoothing=label_smoothing, z_loss=z_loss)
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    z = F.linear(hidden.to(acc), weight.to(acc), None if bias is None else bias.to(acc))  # (N, V)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = labels != ignore_index
    ce = F.cross_entropy(z, labels, ignore_index=ignore_index, reduction="none",
                         label_smoothing=float(label_smoothing))  # (N,), 0 on ignored rows
    if z_loss:
        ce = ce + z_loss * torch.logsumexp(z, -1).square() * valid
    div = divisor(labels, ignore_index, reduction, num_items_in_batch, acc, z.device)
    # torch's nll_loss backward weights row i by valid_i / divisor: ignored rows get exactly zero
    # gradient even when the divisor is 0 (all labels ignored), where ce.sum() / div would give NaN
    w = torch.where(valid, 1.0 / div, torch.zeros((), dtype=acc, device=z.device))  # (N,)
    loss = (ce * w).sum()
    # ...while the value over zero rows is torch's 0 / 0 = NaN (the gradient stays zero)
    return torch.where(div == 0, ce.detach().sum() / div, loss)


def elements(hidden, *_a, **_k) -> int:
    return hidden.numel()


def reductions(hidden, weight, *_a, **_k) -> dict:
    """Reduction length behind each output (scales the tolerance): logits are dots of length H,
    the log-sum-exp sums V terms, the loss sums N rows; grad_h sums over V, grad_W over N."""
    n, h = hidden.shape
    v = weight.shape[0]
    return {"loss": n + h + v, "hidden": h + v, "weight": n + h + v, "bias": n + v}


# Vocabulary tiles, shared by both backends. The (N, Vc) fp32 logits tile is the kernels' main
# scratch; it is sized as a fraction of the full fp32 logits eager would hold (so the saving
# scales with the problem: 1/fraction of eager's logits), at least TILE_MIN_COLS columns
# (narrower, the per-tile passes over the (N, H) fp32 grad_h dominate), and at least
# TILE_MIN_BYTES (wide matmuls at small N). Widths stay multiples of TILE_ALIGN and the tiles
# are balanced so the last one is not a sliver.
TILE_MIN_COLS = 4096
TILE_MIN_BYTES = 128 * 2**20
TILE_ALIGN = 256


def tile_width(n: int, v: int, tile_vocab: int | None = None, *, logits_fraction: float = 1 / 16) -> int:
    if tile_vocab is not None and (not isinstance(tile_vocab, int) or isinstance(tile_vocab, bool) or tile_vocab < 1):
        raise ValueError(f"tile_vocab must be a positive int, got {tile_vocab!r}")
    if tile_vocab is None:
        budget = max(TILE_MIN_BYTES, int(n * v * 4 * logits_fraction))
        cap = max(TILE_MIN_COLS, budget // (4 * max(n, 1)) // TILE_ALIGN * TILE_ALIGN)
        count = -(-v // cap)
        tile_vocab = -(-(-(-v // count)) // TILE_ALIGN) * TILE_ALIGN
    return max(1, min(tile_vocab, v))


# Row chunks (each backend's default where gradients are wanted): each chunk holds all V
# columns of C rows in fp32, so the logits go through the matmuls once, as in eager (three
# products instead of the vocabulary tiles' four), and the low-precision grad_W is accumulated
# over the chunks (one rounding and one read + write of grad_W per chunk after the first). The
# chunk's fp32 logits get a fixed budget, ROW_CHUNK_BYTES: measured on the H200 at 4096 x 4096 x
# 128256 (bench/diagnostics/flce_strategies.py), 2048-row chunks (1 GiB) ran the loss in 21.4 ms
# against 26.9 ms for the tiles and eager's 23.4 ms, 1024-row chunks in 23.8 ms; at 16384 rows
# 2048-row chunks took 84.6 ms against eager's 100.0 ms at 4.9% of eager's memory. Taller chunks
# gain little more (2.1 GB for 3%). Chunks are balanced and ROW_ALIGN-aligned; below
# ROW_CHUNK_MIN rows (a vocabulary over 256k words) the chunks' products lose efficiency and the
# vocabulary tiles take over.
ROW_CHUNK_BYTES = 2**30
ROW_CHUNK_MIN = 1024
ROW_ALIGN = 64


def check_strategy(tile_vocab, chunk_rows) -> None:
    """At most one of ``tile_vocab`` / ``chunk_rows``, each a positive int when given."""
    for name, val in (("tile_vocab", tile_vocab), ("chunk_rows", chunk_rows)):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if tile_vocab is not None and chunk_rows is not None:
        raise ValueError("give at most one of tile_vocab (vocabulary tiles) and chunk_rows (row chunks)")


def row_chunk(n: int, v: int, chunk_rows: int | None = None, *, need_grad: bool = True,
              budget: int | None = None) -> int | None:
    """Rows per chunk for the row-chunk strategy, or None for vocabulary tiles: ``chunk_rows``
    when given; else, where gradients are wanted (without them both strategies do one product
    per logit), as many rows as ``budget`` bytes of fp32 logits hold, balanced over the chunks
    N needs and rounded up to ROW_ALIGN; None where that is fewer than ROW_CHUNK_MIN rows and
    fewer than N. ``budget`` None: ROW_CHUNK_BYTES as it is at the call."""
    check_strategy(None, chunk_rows)
    if chunk_rows is not None:
        return chunk_rows
    if not need_grad:
        return None
    cap = (ROW_CHUNK_BYTES if budget is None else budget) // (4 * max(v, 1)) // ROW_ALIGN * ROW_ALIGN
    if cap < min(n, ROW_CHUNK_MIN):
        return None
    if n <= cap:
        return max(n, 1)
    count = -(-n // cap)
    return min(cap, -(-(-(-n // count)) // ROW_ALIGN) * ROW_ALIGN)
