"""The oracle's tolerance rule (docs/design.md, "The correctness oracle").

A kernel output in dtype d passes when

    err(kernel) <= 2 * err(torch eager in d) + atol_d(reduction length)

with ``err`` the relative L2 error against the float64 reference. ``atol_d`` is one rounding of
the output to d plus fp32 accumulation error growing as sqrt(reduction length): kernels
accumulate in fp32 whatever d is, so a reduction over K terms adds about u_fp32 * sqrt(K).
"""
from __future__ import annotations

import math

import torch

# unit roundoff of each storage dtype
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``out`` against ``ref``, computed in float64 on ref's device."""
    r = ref.detach().to(torch.float64)
    o = out.detach().to(r.device, torch.float64)
    if o.shape != r.shape:
        raise ValueError(f"shape {tuple(o.shape)} vs reference {tuple(r.shape)}")
    if not torch.isfinite(o).all():
        return math.inf
    denom = r.norm().item()
    num = (o - r).norm().item()
    if denom == 0.0:
        return num
    return num / denom


def atol(dtype: torch.dtype, reduction: int = 1) -> float:
    return UNIT_ROUNDOFF[dtype] + UNIT_ROUNDOFF[torch.float32] * math.sqrt(max(reduction, 1))


def bound(eager_err: float, dtype: torch.dtype, reduction: int = 1) -> float:
    return 2.0 * eager_err + atol(dtype, reduction)


def assert_close(name: str, out, ref64, eager, dtype: torch.dtype, reduction: int = 1) -> float:
    """Assert the rule for one output; return the kernel's error (for reports)."""
    e_k = rel_err(out, ref64)
    e_e = rel_err(eager, ref64)
    b = bound(e_e, dtype, reduction)
    assert e_k <= b, f"{name}: rel err {e_k:.3e} > bound {b:.3e} (eager {dtype} err {e_e:.3e})"
    return e_k
