"""Second-order gradients: every forge autograd path refuses ``create_graph=True`` with a clear
error naming its kernel, where it once gave gradients a second backward treated as constants
(a wrong second derivative, no error). A patched model refuses the same way; unpatched, the same
call works."""
from __future__ import annotations

import pytest
import torch

import forge
from forge import ops
from forge.__main__ import build_model

from oracle import need_backend


def _inputs(key, device):
    g = torch.Generator(device=device).manual_seed(0)

    def r(*s):
        return torch.randn(s, generator=g, device=device).requires_grad_(True)

    if key == "rmsnorm":
        return lambda f, x, w: f(x, w, 1e-6), (r(6, 32), r(32))
    if key in ("swiglu", "geglu"):
        return lambda f, a, b: f(a, b), (r(6, 32), r(6, 32))
    if key == "rope":
        cos, sin = torch.randn(1, 4, 16, device=device), torch.randn(1, 4, 16, device=device)
        return lambda f, q, k: f(q, k, cos, sin), (r(2, 2, 4, 16), r(2, 1, 4, 16))
    if key == "gated_mlp":
        return lambda f, x, a, b, c: f(x, a, b, c), (r(6, 16), r(24, 16), r(24, 16), r(16, 24))
    labels = torch.randint(0, 40, (6,), generator=g, device=device)
    return lambda f, h, w: f(h, w, labels), (r(6, 16), r(40, 16))


@pytest.mark.parametrize("key", ["rmsnorm", "swiglu", "geglu", "rope", "gated_mlp", "fused_linear_ce"])
@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_kernel_refuses_create_graph(backend, key, device):
    need_backend(backend)
    call, xs = _inputs(key, device)
    out = call(ops.get(key, backend), *xs)
    loss = sum((o.float() ** 2).sum() for o in (out if isinstance(out, tuple) else (out,)))
    with pytest.raises(RuntimeError, match="has no double backward"):
        torch.autograd.grad(loss, xs, create_graph=True)
    # the same kernel's first-order backward is untouched
    out = call(ops.get(key, backend), *xs)
    loss = sum((o.float() ** 2).sum() for o in (out if isinstance(out, tuple) else (out,)))
    grads = torch.autograd.grad(loss, xs)
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)


@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_patched_model_refuses_create_graph(backend, device):
    need_backend(backend)
    model = build_model("llama", device=device)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(ids, labels=ids).loss
    torch.autograd.grad(loss, params, create_graph=True)  # unpatched: second order is torch's own
    forge.patch(model, backend=backend, min_elements=0)
    loss = model(ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="has no double backward"):
        torch.autograd.grad(loss, params, create_graph=True)
