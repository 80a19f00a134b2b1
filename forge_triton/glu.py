"""Gated activations in Triton: SwiGLU (silu) and GeGLU (gelu tanh), forward and backward.

Specs: forge/spec/swiglu.py and forge/spec/geglu.py (derivatives there). Elementwise over the
flattened tensors; math in fp32. The forward rounds act(gate) to the input dtype before the
product, as eager torch does, so patched models reproduce eager bit for bit in most elements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from forge import _gated_mlp
from forge.spec import gated_mlp as mlp_spec
from forge.spec import geglu as geglu_spec
from forge.spec import swiglu as swiglu_spec

from . import _common, _launch
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
# With WITH_Y the kernel also writes y itself (recomputed, rounded as the forward rounds it), for
# a caller that did not keep it (the gated MLP). Every element is read before it is written at
# the same offset by the same program, so dg/du/y may alias g/u/dy (the MLP passes them so).
@triton.jit
def _glu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, y_ptr, n, BLOCK: tl.constexpr, GELU: tl.constexpr,
                    ACC: tl.constexpr, WITH_Y: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(ACC)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(ACC)
    a, da = _act_and_grad(g, GELU)
    tl.store(dg_ptr + offs, cast(dy * u * da, dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, cast(dy * a, du_ptr.dtype.element_ty), mask=mask)
    if WITH_Y:
        a = cast(a, y_ptr.dtype.element_ty).to(ACC)
        tl.store(y_ptr + offs, cast(a * u, y_ptr.dtype.element_ty), mask=mask)


_fwd = _launch.FastKernel(_glu_fwd_kernel)
_bwd = _launch.FastKernel(_glu_bwd_kernel)


def _dense(t):
    return t if t.is_contiguous() else t.contiguous()


def glu_fwd(gate, up, gelu: bool):
    g, u = _dense(gate), _dense(up)
    y = _common.empty_like(g)
    n = g.numel()
    if n:
        _fwd[(-(-n // BLOCK),)](g, u, y, n, BLOCK=BLOCK, GELU=gelu, ACC=_common.acc(g.dtype), num_warps=8)
    return y, g, u


def glu_bwd(dy, g, u, gelu: bool):
    dy = _dense(dy)
    dg = _common.empty_like(g)
    du = _common.empty_like(u)
    n = g.numel()
    if n:
        _bwd[(-(-n // BLOCK),)](dy, g, u, dg, du, dy, n, BLOCK=BLOCK, GELU=gelu, ACC=_common.acc(g.dtype),
                                WITH_Y=False, num_warps=8)
    return dg, du


def glu_bwd_inplace(dy, g, u, gelu: bool):
    """The gated MLP's backward step, in place: g <- dL/dg, u <- dL/du, dy <- act(g) * u (the
    forward's output, recomputed). All three contiguous, of one shape and dtype; the caller owns
    them (they are its saved activations and its own dL/dy). Returns (dg, du, y), i.e. (g, u, dy)."""
    n = g.numel()
    if n:
        _bwd[(-(-n // BLOCK),)](dy, g, u, g, u, dy, n, BLOCK=BLOCK, GELU=gelu, ACC=_common.acc(g.dtype),
                                WITH_Y=True, num_warps=8)
    return g, u, dy


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
    if not (_common.hot_tensors(gate, up) and gate.dtype is up.dtype and gate.shape == up.shape
            and gate.get_device() == up.get_device()):
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


def _mlp_ops(gelu: bool) -> _gated_mlp.ActOps:
    return _gated_mlp.ActOps(
        act=lambda g, u: glu_fwd(g, u, gelu)[0],
        act_bwd=lambda dh, g, u: glu_bwd_inplace(dh, g, u, gelu),
        inplace=True, device_type="cpu" if _common.INTERPRET else "cuda")


_MLP_OPS = {False: _mlp_ops(False), True: _mlp_ops(True)}


def gated_mlp(x, w_gate, w_up, w_down, *, act: str = "silu", recompute: bool = False):
    """Triton gated MLP (forge.spec.gated_mlp): cuBLAS products around the GLU kernels."""
    if not (_common.hot_tensors(x, w_gate, w_up, w_down) and x.dtype is w_gate.dtype is w_up.dtype
            is w_down.dtype and act in mlp_spec.ACTS and w_gate.dim() == 2 and w_down.dim() == 2
            and w_gate.shape == w_up.shape and w_gate.shape[1] == x.shape[-1] == w_down.shape[0]
            and w_down.shape[1] == w_gate.shape[0]
            and x.get_device() == w_gate.get_device() == w_up.get_device() == w_down.get_device()):
        mlp_spec.check(x, w_gate, w_up, w_down, act)
        _common.check_device(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    return _gated_mlp.apply(_MLP_OPS[act == "gelu_tanh"], x, w_gate, w_up, w_down, recompute)
