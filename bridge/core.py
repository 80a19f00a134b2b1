"""The torch <-> JAX bridge: ONE autograd.Function for every Pallas kernel, its two transports
(native launch on torch's stream, ``bridge/native.py``; JAX and DLPack), and the compile cache.

Registering a kernel (the whole API; other modules of ``bridge`` do exactly this)::

    from bridge import core
    from forge_pallas import rmsnorm as _k

    RMSNORM = core.KernelDef(
        "rmsnorm",
        fwd=_k.rmsnorm_fwd,     # (*inputs, **static) -> (outputs tuple, residuals tuple)
        bwd=_k.rmsnorm_bwd,     # (inputs, residuals, grads, **static) -> one grad (or None) per input
        diff=(0, 1),            # positions of the differentiable tensor inputs
    )

    def rmsnorm(x, weight, eps=1e-6, *, casting="llama", offset=0.0):
        ... validate with the spec ...
        return core.apply(RMSNORM, x, weight, eps=float(eps), casting=casting, offset=float(offset))

``fwd`` and ``bwd`` are plain JAX functions (they call the ``pallas_call`` s). Where the native
path serves them (a CUDA device, bridge/native.py), each pass runs as a plan of Triton-compiled
``pallas_call`` s and torch ops on torch's current stream. Otherwise (CPU interpret mode, a pass
the native path declines) the bridge ``jax.jit`` s them with the static keyword arguments bound, so jit's own cache is keyed by
(kernel, static args, shapes, dtypes) and a repeated call costs only dispatch. ``inputs`` in
``bwd`` are the forward's inputs as JAX arrays (``None`` for positions not in ``save``);
``residuals`` are what ``fwd`` returned as its second element (a tuple of JAX arrays; kept as
torch tensors between the passes so autograd owns their lifetime); ``grads`` has one JAX array
per output (contiguous; zeros for an output that got no gradient). ``bwd`` may return ``None``
for an input without a gradient. Optional fields: ``save`` (input positions ``bwd`` needs, default all),
``nondiff_outputs`` (output positions without a gradient, e.g. an int count), and
``needs_mask=True`` to receive ``needs=(bool, ...)`` (which inputs want a gradient; static) in
``bwd``, so frozen weights skip their gradient kernels.

Transport: inputs are exported as detached views (torch refuses to export a tensor that requires
grad), made contiguous if they are not (DLPack import needs compact strides), copied if they do
not start ``ALIGN``-byte aligned (JAX's GPU runtime would not copy them; see ``to_jax``) and
imported with ``jax.dlpack.from_dlpack`` semantics: zero copy, and JAX's stream waits for what
torch queued on its current stream. Outputs come back with ``torch.from_dlpack``, which makes torch's current
stream wait for JAX's. Memory and stream safety across the two allocators rest on two rules every kernel keeps:
(1) each launch imports its torch tensors afresh (nothing is cached), so JAX's stream is
ordered after everything torch queued before the call, including reads of JAX-owned outputs
that torch has since freed (JAX may reuse that memory at once); (2) every output and residual
goes through ``torch.from_dlpack`` before the call returns, so torch's stream is ordered after
the JAX computation, which may still be reading torch memory that the caller frees next.
Decisions on dtypes (both paths): int64 inputs are narrowed to int32 in torch when JAX
runs without x64 (JAX would otherwise copy them silently; indices and labels fit in int32);
float64 inputs without x64 raise TypeError (JAX would silently compute in float32).
"""
from __future__ import annotations

import functools

import torch

from forge import _runtime as _forge_runtime
from forge.spec._check import refuse_double_backward

from . import native, runtime

_through_ops = _forge_runtime.op_route()  # torch.compiler.is_compiling, or always with FORGE_THROUGH_OPS=1

_REGISTRY: dict[str, "KernelDef"] = {}


class KernelDef:
    """A Pallas kernel as the bridge sees it. See the module docstring."""

    __slots__ = ("name", "fwd", "bwd", "diff", "save", "nondiff_outputs",
                 "needs_mask", "_fwd_jit", "_bwd_jit", "_py")

    def __init__(self, name, fwd, bwd, *, diff, save=None, nondiff_outputs=(), needs_mask=False):
        self.name = name
        self.fwd = fwd
        self.bwd = bwd
        self.diff = tuple(diff)
        self.save = None if save is None else frozenset(save)
        self.nondiff_outputs = tuple(nondiff_outputs)
        self.needs_mask = needs_mask
        self._fwd_jit: dict = {}  # static key -> jitted fwd
        self._bwd_jit: dict = {}  # (static key, needs) -> jitted bwd
        self._py: dict = {}  # (pass, static key, needs) -> the plain function (native plans)
        _REGISTRY[name] = self

    def __repr__(self):
        return f"KernelDef({self.name!r})"

    def fwd_fn(self, skey):
        fn = self._fwd_jit.get(skey)
        if fn is None:
            jax = runtime.jax_module()
            fn = self._fwd_jit[skey] = jax.jit(functools.partial(self.fwd, **dict(skey)))
        return fn

    def py_fn(self, which, skey, needs=None):
        """The pass with its static arguments bound, un-jitted (what native plans trace)."""
        key = (which, skey, needs)
        fn = self._py.get(key)
        if fn is None:
            kw = dict(skey)
            if which == "bwd" and self.needs_mask:
                kw["needs"] = needs
            fn = self._py[key] = functools.partial(self.fwd if which == "fwd" else self.bwd, **kw)
        return fn

    def bwd_fn(self, skey, needs):
        key = (skey, needs if self.needs_mask else None)  # one compile unless bwd uses the mask
        fn = self._bwd_jit.get(key)
        if fn is None:
            jax = runtime.jax_module()
            kw = dict(skey)
            if self.needs_mask:
                kw["needs"] = needs
            fn = self._bwd_jit[key] = jax.jit(functools.partial(self.bwd, **kw))
        return fn


def registry() -> dict[str, KernelDef]:
    return dict(_REGISTRY)


# ---------------------------------------------------------------------------------------------
# torch -> jax


@functools.cache
def _device_info(dl_type: int, dev_id: int):
    """(jax device, stream for external ready events) for a DLPack device; fixed per process."""
    jax = runtime.jax_module()
    from jax._src import xla_bridge

    platform = "cpu" if dl_type == 1 else "cuda"
    dev = xla_bridge.get_backend(platform).device_from_local_hardware_id(dev_id)
    stream = None
    if dl_type != 1:
        try:
            stream = dev.get_stream_for_external_ready_events()
        except jax.errors.JaxRuntimeError:  # not implemented on this platform
            stream = None
    return dev, stream


def _import_public(t):
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        with torch.cuda.device(t.device):  # torch exports only from the current device
            return runtime.jax_module().dlpack.from_dlpack(t)
    return runtime.jax_module().dlpack.from_dlpack(t)


def _import_fast(t):
    # jax.dlpack.from_dlpack minus its per-call Python (platform lookup, stream query, dtype
    # canonicalisation, placement): the same C++ entry point, with per-device facts cached.
    dl_type, dev_id = t.__dlpack_device__()
    if dl_type != 1 and dl_type != 2:  # pinned host, ROCm, ...: let jax handle it
        return _import_public(t)
    dev, stream = _device_info(int(dl_type), dev_id)
    if dl_type == 2 and dev_id != torch.cuda.current_device():
        with torch.cuda.device(dev_id):  # torch exports only from the current device
            cap = t.__dlpack__(stream=stream)
    else:
        cap = t.__dlpack__(stream=stream)
    if _FAST_NEW_SIG:
        return _jaxlib.dlpack_managed_tensor_to_buffer(cap, dev, stream, None, int(dl_type))
    return _jaxlib.dlpack_managed_tensor_to_buffer(cap, dev, stream, None)


try:  # private, checked against the public path on first use; falls back if anything differs
    from jax._src.lib import _jax as _jaxlib
    from jax._src.lib import jaxlib_extension_version as _ext

    _FAST_NEW_SIG = _ext >= 467
    _import = _import_fast
except Exception:  # noqa: BLE001  (jax missing or moved: the public path still works)
    _import = _import_public
_import_checked = False


def _check_fast_path(t):
    global _import, _import_checked
    _import_checked = True
    if _import is _import_public:
        return
    try:
        a = _import_fast(t)
        ok = a.shape == tuple(t.shape) and str(a.dtype) == str(t.dtype).removeprefix("torch.")
        if t.data_ptr() % 256 == 0:  # (a misaligned buffer is legitimately copied by JAX)
            ok = ok and a.unsafe_buffer_pointer() == t.data_ptr()
    except Exception:  # noqa: BLE001
        ok = False
    if not ok:
        _import = _import_public


def _prepare(t: torch.Tensor, pos: int, kname: str, detach: bool = True, compact: bool = True):
    if detach and t.requires_grad:
        t = t.detach()
    if compact and not t.is_contiguous():
        t = t.contiguous()
    dt = t.dtype
    if dt == torch.int64 or dt == torch.float64:
        if not runtime.x64_enabled():
            if dt == torch.int64:
                t = t.to(torch.int32)
            else:
                raise TypeError(f"{kname}: input {pos} is float64 but JAX runs without x64; "
                                "enable jax_enable_x64 or pass float32")
    return t


_WIDE = (torch.int64, torch.float64)


def _prepare_all(tensors: tuple, kname: str, detach: bool = True) -> tuple:
    """The dtype decisions of :func:`_prepare` (and the detach, unless ``detach=False``: inside
    an autograd.Function autograd records nothing anyway) for a call that tries a native plan
    first; ``tensors`` itself when none needs a change, checked without a call per tensor.
    Strides are left as they are: a plan hands each kernel a compact tensor itself
    (native._ready), and the DLPack path prepares what it exports (``to_jax``)."""
    for t in tensors:
        if (detach and t.requires_grad) or t.dtype in _WIDE:
            return tuple([_prepare(t, i, kname, detach, compact=False) for i, t in enumerate(tensors)])
    return tensors


# Every buffer the bridge hands JAX starts at a multiple of this many bytes. JAX's GPU runtime
# imports a DLPack tensor as a view wherever it points: only its CPU runtime copies a misaligned
# one (jaxlib's dlpack import falls back to a copy for kDLCPU alone). XLA's GPU executable then
# refuses an entry parameter that is not 16-byte aligned ("Address of buffer N must be a
# multiple of ...", seen on the H200 for a weight 4 bytes into its storage), and the Pallas
# kernels' lowering declares every pointer 32-byte aligned (tt.divisibility = 32), as the
# native path's launches do (native._ready). The copy is made afresh on every call, like every
# import, so an in-place update of the tensor (an optimizer step) reaches the next call.
ALIGN = 32


def to_jax(t: torch.Tensor, pos: int = 0, kname: str = "bridge"):
    """A JAX view of ``t`` (after the dtype decisions in the module docstring): zero copy,
    except for a tensor not :data:`ALIGN`-byte aligned, which JAX gets a fresh copy of."""
    t = _prepare(t, pos, kname)
    if t.data_ptr() % ALIGN:
        t = t.clone()
    if not _import_checked:
        _check_fast_path(t)
    return _import(t)


def to_torch(a) -> torch.Tensor:
    return torch.from_dlpack(a)


def _inputs_to_jax(kdef, tensors):
    # Every input is imported afresh on every call, weights too. A cache of weight views would
    # save ~0.1 ms per weight and call, but (a) a tensor that cannot be aliased (an address not
    # ALIGN-byte aligned, copied by to_jax; on the CPU JAX itself copies one not 64-byte
    # aligned) is imported as a copy, so a cached copy misses every later in-place update (an
    # optimizer step), and (b) a cached view pins its tensor's storage: torch keeps a tensor's
    # Python object alive while the DLPack capsule holds it, so no weak reference ever tells
    # the cache that the model is gone. The native path (bridge/native.py) imports nothing.
    return tuple(to_jax(t, i, kdef.name) for i, t in enumerate(tensors))


# ---------------------------------------------------------------------------------------------
# the one autograd.Function
#
# What backward needs (the inputs in ``kdef.save`` and the residuals) is kept as torch tensors
# through save_for_backward, not as JAX arrays on ctx: autograd then frees it right after
# backward (unless retain_graph), checks version counters (an in-place edit of a saved input
# raises), and counts it in torch's memory view. Backward re-imports it (zero copy; weight views
# come from the cache).


class _Bridged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kdef, skey, *tensors):
        prepared = _prepare_all(tensors, kdef.name, detach=False)
        p = native.plan(kdef, "fwd", skey, prepared)
        touts, tres = p(prepared) if p is not None else _run_fwd_dlpack(kdef, skey, prepared)
        ctx.plan = p
        keep = kdef.save
        saved = prepared if keep is None else tuple(t if i in keep else None for i, t in enumerate(prepared))
        ctx.save_for_backward(*saved, *tres)
        ctx.kdef, ctx.skey, ctx.n_in = kdef, skey, len(tensors)
        ctx.in_dtypes = tuple([t.dtype for t in tensors])
        if kdef.nondiff_outputs:
            ctx.mark_non_differentiable(*(touts[i] for i in kdef.nondiff_outputs))
        return touts if len(touts) > 1 else touts[0]

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            refuse_double_backward(ctx.kdef.name)
        n = ctx.n_in
        saved = ctx.saved_tensors  # raises if a saved input was modified in place
        needs = tuple(ctx.needs_input_grad[2:])
        return (None, None, *run_bwd(ctx.kdef, ctx.skey, needs, saved[:n], saved[n:], grads, ctx.in_dtypes,
                                     ctx.plan))


def run_bwd(kdef, skey, needs, inputs, residuals, grads, in_dtypes, fwd_plan=None):
    """One gradient (or None) per input of ``kdef`` as torch tensors, in the inputs' dtypes:
    natively launched where a plan serves it, through JAX and DLPack otherwise. ``fwd_plan``:
    the forward's plan where it ran natively (its backward plans hang on it, one per ``needs``:
    autograd hands gradients in the outputs' shapes and dtypes, so the forward's signature is
    the backward's)."""
    grads = _prepare_all(grads, kdef.name + " grad")
    args = (tuple(inputs), tuple(residuals), grads)
    leaves = native._leaves(args)
    p = None if fwd_plan is None else fwd_plan.bwd.get(needs)
    if p is None:
        p = native.plan(kdef, "bwd", (skey, needs), args, leaves)
        if p is not None and fwd_plan is not None:
            fwd_plan.bwd[needs] = p
    if p is not None:
        dins = p(leaves)
    else:
        _refuse_capture(kdef, "bwd")
        jx = tuple(None if t is None else to_jax(t, i, kdef.name) for i, t in enumerate(inputs))
        res = tuple(to_jax(r) for r in residuals)
        g = tuple(to_jax(gr, i, kdef.name + " grad") for i, gr in enumerate(grads))
        dins = tuple(None if d is None else to_torch(d) for d in kdef.bwd_fn(skey, needs)(jx, res, g))
    out = []
    for i, d in enumerate(dins):
        if d is None or not needs[i]:
            out.append(None)
        else:
            out.append(d if d.dtype == in_dtypes[i] else d.to(in_dtypes[i]))
    return out


def _refuse_capture(kdef, which):
    """JAX launches on its own stream: inside a torch CUDA-graph capture that is an error."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        why = native.status()["declined"].get(f"{kdef.name}/{which}") or native.available()[1]
        raise RuntimeError(f"pallas kernel {kdef.name!r} ({which}) cannot be captured in a CUDA graph: it runs "
                           f"through JAX on JAX's own stream ({why})")


def _run_fwd(kdef, skey, tensors):
    """(outputs, residuals) of ``kdef``'s forward as torch tensors: natively launched where a
    plan serves it (bridge/native.py), through JAX and DLPack otherwise."""
    p = native.plan(kdef, "fwd", skey, tensors)
    if p is not None:  # (detached, or inside an autograd.Function: the plan's torch steps record nothing)
        return p(tensors)  # (outputs tuple, residuals tuple)
    return _run_fwd_dlpack(kdef, skey, tensors)


def _run_fwd_dlpack(kdef, skey, tensors):
    _refuse_capture(kdef, "fwd")
    outs, res = kdef.fwd_fn(skey)(*_inputs_to_jax(kdef, tensors))
    return tuple(to_torch(o) for o in outs), tuple(to_torch(r) for r in res)


_TRACED = None  # the op layer's entry under torch.compile (forge.ops.library installs it)


def install(traced) -> None:
    """Called by forge.ops.library: under torch.compile :func:`apply` calls
    ``traced(kdef, tensors, static) -> outputs`` (the kernel's torch.ops.forge op)."""
    global _TRACED
    _TRACED = traced


def through_ops() -> bool:
    """Whether :func:`apply` hands its call to the op layer (torch.compile is tracing)."""
    return _TRACED is not None and _through_ops()


def apply(kdef: KernelDef, *tensors, **static):
    """Run a registered kernel on torch tensors; differentiable through ``kdef.bwd``.

    ``static`` values must be hashable (floats, ints, strings, tuples): they are compile-time
    constants of the JAX functions and part of the cache key. Under torch.compile the call goes
    to the op layer's op for ``kdef`` (see :func:`install`).
    """
    if _TRACED is not None and _through_ops():
        outs = _TRACED(kdef, tensors, static)
        return outs if len(outs) > 1 else outs[0]
    skey = tuple(static.items())
    if torch.is_grad_enabled() and any(tensors[i].requires_grad for i in kdef.diff):
        return _Bridged.apply(kdef, skey, *tensors)
    # no autograd graph to build: skip the Function machinery and residual bookkeeping
    outs, _ = _run_fwd(kdef, skey, _prepare_all(tensors, kdef.name))
    return outs if len(outs) > 1 else outs[0]
