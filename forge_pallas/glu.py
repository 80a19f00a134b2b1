"""SwiGLU and GeGLU (tanh) activations, forward and backward, as Pallas kernels
(spec: forge/spec/swiglu.py, forge/spec/geglu.py).

Elementwise over the flattened tensors: ``block`` elements per program, masked tail. fp32 math,
one rounding per output. The backward recomputes the activation from gate (nothing saved).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _common as C

_K = math.sqrt(2.0 / math.pi)
_A = 0.044715


def _sigmoid_pair(x):
    """(sigmoid(x), 1 - sigmoid(x)), each to full relative precision: forming 1 - s by
    subtraction loses it where s is near 1 (it cost GeGLU's gradient 6 ulp in fp32)."""
    e = jnp.exp(-jnp.abs(x))
    p = 1.0 / (1.0 + e)
    q = e * p
    pos = x >= 0
    return jnp.where(pos, p, q), jnp.where(pos, q, p)


def _act(g, kind):
    """(act(g), act'(g)) in the accumulation dtype."""
    if kind == "swiglu":
        s, one_minus_s = _sigmoid_pair(g)
        return g * s, s * (1.0 + g * one_minus_s)
    # tanh-GELU through p = 0.5 * (1 + tanh(z)) = sigmoid(2z), which does not cancel for g << 0;
    # 1 - tanh(z)^2 = 4 p (1 - p), so gelu' = p + 2 g p (1 - p) z'
    z = _K * (g + _A * g * g * g)
    p, one_minus_p = _sigmoid_pair(2.0 * z)
    return g * p, p + 2.0 * g * p * one_minus_p * _K * (1.0 + 3.0 * _A * g * g)


def _blocks(t_ref, block, body):
    """``body(s, mask)`` over this program's ``block`` elements. A whole block runs unmasked: the
    element count is read at run time, so Triton cannot prove that a mask against it is constant
    over a vector's lanes, and masked loads and stores go one element at a time (twice the
    kernel's time at the model's MLP shape). Only the tail block is masked."""
    total = C.read_rows(t_ref)  # elements, at run time
    start = pl.program_id(0) * block
    s = C.ds(start, block)
    whole = start + block <= total
    pl.when(whole)(lambda: body(s, None))
    pl.when(jnp.logical_not(whole))(lambda: body(s, start + jnp.arange(block) < total))


def _ld(ref, s, mask, acc):
    return C.load(ref.at[s], mask=mask, other=None if mask is None else 0.0).astype(acc)


def _glu_fwd_kernel(g_ref, u_ref, t_ref, y_ref, *, kind, block):
    acc = C.acc_dtype(g_ref.dtype)

    def body(s, mask):
        a, _ = _act(_ld(g_ref, s, mask, acc), kind)
        C.store(y_ref.at[s], (a * _ld(u_ref, s, mask, acc)).astype(y_ref.dtype), mask=mask)

    _blocks(t_ref, block, body)


# y = act(g) * u  =>  dg = dy * u * act'(g),  du = dy * act(g)   (act' in _act, derivations in spec)
# With a y_ref (the gated MLP's backward) the kernel also writes y = act(g) * u, recomputed as
# the forward computes it, for a caller that did not keep it.
def _glu_bwd_kernel(g_ref, u_ref, dy_ref, t_ref, dg_ref, du_ref, *y_ref, kind, block):
    acc = C.acc_dtype(g_ref.dtype)

    def body(s, mask):
        u, dy = _ld(u_ref, s, mask, acc), _ld(dy_ref, s, mask, acc)
        a, da = _act(_ld(g_ref, s, mask, acc), kind)
        C.store(dg_ref.at[s], (dy * u * da).astype(dg_ref.dtype), mask=mask)
        C.store(du_ref.at[s], (dy * a).astype(du_ref.dtype), mask=mask)
        if y_ref:
            C.store(y_ref[0].at[s], (a * u).astype(y_ref[0].dtype), mask=mask)

    _blocks(t_ref, block, body)


# elements per program: 2-4 KB per tensor, plenty of programs at MLP sizes. One size whatever the
# element count (a small tensor is one masked program), so the lowered module does not depend on
# the number of rows. Warps: one 16-byte vector per thread and tensor, as forge_triton's GLU.
# bench/diagnostics/tune_pallas.py swept both (docs/pallas-native.md): 1024 elements on 4 warps ran 1.08x
# Triton's forward and 1.01x its backward at the MLP shapes, 2048 on 8 warps 1.10x and 1.02x,
# larger blocks 1.13-1.43x (each program first waits on its run-time element count; smaller
# programs, more of them resident, hide that wait better)
_BLOCK = 1024
_WARPS = 4

# The lowering choice for this kernel lives here (Triton lowering; see _common).
_launch = C.triton_call


def glu_fwd(gate, up, *, kind):
    """gate, up (...) -> ((y,), ()) with y = act(gate) * up, kind "swiglu" or "geglu"."""
    shape, total = gate.shape, gate.size
    block = _BLOCK
    y = _launch(
        functools.partial(_glu_fwd_kernel, kind=kind, block=block), name=f"{kind}_fwd",
        grid=(C.row_programs(C.cdiv(total, block)),), num_warps=_WARPS,
        out_shape=jax.ShapeDtypeStruct((total,), gate.dtype),
    )(gate.reshape(-1), up.reshape(-1), C.rows_operand(total))
    return (y.reshape(shape),), ()


def glu_bwd(inputs, res, grads, *, kind):
    """(gate, up), (), (dy,) -> (d_gate, d_up)."""
    del res
    gate, up = inputs
    (dy,) = grads
    shape, total = gate.shape, gate.size
    block = _BLOCK
    dg, du = _launch(
        functools.partial(_glu_bwd_kernel, kind=kind, block=block), name=f"{kind}_bwd",
        grid=(C.row_programs(C.cdiv(total, block)),), num_warps=_WARPS,
        out_shape=(jax.ShapeDtypeStruct((total,), gate.dtype), jax.ShapeDtypeStruct((total,), up.dtype)),
    )(gate.reshape(-1), up.reshape(-1), dy.reshape(-1), C.rows_operand(total))
    return dg.reshape(shape), du.reshape(shape)


def glu_bwd_act(dy, gate, up, *, kind):
    """dy, gate, up (...) -> ((d_gate, d_up, y), ()): the backward plus the forward's output y
    recomputed (the gated MLP keeps gate and up, not y)."""
    shape, total = gate.shape, gate.size
    block = _BLOCK
    sds = jax.ShapeDtypeStruct((total,), gate.dtype)
    dg, du, y = _launch(
        functools.partial(_glu_bwd_kernel, kind=kind, block=block), name=f"{kind}_bwd_act",
        grid=(C.row_programs(C.cdiv(total, block)),), num_warps=_WARPS, out_shape=(sds, sds, sds),
    )(gate.reshape(-1), up.reshape(-1), dy.reshape(-1), C.rows_operand(total))
    return (dg.reshape(shape), du.reshape(shape), y.reshape(shape)), ()


swiglu_fwd = functools.partial(glu_fwd, kind="swiglu")
swiglu_bwd = functools.partial(glu_bwd, kind="swiglu")
geglu_fwd = functools.partial(glu_fwd, kind="geglu")
geglu_bwd = functools.partial(glu_bwd, kind="geglu")
