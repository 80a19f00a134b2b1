"""Gated activations in Triton: SwiGLU (silu) and GeGLU (gelu tanh), forward and backward.

Specs: forge/spec/swiglu.py and forge/spec/geglu.py (derivatives there). Elementwise over the
flattened tensors; math in fp32. The forward rounds act(gate) to the input dtype before the
product, as eager torch does, so patched models reproduce eager bit for bit in most elements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forge.spec import geglu as geglu_spec
from forge.spec import swiglu as swiglu_spec

from . import _common
from ._common import cast

BLOCK = 2048
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_C = tl.constexpr(0.044715)


@triton.jit
def _act_and_grad(g, GELU: tl.constexpr):
    """act(g) and act'(g) in the compute dtype of g."""
    if GELU:
        # 0.5 * (1 + tanh(z)) == sigmoid(2z): no cancellation near 0, unlike 1 - 2 / (e^2z + 1)
        z2 = 2.0 * SQRT_2_OVER_PI * (g + GELU_C * g * g * g)
        s, one_minus_s = _common.sigmoid_pair(z2)
        a = g * s
        da = s + 2.0 * g * s * one_minus_s * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * g * g)
    else:
        s, one_minus_s = _common.sigmoid_pair(g)
        a = g * s
        da = s * (1.0 + g * one_minus_s)
    return a, da


@triton.jit
def _glu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr, GELU: tl.constexpr, ACC: tl.constexpr):  # (n,) each
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(ACC)
    a, _ = _act_and_grad(g, GELU)
    a = cast(a, y_ptr.dtype.element_ty).to(ACC)
    tl.store(y_ptr + offs, cast(a * u, y_ptr.dtype.element_ty), mask=mask)


# y = act(g) * u  =>  dg = dy * u * act'(g),  du = dy * act(g)
@triton.jit
def _glu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr, GELU: tl.constexpr, ACC: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(ACC)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(ACC)
    a, da = _act_and_grad(g, GELU)
    tl.store(dg_ptr + offs, cast(dy * u * da, dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, cast(dy * a, du_ptr.dtype.element_ty), mask=mask)


def _grid(n):
    return (triton.cdiv(n, BLOCK),)


def glu_fwd(gate, up, gelu: bool):
    g, u = gate.contiguous(), up.contiguous()
    y = _common.empty(g.shape, g.dtype, g.device)
    if g.numel():
        _glu_fwd_kernel[_grid(g.numel())](g, u, y, g.numel(), BLOCK=BLOCK, GELU=gelu, ACC=_common.acc(g.dtype), num_warps=8)
    return y, g, u


def glu_bwd(dy, g, u, gelu: bool):
    dy = dy.contiguous()
    dg = _common.empty(g.shape, g.dtype, g.device)
    du = _common.empty(u.shape, u.dtype, u.device)
    if g.numel():
        _glu_bwd_kernel[_grid(g.numel())](dy, g, u, dg, du, g.numel(), BLOCK=BLOCK, GELU=gelu, ACC=_common.acc(g.dtype), num_warps=8)
    return dg, du


class GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, gelu):
        y, g, u = glu_fwd(gate, up, gelu)
        ctx.save_for_backward(g, u)
        ctx.gelu = gelu
        return y

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dg, du = glu_bwd(dy, g, u, ctx.gelu)
        return dg, du, None


def _glu(spec_check, gate, up, gelu: bool):
    spec_check(gate, up)
    _common.check_device(gate=gate, up=up)
    if not _common.needs_autograd(gate, up):
        return glu_fwd(gate, up, gelu)[0]
    return GLUFunction.apply(gate, up, gelu)


def swiglu(gate, up):
    """Triton ``silu(gate) * up`` (forge.spec.swiglu)."""
    return _glu(swiglu_spec.check, gate, up, False)


def geglu(gate, up):
    """Triton ``gelu_tanh(gate) * up`` (forge.spec.geglu)."""
    return _glu(geglu_spec.check, gate, up, True)
