"""Backend registry: the functional API of each kernel, per backend.

``get(key, "triton")`` is ``forge_triton.<key>``; ``get(key, "pallas")`` is ``bridge.<key>`` (the
Pallas kernel called through the DLPack bridge). Both take the spec's signature. Imports are
lazy so ``import forge`` works with only one backend installed.
"""
from __future__ import annotations

import functools
import importlib
import types

from .errors import BackendUnavailableError

BACKENDS = ("triton", "pallas")
_MODULE = {"triton": "forge_triton", "pallas": "bridge"}


@functools.cache
def availability(backend: str) -> tuple[bool, str]:
    """(usable, reason) for a backend in this process."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    try:
        mod = importlib.import_module(_MODULE[backend])
    except ImportError as e:  # package missing
        return False, f"{backend} backend unavailable: {e}"
    check = getattr(mod, "availability", None)
    return check() if check else (True, "")


def require(backend: str) -> None:
    ok, why = availability(backend)
    if not ok:
        raise BackendUnavailableError(why)


def get(key: str, backend: str):
    require(backend)
    mod = importlib.import_module(_MODULE[backend])
    fn = getattr(mod, key, None)
    if isinstance(fn, types.ModuleType):
        # the kernel modules share their public function's name and load lazily: importing one
        # directly (``from forge_triton.fused_linear_ce import ...``) binds the module over the
        # package's name for the function; take the function and bind it back
        fn = getattr(fn, key, None)
        if fn is not None:
            setattr(mod, key, fn)
    if fn is None:
        raise BackendUnavailableError(f"kernel {key!r} is not implemented by the {backend} backend")
    return fn


def pick_auto() -> str:
    for b in BACKENDS:
        if availability(b)[0]:
            return b
    raise BackendUnavailableError("; ".join(availability(b)[1] for b in BACKENDS))
