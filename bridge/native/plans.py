"""Plans: a kernel pass as straight-line torch code, built from its recipe, cached per signature.

A plan is a Python function generated from its recipe: one line per step, each step's result in
a local variable, constants and literals bound as globals of the function. A call then costs the
steps' own work and little else (no slot list, no loop over steps), which is most of what a small
kernel call's host time is. :func:`plan` is the entry the bridge calls per kernel call: a cached
plan, one built now (from its recipe on disk, else traced by ``recipe``), or None where the pass
cannot run natively (the reason kept in ``state.DECLINED``). Plans are bounded
(``state.PLANS_MAX``).
"""
from __future__ import annotations

import functools
import json
import time

import torch

from .. import _jax_internals as JI
from . import disk, launch, prims, recipe, state


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
        ctx = prims.Ctx()
        ctx.dev = dev
        idx, out = tuple(st["i"]), st["o"]
        if st["p"] == JI.PALLAS_CALL:
            steps.append((launch.pallas_step(st, eqn_of, ctx), idx, list(out)))
            continue
        ctx.out_dtype = prims.torch_dtype(st["dt"]) if st["dt"] is not None else None
        ctx.out_shape = tuple(st["sh"])
        fn = prims.PRIMS[st["p"]](st["a"], ctx)
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


def build(fn, args, dev, key_prefix, writes=()):
    """The plan of ``fn`` on ``args`` (avals): from its recipe on disk when there is one (no
    trace), else traced, built, and its recipe stored. ``writes``: argument positions a kernel
    may update in place (``recipe.trace``)."""
    path = disk.recipe_path(key_prefix)
    try:
        with open(path) as f:
            rec = disk.recipe_from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        rec = None
    if rec is not None:
        eqns = []

        def eqn_of(n):  # a trace only where a pallas_call's equation is needed after all
            if not eqns:
                t0 = time.perf_counter()
                eqns.extend(recipe.pallas_eqns(fn, args))
                state.TIMES["trace"] += time.perf_counter() - t0
                state.TRACES[0] += 1
            return eqns[n]

        try:
            return _from_recipe(rec, eqn_of, dev, f"{key_prefix[0]}/{key_prefix[1]}")
        except (KeyError, TypeError, ValueError, IndexError, SyntaxError) as e:  # a damaged recipe: trace
            state.log.debug("pallas native: recipe %s not used (%s)", path, e)
    rec, eqns = recipe.trace(fn, args, key_prefix, writes)
    p = _from_recipe(rec, eqns.__getitem__, dev, f"{key_prefix[0]}/{key_prefix[1]}")
    data = disk.recipe_json(rec)
    if data is not None:
        disk.write_json(path, data)
    return p


def _aval(t):
    import jax

    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(_aval(x) for x in t)
    return jax.ShapeDtypeStruct(tuple(t.shape), prims.jax_dtype(t.dtype))


def _sig(a):
    if a is None:
        return None
    if isinstance(a, tuple):
        return tuple(_sig(x) for x in a)
    return (a.shape, a.dtype)


def leaves_of(args):
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
    None, or tuples of them), or None when it cannot run natively (the reason in ``bridge.native.status()``). Built on first
    use per shape, then cached.
    Call it as ``plan(flat)`` with the non-None tensors of ``args`` in order (``leaves``, if the
    caller has them already)."""
    if not state.is_on():  # one cached check per call where the native path is off (CPU CI)
        return None
    if which == "fwd":  # flat tensors: the cheap signature
        if not args:
            return None
        dev = args[0].device
        key = (kdef.name, which, skey, dev, tuple([(t.shape, t.dtype) for t in args]))
    else:  # (inputs, residuals, grads): the leaves' signature and where the Nones are
        leaves = leaves_of(args) if leaves is None else leaves
        if not leaves:
            return None
        dev = leaves[0].device
        nones = tuple(tuple([x is None for x in a]) if isinstance(a, tuple) else a is None for a in args)
        key = (kdef.name, which, skey, dev, nones, tuple([(t.shape, t.dtype) for t in leaves]))
    hit = state.PLANS.get(key)
    if hit is not None:
        try:  # least recently used goes first: a plan in use is never the one dropped
            state.PLANS.move_to_end(key)
        except KeyError:  # another thread dropped it meanwhile
            pass
        return hit or None
    with state.LOCK:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            state.log.debug("pallas %s (%s): a plan built inside a CUDA graph capture", kdef.name, which)
        if dev.type != "cuda" and state.launcher() == "triton":
            return None
        t0 = time.perf_counter()
        fn = kdef.py_fn("fwd", skey) if which == "fwd" else kdef.py_fn("bwd", *skey)
        try:
            writes = kdef.writes if which == "fwd" else ()  # (in the key too: bridge/kernels.py is not in its stamp)
            p = build(fn, _aval(args), dev,
                      (kdef.name, which, repr(skey), repr(_sig(args)), _gpu_kind(), _x64(), writes), writes)
        except state.Unsupported as e:
            state.decline(kdef.name, which, str(e))
            p = False
        state.TIMES["build"] += time.perf_counter() - t0
        state.PLANS[key] = p
        if len(state.PLANS) > state.PLANS_MAX:
            state.PLANS.popitem(last=False)
        return p or None


def _x64() -> bool:
    import jax

    return bool(jax.config.read("jax_enable_x64"))  # (it changes what a trace holds)


@functools.cache
def _gpu_kind():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None
