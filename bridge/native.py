"""Pallas kernels launched natively on torch's stream: no JAX runtime, no DLPack per call.

A bridged kernel (``core.KernelDef``) is a JAX function: one or more ``pallas_call`` s, often
with a little XLA work around them (a reshape, the partial-sum reduction of RMSNorm's weight
gradient, the LoRA kernels' matrix products). For each kernel, pass (fwd/bwd), static
arguments and input shapes, :func:`plan` traces that function to a jaxpr once and turns it into
a *plan*, a flat list of torch-side steps:

- each ``pallas_call`` is lowered by JAX to Triton IR (``bridge/_jax_internals.py``), compiled
  by the installed Triton and launched on torch's current stream like any Triton kernel;
- every other equation runs as the equivalent torch op (``_PRIMS``): the products go through
  cuBLAS, reshapes are views.

The plan then runs on torch tensors: ~10 us of host time for a one-kernel pass instead of the
DLPack path's 0.2-1.5 ms, on torch's stream (so CUDA graphs capture it), in torch's allocator
(so torch's memory statistics see it). A kernel whose jaxpr holds an equation the table does
not know, a lowering that fails or a compile that fails stays on the DLPack path, with its
reason in :func:`status` and one warning.

Caches: the TTIR of each lowered ``pallas_call`` and each plan's *recipe* (its steps as plain
data, from which every plan is built) are kept on disk (``FORGE_CACHE_DIR``, default
``~/.cache/forge``), keyed by the JAX, jaxlib and Triton versions, a stamp of forge_pallas' and
this module's code, the kernel, its static arguments and shapes, so a second process neither
traces, nor lowers, nor (through Triton's own cache and forge's index into it) compiles again. Compiled kernels are keyed by the TTIR's hash (``_KERNELS``): the kernels read
their row count at run time, so plans at other row counts (per input shape: a new row count
traces and lowers again) share one compile (docs/pallas-native.md). Plans are bounded
(``_PLANS_MAX``).

Launches: a plan takes the compiled kernel's launcher directly (Triton 3.6's calling
convention, ``_FAST_TRITON``) and otherwise ``kernel[grid](*args)``. The kernel's arguments are
its inputs then its outputs, as Pallas' Triton lowering declares them; an output aliased to an
input (``input_output_aliases``) is that input's buffer, copied first when the input is still
needed afterwards. Every pointer is declared 32-byte aligned by the lowering: inputs that are
not are copied.

Where it runs: CUDA tensors, JAX not in interpret mode, the private names of
``_jax_internals`` present, ``FORGE_PALLAS_NATIVE`` not ``0``. In CI (CPU) the plans are still
built and run, with each ``pallas_call`` evaluated by JAX's interpreter instead of launched
(``launcher="jax"``): that checks the tracing, the torch side of every plan and the lowering to
TTIR, not the compiled code.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import os
import threading
import time

import torch

from . import _jax_internals as JI

log = logging.getLogger("forge")

_PLANS_MAX = 512
_PLANS: "collections.OrderedDict" = collections.OrderedDict()
_DECLINED: dict = {}  # (kernel, pass) -> reason (the latest)
_WARNED: set = set()
_LOCK = threading.RLock()
_LAUNCHER = None  # None: decide ("triton" on a GPU); tests set "jax"
_LOWER_WITH_JAX = False  # launcher "jax": also lower each pallas_call and key it (tests)
# compiled kernels by what Triton compiles: (sha256 of the TTIR, num_warps, num_stages). Row
# counts share a module (forge_pallas reads them at run time), so they share one entry; each
# plan keeps its own grid. Under launcher "jax" (lower=True) the entries hold the TTIR only.
_KERNELS: dict = {}
_COMPILES = [0]  # triton.compile calls in this process
# seconds spent building plans, by part (bench/bench_first_call.py reports them)
_TIMES = {"trace": 0.0, "lower": 0.0, "compile": 0.0, "build": 0.0}
_TRACES = [0]  # jaxpr traces in this process (a plan from a recipe on disk traces nothing)


class Unsupported(Exception):
    """This kernel pass cannot run natively; the message says why."""


# ------------------------------------------------------------------------------ availability


@functools.cache
def _process_reason() -> str | None:
    if os.environ.get("FORGE_PALLAS_NATIVE", "1") == "0":
        return "FORGE_PALLAS_NATIVE=0"
    miss = JI.missing()
    if miss:
        return "this JAX lacks the internals the native path lowers through: " + ", ".join(miss)
    if launcher() == "triton":
        try:
            import triton  # noqa: F401
            import triton.compiler  # noqa: F401
        except ImportError as e:
            return f"triton is not importable ({e})"
    return None


@functools.cache
def prepare() -> bool:
    """Start what every native launch in this process needs, once: Triton's compiler and runtime
    modules and its driver's target. ``bridge`` calls it when a Pallas kernel is handed out
    (``forge.ops.get``, ``forge.patch``), so a kernel's first call pays only for its own plan
    (Triton's start-up is 0.1-0.2 s, as for forge's Triton backend, which imports it with its
    kernels). True where the native path is on."""
    if not _available():
        return False
    if launcher() == "triton":
        try:
            import triton.compiler.compiler  # noqa: F401
            import triton.runtime.cache  # noqa: F401

            _target()
        except Exception as e:  # noqa: BLE001 - the first plan meets (and reports) it again
            log.debug("pallas native: Triton's start-up failed (%s)", e)
    return True


def launcher() -> str:
    if _LAUNCHER is not None:
        return _LAUNCHER
    from forge_pallas import _common

    return "none" if _common.interpret() else "triton"


def set_launcher(name: str | None, *, lower: bool = False) -> None:
    """``"jax"``: evaluate each ``pallas_call`` with JAX instead of launching it (CPU tests;
    with ``lower=True`` each one is also lowered to TTIR and keyed in the kernel table as the
    Triton launcher would compile it); ``"off"``: every call through JAX and DLPack; ``None``:
    the default (``"triton"`` where JAX has a GPU). Clears the plans, the kernel table and the
    compile count."""
    global _LAUNCHER, _LOWER_WITH_JAX
    if name not in (None, "jax", "triton", "off"):
        raise ValueError(f"launcher must be None, 'jax', 'triton' or 'off', got {name!r}")
    _LAUNCHER = name
    _LOWER_WITH_JAX = bool(lower)
    _KERNELS.clear()
    _COMPILES[0] = 0
    _process_reason.cache_clear()
    _available.cache_clear()
    prepare.cache_clear()
    clear()


def available() -> tuple[bool, str]:
    """(on, reason) for the native path in this process."""
    if launcher() == "none":
        return False, "Pallas runs in interpret mode (JAX has no GPU): the DLPack path serves every call"
    if launcher() == "off":
        return False, "turned off (bridge.native.set_launcher('off'))"
    why = _process_reason()
    return (why is None), (why or "")


@functools.cache
def _available() -> bool:
    return available()[0]


def status() -> dict:
    """{"available": bool, "reason": str, "declined": {"kernel/pass": reason}, "plans": n,
    "kernels": distinct lowered modules (what Triton compiles, one per module whatever the row
    counts), "compiles": triton.compile calls in this process}."""
    ok, why = available()
    return {"available": ok, "reason": why, "declined": {f"{k}/{p}": r for (k, p), r in _DECLINED.items()},
            "plans": len(_PLANS), "kernels": len(_KERNELS), "compiles": _COMPILES[0]}


def timings() -> dict:
    """Seconds this process spent building plans: in all ("build"), tracing to jaxprs, lowering
    to TTIR (disk-cache misses) and in triton.compile (Triton's own disk cache included)."""
    return dict(_TIMES)


def clear() -> None:
    with _LOCK:
        _PLANS.clear()
        _DECLINED.clear()


def _decline(kname, which, why):
    _DECLINED[(kname, which)] = why
    if (kname, which, why) not in _WARNED:
        _WARNED.add((kname, which, why))
        log.warning("pallas %s (%s) runs through JAX and DLPack, not natively: %s", kname, which, why)


# ------------------------------------------------------------------------------ dtypes


def _torch_dtype(jdt) -> torch.dtype:
    """A JAX dtype, or its name as a recipe keeps it (``"bfloat16"``), as torch's."""
    name = str(jdt)
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise Unsupported(f"dtype {name}")
    return dt


def _jax_dtype(tdt):
    import jax.numpy as jnp

    return jnp.dtype(str(tdt).removeprefix("torch."))


# ------------------------------------------------------------------------------ torch primitives
# Each entry: (params, ctx) -> fn(*operands) returning one value or a list (multiple results).
# params are the equation's, as plain data (_PARAMS: lists, ints, dtype names); ctx holds the
# equation's output dtype and shape and the plan's device box. Operands are torch
# tensors or Python scalars (literals, and what folds from them).


class _Ctx:
    __slots__ = ("out_dtype", "out_shape", "dev")


def _convert(p, ctx):
    dt = _torch_dtype(p["new_dtype"])
    py = float if dt.is_floating_point else (bool if dt == torch.bool else int)
    return lambda x: x.to(dt) if isinstance(x, torch.Tensor) else py(x)


def _reshape(p, ctx):
    if p.get("dimensions") is not None:
        raise Unsupported("reshape with dimensions")
    shape = tuple(p["new_sizes"])
    return lambda x: x.reshape(shape)


_SMALL: dict = {}  # (value, shape, dtype, device) -> a constant int tensor (row counts)


def _small_const(x, shape, dtype, dev):
    """A few ints as a device tensor, made once per device: the row-count operands of the
    kernels (forge_pallas/_common.rows_operand) would otherwise cost a fill kernel per call.
    Nothing writes them (``_pallas_step`` copies one an output would alias). Not kept when made
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
        raise Unsupported("pad with interior padding")
    pads = [int(v) for lo, hi, _ in reversed(cfg) for v in (lo, hi)]

    def fn(x, value):
        if isinstance(value, torch.Tensor):
            raise Unsupported("pad with a traced padding value")
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
        raise Unsupported("dot_general with batch dimensions")
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


_PRIMS = {
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

# the parameters each entry of _PRIMS reads (a recipe keeps these, as plain data, and no others)
_PARAMS = {
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


def _plain(v):
    """A jaxpr parameter as JSON data: tuples as lists, numpy scalars as Python's, dtypes by name."""
    import numpy as np

    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, np.dtype) or type(v).__name__ == "dtype":
        return str(_torch_dtype(v)).removeprefix("torch.")
    if isinstance(v, np.generic):
        return v.item()
    raise Unsupported(f"a parameter of type {type(v).__name__}")


# ------------------------------------------------------------------------------ pallas_call


def _cache_dir() -> str:
    return os.environ.get("FORGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "forge")


@functools.cache
def _versions() -> tuple:
    import jax
    import jaxlib

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "none"
    return (jax.__version__, jaxlib.__version__, tv)


def _lowered(key: str, eqn_of):
    """The TTIR of a ``pallas_call``, from the disk cache or lowered now (and stored); ``eqn_of()``
    gives its equation (a trace, when the plan came from a recipe on disk)."""
    path = os.path.join(_cache_dir(), "pallas-native", key + ".json")
    try:
        with open(path) as f:
            d = json.load(f)
        return JI.Lowered(d["ttir"], tuple(d["grid"]), d["num_warps"], d["num_stages"])
    except (OSError, ValueError, KeyError):
        pass
    eqn = eqn_of()
    t0 = time.perf_counter()
    low = JI.lower_pallas_call(eqn)
    _TIMES["lower"] += time.perf_counter() - t0
    _write_json(path, {"ttir": low.ttir, "grid": low.grid, "num_warps": low.num_warps,
                       "num_stages": low.num_stages})
    return low


def _write_json(path, data) -> None:
    """Write ``data`` to ``path`` atomically; a read-only cache folder only costs the next
    process the work again."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("forge: cannot write the native-launch cache %s: %s", path, e)


_FAST_TRITON = None


def _fast_triton() -> bool:
    global _FAST_TRITON
    if _FAST_TRITON is None:
        import triton

        _FAST_TRITON = triton.__version__.startswith("3.6.")
    return _FAST_TRITON


def _kernel_key(low) -> tuple:
    return (hashlib.sha256(low.ttir.encode()).hexdigest(), low.num_warps, low.num_stages)


def _compiled(low):
    """The installed Triton's compile of ``low``, once per module in this process: plans at
    other row counts (same TTIR, other grid) reuse it. The TTIR file is named by its hash; so
    is Triton's own cache entry, so another process compiles nothing either, and finds that
    entry through forge's index (_binary_index) without calling triton.compile."""
    key = _kernel_key(low)
    ck = _KERNELS.get(key)
    if ck is None:
        import triton

        path = os.path.join(_cache_dir(), "pallas-native", f"ttir-{key[0][:32]}.ttir")
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(low.ttir)
            os.replace(tmp, path)
        t0 = time.perf_counter()
        options = {"num_warps": low.num_warps, "num_stages": low.num_stages}
        target = _target()
        index = _binary_index(path, target, options)
        ck = _indexed_binary(index, path, target)
        if ck is None:
            ck = triton.compile(path, target=target, options=options)
            _COMPILES[0] += 1
            _write_index(index, ck)
        _TIMES["compile"] += time.perf_counter() - t0
        _KERNELS[key] = ck
    return ck


def _target():
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
        if _fast_triton() and rec.get("signature") is not None:
            src = _IndexedSource(path, rec["signature"], rec.get("name"))
        else:
            from triton._C.libtriton import ir

            src = IRSource(path, ir.context(), make_backend(target))
        return CompiledKernel(src, group, rec["hash"])
    except Exception as e:  # noqa: BLE001 - a damaged index or entry: compile as before
        log.debug("pallas native: index %s not used (%s)", index, e)
        return None


def _write_index(index, ck) -> None:
    if index is None:
        return
    meta = [k for k in ck.metadata_group if k.endswith(".json") and not k.startswith("__grp__")]
    if len(meta) != 1:
        return
    sig = getattr(ck.src, "signature", None)
    sig = [sig[i] for i in range(len(sig))] if isinstance(sig, dict) and all(isinstance(v, str) for v in sig.values()) else None
    _write_json(index, {"hash": ck.hash, "metadata": meta[0], "signature": sig, "name": getattr(ck.src, "name", None)})


class _TritonLaunch:
    """A compiled kernel (shared across row counts) and this plan's grid; launches on torch's
    current stream of the plan's device."""

    def __init__(self, low, dev):
        self.grid = low.grid
        self.ck = _compiled(low)
        self.dev = dev.index or 0
        self._run = None

    def __call__(self, args):
        g0, g1, g2 = self.grid
        if self._run is None or not _fast_triton():
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

        from . import core

        if self.eqn is None:
            eqn = self.eqn = self.eqn_of()
            self.fn = jax.jit(lambda *xs: eqn.primitive.bind(*xs, **eqn.params))
        n_in = len(self.eqn.invars)
        # copies: an aliased input may come back as JAX's output buffer, which JAX would then
        # consider its own and reuse after the array dies, under the plan's tensor
        ins = [_at(t, v.aval.shape).clone() for t, v in zip(args[:n_in], self.eqn.invars)]
        outs = self.fn(*(core.to_jax(t) for t in ins))
        jax.block_until_ready(outs)  # JAX reads ``ins`` asynchronously: keep them alive till done
        for dst, o, v in zip(args[n_in:], outs, self.eqn.outvars):
            _at(dst, v.aval.shape).copy_(core.to_torch(o))


def _at(t, shape):
    """What a kernel reading ``t``'s address as a compact array of ``shape`` sees."""
    return t.as_strided(tuple(shape), _compact_strides(shape), t.storage_offset())


def _ready(t):
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


def _ready_view(t, perm):
    """A kernel argument the kernel reads as ``t.permute(perm)`` (a transpose the plan does not
    run): ``t`` itself where that view is compact and aligned (the kernel takes only the address,
    the same for both), else a compact copy of the view."""
    return t if compact_as(t, perm) and not t.data_ptr() & 31 else _ready(t.permute(perm))


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


def _pallas_step(st, eqn_of, ctx):
    """The torch-side step of a recipe's ``pallas_call`` record ``st``."""
    out_meta = [(tuple(shape), _torch_dtype(dt)) for shape, dt in st["meta"]]
    aliases = {o: i for o, i in st["alias"]}
    copy_alias = set(st["copy"])  # aliased inputs the plan still needs: copied before the kernel writes them
    vin = {int(i): tuple(p) for i, p in st.get("vin", ())}  # inputs the kernel reads transposed
    vout = {int(j): tuple(p) for j, p in st.get("vout", ())}  # outputs the plan hands on transposed
    get = functools.partial(eqn_of, st["n"])
    if launcher() == "jax":
        launch = _JaxEval(get)
        if _LOWER_WITH_JAX:
            low = _lowered(st["k"], get)
            _KERNELS.setdefault(_kernel_key(low), low.ttir)
    else:
        low = _lowered(st["k"], get)
        try:
            launch = _TritonLaunch(low, ctx.dev)
        except Exception as e:  # noqa: BLE001 - a compile failure declines, it never crashes a call
            raise Unsupported(f"Triton could not compile the lowered {st['name']}: {e}") from e
    dev, empty = ctx.dev, torch.empty
    out_alloc = [_allocator(shape, dt, dev, vout.get(j)) for j, (shape, dt) in enumerate(out_meta)]

    if not aliases and not vin and not vout:  # (most kernels: every output fresh)
        def fn(*ins):
            res = [empty(shape, dtype=dt, device=dev) for shape, dt in out_meta]
            launch([_ready(t) for t in ins] + res)
            return res

        return fn

    if not aliases:  # (rope: its operands kept in the caller's layouts)
        def fn(*ins):
            res = [a() for a in out_alloc]
            launch([_ready_view(t, vin[i]) if i in vin else _ready(t) for i, t in enumerate(ins)] + res)
            return res

        return fn

    def fn(*ins):
        ins = [_ready_view(t, vin[i]) if i in vin else _ready(t) for i, t in enumerate(ins)]
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


# ------------------------------------------------------------------------------ plans
#
# A plan is a Python function generated from its recipe: one line per step, each step's result
# in a local variable, constants and literals bound as globals of the function. A call then
# costs the steps' own work and little else (no slot list, no loop over steps), which is most of
# what a small kernel call's host time is.


def _generate(steps, template, in_slots, out_tree, name):
    """``run(flat) -> output pytree``: the steps ``(fn, input slots, output slot(s))`` as
    straight-line code over the slots; ``flat`` holds the inputs of ``in_slots`` in order."""
    written = set(in_slots)
    for _, _, outs in steps:
        written.update([outs] if type(outs) is int else outs)
    g = {}

    def ref(i):
        if i in written:
            return f"v{i}"
        g[f"c{i}"] = template[i]
        return f"c{i}"

    def tup(names):
        return ", ".join(names) + ("," if len(names) == 1 else "")

    def expr(t):
        if t is None:
            return "None"
        if type(t) is int:
            return ref(t)
        return "(" + tup([expr(x) for x in t]) + ")"

    lines = ["def run(flat):"]
    if in_slots:
        lines.append(f"    {tup([f'v{i}' for i in in_slots])} = flat")
    for n, (fn, idx, outs) in enumerate(steps):
        g[f"f{n}"] = fn
        call = f"f{n}({', '.join(ref(i) for i in idx)})"
        lines.append(f"    v{outs} = {call}" if type(outs) is int else f"    {tup([f'v{o}' for o in outs])} = {call}")
    lines.append(f"    return {expr(out_tree)}")
    src = "\n".join(lines) + "\n"
    exec(compile(src, f"<forge plan {name}>", "exec"), g)  # noqa: S102 - code made here, from the recipe
    run = g["run"]
    run.source = src
    run.bwd = {}  # a forward plan's backward plans, by the inputs that want a gradient (bridge.core)
    return run


class _Var:
    """A jaxpr variable as a plan key: the traced Var and the call it was inlined from (a jitted
    helper called twice has one inner jaxpr, so its Vars are the same objects both times)."""

    __slots__ = ("v", "scope")

    def __init__(self, v, scope=0):
        self.v, self.scope = v, scope

    def __hash__(self):
        return hash((id(self.v), self.scope))

    def __eq__(self, o):
        return type(o) is _Var and o.v is self.v and o.scope == self.scope


class _Lit:
    """A literal operand, as a Python scalar (torch ops take those without a device copy)."""

    __slots__ = ("v",)

    def __init__(self, v):
        if getattr(v, "ndim", None) == 0:
            v = v.item()
        for py in (bool, int, float):  # jax's weakly typed scalars (TypedInt, ...) as plain ones
            if isinstance(v, py):
                v = py(v)
                break
        self.v = v


_RESHAPES = ("reshape", "squeeze", "expand_dims")


def _elide_reshapes(flat_eqns, outvars):
    """Drop the reshapes a kernel needs no step for: a ``pallas_call`` reads and writes through
    pointers, so a reshape whose result only ``pallas_call`` s read is its input (same memory,
    row-major), and a reshape of a ``pallas_call`` output that nothing else reads is that output
    allocated in the reshaped shape. Returns the remaining equations (their operands renamed)
    and, per remaining ``pallas_call`` index, {output position: shape to allocate}."""
    uses = collections.Counter(k for _, ins, _ in flat_eqns for k in ins if type(k) is _Var)
    uses.update(k for k in outvars if type(k) is _Var)
    readers = collections.defaultdict(set)
    producer = {}
    for n, (e, ins, outs) in enumerate(flat_eqns):
        for k in ins:
            readers[k].add(e.primitive.name)
        for j, k in enumerate(outs):
            producer[k] = (n, j)
    rename, skip, grow = {}, set(), {}
    for n, (e, ins, outs) in enumerate(flat_eqns):
        if e.primitive.name not in _RESHAPES or type(ins[0]) is not _Var:
            continue
        src, dst = rename.get(ins[0], ins[0]), outs[0]
        if dst not in outvars and readers[dst] == {JI.PALLAS_CALL}:
            rename[dst], skip = src, skip | {n}
        elif src in producer and uses[src] == 1 and flat_eqns[producer[src][0]][0].primitive.name == JI.PALLAS_CALL:
            pn, j = producer[src]
            grow.setdefault(pn, {})[j] = tuple(e.outvars[0].aval.shape)
            rename[dst], skip = src, skip | {n}
    kept, overrides = [], {}
    for n, (e, ins, outs) in enumerate(flat_eqns):
        if n in skip:
            continue
        if n in grow:
            overrides[len(kept)] = grow[n]
        kept.append((e, [rename.get(k, k) for k in ins], outs))
    outvars[:] = [rename.get(k, k) for k in outvars]
    return kept, overrides


def _elide_transposes(flat_eqns, outvars, overrides):
    """Drop the transposes around a kernel: a ``pallas_call`` takes only its operands'
    addresses, and a transpose is a view at its operand's address. An input the kernel reads
    transposed (``x.permute(p)``, nothing else reading that view) is passed as it is, with ``p``
    kept for the check that the view is compact (``_ready_view``); an output that only a
    transpose reads is allocated as that transpose (``empty_strided``: the kernel's layout in
    memory, the transposed shape). Not for aliased operands. Returns the remaining equations,
    the reshape overrides re-keyed to them, and, per remaining ``pallas_call`` index,
    ({input position: perm}, {output position: perm})."""
    uses = collections.Counter(k for _, ins, _ in flat_eqns for k in ins if type(k) is _Var)
    uses.update(k for k in outvars if type(k) is _Var)
    readers, producer = collections.defaultdict(list), {}
    for n, (e, ins, outs) in enumerate(flat_eqns):
        for i, k in enumerate(ins):
            if type(k) is _Var:
                readers[k].append((n, i))
        for j, k in enumerate(outs):
            producer[k] = (n, j)

    def kernel(n):
        return flat_eqns[n][0].primitive.name == JI.PALLAS_CALL

    def aliased(n):  # (aliased input positions, aliased output positions)
        pairs = flat_eqns[n][0].params.get("input_output_aliases", ())
        return {int(i) for i, _ in pairs}, {int(o) for _, o in pairs}

    skip, vin, vout = set(), collections.defaultdict(dict), collections.defaultdict(dict)
    to_src, to_out = {}, {}  # (kernel, input position) -> the view's source; view -> kernel output
    for n, (e, ins, outs) in enumerate(flat_eqns):
        if e.primitive.name != "transpose" or type(ins[0]) is not _Var:
            continue
        perm = [int(x) for x in e.params["permutation"]]
        src, dst = ins[0], outs[0]
        rd = readers[dst]
        if dst not in outvars and rd and all(kernel(r) and i not in aliased(r)[0] for r, i in rd):
            for r, i in rd:
                vin[r][i] = perm
                to_src[(r, i)] = src
            skip.add(n)
        elif src in producer and uses[src] == 1 and kernel(producer[src][0]) \
                and producer[src][1] not in aliased(producer[src][0])[1]:
            vout[producer[src][0]][producer[src][1]] = perm
            to_out[dst] = src
            skip.add(n)
    kept, moved, views = [], {}, {}
    for n, (e, ins, outs) in enumerate(flat_eqns):
        if n in skip:
            continue
        if n in overrides:
            moved[len(kept)] = overrides[n]
        if n in vin or n in vout:
            views[len(kept)] = (vin.get(n, {}), vout.get(n, {}))
        ins = [to_src.get((n, i), to_out.get(k, k) if type(k) is _Var else k) for i, k in enumerate(ins)]
        kept.append((e, ins, outs))
    outvars[:] = [to_out.get(k, k) if type(k) is _Var else k for k in outvars]
    return kept, moved, views


_ROUNDED = ("bfloat16", "float16")


def _fuse_dot_rounding(flat_eqns, outvars):
    """A ``dot_general`` of two bf16 (fp16) operands that accumulates in fp32 over the left
    operand's last dimension (a projection of its rows), and whose result nothing reads but one
    conversion back to that dtype, becomes one product with a bf16 (fp16) result: cuBLAS
    accumulates in fp32 and rounds once, without writing and reading an fp32 intermediate or
    running the conversion; and it is the product a model's own linear layers run (an
    fp32-result GEMM is a kernel torch loads on its first use: 45-105 ms of a LoRA kernel's first
    call). Products that sum over rows (the weight gradients: a long sum into a small result,
    where cuBLAS splits the sum and torch's default lets it add the parts in bf16) keep their
    fp32 result, as XLA computes it. Returns the equations without the fused conversions and, by
    the product's output, the dtype it now makes."""
    uses = collections.Counter(k for _, ins, _ in flat_eqns for k in ins if type(k) is _Var)
    uses.update(k for k in outvars if type(k) is _Var)
    dots = {outs[0]: e for e, _, outs in flat_eqns if e.primitive.name == "dot_general"}
    rename, skip, made = {}, set(), {}
    for n, (e, ins, outs) in enumerate(flat_eqns):
        if e.primitive.name != "convert_element_type" or type(ins[0]) is not _Var or uses[ins[0]] != 1:
            continue
        d = dots.get(ins[0])
        want = _plain(e.params["new_dtype"])
        if d is None or want not in _ROUNDED or _plain(d.outvars[0].aval.dtype) != "float32":
            continue
        if not all(_plain(v.aval.dtype) == want for v in d.invars):
            continue
        (lc, _), _ = d.params["dimension_numbers"]
        if tuple(lc) != (len(d.invars[0].aval.shape) - 1,):  # a sum over rows
            continue
        rename[outs[0]], made[ins[0]] = ins[0], want
        skip.add(n)
    kept = [(e, [rename.get(k, k) for k in ins], outs) for n, (e, ins, outs) in enumerate(flat_eqns) if n not in skip]
    outvars[:] = [rename.get(k, k) for k in outvars]
    return kept, made


def _recipe(fn, args, key_prefix):
    """Trace ``fn`` on ``args`` (avals) into a recipe: the plan as plain data (the form the disk
    cache keeps), and the ``pallas_call`` equations in program order (what lowers them)."""
    import jax

    t0 = time.perf_counter()
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    _TIMES["trace"] += time.perf_counter() - t0
    _TRACES[0] += 1
    out_tree = jax.tree_util.tree_structure(out_shape)
    jaxpr = closed.jaxpr
    consts = {}
    for v, c in zip(jaxpr.constvars, closed.consts):
        consts[_Var(v)] = torch.as_tensor(jax.device_get(c))

    # flatten nested calls into one equation list, renaming inner variables to outer keys
    flat_eqns = []
    scopes = iter(range(1, 1 << 30))

    def walk(jx, env, scope):
        for e in jx.eqns:
            ins = [_Lit(v.val) if JI.is_literal(v) else env.get(v, _Var(v, scope)) for v in e.invars]
            sub = JI.subjaxpr(e)
            if sub is not None:
                inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
                if getattr(sub, "consts", None):
                    raise Unsupported(f"{e.primitive.name} with constants")
                m, inner_scope = dict(zip(inner.invars, ins)), next(scopes)
                walk(inner, m, inner_scope)
                for o, io in zip(e.outvars, inner.outvars):
                    env[o] = _Lit(io.val) if JI.is_literal(io) else m.get(io, _Var(io, inner_scope))
                continue
            flat_eqns.append((e, ins, [_Var(o, scope) for o in e.outvars]))

    top = {}
    walk(jaxpr, top, 0)
    outvars = [_Lit(v.val) if JI.is_literal(v) else top.get(v, _Var(v)) for v in jaxpr.outvars]
    invars = [_Var(v) for v in jaxpr.invars]
    given = set(invars) | set(consts)

    flat_eqns, rounded = _fuse_dot_rounding(flat_eqns, outvars)
    flat_eqns, overrides = _elide_reshapes(flat_eqns, outvars)
    flat_eqns, overrides, views = _elide_transposes(flat_eqns, outvars, overrides)
    final = {k for k in outvars if type(k) is _Var}

    # slots: every variable and literal gets one; literals are in the template, constants in
    # "consts" (slot -> tensor)
    slots: dict = {}
    template: list = []

    def slot(k):
        if type(k) is _Lit:
            template.append(k.v)
            return len(template) - 1
        i = slots.get(k)
        if i is None:
            i = slots[k] = len(template)
            template.append(None)
        return i

    rec_consts = {slot(k): c for k, c in consts.items()}
    in_slots = [slot(k) for k in invars]
    steps, eqns = [], []
    for n, (e, ins, outs) in enumerate(flat_eqns):
        name = e.primitive.name
        aval = e.outvars[0].aval
        st = {"p": name, "i": [slot(k) for k in ins]}
        out_idx = [slot(k) for k in outs]
        if name == JI.PALLAS_CALL:
            def later(i, n=n, ins=ins):  # does the plan read input i after this kernel?
                k = ins[i]
                if type(k) is not _Var or k in given or k in final:
                    return True
                return any(k in later_ins for _, later_ins, _ in flat_eqns[n + 1:])

            grow = overrides.get(n, {})
            vin, vout = views.get(n, ({}, {}))
            aliases = [(int(o), int(i)) for i, o in e.params.get("input_output_aliases", ())]
            st.update(
                n=len(eqns), name=str(e.params.get("name")), o=out_idx,
                k=hashlib.sha256(repr((_versions(), _code_stamp(), key_prefix, n)).encode()).hexdigest()[:32],
                meta=[[list(grow.get(j, v.aval.shape)), _plain(v.aval.dtype)] for j, v in enumerate(e.outvars)],
                alias=[[o, i] for o, i in aliases], copy=[o for o, i in aliases if later(i)],
                vin=[[i, p] for i, p in sorted(vin.items())], vout=[[j, p] for j, p in sorted(vout.items())])
            eqns.append(e)
        else:
            if name not in _PRIMS:
                raise Unsupported(f"no torch equivalent for the XLA primitive {name!r}")
            st.update(
                a={k: _plain(e.params.get(k)) for k in _PARAMS.get(name, ())},
                dt=rounded.get(outs[0]) or (_plain(aval.dtype) if hasattr(aval, "dtype") else None),
                sh=list(getattr(aval, "shape", ())),
                o=out_idx if e.primitive.multiple_results else out_idx[0])
        steps.append(st)
    out = jax.tree_util.tree_unflatten(out_tree, [slot(k) for k in outvars])
    rec = {"template": template, "consts": rec_consts, "in": in_slots, "steps": steps, "out": out}
    return rec, eqns


def _from_recipe(rec, eqn_of, dev, name="plan"):
    """The plan a recipe describes, for tensors on ``dev``; ``eqn_of(n)`` gives its n-th
    ``pallas_call`` equation where one is needed (a TTIR missing from the disk cache, the CPU
    tests' JAX launcher). A step that reads only literals and constants and makes a scalar or a
    shared small constant (a row-count operand) runs here, once: the plan holds its result."""
    template = list(rec["template"])
    for i, c in rec["consts"].items():
        template[int(i)] = c
    in_slots = list(rec["in"])
    made = set(in_slots)
    for st in rec["steps"]:
        made.update([st["o"]] if type(st["o"]) is int else st["o"])
    final = set(_slots(rec["out"]))
    static = {i for i in range(len(template)) if i not in made}  # literals and constants
    # (not while a CUDA graph captures: what a step makes then belongs to the graph's pool)
    fold = dev.type != "cuda" or not torch.cuda.is_current_stream_capturing()
    steps = []
    for st in rec["steps"]:
        ctx = _Ctx()
        ctx.dev = dev
        idx, out = tuple(st["i"]), st["o"]
        if st["p"] == JI.PALLAS_CALL:
            steps.append((_pallas_step(st, eqn_of, ctx), idx, list(out)))
            continue
        ctx.out_dtype = _torch_dtype(st["dt"]) if st["dt"] is not None else None
        ctx.out_shape = tuple(st["sh"])
        fn = _PRIMS[st["p"]](st["a"], ctx)
        if fold and type(out) is int and out not in final and all(i in static for i in idx):
            r = fn(*[template[i] for i in idx])
            if not isinstance(r, torch.Tensor) or getattr(r, "_forge_shared", False):
                template[out] = r
                static.add(out)
                continue
        steps.append((fn, idx, out if type(out) is int else list(out)))
    return _generate(steps, template, in_slots, _tuples(rec["out"]), name)


def _slots(tree):
    if isinstance(tree, (list, tuple)):
        return [i for t in tree for i in _slots(t)]
    return [] if tree is None else [tree]


def _tuples(tree):
    return tuple(_tuples(t) for t in tree) if isinstance(tree, (list, tuple)) else tree


# A recipe on disk lets a later process build the plan without tracing (the trace was most of a
# warm first call's plan build). Kept only when it is all plain data: small constants, scalar
# literals, an output tree of tuples.
_CONST_MAX = 1024


def _recipe_json(rec):
    """``rec`` as JSON data, or None where it holds something a file would not give back."""
    consts = {}
    for i, c in rec["consts"].items():
        if c.numel() > _CONST_MAX:
            return None
        consts[str(i)] = [str(c.dtype).removeprefix("torch."), list(c.shape), c.flatten().tolist()]

    def plain_tree(t):
        return t is None or type(t) is int or (type(t) is tuple and all(plain_tree(x) for x in t))

    if not plain_tree(rec["out"]) or not all(v is None or type(v) in (bool, int, float) for v in rec["template"]):
        return None
    return {**rec, "consts": consts}


def _recipe_from_json(d):
    d["consts"] = {int(i): torch.tensor(v, dtype=_torch_dtype(dt)).reshape(shape) for i, (dt, shape, v) in d["consts"].items()}
    return d


def _recipe_path(key_prefix) -> str:
    key = hashlib.sha256(repr((_versions(), _code_stamp(), key_prefix)).encode()).hexdigest()[:32]
    return os.path.join(_cache_dir(), "pallas-native", f"plan-{key}.json")


@functools.cache
def _code_stamp() -> str:
    """A hash of the code that decides what a cached recipe or TTIR holds: forge_pallas' kernels,
    this module and its JAX internals. A new forge (or an edited kernel) lowers again."""
    import forge_pallas

    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    pallas = os.path.dirname(os.path.abspath(forge_pallas.__file__))
    files = [os.path.join(pallas, f) for f in sorted(os.listdir(pallas)) if f.endswith(".py")]
    for f in files + [os.path.join(here, "native.py"), os.path.join(here, "_jax_internals.py")]:
        with open(f, "rb") as fh:
            h.update(os.path.basename(f).encode() + b"\0" + fh.read())
    return h.hexdigest()[:16]


def _build(fn, args, dev, key_prefix):
    """The plan of ``fn`` on ``args`` (avals): from its recipe on disk when there is one (no
    trace), else traced, built, and its recipe stored."""
    path = _recipe_path(key_prefix)
    try:
        with open(path) as f:
            rec = _recipe_from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        rec = None
    if rec is not None:
        eqns = []

        def eqn_of(n):  # a trace only where a pallas_call's equation is needed after all
            if not eqns:
                t0 = time.perf_counter()
                eqns.extend(pallas_eqns(fn, args))
                _TIMES["trace"] += time.perf_counter() - t0
                _TRACES[0] += 1
            return eqns[n]

        try:
            return _from_recipe(rec, eqn_of, dev, f"{key_prefix[0]}/{key_prefix[1]}")
        except (KeyError, TypeError, ValueError, IndexError, SyntaxError) as e:  # a damaged recipe: trace
            log.debug("pallas native: recipe %s not used (%s)", path, e)
    rec, eqns = _recipe(fn, args, key_prefix)
    p = _from_recipe(rec, eqns.__getitem__, dev, f"{key_prefix[0]}/{key_prefix[1]}")
    data = _recipe_json(rec)
    if data is not None:
        _write_json(path, data)
    return p


def pallas_eqns(fn, args) -> list:
    """The ``pallas_call`` equations of ``fn`` traced on ``args`` (avals or arrays; tuples
    allowed), in program order, nested calls included."""
    import jax

    out = []

    def walk(jx):
        for e in jx.eqns:
            sub = JI.subjaxpr(e)
            if sub is not None:
                walk(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
            elif e.primitive.name == JI.PALLAS_CALL:
                out.append(e)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def _aval(t):
    import jax

    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_aval(x) for x in t)
    return jax.ShapeDtypeStruct(tuple(t.shape), _jax_dtype(t.dtype))


def _sig(a):
    if a is None:
        return None
    if isinstance(a, tuple):
        return tuple(_sig(x) for x in a)
    return (a.shape, a.dtype)


def _leaves(args):
    out = []
    for a in args:
        if isinstance(a, tuple):
            out.extend(x for x in a if x is not None)
        elif a is not None:
            out.append(a)
    return out


def plan(kdef, which: str, skey, args: tuple, leaves=None):
    """The plan of ``kdef``'s pass ``which`` (``"fwd"``, or ``"bwd"`` with ``skey`` = (static
    key, needs)) with its static arguments bound, on the positional ``args`` (torch tensors,
    None, or tuples of them), or None when it cannot run natively (the reason in :func:`status`). Built on first use per shape, then cached.
    Call it as ``plan(flat)`` with the non-None tensors of ``args`` in order (``leaves``, if the
    caller has them already)."""
    if not _available():  # one cached check per call where the native path is off (CPU CI)
        return None
    if which == "fwd":  # flat tensors: the cheap signature
        if not args:
            return None
        dev = args[0].device
        key = (kdef.name, which, skey, dev, tuple([(t.shape, t.dtype) for t in args]))
    else:  # (inputs, residuals, grads): the leaves' signature and where the Nones are
        leaves = _leaves(args) if leaves is None else leaves
        if not leaves:
            return None
        dev = leaves[0].device
        nones = tuple(tuple([x is None for x in a]) if isinstance(a, tuple) else a is None for a in args)
        key = (kdef.name, which, skey, dev, nones, tuple([(t.shape, t.dtype) for t in leaves]))
    hit = _PLANS.get(key)
    if hit is not None:
        return hit or None
    with _LOCK:
        if dev.type != "cuda" and launcher() == "triton":
            return None
        t0 = time.perf_counter()
        fn = kdef.py_fn("fwd", skey) if which == "fwd" else kdef.py_fn("bwd", *skey)
        try:
            p = _build(fn, _aval(args), dev, (kdef.name, which, repr(skey), repr(_sig(args)), _gpu_kind(), _x64()))
        except Unsupported as e:
            _decline(kdef.name, which, str(e))
            p = False
        _TIMES["build"] += time.perf_counter() - t0
        _PLANS[key] = p
        if len(_PLANS) > _PLANS_MAX:
            _PLANS.popitem(last=False)
        return p or None


def _x64() -> bool:
    import jax

    return bool(jax.config.read("jax_enable_x64"))  # (it changes what a trace holds)


@functools.cache
def _gpu_kind():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None
