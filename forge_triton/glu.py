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
from forge.spec._check import no_double_backward

from . import _common, _launch, _ops
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


def glu_bwd_act(dy, g, u, gelu: bool):
    """:func:`glu_bwd_inplace` into fresh tensors: (dg, du, y)."""
    dy, g, u = _dense(dy), _dense(g), _dense(u)
    dg, du, y = _common.empty_like(g), _common.empty_like(u), _common.empty_like(dy)
    n = g.numel()
    if n:
        _bwd[(-(-n // BLOCK),)](dy, g, u, dg, du, y, n, BLOCK=BLOCK, GELU=gelu, ACC=_common.acc(g.dtype),
                                WITH_Y=True, num_warps=8)
    return dg, du, y


class GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, gelu):
        y, g, u = glu_fwd(gate, up, gelu)
        ctx.save_for_backward(g, u)
        ctx.gelu = gelu
        return y

    @staticmethod
    @no_double_backward("GLU")
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dg, du = glu_bwd(dy, g, u, ctx.gelu)
        return dg, du, None


def _op_fwd(gate, up, *, gelu):
    return (glu_fwd(gate, up, gelu)[0],), ()


def _op_bwd(inputs, res, grads, needs, *, gelu):
    g, u = inputs
    dg, du = glu_bwd(grads[0], _dense(g), _dense(u), gelu)
    return {"gate": dg, "up": du}


def _op_bwd_act(dh, g, u, *, gelu):
    return glu_bwd_act(dh, g, u, gelu), ()


# the op layer's kernels: the GLU, differentiable, and the gated MLP's backward step (no autograd)
GLU = _ops.register(_ops.KernelDef("glu", _op_fwd, _op_bwd, names=("gate", "up"), diff=("gate", "up"), n_out=1,
                                   inductor=True))
GLU_BWD_ACT = _ops.register(_ops.KernelDef("glu_bwd_act", _op_bwd_act, None, names=("dh", "gate", "up"), diff=(),
                                           n_out=3, inductor=True))


def _glu(spec_check, gate, up, gelu: bool):
    if _ops._compiling():
        spec_check(gate, up)
        _common.check_device(gate=gate, up=up)
        return _ops.call(GLU, gate, up, gelu=gelu)[0]
    if not (_common.hot_tensors(gate, up) and gate.dtype is up.dtype and gate.shape == up.shape
            and gate.dim() >= 1 and gate.get_device() == up.get_device()):
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


def _act(gelu):
    def act(g, u):
        if _ops._compiling():
            return _ops.call(GLU, g, u, gelu=gelu)[0]
        return glu_fwd(g, u, gelu)[0]

    return act


def _act_bwd(gelu):
    def act_bwd(dh, g, u):
        if _ops._compiling():
            return _ops.call(GLU_BWD_ACT, dh, g, u, gelu=gelu)
        return glu_bwd_inplace(dh, g, u, gelu)

    return act_bwd


def mlp_act(act: str) -> dict:
    """The gated MLP's pieces for the op layer's node (forge.ops.gated_mlp): the activation
    forward ``act(g, u) -> h`` and backward step ``act_bwd(dh, g, u) -> (dg, du, h)`` without
    autograd. Eagerly the backward step writes over g, u and dh (``inplace``); under
    torch.compile both run as ops (``torch.ops.forge.triton_glu*``) into fresh tensors;
    ``act_bwd_fresh`` is the step into fresh tensors (the node's op, which may not write over
    its inputs)."""
    gelu = act == "gelu_tanh"
    return dict(act=_act(gelu), act_bwd=_act_bwd(gelu), inplace=True,
                device_type="cpu" if _common.INTERPRET else "cuda",
                act_bwd_fresh=lambda dh, g, u: glu_bwd_act(dh, g, u, gelu))
