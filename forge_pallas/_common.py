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


def triton_call(kernel, *, name, grid, out_shape, num_warps, num_stages=None, aliases=None):
    """``pallas_call`` with the Triton lowering (interpreted without a GPU); ``aliases`` (input
    index -> output index) lets an output reuse an input's buffer, updating it in place."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        name=name,
        interpret=interpret(),
        input_output_aliases=aliases or {},
        compiler_params=_TritonParams(num_warps=num_warps, num_stages=num_stages),
    )


def acc_dtype(dtype):
    """fp32 accumulation, except float64 inputs (gradcheck) keep float64."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def warps_for(elements: int) -> int:
    """Warps for a program touching ``elements`` values per tensor (Triton's usual heuristic)."""
    return int(min(max(elements // 256, 1), 16))
