"""Triton backend: one module per kernel, forward and backward behind a torch.autograd.Function.

Layer: above the spec (``forge.spec``, ``forge._runtime``), below the op layer (``forge.ops``),
which it never imports: the op layer installs its torch.library entry in ``_ops`` and builds the
gated MLP and the fused loss from this package's pieces (``mlp_act``, ``fused_linear_ce_*``).

Without a CUDA device the kernels run in Triton's interpreter; the switch must happen before
any kernel is decorated, so it comes first here. Kernel modules load lazily on first use.
"""
from forge import _runtime

_runtime.ensure_triton_mode()

import importlib  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

# public name -> (module that defines it, its name there)
_WHERE = {
    "rmsnorm": ("rmsnorm", "rmsnorm"),
    "swiglu": ("glu", "swiglu"),
    "geglu": ("glu", "geglu"),
    "rope": ("rope", "rope"),
    "lora_qkv": ("lora", "lora_qkv"),
    "lora_mlp": ("lora", "lora_mlp"),
    "lora_o": ("lora", "lora_o"),
    "decode_attention": ("decode_attention", "decode_attention"),  # (the decoding path's; no op)
    "kv_append": ("decode_attention", "kv_append"),  # (the decoding path's cache write; no op)
    "row_linear": ("linear", "row_linear"),  # (the decoding path's one-row products; no op)
    "row_glu": ("linear", "row_glu"),  # (and its gate/up product with the gated activation; no op)
    # the pieces of the op layer's nodes (forge.ops.gated_mlp, forge.ops.precomputed)
    "mlp_act": ("glu", "mlp_act"),
    "experts_pieces": ("experts", "experts_pieces"),
    "fused_linear_ce_prepare": ("fused_linear_ce", "prepare"),
    "fused_linear_ce_compute": ("fused_linear_ce", "compute"),
    "fused_linear_ce_scale": ("fused_linear_ce", "scale_"),
    "check_devices": ("_common", "check_device"),
    "plain_launches": ("_launch", "plain_launches"),  # Triton's own launch path in a block (benchmarks)
}


def availability() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return False, f"triton is not installed ({e})"
    return True, ""


class _Package(types.ModuleType):
    """The package's module type: rmsnorm, rope and decode_attention name both a kernel module and
    the public function it defines. Python binds a submodule on its package when it first loads
    it (an import anywhere, the op layer's included), which would put the module where
    ``forge_triton.rmsnorm`` should be the function: that one binding is refused, and the name
    stays the function's (loaded through :func:`__getattr__`). The module itself stays reachable
    as ``sys.modules["forge_triton.rmsnorm"]`` and by ``from forge_triton.rmsnorm import ...``."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _WHERE.get(name, ("",))[0] == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'forge_triton' has no attribute {name!r}")
    fn = getattr(importlib.import_module(f"{__name__}.{where[0]}"), where[1])
    globals()[name] = fn
    return fn
