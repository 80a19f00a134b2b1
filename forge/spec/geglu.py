"""GeGLU activation of a gated MLP (gemma, gemma2: ``gelu_pytorch_tanh``), equivalent torch::

    y = torch.nn.functional.gelu(gate, approximate="tanh") * up

With k = sqrt(2/pi), z = k * (g + 0.044715 g^3), t = tanh(z)::

    gelu(g)  = 0.5 * g * (1 + t)
    gelu'(g) = 0.5 * (1 + t) + 0.5 * g * (1 - t^2) * k * (1 + 3 * 0.044715 g^2)
    d_gate = dy * up * gelu'(gate);   d_up = dy * gelu(gate)

Kernels use 0.5 * (1 + tanh(z)) = sigmoid(2z), which has no cancellation near 0.
"""
from __future__ import annotations

import torch

from . import swiglu

check = swiglu.check
elements = swiglu.elements
reductions = swiglu.reductions


def reference(gate, up):
    check(gate, up)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
