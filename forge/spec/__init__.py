"""The kernel spec: one module per kernel holding the math as plain torch (the reference),
the argument checks, the size metric the guard uses, and the reduction lengths that scale the
tolerance. Both backends implement exactly these signatures.

Layer: the bottom one. Modules here import torch (and the standard library) only: never a
backend (``forge_triton``, ``forge_pallas``, ``bridge``), the op layer (``forge.ops``) or the
patching layer (``forge.patching``); every layer above reads its math and checks from here.
``tests/test_layers.py`` checks the order."""
from . import experts, geglu, rmsnorm, rope, swiglu, tolerance

KERNELS = ("rmsnorm", "swiglu", "geglu", "rope", "fused_linear_ce", "lora_qkv", "lora_o", "lora_mlp", "experts")
# kernels whose cost scales with the activation size of one call: the per-call guard applies
SHAPE_SENSITIVE = ("rmsnorm", "swiglu", "geglu", "rope")

__all__ = ["KERNELS", "SHAPE_SENSITIVE", "experts", "geglu", "rmsnorm", "rope", "swiglu", "tolerance"]
