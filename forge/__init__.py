"""forge: fused Triton and JAX Pallas kernels patched into live Hugging Face LLMs.

    import forge
    forge.patch(model)            # mode="train", backend="auto"
    forge.unpatch(model)
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import BackendUnavailableError, UnsupportedModelError  # noqa: E402

# Per-backend minimum activation elements (rows x width) for a shape-sensitive kernel call to be
# fused; smaller calls run the original forward. Calibrated by bench/bench_guard.py. A value may
# also be a dict kernel key -> int (e.g. {"pallas": {"rope": 65536}}); read at patch time.
MIN_FUSED_ELEMENTS: dict[str, int | dict[str, int]] = {"triton": 0, "pallas": 0}


def patch(model, mode="train", backend="auto", min_elements=None, kernels=None):
    """Swap forge's kernels into ``model`` (a qwen2/qwen3/gemma/gemma2/llama/mistral
    ``*ForCausalLM``, bare or wrapped by peft or in a ``.model``), per instance; returns it.

    mode: "train" or "infer" (declines fused_linear_ce, lora_qkv, lora_mlp).
    backend: "auto" (per kernel, triton if it can run it, else pallas), "triton", "pallas", or a
        dict kernel key -> backend; a named backend that cannot run raises BackendUnavailableError.
    min_elements: calls of rmsnorm/swiglu/geglu/rope with fewer activation elements run the
        original forward; None = MIN_FUSED_ELEMENTS[backend], 0 = always fused, or a dict per key.
    kernels: restrict to these keys (default: all).

    Afterwards ``model._forge_patched_counts`` {key: modules or call sites replaced},
    ``model._forge_skipped`` {key: why declined}, ``model._forge_backends`` {key: backend} and
    ``model._forge_guard_stats`` (fused / fallback calls per key; ``.reset()``). The fused loss
    runs when the model is in training mode (``model.train()``) and called with ``labels``: it
    returns ``loss`` with ``logits=None``; otherwise (eval, no labels, ``generate()``) logits come
    out as before. Patching again with the same arguments is a no-op.
    """
    from .patching.core import patch as _patch

    return _patch(model, mode=mode, backend=backend, min_elements=min_elements, kernels=kernels)


def unpatch(model):
    """Restore every original forward (outputs bit-identical to before); no-op if unpatched."""
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
