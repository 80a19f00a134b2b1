"""Dropout on a LoRA adapter's input, shared by ``lora_qkv`` and ``lora_mlp`` (every backend).

peft's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: only the
adapter path sees dropout, and each projection owns its ``nn.Dropout`` and draws its own mask.
The fused kernels take that mask as an argument instead of drawing it, per projection::

    mask_p: bool, the shape of the projection's input, True where an element is kept
    dropout_p: float in [0, 1], the probability the mask was drawn with

    dropped = x * mask_p * (1 / (1 - dropout_p))   # = apply(x, mask_p, dropout_p), x's dtype
    lora_p  = F.linear(F.linear(dropped, a_p.to(x.dtype)), b_p.to(x.dtype)) * scale_p

``mask_p=None`` means no dropout (``dropout_p`` must then be 0): the kernels take exactly the
path they take without these arguments. A bool mask costs one byte an element and is all that
backward needs besides x, which the kernels keep anyway (peft keeps the dropped-out copy in the
adapter dtype, plus torch's own mask).

:func:`draw` draws a mask with the same random numbers ``nn.Dropout`` would consume at that
point of the RNG stream for an input of that shape, dtype and device, so a forward that draws
in peft's order (q, k, v; gate, up, down) drops exactly what peft would have dropped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def scale(p: float) -> float:
    """Factor on the kept elements; 0 when everything is dropped (as torch's dropout)."""
    return 0.0 if p >= 1 else 1.0 / (1.0 - p)


_ONES: dict = {}  # (shape, dtype, device) -> a tensor of ones, draw()'s dropout input (read, never written)
_ONES_KEPT = 2  # a model draws on two shapes per step (x's, and h's for the MLP's down adapter)


def release() -> None:
    """Drop the kept ones (forge.unpatch calls it: nothing of forge's stays allocated after a
    model is unpatched and deleted; the next draw makes them again)."""
    _ONES.clear()


def _ones(shape, dtype, device: torch.device) -> torch.Tensor:
    key = (tuple(shape), dtype, device)
    t = _ONES.get(key)
    if t is None:
        t = torch.ones(shape, dtype=dtype, device=device)
        if len(_ONES) >= _ONES_KEPT:
            del _ONES[next(iter(_ONES))]
        _ONES[key] = t
    return t


def draw(shape, p: float, dtype: torch.dtype, device) -> torch.Tensor:
    """A bool keep-mask as ``nn.Dropout(p)`` in training would draw for a ``(shape, dtype,
    device)`` input. It runs torch's own dropout on ones: whichever kernel torch picks for that
    device (bernoulli on the CPU, the fused Philox kernel on CUDA), the mask and the RNG it
    consumes are the ones peft's call would have had (dropout never reads the input values).

    Host cost (a training step draws six masks a decoder layer): the ones are kept between calls
    (the last two shapes, ~94 MB in fp32 at 4096 tokens of Qwen2.5-0.5B's widths; not while
    torch.compile traces or a CUDA graph captures), and on CUDA,
    for 0 < p < 1, the mask is ``torch.native_dropout``'s own: ``F.dropout`` is that very call
    there (``at::dropout`` takes its fused kernel), so the mask and the RNG offsets are the same,
    without the comparison that recovers the mask from the output. Elsewhere (the CPU's
    bernoulli path, p = 1, an empty shape) ``F.dropout(ones) != 0`` as always."""
    dev = device if type(device) is torch.device else torch.device(device)
    if torch.compiler.is_compiling() or (dev.type != "cpu" and dev.index is None):
        return F.dropout(torch.ones(shape, dtype=dtype, device=device), p, True) != 0
    if dev.type == "cuda":
        if torch.cuda.is_current_stream_capturing():  # a graph's reads must stay valid at replay
            return F.dropout(torch.ones(shape, dtype=dtype, device=device), p, True) != 0
        ones = _ones(shape, dtype, dev)
        if 0.0 < p < 1.0 and ones.numel():
            return torch.native_dropout(ones, p, True)[1]
        return F.dropout(ones, p, True) != 0
    return F.dropout(_ones(shape, dtype, dev), p, True) != 0


def apply(t: torch.Tensor, mask: torch.Tensor | None, p: float) -> torch.Tensor:
    """Dropout with a given mask: ``t`` where kept, scaled by :func:`scale`; 0 elsewhere. Also the
    backward of dropout (the same map on the gradient)."""
    if mask is None:
        return t
    return torch.mul(t, mask).mul_(scale(p))  # a product, as torch's dropout: NaN stays NaN


def check(name: str, mask, p, shape, device, of: str) -> None:
    """``mask_<name>`` and ``dropout_<name>`` against the projection's input ``of`` (its shape
    and device)."""
    if isinstance(p, bool) or not isinstance(p, float | int):
        raise TypeError(f"dropout_{name} must be a number, got {type(p).__name__}")
    if not 0 <= p <= 1:
        raise ValueError(f"dropout_{name} must be in [0, 1], got {p}")
    if mask is None:
        if p != 0:
            raise ValueError(f"dropout_{name}={p} needs mask_{name} (draw one with forge.spec.lora_dropout.draw)")
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask_{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask_{name} must be torch.bool (True where kept), got {mask.dtype}")
    if mask.shape != tuple(shape):
        raise ValueError(f"mask_{name} has shape {tuple(mask.shape)} but {of} has {tuple(shape)}")
    if mask.device != device:
        raise ValueError(f"mask_{name} is on {mask.device} but {of} is on {device}")


def rows(mask: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """A mask as contiguous (M, width) rows, like the kernels' inputs."""
    return None if mask is None else mask.reshape(-1, width).contiguous()


__all__ = ["apply", "check", "draw", "rows", "scale"]
