"""A product of a few rows by a weight, read once: ``y = x W^T (+ b)``, for the decoding steps.

At batch 1 a decoding step's dense products (q/k/v stored together, o, a router, the LM head)
each multiply one row by a weight matrix: the time is the weight's bytes read from memory.
cuBLAS picks a tensor-core kernel tiled for many rows there and reaches 0.4-0.8 of the copy
bandwidth on the narrow ones; a matrix-vector kernel (each program a few output features, the
whole of K walked in wide tiles, fp32 sums) gets closer (docs/generate.md, "One-row products").
Equivalent torch::

    y = (x.float() @ w.float().T + (0 if b is None else b.float())).to(x.dtype)

Arguments: ``x`` (M, K) with unit stride along K (rows at any stride); ``w`` (N, K), contiguous,
of x's dtype; ``b`` None or (N,) of that dtype. float16, bfloat16 or float32. Returns a new (M, N)
tensor of x's dtype. Sums are fp32 (the order is the kernel's own: the last bits may differ from
cuBLAS's). Each row reads the whole weight, so the kernels are for M of 1 to a few; forward only
(the decoding path runs without gradients).

With ``r`` (M, N) of x's dtype, unit stride along N (a residual stream's row), the same launch
also writes the sum a decoder layer makes next: returns ``(y, s)`` with ``s = y + r`` rounded as
torch rounds that addition (y first to x's dtype, then the sum in fp32, then to x's dtype), so
``s`` equals ``y + r`` computed after the product, bit for bit.

``glu_reference(x, w, act)``: a gated MLP's first half at one row, for weights stored together
(``w`` (2I, K): the gate's I rows, then the up's): ``act(g) * u`` with ``g`` and ``u`` the two
products, each rounded to x's dtype as the product above writes them, then ``act(g)`` rounded to
it and the product with ``u`` rounded (torch's eager order, which the GLU kernels keep:
forge.spec.swiglu, forge.spec.geglu): what the product followed by the GLU kernel gives, in one
launch. Returns (M, I).
"""
from __future__ import annotations

import torch

from . import _check
from . import geglu as _geglu
from . import swiglu as _swiglu

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTS = {"silu": _swiglu.reference, "gelu_tanh": _geglu.reference}  # the gated activations of glu_reference


def check(x, w, b=None, r=None) -> None:
    _check.tensor("x", x)
    _check.tensor("w", w)
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x must be (M, K) and w (N, K), got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    _check.same_dtype("x", x, "w", w)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but w takes {w.shape[1]} (w is (N, K) = {tuple(w.shape)})")
    if b is not None:
        _check.tensor("b", b)
        if tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"b must be (N,) = ({w.shape[0]},) for w {tuple(w.shape)}, got {tuple(b.shape)}")
        _check.same_dtype("x", x, "b", b)
    if not w.is_contiguous():
        raise ValueError("w must be contiguous (N, K), as an nn.Linear holds its weight")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along K, got strides {x.stride()}")
    if r is not None:
        _check.tensor("r", r)
        if tuple(r.shape) != (x.shape[0], w.shape[0]):
            raise ValueError(f"r must be (M, N) = ({x.shape[0]}, {w.shape[0]}), got {tuple(r.shape)}")
        _check.same_dtype("x", x, "r", r)
        if r.shape[1] > 1 and r.stride(1) != 1:
            raise ValueError(f"r must have unit stride along N, got strides {r.stride()}")
    _check.same_device(x=x, w=w, b=b, r=r)


def reference(x, w, b=None, r=None):
    check(x, w, b, r)
    y = x.float() @ w.float().T
    if b is not None:
        y = y + b.float()
    y = y.to(x.dtype)
    return y if r is None else (y, (y.float() + r.float()).to(x.dtype))


def check_glu(x, w, act) -> None:
    check(x, w)
    if act not in ACTS:
        raise ValueError(f"act must be one of {tuple(ACTS)}, got {act!r}")
    if w.shape[0] % 2:
        raise ValueError(f"w must hold the gate's rows then the up's, an even number, got {w.shape[0]}")


def glu_reference(x, w, act):
    check_glu(x, w, act)
    g, u = reference(x, w).chunk(2, dim=-1)
    return ACTS[act](g, u)  # (torch's eager rounding: act(g) to the dtype, then the product)
