"""The torch <-> JAX bridge: ONE autograd.Function for every Pallas kernel, DLPack transport,
and the compile cache.

Registering a kernel (the whole API; other modules of ``bridge`` do exactly this)::

    from bridge import core
    from forge_pallas import rmsnorm as _k

    RMSNORM = core.KernelDef(
        "rmsnorm",
        fwd=_k.rmsnorm_fwd,     # (*inputs, **static) -> (outputs tuple, residuals tuple)
        bwd=_k.rmsnorm_bwd,     # (inputs, residuals, grads, **static) -> one grad (or None) per input
        diff=(0, 1),            # positions of the differentiable tensor inputs
        cache_inputs=(1,),      # weights: their jax views are cached while their storage holds
    )

    def rmsnorm(x, weight, eps=1e-6, *, casting="llama", offset=0.0):
        ... validate with the spec, reshape ...
        return core.apply(RMSNORM, x2, weight, eps=float(eps), casting=casting, offset=float(offset))

``fwd`` and ``bwd`` are plain JAX functions (they call the ``pallas_call`` s); the bridge
``jax.jit`` s them with the static keyword arguments bound, so jit's own cache is keyed by
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
grad), made contiguous if they are not (DLPack import needs compact strides) and imported with
``jax.dlpack.from_dlpack`` semantics: zero copy, and JAX's stream waits for what torch queued on
its current stream. Outputs come back with ``torch.from_dlpack``, which makes torch's current
stream wait for JAX's. Memory and stream safety across the two allocators rest on two rules every kernel keeps:
(1) each launch imports at least one fresh (non-cached) torch tensor, so JAX's stream is
ordered after everything torch queued before the call, including reads of JAX-owned outputs
that torch has since freed (JAX may reuse that memory at once); (2) every output and residual
goes through ``torch.from_dlpack`` before the call returns, so torch's stream is ordered after
the JAX computation, which may still be reading torch memory that the caller frees next.
Do not mark every input of a kernel ``cache_inputs``. Decisions on dtypes: int64 inputs are narrowed to int32 in torch when JAX
runs without x64 (JAX would otherwise copy them silently; indices and labels fit in int32);
float64 inputs without x64 raise TypeError (JAX would silently compute in float32).
"""
from __future__ import annotations

import functools
import weakref

import torch

from . import runtime

_REGISTRY: dict[str, "KernelDef"] = {}


class KernelDef:
    """A Pallas kernel as the bridge sees it. See the module docstring."""

    __slots__ = ("name", "fwd", "bwd", "diff", "cache_inputs", "save", "nondiff_outputs",
                 "needs_mask", "_fwd_jit", "_bwd_jit")

    def __init__(self, name, fwd, bwd, *, diff, cache_inputs=(), save=None, nondiff_outputs=(),
                 needs_mask=False):
        self.name = name
        self.fwd = fwd
        self.bwd = bwd
        self.diff = tuple(diff)
        self.cache_inputs = frozenset(cache_inputs)
        self.save = None if save is None else frozenset(save)
        self.nondiff_outputs = tuple(nondiff_outputs)
        self.needs_mask = needs_mask
        self._fwd_jit: dict = {}  # static key -> jitted fwd
        self._bwd_jit: dict = {}  # (static key, needs) -> jitted bwd
        _REGISTRY[name] = self

    def __repr__(self):
        return f"KernelDef({self.name!r})"

    def fwd_fn(self, skey):
        fn = self._fwd_jit.get(skey)
        if fn is None:
            jax = runtime.jax_module()
            fn = self._fwd_jit[skey] = jax.jit(functools.partial(self.fwd, **dict(skey)))
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
    return runtime.jax_module().dlpack.from_dlpack(t)


def _import_fast(t):
    # jax.dlpack.from_dlpack minus its per-call Python (platform lookup, stream query, dtype
    # canonicalisation, placement): the same C++ entry point, with per-device facts cached.
    dl_type, dev_id = t.__dlpack_device__()
    if dl_type != 1 and dl_type != 2:  # pinned host, ROCm, ...: let jax handle it
        return _import_public(t)
    dev, stream = _device_info(int(dl_type), dev_id)
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


def _prepare(t: torch.Tensor, pos: int, kname: str):
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
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


def to_jax(t: torch.Tensor, pos: int = 0, kname: str = "bridge"):
    """A zero-copy JAX view of ``t`` (after the dtype decisions in the module docstring)."""
    t = _prepare(t, pos, kname)
    if not _import_checked:
        _check_fast_path(t)
    return _import(t)


# Weight views: id(tensor) -> (weakref, data_ptr, shape, dtype, jax array). A view pins its
# tensor's storage, so the cache is small and bounded; a changed data_ptr (FSDP2 re-gathers
# into a fresh buffer) or a dead tensor invalidates the entry.
_VIEW_CACHE: dict = {}
_VIEW_CACHE_MAX = 256


def _cached_view(t, pos, kname):
    key = id(t)
    e = _VIEW_CACHE.get(key)
    if e is not None and e[0]() is t and e[1] == t.data_ptr() and e[2] == t.shape and e[3] == t.dtype:
        return e[4]
    if not t.is_contiguous() or t.dtype in (torch.int64, torch.float64):
        return to_jax(t, pos, kname)  # a fresh copy each call: nothing stable to cache
    arr = to_jax(t, pos, kname)
    if len(_VIEW_CACHE) >= _VIEW_CACHE_MAX:
        _VIEW_CACHE.pop(next(iter(_VIEW_CACHE)))
    _VIEW_CACHE[key] = (weakref.ref(t), t.data_ptr(), t.shape, t.dtype, arr)
    return arr


def clear_cache() -> None:
    """Drop cached weight views (and the storage they pin)."""
    _VIEW_CACHE.clear()


def to_torch(a) -> torch.Tensor:
    return torch.from_dlpack(a)


def _inputs_to_jax(kdef, tensors):
    ci = kdef.cache_inputs
    return tuple(
        _cached_view(t, i, kdef.name) if i in ci else to_jax(t, i, kdef.name)
        for i, t in enumerate(tensors)
    )


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
        prepared = tuple(t if i in kdef.cache_inputs else _prepare(t, i, kdef.name) for i, t in enumerate(tensors))
        outs, res = kdef.fwd_fn(skey)(*_inputs_to_jax(kdef, prepared))
        touts = tuple(to_torch(o) for o in outs)
        keep = kdef.save
        saved = prepared if keep is None else tuple(t if i in keep else None for i, t in enumerate(prepared))
        ctx.save_for_backward(*saved, *(to_torch(r) for r in res))
        ctx.kdef, ctx.skey, ctx.n_in = kdef, skey, len(tensors)
        ctx.in_dtypes = tuple(t.dtype for t in tensors)
        if kdef.nondiff_outputs:
            ctx.mark_non_differentiable(*(touts[i] for i in kdef.nondiff_outputs))
        return touts if len(touts) > 1 else touts[0]

    @staticmethod
    def backward(ctx, *grads):
        kdef, n = ctx.kdef, ctx.n_in
        saved = ctx.saved_tensors  # raises if a saved input was modified in place
        ci = kdef.cache_inputs
        jx = tuple(None if t is None else (_cached_view(t, i, kdef.name) if i in ci else to_jax(t, i, kdef.name))
                   for i, t in enumerate(saved[:n]))
        res = tuple(to_jax(r) for r in saved[n:])
        needs = tuple(ctx.needs_input_grad[2:])
        g = tuple(to_jax(gr, i, kdef.name + " grad") for i, gr in enumerate(grads))
        dins = kdef.bwd_fn(ctx.skey, needs)(jx, res, g)
        out = [None, None]
        for i, d in enumerate(dins):
            if d is None or not needs[i]:
                out.append(None)
            else:
                dt = to_torch(d)
                out.append(dt if dt.dtype == ctx.in_dtypes[i] else dt.to(ctx.in_dtypes[i]))
        return tuple(out)


def apply(kdef: KernelDef, *tensors, **static):
    """Run a registered kernel on torch tensors; differentiable through ``kdef.bwd``.

    ``static`` values must be hashable (floats, ints, strings, tuples): they are compile-time
    constants of the JAX functions and part of the cache key.
    """
    skey = tuple(static.items())
    if torch.is_grad_enabled() and any(tensors[i].requires_grad for i in kdef.diff):
        return _Bridged.apply(kdef, skey, *tensors)
    # no autograd graph to build: skip the Function machinery and residual bookkeeping
    outs, _ = kdef.fwd_fn(skey)(*_inputs_to_jax(kdef, tensors))
    return tuple(to_torch(o) for o in outs) if len(outs) > 1 else to_torch(outs[0])
