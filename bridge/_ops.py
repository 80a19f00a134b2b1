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

from . import core, dlpack, runtime

install = core.install


def kernels() -> list:
    """Every kernel this backend runs as an op (the fused loss is the op layer's own node; the
    decoding path's cache write, which updates its inputs in place, and its one-row products
    run outside compiled code)."""
    import importlib

    for mod in ("kernels", "lora", "experts"):
        importlib.import_module(f"{__package__}.{mod}")
    skip = ("fused_linear_ce", "kv_append", "row_linear", "row_glu")
    return [k for k in core.registry().values() if k.name not in skip]


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
    return tuple(None if t is None else dlpack.prepare(t, i, kdef.name) for i, t in enumerate(tensors))


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
    """Size ``s`` with its symbols set as in ``assign``."""
    return int(s.node.expr.subs(assign)) if isinstance(s, torch.SymInt) else int(s)


def _shape_eval(fn, *groups, fixed=()):
    """``jax.eval_shape(fn, *groups)`` (each group a tuple of tensors or None, after the bridge's
    dtype decisions) as a pytree of (torch size, torch dtype), without specialising symbolic sizes.

    JAX takes concrete shapes. Under torch.compile(dynamic=True) the inputs' sizes are
    symbolic, and reading them as ints would make every new length a recompile. So the shapes
    are evaluated three times: at the trace's values of the symbols, and at two other settings
    with each symbol moved by its own offset. An output size that moves with them is written as
    the input size, or product of two, that moves the same way in every evaluation. If any output
    size matches none, every input size is read as an int, which specialises the trace to these
    sizes as before (a guard each, so another size compiles again and is never served wrongly).

    ``fixed``: sizes the kernel's trace unrolls a loop over (a router's top-k). Moved to the large
    setting they would unroll it thousands of times, so each is read as an int (a guard) and its
    symbols keep their values in every evaluation."""
    jax = runtime.jax_module()
    tensors = [t for g in groups for t in g if t is not None]
    held = set()
    for s in fixed:
        if isinstance(s, torch.SymInt):
            held |= s.node.expr.free_symbols
            int(s)
    sized = [s for t in tensors for s in t.shape if isinstance(s, torch.SymInt) and s.node.expr.free_symbols]
    syms = _symbols(tensors)
    if any(not s.node.expr.free_symbols <= syms.keys() for s in sized):
        syms, sized = {}, []  # a size without a value here (unbacked): read as ints, as before

    def specs(assign):
        return tuple(tuple(None if t is None else jax.ShapeDtypeStruct(
            tuple(_size(s, assign) if assign else int(s) for s in t.shape), str(t.dtype).removeprefix("torch."))
            for t in g) for g in groups)

    def concrete(tree):
        return jax.tree_util.tree_map(lambda a: (tuple(a.shape), _torch_dtype(a.dtype)), tree)

    first = jax.eval_shape(fn, *specs(syms))
    if not syms:
        return concrete(first)
    # two other settings of the symbols, each moved by its own offset (a small one, and a large
    # one that also catches a size that moves only in steps, such as a count of blocks)
    moves = [{sym: v if sym in held else v + 2 * k + 3 for k, (sym, v) in enumerate(syms.items())},
             {sym: v if sym in held else 4 * v + 4 * k + 4099 for k, (sym, v) in enumerate(syms.items())}]
    try:
        others = [jax.eval_shape(fn, *specs(m)) for m in moves]
    except Exception:  # noqa: BLE001 - sizes the function refuses: read as ints below
        others = None
    cands = [(s, tuple(_size(s, a) for a in (syms, *moves))) for s in sized]
    cands += [(a * b, tuple(x * y for x, y in zip(xs, ys))) for i, (a, xs) in enumerate(cands) for b, ys in cands[i:]]

    def size(vs):
        if len(set(vs)) == 1:
            return vs[0]
        return next((s for s, cs in cands if cs == vs), None)

    leaves, tree = jax.tree_util.tree_flatten(first)
    if others is not None:
        other_leaves = [jax.tree_util.tree_leaves(o) for o in others]
        shapes = [tuple(size(vs) for vs in zip(a.shape, *(o[i].shape for o in other_leaves)))
                  for i, a in enumerate(leaves)]
        if all(None not in sh for sh in shapes):
            return jax.tree_util.tree_unflatten(tree, [(sh, _torch_dtype(a.dtype)) for sh, a in zip(shapes, leaves)])
    for s in sized:  # an output size none of the inputs' sizes explains: these sizes only, guarded
        int(s)
    return concrete(first)


def _empty(shape_dtype, device):
    shape, dtype = shape_dtype
    return torch.empty(shape, dtype=dtype, device=device)


def fake_fwd(kdef, tensors, static):
    prepared = _prepared(kdef, tensors)
    device = next(t.device for t in tensors if t is not None)
    fwd = kdef.py_fn("fwd", tuple(static.items()))
    fixed = [tensors[i].shape[d] for i, d in kdef.static_dims if tensors[i] is not None]
    outs, res = _shape_eval(lambda ts: fwd(*ts), prepared, fixed=fixed)
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
                       tuple(dlpack.prepare(g, i, kdef.name) for i, g in enumerate(grads)))
    return {str(i): torch.empty(d[0], dtype=in_dtypes[i], device=device)
            for i, d in enumerate(dins) if nt[i] and d is not None}
