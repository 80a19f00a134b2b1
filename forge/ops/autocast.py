"""Autocast at the op boundary: the nodes whose math holds matrix products (the gated MLP, the
fused loss) compute in the dtype eager's products would have under ``torch.autocast``.

Eager ``F.linear`` under autocast casts every floating operand but float64 to the autocast dtype
(bf16 or fp16), so an fp32 model trained under autocast (the HF Trainer's ``bf16=True``) runs
its products in bf16 and hands fp32 parameters their gradients through the casts. A node does
the same at its entry: its inputs are cast there, differentiably (``Tensor.to``: the casts'
backward brings each gradient back to its parameter's dtype), and the node then runs with
autocast off, so no torch product inside it changes dtype behind the kernels' back (an fp32
buffer a product silently returned in bf16 is how an out-of-bounds write happens). Imports torch
only.
"""
from __future__ import annotations

import torch

_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: torch.is_autocast_enabled())


def target(device_type: str, *tensors) -> torch.dtype | None:
    """The dtype autocast would cast these tensors' products to on ``device_type``, or None
    where autocast is off there or leaves every one of them as it is."""
    if not _any_autocast() or not torch.is_autocast_enabled(device_type):
        return None
    dt = torch.get_autocast_dtype(device_type)
    for t in tensors:
        if t is not None and t.is_floating_point() and t.dtype is not dt and t.dtype is not torch.float64:
            return dt
    return None


def cast(t, dtype):
    """``t`` as autocast would hand it to a product computing in ``dtype``."""
    if t is None or not t.is_floating_point() or t.dtype is dtype or t.dtype is torch.float64:
        return t
    return t.to(dtype)


def off(device_type: str):
    """A context with autocast off on ``device_type``."""
    return torch.autocast(device_type, enabled=False)
