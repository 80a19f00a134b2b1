"""What the op layer (``forge.ops.library``) takes from the Pallas backend: the adaptor that
runs a bridged kernel (``core.KernelDef``) as a torch.library op.

The forward and backward run exactly as the bridge runs them eagerly (``core._run_fwd``,
``core.run_bwd``: natively launched where a plan serves them, through JAX and DLPack otherwise);
their fakes are ``jax.eval_shape`` of the kernel's JAX functions on the inputs' shapes and
dtypes (after the bridge's dtype decisions), so no kernel runs while torch.compile traces; under
``dynamic=True`` the output sizes stay symbolic (:func:`_shape_eval`).
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


def _symbols(tensors) -> dict:
    """{symbol: its value in this trace} for the symbolic sizes of ``tensors`` (none unless
    torch.compile traces with dynamic shapes)."""
    out = {}
    for t in tensors:
        for s in t.shape:
            if isinstance(s, torch.SymInt):
                expr, env = s.node.expr, s.node.shape_env
                vals = getattr(env, "backed_var_to_val", None)  # (torch before 2.12: var_to_val)
                vals = env.var_to_val if vals is None else vals
                for sym in getattr(expr, "free_symbols", ()):
                    if sym not in out and sym in vals:
                        out[sym] = int(vals[sym])
    return out


def _size(s, assign) -> int:
    if not isinstance(s, torch.SymInt):
        return int(s)
    expr = s.node.expr
    return int(expr.subs(assign)) if getattr(expr, "free_symbols", None) else int(expr)


def _shape_eval(fn, *groups):
    """``jax.eval_shape(fn, *groups)`` (each group a tuple of tensors or None, after the bridge's
    dtype decisions) as a pytree of (torch size, torch dtype), without specialising symbolic sizes.

    JAX takes concrete shapes. Under torch.compile(dynamic=True) the inputs' sizes are
    symbolic, and reading them as ints would make every new length a recompile. So the shapes
    are evaluated twice: once at the trace's values of the symbols, once with each symbol moved
    by its own offset. An output size that moves with them is written as the input size, or
    product of two, that moves the same way in both evaluations. An output size that matches
    none is read as an int, which specialises that size as before."""
    jax = runtime.jax_module()
    tensors = [t for g in groups for t in g if t is not None]
    syms = _symbols(tensors)

    def specs(assign):
        return tuple(tuple(None if t is None else jax.ShapeDtypeStruct(tuple(_size(s, assign) for s in t.shape),
                                                                        str(t.dtype).removeprefix("torch."))
                           for t in g) for g in groups)

    first = jax.eval_shape(fn, *specs(syms))
    if not syms:
        return jax.tree_util.tree_map(lambda a: (tuple(a.shape), _torch_dtype(a.dtype)), first)
    moved = {sym: v + 2 * k + 3 for k, (sym, v) in enumerate(syms.items())}  # distinct offsets: 3, 5, 7...
    second = jax.eval_shape(fn, *specs(moved))
    sized = [s for t in tensors for s in t.shape if isinstance(s, torch.SymInt) and s.node.expr.free_symbols]
    cands = [(s, _size(s, syms), _size(s, moved)) for s in sized]
    cands += [(a * b, x1 * y1, x2 * y2) for i, (a, x1, x2) in enumerate(cands) for (b, y1, y2) in cands[i:]]

    def size(v1, v2):
        if v1 == v2:
            return v1
        for s, c1, c2 in cands:
            if (c1, c2) == (v1, v2):
                return s
        return None

    def leaf(a, b):
        shape = tuple(size(v1, v2) for v1, v2 in zip(a.shape, b.shape))
        if None in shape:  # not found among the inputs' sizes: the concrete size
            shape = tuple(a.shape)
        return shape, _torch_dtype(a.dtype)

    return jax.tree_util.tree_map(leaf, first, second)


def _empty(shape_dtype, device):
    shape, dtype = shape_dtype
    return torch.empty(shape, dtype=dtype, device=device)


def fake_fwd(kdef, tensors, static):
    prepared = _prepared(kdef, tensors)
    device = next(t.device for t in tensors if t is not None)
    fwd = kdef.py_fn("fwd", tuple(static.items()))
    outs, res = _shape_eval(lambda ts: fwd(*ts), prepared)
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
    n = len(inputs)
    nt = _needs_tuple(kdef, needs, n)
    in_dtypes = _in_dtypes(dtypes)
    device = grads[0].device
    fn = kdef.py_fn("bwd", tuple(static.items()), nt)
    dins = _shape_eval(fn, _prepared(kdef, inputs), tuple(res),
                       tuple(core._prepare(g, i, kdef.name) for i, g in enumerate(grads)))
    return {str(i): torch.empty(d[0], dtype=in_dtypes[i], device=device)
            for i, d in enumerate(dins) if nt[i] and d is not None}
