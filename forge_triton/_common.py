"""Shared helpers for the Triton backend: output allocation, device checks, launch sizes."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from forge import _runtime
from forge.spec import _check

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


_ON_CUDA = not INTERPRET  # the mode is fixed once kernels are decorated


def check_device(**named) -> None:
    # ``is_cuda`` / ``is_cpu`` are plain attribute reads; ``t.device`` builds an object per call
    for name, t in named.items():
        if t is not None and not (t.is_cuda if _ON_CUDA else t.is_cpu):
            where = "CPU (Triton interpreter)" if INTERPRET else "a CUDA device"
            raise ValueError(f"{name} is on {t.device}, but the triton backend here runs on {where}")


BoundedCache, Validated = _check.BoundedCache, _check.Validated  # the kernel modules' caches

_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def hot_tensors(*ts) -> bool:
    """Every argument a float tensor on the device this backend runs on: the per-call fast
    check (a few attribute reads); when it fails the wrapper runs the spec's full checks, which
    raise the clear error."""
    for t in ts:
        if not (isinstance(t, torch.Tensor) and t.dtype in _FLOATS and (t.is_cuda if _ON_CUDA else t.is_cpu)):
            return False
    return True


def needs_autograd(*tensors) -> bool:
    """Whether a call must go through its autograd.Function: without grad mode or an input that
    requires grad (inference) the forward runs bare, a few microseconds less host time per call."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). (``triton.cdiv`` is a constexpr_function on Triton 3.6: several
    microseconds per host call.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side next power of two >= n (1 for n <= 1); see :func:`cdiv`."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def dot_upcast() -> bool:
    """Triton's interpreter returns garbage for bf16 ``tl.dot``: upcast operands to fp32 there.
    Kernels take this as a constexpr (see docs/design.md)."""
    return INTERPRET


def acc(dtype: torch.dtype):
    """Compute dtype inside kernels: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return tl.float64 if dtype is torch.float64 else tl.float32


def acc_torch(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# Triton's interpreter truncates fp32 -> bf16 instead of rounding to nearest even (even with
# fp_downcast_rounding="rtne"), which doubles the rounding error of every bf16 output on CPU.
# Kernels cast their outputs through `cast`: on the GPU it is a plain .to(); interpreted, bf16
# values are rounded to nearest even by bit arithmetic first, so truncation is then exact.
FIX_BF16_CAST = tl.constexpr(INTERPRET)


@triton.jit
def cast(x, DT: tl.constexpr):
    if FIX_BF16_CAST:
        if DT == tl.bfloat16:
            b = x.to(tl.float32).to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = b.to(tl.float32, bitcast=True)
    return x.to(DT)


# tl.exp lowers to the approximate ex2 instruction on the GPU (a few ulp in fp32, growing with
# |x|), which shows in fp32 outputs; libdevice's expf is correctly rounded to 1 ulp and costs
# nothing in memory-bound kernels. The interpreter has no libdevice and numpy's exp is exact.
PRECISE_EXP = tl.constexpr(not INTERPRET)


@triton.jit
def exp(x):
    if PRECISE_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def sigmoid_pair(x):
    """(sigmoid(x), 1 - sigmoid(x)), each to full relative precision: forming 1 - s by
    subtraction loses it where s is near 1 (it cost GeGLU's gradient 6 ulp in fp32)."""
    e = exp(-tl.abs(x))
    p = 1.0 / (1.0 + e)
    q = e * p
    pos = x >= 0
    return tl.where(pos, p, q), tl.where(pos, q, p)
