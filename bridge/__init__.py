"""torch <-> JAX bridge: the Pallas kernels of ``forge_pallas`` called on torch tensors.

``bridge.<kernel>`` has the spec's signature (``forge.ops.get(key, "pallas")`` returns it).
Importing this package imports neither torch-side kernels nor jax: modules load on first use,
and ``availability()`` says whether the pallas backend can run here. See ``bridge/core.py`` for
the one generic autograd.Function and how to register a kernel; ``bridge/runtime.py`` for JAX's
memory preallocation (``XLA_PYTHON_CLIENT_PREALLOCATE`` defaults to false) and interpret mode.

Layer: the Pallas backend's torch side, above the spec (``forge.spec``) and ``forge_pallas``,
below the op layer (``forge.ops``), which it never imports: the op layer installs its
torch.library entry in ``core`` (through ``_ops``) and builds the gated MLP and the fused loss
from this package's pieces (``mlp_act``, ``experts_pieces``, ``fused_linear_ce_*``).
"""
from . import runtime  # sets XLA_PYTHON_CLIENT_PREALLOCATE before jax can start

import importlib  # noqa: E402

# public name -> (module of bridge that defines it, its name there)
_WHERE = {
    "rmsnorm": ("kernels", "rmsnorm"),
    "swiglu": ("kernels", "swiglu"),
    "geglu": ("kernels", "geglu"),
    "rope": ("kernels", "rope"),
    "lora_qkv": ("lora", "lora_qkv"),
    "lora_mlp": ("lora", "lora_mlp"),
    "lora_o": ("lora", "lora_o"),
    "decode_attention": ("kernels", "decode_attention"),  # (the decoding path's, forward only)
    "kv_append": ("kernels", "kv_append"),  # (the decoding path's cache write; no op)
    "row_linear": ("kernels", "row_linear"),  # (the decoding path's one-row products; no op)
    "row_glu": ("kernels", "row_glu"),  # (and its gate/up product with the gated activation; no op)
    # the pieces of the op layer's nodes (forge.ops.gated_mlp, forge.ops.precomputed)
    "mlp_act": ("kernels", "mlp_act"),
    "experts_pieces": ("experts", "experts_pieces"),
    "fused_linear_ce_prepare": ("fused_linear_ce", "prepare"),
    "fused_linear_ce_compute": ("fused_linear_ce", "compute"),
    "check_devices": ("kernels", "check_devices"),
}


def availability() -> tuple[bool, str]:
    return runtime.availability()


def __getattr__(name):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'bridge' has no attribute {name!r}")
    runtime.require()
    fn = getattr(importlib.import_module(f"{__name__}.{where[0]}"), where[1])
    from . import native

    native.prepare()  # Triton's start-up for the native launch here, not in the kernel's first call
    globals()[name] = fn
    return fn
