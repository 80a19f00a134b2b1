"""Parity suite: every kernel x backend x dtype against the float64 reference (tests/oracle.py),
and backend against backend. One shared body per kernel; each backend is one parametrisation."""
from __future__ import annotations

import pytest
import torch

from forge import ops
from forge.spec import geglu as geglu_spec
from forge.spec import rmsnorm as rmsnorm_spec
from forge.spec import rope as rope_spec
from forge.spec import shapes
from forge.spec import swiglu as swiglu_spec
from oracle import check_op

BACKENDS = ["triton", "pallas"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cases(cpu: dict, gpu: dict):
    return [pytest.param(v, id=k) for k, v in cpu.items()] + [
        pytest.param(v, id=k, marks=pytest.mark.gpu) for k, v in gpu.items()
    ]


def _kernel(key, backend):
    return ops.get(key, backend)


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values, last dimension strided by 2: exercises the non-contiguous path."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


# ---------------------------------------------------------------- rmsnorm
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
@pytest.mark.parametrize("shape", _cases(shapes.RMSNORM_CPU, shapes.RMSNORM_GPU))
def test_rmsnorm(backend, dtype, casting, offset, shape, device):
    m, n = shape
    x = torch.randn(m, n, device=device, dtype=dtype) * 3
    w = (torch.randn(n, device=device) * 0.5 + (0.0 if casting == "gemma" else 1.0)).to(dtype)
    check_op(_kernel("rmsnorm", backend), rmsnorm_spec.reference, {"x": x, "weight": w},
             diff=("x", "weight"), kwargs={"eps": 1e-6, "casting": casting, "offset": offset},
             reductions=rmsnorm_spec.reductions(x, w))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_per_head_noncontiguous(backend, dtype, device):
    # qwen3 q_norm: (B, S, H, D) normalised over head_dim, arriving as a strided view
    x = _noncontig(torch.randn(2, 5, 3, 16, device=device, dtype=dtype))
    w = torch.randn(16, device=device, dtype=dtype)
    assert not x.is_contiguous()
    check_op(_kernel("rmsnorm", backend), rmsnorm_spec.reference, {"x": x, "weight": w},
             diff=("x", "weight"), kwargs={"eps": 1e-6}, reductions=rmsnorm_spec.reductions(x, w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rmsnorm_mixed_dtype_weight(backend, device):
    # fp32 weight with bf16 activations: HF promotes the output to fp32
    x = torch.randn(4, 24, device=device, dtype=torch.bfloat16)
    w = torch.randn(24, device=device, dtype=torch.float32)
    check_op(_kernel("rmsnorm", backend), rmsnorm_spec.reference, {"x": x, "weight": w},
             diff=("x", "weight"), kwargs={"eps": 1e-5}, reductions=rmsnorm_spec.reductions(x, w))


# ---------------------------------------------------------------- swiglu / geglu
GLU = {"swiglu": swiglu_spec, "geglu": geglu_spec}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key", list(GLU))
@pytest.mark.parametrize("shape", _cases(shapes.GLU_CPU, shapes.GLU_GPU))
def test_glu(backend, dtype, key, shape, device):
    gate = torch.randn(*shape, device=device, dtype=dtype) * 3
    up = torch.randn(*shape, device=device, dtype=dtype)
    check_op(_kernel(key, backend), GLU[key].reference, {"gate": gate, "up": up}, diff=("gate", "up"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", list(GLU))
def test_glu_noncontiguous(backend, key, device):
    gate = _noncontig(torch.randn(3, 40, device=device))
    up = torch.randn(40, 3, device=device).t()
    check_op(_kernel(key, backend), GLU[key].reference, {"gate": gate, "up": up}, diff=("gate", "up"))


# ---------------------------------------------------------------- rope
def _rope_inputs(shape, dtype, device, batch_cos=True):
    b, hq, hk, s, d = shape
    # HF layout: projections viewed as (B, S, H, D) then transposed to (B, H, S, D)
    q = torch.randn(b, s, hq, d, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=device, dtype=dtype).transpose(1, 2)
    pos = torch.arange(s, device=device, dtype=torch.float32)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    ang = torch.outer(pos, inv)
    emb = torch.cat((ang, ang), dim=-1)[None].expand(b if batch_cos else 1, s, d)
    return q, k, emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_cos", [True, False])
@pytest.mark.parametrize("shape", _cases(shapes.ROPE_CPU, shapes.ROPE_GPU))
def test_rope(backend, dtype, batch_cos, shape, device):
    q, k, cos, sin = _rope_inputs(shape, dtype, device, batch_cos)
    check_op(_kernel("rope", backend), rope_spec.reference, {"q": q, "k": k, "cos": cos, "sin": sin},
             diff=("q", "k"), out_names=["q_out", "k_out"], reductions=rope_spec.reductions())


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_general_cos_sin(backend, device):
    # halves of cos/sin that differ: the kernel must use full-width rows, not assume duplication
    q, k, _, _ = _rope_inputs((2, 3, 1, 4, 8), torch.float32, device)
    cos, sin = torch.randn(2, 4, 8, device=device), torch.randn(2, 4, 8, device=device)
    check_op(_kernel("rope", backend), rope_spec.reference, {"q": q, "k": k, "cos": cos, "sin": sin},
             diff=("q", "k"), out_names=["q_out", "k_out"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_unsqueeze_dim_2(backend, device):
    q, k, cos, sin = _rope_inputs((1, 2, 2, 5, 8), torch.float32, device)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, S, H, D)
    check_op(_kernel("rope", backend), rope_spec.reference, {"q": q, "k": k, "cos": cos, "sin": sin},
             diff=("q", "k"), kwargs={"unsqueeze_dim": 2}, out_names=["q_out", "k_out"])
