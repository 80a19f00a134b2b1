"""Triton backend: one module per kernel, forward and backward behind a torch.autograd.Function.

Without a CUDA device the kernels run in Triton's interpreter; the switch must happen before
any kernel is decorated, so it comes first here. Kernel modules load lazily on first use.
"""
from forge import _runtime

_runtime.ensure_triton_mode()

import importlib  # noqa: E402

# public function -> module that defines it
_WHERE = {
    "rmsnorm": "rmsnorm",
    "swiglu": "glu",
    "geglu": "glu",
    "gated_mlp": "glu",
    "rope": "rope",
    "fused_linear_ce": "fused_linear_ce",
    "lora_qkv": "lora",
    "lora_mlp": "lora",
}


def availability() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return False, f"triton is not installed ({e})"
    return True, ""


def __getattr__(name):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'forge_triton' has no attribute {name!r}")
    fn = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = fn
    return fn
