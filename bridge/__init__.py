"""torch <-> JAX bridge: the Pallas kernels of ``forge_pallas`` called on torch tensors.

``bridge.<kernel>`` has the spec's signature (``forge.ops.get(key, "pallas")`` returns it).
Importing this package imports neither torch-side kernels nor jax: modules load on first use,
and ``availability()`` says whether the pallas backend can run here. See ``bridge/core.py`` for
the one generic autograd.Function and how to register a kernel; ``bridge/runtime.py`` for JAX's
memory preallocation (``XLA_PYTHON_CLIENT_PREALLOCATE`` defaults to false) and interpret mode.
"""
from . import runtime  # sets XLA_PYTHON_CLIENT_PREALLOCATE before jax can start

import importlib  # noqa: E402

# public function -> module of bridge that defines it
_WHERE = {
    "rmsnorm": "kernels",
    "swiglu": "kernels",
    "geglu": "kernels",
    "gated_mlp": "kernels",
    "rope": "kernels",
    "fused_linear_ce": "fused_linear_ce",
    "lora_qkv": "lora",
    "lora_mlp": "lora",
}


def availability() -> tuple[bool, str]:
    return runtime.availability()


def __getattr__(name):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'bridge' has no attribute {name!r}")
    runtime.require()
    fn = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = fn
    return fn
