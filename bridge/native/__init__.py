"""Pallas kernels launched natively on torch's stream: no JAX runtime, no DLPack per call.

A bridged kernel (``bridge.core.KernelDef``) is a JAX function: one or more ``pallas_call`` s,
often with a little XLA work around them (a reshape, the partial-sum reduction of RMSNorm's
weight gradient, the LoRA kernels' matrix products). For each kernel, pass (fwd/bwd), static
arguments and input shapes, :func:`plan` traces that function to a jaxpr once and turns it into
a *plan*, a flat list of torch-side steps:

- each ``pallas_call`` is lowered by JAX to Triton IR (``bridge/_jax_internals.py``), compiled
  by the installed Triton and launched on torch's current stream like any Triton kernel;
- every other equation runs as the equivalent torch op: the products go through cuBLAS,
  reshapes are views.

The plan then runs on torch tensors: ~10 us of host time for a one-kernel pass instead of the
DLPack path's 0.2-1.5 ms, on torch's stream (so CUDA graphs capture it), in torch's allocator
(so torch's memory statistics see it). A kernel whose jaxpr holds an equation the table does
not know, a lowering that fails or a compile that fails stays on the DLPack path, with its
reason in :func:`status` and one warning.

The package, by concern:

- ``state``: whether the path runs here (launcher, availability), its tables and counters;
- ``recipe``: tracing a pass into a recipe (its steps as plain data);
- ``prims``: the torch op for each XLA primitive a recipe may hold, and the dtype mapping;
- ``disk``: the cache on disk (``FORGE_CACHE_DIR``): lowered TTIR and recipes, so a second
  process neither traces, nor lowers, nor (through Triton's own cache and forge's index into
  it) compiles again (docs/pallas-native.md);
- ``launch``: compiling the lowered TTIR with Triton once per module and launching it;
- ``plans``: a recipe made into straight-line code, cached per signature (:func:`plan`).

Where it runs: CUDA tensors, JAX not in interpret mode, the private names of
``_jax_internals`` present, ``FORGE_PALLAS_NATIVE`` not ``0``. In CI (CPU) the plans are still
built and run, with each ``pallas_call`` evaluated by JAX's interpreter instead of launched
(``set_launcher("jax")``): that checks the tracing, the torch side of every plan and the
lowering to TTIR, not the compiled code.
"""
from __future__ import annotations

import functools

from . import launch, state
from .launch import compact_as
from .plans import leaves_of, plan
from .recipe import pallas_eqns
from .state import Unsupported, available, clear, launcher

__all__ = ["Unsupported", "available", "clear", "compact_as", "launcher", "leaves_of", "pallas_eqns", "plan",
           "prepare", "set_launcher", "status", "timings"]


@functools.cache
def prepare() -> bool:
    """Start what every native launch in this process needs, once: Triton's compiler and runtime
    modules and its driver's target. ``bridge`` calls it when a Pallas kernel is handed out
    (``forge.ops.get``, ``forge.patch``), so a kernel's first call pays only for its own plan
    (Triton's start-up is 0.1-0.2 s, as for forge's Triton backend, which imports it with its
    kernels). True where the native path is on."""
    if not state.is_on():
        return False
    if state.launcher() == "triton":
        try:
            import triton.compiler.compiler  # noqa: F401
            import triton.runtime.cache  # noqa: F401

            launch.target()
        except Exception as e:  # noqa: BLE001 - the first plan meets (and reports) it again
            state.log.debug("pallas native: Triton's start-up failed (%s)", e)
    return True


def set_launcher(name: str | None, *, lower: bool = False) -> None:
    """``"jax"``: evaluate each ``pallas_call`` with JAX instead of launching it (CPU tests;
    with ``lower=True`` each one is also lowered to TTIR and keyed in the kernel table as the
    Triton launcher would compile it); ``"off"``: every call through JAX and DLPack; ``None``:
    the default (``"triton"`` where JAX has a GPU). Clears the plans, the kernel table and the
    compile count."""
    if name not in (None, "jax", "triton", "off"):
        raise ValueError(f"launcher must be None, 'jax', 'triton' or 'off', got {name!r}")
    state.LAUNCHER = name
    state.LOWER_WITH_JAX = bool(lower)
    state.KERNELS.clear()
    state.COMPILES[0] = 0
    state.process_reason.cache_clear()
    state.is_on.cache_clear()
    prepare.cache_clear()
    state.clear()


def status() -> dict:
    """{"available": bool, "reason": str, "declined": {"kernel/pass": reason}, "plans": n,
    "kernels": distinct lowered modules (what Triton compiles, one per module whatever the row
    counts), "compiles": triton.compile calls in this process, "traces": passes traced to jaxprs
    in this process (a plan built from its recipe on disk traces nothing)}."""
    ok, why = state.available()
    return {"available": ok, "reason": why, "declined": {f"{k}/{p}": r for (k, p), r in state.DECLINED.items()},
            "plans": len(state.PLANS), "kernels": len(state.KERNELS), "compiles": state.COMPILES[0],
            "traces": state.TRACES[0]}


def timings() -> dict:
    """Seconds this process spent building plans: in all ("build"), tracing to jaxprs, lowering
    to TTIR (disk-cache misses) and in triton.compile (Triton's own disk cache included)."""
    return dict(state.TIMES)
