"""The torch <-> JAX bridge: ONE autograd.Function for every Pallas kernel, choosing per call
between its two transports (native launch on torch's stream, ``bridge/native/``; JAX and
DLPack, ``bridge/dlpack.py``), and the cache of jitted passes.

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
path serves them (a CUDA device, ``bridge/native/``), each pass runs as a plan of Triton-compiled
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
``bwd``, so frozen weights skip their gradient kernels, and ``writes`` (forward input positions
the caller hands over to be updated in place: a plan's outputs aliasing them, through
``input_output_aliases``, are those tensors' own buffers, not copies; a cache write).

Transport: the DLPack path's rules (zero-copy imports afresh on every call, every output through
``torch.from_dlpack`` before the call returns) and the dtype decisions both paths share
(int64 narrowed to int32 without x64, float64 refused) are ``bridge/dlpack.py``'s.
"""
from __future__ import annotations

import functools

import torch

from forge import _runtime as _forge_runtime
from forge.spec._check import BoundedCache, refuse_double_backward

from . import dlpack, native, runtime

_through_ops = _forge_runtime.op_route()  # torch.compiler.is_compiling, or always with FORGE_THROUGH_OPS=1

_REGISTRY: dict[str, "KernelDef"] = {}


_JITS = 64  # jitted functions a kernel keeps, per pass (the oldest goes first)


class KernelDef:
    """A Pallas kernel as the bridge sees it. See the module docstring."""

    __slots__ = ("name", "fwd", "bwd", "diff", "save", "nondiff_outputs",
                 "needs_mask", "static_dims", "writes", "_fwd_jit", "_bwd_jit", "_py")

    def __init__(self, name, fwd, bwd, *, diff, save=None, nondiff_outputs=(), needs_mask=False, static_dims=(),
                 writes=()):
        self.name = name
        self.fwd = fwd
        self.bwd = bwd
        self.diff = tuple(diff)
        self.save = None if save is None else frozenset(save)
        self.nondiff_outputs = tuple(nondiff_outputs)
        self.needs_mask = needs_mask
        # (input position, dim) of sizes the kernel unrolls over (a router's top-k): a compile
        # with symbolic sizes reads these as ints (bridge/_ops.py, _shape_eval)
        self.static_dims = tuple(static_dims)
        self.writes = tuple(writes)  # (the forward's inputs updated in place: see the module docstring)
        # (bounded: a static key can hold a row count, the fused loss's chunk rows, so a run of
        # ever new token counts would keep a compiled program for each, ~5 MB apiece on the CPU)
        self._fwd_jit = BoundedCache(_JITS)  # static key -> jitted fwd
        self._bwd_jit = BoundedCache(_JITS)  # (static key, needs) -> jitted bwd
        self._py = BoundedCache(_JITS)  # (pass, static key, needs) -> the plain function (native plans)
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


def forget_traces() -> None:
    """Drop every registered kernel's jitted passes, the native plans and JAX's trace caches, so
    the next call traces again: for a module constant that a kernel reads when it is traced (a
    tile sweep, a test of a variant). Recipes on disk are keyed by the code, not by such
    constants: where they are used, point ``FORGE_CACHE_DIR`` elsewhere as well."""
    for kd in _REGISTRY.values():
        kd._fwd_jit.clear()
        kd._bwd_jit.clear()
        kd._py.clear()
    native.clear()
    runtime.jax_module().clear_caches()


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
        prepared = dlpack.prepare_all(tensors, kdef.name, detach=False)
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
    grads = dlpack.prepare_all(grads, kdef.name + " grad")
    args = (tuple(inputs), tuple(residuals), grads)
    leaves = native.leaves_of(args)
    p = None if fwd_plan is None else fwd_plan.bwd.get(needs)
    if p is None:
        p = native.plan(kdef, "bwd", (skey, needs), args, leaves)
        if p is not None and fwd_plan is not None:
            fwd_plan.bwd[needs] = p
    if p is not None:
        dins = p(leaves)
    else:
        _refuse_capture(kdef, "bwd")
        jx = tuple(None if t is None else dlpack.to_jax(t, i, kdef.name) for i, t in enumerate(inputs))
        res = tuple(dlpack.to_jax(r) for r in residuals)
        g = tuple(dlpack.to_jax(gr, i, kdef.name + " grad") for i, gr in enumerate(grads))
        dins = tuple(None if d is None else dlpack.to_torch(d) for d in kdef.bwd_fn(skey, needs)(jx, res, g))
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
    plan serves it (bridge.native), through JAX and DLPack otherwise."""
    p = native.plan(kdef, "fwd", skey, tensors)
    if p is not None:  # (detached, or inside an autograd.Function: the plan's torch steps record nothing)
        return p(tensors)  # (outputs tuple, residuals tuple)
    return _run_fwd_dlpack(kdef, skey, tensors)


def run_fwd(kdef: KernelDef, *tensors, **static) -> tuple:
    """The outputs (a tuple) of ``kdef``'s forward on torch tensors, natively launched where a
    plan serves it: no autograd and never through the op layer, for passes that a bridged
    kernel's own torch-side driver runs (the fused loss's row chunks)."""
    return _run_fwd(kdef, tuple(static.items()), dlpack.prepare_all(tensors, kdef.name))[0]


def _run_fwd_dlpack(kdef, skey, tensors):
    _refuse_capture(kdef, "fwd")
    outs, res = kdef.fwd_fn(skey)(*dlpack.inputs_to_jax(kdef, tensors))
    return tuple(dlpack.to_torch(o) for o in outs), tuple(dlpack.to_torch(r) for r in res)


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
    outs, _ = _run_fwd(kdef, skey, dlpack.prepare_all(tensors, kdef.name))
    return outs if len(outs) > 1 else outs[0]
