"""The MoE expert block (forge.spec.experts) per backend against the float64 oracle, values and
every gradient (hidden, top_k_weights, gate_up_proj, down_proj), at the shapes a grouped kernel
finds awkward: top-1 and top-k = E, a single token, experts with no tokens, fewer rows than
experts, one expert taking every row (several row tiles), ids outside [0, E) (skipped),
non-contiguous inputs; gradcheck in float64; and the backends against each other. The gpu cases
run the real shapes."""
from __future__ import annotations

import pytest
import torch

from forge import ops
from forge.errors import BackendUnavailableError
from forge.spec import experts as X
from forge.spec import tolerance
from oracle import check_op

BACKENDS = list(ops.BACKENDS)
DIFF = ("hidden", "top_k_weights", "gate_up_proj", "down_proj")


def _experts(backend):
    """The backend's experts op, or a skip with the registry's reason (a backend without the
    pieces yet, or one that cannot run here)."""
    try:
        return ops.get("experts", backend)
    except BackendUnavailableError as e:
        pytest.skip(str(e))


def _ref(**kw):
    # the oracle moves every tensor to float64: the ids go back to integers
    return X.reference(**{**kw, "top_k_index": kw["top_k_index"].long()})


def _case(t, h, i, e, k, *, dtype=torch.float32, device="cpu", ids=None, seed=0, scale=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if ids is None:  # distinct experts per token, as a top-k router picks them
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    scale = scale or h ** -0.5
    tensors = {
        "hidden": torch.randn(t, h, generator=g),
        "top_k_index": ids,
        "top_k_weights": torch.rand(t, k, generator=g),
        "gate_up_proj": torch.randn(e, 2 * i, h, generator=g) * scale,
        "down_proj": torch.randn(e, h, i, generator=g) * i ** -0.5,
    }
    return {n: v.to(device, v.dtype if n == "top_k_index" else dtype) for n, v in tensors.items()}


def _one_expert(t, e):
    ids = torch.full((t, 1), 2)
    ids[0, 0] = e  # transformers' sentinel id: skipped
    return ids


CPU_CASES = {
    "t7_e5_k2": dict(t=7, h=24, i=20, e=5, k=2),
    "top1": dict(t=6, h=16, i=12, e=4, k=1),
    "one_token_topk_all": dict(t=1, h=24, i=20, e=8, k=8),
    "empty_and_sentinel": dict(t=4, h=16, i=12, e=8, k=2,
                               ids=torch.tensor([[0, 1], [1, 8], [0, -1], [1, 0]])),
    "one_expert_many_tiles": dict(t=37, h=16, i=12, e=4, k=1, ids=_one_expert(37, 4)),
    # fewer rows than experts (a decoding step's shape): the launch has row slots for the rows,
    # not the experts; experts without rows before, between and after those with them
    "few_rows_many_experts": dict(t=3, h=16, i=12, e=16, k=2, ids=torch.tensor([[15, 0], [7, 3], [0, 9]])),
}


# every case in fp32; bf16 on one (the interpreter's time; the gpu cases are bf16)
CPU_PARAMS = [pytest.param(c, torch.float32, id=n) for n, c in CPU_CASES.items()] + [
    pytest.param(CPU_CASES["t7_e5_k2"], torch.bfloat16, id="t7_e5_k2-bf16")]


@pytest.mark.parametrize("case, dtype", CPU_PARAMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_oracle(backend, case, dtype):
    fn = _experts(backend)
    tensors = _case(**case, dtype=dtype)
    check_op(fn, _ref, tensors, diff=DIFF, reductions=X.reductions(*tensors.values()))


def test_experts_noncontiguous_inputs():
    fn = _experts("triton")
    tensors = _case(t=5, h=16, i=12, e=3, k=2, seed=4)
    wide = torch.zeros(5, 32)
    wide[:, ::2] = tensors["hidden"]
    tensors["hidden"] = wide[:, ::2]
    # expert weights stored transposed (E, H, 2I) and viewed as (E, 2I, H): strided rows
    tensors["gate_up_proj"] = tensors["gate_up_proj"].transpose(1, 2).contiguous().transpose(1, 2)
    tensors["top_k_weights"] = tensors["top_k_weights"].t().contiguous().t()
    check_op(fn, _ref, tensors, diff=DIFF, reductions=X.reductions(*tensors.values()))


def test_experts_gradcheck():
    fn = _experts("triton")
    tensors = _case(t=3, h=5, i=3, e=3, k=2, dtype=torch.float64, seed=5)
    idx = tensors.pop("top_k_index")
    leaves = [tensors[n].requires_grad_() for n in DIFF]
    assert torch.autograd.gradcheck(lambda x, w, gu, dn: fn(x, idx, w, gu, dn), leaves, fast_mode=True)


def test_experts_no_grad_path_matches_node():
    """Inference (no node built) computes what the autograd node computes."""
    fn = _experts("triton")
    tensors = _case(t=5, h=16, i=12, e=4, k=2, seed=6)
    with torch.no_grad():
        bare = fn(**tensors)
    leaves = {n: (v.clone().requires_grad_() if n in DIFF else v) for n, v in tensors.items()}
    torch.testing.assert_close(fn(**leaves).detach(), bare, rtol=0, atol=0)


def test_experts_checks_before_any_kernel():
    fn = _experts("triton")
    tensors = _case(t=4, h=16, i=12, e=4, k=2)
    tensors["top_k_weights"] = tensors["top_k_weights"][:, :1]
    with pytest.raises(ValueError, match="top_k_index"):
        fn(**tensors)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="one backend registered: nothing to agree with")
def test_experts_backends_agree():
    fns = [_experts(b) for b in BACKENDS]
    tensors = _case(t=6, h=24, i=20, e=4, k=2, seed=7)
    res = []
    dout = torch.randn(6, 24)
    for fn in fns:
        leaves = {n: (v.clone().requires_grad_() if n in DIFF else v) for n, v in tensors.items()}
        out = fn(**leaves)
        out.backward(dout)
        res.append([out.detach()] + [leaves[n].grad for n in DIFF])
    red = X.reductions(*tensors.values())
    for name, a, b in zip(("out",) + DIFF, *res):
        tol = 2 * tolerance.atol(torch.float32, red.get(name, 1))
        assert tolerance.rel_err(a, b) <= tol, name


# ---------------------------------------------- low-rank adapters on the weights (peft's LoRA)
# The adapters' terms join the weights' grouped products (forge/ops/experts.py, ``low=`` of the
# pieces): at the shapes above (one token, empty experts and sentinel ids, a group over several
# row tiles) against the float64 reference on the adapted weights W + s B A, every gradient
# (the adapters', the weights', hidden's and the scores').
LORA_SCALES = (2.0, 0.5)
LORA_DIFF = DIFF + ("a_gu", "b_gu", "a_dn", "b_dn")


def _with_adapters(tensors, r=3, seed=11):
    e, two_i, h = tensors["gate_up_proj"].shape
    i = two_i // 2
    g = torch.Generator(device="cpu").manual_seed(seed)
    ad = {"a_gu": torch.randn(e, r, h, generator=g) * h ** -0.5, "b_gu": torch.randn(e, two_i, r, generator=g),
          "a_dn": torch.randn(e, r, i, generator=g) * i ** -0.5, "b_dn": torch.randn(e, h, r, generator=g)}
    return {**tensors, **{n: v.to(tensors["hidden"].dtype) for n, v in ad.items()}}


def _lora(fn):
    def run(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, a_gu, b_gu, a_dn, b_dn):
        return fn(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj,
                  adapters=((a_gu, b_gu, LORA_SCALES[0]), (a_dn, b_dn, LORA_SCALES[1])))
    return run


def _lora_ref(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, a_gu, b_gu, a_dn, b_dn):
    return _ref(hidden=hidden, top_k_index=top_k_index, top_k_weights=top_k_weights,
                gate_up_proj=torch.baddbmm(gate_up_proj, b_gu, a_gu, alpha=LORA_SCALES[0]),
                down_proj=torch.baddbmm(down_proj, b_dn, a_dn, alpha=LORA_SCALES[1]))


def _lora_reductions(tensors):
    """The spec's reduction lengths, and the adapters': an adapter's gradient sums over its
    expert's rows and over the width its rank-r factor contracted (d A_gu: dgu B over 2I; d B_gu:
    x A^T over H; likewise for down), as does the hidden gradient's extra term (over the rank)."""
    red = X.reductions(*list(tensors.values())[:5])
    h, i, r = tensors["hidden"].shape[1], tensors["down_proj"].shape[2], tensors["a_gu"].shape[1]
    red.update(a_gu=red["gate_up_proj"] * 2 * i, b_gu=red["gate_up_proj"] * h, a_dn=red["down_proj"] * h,
               b_dn=red["down_proj"] * i, hidden=red["hidden"] + r, out=red["out"] + r)
    return red


# (Pallas: two awkward shapes only, for the interpreter's time; Triton: every case)
@pytest.mark.parametrize("backend, case", [pytest.param(b, c, id=f"{b}-{n}") for b in BACKENDS
                                           for n, c in CPU_CASES.items()
                                           if b == "triton" or n in ("one_token_topk_all", "empty_and_sentinel")])
def test_expert_adapters_oracle(backend, case):
    fn = _experts(backend)
    tensors = _with_adapters(_case(**case))
    check_op(_lora(fn), _lora_ref, tensors, diff=LORA_DIFF, reductions=_lora_reductions(tensors))


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_adapters_wider_rank_than_a_k_step(backend):
    # rank 40: more than the Pallas interpreter's K step (32), so its low-rank loop takes two
    # steps, the second partly masked; one step of Triton's (64), masked past the rank
    fn = _experts(backend)
    tensors = _with_adapters(_case(**CPU_CASES["t7_e5_k2"]), r=40)
    check_op(_lora(fn), _lora_ref, tensors, diff=LORA_DIFF, reductions=_lora_reductions(tensors))


ROUTE_CASES = {  # (tokens, top-k, experts): decoding steps, the kernel's widest case and one past it
    "decode1_e64": (1, 8, 64), "decode8_e128": (8, 8, 128), "rows256_e128": (32, 8, 128),
    "rows257_torch": (257, 1, 4), "top1_e1": (3, 1, 1), "odd_e7": (17, 3, 7)}


def _route_matches_torch(backend, device):
    """The op layer's routing with the backend's ``route`` piece (up to ROUTE_ROWS rows; torch's
    past that) equals torch's route (forge.spec.experts.route) bit for bit, ids outside [0, E)
    included: E itself (transformers' sentinel), negatives, and an int64 id whose low 32 bits
    name a real expert."""
    from forge.ops import experts as OX

    try:
        pieces = OX.ExpertsOps(**ops._piece(backend, "experts_pieces")())
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    assert pieces.route is not X.route  # (the backend's own piece is what runs below 257 rows)
    g = torch.Generator().manual_seed(0)
    for name, (t, k, e) in ROUTE_CASES.items():
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if e >= k else \
            torch.randint(0, e, (t, k), generator=g)
        ids[0, 0] = e
        if t > 2:
            ids[1, -1], ids[2, 0] = -3, 2 ** 40 + 1
        for dtype in (torch.int64, torch.int32):
            if dtype == torch.int32:
                ids = ids.clamp(-3, e + 1)
            got = OX.route(pieces, ids.to(device, dtype), e)
            want = X.route(ids.to(device, dtype), e)
            for part, a, b in zip(("row_token", "offsets", "slot_rows"), got, want):
                assert a.dtype == b.dtype and torch.equal(a, b), (name, dtype, part, a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_route_piece_matches_torch_route(backend):
    _route_matches_torch(backend, "cpu")


TOP_K_CASES = {  # (tokens, experts, top-k): decoding steps of the three architectures, odd sizes
    "olmoe_decode1": (1, 64, 8), "qwen3_decode8": (8, 128, 8), "mixtral_decode4": (4, 8, 2),
    "rows256": (256, 64, 8), "odd_e7_k3": (19, 7, 3), "top1": (5, 16, 1), "k_all": (3, 4, 4)}


def _distinct_logits(t, e, g):
    # every row a permutation of distinct values (exact in bf16): torch's choice is unique
    base = torch.linspace(-4.0, 4.0, e).to(torch.bfloat16).float()
    return torch.stack([base[torch.randperm(e, generator=g)] for _ in range(t)])


def _top_k_matches_torch(backend, device):
    """The op layer's top-k with the backend's piece (up to TOP_K_ROWS tokens) against the router's
    torch code (forge.spec.experts.top_k): the same experts in the same order and the scores
    within fp32 rounding, with and without renormalisation, in bf16, fp16 and fp32; with equal
    logits, the same chosen values, equal ones in expert order."""
    from forge.ops import experts as OX

    try:
        pieces = OX.ExpertsOps(**ops._piece(backend, "experts_pieces")())
    except BackendUnavailableError as e:
        pytest.skip(str(e))
    assert pieces.top_k is not X.top_k
    g = torch.Generator().manual_seed(0)
    for name, (t, e, k) in TOP_K_CASES.items():
        logits = _distinct_logits(t, e, g)
        # (each dtype and both renormalisations, four pairs: the Pallas interpreter compiles each)
        for dtype, renorm in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False),
                              (torch.float16, True)):
            x = logits.to(device, dtype)
            scores, index = OX.top_k(pieces, x, k, renorm)
            want_s, want_i = X.top_k(x, k, renorm)
            assert index.dtype == torch.int64 and scores.dtype == torch.float32, (name, index.dtype)
            assert torch.equal(index, want_i), (name, dtype, renorm, index, want_i)
            torch.testing.assert_close(scores, want_s, rtol=4e-6, atol=1e-7, msg=(name, dtype, renorm))
            if dtype != torch.float32 and renorm:
                # the scores stored in the logits' dtype (what olmoe's and qwen3_moe's routers
                # return): one rounding each side, at most one unit in the last place apart
                got_s = OX.top_k(pieces, x, k, True, dtype)[0]
                assert got_s.dtype == dtype
                torch.testing.assert_close(got_s, X.top_k(x, k, True, dtype)[0],
                                           rtol=2 * tolerance.UNIT_ROUNDOFF[dtype], atol=1e-7)
    # ties: rows of few distinct values; the chosen logits equal torch's, equal ones by expert id
    x = torch.randint(0, 3, (32, 64), generator=g).float().to(device)
    scores, index = OX.top_k(pieces, x, 8, True)
    want_s, want_i = X.top_k(x, 8, True)
    assert torch.equal(x.gather(1, index), x.gather(1, want_i))
    torch.testing.assert_close(scores, want_s, rtol=4e-6, atol=1e-7)
    same = x.gather(1, index)[:, 1:] == x.gather(1, index)[:, :-1]
    assert bool((index[:, 1:] > index[:, :-1])[same].all())
    # a row with NaN logits (a broken model) still names k distinct experts in range: no expert id
    # the expert kernel would read out of bounds
    x[3, 5], x[4] = float("nan"), float("nan")
    index = OX.top_k(pieces, x, 8, True)[1]
    assert bool(((index >= 0) & (index < 64)).all())
    assert all(len(set(row.tolist())) == 8 for row in index)
    # past the piece's rows, or float64: torch's code, and bad arguments fail before any launch
    big = _distinct_logits(X.TOP_K_ROWS + 1, 16, g).to(device)
    assert torch.equal(OX.top_k(pieces, big, 2, False)[1], X.top_k(big, 2, False)[1])
    with pytest.raises(ValueError, match="k=9"):
        OX.top_k(pieces, x[:, :8], 9, False)
    with pytest.raises(ValueError, match="2-D"):
        OX.top_k(pieces, x[0], 2, False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_piece_matches_torch_router(backend):
    _top_k_matches_torch(backend, "cpu")


GPU_SHAPES = {  # (tokens, hidden, moe intermediate, experts, top-k)
    "qwen3_30b_a3b_4x1024": (4096, 2048, 768, 128, 8),
    "olmoe_1b_7b_4x1024": (4096, 2048, 1024, 64, 8),
    "qwen3_30b_a3b_decode8": (8, 2048, 768, 128, 8),
}


# bf16 at every shape; fp32 at one (its tiles take a K step half as deep, so the stages fit
# the shared memory: compiled only here)
GPU_PARAMS = [pytest.param(s, torch.bfloat16, id=n) for n, s in GPU_SHAPES.items()] + [
    pytest.param(GPU_SHAPES["qwen3_30b_a3b_4x1024"], torch.float32, id="qwen3_30b_a3b_4x1024-fp32")]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype", GPU_PARAMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_oracle_gpu(backend, shape, dtype, device):
    fn = _experts(backend)
    t, h, i, e, k = shape
    tensors = _case(t, h, i, e, k, dtype=dtype, device=device)
    check_op(fn, _ref, tensors, diff=DIFF, reductions=X.reductions(*tensors.values()))


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [16, 128], ids=["r16", "r128"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_adapters_oracle_gpu(backend, rank, device):
    # the compiled low-rank loop at OLMoE's expert shape (fewer experts, the same tiles): rank 16
    # in one K step, rank 128 over several (wider than either backend's bf16 K step)
    fn = _experts(backend)
    tensors = _case(1024, 2048, 1024, 8, 2, dtype=torch.bfloat16)
    tensors = {n: v.to(device) for n, v in _with_adapters(tensors, r=rank).items()}
    check_op(_lora(fn), _lora_ref, tensors, diff=LORA_DIFF, reductions=_lora_reductions(tensors))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_route_piece_matches_torch_route_gpu(backend, device):
    _route_matches_torch(backend, device)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_piece_matches_torch_router_gpu(backend, device):
    _top_k_matches_torch(backend, device)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_step_without_host_sync(backend, device):
    # routing, every piece and the backward stay on the device (torch raises at a synchronizing
    # call in "error" mode): what lets a step or a decode token be captured in a CUDA graph
    fn = _experts(backend)
    t, h, i, e, k = GPU_SHAPES["qwen3_30b_a3b_4x1024"]
    tensors = _case(t, h, i, e, k, dtype=torch.bfloat16, device=device)
    leaves = {n: (v.requires_grad_() if n in DIFF else v) for n, v in tensors.items()}

    def step():
        fn(**leaves).float().sum().backward()

    step()  # compile, warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(leaves[n].grad).all() for n in DIFF)
