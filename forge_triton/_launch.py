"""A cheaper launch of forge's compiled Triton kernels: host time per call is what decides a
small model's step (bench/bench_host_overhead.py, docs/design.md).

``kernel[grid](*args, **meta)`` goes through ``JITFunction.run`` every time: it binds and
specialises every argument, builds a cache key (a ``str`` of the options dict), reads the knobs,
checks the kernel's globals, and on Triton 3.6 hands the launcher an (empty) hook chain it calls
twice per launch; ~16-18 us per launch on the H200's host. :class:`FastKernel` keeps that path
for the first call of each *specialisation* and remembers the ``CompiledKernel`` it returns;
later calls with the same specialisation call the compiled launcher directly.

The specialisation key is a refinement of Triton's: per tensor its dtype and whether its data
pointer is 16-byte aligned; per int its type, whether it is 1, whether it is a multiple of 16
and whether it fits in 32 bits; per other argument its type (floats) or value (None, bools);
the constexpr keywords and launch options by value; the current device. Two calls with one key
are specialised identically by Triton, so the remembered kernel is the one Triton would pick.

The direct path is taken only where it was checked on a GPU (Triton 3.6, the version on the
H200 machine; ``FAST_VERSIONS``) and only while no launch hook is installed (a profiler such as
proton adds one: then every launch takes Triton's own path). ``FORGE_TRITON_FAST_LAUNCH=0``
turns it off. In Triton's CPU interpreter it is never used.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton

from forge import _runtime

FAST_VERSIONS = ("3.6.",)


def _fast_supported() -> bool:
    if _runtime.triton_interpreted() or os.environ.get("FORGE_TRITON_FAST_LAUNCH", "1") == "0":
        return False
    if not triton.__version__.startswith(FAST_VERSIONS):
        return False
    try:
        from triton import knobs

        knobs.runtime.launch_enter_hook  # noqa: B018 - the attribute the direct path reads
    except (ImportError, AttributeError):
        return False
    return True


FAST = _fast_supported()
_I32 = (-(2**31), 2**31 - 1)


_RT = None


def _no_hooks() -> bool:
    """No launch hook installed (checked per call: a profiler may add one at any time)."""
    global _RT
    if _RT is None:
        from triton import knobs

        _RT = knobs.runtime
    rt = _RT
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return False
    return True


def _arg_key(a):
    t = type(a)
    if t is int:
        return (int, a == 1, not a & 15, _I32[0] <= a <= _I32[1])
    if t is float:
        return float
    if isinstance(a, torch.Tensor):
        return (a.dtype, not a.data_ptr() & 15)
    return (t, a)  # None, bool, a dtype: by value


# How launches run on this thread. None: launched (the eager path). The op layer
# (forge.ops.library) runs a kernel's forward / backward in the two other modes: "skip" while
# it computes an op's fake outputs in Triton's interpreter (the tensors are fake: only the
# allocations matter), "wrap" inside a torch.library.triton_op (each launch goes through
# torch.library.wrap_triton, so torch.compile's graph holds the kernel and inductor sees it).
_MODE = threading.local()


@contextlib.contextmanager
def mode(m):
    """Run launches on this thread in mode ``m`` ("skip" or "wrap", see _MODE) for the block."""
    old = getattr(_MODE, "value", None)
    _MODE.value = m
    try:
        yield
    finally:
        _MODE.value = old


@contextlib.contextmanager
def plain_launches():
    """Launch every kernel through Triton's own path (``kernel[grid](...)``) inside the block,
    as ``FORGE_TRITON_FAST_LAUNCH=0`` does for a whole process: a call's host time with and
    without it is what the direct path saves (bench/bench_host_overhead.py). It holds for the
    whole process while the block runs, not for one thread."""
    global FAST
    old, FAST = FAST, False
    try:
        yield
    finally:
        FAST = old


def _no_launch(*args, **meta):
    return None


def _traced(kernel, grid, m):
    if m == "skip":
        return _no_launch
    from torch.library import wrap_triton

    return wrap_triton(kernel)[grid]


class FastKernel:
    """Wraps a ``@triton.jit`` kernel; ``fk[grid](*args, **meta)`` launches like the kernel.
    Positional arguments are the kernel's runtime ones (in order); the constexpr parameters and
    launch options (num_warps, ...) are keywords. ``fk.kernel`` is the wrapped JITFunction.
    Launch modes of the op layer (see _MODE) go through Triton's own path."""

    __slots__ = ("kernel", "_cache")

    def __init__(self, kernel):
        self.kernel = kernel
        self._cache: dict = {}

    def __getitem__(self, grid):
        m = getattr(_MODE, "value", None)
        if m is not None:
            return _traced(self.kernel, grid, m)
        if not FAST:
            return self.kernel[grid]
        return lambda *args, **meta: self._launch(grid, args, meta)

    def _launch(self, grid, args, meta):
        dev = torch.cuda.current_device()
        key = (dev, *meta.items(), *map(_arg_key, args))
        hit = self._cache.get(key)
        if hit is None or not _no_hooks():
            ck = self.kernel[grid](*args, **meta)  # Triton's own path (compiles when new)
            if hit is None and ck is not None:
                self._cache[key] = self._entry(ck, args, meta)
            return ck
        ck, run, tail = hit
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(dev), ck.function, ck.packed_metadata,
            None, None, None, *args, *tail)
        return ck

    def _entry(self, ck, args, meta):
        # the launcher takes every parameter in signature order, constexprs included (it skips
        # them): the positional args, then the keyword parameters that follow them
        params = self.kernel.params
        tail = []
        for p in params[len(args):]:
            if p.name in meta:
                tail.append(meta[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                name = getattr(getattr(self.kernel, "fn", None), "__name__", repr(self.kernel))
                raise TypeError(f"{name}: parameter {p.name} not given")
        return ck, ck.run, tuple(tail)
