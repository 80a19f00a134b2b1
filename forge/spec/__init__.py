"""The kernel spec: one module per kernel holding the math as plain torch (the reference),
the argument checks, the size metric the guard uses, and the reduction lengths that scale the
tolerance. Both backends implement exactly these signatures."""
from . import geglu, rmsnorm, rope, swiglu, tolerance

KERNELS = ("rmsnorm", "swiglu", "geglu", "rope", "fused_linear_ce", "lora_qkv", "lora_mlp")
# kernels whose cost scales with the activation size of one call: the per-call guard applies
SHAPE_SENSITIVE = ("rmsnorm", "swiglu", "geglu", "rope")

__all__ = ["KERNELS", "SHAPE_SENSITIVE", "geglu", "rmsnorm", "rope", "swiglu", "tolerance"]
