"""Parity suite: every kernel x backend x dtype against the float64 reference (tests/oracle.py),
and backend against backend. One shared body per kernel: a case builder makes the inputs, the
``backend`` parametrisation runs the oracle, the ``agree`` tests run both backends on the same
inputs and gradients. On CPU both backends run in their interpreters at the tiny shapes; with
``-m gpu`` at the real ones.

Agreement bound: both backends compute in fp32 and round each output once, so they may differ by
about one rounding of each output plus fp32 accumulation noise over the reduction:
``rel_err(triton, pallas) <= 2 * atol(dtype, reduction)`` (tighter than the oracle's rule, which
also allows twice the eager error).
"""
from __future__ import annotations

import pytest
import torch

from forge import ops
from forge.spec import gated_mlp as mlp_spec
from forge.spec import geglu as geglu_spec
from forge.spec import rmsnorm as rmsnorm_spec
from forge.spec import rope as rope_spec
from forge.spec import shapes
from forge.spec import swiglu as swiglu_spec
from forge.spec import tolerance
from oracle import check_op, grad_leaf, need_backend

BACKENDS = list(ops.BACKENDS)  # from the registry (forge.ops.BACKENDS_TABLE)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cases(cpu: dict, gpu: dict):
    return [pytest.param(v, id=k) for k, v in cpu.items()] + [
        pytest.param(v, id=k, marks=pytest.mark.gpu) for k, v in gpu.items()
    ]


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values, last dimension strided by 2: exercises the non-contiguous path."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def _run_both(key, case):
    """Outputs and input gradients of both backends on identical inputs and output grads."""
    results = {}
    grads_out = None
    for backend in BACKENDS:
        args, grads = {}, {}
        for n, t in case["tensors"].items():
            args[n], grads[n] = grad_leaf(t) if n in case["diff"] else (t.detach().clone(), None)
        outs = ops.get(key, backend)(**args, **case["kwargs"])
        outs = outs if isinstance(outs, tuple) else (outs,)
        if grads_out is None:
            grads_out = [torch.randn_like(o) for o in outs]
        torch.autograd.backward(list(outs), grads_out)
        results[backend] = [o.detach() for o in outs] + [grads[n]() for n in case["diff"]]
    return results


def _assert_agree(key, case):
    res = _run_both(key, case)
    names = case["out_names"] + ["grad " + n for n in case["diff"]]
    red = case["reductions"]
    red_keys = case["out_names"] + list(case["diff"])
    for name, rk, t, p in zip(names, red_keys, res["triton"], res["pallas"]):
        assert t.dtype == p.dtype and t.shape == p.shape, f"{name}: {t.dtype}{tuple(t.shape)} vs {p.dtype}{tuple(p.shape)}"
        if t.numel() == 0:
            continue
        err = tolerance.rel_err(p, t)
        bound = 2 * tolerance.atol(t.dtype, red.get(rk, 1))
        assert err <= bound, f"{key} {name}: triton vs pallas rel err {err:.3e} > {bound:.3e}"


def _check(key, backend, ref, case):
    check_op(ops.get(key, backend), ref, case["tensors"], diff=case["diff"], kwargs=case["kwargs"],
             reductions=case["reductions"], out_names=case["out_names"])


# ---------------------------------------------------------------- rmsnorm
def _rmsnorm_case(x, w, **kwargs):
    return {"tensors": {"x": x, "weight": w}, "diff": ("x", "weight"), "kwargs": kwargs,
            "reductions": rmsnorm_spec.reductions(x, w), "out_names": ["y"]}


def _rmsnorm_inputs(shape, dtype, casting, device):
    m, n = shape
    x = torch.randn(m, n, device=device, dtype=dtype) * 3
    w = (torch.randn(n, device=device) * 0.5 + (0.0 if casting == "gemma" else 1.0)).to(dtype)
    return x, w


RMSNORM_MODES = [("llama", 0.0), ("gemma", 1.0)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting,offset", RMSNORM_MODES)
@pytest.mark.parametrize("shape", _cases(shapes.RMSNORM_CPU, shapes.RMSNORM_GPU))
def test_rmsnorm(backend, dtype, casting, offset, shape, device):
    x, w = _rmsnorm_inputs(shape, dtype, casting, device)
    _check("rmsnorm", backend, rmsnorm_spec.reference,
           _rmsnorm_case(x, w, eps=1e-6, casting=casting, offset=offset))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("casting,offset", RMSNORM_MODES)
@pytest.mark.parametrize("shape", _cases(shapes.RMSNORM_CPU, shapes.RMSNORM_GPU))
def test_rmsnorm_agree(dtype, casting, offset, shape, device):
    x, w = _rmsnorm_inputs(shape, dtype, casting, device)
    _assert_agree("rmsnorm", _rmsnorm_case(x, w, eps=1e-6, casting=casting, offset=offset))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_per_head_noncontiguous(backend, dtype, device):
    # qwen3 q_norm: (B, S, H, D) normalised over head_dim, arriving as a strided view
    x = _noncontig(torch.randn(2, 5, 3, 16, device=device, dtype=dtype))
    w = torch.randn(16, device=device, dtype=dtype)
    assert not x.is_contiguous()
    _check("rmsnorm", backend, rmsnorm_spec.reference, _rmsnorm_case(x, w, eps=1e-6))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rmsnorm_mixed_dtype_weight(backend, device):
    # fp32 weight with bf16 activations: HF promotes the output to fp32
    x = torch.randn(4, 24, device=device, dtype=torch.bfloat16)
    w = torch.randn(24, device=device, dtype=torch.float32)
    _check("rmsnorm", backend, rmsnorm_spec.reference, _rmsnorm_case(x, w, eps=1e-5))


# ---------------------------------------------------------------- swiglu / geglu
GLU = {"swiglu": swiglu_spec, "geglu": geglu_spec}


def _glu_case(gate, up):
    return {"tensors": {"gate": gate, "up": up}, "diff": ("gate", "up"), "kwargs": {},
            "reductions": {}, "out_names": ["y"]}


def _glu_inputs(shape, dtype, device):
    return torch.randn(*shape, device=device, dtype=dtype) * 3, torch.randn(*shape, device=device, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key", list(GLU))
@pytest.mark.parametrize("shape", _cases(shapes.GLU_CPU, shapes.GLU_GPU))
def test_glu(backend, dtype, key, shape, device):
    _check(key, backend, GLU[key].reference, _glu_case(*_glu_inputs(shape, dtype, device)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("key", list(GLU))
@pytest.mark.parametrize("shape", _cases(shapes.GLU_CPU, shapes.GLU_GPU))
def test_glu_agree(dtype, key, shape, device):
    _assert_agree(key, _glu_case(*_glu_inputs(shape, dtype, device)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", list(GLU))
def test_glu_noncontiguous(backend, key, device):
    gate = _noncontig(torch.randn(3, 40, device=device))
    up = torch.randn(40, 3, device=device).t()
    _check(key, backend, GLU[key].reference, _glu_case(gate, up))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", list(GLU))
def test_glu_refuses_a_0d_gate(backend, key, device):
    # (Triton's fast path skipped the spec's check for 0-d tensors of equal shape and returned a value)
    need_backend(backend)
    gate, up = torch.tensor(1.5, device=device), torch.tensor(2.0, device=device)
    with pytest.raises(ValueError, match="at least 1 dimension"):
        ops.get(key, backend)(gate, up)


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


def _rope_case(q, k, cos, sin, **kwargs):
    return {"tensors": {"q": q, "k": k, "cos": cos, "sin": sin}, "diff": ("q", "k"), "kwargs": kwargs,
            "reductions": rope_spec.reductions(), "out_names": ["q_out", "k_out"]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_cos", [True, False])
@pytest.mark.parametrize("shape", _cases(shapes.ROPE_CPU, shapes.ROPE_GPU))
def test_rope(backend, dtype, batch_cos, shape, device):
    _check("rope", backend, rope_spec.reference, _rope_case(*_rope_inputs(shape, dtype, device, batch_cos)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_cos", [True, False])
@pytest.mark.parametrize("shape", _cases(shapes.ROPE_CPU, shapes.ROPE_GPU))
def test_rope_agree(dtype, batch_cos, shape, device):
    _assert_agree("rope", _rope_case(*_rope_inputs(shape, dtype, device, batch_cos)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_general_cos_sin(backend, device):
    # halves of cos/sin that differ: the kernel must use full-width rows, not assume duplication
    q, k, _, _ = _rope_inputs((2, 3, 1, 4, 8), torch.float32, device)
    cos, sin = torch.randn(2, 4, 8, device=device), torch.randn(2, 4, 8, device=device)
    _check("rope", backend, rope_spec.reference, _rope_case(q, k, cos, sin))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bshd_contiguous", "bhsd_contiguous", "strided"])
def test_rope_layouts(backend, layout, device):
    # unsqueeze_dim=2 takes (B, S, H, D); also a contiguous (B, H, S, D) view of it and a
    # view whose strides fit neither layout (the bridge copies that one)
    q, k, cos, sin = _rope_inputs((1, 2, 2, 5, 8), torch.float32, device)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, S, H, D)
    if layout == "bhsd_contiguous":
        q, k = q.contiguous(), k.contiguous()
    elif layout == "strided":
        q, k = _noncontig(q), _noncontig(k)
    _check("rope", backend, rope_spec.reference, _rope_case(q, k, cos, sin, unsqueeze_dim=2))


# ---------------------------------------------------------------- gated MLP (train mode)
MLP_ACTS = ["silu", "gelu_tanh"]


def _mlp_inputs(shape, dtype, device):
    m, h, i = shape
    x = torch.randn(1, m, h, device=device, dtype=dtype)
    ws = [(torch.randn(*s, device=device) * s[1] ** -0.5).to(dtype) for s in ((i, h), (i, h), (h, i))]
    return (x, *ws)


def _mlp_case(x, wg, wu, wd, act, **kw):
    return {"tensors": {"x": x, "w_gate": wg, "w_up": wu, "w_down": wd},
            "diff": ("x", "w_gate", "w_up", "w_down"), "kwargs": {"act": act, **kw},
            "reductions": mlp_spec.reductions(x, wg, wu, wd), "out_names": ["y"]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", MLP_ACTS)
@pytest.mark.parametrize("shape", _cases(shapes.MLP_CPU, shapes.MLP_GPU))
def test_gated_mlp(backend, dtype, act, shape, device):
    _check("gated_mlp", backend, mlp_spec.reference, _mlp_case(*_mlp_inputs(shape, dtype, device), act))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", MLP_ACTS)
@pytest.mark.parametrize("shape", _cases({"odd": shapes.MLP_CPU["odd"]}, {"qwen05b": shapes.MLP_GPU["qwen05b"]}))
def test_gated_mlp_recompute(backend, dtype, act, shape, device):
    """recompute=True: the node keeps x and the weights only (g and u made again in backward),
    and meets the same rule."""
    case = _mlp_case(*_mlp_inputs(shape, dtype, device), act, recompute=True)
    _check("gated_mlp", backend, mlp_spec.reference, case)
    x, wg, wu, wd = (t.detach().requires_grad_() for t in case["tensors"].values())
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        for rc in (False, True):
            kept.clear()
            ops.get("gated_mlp", backend)(x, wg, wu, wd, act=act, recompute=rc)
            saved = {tuple(t.shape) for t in kept}
            assert (tuple(x.shape[:-1]) + (wg.shape[0],) in saved) is not rc, (rc, saved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", MLP_ACTS)
@pytest.mark.parametrize("shape", _cases(shapes.MLP_CPU, shapes.MLP_GPU))
def test_gated_mlp_agree(dtype, act, shape, device):
    _assert_agree("gated_mlp", _mlp_case(*_mlp_inputs(shape, dtype, device), act))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_mlp_second_backward(backend, device):
    # Triton writes the backward's results over the saved activations: a second backward through
    # the graph must raise, not read overwritten values, and say why (torch's own in-place error
    # named a tensor the user never made); Pallas (fresh buffers) gives the same gradients twice
    x, wg, wu, wd = (t.requires_grad_() for t in _mlp_inputs((5, 16, 24), torch.float32, device))
    y = ops.get("gated_mlp", backend)(x, wg, wu, wd)
    dy = torch.randn_like(y)
    first = torch.autograd.grad(y, (x, wg), dy, retain_graph=True)
    if backend == "triton":
        with pytest.raises(RuntimeError, match="gated MLP backward can run only once per forward"):
            torch.autograd.grad(y, (x, wg), dy)
    else:
        second = torch.autograd.grad(y, (x, wg), dy)
        assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_mlp_bad_input(backend, device):
    x, wg, wu, wd = _mlp_inputs((2, 8, 16), torch.float32, device)
    with pytest.raises(ValueError, match="w_down"):
        ops.get("gated_mlp", backend)(x, wg, wu, wd.t().contiguous())
    with pytest.raises(TypeError, match="w_up"):
        ops.get("gated_mlp", backend)(x, wg, wu.double(), wd)
    with pytest.raises(ValueError, match="act must be one of"):
        ops.get("gated_mlp", backend)(x, wg, wu, wd, act="relu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_mlp_bad_input_after_a_good_call(backend, device):
    # the per-call fast check (after a call of the same dtype passed the full checks) hands
    # anything it cannot vouch for to the full checks: it read x.get_device(), -1 on both the
    # CPU and meta (a meta call reached the kernels), and a 0-d x or a None raised inside it
    f = ops.get("gated_mlp", backend)
    x, wg, wu, wd = _mlp_inputs((2, 8, 16), torch.float32, device)
    f(x, wg, wu, wd)
    with pytest.raises(ValueError, match="x is on meta"):
        f(*(t.to("meta") for t in (x, wg, wu, wd)))
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        f(x[0, 0, 0], wg, wu, wd)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        f(None, wg, wu, wd)
    with pytest.raises(TypeError, match="w_gate must be a torch.Tensor"):
        f(x, 1.0, wu, wd)


@pytest.mark.parametrize("key,args,name", [
    ("rmsnorm", lambda t: (t, None, 1e-6), "weight"),
    ("swiglu", lambda t: (t, 3), "up"),
    ("geglu", lambda t: ([1.0], t), "gate"),
    ("rope", lambda t: (t.view(1, 1, 4, 8), t.view(1, 1, 4, 8), "cos", t.view(1, 4, 8)), "cos"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_tensor_argument_is_named(backend, key, args, name, device):
    # the spec's TypeError naming the argument, on both backends (Pallas' entry once read
    # weight.shape first: AttributeError on None)
    need_backend(backend)
    t = torch.randn(4, 8, device=device)
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
        ops.get(key, backend)(*args(t))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_size_weights_are_refused_by_name(backend, device):
    # an adapter of rank 0, a vocabulary of 0 or experts of width 0 crashed inside the backends
    # (a division by a zero block count, a reshape of 0 elements) where the reference returned
    need_backend(backend)
    x = torch.randn(3, 8, device=device)
    w = torch.randn(6, 8, device=device)
    a0, b0 = torch.randn(0, 8, device=device), torch.randn(6, 0, device=device)
    with pytest.raises(ValueError, match=r"a has a dimension of size 0 .*rank at least 1"):
        ops.get("lora_o", backend)(x, w, None, a0, b0, scale=1.0)
    with pytest.raises(ValueError, match="w has a dimension of size 0"):
        ops.get("lora_o", backend)(x, w[:0], None, a0[:, :8].new_ones(2, 8), b0.new_ones(0, 2), scale=1.0)
    with pytest.raises(ValueError, match="w has a dimension of size 0"):
        ops.get("lora_o", backend)(x[:, :0], w[:, :0], None, x.new_ones(2, 0), x.new_ones(6, 2), scale=1.0)
    labels = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="weight has a dimension of size 0"):
        ops.get("fused_linear_ce", backend)(x, w[:0], labels.fill_(-100))
    top = torch.zeros(3, 1, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="gate_up_proj has a dimension of size 0"):
        ops.get("experts", backend)(x, top, torch.ones(3, 1, device=device), torch.randn(2, 0, 8, device=device),
                                    torch.randn(2, 8, 0, device=device))


@pytest.mark.parametrize("unsqueeze_dim", [1.0, True])
def test_rope_unsqueeze_dim_must_be_an_int(unsqueeze_dim):
    q = torch.randn(1, 2, 4, 8)
    cos = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="unsqueeze_dim must be 1"):
        rope_spec.check_args(q, q, cos, cos, unsqueeze_dim)


@pytest.mark.parametrize("key", ["swiglu", "gated_mlp"])
def test_pallas_glu_calls_past_int32_run_in_pieces(key, device, monkeypatch):
    # Pallas' GLU counts a call's elements in int32: at rows x intermediate >= 2**31 (1 x 131072
    # tokens at Qwen2.5-7B) the count wrapped and most of the output was never written. Such
    # calls run in pieces; here the limit is lowered so a small call takes that path
    need_backend("pallas")
    kernels = pytest.importorskip("bridge.kernels")
    launches = []
    apply = kernels.core.apply
    monkeypatch.setattr(kernels, "GLU_MAX_ELEMENTS", 100)
    monkeypatch.setattr(kernels, "GLU_PIECE", 64)
    monkeypatch.setattr(kernels.core, "apply", lambda kdef, *ts, **kw: launches.append(ts[0].numel()) or apply(
        kdef, *ts, **kw))
    if key == "swiglu":
        _check(key, "pallas", swiglu_spec.reference, _glu_case(*_glu_inputs((3, 50), torch.float32, device)))
    else:
        _check(key, "pallas", mlp_spec.reference, _mlp_case(*_mlp_inputs((5, 8, 30), torch.float32, device), "silu"))
    assert launches and max(launches) <= 64 and 150 in [sum(launches[i:i + 3]) for i in range(len(launches))]
