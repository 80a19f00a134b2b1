"""Tracing a kernel pass into a *recipe*: the pass's jaxpr, nested calls inlined, made into a
flat list of steps as plain data (the form the disk cache keeps, ``disk.recipe_json``), from
which ``plans`` builds every plan.

Each ``pallas_call`` becomes a kernel step (lowered and launched by ``launch``); every other
equation a torch op (``prims.PRIMS``). Before that, what a kernel taking only addresses needs no
step for is dropped: reshapes and transposes around a kernel (a view at the same address), and
the conversion after a bf16 product that cuBLAS can round itself.
"""
from __future__ import annotations

import collections
import hashlib
import time

import torch

from .. import _jax_internals as JI
from . import disk, prims, state


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
        want = prims.plain(e.params["new_dtype"])
        if d is None or want not in _ROUNDED or prims.plain(d.outvars[0].aval.dtype) != "float32":
            continue
        if not all(prims.plain(v.aval.dtype) == want for v in d.invars):
            continue
        (lc, _), _ = d.params["dimension_numbers"]
        if tuple(lc) != (len(d.invars[0].aval.shape) - 1,):  # a sum over rows
            continue
        rename[outs[0]], made[ins[0]] = ins[0], want
        skip.add(n)
    kept = [(e, [rename.get(k, k) for k in ins], outs) for n, (e, ins, outs) in enumerate(flat_eqns) if n not in skip]
    outvars[:] = [rename.get(k, k) for k in outvars]
    return kept, made


def trace(fn, args, key_prefix, writes=()):
    """Trace ``fn`` on ``args`` (avals) into a recipe: the plan as plain data (the form the disk
    cache keeps), and the ``pallas_call`` equations in program order (what lowers them). An
    output a ``pallas_call`` aliases to one of its inputs is that input's buffer, copied first
    where the plan's caller keeps the input (every argument but those at the positions
    ``writes`` names, which the caller hands over to be updated in place) or a later step reads it."""
    import jax

    t0 = time.perf_counter()
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    state.TIMES["trace"] += time.perf_counter() - t0
    state.TRACES[0] += 1
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
                    raise state.Unsupported(f"{e.primitive.name} with constants")
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
    given = {k for n, k in enumerate(invars) if n not in writes} | set(consts)

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
                k=hashlib.sha256(repr((disk.versions(), disk.code_stamp(), key_prefix, n)).encode()).hexdigest()[:32],
                meta=[[list(grow.get(j, v.aval.shape)), prims.plain(v.aval.dtype)] for j, v in enumerate(e.outvars)],
                alias=[[o, i] for o, i in aliases], copy=[o for o, i in aliases if later(i)],
                vin=[[i, p] for i, p in sorted(vin.items())], vout=[[j, p] for j, p in sorted(vout.items())])
            eqns.append(e)
        else:
            if name not in prims.PRIMS:
                raise state.Unsupported(f"no torch equivalent for the XLA primitive {name!r}")
            st.update(
                a={k: prims.plain(e.params.get(k)) for k in prims.PARAMS.get(name, ())},
                dt=rounded.get(outs[0]) or (prims.plain(aval.dtype) if hasattr(aval, "dtype") else None),
                sh=list(getattr(aval, "shape", ())),
                o=out_idx if e.primitive.multiple_results else out_idx[0])
        steps.append(st)
    out = jax.tree_util.tree_unflatten(out_tree, [slot(k) for k in outvars])
    rec = {"template": template, "consts": rec_consts, "in": in_slots, "steps": steps, "out": out}
    return rec, eqns


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
