"""Shared helpers for the Triton backend: output allocation, device checks, launch sizes."""
from __future__ import annotations

import os

import torch

from forge import _runtime

# Tests set FORGE_POISON=1: every output is NaN-filled before the kernel runs, so an element the
# kernel did not write shows up. Read once; the hot path pays one bool test.
POISON = os.environ.get("FORGE_POISON", "0") == "1"
INTERPRET = _runtime.triton_interpreted()


def empty(shape, dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def empty_like(t: torch.Tensor, dtype=None) -> torch.Tensor:
    out = torch.empty_like(t, dtype=dtype)
    if POISON and out.is_floating_point():
        out.fill_(float("nan"))
    return out


def check_device(**named) -> None:
    for name, t in named.items():
        if t is not None and not _runtime.kernel_device_ok(t):
            where = "CPU (Triton interpreter)" if INTERPRET else "a CUDA device"
            raise ValueError(f"{name} is on {t.device}, but the triton backend here runs on {where}")


def num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def dot_upcast() -> bool:
    """Triton's interpreter returns garbage for bf16 ``tl.dot``: upcast operands to fp32 there.
    Kernels take this as a constexpr (see shared/MEASURED.md)."""
    return INTERPRET
