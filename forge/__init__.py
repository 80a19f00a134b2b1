"""forge: fused Triton and JAX Pallas kernels patched into live Hugging Face LLMs.

    import forge
    forge.patch(model)            # mode="train", backend="auto"
    forge.unpatch(model)
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import BackendUnavailableError, UnsupportedModelError  # noqa: E402

# Per-call guard defaults: the activation elements (rows x width) from which a shape-sensitive
# call (rmsnorm, swiglu, geglu, rope) is fused; smaller calls run the original forward. Per
# backend: an int, a dict kernel key -> int, or a dict mode ("infer"/"train") -> either. Read at
# patch time; ``forge.patch(min_elements=...)`` overrides it (0 = always fuse).
#
# Calibrated on one H200 host with bench/bench_guard.py (bench/results/bench_guard-h200-
# 20261130-074132.* and -0750*: streams of calls, eager and fused timed alternately): the
# smallest size from which the fused call was at least as fast as eager at every larger size of
# the sweep, or NEVER where it was not (there the host cost of a call, ~30 us Triton forward
# and ~250 us forward + backward, ~0.2 ms / ~1.5 ms bridged Pallas, exceeds what the kernel
# saves on the device up to the largest size swept: 16384 x 4864 for the GLUs, 16384 x 896
# for RMSNorm, (1, 14 + 2, 4096, 64) for RoPE).
NEVER = 1 << 62
MIN_FUSED_ELEMENTS: dict = {
    "triton": {
        "infer": {"rmsnorm": 0, "rope": 0, "swiglu": 4096 * 4864, "geglu": 4096 * 4864},
        "train": {"rmsnorm": 0, "rope": 0, "swiglu": 16384 * 4864, "geglu": 16384 * 4864},
    },
    "pallas": NEVER,
}


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
    "NEVER",
    "UnsupportedModelError",
    "__version__",
    "patch",
    "unpatch",
]
