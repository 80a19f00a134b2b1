"""What the op layer (``forge.ops.library``) takes from the Pallas backend: the adaptor that
runs a bridged kernel (``core.KernelDef``) as a torch.library op.

The forward and backward run exactly as the bridge runs them eagerly (``core._run_fwd``,
``core.run_bwd``: natively launched where a plan serves them, through JAX and DLPack otherwise);
their fakes are ``jax.eval_shape`` of the kernel's JAX functions on the inputs' shapes and
dtypes (after the bridge's dtype decisions), so no kernel runs while torch.compile traces.
Inputs are named by position ("0", "1", ...), as the KernelDefs declare them (``diff``,
``save``). Imports the bridge's own modules only: the op layer installs itself with
:func:`install` (``core.apply`` calls it under torch.compile).
"""
from __future__ import annotations

import torch

from . import core, runtime

install = core.install


def kernels() -> list:
    """Every kernel this backend runs as an op (the fused loss is the op layer's own node)."""
    import importlib

    for mod in ("kernels", "lora"):
        importlib.import_module(f"{__package__}.{mod}")
    return [k for k in core.registry().values() if k.name != "fused_linear_ce"]


def op_name(kdef) -> str:
    return kdef.name


def input_names(kdef, n: int) -> tuple:
    return tuple(str(i) for i in range(n))


def diff_names(kdef, n: int) -> tuple:
    return tuple(str(i) for i in kdef.diff if i < n)


def saved_present(kdef, present) -> tuple:
    return tuple(p and (kdef.save is None or i in kdef.save) for i, p in enumerate(present))


def has_bwd(kdef) -> bool:
    return kdef.bwd is not None


def inductor(kdef) -> bool:
    return False  # JAX-compiled: opaque to inductor


def wrapped(body):
    return body


def _prepared(kdef, tensors):
    return tuple(None if t is None else core._prepare(t, i, kdef.name) for i, t in enumerate(tensors))


def run_fwd(kdef, tensors, static):
    prepared = _prepared(kdef, tensors)
    return core._run_fwd(kdef, tuple(static.items()), prepared)  # (the op layer copies aliases)


def _torch_dtype(d) -> torch.dtype:
    return getattr(torch, str(d))


def _specs(ts):
    import jax

    return tuple(None if t is None else jax.ShapeDtypeStruct(tuple(int(s) for s in t.shape),
                                                             str(t.dtype).removeprefix("torch."))
                 for t in ts)


def _empty(shape_dtype, device):
    return torch.empty(tuple(shape_dtype.shape), dtype=_torch_dtype(shape_dtype.dtype), device=device)


def fake_fwd(kdef, tensors, static):
    jax = runtime.jax_module()
    prepared = _prepared(kdef, tensors)
    device = next(t.device for t in tensors if t is not None)
    outs, res = jax.eval_shape(kdef.py_fn("fwd", tuple(static.items())), *_specs(prepared))
    return [_empty(o, device) for o in outs], [_empty(r, device) for r in res]


def _needs_tuple(kdef, needs, n):
    return tuple(needs.get(str(i), False) for i in range(n))


def _in_dtypes(dtypes):
    return tuple(None if d is None else getattr(torch, d.removeprefix("torch.")) for d in dtypes)


def run_bwd(kdef, inputs, res, grads, needs, static, dtypes):
    n = len(inputs)
    nt = _needs_tuple(kdef, needs, n)
    dins = core.run_bwd(kdef, tuple(static.items()), nt, _prepared(kdef, inputs), res, grads, _in_dtypes(dtypes))
    return {str(i): d for i, d in enumerate(dins) if nt[i]}


def fake_bwd(kdef, inputs, res, grads, needs, static, dtypes):
    jax = runtime.jax_module()
    n = len(inputs)
    nt = _needs_tuple(kdef, needs, n)
    in_dtypes = _in_dtypes(dtypes)
    device = grads[0].device
    fn = kdef.py_fn("bwd", tuple(static.items()), nt)
    dins = jax.eval_shape(fn, _specs(_prepared(kdef, inputs)), _specs(res),
                          _specs(tuple(core._prepare(g, i, kdef.name) for i, g in enumerate(grads))))
    return {str(i): torch.empty(tuple(d.shape), dtype=in_dtypes[i], device=device)
            for i, d in enumerate(dins) if nt[i] and d is not None}
