"""Backend registry: the functional API of each kernel, per backend.

``get(key, "triton")`` is ``forge_triton.<key>``; ``get(key, "pallas")`` is ``bridge.<key>`` (the
Pallas kernel called through the DLPack bridge). Both take the spec's signature. Imports are
lazy so ``import forge`` works with only one backend installed (``forge.ops`` itself is loaded by
``import forge`` and imports no backend).
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


def auto_order() -> tuple[str, ...]:
    """The order ``backend="auto"`` tries the backends in. With a CUDA device: triton first (its
    launches cost the least host time). Without one both run in interpreters, and Pallas' (one
    XLA-compiled program per kernel and shape) is several times faster than Triton's (Python per
    program instance): a 4 x 128 training step at hidden 128 took 0.9-2.3 s against 18 s."""
    from . import _runtime

    return BACKENDS if _runtime.has_cuda() else ("pallas", "triton")


def pick_auto() -> str:
    for b in auto_order():
        if availability(b)[0]:
            return b
    raise BackendUnavailableError("; ".join(availability(b)[1] for b in auto_order()))


def interpreted(backend: str) -> bool:
    """Whether ``backend`` runs its kernels in its interpreter (CPU) in this process."""
    if backend == "triton":
        from . import _runtime

        return _runtime.triton_interpreted()
    from bridge import runtime

    return runtime.interpret()


def fits(backend: str, device_types: frozenset, float64: bool) -> tuple[bool, str]:
    """(usable, reason) for running ``backend`` on a model whose parameters live on
    ``device_types`` (e.g. {"cpu"}) and, with ``float64``, include float64 ones: what would make
    the first call fail, said at patch time. Call after :func:`availability` says True."""
    if "meta" in device_types:
        return False, (f"{backend}: the model's parameters are on the meta device, where no kernel runs; "
                       "patch after the model is on its device (to_empty() and loading its weights)")
    if backend == "triton":
        from . import _runtime

        return _runtime.triton_fits(device_types)
    from bridge import runtime

    return runtime.fits(device_types, float64)
