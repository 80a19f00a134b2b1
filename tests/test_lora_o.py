"""``lora_o`` (one LoRA linear: o_proj) and the fused q/k/v and MLP calls with projections that
have no adapter (peft's partial target sets): both backends against the float64 reference
(tests/oracle.py), forward and backward, with and without dropout, peft's fp32 adapters on bf16;
Triton against Pallas; gradcheck of the Triton path; argument errors. CPU cases are tiny; the
``-m gpu`` cases run the Llama-3.1-8B widths at 2048 tokens.
"""
from __future__ import annotations

import forge_triton  # noqa: F401  (first: sets TRITON_INTERPRET before anything imports triton)
import pytest  # noqa: E402
import torch  # noqa: E402

from forge import ops  # noqa: E402
from forge.spec import lora_dropout as D  # noqa: E402
from forge.spec import lora_mlp as mlp_spec  # noqa: E402
from forge.spec import lora_o as o_spec  # noqa: E402
from forge.spec import lora_qkv as qkv_spec  # noqa: E402
from oracle import need_backend  # noqa: E402
from test_lora import (BACKENDS, BF16, F32, LLAMA8B, MLP_CPU, QKV_CPU, _assert_agree, _check, _w, mlp_case,  # noqa: E402
                       qkv_case)

# (lead dims, input width, output width): odd widths, rows not a block multiple; the GPU: o_proj
# at the Llama-3.1-8B shape (4096 -> 4096) at 2048 tokens
O_CPU = ((2, 5), 40, 24)
O_GPU = ((2, 1024), 4096, 4096)


def o_case(shape, r, bias, dtype, device, adapter_dtype=None, p=0.0):
    lead, k, n = shape
    ldt = adapter_dtype or dtype
    t = {"x": torch.randn(*lead, k, device=device, dtype=dtype), "w": _w((n, k), dtype, device, k),
         "a": _w((r, k), ldt, device, k), "b": _w((n, r), ldt, device, r)}
    kwargs = {"scale": 2.0}
    if bias:
        t["bias"] = torch.randn(n, device=device).to(dtype)
    else:
        kwargs["bias"] = None
    if p:
        kwargs.update(seed=D.seed(device), dropout=p)
    red = o_spec.reductions(t["x"], t["w"], t.get("bias"), t["a"], t["b"])
    return {"tensors": t, "kwargs": kwargs, "diff": ("x", "a", "b"), "out_names": ["y"], "reductions": red}


def without(case, spec, *projs):
    """``case`` with the projections ``projs`` left without an adapter (a_p = b_p = None)."""
    for p in projs:
        case["tensors"].pop(f"a_{p}")
        case["tensors"].pop(f"b_{p}")
        case["kwargs"].update({f"a_{p}": None, f"b_{p}": None})
    case["diff"] = tuple(n for n in case["diff"] if n.rpartition("_")[2] not in projs)
    adapters = {k: v for k, v in case["kwargs"].items() if k.startswith(("a_", "b_", "bias_"))}  # (None ones)
    case["reductions"] = spec.reductions(**case["tensors"], **adapters)
    return case


# ---------------------------------------------------------------- lora_o against the reference
O_VARIANTS = [  # (dtype, bias, adapter dtype, dropout)
    pytest.param(F32, True, None, 0.0, id="fp32-bias"),
    pytest.param(BF16, False, F32, 0.0, id="bf16-fp32_adapters"),
    pytest.param(F32, False, None, 0.3, id="fp32-dropout"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [pytest.param(O_CPU, id="odd"), pytest.param(O_GPU, id="llama8b", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype,bias,adapter_dtype,p", O_VARIANTS)
def test_lora_o(backend, shape, dtype, bias, adapter_dtype, p, device):
    r = 16 if shape is O_GPU else 8
    _check("lora_o", backend, o_spec.reference, o_case(shape, r, bias, dtype, device, adapter_dtype, p))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_o_bf16_dropout_llama8b(backend, device):
    # the step the issue measures: bf16 activations, peft's fp32 adapters, lora_dropout 0.05
    _check("lora_o", backend, o_spec.reference, o_case(O_GPU, 16, False, BF16, device, F32, 0.05))


def test_lora_o_agree(device):
    _assert_agree("lora_o", o_case(O_CPU, 8, True, F32, device, p=0.3))


def test_gradcheck_lora_o(device):
    d = dict(device=device, dtype=torch.float64)
    seed = D.seed(device)
    x = torch.randn(3, 10, **d, requires_grad=True)
    w, bias = torch.randn(6, 10, **d), torch.randn(6, **d)
    a, b = torch.randn(3, 10, **d, requires_grad=True), torch.randn(6, 3, **d, requires_grad=True)

    def f(x, a, b):
        return forge_triton.lora_o(x, w, bias, a, b, scale=2.0, seed=seed, dropout=0.25)

    assert torch.autograd.gradcheck(f, (x, a, b), fast_mode=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_o_errors(backend, device):
    fn = ops.get("lora_o", backend)
    case = o_case(((1,), 24, 16), 8, True, F32, device)
    t, kw = case["tensors"], case["kwargs"]
    with pytest.raises(ValueError, match="a and b must both be given"):
        fn(**{**t, "a": None}, **kw)
    with pytest.raises(ValueError, match="b has rank 8 but a has rank 4"):
        fn(**{**t, "a": t["a"][:4]}, **kw)
    with pytest.raises(ValueError, match="w has 23 input features but x has 24"):
        fn(**{**t, "w": t["w"][:, :23]}, **kw)
    with pytest.raises(ValueError, match="dropout=0.1 needs a seed"):
        fn(**t, **kw, dropout=0.1)
    with pytest.raises(ValueError, match="w requires grad"):
        fn(**{**t, "w": t["w"].detach().requires_grad_()}, **kw)


# ---------------------------------------------------------------- projections without an adapter
@pytest.mark.parametrize("backend", BACKENDS)
def test_qkv_without_k_adapter(backend, device):
    # peft's default target modules: q and v adapted, k its plain (biased) base product
    case = without(qkv_case(QKV_CPU["odd"], 8, True, F32, device), qkv_spec, "k")
    case["kwargs"].update(seed=D.seed(device), dropout_q=0.1, dropout_v=0.2)
    _check("lora_qkv", backend, qkv_spec.reference, case)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("missing", [("gate",), ("down",), ("gate", "up")], ids=["no_gate", "no_down", "down_only"])
def test_mlp_without_some_adapters(backend, missing, device):
    case = without(mlp_case(MLP_CPU["odd"], 8, "silu", F32, device), mlp_spec, *missing)
    case["kwargs"].update(seed=D.seed(device), **{f"dropout_{p}": 0.2 for p in mlp_spec.PROJ if p not in missing})
    _check("lora_mlp", backend, mlp_spec.reference, case)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("frozen", [("b_gate", "a_down"), ("b_up",), ("a_down", "b_gate", "b_up")],
                         ids=["b_gate_a_down", "b_up", "a_down_b_gate_b_up"])
def test_mlp_with_frozen_adapter_factors(backend, frozen, device):
    # factors that require no gradient (frozen by the user): their gradients are not made, and
    # the others' still match the reference, dropout on every adapter
    case = mlp_case(MLP_CPU["odd"], 8, "silu", F32, device)
    case["diff"] = tuple(n for n in case["diff"] if n not in frozen)
    case["kwargs"].update(seed=D.seed(device), dropout_gate=0.1, dropout_up=0.2, dropout_down=0.3)
    _check("lora_mlp", backend, mlp_spec.reference, case)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_adapters_llama8b(backend, device):
    # q and v adapted (peft's default) at the 8B widths, bf16 with fp32 adapters and dropout
    case = without(qkv_case(LLAMA8B["qkv"], 16, False, BF16, device, adapter_dtype=F32), qkv_spec, "k")
    case["kwargs"].update(seed=D.seed(device), dropout_q=0.05, dropout_v=0.05)
    _check("lora_qkv", backend, qkv_spec.reference, case)
    case = without(mlp_case(LLAMA8B["mlp"], 16, "silu", BF16, device, adapter_dtype=F32), mlp_spec, "up")
    case["kwargs"].update(seed=D.seed(device), dropout_gate=0.05, dropout_down=0.05)
    _check("lora_mlp", backend, mlp_spec.reference, case)


def test_partial_adapters_agree(device):
    case = without(qkv_case(QKV_CPU["odd"], 8, True, F32, device), qkv_spec, "k")
    case["kwargs"].update(seed=D.seed(device), dropout_q=0.1, dropout_v=0.2)
    _assert_agree("lora_qkv", case)
    case = without(mlp_case(MLP_CPU["odd"], 8, "silu", F32, device), mlp_spec, "gate")
    case["kwargs"].update(seed=D.seed(device), dropout_up=0.2, dropout_down=0.2)
    _assert_agree("lora_mlp", case)


def test_gradcheck_partial_adapters(device):
    d = dict(device=device, dtype=torch.float64)
    seed = D.seed(device)
    x = torch.randn(3, 10, **d, requires_grad=True)
    wg, wu, wd = torch.randn(7, 10, **d), torch.randn(7, 10, **d), torch.randn(10, 7, **d)
    au, bu = torch.randn(3, 10, **d, requires_grad=True), torch.randn(7, 3, **d, requires_grad=True)

    def mlp(x, au, bu):  # only up adapted
        return forge_triton.lora_mlp(x, wg, None, None, wu, au, bu, wd, None, None, scale_gate=1.0, scale_up=0.5,
                                     scale_down=1.0, seed=seed, dropout_up=0.3)

    assert torch.autograd.gradcheck(mlp, (x, au, bu), fast_mode=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_adapter_errors(backend, device):
    qkv = ops.get("lora_qkv", backend)
    case = qkv_case(((1,), 24, 16, 8), 8, True, F32, device)
    t, kw = case["tensors"], case["kwargs"]
    with pytest.raises(ValueError, match="a_k and b_k must both be given"):
        qkv(**{**t, "b_k": None}, **kw)
    with pytest.raises(ValueError, match=r"dropout_k=0.1 but k has no adapter"):
        qkv(**{**t, "a_k": None, "b_k": None}, **kw, seed=D.seed(device), dropout_k=0.1)
    with pytest.raises(TypeError, match="a_q is torch.float32 but a_v is torch.float64"):
        qkv(**{**t, "a_k": None, "b_k": None, "a_v": t["a_v"].double(), "b_v": t["b_v"].double()}, **kw)


@pytest.mark.gpu
def test_backends_agree_llama8b(device):
    # Triton against Pallas (natively launched) at the Llama-3.1-8B widths, 2048 tokens, as the
    # issue's step runs them: bf16, peft's fp32 adapters, lora_dropout 0.05 on every projection
    case = qkv_case(LLAMA8B["qkv"], 16, False, BF16, device, adapter_dtype=F32)
    case["kwargs"].update(seed=D.seed(device), dropout_q=0.05, dropout_k=0.05, dropout_v=0.05)
    _assert_agree("lora_qkv", case, BF16)
    case = mlp_case(LLAMA8B["mlp"], 16, "silu", BF16, device, adapter_dtype=F32)
    case["kwargs"].update(seed=D.seed(device), dropout_gate=0.05, dropout_up=0.05, dropout_down=0.05)
    _assert_agree("lora_mlp", case, BF16)
    _assert_agree("lora_o", o_case(O_GPU, 16, False, BF16, device, F32, 0.05), BF16)


@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_double_backward_is_refused(backend, device):
    # the LoRA kernels give first derivatives only: a backward with create_graph=True says so at
    # once, naming the kernel (never gradients a second backward would take for constants)
    need_backend(backend)
    seed = D.seed(device)
    o = o_case(((3,), 24, 16), 8, True, F32, device)
    qkv = qkv_case(((3,), 24, 16, 8), 8, False, F32, device)
    mlp = mlp_case(((3,), 24, 40), 8, "silu", F32, device)
    for key, case in (("lora_o", o), ("lora_qkv", qkv), ("lora_mlp", mlp)):
        t = {n: v.clone().requires_grad_(n == "x") for n, v in case["tensors"].items()}
        outs = ops.get(key, backend)(**t, **case["kwargs"], seed=seed)
        outs = outs if isinstance(outs, tuple) else (outs,)
        with pytest.raises(RuntimeError, match="has no double backward"):
            torch.autograd.grad(sum(o.square().sum() for o in outs), t["x"], create_graph=True)
