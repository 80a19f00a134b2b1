"""forge: fused Triton and JAX Pallas kernels patched into live Hugging Face LLMs.

    import forge
    forge.patch(model)            # mode="train", backend="auto"
    forge.unpatch(model)
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: E402  (the backend registry; imports no backend)
from .errors import BackendUnavailableError, LabelDtypeError, UnsupportedModelError  # noqa: E402

# the guard's default thresholds (forge/defaults.py), read by forge.patch at patch time
from .defaults import MIN_FUSED_ELEMENTS, NEVER  # noqa: E402


def patch(model, mode="train", backend="auto", min_elements=None, kernels=None, graphs=False,
          recompute_mlp=False, compile_kernels="auto"):
    """Swap forge's kernels into ``model`` (a qwen2/qwen3/gemma/gemma2/llama/mistral
    ``*ForCausalLM``, bare or wrapped by peft or in a ``.model``), per instance; returns it.

    mode: "train" or "infer" (declines fused_linear_ce, lora_qkv, lora_o, lora_mlp).
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
    ``"forge"`` logger gives a summary (INFO), and a WARNING (once per reason) only for what was
    asked for and does not happen (docs/patching.md, "Logging"). A deep copy
    or a pickled and loaded copy comes back patched, on its own statistics (docs/patching.md).
    """
    from .patching.core import patch as _patch

    return _patch(model, mode=mode, backend=backend, min_elements=min_elements, kernels=kernels, graphs=graphs,
                  recompute_mlp=recompute_mlp, compile_kernels=compile_kernels, min_fused=MIN_FUSED_ELEMENTS)


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
