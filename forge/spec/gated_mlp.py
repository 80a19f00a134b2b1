"""The gated MLP of qwen2 / qwen3 / llama (SwiGLU) and gemma / gemma2 (GeGLU) as one op, for
full-parameter training (the MLP forward of a patched model in train mode), equivalent torch::

    g = x @ w_gate.T ;  u = x @ w_up.T            # (..., I)
    y = (act(g) * u) @ w_down.T                    # act: silu or gelu_tanh; no biases

Backward, with h = act(g) * u::

    dh = dy @ w_down ;  d_w_down = dy^T h
    dg = dh * u * act'(g) ;  du = dh * act(g)      # forge.spec.swiglu / forge.spec.geglu
    d_w_gate = dg^T x ;  d_w_up = du^T x ;  dx = dg @ w_gate + du @ w_up

What the fused version changes is memory: eager autograd keeps x, g, u and h (the down
projection's input) for the backward; the fused op keeps x, g and u and recomputes h inside the
activation's backward kernel, one (rows x I) activation less per layer. The matrix products are
the same cuBLAS calls eager makes. With ``recompute=True`` it keeps x only and makes g and u again
in backward: three (rows x I) activations less than eager, for two more products.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _check

ACTS = ("silu", "gelu_tanh")


def check(x, w_gate, w_up, w_down, act: str = "silu") -> None:
    for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        _check.tensor(name, t)
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(w.shape)}")
        _check.same_dtype("x", x, name, w)
    if w_gate.shape != w_up.shape or w_gate.shape[1] != x.shape[-1]:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must both be "
                         f"(I, {x.shape[-1]}) for x of width {x.shape[-1]}")
    if w_down.shape[1] != w_gate.shape[0]:
        raise ValueError(f"w_down {tuple(w_down.shape)} must be (H, {w_gate.shape[0]})")
    _check.same_device(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")


def reference(x, w_gate, w_up, w_down, *, act: str = "silu", recompute: bool = False):
    """``recompute`` changes what the fused op keeps for backward, not what it computes."""
    check(x, w_gate, w_up, w_down, act)
    g = F.linear(x, w_gate)
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    return F.linear(a * F.linear(x, w_up), w_down)


def elements(x, w_gate, *_a, **_k) -> int:
    """Activation elements per call: rows x intermediate width (the guard's metric)."""
    return x.numel() // max(x.shape[-1], 1) * w_gate.shape[0]


def reductions(x, w_gate, w_up, w_down, *_a, **_k) -> dict:
    rows = x.numel() // max(x.shape[-1], 1)
    return {"y": w_gate.shape[0], "x": w_gate.shape[0], "w_gate": rows, "w_up": rows, "w_down": rows}
