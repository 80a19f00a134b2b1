"""Shared helpers for the Pallas kernels: lowering choice, interpret mode, launch sizes.

Lowering: every kernel here is written for Pallas' Triton lowering (``pallas_call`` with
``pallas.triton.CompilerParams``), refs indexed with ``pl.ds`` and masked
``pallas.triton.load/store`` over power-of-two lanes. On the H200 with jax 0.11.2 it matches
Triton's own speed (docs/design.md); jax 0.11 deprecates it in favour of Mosaic GPU, which
needs its own kernels: each kernel module routes its launches through one ``_launch`` function
so a Mosaic GPU variant can be added beside it. Without a GPU in JAX the same calls run with
``interpret=True`` (jax 0.10.2 CPU in CI). Pure JAX: never import torch here.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# jax <= 0.4.3x named it TritonCompilerParams; 0.10.2 and 0.11.x export CompilerParams
_TritonParams = getattr(plt, "CompilerParams", None) or getattr(plt, "TritonCompilerParams")

load = plt.load
store = plt.store
next_power_of_2 = pl.next_power_of_2
cdiv = pl.cdiv


@functools.cache
def jax_has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@functools.cache
def interpret() -> bool:
    """Interpret when JAX has no GPU (or FORGE_PALLAS_INTERPRET=1); decided once per process."""
    return os.environ.get("FORGE_PALLAS_INTERPRET", "0") == "1" or not jax_has_gpu()


@functools.cache
def num_cores() -> int:
    """Streaming multiprocessors of the first GPU (persistent grids); a small number on CPU."""
    if jax_has_gpu():
        return int(getattr(jax.devices("gpu")[0], "core_count", 132) or 132)
    return 4


def i32(v):
    """A Python int as int32 under ``jax_enable_x64`` (loop bounds, indices; see ``ds``)."""
    return jnp.int32(v) if isinstance(v, int) and jax.config.read("jax_enable_x64") else v


def ds(start, size):
    """``pl.ds`` whose Python-int start stays int32 under ``jax_enable_x64`` (gradcheck in float64):
    program ids are int32, and the interpreter rejects int32/int64 mixes in one index."""
    return pl.ds(i32(start), size)


def _whole(shape):
    """The whole array as one block, indexed by element: the kernel sees the full array, as
    without a BlockSpec, but the lowering takes the block's start as the index map's value (0)
    instead of ``0 * block size``, so the array's extents stay out of the Triton IR (only its
    strides, from the trailing dimensions, are in it)."""
    if not shape:
        return None
    return pl.BlockSpec(tuple(pl.Element(int(d)) for d in shape), lambda *_: (0,) * len(shape))


def triton_call(kernel, *, name, grid, out_shape, num_warps, num_stages=None, aliases=None):
    """``pallas_call`` with the Triton lowering (interpreted without a GPU); ``aliases`` (input
    index -> output index) lets an output reuse an input's buffer, updating it in place.

    Every operand is passed whole (:func:`_whole`): with the row count read at run time
    (:func:`rows_operand`), the lowered module then does not depend on the number of rows."""
    outs = out_shape if isinstance(out_shape, (tuple, list)) else None

    def call(*args):
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            in_specs=[_whole(jnp.shape(a)) for a in args],
            out_specs=(type(outs)(_whole(o.shape) for o in outs) if outs is not None
                       else _whole(out_shape.shape)),
            name=name,
            interpret=interpret(),
            input_output_aliases=aliases or {},
            compiler_params=_TritonParams(num_warps=num_warps, num_stages=num_stages),
        )(*args)

    return call


def rows_operand(m: int):
    """A row count as a kernel operand, (1,) int32: the kernel reads it at run time
    (:func:`read_rows`) instead of taking it from a ref's shape, where it would be a constant
    of the lowered module (a new row count, a new Triton compile). An int32: a count of 2**31 or
    more would wrap, so callers split such calls (the GLU's element counts: bridge/kernels.py).
    (No check here: the op layer's shape evaluation asks for sizes far past any real call.)"""
    return jnp.full((1,), m, jnp.int32)


def row_programs(n: int) -> int:
    """Programs along a grid axis that follows the rows: ``n``, but at least two. The lowering
    turns the program id of a one-program axis into the constant 0, a second module for small
    inputs; the extra program finds every row masked off and stores nothing."""
    return max(2, int(n))


def cdiv_traced(a, b: int):
    """ceil(a / b) of a traced int32 (a run-time row count) by a static int, int32 also under
    ``jax_enable_x64`` (``pl.cdiv`` would make ``b`` int64 there)."""
    return jax.lax.div(a + i32(b - 1), i32(b))


def read_rows(ref):
    """The scalar a :func:`rows_operand` holds, inside a kernel."""
    return load(ref.at[ds(0, 1)])[0]


def acc_dtype(dtype):
    """fp32 accumulation, except float64 inputs (gradcheck) keep float64."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def warps_for(elements: int) -> int:
    """Warps for a program touching ``elements`` values per tensor (Triton's usual heuristic)."""
    return int(min(max(elements // 256, 1), 16))
