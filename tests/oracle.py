"""The correctness oracle (docs/design.md): one routine every kernel test calls.

``check_op`` runs the spec reference in float64 (on the test device), the same reference eagerly in the
test dtype on the test device, and the kernel; then compares every output and every input
gradient with ``forge.spec.tolerance``'s rule.
"""
from __future__ import annotations

import pytest
import torch

from forge.spec import tolerance

# a case on the CPU (the interpreted kernels) and, gpu-marked, on CUDA (the compiled ones)
ON_CPU_AND_GPU = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])


def skip_interpreters_on_gpu(device: str) -> None:
    """An ``ON_CPU_AND_GPU`` case's CPU half is skipped where CUDA is: there the kernels are compiled."""
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the CPU case runs the interpreters: on a CUDA machine the kernels are compiled")


def need_backend(backend: str) -> None:
    """Skip the calling test, with the registry's reason, where ``backend`` cannot run here."""
    from forge import ops

    ok, why = ops.availability(backend)
    if not ok:
        pytest.skip(why)


def _as_tuple(x):
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def grad_leaf(t: torch.Tensor):
    """(argument, gradient getter) for an input whose gradient a test reads: the argument holds
    ``t``'s values in ``t``'s own layout (a clone makes a step-sliced view contiguous, and the
    kernel would never see its strides), a view of a leaf where it must be; the getter returns
    the gradient in ``t``'s shape (zeros where none came)."""
    t = t.detach()
    leaf = t.clone().requires_grad_(True)
    if leaf.stride() == t.stride() or not t.numel() or 0 in t.stride():
        return leaf, lambda: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    base = torch.zeros(span, dtype=t.dtype, device=t.device)
    base.as_strided(t.shape, t.stride()).copy_(t)
    base.requires_grad_(True)
    view = base.as_strided(t.shape, t.stride())
    return view, lambda: (base.grad.as_strided(t.shape, t.stride()).clone() if base.grad is not None
                          else torch.zeros_like(t))


def _forward(fn, tensors: dict, diff: tuple, kwargs: dict, to=None):
    args, grads = {}, {}
    for name, t in tensors.items():
        t = t.detach()
        if to is not None:
            t = t.to(*to)
        if name in diff:
            t, grads[name] = grad_leaf(t)
        args[name] = t
    return _as_tuple(fn(**args, **kwargs)), grads


def _backward(outs, grads, diff, grads_out):
    live = [(o, g) for o, g in zip(outs, grads_out) if o.requires_grad]
    if live and any(o.numel() for o, _ in live):
        torch.autograd.backward([o for o, _ in live], [g.to(o.device, o.dtype) for o, g in live])
    return {n: grads[n]() for n in diff}


def check_op(kernel_fn, ref_fn, tensors: dict, *, diff=(), kwargs=None, reductions=None,
             out_names=None, dtype=None, backward=True):
    """Assert forward outputs and input gradients of ``kernel_fn`` against the oracle.

    tensors: name -> input tensor (already in the test dtype, on the test device).
    diff: names of inputs whose gradients are compared.
    reductions: name (output or input) -> reduction length for the tolerance.
    Returns {name: rel err} for reporting.
    """
    kwargs = kwargs or {}
    reductions = reductions or {}
    dtype = dtype or next(iter(tensors.values())).dtype
    diff = tuple(diff) if backward else ()
    # the reference in float64 on the test device (CPU in CI; the GPU keeps big shapes fast)
    dev = next(iter(tensors.values())).device
    ref_outs, ref_leaves = _forward(ref_fn, tensors, diff, kwargs, to=(dev, torch.float64))
    grads_out = [torch.randn(o.shape, dtype=torch.float64, device=dev) for o in ref_outs]
    ref_grads = _backward(ref_outs, ref_leaves, diff, grads_out)
    eag_outs, eag_leaves = _forward(ref_fn, tensors, diff, kwargs)
    eag_grads = _backward(eag_outs, eag_leaves, diff, grads_out)
    ker_outs, ker_leaves = _forward(kernel_fn, tensors, diff, kwargs)
    ker_grads = _backward(ker_outs, ker_leaves, diff, grads_out)
    out_names = out_names or [f"out{i}" for i in range(len(ref_outs))]
    errs = {}
    assert len(ker_outs) == len(ref_outs), f"kernel returned {len(ker_outs)} outputs, reference {len(ref_outs)}"
    for name, k, r, e in zip(out_names, ker_outs, ref_outs, eag_outs):
        assert k.shape == r.shape, f"{name}: shape {tuple(k.shape)} vs reference {tuple(r.shape)}"
        assert k.dtype == e.dtype, f"{name}: dtype {k.dtype} vs eager {e.dtype}"
        errs[name] = tolerance.assert_close(name, k, r, e, e.dtype, reductions.get(name, 1))
    for name in ker_grads:
        k, r, e = ker_grads[name], ref_grads[name], eag_grads[name]
        assert k.shape == r.shape and k.dtype == e.dtype, f"grad {name}: {k.shape}/{k.dtype} vs {r.shape}/{e.dtype}"
        errs["d" + name] = tolerance.assert_close("grad " + name, k, r, e, e.dtype, reductions.get(name, 1))
    return errs


def assert_step_close(got, ref, eager, config, tokens, dtype=torch.bfloat16):
    """A whole model's step, ``(loss, {name: gradient})``, against an fp32 copy's (``ref``),
    bounded by the unpatched model's own error (``eager``): the oracle's rule, with the reduction
    length the widest of the model's vocabulary, intermediate and hidden sizes and the tokens."""
    k = max(config.vocab_size, config.intermediate_size, config.hidden_size, tokens)
    tolerance.assert_close("loss", got[0], ref[0], eager[0], dtype, k)
    for n in ref[1]:
        tolerance.assert_close(f"grad {n}", got[1][n], ref[1][n], eager[1][n], dtype, k)
