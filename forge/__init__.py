"""forge: fused Triton and JAX Pallas kernels patched into live Hugging Face LLMs.

    import forge
    forge.patch(model)            # mode="train", backend="auto"
    forge.unpatch(model)
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import BackendUnavailableError, UnsupportedModelError  # noqa: E402

# Per-backend minimum activation elements (rows x width) for a shape-sensitive kernel call to be
# fused; smaller calls run the original forward. Calibrated by bench/bench_guard.py.
MIN_FUSED_ELEMENTS: dict[str, int] = {"triton": 0, "pallas": 0}


def patch(model, mode="train", backend="auto", min_elements=None, kernels=None):
    from .patching.core import patch as _patch

    return _patch(model, mode=mode, backend=backend, min_elements=min_elements, kernels=kernels)


def unpatch(model):
    from .patching.core import unpatch as _unpatch

    return _unpatch(model)


__all__ = [
    "BackendUnavailableError",
    "MIN_FUSED_ELEMENTS",
    "UnsupportedModelError",
    "__version__",
    "patch",
    "unpatch",
]
