"""Weights stored back to back, for inference: q/k/v and gate/up each read by one product.

In a decoding step every product is a matrix-vector product over a weight, bound by the bytes
it reads, and narrow ones (grouped-query attention's k and v: 1024 of 4096 rows at Llama-3-8B)
do not reach the bandwidth of wide ones; each is also a launch of its own. With ``STACK_INFER``
on, ``forge.patch(mode="infer")`` moves the q, k and v weights of every attention module (and
their biases) into one block of memory, and the gate and up weights of every gated MLP into
another, as slices of it: each projection's ``weight`` is the same ``nn.Parameter`` object as
before, holding the same values, now a view into the block. Nothing is copied per call and no
memory is added (while patching, one module's block exists beside its old weights). A call then
reads q, k and v with one product (forge.patching.qkv) and, for at most ``GLU_ROWS`` rows,
gate and up with one (forge.patching.forwards.glu_forward; above it the split halves of a wide
product would need copies before the activation kernel, which reads dense tensors). Where the
weights are found apart again (``model.to(...)`` gave each its own tensor, or a projection was
replaced), the call runs the separate products: ``stacked`` is checked on each call.

``unpatch`` gives every moved weight its own memory again (a copy, one module at a time), so the
model's parameters are as they were; the Parameter objects never change. Only weights still in
the block forge made are copied: one pointed elsewhere since (a flat buffer of the user's)
keeps its memory and whatever shares it. So does the first
``state_dict()`` (a pre-hook on each module whose projections were moved): savers that keep one
tensor per storage (accelerate's ``save_model`` dropped every view but the first one, so k, v
and up were missing from the checkpoint) get tensors that each own their memory, and the model
runs the separate products from then on. A pickled copy brings those hooks along and so knows
its stacked weights for forge's. Weights that share their memory at patch time (views into a
larger buffer, or a storage another model's parameters hold too, as in TRL's reference model
with shared layers) are not moved at all: moving them would end the sharing and keep their old
memory alive beside the block.

On by default (``STACK_INFER = True``): at the Llama-3-8B shape a decoding step with the weights
stored together was 7% faster at batch 1 and 4% at batch 8 than with them apart (docs/generate.md
has the run). ``STACK_INFER = False`` before ``forge.patch`` leaves every weight where it is, and so does
``forge.patch(min_elements=forge.NEVER)`` (every call the model's own code, bit for bit).
"""
from __future__ import annotations

import functools
import logging
import operator

import torch
from torch import nn

log = logging.getLogger("forge")
_TOLD = False  # the saving hook's info line was logged (once a process; later ones at debug)
_TOLD_SHARED: set = set()  # the name groups whose shared-memory line was logged (once a process)

STACK_INFER = True  # forge.patch(mode="infer") stacks q/k/v and gate/up weights (read at patch time)
GLU_ROWS = 16  # gate and up as one product for calls of at most this many rows (decoding steps)
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def misfit(mods, names) -> str | None:
    """Why the projections ``mods`` (named ``names``) cannot be read by one product over their
    weights (and biases) side by side, None when they can: plain ``nn.Linear`` modules whose
    weights are plain tensors of one dtype, device and input width, with biases on all or none,
    in the weights' dtype (shared with forge.patching.qkv's fusion in training)."""
    if any(type(m) is not nn.Linear for m in mods):
        return f"{', '.join(names)} are not all plain nn.Linear"
    ws = [m.weight for m in mods]
    if any(type(w) is not nn.Parameter and type(w) is not torch.Tensor for w in ws):
        return "a weight that is not a plain tensor (an FSDP2 shard or a quantized weight)"
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
        return f"the {len(ws)} weights differ in dtype, device or input width"
    bs = [m.bias for m in mods]
    if any(b is None for b in bs) and any(b is not None for b in bs):
        return "a bias on some of the projections only"
    if bs[0] is not None and len({(b.dtype, b.device) for b in bs} | {(ws[0].dtype, ws[0].device)}) != 1:
        return "biases of another dtype than the weights"
    return None


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def shares_memory(ts) -> bool:
    """Whether a tensor of ``ts`` shares its memory with any other tensor (a view into a larger
    buffer, or another model's parameter over the same storage: TRL's reference model shares its
    first layers' weights with the policy's this way). Moving such a weight would end the
    sharing and keep the old memory alive beside the block."""
    for t in ts:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.nbytes() != t.numel() * t.element_size():
            return True
        if _use_count is not None and _use_count(st._cdata) > 2:  # (t, and ``st`` itself)
            return True
    return False


def stacked(ts):
    """One tensor over ``ts`` (weights of equal trailing shape, or 1-D biases) when they lie back to
    back in one block of memory, in this order, else None. A view: reads what they hold now."""
    t0 = ts[0]
    try:
        st = t0.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # (a tensor subclass without a storage)
        return None
    off = t0.storage_offset()
    for t in ts:
        if (t.untyped_storage().data_ptr() != st or t.storage_offset() != off or t.dtype != t0.dtype
                or t.shape[1:] != t0.shape[1:] or not t.is_contiguous()):
            return None
        off += t.numel()
    rows = sum(t.shape[0] for t in ts)
    return t0.detach().as_strided((rows,) + tuple(t0.shape[1:]), t0.stride())


class _Group(list):
    """The tensors of one group forge stacked, and ``block``: the (address, bytes) of the block
    it put them in, or None once they are no longer there. Only tensors still in that block are
    forge's to give their own memory: a weight the user pointed elsewhere since (their own flat
    buffer, another layer's weight) keeps its memory and what shares it. A copy or a pickle of
    the group finds its block again over the copy's tensors."""
    block = None

    def __reduce__(self):
        return _group, (list(self),)


def _group(ts) -> _Group:
    g = _Group(ts)
    g.block = _block_of(g)
    return g


def _block_of(ts):
    """(address, bytes) of the storage when ``ts`` fill exactly one block, back to back in this
    order (what :func:`_move` makes), else None."""
    if stacked(ts) is None or ts[0].storage_offset():
        return None
    st = ts[0].untyped_storage()
    return (st.data_ptr(), st.nbytes()) if st.nbytes() == sum(t.numel() * t.element_size() for t in ts) else None


def _move(g) -> None:
    """Put the tensors (parameters) of group ``g`` back to back in one new block, each keeping its
    object, where they do not lie so already, and set ``g.block``. An interrupt part-way leaves
    each tensor in its own memory again. (A deepcopy of a stacked model is not stacked: torch
    copies each parameter on its own.)"""
    if stacked(g) is None:
        with torch.no_grad():
            block = torch.cat([t.detach() for t in g])  # (dtype and device checked by _plain)
            before = [t.data for t in g]
            try:
                o = 0
                for t in g:
                    n = t.shape[0]
                    t.data = block[o:o + n]
                    o += n
                g.block = _block_of(g)
            except BaseException:
                for t, d in zip(g, before):
                    t.data = d
                g.block = None
                raise
    else:
        g.block = _block_of(g)


def _unmove(g) -> int:
    """Give each tensor of group ``g`` still in forge's block its own memory; how many."""
    n, block = 0, getattr(g, "block", None)
    with torch.no_grad():
        for t in g if block is not None else ():
            st = t.untyped_storage()
            if (st.data_ptr(), st.nbytes()) == block:
                t.data = t.data.clone()
                n += 1
    g.block = None
    return n


def stack(modules, names, undo) -> list:
    """With ``STACK_INFER`` on, stack the weights (and biases) of ``parent[n] for n in names`` for
    each ``parent`` of ``modules`` whose projections fit; returns whether any group lies stacked
    (moved now or found so), and appends the :func:`unstack` of those moved to ``undo`` (the
    patch's undo list)."""
    if not STACK_INFER:
        return False
    moved, any_stacked, shared = [], False, 0
    undo.append(lambda: unstack(moved))  # (run last: the groups no saving hook holds yet)
    for parent in modules:
        mods = [parent._modules.get(n) for n in names]
        if any(m is None for m in mods) or misfit(mods, names) is not None:
            continue
        pairs = [[getattr(m, a) for m in mods] for a in ("weight", "bias")]
        if any(stacked(ts) is None and shares_memory(ts) for ts in pairs if ts[0] is not None):
            shared += 1
            continue
        any_stacked = True
        mine = _adopted(parent)  # (an adopted group's tensors may be stacked only now: a deep copy's)
        moved.extend(mine)  # (each group is on the undo list before its tensors move)
        for ts in pairs:
            if ts[0] is None:
                continue
            g = next((g for g in mine if len(g) == len(ts) and all(map(operator.is_, g, ts))), None)
            if g is None:
                if stacked(ts) is not None:  # (placed back to back by a loader: unpatch leaves them)
                    continue
                g = _Group(ts)
                mine.append(g)
                moved.append(g)
            _move(g)
        for g in mine:  # (adopted groups the loop above did not meet: found again, or not)
            g.block = _block_of(g)
        if mine:  # (its own list: a copy of this module alone copies only its own weights)
            hook = parent.register_state_dict_pre_hook(functools.partial(_before_saving, mine))
            undo.append(functools.partial(_unhook, mine, hook))
    if shared and names not in _TOLD_SHARED:
        _TOLD_SHARED.add(names)
        log.info("forge.patch: %s weights left apart where their memory is shared with other tensors "
                 "(another model's layers, a buffer of the caller's, a state_dict or autograd graph still "
                 "alive), which moving them would end: those modules run the separate products",
                 "/".join(names))
    return any_stacked


def _unhook(groups, hook) -> None:
    """Undo of a saving hook: its groups apart, then the hook gone. Where a group cannot be given
    its own memory (out of memory) this raises and the hook stays, so that saving still parts it,
    and unpatch's :func:`release` tries again."""
    unstack(groups)
    hook.remove()


def unstack(moved) -> int:
    """Give every group of ``moved`` its own memory (:func:`_unmove`), those done taken off the
    list; one that fails (out of memory) stays on it and the first error is raised after the
    others were done."""
    n, left, err = 0, [], None
    for g in moved:
        try:
            n += _unmove(g)
        except Exception as e:  # noqa: BLE001
            left.append(g)
            err = err or e
    moved[:] = left
    if err is not None:
        raise err
    return n


def release(root) -> None:
    """At unpatch, after the patch's own undo: forge's saving hooks that are left on modules
    under ``root`` (a part copied or loaded from a patched model and put into this one brings
    them) go, their groups unstacked, so nothing of forge's stays on the model."""
    for m in root.modules():
        if m._state_dict_pre_hooks:
            groups = _adopted(m)
            try:
                unstack(groups)
            finally:
                if groups:  # (those not apart keep their hook: saving still parts them, unpatch retries)
                    m.register_state_dict_pre_hook(functools.partial(_before_saving, groups))


def _before_saving(moved, module, prefix, keep_vars) -> None:
    """A state_dict pre-hook on each module whose projections forge stacked: gives the stacked
    weights their own memory first (what unpatch does), so that every tensor of a state dict
    owns its storage. Savers that keep one tensor per storage (accelerate's ``save_model``,
    safetensors' ``save_model``) would otherwise drop or refuse the views; calls then run the
    separate products (``stacked`` finds the weights apart)."""
    global _TOLD
    if unstack(moved):
        (log.debug if _TOLD else log.info)(
            "forge: state_dict() of a model patched with mode='infer' gives its stacked q/k/v and gate/up "
            "weights their own memory again, so each saved tensor owns its storage; calls read them with "
            "separate products (unpatch and patch again to stack them; said once a process)")
        _TOLD = True


def _adopted(parent) -> list:
    """The groups of forge's own saving hooks on ``parent``, those hooks dropped: a copy or a
    pickle of a patched model brings them along, over the copy's tensors (which a pickle keeps
    stacked). They are forge's, to unstack at unpatch or on saving, not weights a loader placed
    together."""
    ours = [(k, h) for k, h in parent._state_dict_pre_hooks.items()
            if isinstance(h, functools.partial) and h.func is _before_saving]
    groups = []
    for k, h in ours:
        del parent._state_dict_pre_hooks[k]
        groups.extend(ts for ts in h.args[0] if not any(ts is g for g in groups))
    return [g if isinstance(g, _Group) else _group(g) for g in groups]


def weights(parent, names, x):
    """(weight, bias or None) stacked over ``parent``'s projections ``names`` for a call on ``x``
    that needs no gradient of them, else None (run the separate products). A projection with a
    forward pre-hook (which may change the input it is called with) keeps its own product."""
    mods = [parent._modules.get(n) for n in names]
    if any(type(m) is not nn.Linear or m._forward_pre_hooks for m in mods):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for m in mods for p in m.parameters())):
        return None
    w = stacked([m.weight for m in mods])
    if w is None or w.dtype != x.dtype or w.device != x.device:
        return None
    if mods[0].bias is None:
        return (w, None) if all(m.bias is None for m in mods) else None
    if any(m.bias is None for m in mods):
        return None
    b = stacked([m.bias for m in mods])
    return None if b is None else (w, b)
