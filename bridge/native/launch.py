"""Compiling and launching a plan's ``pallas_call`` s: the lowered TTIR compiled by the installed
Triton once per module (``state.KERNELS``, keyed by the TTIR's hash: the kernels read their row
count at run time, so plans at other row counts share one compile), found again in another
process through Triton's own cache and forge's index into it; and the step of a plan that
launches it on torch's current stream.

A plan takes the compiled kernel's launcher directly (Triton 3.6's calling convention,
:func:`fast_triton`) and otherwise ``kernel[grid](*args)``. The kernel's arguments are its
inputs then its outputs, as Pallas' Triton lowering declares them; an output aliased to an
input (``input_output_aliases``) is that input's buffer, copied first when the input is still
needed afterwards. Every pointer is declared 32-byte aligned by the lowering: inputs that are
not are copied (:func:`ready`). Under launcher ``"jax"`` (the CPU tests) each ``pallas_call`` is
evaluated by JAX's interpreter instead (``_JaxEval``), through the DLPack transport.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import time

import torch

from .. import dlpack
from . import disk, prims, state


_FAST_TRITON = None


def fast_triton() -> bool:
    global _FAST_TRITON
    if _FAST_TRITON is None:
        import triton

        _FAST_TRITON = triton.__version__.startswith("3.6.")
    return _FAST_TRITON


def kernel_key(low) -> tuple:
    return (hashlib.sha256(low.ttir.encode()).hexdigest(), low.num_warps, low.num_stages)


def compiled(low):
    """The installed Triton's compile of ``low``, once per module in this process: plans at
    other row counts (same TTIR, other grid) reuse it. The TTIR file is named by its hash; so
    is Triton's own cache entry, so another process compiles nothing either, and finds that
    entry through forge's index (:func:`_binary_index`) without calling triton.compile."""
    key = kernel_key(low)
    ck = state.KERNELS.get(key)
    if ck is None:
        import triton

        path = disk.ttir_file(key[0], low.ttir)
        t0 = time.perf_counter()
        options = {"num_warps": low.num_warps, "num_stages": low.num_stages}
        tgt = target()
        index = _binary_index(path, tgt, options)
        ck = _indexed_binary(index, path, tgt)
        if ck is None:
            ck = triton.compile(path, target=tgt, options=options)
            state.COMPILES[0] += 1
            _write_index(index, ck)
        state.TIMES["compile"] += time.perf_counter() - t0
        state.KERNELS[key] = ck
    return ck


def target():
    """The target triton.compile would take by default: its driver's, for the current device."""
    from triton.runtime import driver

    return driver.active.get_current_target()


# A warm first call must not pay triton.compile even on a cache hit: Triton's cache key hashes
# its own sources and compiler library (~0.4 s, once a process, on the H200 host and on a CPU).
# forge keeps an index beside each TTIR instead: Triton's cache key (its hash) and the name of
# the entry's metadata, under a stamp of what that key covers that can be read cheaply.
def _binary_index(path, target, options):
    """The index file for ``path`` compiled with ``options`` for ``target`` by this Triton, or
    None where the index must not be used (Triton set to recompile or override kernels, or
    internals it does not have)."""
    try:
        from triton import knobs
        from triton._C.libtriton import get_cache_invalidating_env_vars

        if knobs.compilation.always_compile or knobs.compilation.override or knobs.cache.manager_class:
            return None
        stamp = repr((_triton_stamp(), (target.backend, target.arch, target.warp_size),
                      sorted(options.items()), sorted(get_cache_invalidating_env_vars().items())))
    except Exception:  # noqa: BLE001 - another Triton: no index, triton.compile as before
        return None
    return f"{path}.{hashlib.sha256(stamp.encode()).hexdigest()[:24]}.json"


@functools.cache
def _triton_stamp():
    """Triton's version and its compiler library's size and time stamp: once a process."""
    import triton

    lib_dir = os.path.join(os.path.dirname(triton.__file__), "_C")
    libs = sorted(n for n in os.listdir(lib_dir) if n.startswith("libtriton."))
    return triton.__version__, [(n, st.st_size, st.st_mtime_ns) for n in libs for st in [os.stat(os.path.join(lib_dir, n))]]


class _IndexedSource:
    """What Triton 3.6's launcher reads of a kernel's source, its argument types, kept in the
    index: the TTIR is not parsed again (Triton's IRSource loads its MLIR dialects and parses the
    module to find them)."""

    ext = "ttir"

    def __init__(self, path, signature, name):
        self.path, self.signature, self.name = path, dict(enumerate(signature)), name


def _indexed_binary(index, path, target):
    """Triton's compiled kernel for ``path`` from its own cache, found through ``index``; None
    when there is no index or the entry is gone (then triton.compile runs)."""
    if index is None or not os.path.exists(index):
        return None
    try:
        with open(index) as f:
            rec = json.load(f)
        from triton.compiler.compiler import CompiledKernel, IRSource, make_backend
        from triton.runtime.cache import get_cache_manager

        group = get_cache_manager(rec["hash"]).get_group(rec["metadata"])
        if not group or rec["metadata"] not in group:
            return None
        # what triton.compile builds on a cache hit, less the cache key
        if fast_triton() and rec.get("signature") is not None:
            src = _IndexedSource(path, rec["signature"], rec.get("name"))
        else:
            from triton._C.libtriton import ir

            src = IRSource(path, ir.context(), make_backend(target))
        return CompiledKernel(src, group, rec["hash"])
    except Exception as e:  # noqa: BLE001 - a damaged index or entry: compile as before
        state.log.debug("pallas native: index %s not used (%s)", index, e)
        return None


def _write_index(index, ck) -> None:
    if index is None:
        return
    meta = [k for k in ck.metadata_group if k.endswith(".json") and not k.startswith("__grp__")]
    if len(meta) != 1:
        return
    sig = getattr(ck.src, "signature", None)
    sig = [sig[i] for i in range(len(sig))] if isinstance(sig, dict) and all(isinstance(v, str) for v in sig.values()) else None
    disk.write_json(index, {"hash": ck.hash, "metadata": meta[0], "signature": sig, "name": getattr(ck.src, "name", None)})


class _TritonLaunch:
    """A compiled kernel (shared across row counts) and this plan's grid; launches on torch's
    current stream of the plan's device."""

    def __init__(self, low, dev):
        self.grid = low.grid
        self.ck = compiled(low)
        self.dev = dev.index or 0
        self._run = None

    def __call__(self, args):
        g0, g1, g2 = self.grid
        if self._run is None or not fast_triton():
            self.ck[(g0, g1, g2)](*args)
            self._run = self.ck.run
            return
        self._run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(self.dev), self.ck.function,
                  self.ck.packed_metadata, None, None, None, *args)


class _JaxEval:
    """Evaluates the ``pallas_call`` with JAX (interpret mode on CPU): the CPU tests' launcher.
    ``eqn_of()`` gives the equation, on the first call (a plan built from a recipe on disk has
    traced nothing). It reads and writes each operand as a kernel does, by address: the compact
    array of the equation's shape at the tensor's place in its storage, whatever the tensor's own
    shape and strides (a reshape or transpose the plan dropped)."""

    def __init__(self, eqn_of):
        self.eqn_of, self.eqn, self.fn = eqn_of, None, None

    def __call__(self, args):
        import jax

        if self.eqn is None:
            eqn = self.eqn = self.eqn_of()
            self.fn = jax.jit(lambda *xs: eqn.primitive.bind(*xs, **eqn.params))
        n_in = len(self.eqn.invars)
        # copies: an aliased input may come back as JAX's output buffer, which JAX would then
        # consider its own and reuse after the array dies, under the plan's tensor
        ins = [_at(t, v.aval.shape).clone() for t, v in zip(args[:n_in], self.eqn.invars)]
        outs = self.fn(*(dlpack.to_jax(t) for t in ins))
        jax.block_until_ready(outs)  # JAX reads ``ins`` asynchronously: keep them alive till done
        for dst, o, v in zip(args[n_in:], outs, self.eqn.outvars):
            _at(dst, v.aval.shape).copy_(dlpack.to_torch(o))


def _at(t, shape):
    """What a kernel reading ``t``'s address as a compact array of ``shape`` sees."""
    return t.as_strided(tuple(shape), _compact_strides(shape), t.storage_offset())


def ready(t):
    """A kernel argument: compact strides, 32-byte aligned (what the lowering declares)."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.data_ptr() & 31:
        t = t.clone()
    return t


def compact_as(t, perm) -> bool:
    """Whether ``t.permute(perm)`` is compact (row-major), read from ``t``'s strides without
    making the view (an aten call each)."""
    sh, st = t.shape, t.stride()
    want = 1
    for d in reversed(perm):
        if sh[d] != 1 and st[d] != want:
            return False
        want *= sh[d]
    return True


def ready_view(t, perm):
    """A kernel argument the kernel reads as ``t.permute(perm)`` (a transpose the plan does not
    run): ``t`` itself where that view is compact and aligned (the kernel takes only the address,
    the same for both), else a compact copy of the view."""
    return t if compact_as(t, perm) and not t.data_ptr() & 31 else ready(t.permute(perm))


def _compact_strides(shape):
    out, n = [], 1
    for s in reversed(shape):
        out.append(n)
        n *= s
    return out[::-1]


def _allocator(shape, dt, dev, perm=None):
    """A maker of a kernel output of ``shape``: compact, or (``perm``) allocated as its transpose
    ``.permute(perm)``, the kernel's layout in memory behind the transposed shape."""
    if perm is None:
        return functools.partial(torch.empty, shape, dtype=dt, device=dev)
    cs = _compact_strides(shape)
    return functools.partial(torch.empty_strided, tuple(shape[d] for d in perm), tuple(cs[d] for d in perm),
                             dtype=dt, device=dev)


def pallas_step(st, eqn_of, ctx):
    """The torch-side step of a recipe's ``pallas_call`` record ``st``."""
    out_meta = [(tuple(shape), prims.torch_dtype(dt)) for shape, dt in st["meta"]]
    aliases = {o: i for o, i in st["alias"]}
    copy_alias = set(st["copy"])  # aliased inputs the plan still needs: copied before the kernel writes them
    vin = {int(i): tuple(p) for i, p in st.get("vin", ())}  # inputs the kernel reads transposed
    vout = {int(j): tuple(p) for j, p in st.get("vout", ())}  # outputs the plan hands on transposed
    get = functools.partial(eqn_of, st["n"])
    if state.launcher() == "jax":
        launch = _JaxEval(get)
        if state.LOWER_WITH_JAX:
            low = disk.lowered(st["k"], get)
            state.KERNELS.setdefault(kernel_key(low), low.ttir)
    else:
        low = disk.lowered(st["k"], get)
        try:
            launch = _TritonLaunch(low, ctx.dev)
        except Exception as e:  # noqa: BLE001 - a compile failure declines, it never crashes a call
            raise state.Unsupported(f"Triton could not compile the lowered {st['name']}: {e}") from e
    dev, empty = ctx.dev, torch.empty
    out_alloc = [_allocator(shape, dt, dev, vout.get(j)) for j, (shape, dt) in enumerate(out_meta)]

    if not aliases and not vin and not vout:  # (most kernels: every output fresh)
        def fn(*ins):
            res = [empty(shape, dtype=dt, device=dev) for shape, dt in out_meta]
            launch([ready(t) for t in ins] + res)
            return res

        return fn

    if not aliases:  # (rope: its operands kept in the caller's layouts)
        def fn(*ins):
            res = [a() for a in out_alloc]
            launch([ready_view(t, vin[i]) if i in vin else ready(t) for i, t in enumerate(ins)] + res)
            return res

        return fn

    def fn(*ins):
        ins = [ready_view(t, vin[i]) if i in vin else ready(t) for i, t in enumerate(ins)]
        res = []
        for j in range(len(out_meta)):
            i = aliases.get(j)
            if i is None:
                res.append(out_alloc[j]())
            else:
                copy = j in copy_alias or getattr(ins[i], "_forge_shared", False)
                res.append(ins[i].clone() if copy else ins[i])
                if copy:
                    ins[i] = res[-1]
        launch(ins + res)
        return res

    return fn
