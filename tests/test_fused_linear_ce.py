"""Fused linear cross-entropy: both backends against the float64 reference (tests/oracle.py) and
against each other, plus the contract points the oracle cannot see: all-ignored batches, tied
and frozen weights, a finite-difference derivative check, argument errors, no host sync.

On CPU: 13 tokens x 32 hidden x vocab 1000 with 256-column tiles, so there are several tiles and
a ragged last one (1000 = 3 x 256 + 232). Under ``-m gpu``: the real vocabularies with the
default (memory-budget) tile width.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from forge import _runtime, ops
from forge.spec import fused_linear_ce as spec
from forge.spec import tolerance
from oracle import check_op

BACKENDS = list(ops.BACKENDS)  # from the registry (forge.ops.BACKENDS_TABLE)
# every backend with each strategy: vocabulary tiles, and row chunks (CPU 4 rows -> 4 chunks of
# 13 rows, the last ragged; GPU 128 rows) forced where the default would pick the tiles
VARIANTS = ["triton", "triton-rows", "pallas", "pallas-rows", "pallas-rows-native"]
ROWS = {"cpu": 4, "gpu": 128}
DTYPES = [torch.float32, torch.bfloat16]
TILE = 256  # CPU tile width: 1000 columns -> 4 tiles, the last ragged
CPU_SHAPE = (13, 32, 1000)
GPU_SHAPES = {"qwen05b_vocab": (512, 896, 151936), "llama3_vocab": (67, 4096, 128256)}

# name -> (kernel/reference kwargs, bias?, fraction of labels ignored)
CASES = {
    "plain": ({}, False, 0.25),
    "softcap_bias": ({"softcap": 2.0}, True, 0.25),
    "smooth_zloss_sum": ({"label_smoothing": 0.1, "z_loss": 1e-3, "reduction": "sum"}, False, 0.1),
    "num_items": ({"num_items_in_batch": torch.tensor(40)}, False, 0.25),
}


def _natively(fn):
    """``fn`` with the Pallas loss's row chunks natively launched (bridge.fused_linear_ce.NATIVE_ROWS
    on): on a CPU its plans run with each pallas_call evaluated by JAX (on a GPU the default
    launch is native already)."""
    import bridge.fused_linear_ce as bf
    from bridge import native

    def call(*a, **k):
        old, bf.NATIVE_ROWS = bf.NATIVE_ROWS, True
        try:
            if native.launcher() == "jax" or native.available()[0]:
                return fn(*a, **k)
            return _jax_launched(fn, *a, **k)
        finally:
            bf.NATIVE_ROWS = old
    return call


def _jax_launched(fn, *a, **k):
    from bridge import native

    native.set_launcher("jax")
    try:
        out = fn(*a, **k)
        st = native.status()
        # the chunks' kernels ran as plans (none without rows; float64 stays on the jitted
        # function, as the derivative check's loss does)
        planned = a[0].shape[0] and a[0].dtype != torch.float64
        assert (st["plans"] >= 1 or not planned) and not st["declined"], st
        return out
    finally:
        native.set_launcher(None)


def _kernel(variant, tile=TILE, rows=None):
    """The variant's loss; ``tile`` a CPU-sized vocabulary tile (None: real shapes, the default
    sizing), for "<backend>-rows" a row chunk instead (``rows``, else ROWS by shape kind);
    "pallas-rows-native": the row chunks' Pallas kernels launched natively (torch's products
    around them)."""
    if variant.endswith("-native"):
        return _natively(_kernel(variant.removesuffix("-native"), tile, rows))
    if variant.endswith("-rows"):
        rows = rows or ROWS["cpu" if tile else "gpu"]
        return functools.partial(ops.get("fused_linear_ce", variant[:-5]), chunk_rows=rows)
    fn = ops.get("fused_linear_ce", variant)
    return functools.partial(fn, tile_vocab=tile) if tile else fn


def _inputs(n, h, v, dtype, device, bias=False, ignored=0.25):
    hidden = torch.randn(n, h, device=device).to(dtype)
    weight = (torch.randn(v, h, device=device) * h**-0.5 * 2).to(dtype)  # logits ~ N(0, 4)
    labels = torch.randint(0, v, (n,), device=device)
    labels[torch.rand(n, device=device) < ignored] = -100
    labels[:1] = v - 1  # the last (ragged) tile holds a target
    t = {"hidden": hidden, "weight": weight}
    if bias:
        t["bias"] = (torch.randn(v, device=device) * 0.5).to(dtype)
    return t, labels


def _with_labels(fn, labels):
    """check_op casts tensor inputs to float64: labels travel in the closure instead."""
    def call(hidden, weight, bias=None, **kw):
        return fn(hidden, weight, labels.to(hidden.device), bias, **kw)
    return call


def _shapes():
    return [pytest.param(CPU_SHAPE, TILE, id="cpu")] + [
        pytest.param(s, None, id=k, marks=pytest.mark.gpu) for k, s in GPU_SHAPES.items()]


@pytest.mark.parametrize("backend", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape,tile", _shapes())
def test_against_reference(backend, dtype, case, shape, tile, device):
    kwargs, bias, ignored = CASES[case]
    tensors, labels = _inputs(*shape, dtype, device, bias, ignored)
    check_op(_with_labels(_kernel(backend, tile), labels), _with_labels(spec.reference, labels), tensors,
             diff=tuple(tensors), kwargs=kwargs, out_names=["loss"],
             reductions=spec.reductions(tensors["hidden"], tensors["weight"]))


@pytest.mark.parametrize("backend", VARIANTS)
@pytest.mark.parametrize("case", ["plain", "smooth_zloss_sum"])
@pytest.mark.parametrize("offset", [300.0, 3000.0])
def test_large_logits(backend, case, offset, device):
    # fp32 logits around ``offset``: the probabilities and the loss are formed from the row's max
    # and log sum-exp kept apart, so they keep fp32's precision (formed from lse = m + log s,
    # they carried lse's rounding, relative to |lse|: 1e-3 to 1e-1 off at 3000, 17-240x the bound)
    kwargs, bias, ignored = CASES[case]
    tensors, labels = _inputs(*CPU_SHAPE, torch.float32, device, bias, ignored)
    tensors["hidden"][:, 0] = 1.0
    tensors["weight"][:, 0] = offset  # every logit = offset + N(0, 4)
    check_op(_with_labels(_kernel(backend), labels), _with_labels(spec.reference, labels), tensors,
             diff=tuple(tensors), kwargs=kwargs, out_names=["loss"],
             reductions=spec.reductions(tensors["hidden"], tensors["weight"]))


def _eager_lm_head(hidden, weight, labels, bias=None, *, reduction="mean", label_smoothing=0.0, z_loss=0.0):
    """The loss a model computes without forge: lm_head's logits in the input dtype, the loss over
    them upcast to fp32 (transformers' ForCausalLMLoss), so dL/dz is rounded to that dtype."""
    z = F.linear(hidden, weight, bias).float()
    valid = labels != -100
    ce = F.cross_entropy(z, labels, ignore_index=-100, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        ce = ce + z_loss * torch.logsumexp(z, -1).square() * valid
    return ce.sum() / (valid.sum() if reduction == "mean" else 1)


def _grads(fn, tensors, labels, dtype, kwargs):
    leaves = {k: t.detach().to(dtype).requires_grad_() for k, t in tensors.items()}
    fn(leaves["hidden"], leaves["weight"], labels, leaves.get("bias"), **kwargs).backward()
    return {k: t.grad for k, t in leaves.items()}


@pytest.mark.parametrize("backend", VARIANTS)
@pytest.mark.parametrize("case", ["plain", "smooth_zloss_sum"])
@pytest.mark.parametrize("shape,tile", _shapes())
def test_float16(backend, case, shape, tile, device):
    # float16 forms the gradients in the backward, the cotangent in every row's weight before
    # dL/dz is rounded to fp16 (forge.ops.precomputed.DeferredGradLoss); a backward may run twice.
    # At a real vocabulary, without a loss scaler, dL/dz = p / divisor lies below fp16's range for
    # most columns (p ~ 1e-6 at 150k columns, a divisor of hundreds), so the oracle's gradient
    # bound, an fp32 computation's error, is out of reach there (seen on an H200: grad_h 4.3e-2
    # against 5.6e-3 at 512 x 896 x 151936); a model without forge loses the same (its lm_head's
    # logits are fp16). There: the loss against the oracle, the gradients within twice that
    # model's error. (With a loss scaler they reach the oracle's: test_autocast.py's fp16 case.)
    kwargs, bias, ignored = CASES[case]
    tensors, labels = _inputs(*shape, torch.float16, device, bias, ignored)
    check_op(_with_labels(_kernel(backend, tile), labels), _with_labels(spec.reference, labels), tensors,
             diff=tuple(tensors), kwargs=kwargs, out_names=["loss"], backward=tile is not None,
             reductions=spec.reductions(tensors["hidden"], tensors["weight"]))
    ref = _grads(spec.reference, tensors, labels, torch.float64, kwargs)
    eager = _grads(_eager_lm_head, tensors, labels, torch.float16, kwargs)
    got = _grads(_kernel(backend, tile), tensors, labels, torch.float16, kwargs)
    for k in ref:
        err, bound = tolerance.rel_err(got[k], ref[k]), 2 * tolerance.rel_err(eager[k], ref[k])
        assert err <= bound, f"grad {k}: rel err {err:.3e} > twice eager's fp16 lm_head {bound:.3e}"
    h, w = (tensors[k].clone().requires_grad_() for k in ("hidden", "weight"))
    loss = _kernel(backend, tile)(h, w, labels, **kwargs)
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * first, rtol=2e-3, atol=0)


def test_float16_under_compile_runs_the_spec_loss(monkeypatch):
    # the op pair forms the gradients in the forward, which fp16 cannot hold: under torch.compile
    # (the op route) a float16 loss is the spec's torch code, fp32 logits
    import forge.ops._nodes as nodes

    monkeypatch.setattr(nodes, "_through_ops", lambda: True)
    tensors, labels = _inputs(*CPU_SHAPE, torch.float16, "cpu")
    got = ops.get("fused_linear_ce", "triton")(tensors["hidden"], tensors["weight"], labels, tile_vocab=TILE)
    assert torch.equal(got, spec.reference(tensors["hidden"], tensors["weight"], labels))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["plain", "softcap_bias"])
@pytest.mark.parametrize("shape,tile", _shapes())
def test_backends_agree(dtype, case, shape, tile, device):
    # both compute fp32 logits and round each gradient once: they may differ by about one
    # rounding plus fp32 accumulation noise (the bound of tests/test_parity.py)
    kwargs, bias, ignored = CASES[case]
    tensors, labels = _inputs(*shape, dtype, device, bias, ignored)
    red = spec.reductions(tensors["hidden"], tensors["weight"])
    res = {}
    for backend in BACKENDS:
        leaves = {k: t.clone().requires_grad_() for k, t in tensors.items()}
        fn = _kernel(backend, tile)
        loss = fn(leaves["hidden"], leaves["weight"], labels, leaves.get("bias"), **kwargs)
        (loss * 0.7).backward()
        res[backend] = {"loss": loss.detach(), **{k: t.grad for k, t in leaves.items()}}
    for name, t in res["triton"].items():
        p = res["pallas"][name]
        assert t.dtype == p.dtype and t.shape == p.shape, name
        err, bound = tolerance.rel_err(p, t), 2 * tolerance.atol(t.dtype, red[name])
        assert err <= bound, f"{name}: triton vs pallas rel err {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("backend", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,tile", _shapes())
@pytest.mark.skipif(_runtime.THROUGH_OPS, reason="reads the eager node's gradient buffers (grad_fn.grads); with "
                    "FORGE_THROUGH_OPS=1 the node is the op's generated one, whose gradients the other tests check")
def test_backward_scales_in_place(backend, dtype, shape, tile, device):
    # both backends go through forge.ops.precomputed: the forward's gradient buffers (on the
    # autograd node) become the .grad tensors, multiplied by grad_output in place with one
    # rounding of the fp32 product (c = 0.37 is not a bf16 number: scaling by a rounded c, not
    # at all, or twice all show); a second backward raises instead of scaling again
    tensors, labels = _inputs(*shape, dtype, device, bias=True)
    x = {k: t.clone().requires_grad_() for k, t in tensors.items()}
    loss = _kernel(backend, tile)(x["hidden"], x["weight"], labels, x["bias"])
    # no reference is kept to them (AccumulateGrad copies a gradient somebody else holds)
    grads = dict(zip(("hidden", "weight", "bias"), loss.grad_fn.grads))
    assert [g.dtype for g in grads.values()] == [torch.float32, dtype, dtype]
    raw = {k: g.clone() for k, g in grads.items()}
    # (grad_h is cast to hidden's dtype: for fp32 the accumulator itself is hidden's grad)
    ptrs = {k: g.data_ptr() for k, g in grads.items() if k != "hidden" or dtype == torch.float32}
    del grads
    c = torch.tensor(0.37, device=device)
    loss.backward(c, retain_graph=True)
    want = {k: (g.to(c.dtype) * c).to(dtype) for k, g in raw.items()}  # (torch's g * c on CUDA rounds c)
    for k, w in want.items():
        assert torch.equal(x[k].grad, w), k
    for k, p in ptrs.items():
        assert x[k].grad.data_ptr() == p, f"{k}.grad is not the forward's buffer"
    with pytest.raises(RuntimeError, match="only once per forward"):
        loss.backward(c)
    assert torch.equal(x["weight"].grad, want["weight"])  # untouched by the second


@pytest.mark.parametrize("backend", VARIANTS)
@pytest.mark.parametrize("reduction,expect", [("mean", "nan"), ("sum", 0.0)])
def test_all_ignored(backend, reduction, expect, device):
    # torch: mean over zero rows is 0/0 = NaN, sum is 0; gradients are exactly zero either way
    tensors, _ = _inputs(*CPU_SHAPE, torch.float32, device)
    labels = torch.full((CPU_SHAPE[0],), -100, device=device)
    h, w = (tensors[k].clone().requires_grad_() for k in ("hidden", "weight"))
    loss = _kernel(backend)(h, w, labels, reduction=reduction)
    want = F.cross_entropy(F.linear(h.detach(), w.detach()), labels, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == ()
    if expect == "nan":
        assert torch.isnan(loss) and torch.isnan(want)
    else:
        assert loss.item() == 0.0 == want.item()
    loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend", VARIANTS)
def test_no_grad_and_zero_items(backend, device):
    # under no_grad only the loss pass runs: the same loss; num_items_in_batch=0 gives HF's
    # sum / 0 (inf here, some labels are valid)
    tensors, labels = _inputs(*CPU_SHAPE, torch.float32, device)
    h, w = (tensors[k].clone().requires_grad_() for k in ("hidden", "weight"))
    fn = _kernel(backend)
    with_grad = fn(h, w, labels)
    with torch.no_grad():
        without = fn(h, w, labels)
        zero = fn(h, w, labels, num_items_in_batch=0)
    # same pass-1 work (XLA may fuse the two programs differently: fp32 summation-order noise)
    assert not without.requires_grad and tolerance.rel_err(without, with_grad) <= 1e-6
    ref = spec.reference(h.detach(), w.detach(), labels, num_items_in_batch=0)
    assert torch.isinf(zero) and torch.isinf(ref)


@pytest.mark.parametrize("backend", VARIANTS)
def test_zero_items_with_valid_labels_backward(backend, device):
    # num_items_in_batch=0 over valid labels: eager's sum / 0 is inf and its gradients are not
    # finite (NaN or inf) on every valid row and every vocabulary row, while ignored rows of
    # grad_h stay exactly 0; a step that silently got zero gradients would skip the update
    tensors, labels = _inputs(*CPU_SHAPE, torch.float32, device)
    assert (labels == -100).any() and (labels != -100).any()
    got = {k: tensors[k].clone().requires_grad_() for k in ("hidden", "weight")}
    ref = {k: tensors[k].clone().requires_grad_() for k in ("hidden", "weight")}
    loss = _kernel(backend)(got["hidden"], got["weight"], labels, num_items_in_batch=0)
    want = spec.reference(ref["hidden"], ref["weight"], labels, num_items_in_batch=0)
    assert torch.isinf(loss) and torch.isinf(want)
    loss.backward()
    want.backward()
    for k in got:
        assert torch.equal(got[k].grad.isfinite(), ref[k].grad.isfinite()), k
    assert not ref["weight"].grad.isfinite().any()
    assert torch.equal(got["hidden"].grad[labels == -100], torch.zeros_like(got["hidden"].grad[labels == -100]))


@pytest.mark.parametrize("backend", VARIANTS)
@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_bias_of_any_strides(backend, layout, device):
    # a (V,) bias that is a strided slice or a broadcast scalar of a leaf: the loss and the
    # gradients of the tensor it is
    tensors, labels = _inputs(*CPU_SHAPE, torch.float32, device)
    v = CPU_SHAPE[2]
    leaf = torch.randn(2 * v if layout == "strided" else 1, device=device) * 0.5

    def run(fn, dtype):
        x = {k: t.detach().to(dtype).requires_grad_() for k, t in (*tensors.items(), ("bias", leaf))}
        b = x["bias"][::2] if layout == "strided" else x["bias"].expand(v)
        assert not b.is_contiguous()
        loss = fn(x["hidden"], x["weight"], labels, b)
        loss.backward()
        return loss, {k: t.grad for k, t in x.items()}

    loss, grads = run(_kernel(backend), torch.float32)
    want, want_g = run(spec.reference, torch.float64)
    eager, eager_g = run(spec.reference, torch.float32)
    tolerance.assert_close("loss", loss, want, eager, torch.float32, v)
    # (a broadcast bias's gradient is a sum over the vocabulary of dL/dz, 0 up to rounding: no
    # relative error to take)
    for k in grads.keys() - ({"bias"} if layout == "expanded" else set()):
        tolerance.assert_close(f"grad {k}", grads[k], want_g[k], eager_g[k], torch.float32, v)


@pytest.mark.parametrize("backend", VARIANTS)
def test_no_rows(backend, device):
    # an empty batch behaves like torch's cross_entropy on (0, V) logits: NaN mean, zero grads
    tensors, _ = _inputs(0, 32, 1000, torch.float32, device)
    labels = torch.zeros(0, dtype=torch.long, device=device)
    h, w = (tensors[k].clone().requires_grad_() for k in ("hidden", "weight"))
    loss = _kernel(backend)(h, w, labels)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(F.linear(h, w), labels))
    loss.backward()
    assert h.grad.shape == (0, 32) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_embedding(backend, dtype, device):
    # lm_head weight is also the input embedding: its gradient sums both uses
    n, h, v = CPU_SHAPE
    tensors, labels = _inputs(n, h, v, dtype, device)
    ids = torch.randint(0, v, (n,), device=device)

    def model(fn):
        def call(weight, noise):
            hidden = F.embedding(ids.to(weight.device), weight) * 3.0 + noise
            return fn(hidden, weight, labels.to(weight.device))
        return call

    noise = torch.randn(n, h, device=device).to(dtype)
    check_op(model(_kernel(backend)), model(spec.reference), {"weight": tensors["weight"], "noise": noise},
             diff=("weight", "noise"), out_names=["loss"],
             reductions={"loss": n + h + v, "weight": n + h + v, "noise": h + v})


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", VARIANTS)
def test_frozen_weight(backend, device):
    tensors, labels = _inputs(*CPU_SHAPE, torch.float32, device)
    h = tensors["hidden"].clone().requires_grad_()
    w = tensors["weight"]  # frozen lm_head
    counter = _CountMatmuls()
    with counter:
        _kernel(backend)(h, w, labels).backward()
    assert w.grad is None and h.grad is not None
    if backend == "triton":  # 4 tiles x (logits, logits again, grad_h), the last tile's logits
        assert counter.count == 3 * 4 - 1  # kept from pass 1; no grad_W
    if backend == "triton-rows":  # 4 chunks x (logits, grad_h)
        assert counter.count == 2 * 4
    check_op(_with_labels(_kernel(backend), labels), _with_labels(spec.reference, labels), tensors,
             diff=("hidden",), out_names=["loss"], reductions=spec.reductions(h, w))


# 13 rows x 1000 columns: tiles of 256 -> 4 tiles, chunks of 4 rows -> 4 chunks. Trainable
# weight, tiles: logits, logits again, grad_h, grad_W per tile, the last tile's logits kept from
# pass 1; chunks: eager's three per chunk (logits, grad_h, grad_W). No gradient wanted: the
# logits once per tile / chunk.
@pytest.mark.parametrize("variant,with_grad,without", [("triton", 4 * 4 - 1, 4), ("triton-rows", 3 * 4, 4)])
def test_triton_matmul_count(variant, with_grad, without, device):
    tensors, labels = _inputs(*CPU_SHAPE, torch.float32, device)
    h, w = (tensors[k].clone().requires_grad_() for k in ("hidden", "weight"))
    counter = _CountMatmuls()
    with counter:
        _kernel(variant)(h, w, labels).backward()
    assert counter.count == with_grad
    counter = _CountMatmuls()
    with counter, torch.no_grad():
        _kernel(variant)(h, w, labels)
    assert counter.count == without


class _Allocations(TorchDispatchMode):
    """(shape, dtype) of every tensor an op returns that is not a view or one of its arguments."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {id(a) for a in (*args, *(kwargs or {}).values())}
        if isinstance(out, torch.Tensor) and not func.is_view and id(out) not in given:
            self.made.append((tuple(out.shape), out.dtype))
        return out


@pytest.mark.parametrize("variant", ["triton", "triton-rows"])
def test_triton_grad_overlays_the_logits(variant, device):
    # bf16: dL/dz is written over the fp32 logits' own bytes in both strategies, so no (rows,
    # tile) buffer is made for it (the vocabulary tiles' width counts on that: LOGITS_FRACTION)
    tensors, labels = _inputs(*CPU_SHAPE, torch.bfloat16, device)
    h, w = (tensors[k].clone().requires_grad_() for k in ("hidden", "weight"))
    allocs = _Allocations()
    with allocs:
        _kernel(variant)(h, w, labels).backward()
    n, _, v = CPU_SHAPE
    wide = [(s, d) for s, d in allocs.made if len(s) == 2 and s[0] in (n, ROWS["cpu"]) and s[1] >= min(TILE, v)]
    assert wide and {d for _, d in wide} == {torch.float32}, wide  # the logits tiles, nothing else


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["plain", "softcap_bias", "smooth_zloss_sum"])
@pytest.mark.parametrize("shape,tile", _shapes())
def test_strategies_agree(backend, dtype, case, shape, tile, device):
    # row chunks against vocabulary tiles: the same fp32 logits and statistics; grad_W differs
    # by its roundings (one per chunk there, one per tile here): within the backends' bound
    kwargs, bias, ignored = CASES[case]
    tensors, labels = _inputs(*shape, dtype, device, bias, ignored)
    red = spec.reductions(tensors["hidden"], tensors["weight"])
    res = {}
    for variant in (backend, f"{backend}-rows"):
        leaves = {k: t.clone().requires_grad_() for k, t in tensors.items()}
        loss = _kernel(variant, tile)(leaves["hidden"], leaves["weight"], labels, leaves.get("bias"), **kwargs)
        loss.backward()
        res[variant] = {"loss": loss.detach(), **{k: t.grad for k, t in leaves.items()}}
    for name, t in res[backend].items():
        r = res[f"{backend}-rows"][name]
        assert t.dtype == r.dtype and t.shape == r.shape, name
        err, bound = tolerance.rel_err(r, t), 2 * tolerance.atol(t.dtype, red[name])
        assert err <= bound, f"{name}: row chunks vs tiles rel err {err:.3e} > {bound:.3e}"


def test_row_chunk_choice(monkeypatch):
    # row chunks by default where gradients are wanted: as many rows as 1 GiB of fp32 logits
    # holds, balanced over the chunks; vocabulary tiles without gradients, or for a vocabulary
    # so wide that a chunk would be under ROW_CHUNK_MIN rows; forced ones as given
    assert spec.row_chunk(16384, 128256) == 2048  # 2**30 / (4 * 128256) = 2093, down to 64s
    assert spec.row_chunk(4096, 151936) == 1408  # 1728-row cap: three chunks of 1366, up to 64s
    assert spec.row_chunk(64, 128256) == 64  # one chunk
    assert spec.row_chunk(16384, 128256, need_grad=False) is None
    assert spec.row_chunk(4096, 300_000) is None  # an 832-row cap: vocabulary tiles
    assert spec.row_chunk(500, 300_000) == 500  # ...unless every row fits one chunk
    assert spec.row_chunk(100, 10, 7) == 7
    monkeypatch.setattr(spec, "ROW_CHUNK_BYTES", 2**29)  # read at the call (it was frozen at import)
    assert spec.row_chunk(16384, 128256) == 1024
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        spec.row_chunk(100, 10, 0)


@pytest.mark.parametrize("backend", VARIANTS)
def test_directional_derivative(backend, device):
    # gradcheck's numerical Jacobian is far too slow in the interpreters; one central difference
    # along a random direction in float64 checks the same thing: <grad, d> = dL(x + t d)/dt
    if backend.startswith("pallas"):
        pytest.importorskip("jax").config.update("jax_enable_x64", True)
    try:
        n, h, v = 5, 8, 37
        tensors, labels = _inputs(n, h, v, torch.float64, device, bias=True, ignored=0.3)
        kw = dict(softcap=3.0, label_smoothing=0.05, z_loss=1e-2)
        fn = _kernel(backend, tile=16, rows=2)
        x = {k: t.clone().requires_grad_() for k, t in tensors.items()}
        fn(x["hidden"], x["weight"], labels, x["bias"], **kw).backward()
        d = {k: torch.randn_like(t) for k, t in tensors.items()}
        eps = 1e-6
        def at(sign):
            p = {k: tensors[k] + sign * eps * d[k] for k in tensors}
            return fn(p["hidden"], p["weight"], labels, p["bias"], **kw)

        plus, minus = at(1.0), at(-1.0)
        numeric = ((plus - minus) / (2 * eps)).item()
        analytic = sum((x[k].grad * d[k]).sum() for k in x).item()
        assert abs(numeric - analytic) <= 1e-6 * (1 + abs(analytic)), (numeric, analytic)
    finally:
        if backend.startswith("pallas"):
            pytest.importorskip("jax").config.update("jax_enable_x64", False)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
@pytest.mark.parametrize("bad,exc,match", [
    ({"hidden": torch.zeros(3, 4, 5)}, ValueError, "hidden must be 2-D"),
    ({"weight": torch.zeros(10, 5)}, ValueError, "weight has width"),
    ({"labels": torch.zeros(4, dtype=torch.long)}, ValueError, "labels must have shape"),
    ({"labels": torch.zeros(3)}, TypeError, "labels must be int64"),
    ({"weight": torch.zeros(10, 4, dtype=torch.float64)}, TypeError, "hidden is torch.float32"),
    ({"bias": torch.zeros(9)}, ValueError, "bias must have shape"),
    ({"reduction": "none"}, ValueError, "reduction must be one of"),
    ({"reduction": "sum", "num_items_in_batch": 3}, ValueError, "num_items_in_batch replaces"),
    ({"num_items_in_batch": -1}, ValueError, "num_items_in_batch must be non-negative"),
    ({"num_items_in_batch": torch.tensor(3, device="meta")}, ValueError, "num_items_in_batch is on meta"),
    ({"softcap": -1.0}, ValueError, "softcap must be"),
    ({"label_smoothing": 1.5}, ValueError, "label_smoothing must be"),
    ({"z_loss": -1.0}, ValueError, "z_loss must be"),
])
def test_argument_errors(backend, bad, exc, match, device):
    _argument_error(backend, bad, exc, match, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_on_another_device(backend, device):
    # both backends name the device before any kernel (Pallas' loss went to DLPack with meta
    # tensors); Pallas compares int32 labels, so an ignore_index beyond int32 is refused by name
    tensors, labels = _inputs(*CPU_SHAPE, torch.float32, device)
    fn = ops.get("fused_linear_ce", backend)
    with pytest.raises(ValueError, match="hidden is on meta"):
        fn(tensors["hidden"].to("meta"), tensors["weight"].to("meta"), labels.to("meta"))
    if backend == "pallas":
        with pytest.raises(ValueError, match="ignore_index must fit in int32"):
            fn(tensors["hidden"], tensors["weight"], labels.clamp(min=0), ignore_index=2**31 + 3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad,exc,match", [
    ({"chunk_rows": 0}, ValueError, "chunk_rows must be a positive int"),
    ({"chunk_rows": 2.0}, ValueError, "chunk_rows must be a positive int"),
    ({"tile_vocab": 256, "chunk_rows": 2}, ValueError, "at most one of tile_vocab"),
])
def test_strategy_errors(backend, bad, exc, match, device):
    _argument_error(backend, bad, exc, match, device)


def _argument_error(backend, bad, exc, match, device):
    args = {"hidden": torch.zeros(3, 4), "weight": torch.zeros(10, 4),
            "labels": torch.zeros(3, dtype=torch.long), "bias": None}
    args.update(bad)
    fn = spec.reference if backend == "reference" else ops.get("fused_linear_ce", backend)
    pos = [args.pop(k).to(device) if isinstance(args.get(k), torch.Tensor) else args.pop(k)
           for k in ("hidden", "weight", "labels", "bias")]
    with pytest.raises(exc, match=match):
        fn(*pos, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", VARIANTS)
def test_no_host_sync(backend, device):
    # forward and backward queue work without reading anything back (torch raises on a sync)
    tensors, labels = _inputs(4096, 896, 151936, torch.bfloat16, device)
    h, w = (tensors[k].clone().requires_grad_() for k in ("hidden", "weight"))
    nib = torch.tensor(3000, device=device)
    _kernel(backend, None)(h, w, labels, num_items_in_batch=nib).backward()  # compile, warm up
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _kernel(backend, None)(h, w, labels, num_items_in_batch=nib).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("package,key", [("forge_triton", "rmsnorm"), ("forge_triton", "fused_linear_ce"),
                                         ("bridge", "fused_linear_ce")])
def test_ops_get_after_a_direct_submodule_import(package, key):
    # a kernel module and the public function may share a name: a direct submodule import binds
    # the module over the lazily loaded name; ops.get must still return a function (for the
    # loss, the op layer's node built from the module's pieces). A fresh interpreter, so the
    # import happens first.
    import subprocess
    import sys

    backend = {"forge_triton": "triton", "bridge": "pallas"}[package]
    code = (f"import {package}.{key}, types\n"
            f"from forge import ops\n"
            f"fn = ops.get({key!r}, {backend!r})\n"
            f"assert callable(fn) and not isinstance(fn, types.ModuleType), fn\n"
            f"assert ops.get({key!r}, {backend!r}) is fn\n")
    if key == "rmsnorm":
        code += f"import {package}; assert {package}.{key} is fn\n"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape,blocks", [
    pytest.param((256, 64, 32), (128, 32, 16), id="full-blocks"),
    pytest.param((200, 48, 21), (128, 32, 16), id="ragged"),
    pytest.param((151936, 896, 1000), None, id="qwen05b-vocab", marks=pytest.mark.gpu),
])
def test_pallas_grad_w_accumulate(dtype, shape, blocks):
    # the Pallas row chunks' in-place grad_W += dz^T h (forge_pallas.fused_linear_ce): with
    # every block full (no masks in the kernel) and with ragged blocks on all three sides,
    # against an fp32 product of the same rounded inputs at full precision
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    from forge_pallas import fused_linear_ce as pk

    v, hd, c = shape
    keys = jax.random.split(jax.random.PRNGKey(c), 3)
    gw, g, h = (jax.random.normal(k, s, jnp.float32).astype(dtype)
                for k, s in zip(keys, ((v, hd), (c, v), (c, hd))))
    want = gw.astype(jnp.float32) + jnp.dot(g.T.astype(jnp.float32), h.astype(jnp.float32),
                                            precision=jax.lax.Precision.HIGHEST)
    out = jax.jit(functools.partial(pk._gw_accumulate, blocks=blocks))(gw, g, h)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (v, hd)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
    # one rounding of each result to the output dtype (bf16: 2^-9 of its size), fp32 sums
    assert err <= (2.0**-8 if dtype == "bfloat16" else 1e-5), err


@pytest.mark.gpu
def test_pallas_row_chunks_cross_no_dlpack(monkeypatch, device):
    # on a GPU, with NATIVE_ROWS on, the Pallas loss's default strategy with gradients (row
    # chunks) runs its kernels natively on torch's stream: neither its jitted function nor any
    # DLPack launch is reached
    import bridge.core
    import bridge.fused_linear_ce as bf

    def refuse(*_a, **_k):
        raise AssertionError("the row chunks reached JAX through DLPack")

    jitted = bridge.core.KernelDef.fwd_fn

    def fwd_fn(kdef, skey):  # (KernelDef has __slots__: its instances take no attribute; patch the class)
        if kdef is bf.FLCE:
            refuse()
        return jitted(kdef, skey)

    monkeypatch.setattr(bridge.core, "_run_fwd_dlpack", refuse)
    monkeypatch.setattr(bridge.core.KernelDef, "fwd_fn", fwd_fn)
    monkeypatch.setattr(bf, "NATIVE_ROWS", True)
    tensors, labels = _inputs(4096, 4096, 128256, torch.bfloat16, device)
    x = {k: t.requires_grad_() for k, t in tensors.items()}
    loss = ops.get("fused_linear_ce", "pallas")(x["hidden"], x["weight"], labels)
    loss.backward()
    assert torch.isfinite(loss) and x["weight"].grad is not None and x["hidden"].grad is not None
