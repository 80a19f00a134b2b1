"""Every kernel of every backend as an op in the ``forge`` namespace (torch.library), forward and
backward, with a fake (meta) implementation and registered autograd, so that torch.compile
traces a patched model whole (``fullgraph=True``).

Ops: ``torch.ops.forge.<backend>_<kernel>_fwd(tensors, static) -> (outputs, residuals)`` and
``torch.ops.forge.<backend>_<kernel>_bwd(saved, residuals, grads, needs, static) -> grads``, for
each kernel a backend describes (``forge_triton._ops.REGISTRY``, ``bridge.core.registry()``).
``tensors`` are the kernel's tensor inputs that are not None, ``static`` a string holding the
hashable arguments (``repr`` of their items, read back with ``ast.literal_eval``, cached) and the
call's structure (which inputs were None). The forward op's autograd saves what the kernel's
backward reads and calls the backward op with the gradients the inputs need, bound by name (or,
where an adaptor gives a ``traced_bwd``, runs that in plain torch ops instead: no backward op).
Residuals are outputs of the forward op (a custom op cannot keep Python state between passes).

When these ops run: only under torch.compile (``torch.compiler.is_compiling()``). Eager calls
keep the backends' direct paths (FastKernel launches, their autograd.Functions), which cost a
few microseconds less host time per call than an op call (bench/diagnostics/bench_op_overhead.py). Each
backend's functional API turns here through one entry, installed with :func:`register`
(``forge_triton._ops.call``, ``bridge.core.apply``).

On a GPU a Triton kernel marked ``inductor`` is a ``torch.library.triton_op`` whose launches go
through ``torch.library.wrap_triton``: inductor sees the kernels. In Triton's interpreter
(``wrap_triton`` cannot trace an interpreted kernel) and for the kernels built around cuBLAS
calls (LoRA, the loss) the op is an opaque ``torch.library.custom_op``; its fake runs the
backend's forward with the launches skipped (Triton) or ``jax.eval_shape`` (Pallas).

The backend-neutral nodes (:mod:`forge.ops.gated_mlp`, :mod:`forge.ops.precomputed`) register
their own ops here too, over the pieces each backend hands them.
"""
import ast
import functools
import threading

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar as _guard_scalar

NAMESPACE = "forge"
_LOCK = threading.Lock()
_OPS: dict = {}  # (backend, kernel name) -> the forward op (an OpOverloadPacket)
_AUTOGRAD: set = set()  # qualified names of the forward ops with a registered backward


@functools.lru_cache(maxsize=4096)
def parse(static: str) -> tuple:
    """The static string of an op call back as (items, structure) (cached: one parse per call
    signature, bounded)."""
    return ast.literal_eval(static)


def _concrete(v):
    """``v`` with every number a plain Python one. Under ``torch.compile(dynamic=True)`` dynamo
    turns float attributes of a module (an RMSNorm's eps) into symbolic floats, which a static
    string cannot hold; ``guard_scalar`` specialises them to their value, with a guard."""
    if isinstance(v, tuple | list):
        return tuple(_concrete(x) for x in v)
    if isinstance(v, bool | int | float | torch.SymInt | torch.SymFloat | torch.SymBool):
        return _guard_scalar(v)
    return v


def encode(items, structure) -> str:
    return repr((tuple((k, _concrete(v)) for k, v in items), structure))


def _expand(tensors, present):
    it = iter(tensors)
    return tuple(next(it) if p else None for p in present)


def _keys(t):
    """What identifies ``t``'s memory: its storage, and (real tensors) its address, which JAX
    outputs imported through DLPack share with an input without sharing its storage object."""
    st = t.untyped_storage()
    try:
        p = st.data_ptr()
    except RuntimeError:  # a fake tensor's storage has no address
        p = 0
    return (("s", st._cdata), ("p", p)) if p else (("s", st._cdata),)


def _fresh(ts, inputs):
    """``ts`` with every tensor that shares memory with an input or an earlier one copied: an
    op's outputs may alias neither (a kernel may return views of one buffer, e.g. the LoRA A
    gradients cut from one GEMM, or JAX an input's buffer). The fakes go through it too (on
    storages alone), so they alias exactly as the real outputs do: not at all. Not for inductor's
    traced bodies (their outputs are fresh by contract)."""
    seen = {k for t in inputs if isinstance(t, torch.Tensor) and t.numel() for k in _keys(t)}
    out = []
    for t in ts:
        if t.numel():
            ks = _keys(t)
            if any(k in seen for k in ks):
                t = t.clone()
                ks = _keys(t)
            seen.update(ks)
        out.append(t)
    return out


def _materialise(grads, meta):
    return tuple(g if g is not None else torch.zeros(s, dtype=d, device=dev) for g, (s, d, dev) in zip(grads, meta))


class _Spec:
    """One kernel of one backend, as the generic op code needs it (built by the adaptor)."""

    __slots__ = ("backend", "kdef", "adaptor", "qualname")

    def __init__(self, backend, kdef, adaptor):
        self.backend, self.kdef, self.adaptor = backend, kdef, adaptor
        self.qualname = f"{backend}_{adaptor.op_name(kdef)}"


def _define(spec: _Spec):
    """Register ``forge::<qualname>_fwd`` and ``_bwd`` with fakes and autograd; the forward op."""
    ad, kdef = spec.adaptor, spec.kdef
    inductor = ad.inductor(kdef)

    def fwd_body(tensors: list[torch.Tensor], static: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        items, (present, _dtypes) = parse(static)
        outs, res = ad.run_fwd(kdef, _expand(tensors, present), dict(items))
        if inductor:  # traced by inductor: the backend's bodies return fresh tensors by contract
            return list(outs), list(res)
        both = _fresh(list(outs) + list(res), tensors)
        return both[:len(outs)], both[len(outs):]

    def fwd_fake(tensors, static):
        items, (present, _dtypes) = parse(static)
        outs, res = ad.fake_fwd(kdef, _expand(tensors, present), dict(items))
        both = _fresh(list(outs) + list(res), tensors)
        return both[:len(outs)], both[len(outs):]

    def bwd_body(saved: list[torch.Tensor], residuals: list[torch.Tensor], grads: list[torch.Tensor],
                 needs: list[bool], static: str) -> list[torch.Tensor]:
        items, (present, dtypes) = parse(static)
        inputs = _expand(saved, ad.saved_present(kdef, present))
        out = ad.run_bwd(kdef, inputs, tuple(residuals), tuple(grads), _needs(kdef, ad, present, needs),
                         dict(items), dtypes)
        got = [out[n] for n, f in zip(ad.diff_names(kdef, len(present)), needs) if f]
        return got if inductor else _fresh(got, (*saved, *residuals, *grads))

    def bwd_fake(saved, residuals, grads, needs, static):
        items, (present, dtypes) = parse(static)
        inputs = _expand(saved, ad.saved_present(kdef, present))
        out = ad.fake_bwd(kdef, inputs, tuple(residuals), tuple(grads), _needs(kdef, ad, present, needs),
                          dict(items), dtypes)
        return _fresh([out[n] for n, f in zip(ad.diff_names(kdef, len(present)), needs) if f],
                      (*saved, *residuals, *grads))

    fwd_name, bwd_name = f"{NAMESPACE}::{spec.qualname}_fwd", f"{NAMESPACE}::{spec.qualname}_bwd"
    if ad.inductor(kdef):  # a GPU Triton kernel: inductor traces the body's wrap_triton launches
        fwd_op = torch.library.triton_op(fwd_name, ad.wrapped(fwd_body), mutates_args=())
    else:
        fwd_op = torch.library.custom_op(fwd_name, fwd_body, mutates_args=())
        fwd_op.register_fake(fwd_fake)
    has_bwd = ad.has_bwd(kdef)
    traced_bwd = ad.traced_bwd(kdef) if hasattr(ad, "traced_bwd") else None  # (optional)
    if has_bwd and traced_bwd is None:
        if ad.inductor(kdef):
            bwd_op = torch.library.triton_op(bwd_name, ad.wrapped(bwd_body), mutates_args=())
        else:
            bwd_op = torch.library.custom_op(bwd_name, bwd_body, mutates_args=())
            bwd_op.register_fake(bwd_fake)
    if has_bwd:
        fwd_op.register_autograd(_backward(spec, traced_bwd), setup_context=_setup_context(spec))
        _AUTOGRAD.add(fwd_name)
    return getattr(torch.ops.forge, f"{spec.qualname}_fwd")


def _needs(kdef, ad, present, flags):
    """{differentiable input name: whether its gradient is wanted} from the op's bool list."""
    return dict(zip(ad.diff_names(kdef, len(present)), flags))


def _setup_context(spec: _Spec):
    ad, kdef = spec.adaptor, spec.kdef

    def setup_context(ctx, inputs, output):
        tensors, static = inputs
        outs, res = output
        _items, (present, _dtypes) = parse(static)
        full = _expand(tensors, present)
        names = ad.input_names(kdef, len(present))
        wants = {n: t is not None and t.requires_grad for n, t in zip(names, full)}
        ctx.wanted = [n for n in ad.diff_names(kdef, len(present)) if wants[n]]
        ctx.flags = [wants[n] for n in ad.diff_names(kdef, len(present))]
        keep = ad.saved_present(kdef, present)
        ctx.save_for_backward(*(t for t, k in zip(full, keep) if k), *res)
        ctx.n_saved, ctx.static, ctx.present, ctx.names = sum(keep), static, present, names
        ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]

    return setup_context


def _backward(spec: _Spec, traced_bwd=None):
    """The forward op's registered backward: the backward op, or ``traced_bwd`` (plain torch ops
    that the compiled backward holds, no op of its own) where the adaptor gives one."""
    bwd = None
    ad, kdef = spec.adaptor, spec.kdef

    def backward(ctx, grad_outs, _grad_res):
        nonlocal bwd
        saved = ctx.saved_tensors
        n = ctx.n_saved
        grads = _materialise(grad_outs, ctx.out_meta)
        if not ctx.wanted:
            got = {}
        elif traced_bwd is not None:
            items, (present, dtypes) = parse(ctx.static)
            got = traced_bwd(_expand(saved[:n], ad.saved_present(kdef, present)), tuple(saved[n:]), grads,
                             _needs(kdef, ad, present, ctx.flags), dict(items), dtypes)
        else:
            if bwd is None:
                bwd = getattr(torch.ops.forge, f"{spec.qualname}_bwd")
            got = dict(zip(ctx.wanted, bwd(list(saved[:n]), list(saved[n:]), list(grads), ctx.flags, ctx.static)))
        per_input = [got.get(name) for name, p in zip(ctx.names, ctx.present) if p]
        return per_input, None

    return backward


def traced_entry(backend: str, adaptor):
    """The function a backend's functional API calls under torch.compile:
    ``(kdef, tensors, static dict) -> outputs tuple``, through the forward op. Every op of the
    backend is defined here, before any tracing (dynamo traces only the dict lookup)."""
    ops = {}
    for kdef in adaptor.kernels():
        spec = _Spec(backend, kdef, adaptor)
        key = (backend, spec.qualname)
        with _LOCK:
            if key not in _OPS:
                _OPS[key] = _define(spec)
        ops[kdef.name] = _OPS[key]

    def traced(kdef, tensors, static):
        present = tuple(t is not None for t in tensors)
        dtypes = tuple(None if t is None else str(t.dtype) for t in tensors)
        outs, _res = ops[kdef.name]([t for t in tensors if t is not None], encode(static.items(), (present, dtypes)))
        return tuple(outs)

    return traced


def register(backend: str, adaptor) -> None:
    """Define the ops of ``backend`` (one pair per kernel) and install the op layer's entry in
    it: its functional API calls the entry under torch.compile."""
    adaptor.install(traced_entry(backend, adaptor))


def op_names(backend: str) -> list[str]:
    """The qualified names of the ops defined for ``backend`` so far."""
    out = []
    for (b, q), _op in _OPS.items():
        if b == backend:
            out.append(f"{NAMESPACE}::{q}_fwd")
            if hasattr(torch.ops.forge, f"{q}_bwd"):
                out.append(f"{NAMESPACE}::{q}_bwd")
    return out


def has_autograd(qualname: str) -> bool:
    """Whether the forward op ``qualname`` ("forge::<backend>_<kernel>_fwd") has a registered
    backward (its backward op, or plain torch ops traced into the compiled backward)."""
    return qualname in _AUTOGRAD
