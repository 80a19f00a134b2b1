"""forge: fused Triton and JAX Pallas kernels patched into live Hugging Face LLMs.

    import forge
    forge.patch(model)            # mode="train", backend="auto"
    forge.unpatch(model)
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: E402  (the backend registry; imports no backend)
from .errors import BackendUnavailableError, LabelDtypeError, UnsupportedModelError  # noqa: E402

# Per-call guard defaults: the activation elements (rows x width) from which a shape-sensitive
# call (rmsnorm, swiglu, geglu, rope) is fused; smaller calls run the original forward. Per
# backend: an int, a dict kernel key -> int, or a dict mode ("infer"/"train") -> either. Read at
# patch time; ``forge.patch(min_elements=...)`` overrides it (0 = always fuse).
#
# Calibrated on one H200 host with bench/bench_guard.py (streams of calls, eager and fused timed
# alternately): the smallest size from which the fused call was at least as fast as eager at
# every larger size of the sweep, or NEVER where it was not (there the host cost of a call
# exceeds what the kernel saves on the device up to the largest size swept). The GLU keys in
# training run the whole MLP as one node (forge.spec.gated_mlp), swept as such.
# bench/results/bench_guard-gated_mlp-rmsnorm-rope-swiglu-h200.*: rmsnorm and rope pay from the
# smallest call on both backends; the GLU from 4096 x 4864 (pallas in inference; triton's
# crossover there is lower, its default kept from the earlier sweep) and the gated MLP in
# training from 8192 x 4864 on both.
# "pallas" holds for Pallas kernels launched natively on torch's stream (bridge/native.py);
# "pallas-dlpack" where that path is unavailable (CPU interpret mode, or a JAX whose internals
# changed) and every call goes through DLPack and JAX's runtime at 0.3-0.7 ms of host time:
# there the shape-sensitive kernels never paid up to the largest size swept.
# Below its crossover the gated MLP still saves one rows x 4864 activation per layer (train
# 4x1024: 30% of eager's peak memory instead of 42%) for ~0.1 ms of host time per layer call:
# ``min_elements={"swiglu": 0}`` takes that trade.
NEVER = 1 << 62
MIN_FUSED_ELEMENTS: dict = {
    "triton": {
        "infer": {"rmsnorm": 0, "rope": 0, "swiglu": 4096 * 4864, "geglu": 4096 * 4864},
        "train": {"rmsnorm": 0, "rope": 0, "swiglu": 8192 * 4864, "geglu": 8192 * 4864},
    },
    "pallas": {
        "infer": {"rmsnorm": 0, "rope": 0, "swiglu": 4096 * 4864, "geglu": 4096 * 4864},
        "train": {"rmsnorm": 0, "rope": 0, "swiglu": 8192 * 4864, "geglu": 8192 * 4864},
    },
    "pallas-dlpack": {
        "infer": NEVER,
        "train": {"rmsnorm": NEVER, "rope": NEVER, "swiglu": 16384 * 4864, "geglu": 16384 * 4864},
    },
}


def patch(model, mode="train", backend="auto", min_elements=None, kernels=None, graphs=False,
          recompute_mlp=False, compile_kernels="auto"):
    """Swap forge's kernels into ``model`` (a qwen2/qwen3/gemma/gemma2/llama/mistral
    ``*ForCausalLM``, bare or wrapped by peft or in a ``.model``), per instance; returns it.

    mode: "train" or "infer" (declines fused_linear_ce, lora_qkv, lora_mlp).
    backend: "auto" (per kernel, the first backend that can run it on this model: triton then
        pallas with a CUDA device, pallas then triton without one), "triton", "pallas", or a dict
        kernel key -> backend; a named backend that cannot run this model here (no CUDA for
        compiled Triton, float64 on Pallas without jax x64, a model on "meta") raises
        BackendUnavailableError at patch time.
    min_elements: calls of rmsnorm/swiglu/geglu/rope with fewer activation elements run the
        original forward; None = MIN_FUSED_ELEMENTS[backend], 0 = always fused, or a dict per key.
    kernels: restrict to these keys (default: all): the kernels above and "qkv", the q, k and v
        projections of each attention module as one product over their weights concatenated
        (torch's matmul, no backend), in training inside the layers graphs=True captures
        (forge.patching.qkv, docs/patching.md).
    graphs: capture each decoder layer's forward (and, with grad on, its backward) in CUDA graphs
        at an input shape's second call, and replay them (Triton kernels; see
        forge.patching.graphs for when a call replays and what the graphs hold). Off by default:
        the graphs keep the activations in a memory pool between calls (one for all captured
        shapes, about the largest one's size), and a call that does not fit them (a mask, a
        growing KV cache, hooks, a second forward before the first's backward) runs uncaptured.
        With mode="infer", generate() decodes on a static KV cache of forge's with each decoding
        step one graph replay (forge.patching.decode, docs/generate.md).
        ``model._forge_graphs.stats`` counts replayed and uncaptured passes and decoding steps.
    recompute_mlp: in training, the fused gated MLP keeps only its input for backward and makes
        its gate and up products again there: 2 x rows x intermediate activations less per layer
        (1.9 GB at Qwen2.5-0.5B 4 x 1024) for two more matrix products per layer. The MLP is then
        fused at every size unless ``min_elements`` names a threshold for it.
    compile_kernels: which of rmsnorm, swiglu, geglu and rope run forge's kernel when the patched
        model is traced by torch.compile; the others hand the trace transformers' code, which
        inductor fuses with the operations around it. "auto" (default): in training the GLU
        (forge's gated MLP keeps less for backward), in inference none; "all": every one; or a
        list of keys. The fused loss and the LoRA kernels always stay forge's under
        torch.compile. Eager calls are not affected (docs/performance.md, "forge and
        torch.compile" and "The gated MLP stays forge's in compiled training").

    Afterwards ``model._forge_patched_counts`` {key: modules or call sites replaced},
    ``model._forge_skipped`` {key: why declined}, ``model._forge_backends`` {key: backend} and
    ``model._forge_guard_stats`` (fused / fallback calls per key; ``.reset()``). The fused loss
    runs when the model is in training mode (``model.train()``) and called with ``labels``: it
    returns ``loss`` with ``logits=None`` (and asks the decoder for no KV cache unless ``use_cache``
    is passed, or the call's ``position_ids`` without an attention mask make the cache matter to
    transformers' masks: docs/patching.md, "Packed sequences"); with ``return_dict=False`` its tuple has eager's length and positions, None where
    eager has logits (and a cache the fused path did not build). Labels must be int64, each in
    [0, vocab) or -100, as eager's loss requires (docs/fused_linear_ce.md). Otherwise (eval, no
    labels, ``generate()``) logits come out as before. Patching again with the same arguments is
    a no-op. ``forge.report(model)`` says what ran; the
    ``"forge"`` logger gives a summary (INFO) and each decline reason (WARNING, once). A deep copy
    or a pickled and loaded copy comes back patched, on its own statistics (docs/patching.md).
    """
    from .patching.core import patch as _patch

    return _patch(model, mode=mode, backend=backend, min_elements=min_elements, kernels=kernels, graphs=graphs,
                  recompute_mlp=recompute_mlp, compile_kernels=compile_kernels)


def report(model):
    """What runs where in a patched model: per kernel its backend, the modules patched, the
    guard's fused and fallback calls since the patch, and why a kernel was skipped.
    ``print(forge.report(model))`` shows a table; ``.kernels[key]`` and ``.as_dict()`` the data."""
    from .patching.core import report as _report

    return _report(model)


def unpatch(model):
    """Restore every original forward (outputs bit-identical to before); no-op if unpatched."""
    from .patching.core import unpatch as _unpatch

    return _unpatch(model)


__all__ = [
    "BackendUnavailableError",
    "LabelDtypeError",
    "MIN_FUSED_ELEMENTS",
    "NEVER",
    "UnsupportedModelError",
    "__version__",
    "ops",
    "patch",
    "report",
    "unpatch",
]
