"""Fused LoRA kernels (lora_qkv, lora_mlp): both backends against the float64 reference
(tests/oracle.py), triton against pallas, gradcheck of the Triton path, frozen base weights,
argument errors. CPU cases are tiny (interpreters); ``-m gpu`` runs the Qwen2.5-0.5B shapes.

Agreement bound (triton vs pallas) as in test_parity: ``2 * atol(dtype, reduction)``. The two
backends round at the same places except grad_x, which Triton accumulates in x's dtype over four
cuBLAS ``addmm_`` calls (one rounding each) and Pallas in fp32 once: a few roundings, inside it.
"""
from __future__ import annotations

import forge_triton  # noqa: F401  (first: sets TRITON_INTERPRET before anything imports triton)
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forge import ops
from forge.spec import lora_dropout
from forge.spec import lora_mlp as mlp_spec
from forge.spec import lora_qkv as qkv_spec
from forge.spec import tolerance
from oracle import check_op

BACKENDS = list(ops.BACKENDS)  # from the registry (forge.ops.BACKENDS_TABLE)

# (lead dims, hidden, q width, k/v width or intermediate): odd widths, rows not a block multiple
# (Pallas in its interpreter compiles each new shape / dtype / variant for seconds: CPU cases are
# few and the tests below reuse their combinations, so jit's cache serves them.)
QKV_CPU = {"odd": ((2, 5), 56, 40, 24)}
QKV_GPU = {"qwen05b": ((4, 1024), 896, 896, 128), "odd_large": ((3, 333), 1000, 1000, 200),
           "one_row": ((1,), 896, 896, 128)}
MLP_CPU = {"odd": ((7,), 40, 72)}
MLP_GPU = {"qwen05b": ((4, 1024), 896, 4864), "odd_large": ((3, 333), 1000, 1800), "one_row": ((1, 1), 896, 4864)}
ONE_ROW = {"qkv": ((1,), 24, 16, 8), "mlp": ((1, 1), 24, 40)}
F32, BF16 = torch.float32, torch.bfloat16
# (dtype, bias or act, rank), r in {8, 16}: on CPU each dtype meets one variant (both backends),
# on the GPU every combination
QKV_VARIANTS = [(F32, True, 8), (BF16, False, 16)]
QKV_VARIANTS_GPU = [(F32, False, 8), (BF16, True, 16), (F32, True, 16), (BF16, False, 8)]
MLP_VARIANTS = [(F32, "silu", 8), (BF16, "gelu_tanh", 16)]
MLP_VARIANTS_GPU = [(F32, "gelu_tanh", 16), (BF16, "silu", 8), (F32, "silu", 16), (BF16, "gelu_tanh", 8)]


def _cases(cpu, gpu):
    return [pytest.param(v, id=k) for k, v in cpu.items()] + [
        pytest.param(v, id=k, marks=pytest.mark.gpu) for k, v in gpu.items()]


def _grid(shapes_cpu, shapes_gpu, variants, variants_gpu):
    """(shape, dtype, variant, rank) params: CPU shapes x CPU variants; on the GPU the Qwen2.5-0.5B
    shape x every variant, the others x the CPU variants (each GPU case also runs the float64
    reference on the host CPU, which is what takes the time there)."""
    def pid(name, dt, v, r):
        v = {True: "bias", False: "nobias"}.get(v, v)
        return f"{name}-{str(dt).removeprefix('torch.')}-{v}-r{r}"
    out = [pytest.param(shape, *var, id=pid(n, *var)) for n, shape in shapes_cpu.items() for var in variants]
    out += [pytest.param(shape, *var, id=pid(n, *var), marks=pytest.mark.gpu)
            for n, shape in shapes_gpu.items() for var in variants + (variants_gpu if n == "qwen05b" else [])]
    return out


def _w(shape, dtype, device, fan_in):
    # unit-variance outputs, so every term of the sum matters for the error
    return (torch.randn(*shape, device=device) / fan_in**0.5).to(dtype)


def qkv_case(shape, r, bias, dtype, device, adapter_dtype=None):
    lead, h, nq, nkv = shape
    ldt = adapter_dtype or dtype
    tensors, kwargs = {"x": torch.randn(*lead, h, device=device, dtype=dtype)}, {}
    for p, n, s in (("q", nq, 2.0), ("k", nkv, 0.5), ("v", nkv, 1.0)):
        tensors[f"w_{p}"] = _w((n, h), dtype, device, h)
        if bias:
            tensors[f"bias_{p}"] = torch.randn(n, device=device).to(dtype)
        else:
            kwargs[f"bias_{p}"] = None
        tensors[f"a_{p}"] = _w((r, h), ldt, device, h)
        tensors[f"b_{p}"] = _w((n, r), ldt, device, r)
        kwargs[f"scale_{p}"] = s
    diff = ("x",) + tuple(f"{m}_{p}" for p in "qkv" for m in "ab")
    return {"tensors": tensors, "kwargs": kwargs, "diff": diff, "out_names": ["q", "k", "v"],
            "reductions": qkv_spec.reductions(**tensors, **kwargs)}


def mlp_case(shape, r, act, dtype, device, adapter_dtype=None):
    lead, h, inter = shape
    ldt = adapter_dtype or dtype
    t = {"x": torch.randn(*lead, h, device=device, dtype=dtype)}
    for p, n_in, n_out in (("gate", h, inter), ("up", h, inter), ("down", inter, h)):
        t[f"w_{p}"] = _w((n_out, n_in), dtype, device, n_in)
        t[f"a_{p}"] = _w((r, n_in), ldt, device, n_in)
        t[f"b_{p}"] = _w((n_out, r), ldt, device, r)
    kwargs = {"scale_gate": 2.0, "scale_up": 0.5, "scale_down": 1.5, "act": act}
    diff = ("x",) + tuple(f"{m}_{p}" for p in ("gate", "up", "down") for m in "ab")
    return {"tensors": t, "kwargs": kwargs, "diff": diff, "out_names": ["y"],
            "reductions": mlp_spec.reductions(**t)}


def _check(key, backend, ref, case):
    return check_op(ops.get(key, backend), ref, case["tensors"], diff=case["diff"], kwargs=case["kwargs"],
                    reductions=case["reductions"], out_names=case["out_names"])


def _assert_agree(key, case, compute=None):
    """Triton against Pallas, outputs and gradients, within twice the oracle's atol of the
    outputs' dtype, or of ``compute`` (x's dtype: fp32 gradients of fp32 adapters on a bf16 model
    carry bf16 products, whose roundings the two backends order differently)."""
    res, grads_out = {}, None
    for backend in BACKENDS:
        leaves = {n: t.detach().clone().requires_grad_(n in case["diff"]) for n, t in case["tensors"].items()}
        outs = ops.get(key, backend)(**leaves, **case["kwargs"])
        outs = outs if isinstance(outs, tuple) else (outs,)
        if grads_out is None:
            grads_out = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(list(outs), grads_out)
        res[backend] = [o.detach() for o in outs] + [leaves[n].grad for n in case["diff"]]
    names = case["out_names"] + list(case["diff"])
    for name, t, p in zip(names, res["triton"], res["pallas"]):
        assert t.dtype == p.dtype and t.shape == p.shape, f"{name}: {t.dtype}{t.shape} vs {p.dtype}{p.shape}"
        err = tolerance.rel_err(p, t)
        bound = 2 * tolerance.atol(compute or t.dtype, case["reductions"].get(name, 1))
        assert err <= bound, f"{key} {name}: triton vs pallas rel err {err:.3e} > {bound:.3e}"


# ---------------------------------------------------------------- parity: backend vs reference
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,dtype,bias,r", _grid(QKV_CPU, QKV_GPU, QKV_VARIANTS, QKV_VARIANTS_GPU))
def test_lora_qkv(backend, shape, dtype, bias, r, device):
    _check("lora_qkv", backend, qkv_spec.reference, qkv_case(shape, r, bias, dtype, device))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,dtype,act,r", _grid(MLP_CPU, MLP_GPU, MLP_VARIANTS, MLP_VARIANTS_GPU))
def test_lora_mlp(backend, shape, dtype, act, r, device):
    _check("lora_mlp", backend, mlp_spec.reference, mlp_case(shape, r, act, dtype, device))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_one_row(dtype, device):
    # Triton only on CPU (its row masking is per kernel; Pallas' is covered by "odd", M < block)
    _check("lora_qkv", "triton", qkv_spec.reference, qkv_case(ONE_ROW["qkv"], 8, True, dtype, device))
    _check("lora_mlp", "triton", mlp_spec.reference, mlp_case(ONE_ROW["mlp"], 16, "silu", dtype, device))


# the Llama-3.1-8B widths (hidden 4096, 8 KV heads of 128, intermediate 14336) at 2048 tokens, r 16
LLAMA8B = {"qkv": ((2, 1024), 4096, 4096, 1024), "mlp": ((2, 1024), 4096, 14336)}
ADAPTER_SHAPES = [pytest.param((QKV_CPU["odd"], MLP_CPU["odd"]), id="odd"),
                  pytest.param((LLAMA8B["qkv"], LLAMA8B["mlp"]), id="llama8b", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", ADAPTER_SHAPES)
def test_fp32_adapters_on_bf16(backend, shapes, device):
    # peft's default for a bf16 model: fp32 adapters, read in bf16 (tensor-core products with fp32
    # accumulation), fp32 gradients for them, the sum in bf16
    qkv = qkv_case(shapes[0], 16, True, torch.bfloat16, device, adapter_dtype=torch.float32)
    errs = _check("lora_qkv", backend, qkv_spec.reference, qkv)
    assert all(qkv["tensors"][n].dtype == torch.float32 for n in ("a_q", "b_v"))  # (check_op compares grad dtypes)
    _check("lora_mlp", backend, mlp_spec.reference,
           mlp_case(shapes[1], 16, "silu", torch.bfloat16, device, adapter_dtype=torch.float32))
    assert errs["da_q"] > 0


class _Float32Tensors(TorchDispatchMode):
    """Records every float32 tensor of at least ``n`` elements that an op returns."""

    def __init__(self, n):
        super().__init__()
        self.n, self.seen = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.n:
                self.seen.append(f"{func}: {tuple(t.shape)}")
        return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_adapters_make_no_fp32_activations(backend, device):
    # the adapter path reads x in bf16: no float32 copy of a (tokens x width) activation in
    # forward or backward (the fp32 adapters' own gradients, r x width, are far smaller)
    for key, case in (("lora_qkv", qkv_case(LLAMA8B["qkv"], 16, True, BF16, device, adapter_dtype=F32)),
                      ("lora_mlp", mlp_case(LLAMA8B["mlp"], 16, "silu", BF16, device, adapter_dtype=F32))):
        leaves = {n: t.clone().requires_grad_(n in case["diff"]) for n, t in case["tensors"].items()}
        tokens = leaves["x"].numel() // leaves["x"].shape[-1]
        with _Float32Tensors(tokens * 256) as seen:
            outs = ops.get(key, backend)(**leaves, **case["kwargs"])
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
        assert not seen.seen, f"{key}: float32 activations {seen.seen[:4]}"
        assert all(leaves[n].grad.dtype == F32 for n in case["diff"] if n != "x")


@pytest.mark.parametrize("backend", BACKENDS)
def test_uneven_ranks_noncontiguous(backend, device):
    # per-projection ranks differ (peft rank_pattern), x strided, a base weight transposed
    case = qkv_case(QKV_CPU["odd"], 8, True, torch.float32, device)
    t = case["tensors"]
    t["a_k"], t["b_k"] = _w((4, 56), torch.float32, device, 56), _w((24, 4), torch.float32, device, 4)
    wide = torch.randn(2, 5, 112, device=device)
    wide[..., ::2] = t["x"]
    t["x"] = wide[..., ::2]
    t["w_v"] = t["w_v"].t().contiguous().t()
    assert not t["x"].is_contiguous() and not t["w_v"].is_contiguous()
    _check("lora_qkv", backend, qkv_spec.reference, case)
    m = mlp_case(MLP_CPU["odd"], 8, "gelu_tanh", torch.float32, device)
    m["tensors"]["a_up"] = _w((16, 40), torch.float32, device, 40)
    m["tensors"]["b_up"] = _w((72, 16), torch.float32, device, 16)
    # down's rank apart from gate's (the Triton backward once ran down's product over gate's rank)
    m["tensors"]["a_down"] = _w((4, 72), torch.float32, device, 72)
    m["tensors"]["b_down"] = _w((40, 4), torch.float32, device, 4).t().contiguous().t()
    _check("lora_mlp", backend, mlp_spec.reference, m)


# ---------------------------------------------------------------- parity: triton vs pallas
# the CPU variants again: Pallas' compiled functions are reused from the tests above
@pytest.mark.parametrize("shape,dtype,bias,r", _grid(QKV_CPU, {"qwen05b": QKV_GPU["qwen05b"]}, QKV_VARIANTS, []))
def test_lora_qkv_agree(shape, dtype, bias, r, device):
    _assert_agree("lora_qkv", qkv_case(shape, r, bias, dtype, device))


@pytest.mark.parametrize("shape,dtype,act,r", _grid(MLP_CPU, {"qwen05b": MLP_GPU["qwen05b"]}, MLP_VARIANTS, []))
def test_lora_mlp_agree(shape, dtype, act, r, device):
    _assert_agree("lora_mlp", mlp_case(shape, r, act, dtype, device))


# ---------------------------------------------------------------- gradcheck (float64, Triton)
def test_gradcheck_lora_qkv(device):
    d = dict(device=device, dtype=torch.float64)
    x = torch.randn(3, 10, **d, requires_grad=True)
    w = [torch.randn(n, 10, **d) for n in (6, 4, 4)]
    bias = [torch.randn(6, **d), None, torch.randn(4, **d)]
    ab = [t.requires_grad_() for r, n in ((3, 6), (2, 4), (3, 4))
          for t in (torch.randn(r, 10, **d), torch.randn(n, r, **d))]

    def f(x, *ab):
        return forge_triton.lora_qkv(x, w[0], bias[0], ab[0], ab[1], w[1], bias[1], ab[2], ab[3],
                                     w[2], bias[2], ab[4], ab[5], scale_q=2.0, scale_k=0.5, scale_v=1.0)

    assert torch.autograd.gradcheck(f, (x, *ab), fast_mode=True)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gradcheck_lora_mlp(act, device):
    d = dict(device=device, dtype=torch.float64)
    x = torch.randn(3, 10, **d, requires_grad=True)
    wg, wu, wd = torch.randn(7, 10, **d), torch.randn(7, 10, **d), torch.randn(10, 7, **d)
    ab = [t.requires_grad_() for r, n_in, n_out in ((2, 10, 7), (3, 10, 7), (2, 7, 10))
          for t in (torch.randn(r, n_in, **d), torch.randn(n_out, r, **d))]

    def f(x, ag, bg, au, bu, ad, bd):
        return forge_triton.lora_mlp(x, wg, ag, bg, wu, au, bu, wd, ad, bd, scale_gate=2.0, scale_up=0.5,
                                     scale_down=1.5, act=act)

    assert torch.autograd.gradcheck(f, (x, *ab), fast_mode=True)


# ---------------------------------------------------------------- frozen base, unused outputs
@pytest.mark.parametrize("backend", BACKENDS)
def test_base_weights_frozen(backend, device):
    case = qkv_case(QKV_CPU["odd"], 8, True, torch.float32, device)
    t = {n: v.clone() for n, v in case["tensors"].items()}
    for n in case["diff"]:
        t[n].requires_grad_()
    fn = ops.get("lora_qkv", backend)
    q, k, v = fn(**t, **case["kwargs"])
    (q.sum() + k.sum() + v.sum()).backward()
    assert all(t[n].grad is None for n in t if n.startswith(("w_", "bias_")))
    assert all(t[n].grad is not None and t[n].grad.abs().sum() > 0 for n in case["diff"])
    t["w_k"].requires_grad_()
    with pytest.raises(ValueError, match="w_k requires grad"):
        fn(**t, **case["kwargs"])
    with torch.no_grad():  # no graph, nothing to freeze: allowed
        fn(**t, **case["kwargs"])
    m = mlp_case(ONE_ROW["mlp"], 8, "silu", torch.float32, device)
    m["tensors"]["w_down"].requires_grad_()
    with pytest.raises(ValueError, match="w_down requires grad"):
        ops.get("lora_mlp", backend)(**m["tensors"], **m["kwargs"])


def test_unused_outputs_get_no_gradient_terms(device):
    # only q feeds the loss (k, v unused): their adapters get zero gradients, x only q's terms
    case = qkv_case(QKV_CPU["odd"], 8, False, torch.float64, device)
    t = {n: v.clone().requires_grad_(n in case["diff"]) for n, v in case["tensors"].items()}
    q, _, _ = forge_triton.lora_qkv(**t, **case["kwargs"])
    q.square().sum().backward()
    ref = {n: v.clone().requires_grad_(n in case["diff"]) for n, v in case["tensors"].items()}
    qr, _, _ = qkv_spec.reference(**ref, **case["kwargs"])
    qr.square().sum().backward()
    for n in ("x", "a_q", "b_q"):
        torch.testing.assert_close(t[n].grad, ref[n].grad)
    for n in ("a_k", "b_k", "a_v", "b_v"):  # no path to them: no gradient, or an exact zero one
        assert ref[n].grad is None and (t[n].grad is None or t[n].grad.abs().max() == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows(backend, device):
    case = qkv_case(((0,), 24, 16, 8), 8, True, torch.float32, device)
    q, k, v = ops.get("lora_qkv", backend)(**case["tensors"], **case["kwargs"])
    assert q.shape == (0, 16) and k.shape == (0, 8) and v.shape == (0, 8)
    m = mlp_case(((0,), 24, 40), 8, "silu", torch.float32, device)
    assert ops.get("lora_mlp", backend)(**m["tensors"], **m["kwargs"]).shape == (0, 24)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_name_the_argument(backend, device):
    qkv = ops.get("lora_qkv", backend)
    mlp = ops.get("lora_mlp", backend)
    case = qkv_case(ONE_ROW["qkv"], 8, True, torch.float32, device)
    t, kw = case["tensors"], case["kwargs"]
    with pytest.raises(ValueError, match="b_k has rank 8 but a_k has rank 4"):
        qkv(**{**t, "a_k": t["a_k"][:4]}, **kw)
    with pytest.raises(ValueError, match="w_v has 23 input features but x has 24"):
        qkv(**{**t, "w_v": t["w_v"][:, :23]}, **kw)
    with pytest.raises(ValueError, match=r"bias_q must have shape \(16,\)"):
        qkv(**{**t, "bias_q": t["bias_q"][:3]}, **kw)
    with pytest.raises(TypeError, match="a_q is torch.float32 but a_v is torch.float64"):
        qkv(**{**t, "a_v": t["a_v"].double(), "b_v": t["b_v"].double()}, **kw)
    with pytest.raises(TypeError, match="scale_k must be a number"):
        qkv(**t, **{**kw, "scale_k": "2"})
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        qkv(**{**t, "x": None}, **kw)
    m = mlp_case(ONE_ROW["mlp"], 8, "silu", torch.float32, device)
    with pytest.raises(ValueError, match="act must be one of"):
        mlp(**m["tensors"], **{**m["kwargs"], "act": "relu"})
    with pytest.raises(ValueError, match="a_down has 39 input features but h = act"):
        mlp(**{**m["tensors"], "a_down": m["tensors"]["a_down"][:, :39]}, **m["kwargs"])
    with pytest.raises(ValueError, match="w_down has 23 output features"):
        mlp(**{**m["tensors"], "w_down": m["tensors"]["w_down"][:23], "b_down": m["tensors"]["b_down"][:23]},
            **m["kwargs"])


def test_triton_remembered_signature_still_checks_every_call(device):
    # the Triton wrappers skip the spec's checks for a signature they already accepted; what
    # varies per call (seed, probabilities, scales, frozen base weights) is still checked
    import forge_triton

    case = qkv_case(ONE_ROW["qkv"], 8, True, torch.float32, device)
    t, kw = case["tensors"], case["kwargs"]
    seed = lora_dropout.seed(device)
    forge_triton.lora_qkv(**t, **kw, seed=seed, dropout_q=0.1)  # accepted: remembered
    with pytest.raises(ValueError, match="dropout_k=0.1 needs a seed"):
        forge_triton.lora_qkv(**t, **kw, dropout_k=0.1)
    with pytest.raises(TypeError, match="seed must be an int64 tensor of one element"):
        forge_triton.lora_qkv(**t, **kw, seed=seed.float(), dropout_q=0.1)
    with pytest.raises(ValueError, match=r"dropout_q must be in \[0, 1\]"):
        forge_triton.lora_qkv(**t, **kw, seed=seed, dropout_q=1.5)
    with pytest.raises(TypeError, match="scale_k must be a number"):
        forge_triton.lora_qkv(**t, **{**kw, "scale_k": True})
    with pytest.raises(ValueError, match="w_k requires grad"):
        forge_triton.lora_qkv(**{**t, "w_k": t["w_k"].detach().requires_grad_()}, **kw)
    with pytest.raises(ValueError, match="w_v has 23 input features but x has 24"):
        forge_triton.lora_qkv(**{**t, "w_v": t["w_v"][:, :23]}, **kw)
    m = mlp_case(ONE_ROW["mlp"], 8, "silu", torch.float32, device)
    forge_triton.lora_mlp(**m["tensors"], **m["kwargs"])
    with pytest.raises(ValueError, match="act must be one of"):
        forge_triton.lora_mlp(**m["tensors"], **{**m["kwargs"], "act": ["silu"]})
    with pytest.raises(ValueError, match="dropout_down=0.1 needs a seed"):
        forge_triton.lora_mlp(**m["tensors"], **m["kwargs"], dropout_down=0.1)
    with pytest.raises(ValueError, match="w_up requires grad"):
        forge_triton.lora_mlp(**{**m["tensors"], "w_up": m["tensors"]["w_up"].detach().requires_grad_()},
                              **m["kwargs"])
