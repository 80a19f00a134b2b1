"""The torch side of a plan's XLA equations: each primitive a plan may hold (``PRIMS``), as the
torch op that computes it, and the conversions between JAX's and torch's dtypes.

Each entry of ``PRIMS``: ``(params, ctx) -> fn(*operands)`` returning one value or a list
(multiple results). ``params`` are the equation's, as plain data (``PARAMS`` names the ones a
recipe keeps: lists, ints, dtype names); ``ctx`` (:class:`Ctx`) holds the equation's output
dtype and shape and the plan's device. Operands are torch tensors or Python scalars (literals,
and what folds from them). The products go through cuBLAS, reshapes are views. An equation
whose primitive is not here keeps its kernel on the DLPack path (``state.Unsupported``).
"""
from __future__ import annotations

import torch

from . import state


def torch_dtype(jdt) -> torch.dtype:
    """A JAX dtype, or its name as a recipe keeps it (``"bfloat16"``), as torch's."""
    name = str(jdt)
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise state.Unsupported(f"dtype {name}")
    return dt


def jax_dtype(tdt):
    import jax.numpy as jnp

    return jnp.dtype(str(tdt).removeprefix("torch."))


class Ctx:
    __slots__ = ("out_dtype", "out_shape", "dev")


def _convert(p, ctx):
    dt = torch_dtype(p["new_dtype"])
    py = float if dt.is_floating_point else (bool if dt == torch.bool else int)
    return lambda x: x.to(dt) if isinstance(x, torch.Tensor) else py(x)


def _reshape(p, ctx):
    if p.get("dimensions") is not None:
        raise state.Unsupported("reshape with dimensions")
    shape = tuple(p["new_sizes"])
    return lambda x: x.reshape(shape)


_SMALL: dict = {}  # (value, shape, dtype, device) -> a constant int tensor (row counts)


def _small_const(x, shape, dtype, dev):
    """A few ints as a device tensor, made once per device: the row-count operands of the
    kernels (forge_pallas/_common.rows_operand) would otherwise cost a fill kernel per call.
    Nothing writes them (``launch.pallas_step`` copies one an output would alias). Not kept when made
    inside a CUDA-graph capture (the graph's memory pool owns it)."""
    key = (x, shape, dtype, dev)
    t = _SMALL.get(key)
    if t is None:
        t = torch.full(shape, x, dtype=dtype, device=dev)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()) and len(_SMALL) < 4096:
            t._forge_shared = True
            _SMALL[key] = t
    return t


def _broadcast(p, ctx):
    shape, dims = tuple(p["shape"]), tuple(p["broadcast_dimensions"])
    small = not ctx.out_dtype.is_floating_point and ctx.out_dtype != torch.bool and len(shape) == 1 and shape[0] <= 8

    def fn(x):
        if not isinstance(x, torch.Tensor):
            if small:
                return _small_const(x, shape, ctx.out_dtype, ctx.dev)
            return torch.full(shape, x, dtype=ctx.out_dtype, device=ctx.dev)
        view = [1] * len(shape)
        for i, d in enumerate(dims):
            view[d] = x.shape[i]
        return x.reshape(view).expand(shape)

    return fn


def _pad(p, ctx):
    cfg = p["padding_config"]
    if any(int(c[2]) for c in cfg):
        raise state.Unsupported("pad with interior padding")
    pads = [int(v) for lo, hi, _ in reversed(cfg) for v in (lo, hi)]

    def fn(x, value):
        if isinstance(value, torch.Tensor):
            raise state.Unsupported("pad with a traced padding value")
        return torch.nn.functional.pad(x, pads, value=value)

    return fn


def _mm(a, b, out_dtype):
    """a (M, K) @ b (K, N), accumulated in fp32, rounded once to ``out_dtype``."""
    if a.dtype == out_dtype:
        return torch.mm(a, b)
    if not a.is_cuda:
        return torch.mm(a.to(out_dtype), b.to(out_dtype))
    return torch.mm(a, b, out_dtype=out_dtype)  # bf16/fp16 operands, fp32 result (cuBLAS)


def _dot_general(p, ctx):
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    if lb or rb:
        raise state.Unsupported("dot_general with batch dimensions")
    lc, rc = tuple(lc), tuple(rc)
    out = ctx.out_dtype

    def fn(a, b):
        if a.dim() == 2 and b.dim() == 2 and len(lc) == 1:
            a2 = a if lc == (1,) else a.t()
            b2 = b if rc == (0,) else b.t()
            if a2.dtype != b2.dtype:
                a2, b2 = a2.to(out), b2.to(out)
            return _mm(a2, b2, out)
        return torch.tensordot(a.to(out), b.to(out), dims=(lc, rc))

    return fn


def _elementwise(op):
    return lambda p, ctx: op


def _reduce(op):
    def make(p, ctx):
        axes = tuple(p["axes"])
        return lambda x: op(x, axes)

    return make


def _slice(p, ctx):
    start, limit = p["start_indices"], p["limit_indices"]
    strides = p.get("strides") or (1,) * len(start)
    idx = tuple(slice(int(s), int(e), int(st)) for s, e, st in zip(start, limit, strides))
    return lambda x: x[idx]


def _to_shape(p, ctx):
    return lambda x: x.reshape(ctx.out_shape)


def _concatenate(p, ctx):
    dim = int(p["dimension"])
    return lambda *xs: torch.cat(xs, dim=dim)


def _transpose(p, ctx):
    perm = tuple(p["permutation"])
    return lambda x: x.permute(perm)


PRIMS = {
    "convert_element_type": _convert,
    "reshape": _reshape,
    "squeeze": _to_shape,
    "expand_dims": _to_shape,
    "broadcast_in_dim": _broadcast,
    "pad": _pad,
    "concatenate": _concatenate,
    "dot_general": _dot_general,
    "transpose": _transpose,
    "slice": _slice,
    "reduce_sum": _reduce(lambda x, axes: x.sum(dim=axes)),
    "reduce_max": _reduce(lambda x, axes: x.amax(dim=axes)),
    "add": _elementwise(lambda a, b: a + b),
    "add_any": _elementwise(lambda a, b: a + b),
    "sub": _elementwise(lambda a, b: a - b),
    "mul": _elementwise(lambda a, b: a * b),
    "div": _elementwise(lambda a, b: a / b),
    "neg": _elementwise(lambda a: -a),
    "max": _elementwise(lambda a, b: torch.maximum(a, b)),
    "min": _elementwise(lambda a, b: torch.minimum(a, b)),
    "copy": _elementwise(lambda a: a.clone()),
    "copy_p": _elementwise(lambda a: a.clone()),
}


# the parameters each entry of PRIMS reads (a recipe keeps these, as plain data, and no others)
PARAMS = {
    "convert_element_type": ("new_dtype",),
    "reshape": ("new_sizes", "dimensions"),
    "broadcast_in_dim": ("shape", "broadcast_dimensions"),
    "pad": ("padding_config",),
    "concatenate": ("dimension",),
    "dot_general": ("dimension_numbers",),
    "transpose": ("permutation",),
    "slice": ("start_indices", "limit_indices", "strides"),
    "reduce_sum": ("axes",),
    "reduce_max": ("axes",),
}


def plain(v):
    """A jaxpr parameter as JSON data: tuples as lists, numpy scalars as Python's, dtypes by name."""
    import numpy as np

    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [plain(x) for x in v]
    if isinstance(v, np.dtype) or type(v).__name__ == "dtype":
        return str(torch_dtype(v)).removeprefix("torch.")
    if isinstance(v, np.generic):
        return v.item()
    raise state.Unsupported(f"a parameter of type {type(v).__name__}")
