"""RMSNorm in Triton: forward, and backward for x and weight (spec: forge/spec/rmsnorm.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forge.spec import rmsnorm as spec
from forge.spec._check import no_double_backward

from . import _common, _launch, _ops
from ._common import cast

MAX_WIDTH = 65536  # one row lives in registers


@triton.jit
def _rmsnorm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr,  # (M, N), (N,), (M, N), (M,)
    stride_x, stride_y, M, N, eps, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GEMMA: tl.constexpr, ACC: tl.constexpr,
):
    # BLOCK_M rows per program: narrow rows (qwen3's per-head norms, width 64) would otherwise
    # leave each program a few hundred bytes of work.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    cols = tl.arange(0, BLOCK_N)  # (BN,)
    rmask = rows < M
    mask = rmask[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)  # (BM, BN)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)  # (BM,)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    xhat = x * rstd[:, None]
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(ACC)[None, :]
    if GEMMA:
        y = xhat * (w + offset)
    else:
        # HF rounds the normalised row to the input dtype before scaling by the weight
        y = cast(xhat, x_ptr.dtype.element_ty).to(ACC) * (w + offset)
    tl.store(y_ptr + r64 * stride_y + cols[None, :], cast(y, y_ptr.dtype.element_ty), mask=mask)


# Backward. With xhat = x * rstd, rstd = (mean(x^2) + eps)^-1/2 and g = dy * (w + offset):
#   dx = rstd * (g - xhat * mean(g * xhat))
#   dw = sum over rows of dy * xhat      (llama: xhat rounded to x's dtype, as HF computes y)
# Each program walks row blocks pid, pid + P, ... and keeps its dw partial in registers; the P
# partial rows are summed afterwards, so no atomics contend on dw.
@triton.jit
def _rmsnorm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr,  # (M,N) (M,N) (N,) (M,) (M,N) (P,N)
    stride_dy, stride_x, stride_dx, M, N, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GEMMA: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ACC)[None, :] + offset
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for start in range(pid * BLOCK_M, M, progs * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)[:, None]
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=1)[:, None] / N))
        tl.store(dx_ptr + r64 * stride_dx + cols[None, :], cast(dx, dx_ptr.dtype.element_ty), mask=mask)
        if GEMMA:
            dw_acc += dy * xhat
        else:
            dw_acc += dy * cast(xhat, x_ptr.dtype.element_ty).to(ACC)
    tl.store(dw_part_ptr + pid * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)


@triton.jit
def _dw_reduce_kernel(part_ptr, dw_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # dw[cols] = sum over the P partial rows, rounded once to dw's dtype (one launch where
    # torch needs a sum and a cast)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=part_ptr.dtype.element_ty)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        m = (rows < P)[:, None] & cmask[None, :]
        acc += tl.sum(tl.load(part_ptr + rows[:, None] * N + cols[None, :], mask=m, other=0.0), axis=0)
    tl.store(dw_ptr + cols, cast(acc, dw_ptr.dtype.element_ty), mask=cmask)


# Launch shape: about TILE elements per program step; tuned on the H200 (bench/diagnostics/tune_triton.py, tune_rmsnorm_bwd.py).
# The backward's dw partials: 2 programs per SM, and the reduction over them with tall thin
# tiles (256 partial rows x 16 columns, 8 warps: 256 programs at width 4096, few steps each):
# at 4096 x 4096 bf16 the backward went from 50 us (48% of the copy bandwidth) to 35 us (68%),
# at 32768 x 4096 to 83% (the 32 column-block programs of 128 columns had been the bottleneck).
TILE = 4096
BWD_PROGS_PER_SM = 2

_fwd = _launch.FastKernel(_rmsnorm_fwd_kernel)
_bwd = _launch.FastKernel(_rmsnorm_bwd_kernel)
_dw_reduce = _launch.FastKernel(_dw_reduce_kernel)
DW_BLOCK_N = 16  # the dw reduction's tile: DW_BLOCK_P partial rows x DW_BLOCK_N columns a step
DW_BLOCK_P = 256
DW_WARPS = 8
_CFG = _common.BoundedCache()  # width -> launch configuration


def _launch_cfg(n: int) -> tuple[int, int, int]:
    n = int(n)  # (a symbolic width while torch.compile traces: the block sizes fix it)
    cfg = _CFG.get(n)
    if cfg is None:
        block_n = _common.next_pow2(max(n, 1))
        block_m = max(1, min(64, TILE // block_n))
        tile = block_m * block_n
        warps = 4 if tile <= 2048 else (8 if tile <= 8192 else 16)
        cfg = _CFG[n] = (block_m, block_n, warps)
    return cfg


def _rows(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """t as rows of width n with unit column stride: (tensor, row stride). A contiguous t is used
    as it is (no reshape: a view op costs microseconds of host time per call)."""
    if t.is_contiguous():
        return t, n
    t2 = t.reshape(-1, n)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2, t2.stride(0)


def rmsnorm_fwd(x, weight, eps, casting, offset):
    """(y shaped like x, x as the backward reads it, rstd (M,))."""
    n = x.shape[-1]
    x2, sx = _rows(x, n)
    m = x.numel() // n if n else 0
    gemma = casting == "gemma"
    dt = x.dtype if gemma or weight.dtype is x.dtype else torch.promote_types(weight.dtype, x.dtype)
    y = _common.empty(x.shape, dt, x.device)
    rstd = _common.empty((m,), torch.float64 if x.dtype is torch.float64 else torch.float32, x.device)
    if m:
        block_m, block_n, warps = _launch_cfg(n)
        _fwd[(-(-m // block_m),)](
            x2, weight if weight.is_contiguous() else weight.contiguous(), y, rstd, sx, n, m, n,
            float(eps), float(offset), BLOCK_M=block_m, BLOCK_N=block_n, GEMMA=gemma,
            ACC=_common.acc(x.dtype), num_warps=warps,
        )
    return y, x2, rstd


def rmsnorm_bwd(dy, x2, weight, rstd, casting, offset):
    """(dx shaped like x2, dw)."""
    n = x2.shape[-1]
    m = rstd.shape[0]
    sx = n if x2.is_contiguous() else x2.stride(0)
    dy2, sdy = _rows(dy, n)
    dx = _common.empty(x2.shape, x2.dtype, x2.device)
    if m == 0:
        return dx, torch.zeros_like(weight)
    block_m, block_n, warps = _launch_cfg(n)
    progs = min(-(-m // block_m), BWD_PROGS_PER_SM * _common.num_sms(x2.device))
    acc_t = torch.float64 if x2.dtype is torch.float64 else torch.float32
    dw_part = _common.empty((progs, n), acc_t, x2.device)
    _bwd[(progs,)](
        dy2, x2, weight if weight.is_contiguous() else weight.contiguous(), rstd, dx, dw_part,
        sdy, sx, n if dx.is_contiguous() else dx.stride(0), m, n, float(offset),
        BLOCK_M=block_m, BLOCK_N=block_n, GEMMA=casting == "gemma", ACC=_common.acc(x2.dtype),
        num_warps=warps,
    )
    dw = _common.empty((n,), weight.dtype, x2.device)
    _dw_reduce[(-(-n // DW_BLOCK_N),)](dw_part, dw, progs, n, BLOCK_P=DW_BLOCK_P, BLOCK_N=DW_BLOCK_N,
                                       num_warps=DW_WARPS)
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, casting, offset):
        y, x2, rstd = rmsnorm_fwd(x, weight, eps, casting, offset)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.cfg = (casting, offset, x.shape)
        return y

    @staticmethod
    @no_double_backward("rmsnorm")
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        casting, offset, shape = ctx.cfg
        dx, dw = rmsnorm_bwd(dy, x2, weight, rstd, casting, offset)
        if dx.shape != shape:
            dx = dx.view(shape)
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None


def _op_fwd(x, weight, *, eps, casting, offset):
    y, _x2, rstd = rmsnorm_fwd(x, weight, eps, casting, offset)
    return (y,), (rstd,)


def _op_bwd(inputs, res, grads, needs, *, eps, casting, offset):
    x, weight = inputs
    x2, _ = _rows(x, x.shape[-1])
    dx, dw = rmsnorm_bwd(grads[0], x2, weight, res[0], casting, offset)
    return {"x": dx.view(x.shape), "weight": dw}


RMSNORM = _ops.register(_ops.KernelDef("rmsnorm", _op_fwd, _op_bwd, names=("x", "weight"), diff=("x", "weight"),
                                       n_out=1, inductor=True))

_OK_CFG = _common.Validated()  # (casting, eps, offset) already checked by the spec


def _hot(x, weight, eps, casting, offset) -> bool:
    """The common case, checked in a few attribute reads: what spec.check would accept."""
    try:
        return (_common.hot_tensors(x, weight) and weight.dim() == 1 and x.dim() >= 1
                and weight.shape[0] == x.shape[-1] <= MAX_WIDTH
                and x.get_device() == weight.get_device() and (casting, eps, offset) in _OK_CFG)
    except TypeError:  # an unhashable argument: let spec.check say what is wrong
        return False


def _check(x, weight, eps, casting, offset):
    spec.check(x, weight, eps, casting, offset)
    _common.check_device(x=x, weight=weight)
    if x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"x's last dimension {x.shape[-1]} exceeds the kernel's maximum width {MAX_WIDTH}")


def rmsnorm(x, weight, eps: float = 1e-6, *, casting: str = "llama", offset: float = 0.0):
    """Triton RMSNorm with the signature of ``forge.spec.rmsnorm.reference``."""
    if _ops._compiling():
        _check(x, weight, eps, casting, offset)
        return _ops.call(RMSNORM, x, weight, eps=float(eps), casting=casting, offset=float(offset))[0]
    if not _hot(x, weight, eps, casting, offset):
        _check(x, weight, eps, casting, offset)
        _OK_CFG.add((casting, eps, offset))
    if not _common.needs_autograd(x, weight):
        return rmsnorm_fwd(x, weight, eps, casting, offset)[0]
    return RMSNormFunction.apply(x, weight, eps, casting, offset)
