"""``copy.deepcopy`` and pickling (``torch.save(model)``) of a patched model: the copy comes back
patched, with the same ``forge.patch`` arguments, its own guard statistics and forwards bound to
its own modules.

A replaced forward is a closure over the guard's counters, bound to its module; Python copies
functions by reference, so a plain deep copy would share the original's counters, and pickling
stores a bound method as ``getattr(module, name)``, which on loading gives back the class's
forward (or fails). forge therefore copies and pickles a patched model as if it were unpatched
and patches the copy again:

- every module forge gave a forward gets an instance ``__reduce_ex__`` (what ``copy`` and
  ``pickle`` consult) that leaves forge's forward and these hooks out of the module's state
  (putting back a forward someone else had installed before forge);
- the model ``forge.patch`` was called on and the wrappers down to the Hugging Face model (peft,
  ``.model`` nesting) also leave out ``_forge_*`` and patch the copy: ``__deepcopy__`` once the
  copy is complete, and, for pickle, a ``state_setter`` that runs once the loaded object has its
  state (so a loaded model is patched while ``torch.load`` runs; should that fail, say the saved
  backend cannot run on the loading machine, it logs a warning and the model runs unpatched).
  What patches the copy is handed in by ``core`` (``call``: ``forge.patch`` with the original's
  arguments bound), so this module imports nothing of forge's.

``copy.copy`` (shallow) shares the modules with the original: it copies as before, patched
modules included. A copy of a part of the model (one decoder layer) comes back unpatched.
The hooks are instance attributes, removed by ``forge.unpatch``.
"""
from __future__ import annotations

import copy
import functools
import logging
import sys
import weakref

HOOKS = ("__reduce_ex__", "__deepcopy__")
KEEP = object()  # the module's forward entry is not forge's: copy it as it is
log = logging.getLogger("forge")
_OURS = weakref.WeakSet()  # the forwards forge installed


def mark(forward) -> None:
    """Remember ``forward`` as forge's (a copy tells it from one installed over it later)."""
    _OURS.add(forward)


def ours(forward) -> bool:
    """Whether ``forward`` is one forge installed (Patcher.replace_forward marks each)."""
    return forward in _OURS


def module_hook(module, had, old):
    """The ``__reduce_ex__`` of a module whose forward forge replaced (``had``: an instance
    forward ``old`` was there before)."""
    return functools.partial(_reduce, module, old if had else None, None)


def publish(state, chain, public_names) -> None:
    """Set a patch's public attributes (``public_names``, values ``state.public``) on every object
    of ``chain`` (the model patch() was called on -> the Hugging Face model) and give each the
    hooks that copy and pickle it as a patched model; the modules between them that forward
    attributes get a plain ``__deepcopy__``. Every object is remembered in ``state.chain`` for
    unpatch."""
    root = chain[-1]
    rec = next((r for r in state.records if r[0] is root and r[4] == "forward"), None)
    for obj in chain:
        if not any(o is obj for o in state.chain):
            state.chain.append(obj)
            fwd = chain_forward(rec) if obj is root else KEEP
            # other methods forge took over on it (generate, ...): the copy's own patch redoes them
            taken = tuple(r[4] for r in state.records if r[0] is obj and r[4] != "forward")
            install_chain_hooks(obj, fwd, state.call, public_names + ("_forge_state",) + taken)
        for name, value in zip(public_names, state.public):
            object.__setattr__(obj, name, value)
    path = next((n for n, m in chain[0].named_modules() if m is root), "")
    obj = chain[0]
    for part in path.split(".") if path else ():
        obj = obj._modules[part]
        if obj is not root and not any(o is obj for o in state.chain):
            state.chain.append(obj)
            install_passthrough_hook(obj)


def install_chain_hooks(obj, forward, call, drop) -> None:
    """On the model patch() was called on and the wrappers below it: copy unpatched, patch the
    copy with ``call`` (``call(copy)`` patches it as the original was). ``forward``: KEEP, None (forge's, none before)
    or the forward that was there before forge's; ``drop``: attribute names to leave out."""
    obj.__dict__["__reduce_ex__"] = functools.partial(_reduce, obj, forward, (call, drop))
    obj.__dict__["__deepcopy__"] = functools.partial(_deepcopy, obj, forward, (call, drop))


def install_passthrough_hook(obj) -> None:
    """On a module between the wrappers and the Hugging Face model that forwards unknown
    attributes to its child (peft's LoraModel): ``copy.deepcopy`` looks ``__deepcopy__`` up on
    the instance, and would otherwise be handed the child's hook and copy the child in its place."""
    obj.__dict__["__deepcopy__"] = functools.partial(_deepcopy, obj, KEEP, (None, ()))


def chain_forward(root_record):
    return KEEP if root_record is None else (root_record[2] if root_record[1] else None)


def _plain(obj, forward, drop, protocol):
    """obj's reduce value as its class makes it, with forge's entries left out of its state."""
    rv = list(type(obj).__reduce_ex__(obj, protocol))
    if len(rv) > 2 and isinstance(rv[2], dict):
        state = {k: v for k, v in rv[2].items() if k not in HOOKS and k not in drop}
        if forward is not KEEP:
            cur = state.pop("forward", None)
            if cur is not None and not ours(cur):
                log.warning("forge: %s.forward was replaced after forge.patch (accelerate's prepare, which the HF "
                            "Trainer calls, wraps it for mixed precision): it wraps forge's forward of the original "
                            "and cannot be copied, so the copy runs without it. Copy the model before wrapping it",
                            type(obj).__name__)
            if forward is not None:
                state["forward"] = forward
        rv[2] = state
    return rv


def _reduce(obj, forward, chain, protocol):
    if sys._getframe(1).f_code is copy.copy.__code__:
        return type(obj).__reduce_ex__(obj, protocol)  # shallow: shares the patched modules
    call, drop = chain if chain is not None else (None, ())
    rv = _plain(obj, forward, drop, protocol)
    if call is None:
        return tuple(rv)
    rv += [None] * (5 - len(rv))
    return (*rv[:5], functools.partial(_set_state_and_patch, call))


def _set_state_and_patch(call, obj, state):
    _set_state(obj, state)
    _patch_copy(obj, call)


def _deepcopy(obj, forward, chain, memo):
    caller = sys._getframe(1)
    x = caller.f_locals.get("x", obj) if caller.f_code is copy.deepcopy.__code__ else obj
    if x is not obj and "__deepcopy__" not in getattr(x, "__dict__", {}):
        # reached through a wrapper made after patching that hands unknown attributes to its
        # child (peft's PeftModel, torch.compile's OptimizedModule): copy the wrapper as copy
        # does without a hook; its state's deep copy reaches obj's hook with obj itself. (A
        # shallow copy of obj carries obj's hooks in its own dict: it copies as obj, the modules
        # it shares with obj.)
        return copy._reconstruct(x, memo, *type(x).__reduce_ex__(x, 4))
    call, drop = chain
    func, args, state, *items = _plain(obj, forward, drop, 4)
    if any(items):
        raise TypeError(f"forge cannot deep-copy {type(obj).__name__}: its reduce has list or dict items")
    y = func(*copy.deepcopy(args, memo))
    memo[id(obj)] = y
    if state is not None:
        _set_state(y, copy.deepcopy(state, memo))
    if call is not None:
        _patch_copy(y, call)
    return y


def _set_state(obj, state):
    setstate = getattr(type(obj), "__setstate__", None)
    if setstate is not None:
        setstate(obj, state)
    else:
        obj.__dict__.update(state)


def _patch_copy(obj, call):
    try:
        call(obj)
    except Exception as e:  # noqa: BLE001  (a copy that cannot be patched still loads)
        log.warning("forge: the copied or loaded %s could not be patched again (%s: %s); it runs unpatched",
                    type(obj).__name__, type(e).__name__, e)
