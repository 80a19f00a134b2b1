"""SwiGLU activation of a gated MLP (qwen2, qwen3, llama), equivalent torch::

    y = torch.nn.functional.silu(gate) * up

Elementwise; kernels compute in fp32 and round once. Backward, with s = sigmoid(gate)::

    d_gate = dy * up * s * (1 + gate * (1 - s))
    d_up   = dy * gate * s
"""
from __future__ import annotations

import torch

from . import _check


def check(gate, up) -> None:
    _check.tensor("gate", gate)
    _check.tensor("up", up)
    _check.same_shape("gate", gate, "up", up)
    _check.same_dtype("gate", gate, "up", up)
    _check.same_device(gate=gate, up=up)


def reference(gate, up):
    check(gate, up)
    return torch.nn.functional.silu(gate) * up


def elements(gate, *_a, **_k) -> int:
    return gate.numel()


def reductions(*_a, **_k) -> dict:
    return {"y": 1, "gate": 1, "up": 1}
