"""peft's lora_dropout drawn inside the fused LoRA kernels (forge/spec/lora_dropout.py): both
backends against the float64 reference with the same seed (forward and backward), each
backend's masks bit for bit the spec's (so the two backends' are identical), gradcheck, the
statistics of the masks (keep rate, scaling, independence across projections, seeds and
neighbouring elements), reproducibility under ``torch.manual_seed``, and the errors.

Statistical bounds are binomial: a rate over n elements with probability q is within
5 sqrt(q (1 - q) / n) of q (a false alarm once in ~3.5 million runs per check).
"""
from __future__ import annotations

import forge_triton  # noqa: F401  (first: sets TRITON_INTERPRET before anything imports triton)
import itertools  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from forge import ops  # noqa: E402
from forge.spec import lora_dropout as D  # noqa: E402
from forge.spec import lora_mlp as mlp_spec  # noqa: E402
from forge.spec import lora_qkv as qkv_spec  # noqa: E402
from test_lora import (ADAPTER_SHAPES, BACKENDS, F32, LLAMA8B, MLP_CPU, MLP_GPU, MLP_VARIANTS, MLP_VARIANTS_GPU, ONE_ROW,  # noqa: E402
                       QKV_CPU, QKV_GPU, QKV_VARIANTS, QKV_VARIANTS_GPU, _assert_agree, _check, _grid, mlp_case,
                       qkv_case)

QKV_DROP = {"q": 0.1, "k": 0.0, "v": 0.5}  # k without dropout: mixed projections in one call
MLP_DROP = {"gate": 0.05, "up": 0.3, "down": 0.2}


def with_dropout(case, drops, device):
    case["kwargs"]["seed"] = D.seed(device)
    case["kwargs"].update({f"dropout_{p}": prob for p, prob in drops.items()})
    return case


def _within(rate, q, n, what):
    bound = 5 * math.sqrt(q * (1 - q) / n)
    assert abs(rate - q) <= bound, f"{what}: {rate:.5f} vs {q:.5f} (bound {bound:.5f}, n={n})"


# ---------------------------------------------------------------- kernels against the reference
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,dtype,bias,r", _grid(QKV_CPU, QKV_GPU, QKV_VARIANTS[:1], QKV_VARIANTS_GPU[:2]))
def test_dropout_lora_qkv(backend, shape, dtype, bias, r, device):
    _check("lora_qkv", backend, qkv_spec.reference, with_dropout(qkv_case(shape, r, bias, dtype, device), QKV_DROP,
                                                                 device))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,dtype,act,r", _grid(MLP_CPU, MLP_GPU, MLP_VARIANTS[:1], MLP_VARIANTS_GPU[:2]))
def test_dropout_lora_mlp(backend, shape, dtype, act, r, device):
    _check("lora_mlp", backend, mlp_spec.reference, with_dropout(mlp_case(shape, r, act, dtype, device), MLP_DROP,
                                                                 device))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", [pytest.param((QKV_CPU["odd"], MLP_CPU["odd"]), id="odd"),
                                    pytest.param((LLAMA8B["qkv"], LLAMA8B["mlp"]), id="llama8b",
                                                 marks=pytest.mark.gpu)])
def test_dropout_fp32_adapters_on_bf16(backend, shapes, device):
    # peft's default for a bf16 model, peft's usual p: the masks drawn in the kernels, the
    # dropped input and every product in bf16, fp32 gradients for the fp32 adapters
    p = dict.fromkeys(("gate", "up", "down"), 0.05)
    _check("lora_mlp", backend, mlp_spec.reference,
           with_dropout(mlp_case(shapes[1], 16, "gelu_tanh", torch.bfloat16, device, adapter_dtype=F32), p, device))
    if shapes[0] is not QKV_CPU["odd"]:
        _check("lora_qkv", backend, qkv_spec.reference,
               with_dropout(qkv_case(shapes[0], 16, False, torch.bfloat16, device, adapter_dtype=F32),
                            dict.fromkeys("qkv", 0.05), device))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,r", [(F32, 64), (torch.bfloat16, 128), (torch.bfloat16, 256)], ids=["f32-r64", "bf16-r128",
                                                                                                "bf16-r256"])
def test_wide_ranks_fit_the_gpu(backend, dtype, r, device):
    # ranks people train with (64-256): the row kernels keep x's tile and every adapter's A (or
    # d xa) tile per pipeline stage in shared memory; three stages of three rank-128 adapters
    # exceed an H100's, so the launch takes fewer stages or narrower column blocks (it raised
    # OutOfResources inside Triton before)
    _check("lora_qkv", backend, qkv_spec.reference,
           with_dropout(qkv_case(((2, 64), 1024, 1024, 256), r, False, dtype, device), QKV_DROP, device))
    _check("lora_mlp", backend, mlp_spec.reference,
           with_dropout(mlp_case(((2, 64), 1024, 2048), r, "silu", dtype, device), MLP_DROP, device))


def test_row_kernel_launch_fits_shared_memory():
    # the launch settings of the row kernels: Triton's three stages and CFG's columns where they
    # fit (bf16 at the ranks benchmarked), fewer stages or columns where they do not, always
    # within the budget (H100: 227 KB a program)
    from forge_triton import lora_kernels as K

    dev = torch.device("cpu")  # (the interpreter stands in for an H100's shared memory)
    limit = 227 * 1024 * 7 // 8
    assert K._down_launch([16] * 3, torch.bfloat16, dev)[1:4] == (K.CFG["down"][1], K.CFG["down"][2], 3)
    assert K._down_launch([64] * 3, torch.bfloat16, dev)[3] == 3
    for dt in (torch.bfloat16, F32, torch.float64):
        for r in (8, 64, 128, 256):
            bm, bk, _, stages, br = K._down_launch([r] * 3, dt, dev)
            assert stages * (bm * bk + 3 * bk * br) * dt.itemsize <= limit, (dt, r)
            assert br >= r and bk >= 16
    # the rule itself: stages first, then the block; one stage of the smallest block at worst
    from forge import _runtime

    per = lambda b: b * 100  # noqa: E731  (bytes a stage; 7/8 of the limit is usable)
    assert _runtime.pipeline_fit(128, per, 8 * 3 * 12800 // 7 + 1) == (128, 3)
    assert _runtime.pipeline_fit(128, per, 8 * 3 * 12800 // 7 - 8) == (128, 2)
    assert _runtime.pipeline_fit(128, per, 8000) == (64, 1)
    assert _runtime.pipeline_fit(32, lambda b: 10**9, 1000, smallest=32) == (32, 1)


def _either_way_cases(backend, shapes, device):
    for dt, adt in ((torch.bfloat16, F32), (F32, None)):
        _check("lora_mlp", backend, mlp_spec.reference,
               with_dropout(mlp_case(shapes[1], 16, "silu", dt, device, adapter_dtype=adt), MLP_DROP, device))
        _check("lora_qkv", backend, qkv_spec.reference,
               with_dropout(qkv_case(shapes[0], 8, True, dt, device, adapter_dtype=adt), QKV_DROP, device))


@pytest.mark.parametrize("how", ["dot", "outer_products"])
@pytest.mark.parametrize("shapes", ADAPTER_SHAPES)
def test_triton_low_rank_term_either_way(how, shapes, monkeypatch, device):
    # the Triton tile kernels (add, dx, glu_fwd, glu_bwd) compute their rank-r term with tl.dot or
    # as r outer products (CFG's fourth entry picks by rank): both against the reference, with
    # dropout, fp32 adapters on a bf16 model and an all-fp32 model
    from forge_triton import lora_kernels

    upto = 0 if how == "dot" else 1024
    for key in ("add", "dx", "glu_fwd", "glu_bwd"):
        monkeypatch.setitem(lora_kernels.CFG, key, lora_kernels.CFG[key][:3] + (upto,))
    _either_way_cases("triton", shapes, device)


@pytest.mark.parametrize("shapes", ADAPTER_SHAPES)
def test_pallas_low_rank_term_as_outer_products(shapes, monkeypatch, device):
    # the same option in the Pallas tile kernels (forge_pallas.lora_kernels.FMA_UPTO, read when
    # a kernel is traced); the dot is what every other Pallas LoRA test runs
    pytest.importorskip("jax")
    from bridge import core
    from forge_pallas import lora_kernels

    monkeypatch.setattr(lora_kernels, "FMA_UPTO", 1024)
    core.forget_traces()
    try:
        _either_way_cases("pallas", shapes, device)
    finally:
        monkeypatch.undo()
        core.forget_traces()


def test_dropout_agree(device):
    # the CPU variants of the tests above (Pallas' compiled functions are reused)
    _assert_agree("lora_qkv", with_dropout(qkv_case(QKV_CPU["odd"], 8, True, F32, device), QKV_DROP, device))
    _assert_agree("lora_mlp", with_dropout(mlp_case(MLP_CPU["odd"], 8, "silu", F32, device), MLP_DROP, device))


def _identity_qkv(rows, width, device):
    """lora_qkv arguments whose outputs are each projection's dropped-out input: x = ones, zero
    base weights, A = B = identity (rank = width), scale 1."""
    t = {"x": torch.ones(rows, width, device=device)}
    kw = {}
    for p in "qkv":
        t.update({f"w_{p}": torch.zeros(width, width, device=device), f"a_{p}": torch.eye(width, device=device),
                  f"b_{p}": torch.eye(width, device=device)})
        kw.update({f"bias_{p}": None, f"scale_{p}": 1.0})
    return t, kw


def test_masks_are_the_specs_on_both_backends(device):
    # each kernel's mask, element for element, is the spec's hash of (seed, salt, row, column):
    # so the Triton and Pallas masks are identical, and the backward uses the forward's mask
    # (the oracle tests above would fail otherwise). Rows span several row blocks.
    rows, width = 150, 16
    t, kw = _identity_qkv(rows, width, device)
    seed = D.seed(device)
    ps = {"q": 0.1, "k": 0.5, "v": 0.9}
    got = {}
    for backend in BACKENDS:
        outs = ops.get("lora_qkv", backend)(**t, **kw, seed=seed, **{f"dropout_{p}": v for p, v in ps.items()})
        for p, o in zip("qkv", outs):
            kept = o != 0
            assert torch.equal(kept, D.keep(seed, D.SALT[p], (rows, width), ps[p])), f"{backend} {p}"
            assert torch.allclose(o[kept], torch.full_like(o[kept], D.scale(ps[p]))), f"{backend} {p}: scaling"
            got[backend, p] = kept
    for p in "qkv":
        assert torch.equal(*(got[b, p] for b in BACKENDS))
    assert not torch.equal(got[BACKENDS[0], "q"], got[BACKENDS[0], "k"])  # the comparison can fail


@pytest.mark.parametrize("backend", ["triton", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_dropout_off_is_the_plain_call(backend, device):
    # no seed, or a seed with every probability 0, takes the plain path: outputs and gradients
    # bit for bit as without the arguments; a probability > 0 changes them (so it can fail)
    seed = D.seed(device)
    for key, case, off, on in (
            ("lora_qkv", qkv_case(QKV_CPU["odd"], 8, True, F32, device), dict(seed=seed, dropout_k=0.0),
             dict(seed=seed, dropout_q=0.5)),
            ("lora_mlp", mlp_case(MLP_CPU["odd"], 8, "silu", F32, device), dict(seed=seed, dropout_up=0),
             dict(seed=seed, dropout_gate=0.5))):
        fn = ops.get(key, backend)
        res = []
        for kw in ({}, off, on):
            leaves = {n: t.clone().requires_grad_(n in case["diff"]) for n, t in case["tensors"].items()}
            outs = fn(**leaves, **case["kwargs"], **kw)
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
            res.append([o.detach() for o in outs] + [leaves[n].grad for n in case["diff"]])
        assert all(torch.equal(a, b) for a, b in zip(res[0], res[1])), key
        assert not torch.equal(res[0][0], res[2][0]), key


def test_gradcheck_dropout(device):
    d = dict(device=device, dtype=torch.float64)
    seed = D.seed(device)
    x = torch.randn(3, 10, **d, requires_grad=True)
    w = [torch.randn(n, 10, **d) for n in (6, 4, 4)]
    ab = [t.requires_grad_() for r, n in ((3, 6), (2, 4), (3, 4))
          for t in (torch.randn(r, 10, **d), torch.randn(n, r, **d))]

    def qkv(x, *ab):
        return forge_triton.lora_qkv(x, w[0], None, ab[0], ab[1], w[1], None, ab[2], ab[3], w[2], None, ab[4], ab[5],
                                     scale_q=2.0, scale_k=0.5, scale_v=1.0, seed=seed, dropout_k=0.4,
                                     dropout_v=0.25)

    assert torch.autograd.gradcheck(qkv, (x, *ab), fast_mode=True)
    wg, wu, wd = torch.randn(7, 10, **d), torch.randn(7, 10, **d), torch.randn(10, 7, **d)
    ab = [t.requires_grad_() for r, n_in, n_out in ((2, 10, 7), (3, 10, 7), (2, 7, 10))
          for t in (torch.randn(r, n_in, **d), torch.randn(n_out, r, **d))]

    def mlp(x, ag, bg, au, bu, ad, bd):
        return forge_triton.lora_mlp(x, wg, ag, bg, wu, au, bu, wd, ad, bd, scale_gate=2.0, scale_up=0.5,
                                     scale_down=1.5, seed=seed, dropout_gate=0.4, dropout_up=0.25,
                                     dropout_down=0.5)

    assert torch.autograd.gradcheck(mlp, (x, *ab), fast_mode=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_errors(backend, device):
    qkv, mlp = ops.get("lora_qkv", backend), ops.get("lora_mlp", backend)
    case = qkv_case(ONE_ROW["qkv"], 8, True, torch.float32, device)
    t, kw = case["tensors"], case["kwargs"]
    seed = D.seed(device)
    with pytest.raises(ValueError, match="dropout_k=0.1 needs a seed"):
        qkv(**t, **kw, dropout_k=0.1)
    with pytest.raises(TypeError, match="seed must be an int64 tensor of one element"):
        qkv(**t, **kw, seed=seed.to(torch.int32), dropout_q=0.1)
    with pytest.raises(TypeError, match="seed must be a torch.Tensor"):
        qkv(**t, **kw, seed=7, dropout_q=0.1)
    with pytest.raises(ValueError, match=r"dropout_q must be in \[0, 1\]"):
        qkv(**t, **kw, seed=seed, dropout_q=1.5)
    m = mlp_case(ONE_ROW["mlp"], 8, "silu", torch.float32, device)
    with pytest.raises(TypeError, match="dropout_down must be a number"):
        mlp(**m["tensors"], **m["kwargs"], seed=seed, dropout_down="0.1")


# ---------------------------------------------------------------- the masks' statistics
SHAPE = (512, 1024)  # 2**19 elements a mask: the binomial bounds are ~0.0015 at p = 0.05


def _mask(seed, name, p=0.05, shape=SHAPE):
    return D.keep(seed, D.SALT[name], shape, p).to(torch.float64)


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_keep_rate_and_scale(p):
    seed = D.seed("cpu")
    n = SHAPE[0] * SHAPE[1]
    kept = _mask(seed, "q", p)
    _within(kept.mean().item(), 1 - p, n, f"keep rate at p={p}")
    # per row and per column as well (a key that failed to mix would skew whole rows or columns)
    for dim, m in ((1, SHAPE[1]), (0, SHAPE[0])):
        rates = kept.mean(dim=dim)
        worst = (rates - (1 - p)).abs().max().item()
        assert worst <= 6 * math.sqrt(p * (1 - p) / m), f"p={p}: a {'row' if dim else 'column'} off by {worst}"
    dropped = D.apply(torch.ones(SHAPE, dtype=torch.float64), seed, D.SALT["q"], p)
    assert torch.equal(dropped != 0, kept.bool())
    assert torch.all(dropped[dropped != 0] == 1 / (1 - p))  # kept elements scaled by 1 / (1 - p)
    _within(dropped.mean().item() * (1 - p), 1 - p, n, "mean of the dropped-out ones, times 1 - p")


def test_edge_probabilities():
    seed = D.seed("cpu")
    assert D.keep(seed, D.SALT["up"], (7, 9), 0.0).all()
    assert not D.keep(seed, D.SALT["up"], (7, 9), 1.0).any()
    assert D.scale(1.0) == 0.0 and D.apply(torch.ones(3, 4), seed, 1, 1.0).abs().sum() == 0
    assert abs(D.threshold(0.05) / 2**24 - 0.05) <= 2**-25


def test_streams_are_independent():
    # every pair of the seven projections' streams of one seed, and one projection's stream
    # under two successive seeds (two layers, or two steps), keep an element together as often
    # as independent draws would, (1 - p)^2
    n = SHAPE[0] * SHAPE[1]
    p = 0.3  # a large p makes dependence easy to see
    s1, s2 = D.seed("cpu"), D.seed("cpu")
    masks = {name: _mask(s1, name, p) for name in D.SALT}
    pairs = [(masks[a], masks[b], f"{a}/{b}") for a, b in itertools.combinations(D.SALT, 2)]
    pairs.append((masks["q"], _mask(s2, "q", p), "two seeds"))
    for a, b, what in pairs:
        _within((a * b).mean().item(), (1 - p) ** 2, n, what)
        assert not torch.equal(a, b), what


def test_neighbours_are_independent():
    # an element and its neighbour in the next row, or the next column, or a row further down
    # (rows of one call, rows of the next call's tokens): kept together at (1 - p)^2
    p = 0.3
    kept = _mask(D.seed("cpu"), "down", p)
    for what, a, b in (("next row", kept[:-1], kept[1:]), ("next column", kept[:, :-1], kept[:, 1:]),
                       ("64 rows down", kept[:-64], kept[64:])):
        _within((a * b).mean().item(), (1 - p) ** 2, a.numel(), what)


def test_hash_words_match_the_definition():
    # the torch hash (int64 words, products split in halves) against the plain-int definition
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (4096,), generator=g, dtype=torch.int64)
    words[:4] = torch.tensor([0, 1, 2**31, 2**32 - 1])
    assert D.mix(words).tolist() == [D.mix_word(int(w)) for w in words]
    seed = torch.tensor([-5499732812094645439])
    k_row, k_col = D.keys(seed, 3)
    lo, hi = int(seed) & D.MASK32, (int(seed) >> 32) & D.MASK32
    assert int(k_row) == D.mix_word(lo ^ D.mix_word(hi ^ D.salt_word(3)))
    assert int(k_col) == D.mix_word(int(k_row) ^ D.GOLDEN)


def test_seeds_follow_torch_manual_seed(device):
    torch.manual_seed(3)
    a = [D.seed(device) for _ in range(3)]
    torch.manual_seed(3)
    b = [D.seed(device) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert len({int(x) for x in a}) == 3  # successive calls draw fresh seeds
    # (the device's type: a CUDA draw lands on cuda:0, which is not equal to torch.device("cuda"))
    assert all(x.device.type == torch.device(device).type and x.dtype == torch.int64 and x.shape == (1,) for x in a)


# ---------------------------------------------------------------- under torch.compile: the op layer
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_through_the_ops(backend, device):
    # the route torch.compile takes (forge.ops.library's ops, the seed an int64 input of the
    # forward op): the eager call's outputs and gradients, and every op passes opcheck
    import importlib
    import unittest.mock

    from torch.utils._python_dispatch import TorchDispatchMode

    for mod in ("forge_triton._ops", "bridge.core"):
        importlib.import_module(mod)
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "forge":
                calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    case = with_dropout(mlp_case(ONE_ROW["mlp"], 8, "silu", F32, device), MLP_DROP, device)
    fn = ops.get("lora_mlp", backend)
    res = []
    for routed in (False, True):
        leaves = {n: t.clone().requires_grad_(n in case["diff"]) for n, t in case["tensors"].items()}
        with unittest.mock.patch("forge_triton._ops._compiling", lambda: routed), \
                unittest.mock.patch("bridge.core._through_ops", lambda: routed), Record():
            y = fn(**leaves, **case["kwargs"])
            y.square().sum().backward()
        res.append([y.detach()] + [leaves[n].grad for n in case["diff"]])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    seen = {}
    for func, args, kwargs in calls:
        seen.setdefault(func.name(), (func, args, kwargs))
    assert any(name.endswith("lora_mlp_fwd") for name in seen), sorted(seen)
    from forge.ops import library

    def fresh(a, grad):  # detached copies; float ones require grad for an op with a backward
        if isinstance(a, torch.Tensor):
            t = a.detach().clone()
            return t.requires_grad_() if grad and t.is_floating_point() else t
        return type(a)(fresh(x, grad) for x in a) if isinstance(a, list | tuple) else a

    for name, (func, args, kwargs) in seen.items():
        grad = library.has_autograd(name)
        torch.library.opcheck(func, fresh(args, grad), {k: fresh(v, grad) for k, v in kwargs.items()})


# ---------------------------------------------------------------- the MLP recomputing g and u
def _mlp_reference_any(*a, recompute=False, **k):  # (recompute: where the kernel keeps what, not what it computes)
    return mlp_spec.reference(*a, **k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dropout", [False, True])
def test_lora_mlp_recompute(backend, dropout, device):
    # recompute=True (forge.patch(recompute_mlp=True)): the kernel keeps x, not the (M, I) gate and
    # up outputs, and makes them again in backward: the oracle's rule, and the same numbers as
    # without it (the same products and kernels, run again), with dropout's masks drawn again
    cpu = device.type == "cpu"
    shape, dtype = (MLP_CPU["odd"], F32) if cpu else (MLP_GPU["qwen05b"], torch.bfloat16)
    case = mlp_case(shape, 16, "silu", dtype, device)
    if dropout:
        with_dropout(case, MLP_DROP, device)
    case["kwargs"]["recompute"] = True
    _check("lora_mlp", backend, _mlp_reference_any, case)
    res, wide = {}, {}
    m, inter = case["tensors"]["x"].numel() // shape[1], shape[2]
    for rc in (False, True):
        leaves = {n: t.detach().clone().requires_grad_(n in case["diff"]) for n, t in case["tensors"].items()}
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            y = ops.get("lora_mlp", backend)(**leaves, **{**case["kwargs"], "recompute": rc})
        wide[rc] = saved.count((m, inter))  # the (M, I) activations kept for the backward
        y.backward(torch.ones_like(y))
        res[rc] = [y.detach()] + [leaves[n].grad for n in case["diff"]]
    assert wide == {False: 2, True: 0}, wide
    for name, a, b in zip(["y", *case["diff"]], res[False], res[True]):
        assert torch.equal(a, b), f"{backend} {name}: recompute changed the result"
