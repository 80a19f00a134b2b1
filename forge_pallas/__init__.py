"""Pallas backend: the forge kernels as JAX Pallas GPU kernels, pure JAX (never imports torch).

One module per kernel, forward and backward together, each a pair of JAX functions that the
bridge (``bridge/``) calls on torch tensors::

    fwd(*inputs, **static) -> (outputs, residuals)
    bwd(inputs, residuals, grads, **static) -> one gradient (or None) per input

Without a GPU in JAX the kernels run in Pallas' interpreter (``_common.interpret``).
"""
from . import _common, glu, rmsnorm, rope  # noqa: F401

__all__ = ["glu", "rmsnorm", "rope"]
