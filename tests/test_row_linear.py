"""The decoding steps' one-row products (forge.spec.row_linear) against a float64 reference, under
the suite's rule (no worse than twice eager's error in the same dtype, plus rounding), on both
backends; bad arguments get the spec's errors; the step's function mode hands the kernel exactly
the one-row calls it takes (decode_runtime._RowProducts).

CPU cases run the interpreters on small widths (a K tail, several K tiles, N not a multiple of
a program's features, a bias, rows at a stride); the gpu-marked ones the batch-1 decoding shapes
of Llama-3-8B and Qwen3-30B-A3B (q/k/v stored together, o, the router, the LM head) compiled.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import forge.ops
from forge.patching import decode_runtime
from forge.spec import row_linear as spec
from forge.spec import tolerance
from oracle import ON_CPU_AND_GPU, skip_interpreters_on_gpu

BACKENDS = list(forge.ops.BACKENDS)
GPU = torch.cuda.is_available()


def _check(backend, m, n, k, dtype, device, bias, row_stride=None, seed=0, autocast=False):
    f = forge.ops.get("row_linear", backend)
    gen = torch.Generator().manual_seed(seed)
    width = row_stride or k
    x = torch.randn(m, width, generator=gen)[:, :k].to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    if autocast:  # (the HF Trainer's bf16=True over float32 parameters: the kernel keeps their dtype)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            y = f(x, w, b)
    else:
        y = f(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype and y.device == x.device
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    eager = F.linear(x, w, b)
    tolerance.assert_close(f"row_linear {m}x{k} by {n}x{k}", y, ref, eager, dtype, k)
    return y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k,dtype,bias,row_stride", [
    (1, 20, 37, torch.float32, False, None),     # K below one tile, N not a multiple of 8
    (1, 64, 1100, torch.bfloat16, True, None),   # three K tiles and a tail; a bias
    (3, 9, 600, torch.float16, True, 640),       # several rows at a stride wider than K
])
def test_row_linear_cpu(backend, m, n, k, dtype, bias, row_stride):
    if GPU:
        pytest.skip("the CPU case runs the interpreters: on a CUDA machine the kernels are compiled")
    _check(backend, m, n, k, dtype, "cpu", bias, row_stride)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_linear_writes_the_residual_sum_cpu(backend, dtype):
    # with r, the same launch writes y + r as torch's addition rounds it (y first to the dtype):
    # bit for bit, and y as the call without r makes it; rows at a stride
    if GPU:
        pytest.skip("the CPU case runs the interpreters: on a CUDA machine the kernels are compiled")
    f = forge.ops.get("row_linear", backend)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 600, generator=gen).to(dtype)
    w = (torch.randn(20, 600, generator=gen) / 25).to(dtype)
    r = torch.randn(3, 24, generator=gen).to(dtype)[:, :20]
    y, s = f(x, w, None, r)
    assert torch.equal(y, f(x, w)) and torch.equal(s, y + r)
    tolerance.assert_close("row_linear with r", y, x.double() @ w.double().T, F.linear(x, w), dtype, 600)


def _check_glu(backend, m, i, k, dtype, device, act, seed=0):
    """The gated one-row kernel: the same values as the backend's row_linear followed by its GLU
    kernel, bit for bit, and the float64 reference under the suite's rule."""
    f, lin = forge.ops.get("row_glu", backend), forge.ops.get("row_linear", backend)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(2 * i, k, generator=gen) / k ** 0.5).to(device, dtype)
    y = f(x, w, act)
    assert y.shape == (m, i) and y.dtype == dtype
    g, u = lin(x, w).chunk(2, dim=-1)
    glu = forge.ops.get("swiglu" if act == "silu" else "geglu", backend)
    assert torch.equal(y, glu(g.contiguous(), u.contiguous()))
    gd, ud = (x.double() @ w.double().T).chunk(2, dim=-1)
    ref = spec.ACTS[act](gd, ud)
    ge, ue = F.linear(x, w).chunk(2, dim=-1)
    tolerance.assert_close(f"row_glu {act} {m}x{k} by {2 * i}x{k}", y, ref, spec.ACTS[act](ge, ue), dtype, k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("act", list(spec.ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_glu_cpu(backend, act, dtype):
    if GPU:
        pytest.skip("the CPU case runs the interpreters: on a CUDA machine the kernels are compiled")
    _check_glu(backend, 2, 20, 600, dtype, "cpu", act)  # (I not a multiple of a program's 8, a K tail)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("i,k,act", [(14336, 4096, "silu"), (16384, 2048, "gelu_tanh")])  # Llama-3-8B; gemma-2b
def test_row_glu_gpu(backend, i, k, act):
    _check_glu(backend, 1, i, k, torch.bfloat16, "cuda", act, seed=i)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_row_linear_bias_of_any_strides(backend, layout, device):
    # a (N,) bias that is a strided slice or a broadcast scalar: read as the tensor it is
    f = forge.ops.get("row_linear", backend)
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 24, generator=gen).to(device), torch.randn(20, 24, generator=gen).to(device)
    b = torch.randn(40, generator=gen).to(device)[::2] if layout == "strided" else \
        torch.randn(1, generator=gen).to(device).expand(20)
    assert not b.is_contiguous()
    y = f(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    tolerance.assert_close(f"row_linear, {layout} bias", y, ref, F.linear(x, w, b), torch.float32, 24)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_linear_layout_checked_on_every_signature(backend):
    # a call of the same shapes and dtypes as an accepted one, but a layout the spec refuses, is
    # refused too (a backend that checks each signature once keys it on the strides as well)
    f = forge.ops.get("row_linear", backend)
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    f(x, w)
    with pytest.raises(ValueError, match="w must be contiguous"):
        f(x, torch.randn(16, 8).T)
    with pytest.raises(ValueError, match="unit stride along K"):
        f(torch.randn(16, 2).T[:1], w)  # (1, 16) at strides (1, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_linear_empty(backend, device):
    f = forge.ops.get("row_linear", backend)
    w = torch.randn(5, 8, device=device)
    assert f(torch.zeros(0, 8, device=device), w).shape == (0, 5)
    b = torch.randn(5, device=device)
    y = f(torch.zeros(2, 0, device=device), torch.zeros(5, 0, device=device), b)  # (no features: the bias)
    assert torch.equal(y, b.expand(2, 5))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,k,bias", [
    (6144, 4096, False),     # Llama-3-8B q/k/v stored together
    (4096, 4096, False),     # its o
    (128256, 4096, False),   # its head
    (5120, 2048, True),      # Qwen3-30B-A3B q/k/v (a bias, as Qwen2's q/k/v have)
    (128, 2048, False),      # its router
    (151936, 2048, False),   # its head
])
def test_row_linear_gpu(backend, n, k, bias):
    _check(backend, 1, n, k, torch.bfloat16, "cuda", bias, seed=n)
    _check(backend, 2, n, k, torch.bfloat16, "cuda", bias, seed=n + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (2048, 4096)])  # Llama o, down; Qwen3's o
def test_row_linear_writes_the_residual_sum_gpu(backend, n, k):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(1, k, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to("cuda", torch.bfloat16)
    r = torch.randn(1, n, generator=gen).to("cuda", torch.bfloat16)
    f = forge.ops.get("row_linear", backend)
    y, s = f(x, w, None, r)
    assert torch.equal(y, f(x, w)) and torch.equal(s, y + r)
    tolerance.assert_close(f"row_linear with r, 1x{k} by {n}x{k}", y, x.double() @ w.double().T, F.linear(x, w),
                           torch.bfloat16, k)


@pytest.mark.parametrize("backend", BACKENDS)
@ON_CPU_AND_GPU
def test_row_linear_float32_under_autocast(backend, device):
    # float32 operands under autocast(bf16): a float32 product under the float32 rule, nothing
    # rounded to bf16 (the decoding steps' mode leaves such calls to torch: test below)
    skip_interpreters_on_gpu(device)
    n, k = (5120, 2048) if device == "cuda" else (24, 600)
    _check(backend, 1, n, k, torch.float32, device, True, autocast=True)


@pytest.mark.parametrize("backend", BACKENDS)
@ON_CPU_AND_GPU
def test_row_sum_and_glu_float32_under_autocast(backend, device):
    # the residual sum and the gated launch with float32 operands under autocast(bf16): float32
    # outputs, the same as without autocast (nothing rounded to bf16), and the float32 rule
    skip_interpreters_on_gpu(device)
    i, k = (14336, 4096) if device == "cuda" else (20, 600)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, k, generator=gen).to(device)
    w = (torch.randn(2 * i, k, generator=gen) / k ** 0.5).to(device)
    r = torch.randn(1, 2 * i, generator=gen).to(device)
    f, g = forge.ops.get("row_linear", backend), forge.ops.get("row_glu", backend)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        y, s = f(x, w, None, r)
        z = g(x, w, "silu")
    assert y.dtype == s.dtype == z.dtype == torch.float32
    y0, s0 = f(x, w, None, r)
    assert torch.equal(y, y0) and torch.equal(s, s0) and torch.equal(z, g(x, w, "silu"))
    tolerance.assert_close("row_linear with r under autocast", y, x.double() @ w.double().T, F.linear(x, w),
                           torch.float32, k)
    gd, ud = (x.double() @ w.double().T).chunk(2, dim=-1)
    ge, ue = F.linear(x, w).chunk(2, dim=-1)
    tolerance.assert_close("row_glu under autocast", z, spec.ACTS["silu"](gd, ud), spec.ACTS["silu"](ge, ue),
                           torch.float32, k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_linear_errors(backend):
    f = forge.ops.get("row_linear", backend)
    x, w = torch.zeros(1, 16), torch.zeros(8, 16)
    with pytest.raises(ValueError, match="x has 12 features but w takes 16"):
        f(torch.zeros(1, 12), w)
    with pytest.raises(TypeError, match="x is torch.float32 but w is torch.bfloat16"):
        f(x, w.bfloat16())
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        f(x.double(), w.double())
    with pytest.raises(ValueError, match="contiguous"):
        f(x, torch.zeros(16, 8).T)
    with pytest.raises(ValueError, match=r"b must be \(N,\)"):
        f(x, w, torch.zeros(16))
    with pytest.raises(ValueError, match="unit stride along K"):
        f(torch.zeros(1, 32)[:, ::2], w)
    with pytest.raises(ValueError, match=r"x must be \(M, K\)"):
        f(torch.zeros(1, 1, 16), w)
    with pytest.raises(ValueError, match=r"r must be \(M, N\) = \(1, 8\)"):
        f(x, w, None, torch.zeros(1, 16))
    with pytest.raises(TypeError, match="x is torch.float32 but r is torch.bfloat16"):
        f(x, w, None, torch.zeros(1, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="r must have unit stride along N"):
        f(x, w, None, torch.zeros(1, 16)[:, ::2])
    g = forge.ops.get("row_glu", backend)
    with pytest.raises(ValueError, match="act must be one of"):
        g(x, w, "relu")
    with pytest.raises(ValueError, match="the gate's rows then the up's, an even number, got 7"):
        g(x, torch.zeros(7, 16), "silu")


class _Spy:
    def __init__(self):
        self.shapes, self.sums = [], 0

    def __call__(self, x, w, b=None, r=None):
        self.shapes.append((tuple(x.shape), tuple(w.shape), b is not None))
        self.sums += r is not None
        return spec.reference(x, w, b, r)


def test_step_mode_takes_one_row_products_only():
    # under the decoding step's mode: F.linear of one row (an nn.Linear's or a direct call, any
    # leading dims) runs the kernel; several rows, a gradient wanted, autocast, float64 or a
    # non-contiguous weight run torch's own; other functions are untouched
    spy = _Spy()
    lin = torch.nn.Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(1, 1, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        want = F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16)
        with decode_runtime._RowProducts(spy) as mode:
            y = lin(x)
            y2 = F.linear(x[0, 0], lin.weight)
            F.linear(torch.randn(2, 16, dtype=torch.bfloat16), lin.weight)  # two rows
            F.linear(x.double(), lin.weight.double())  # float64
            F.linear(x, torch.randn(16, 8, dtype=torch.bfloat16).T)  # a transposed weight
            with torch.autocast("cpu", dtype=torch.bfloat16):
                F.linear(x.float(), lin.weight.float())
            z = torch.mm(torch.randn(1, 16), torch.randn(16, 3))
    assert y.shape == (1, 1, 8) and torch.equal(y, want)
    assert y2.shape == (8,)
    assert z.shape == (1, 3)
    assert spy.shapes == [((1, 16), (8, 16), True), ((1, 16), (8, 16), False)], spy.shapes
    assert mode.taken == 2
    with decode_runtime._RowProducts(spy) as mode:  # grad mode with a parameter that wants one
        out = torch.nn.Linear(16, 8)(torch.randn(1, 16))
    assert mode.taken == 0 and out.requires_grad


def test_step_kernels_counts_the_calls_taken():
    # step_kernels with a slot's kernel counts what it took; without one nothing changes
    spy = _Spy()

    class Slot:
        attention, linear, row_calls, sums, row_sums, glu, row_glus = None, spy, 0, False, 0, None, 0

    lin = torch.nn.Linear(16, 8, bias=False)
    with torch.no_grad():
        with decode_runtime.step_kernels(Slot):
            lin(torch.randn(1, 16))
        Slot.linear = None
        with decode_runtime.step_kernels(Slot):
            lin(torch.randn(1, 16))
    assert Slot.row_calls == 1 and len(spy.shapes) == 1


def _layer(emb, wo, wd, ids, between=None, swap=False, touch=False):
    """A decoder layer's residual stream as transformers writes it: embedding, o's product added
    to it, down's product added to that (``between``: a function on the product before the
    addition, as gemma2's norm; ``swap``: product + residual; ``touch``: the residual changed in
    place between the product and the addition)."""
    h = emb(ids)
    o = F.linear(torch.sin(h), wo)
    if touch:
        h.mul_(2)
    o = o if between is None else between(o)
    s1 = o + h if swap else h + o
    return s1 + F.linear(torch.cos(s1), wd)


@pytest.mark.parametrize("case", ["plain", "swap", "between", "touch", "alpha"])
def test_step_mode_writes_the_residual_sums(case):
    # with sums on, o's and down's products write the residual stream's sums and the additions
    # right after them take those: the same tensors, bit for bit, as the mode without sums; an
    # addition of other tensors (a norm between, as gemma2's), of a residual changed in place, or
    # with alpha, runs torch's own and gets the same result
    gen = torch.Generator().manual_seed(11)
    emb = torch.nn.Embedding(10, 16).to(torch.bfloat16)
    wo, wd = (torch.randn(16, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    ids = torch.tensor([[3]])
    kw = {"swap": case == "swap", "touch": case == "touch",
          "between": {"between": lambda t: t * 0.5, "alpha": None}.get(case)}
    layer = _layer
    if case == "alpha":
        def layer(emb, wo, wd, ids, **_):
            h = emb(ids)
            return torch.add(h, F.linear(torch.sin(h), wo), alpha=2)
    got, want = [], []
    with torch.no_grad():
        for sums, out in ((True, got), (False, want)):
            spy = _Spy()
            with decode_runtime._RowProducts(spy, sums=sums) as mode:
                out.append(layer(emb, wo, wd, ids, **kw))
            out.append((mode.taken, mode.summed, spy.sums))
    assert torch.equal(got[0], want[0]) and got[0].shape == (1, 1, 16)
    taken = 1 if case == "alpha" else 2
    served = {"plain": 2, "swap": 2, "between": 1, "touch": 1, "alpha": 0}[case]
    assert got[1] == (taken, served, taken) and want[1] == (taken, 0, 0), (got[1], want[1])


def test_step_mode_runs_the_gated_product_for_one_row():
    # the mode's gated(): one row, the weights stored together (an even number of rows), the
    # one-row conditions; else None (the MLP then runs its product and GLU kernel apart)
    calls = []

    def glu(x, w, act):
        calls.append((tuple(x.shape), tuple(w.shape), act))
        return spec.glu_reference(x, w, act)

    w = torch.randn(12, 16)
    x = torch.randn(1, 1, 16)
    with torch.no_grad():
        mode = decode_runtime._RowProducts(_Spy(), glu=glu)
        y = mode.gated(x, w, "silu")
        assert y.shape == (1, 1, 6) and torch.equal(y, spec.glu_reference(x.reshape(1, 16), w, "silu").view(1, 1, 6))
        assert mode.gated(torch.randn(2, 16), w, "silu") is None  # two rows
        assert mode.gated(x, w[:11], "silu") is None  # an odd number of rows
        assert decode_runtime._RowProducts(_Spy()).gated(x, w, "silu") is None  # no gated kernel
    assert mode.gated(x.requires_grad_(), w, "silu") is None  # a gradient wanted
    assert calls == [((1, 16), (12, 16), "silu")] and mode.glued == 1
