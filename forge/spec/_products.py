"""Matrix products through torch (cuBLAS) with the roundings the fused loss's spec allows, and
the row-chunk strategy's products, shared by both backends' fused loss (forge_triton's and
bridge's): a backend supplies only its kernels for a chunk's statistics and dL/dz.

Torch only, like the rest of forge.spec.
"""
from __future__ import annotations

import contextlib

import torch

_ADDMM_F32 = None  # whether torch.addmm(out_dtype=fp32) accumulates in place here
_MM_F32 = None  # whether torch.mm(out_dtype=fp32) exists here (torch >= 2.8 on CUDA)


def mm_f32(a, b):
    """a @ b with an fp32 (fp64) result from low-precision operands: cuBLAS accumulates in fp32
    and writes fp32, so the logits carry no bf16 rounding (the spec's logits are fp32)."""
    global _MM_F32
    if a.dtype in (torch.float32, torch.float64):
        return torch.mm(a, b)
    if a.is_cuda and _MM_F32 is not False:
        try:
            out = torch.mm(a, b, out_dtype=torch.float32)
            _MM_F32 = True
            return out
        except (RuntimeError, TypeError):
            _MM_F32 = False
    return torch.mm(a.float(), b.float())  # the interpreter path (CPU tests), or an old torch


def addmm_f32_(acc, a, b):
    """acc += a @ b, acc fp32, a and b in the input dtype."""
    global _ADDMM_F32
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if a.is_cuda and _ADDMM_F32 is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _ADDMM_F32 = True
            return
        except (RuntimeError, TypeError):  # older torch: no in-place fp32-out addmm
            _ADDMM_F32 = False
    acc.add_(mm_f32(a, b))


_REDUCED_FLAG = {torch.bfloat16: "allow_bf16_reduced_precision_reduction",
                 torch.float16: "allow_fp16_reduced_precision_reduction"}


@contextlib.contextmanager
def _one_rounding(dtype):
    """cuBLAS may not reduce split-K partial sums in ``dtype`` (torch allows it by default for
    bf16/fp16): the flag is cleared for the call, so a product written in ``dtype`` is rounded
    once from its fp32 accumulation."""
    flags, attr = torch.backends.cuda.matmul, _REDUCED_FLAG[dtype]
    old = getattr(flags, attr)
    setattr(flags, attr, False)
    try:
        yield
    finally:
        setattr(flags, attr, old)


def mm_into(out, a, b):
    """out = a @ b, fp32 accumulation rounded once to out's dtype: cuBLAS writes bf16/fp16 out
    directly (:func:`_one_rounding`); else through an fp32 temporary."""
    if a.dtype == out.dtype and out.dtype in (torch.float32, torch.float64):
        torch.mm(a, b, out=out)
        return
    if not (a.is_cuda and out.dtype in _REDUCED_FLAG and a.dtype == out.dtype):
        out.copy_(mm_f32(a, b))
        return
    with _one_rounding(out.dtype):
        torch.mm(a, b, out=out)


def addmm_into_(out, a, b):
    """out += a @ b in one cuBLAS call (beta = 1): fp32 accumulation of the product and out,
    rounded once to out's dtype."""
    if not (out.is_cuda and out.dtype in _REDUCED_FLAG):
        out.addmm_(a, b)
        return
    with _one_rounding(out.dtype):
        out.addmm_(a, b)


def _empty(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


def row_chunks(hidden, weight, chunk_rows, need_h, need_w, need_b, kernels, empty=_empty):
    """The row-chunk strategy's products: per chunk of C rows, z = h[chunk] @ W^T (C, V) in fp32;
    ``kernels(r0, r1, z)`` (the backend's) forms the chunk's statistics and loss rows and returns
    dL/dz (C, V) in hidden's dtype, or None where no gradient is wanted; then grad_h[chunk] =
    dz @ W (fp32, written once), grad_W = dz^T @ h[chunk] for the first chunk and += (cuBLAS
    beta = 1) after it, rounded once per chunk, and grad_b += dz's column sums. Eager's three
    products. Returns (grad_h fp32 | None, grad_W | None, grad_b fp32 | None), unscaled.
    ``empty(shape, dtype, device)``: how grad_W's buffer is made (every row written by the first
    chunk)."""
    n, hd = hidden.shape
    v = weight.shape[0]
    dev, dt = hidden.device, hidden.dtype
    acc_t = torch.float64 if dt == torch.float64 else torch.float32
    gh = torch.zeros((n, hd), dtype=acc_t, device=dev) if need_h else None
    gw = None
    if need_w:  # (none without rows)
        gw = empty(weight.shape, weight.dtype, dev) if n else torch.zeros_like(weight)
    gb = torch.zeros((v,), dtype=acc_t, device=dev) if need_b else None
    wt = weight.t()
    for i, r0 in enumerate(range(0, n, chunk_rows)):
        r1 = min(r0 + chunk_rows, n)
        h_c = hidden[r0:r1]
        g = kernels(r0, r1, mm_f32(h_c, wt))  # (C, V)
        if g is None:
            continue
        if need_h:
            addmm_f32_(gh[r0:r1], g, weight)  # (C, H) = (C, V) @ (V, H), once per row
        if need_w:
            (mm_into if i == 0 else addmm_into_)(gw, g.t(), h_c)  # (V, H)
        if need_b:
            gb += g.sum(0, dtype=acc_t)
        del g
    return gh, gw, gb
