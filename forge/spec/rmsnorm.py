"""RMSNorm over the last dimension, in the two casting conventions Hugging Face uses.

llama / qwen2 / qwen3 (``casting="llama"``), equivalent torch::

    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (weight + offset) * normed.to(x.dtype)          # dtype: promote(weight, x)

gemma / gemma2 (``casting="gemma"``, offset 1.0), everything in fp32::

    y = (normed * (offset + weight.float())).to(x.dtype)

Per-head use (qwen3 ``q_norm``/``k_norm``) is the same op with width = head_dim: every leading
dimension is a row. Backward by autograd of the above; the cast is the identity for gradients.
"""
from __future__ import annotations

import torch

from . import _check

CASTINGS = ("llama", "gemma")


def check(x, weight, eps: float, casting: str, offset: float) -> None:
    _check.tensor("x", x)
    _check.tensor("weight", weight)
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D, got shape {tuple(weight.shape)}")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has width {weight.shape[0]} but x's last dimension is {x.shape[-1]}")
    _check.same_device(x=x, weight=weight)
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    if not (isinstance(eps, float | int) and eps >= 0):
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if not isinstance(offset, float | int):
        raise TypeError(f"offset must be a number, got {type(offset).__name__}")


def out_dtype(x, weight, casting: str) -> torch.dtype:
    return x.dtype if casting == "gemma" else torch.promote_types(weight.dtype, x.dtype)


def reference(x, weight, eps: float = 1e-6, *, casting: str = "llama", offset: float = 0.0):
    check(x, weight, eps, casting, offset)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        return (normed * (offset + weight.to(acc))).to(x.dtype)
    return (weight + offset) * normed.to(x.dtype)


def elements(x, *_a, **_k) -> int:
    """Activation elements per call: rows x width."""
    return x.numel()


def reductions(x, weight, *_a, **_k) -> dict:
    """Reduction length behind each output (scales the tolerance)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return {"y": x.shape[-1], "x": x.shape[-1], "weight": rows}
