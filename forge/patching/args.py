"""forge.patch's arguments: checked, and normalised into what one patch pass records (the
tuple ``core.patch`` compares to tell a repeated patch from a new one). Every error names the
argument as the caller wrote it."""
from __future__ import annotations

import operator

from .. import ops
from ..spec import KERNELS
from . import qkv as _qkv
from .patcher import DEFERRED_UNDER_COMPILE

# what forge.patch(kernels=) takes: the kernels, and the fusions of torch's own operations
PATCH_KEYS = KERNELS + (_qkv.KEY,)

MODES = ("train", "infer")


def normalize(mode, backend, min_elements, kernels, graphs=False, recompute_mlp=False, compile_kernels="auto"):
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, one of {MODES}, got {type(mode).__name__} {mode!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, v in (("graphs", graphs), ("recompute_mlp", recompute_mlp)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be True or False, got {v!r}")
    requested, explicit = _kernels_arg(kernels)
    backend = _backend_arg(backend)
    if isinstance(min_elements, dict):
        bad = [k for k in min_elements if k not in KERNELS]
        if bad:
            raise ValueError(f"min_elements: unknown kernel key(s) {bad}; known: {KERNELS}")
        min_elements = {k: _count_arg(v) for k, v in min_elements.items()}
    elif min_elements is not None:
        min_elements = _count_arg(min_elements)
    return (mode, backend, min_elements, tuple(requested), graphs, recompute_mlp,
            _compile_kernels_arg(compile_kernels), explicit)


def _kernels_arg(kernels):
    """(requested keys, whether the caller named them) for ``kernels``: None (every kernel), one
    key or a list/tuple/set of keys."""
    if kernels is None:
        return PATCH_KEYS, False
    if isinstance(kernels, str):
        kernels = (kernels,)
    elif not isinstance(kernels, list | tuple | set | frozenset):
        raise TypeError(f"kernels must be None, a kernel key or a list of them (e.g. ['rmsnorm', 'rope']), "
                        f"keys from {PATCH_KEYS}; got {kernels!r} ({type(kernels).__name__})")
    requested = tuple(kernels)
    odd = [k for k in requested if not isinstance(k, str)]
    if odd:
        raise TypeError(f"kernels must list kernel keys (strings) from {PATCH_KEYS}; got {odd}")
    bad = [k for k in requested if k not in PATCH_KEYS]
    if bad:
        raise ValueError(f"kernels: unknown kernel key(s) {bad}; valid keys: {PATCH_KEYS}")
    return requested, True


def _backend_arg(backend):
    """``backend`` ("auto", a backend name, or a dict kernel key -> one of them) as a dict over
    every kernel; errors quote what the caller wrote."""
    choices = ("auto",) + ops.BACKENDS
    if isinstance(backend, str):
        if backend not in choices:
            raise ValueError(f"backend={backend!r} is not one of {choices} (or a dict kernel key -> one of them)")
        return {k: backend for k in KERNELS}
    if not isinstance(backend, dict):
        raise TypeError(f"backend must be one of {choices} or a dict kernel key -> one of them, "
                        f"got {backend!r} ({type(backend).__name__})")
    bad = [k for k in backend if k not in KERNELS]
    if bad:
        raise ValueError(f"backend: unknown kernel key(s) {bad}; valid keys: {KERNELS}")
    for k, b in backend.items():
        if not isinstance(b, str) or b not in choices:
            raise ValueError(f"backend[{k!r}]={b!r} is not one of {choices}")
    return {k: backend.get(k, "auto") for k in KERNELS}


def _compile_kernels_arg(v):
    """``compile_kernels`` as "auto", "all" or a sorted tuple of kernel keys."""
    if isinstance(v, str) and v in ("auto", "all"):
        return v
    if isinstance(v, str) or not isinstance(v, list | tuple | set | frozenset):
        raise TypeError(f"compile_kernels must be 'auto', 'all' or a list of kernel keys, got {v!r}")
    bad = [k for k in v if k not in DEFERRED_UNDER_COMPILE]
    if bad:
        raise ValueError(f"compile_kernels lists which of {DEFERRED_UNDER_COMPILE} keep forge's kernel inside "
                         f"torch.compile (the fused loss and LoRA kernels always do); got {bad}")
    return tuple(sorted(v))


def _count_arg(v) -> int:
    """An integer-like min_elements value (int, numpy or torch integer) as a plain int."""
    if not isinstance(v, bool):
        try:
            v = operator.index(v)
        except TypeError:
            pass
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"min_elements must be None, a non-negative integer or a dict of them, "
                        f"got {v!r} ({type(v).__name__})")
    if v < 0:
        raise ValueError(f"min_elements must be non-negative, got {v}")
    return v
