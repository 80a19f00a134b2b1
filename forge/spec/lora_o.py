"""One LoRA linear (peft ``lora.Linear`` on the attention's o_proj, or any single projection).

Signature (every backend)::

    lora_o(x, w, bias, a, b, *, scale, seed=None, dropout=0.0) -> y

    x: (..., K)   w: (N, K) frozen base weight   bias: (N,) frozen, or None
    a: (r, K) lora_A.weight   b: (N, r) lora_B.weight   scale: float (alpha / r)
    x, w, bias share one dtype; a and b one (possibly another, e.g. peft's fp32)
    dropout: peft's lora_dropout on the adapter's input; seed: the call's int64 seed (one element,
    on x's device; needed when dropout > 0), the stream SALT["o"] of it (forge/spec/lora_dropout.py)

Equivalent torch (``project`` of forge.spec.lora_qkv: the adapter rounded to x's dtype, every
product on x's dtype with fp32 accumulation, fp32 gradients for fp32 adapters)::

    xd = lora_dropout.apply(x, seed, SALT["o"], dropout)              # x if dropout == 0
    y = F.linear(x, w, bias) + F.linear(F.linear(xd, a.to(x.dtype)), b.to(x.dtype)) * scale

Gradients flow to x, a and b; w and bias are frozen (ValueError if one requires grad while grad
is enabled). Backward, with xa = xd a^T (M, r) saved, xd recomputed from x and the seed, g the
output gradient::

    d b  = scale * g^T xa     d xa = scale * g b     d a = d xa^T xd     d x = g w + drop(d xa a)
"""
from __future__ import annotations

from . import _check, lora_dropout
from .lora_qkv import _proj_args, frozen, project

# the tensor arguments by name, in the signature's order (the seed is a keyword), and those
# with a gradient: every backend binds its gradients to these names, never to positions
TENSORS = ("x", "w", "bias", "a", "b", "seed")
TRAINABLE = ("x", "a", "b")


def check(x, w, bias, a, b, *, scale, seed=None, dropout=0.0) -> None:
    _check.tensor("x", x)
    _proj_args("", x, w, bias, a, b, scale, optional=False)
    lora_dropout.check("", dropout)
    lora_dropout.check_seed(seed, {"": dropout}, x.device)


def reference(x, w, bias, a, b, *, scale, seed=None, dropout=0.0):
    check(x, w, bias, a, b, scale=scale, seed=seed, dropout=dropout)
    return project(x, w, bias, a, b, scale, seed, lora_dropout.SALT["o"], dropout)


def elements(x, *_a, **_k) -> int:
    """Activation elements per call: rows x input features."""
    return x.numel()


def reductions(x, w, bias, a, b, **_k) -> dict:
    """Reduction length behind each output and gradient (scales the tolerance): d b sums over the
    rows after xa's sum over K, d a over the rows after d xa's sum over N."""
    k, r = x.shape[-1], a.shape[0]
    rows = x.numel() // max(k, 1)
    return {"y": k + r, "x": w.shape[0] + r, "a": rows + w.shape[0], "b": rows + k}


__all__ = ["TENSORS", "TRAINABLE", "check", "elements", "frozen", "reductions", "reference"]
