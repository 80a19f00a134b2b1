"""Mixture-of-experts models (qwen3_moe, mixtral, olmoe), tiny and random, patched against
unpatched: loss, logits and every parameter gradient against a float64 copy (the oracle's rule,
tests/oracle.py), the expert modules run by forge's experts kernel, the router's auxiliary loss,
greedy generation, unpatch bit-identical, peft LoRA on the expert weights, and the expert modules
forge declines (a swapped activation) with their reasons. One layer each: the experts kernel is
the costly part in the interpreters."""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import copy  # noqa: E402
import gc  # noqa: E402
import weakref  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import forge  # noqa: E402
from forge import ops  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.errors import BackendUnavailableError  # noqa: E402
from forge.patching import arch as arch_table  # noqa: E402
from forge.patching import experts as experts_patch  # noqa: E402
from forge.spec import tolerance  # noqa: E402
from test_models import assert_model_close, batch, reduction_length, run  # noqa: E402

# per arch on the one-layer tiny model: 2 norms per layer (+2 q/k norms) and the final norm;
# one attention, one expert module, one lm_head; written out so a wrong table entry fails here
TINY_COUNTS = {
    "qwen3_moe": {"rmsnorm": 5, "rope": 1, "experts": 1, "fused_linear_ce": 1},
    "mixtral": {"rmsnorm": 3, "rope": 1, "experts": 1, "fused_linear_ce": 1},
    "olmoe": {"rmsnorm": 5, "rope": 1, "experts": 1, "fused_linear_ce": 1},
}


def need_experts(backend):
    ok, why = ops.availability(backend)
    if not ok:
        pytest.skip(why)
    try:
        ops.get("experts", backend)
    except BackendUnavailableError as e:
        pytest.skip(str(e))


def _model(model_type, **kw):
    return build_model(model_type, num_hidden_layers=1, **kw)


def _patched_against_copy(model, backend, ids, labels, ref_dtype, dtype, experts):
    """Patch ``model`` and hold its training step (loss, logits, every gradient) to eager's and a
    ``ref_dtype`` copy's by the oracle's rule, ``experts`` expert modules patched; the copy runs
    transformers' eager loop over the experts (torch._grouped_mm takes bf16 only). Returns eager's
    (loss, logits, grads)."""
    ref_model = copy.deepcopy(model).to(ref_dtype)
    hf = ref_model.base_model.model if hasattr(ref_model, "peft_config") else ref_model  # (a peft model)
    hf.set_experts_implementation("eager")
    ref = run(ref_model, ids, labels)
    del ref_model
    eager = run(model, ids, labels)
    forge.patch(model, backend=backend, min_elements=0)
    assert model._forge_patched_counts["experts"] == experts, model._forge_skipped
    patched = run(model, ids, labels)
    assert_model_close(patched, eager, ref, dtype, reduction_length(model, ids))
    return eager


@pytest.mark.parametrize("backend", ops.BACKENDS)
@pytest.mark.parametrize("model_type", arch_table.MOE)
def test_moe_model_matches_eager(model_type, backend):
    need_experts(backend)
    model = _model(model_type)
    ids, labels = batch(model, 2, 4, "cpu")
    eager = _patched_against_copy(model, backend, ids, labels, torch.float64, torch.float32, 1)
    assert dict(model._forge_patched_counts) == TINY_COUNTS[model_type], model._forge_skipped
    assert "swiglu" not in model._forge_state.info.skipped or "mixture of experts" in model._forge_skipped["swiglu"]
    assert model._forge_guard_stats.fused("experts") >= 2  # the training step and the logits call
    forge.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, eager[1]), "unpatch did not restore bit-identical logits"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ops.BACKENDS)
@pytest.mark.parametrize("model_type", arch_table.MOE)
def test_moe_model_matches_eager_gpu(model_type, backend):
    """Compiled kernels at real widths (the 0.5B demo shape with 4 layers and each arch's expert
    fields in forge.__main__.MOE_REAL), bf16, 2x256 tokens: loss, logits and every gradient
    against a float32 copy by the oracle's rule, every layer's experts fused, unpatch exact."""
    need_experts(backend)
    model = build_model(model_type, "gpu_demo", dtype=torch.bfloat16, device="cuda")
    ids, labels = batch(model, 2, 256, "cuda")
    eager = _patched_against_copy(model, backend, ids, labels, torch.float32, torch.bfloat16, 4)
    assert model._forge_guard_stats.fused("experts") >= 4
    forge.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, eager[1]), "unpatch did not restore bit-identical logits"


def test_router_aux_loss_unchanged():
    """With output_router_logits the loss includes the load-balancing loss: the patched model
    gives eager's aux_loss and total loss (the fused loss then runs eager's forward)."""
    model = _model("qwen3_moe", router_aux_loss_coef=0.5)
    ids, labels = batch(model, 2, 4, "cpu", seed=1)
    want = model(ids, labels=labels, output_router_logits=True)
    forge.patch(model, backend="triton", min_elements=0)
    got = model(ids, labels=labels, output_router_logits=True)
    assert got.aux_loss is not None and got.router_logits is not None
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=0, atol=0)  # the router is eager's
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert model._forge_guard_stats.fused("experts") == 1


def test_router_logits_in_the_config_decline_the_fused_loss():
    # every training call then needs the model's own forward (the auxiliary loss reads the
    # logits): the fused loss was counted patched and never ran, with nothing said
    model = _model("qwen3_moe", output_router_logits=True)
    forge.patch(model, backend="triton", min_elements=0)
    assert "fused_linear_ce" not in model._forge_patched_counts
    assert "output_router_logits" in model._forge_skipped["fused_linear_ce"]


def test_generate_token_identical():
    """Greedy decoding (prefill, then one token per step: the decode shape of the expert block)
    gives eager's tokens (the patched forward replaces whichever experts implementation the
    config names; here transformers' eager loop)."""
    model = _model("mixtral").eval()
    model.set_experts_implementation("eager")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    forge.patch(model, mode="infer", backend="triton", min_elements=0)
    assert model._forge_patched_counts["experts"] == 1
    got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    assert model._forge_guard_stats.fused("experts") >= 4


@pytest.mark.parametrize("backend", ops.BACKENDS)
@pytest.mark.parametrize("model_type", arch_table.MOE)
def test_routers_choose_as_transformers(model_type, backend, monkeypatch):
    """Each router, patched: a call without gradients takes the backend's top_k piece and returns
    the router's own logits (bit-equal), experts (equal; in bf16, where logits can tie, the same
    chosen logits) and scores (its dtype: bf16 for olmoe's and qwen3_moe's, fp32 for mixtral's,
    within one rounding), renormalised or not as the architecture's router does; a call that
    wants gradients, or one in training mode, runs the router's own forward; unpatch restores it."""
    need_experts(backend)
    model = _model(model_type, num_experts_per_tok=3).eval()
    routers = [m for m in model.modules() if type(m).__name__ in experts_patch.ROUTERS]
    assert routers, [type(m).__name__ for m in model.modules()]
    renorm = getattr(routers[0], "norm_topk_prob", True)
    hidden32 = torch.randn(2, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    real = experts_patch._ops.top_k
    calls = []
    monkeypatch.setattr(experts_patch._ops, "top_k", lambda *a: calls.append(a[2:]) or real(*a))
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        hidden = hidden32.to(dtype)
        with torch.no_grad():
            want = [r(hidden) for r in routers]
        forge.patch(model, backend=backend, min_elements=0)
        calls.clear()
        with torch.no_grad():
            got = [r(hidden) for r in routers]
        assert calls == [(3, renorm, want[0][1].dtype)] * len(routers)
        for (gl, gs, gi), (wl, ws, wi) in zip(got, want):
            assert torch.equal(gl, wl) and gs.dtype == ws.dtype
            if dtype == torch.float32:
                assert torch.equal(gi, wi)
            else:
                assert torch.equal(gl.gather(1, gi), wl.gather(1, wi))
            torch.testing.assert_close(gs, ws, rtol=2 * tolerance.UNIT_ROUNDOFF[gs.dtype], atol=1e-7)
        leaf = hidden.clone().requires_grad_()
        for r, (wl, ws, wi) in zip(routers, want):
            logits, scores, index = r(leaf)  # (wants gradients: the router's own code)
            assert torch.equal(index, wi) and torch.equal(scores, ws)
        assert len(calls) == len(routers)
        model.train()
        with torch.no_grad():  # (reentrant checkpointing's first forward: the choice its recompute makes)
            for r, (wl, ws, wi) in zip(routers, want):
                logits, scores, index = r(hidden)
                assert torch.equal(index, wi) and torch.equal(scores, ws)
        assert len(calls) == len(routers)
        model.eval()
        forge.unpatch(model)
        assert all("forward" not in r.__dict__ for r in routers)


@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_reentrant_checkpointing_with_tied_router_logits(backend):
    """A zero router (every logit tied) under reentrant checkpointing: the forward runs without
    gradients and its recompute with them; both must choose the same experts, so the loss and
    the gradients are eager's (the forward took the backend's top_k piece, which breaks ties by
    the lower expert id, and the recompute torch's topk: here loss 5.58533 against 5.58630)."""
    need_experts(backend)
    model = build_model("qwen3_moe", num_hidden_layers=2, num_experts_per_tok=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    ref = copy.deepcopy(model)
    ids, labels = batch(model, 2, 8, "cpu")
    outs = []
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        m.train()
        if m is model:
            forge.patch(m, backend=backend, min_elements=0)
        loss = m(ids, labels=labels).loss
        loss.backward()
        outs.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (want, wg), (got, gg) = outs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert gg.keys() == wg.keys()
    for n in wg:
        torch.testing.assert_close(gg[n], wg[n], rtol=1e-4, atol=1e-6 * wg[n].abs().max().item(), msg=n)


def _peft_expert_lora(model, targets=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
    """``model`` with peft's LoRA (r=2) on the expert weights ``targets``, B drawn."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=[],
                                                       target_parameters=list(targets)))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():  # B is zero at init: give the adapter an effect
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


BOTH = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.mark.parametrize("backend,targets", [("triton", BOTH), ("pallas", BOTH), ("triton", BOTH[:1])],
                         ids=["triton", "pallas", "triton-gate_up_only"])
def test_peft_lora_on_expert_weights(backend, targets):
    """peft's target_parameters LoRA lives in a parametrization registered around each call: the
    kernel runs on the adapted weights, and the adapters' gradients (every trainable parameter)
    and the loss match eager peft's by the oracle's rule against a float64 copy."""
    need_experts(backend)
    model = _peft_expert_lora(_model("qwen3_moe"), targets)
    ids, labels = batch(model, 2, 4, "cpu", seed=4)
    eager = _patched_against_copy(model, backend, ids, labels, torch.float64, torch.float32, 1)
    assert any("lora_A" in n for n in eager[2]) and all("lora" in n for n in eager[2])
    assert model._forge_guard_stats.fused("experts") >= 2 and model._forge_guard_stats.fallback("experts") == 0
    forge.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, eager[1]), "unpatch did not restore bit-identical logits"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_peft_lora_on_expert_weights_gpu(backend):
    """The same at real widths (forge.__main__'s gpu_demo qwen3_moe, 4 layers), bf16, 2x256
    tokens, against a float32 copy by the oracle's rule."""
    need_experts(backend)
    model = _peft_expert_lora(build_model("qwen3_moe", "gpu_demo", dtype=torch.bfloat16, device="cuda"))
    ids, labels = batch(model, 2, 256, "cuda")
    _patched_against_copy(model, backend, ids, labels, torch.float32, torch.bfloat16, 4)
    assert model._forge_guard_stats.fallback("experts") == 0


def test_peft_expert_lora_never_forms_the_adapted_weight(monkeypatch):
    """forge computes peft's expert LoRA as rank-r products beside the frozen weights: peft's
    parametrization is never evaluated, neither for the forward or the backward nor by its
    registration (forge's forward of peft's wrapper registers none), and the gradients are those of
    the path that reads the adapted weights (peft's parametrization evaluated, forge's kernel on
    its result) within rounding. Through peft's own wrapper forward (its registration's check
    evaluates each folded weight once) the expert modules' forward still reads the factors."""
    from peft.tuners.lora import layer as peft_layer

    made, registered = [], []
    proxy_forward = peft_layer._LoraFactorsProxy.forward
    register = torch.nn.utils.parametrize.register_parametrization

    def tracked(self, w):
        out = proxy_forward(self, w)
        made.append(weakref.ref(out))
        return out

    def counted(*a, **k):
        registered.append(a[1])
        return register(*a, **k)

    monkeypatch.setattr(peft_layer._LoraFactorsProxy, "forward", tracked)
    monkeypatch.setattr(torch.nn.utils.parametrize, "register_parametrization", counted)
    model = _peft_expert_lora(_model("qwen3_moe"))
    ids, labels = batch(model, 2, 4, "cpu", seed=6)

    def step():
        made.clear()
        registered.clear()
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=labels).loss
        gc.collect()
        kept = sum(r() is not None for r in made)
        loss.backward()
        return kept, len(made), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    kept, eager_built, _ = step()
    assert kept >= 1 and len(registered) == 2, "the probe does not see eager peft keep its adapted weights"
    forge.patch(model, backend="triton", min_elements=0)
    kept, built, low_rank = step()
    assert (kept, built, registered) == (0, 0, []), (kept, built, registered)
    assert model._forge_guard_stats.fused("experts") == 1
    monkeypatch.setattr(experts_patch, "_peft_adapters", lambda mod, chain: None)  # peft's own forward
    kept, built, through_peft = step()
    assert kept == 0 and built == eager_built - 2 and len(registered) == 2, (kept, built, eager_built)
    monkeypatch.setattr(experts_patch, "_PEFT_FACTORS", "(none)")  # read the adapted weights instead
    kept, built, merged = step()
    assert built == eager_built and model._forge_guard_stats.fallback("experts") == 0
    assert low_rank.keys() == merged.keys() == through_peft.keys() and low_rank
    for n in merged:
        torch.testing.assert_close(low_rank[n], through_peft[n], rtol=0, atol=0)
        torch.testing.assert_close(low_rank[n], merged[n], rtol=1e-4, atol=1e-6)
    forge.unpatch(model)
    registered.clear()
    model(ids)
    assert len(registered) == 2, "unpatch did not give peft's wrapper its own forward back"


def test_peft_expert_lora_compiles_whole():
    """forge's forward of peft's wrapper (factors read, no parametrization registered) traces
    into one graph under torch.compile (fullgraph, aot_eager on the CPU): the loss and every
    adapter gradient those of the same patched model uncompiled."""
    model = _peft_expert_lora(_model("qwen3_moe"))
    ids, labels = batch(model, 2, 4, "cpu", seed=9)
    forge.patch(model, backend="triton", min_elements=0)
    torch._dynamo.reset()

    def step(fn):  # (the training step alone: one trace)
        model.zero_grad(set_to_none=True)
        loss = fn(ids, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = step(model)
    got = step(torch.compile(model, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert got[1].keys() == want[1].keys() and any("lora_A" in n for n in want[1])
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], rtol=1e-5, atol=1e-7)


def test_peft_expert_lora_disabled_or_merged():
    """Where peft does something else than fold one adapter (adapters disabled, or merged into
    the weights), forge's forward of its wrapper gives way to peft's own: the same logits as
    unpatched peft, with the adapters' effect and without."""
    model = _peft_expert_lora(_model("qwen3_moe"))
    ids = torch.randint(0, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(8))

    def logits():
        with torch.no_grad():
            with model.disable_adapter():
                off = model(ids).logits
            on = model(ids).logits
            model.merge_adapter()
            merged = model(ids).logits
            model.unmerge_adapter()
        return off, on, merged

    want = logits()
    assert not torch.allclose(want[0], want[1], rtol=1e-3, atol=1e-3)
    forge.patch(model, backend="triton", min_elements=0)
    for got, ref in zip(logits(), want):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert model._forge_guard_stats.fused("experts") == 3 and model._forge_guard_stats.fallback("experts") == 0


def test_swapped_activation_is_declined_then_falls_back():
    model = _model("olmoe")
    experts = model.model.layers[0].mlp.experts
    experts.act_fn = torch.nn.GELU()
    forge.patch(model, backend="triton", min_elements=0, kernels=["experts"])
    assert "experts" not in model._forge_patched_counts
    assert "calls GELU, not silu" in model._forge_skipped["experts"]
    forge.unpatch(model)
    experts.act_fn = torch.nn.SiLU()
    forge.patch(model, backend="triton", min_elements=0, kernels=["experts"])
    assert model._forge_patched_counts == {"experts": 1}
    experts.act_fn = torch.nn.GELU()  # swapped after patching: the call runs the module's own code
    ids = torch.randint(0, 256, (1, 3))
    with torch.no_grad():
        model(ids)
    assert model._forge_guard_stats.fallback("experts") == 1


def test_peft_expert_lora_with_gradient_checkpointing():
    """Non-reentrant gradient checkpointing (saved-tensor hooks around each layer) recomputes the
    low-rank expert block: the same gradients as the plain patched step."""
    model = _peft_expert_lora(_model("qwen3_moe"))
    ids, labels = batch(model, 2, 4, "cpu", seed=7)
    forge.patch(model, backend="triton", min_elements=0)
    plain = run(model, ids, labels)[2]
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    checkpointed = run(model, ids, labels)[2]
    assert plain.keys() == checkpointed.keys() and plain
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], rtol=1e-6, atol=1e-7)


def test_expert_adapters_are_checked():
    """The experts op's ``adapters`` (low-rank updates of its weights) must fit the weights."""
    fn = ops.get("experts", "triton")
    e, h, i, r = 4, 8, 6, 2
    x, gu, dn = torch.randn(3, h), torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    idx, w = torch.randint(0, e, (3, 2)), torch.rand(3, 2)
    good = (torch.randn(e, r, h), torch.randn(e, 2 * i, r), 2.0)
    got = fn(x, idx, w, gu, dn, adapters=(good, None))
    want = fn(x, idx, w, torch.baddbmm(gu, good[1], good[0], alpha=2.0), dn)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not make a low-rank update"):
        fn(x, idx, w, gu, dn, adapters=((torch.randn(e, r, h + 1), good[1], 2.0), None))
    with pytest.raises(TypeError, match="the expert block computes in"):
        fn(x, idx, w, gu, dn, adapters=(None, (torch.randn(e, r, i).double(), torch.randn(e, h, r), 1.0)))
    with pytest.raises(TypeError, match="adapters must be"):
        fn(x, idx, w, gu, dn, adapters=good)


def test_expert_adapters_under_autocast_merge_in_the_weights_dtype():
    """Under autocast the adapters are merged into fp32 weights before the node casts them, as
    peft folds them (autocast off, in the weights' dtype): the same bits as the node on weights
    merged outside autocast, not a merge computed in bf16."""
    fn = ops.get("experts", "triton")
    e, h, i, r = 4, 16, 8, 2
    g = torch.Generator().manual_seed(3)
    x, gu, dn = torch.randn(5, h, generator=g), torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    idx, w = torch.randint(0, e, (5, 2), generator=g), torch.rand(5, 2, generator=g)
    ads = ((torch.randn(e, r, h, generator=g), torch.randn(e, 2 * i, r, generator=g), 2.0),
           (torch.randn(e, r, i, generator=g), torch.randn(e, h, r, generator=g), 0.5))
    m_gu, m_dn = (torch.baddbmm(wt, ad[1], ad[0], alpha=ad[2]) for wt, ad in zip((gu, dn), ads))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fn(x, idx, w, gu, dn, adapters=ads)
        want = fn(x, idx, w, m_gu, m_dn)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_expert_lora_terms_join_the_products():
    """The adapters' up-projections join their weights' grouped products (``low=`` of the pieces),
    so the node makes no element-wise pass of its own over the routed rows' activations: the only
    tensor as large as them it makes outside the pieces is the gather of x's rows for x A^T. (The
    earlier node added each adapter's (S, out) product in fp32 and ran the GLU in torch: at 8B-class
    MoE shapes that glue was most of the step.)"""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    import forge_triton.experts as TX
    from forge.ops import experts as OX

    lows = {}

    def wrap(name, fn):
        def run(*a, **kw):
            lows.setdefault(name, []).append(kw.get("low") is not None)
            with _disable_current_modes():  # the pieces' own tensors are not the node's
                return fn(*a, **kw)
        return run

    ops_ = OX.ExpertsOps(**{n: wrap(n, f) if callable(f) and n != "route" else f  # (the routing takes no term)
                            for n, f in TX.experts_pieces().items()})
    t, h, i, e, k, r = 64, 16, 12, 4, 2, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=g).requires_grad_()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    gu, dn = torch.randn(e, 2 * i, h, generator=g) * h ** -0.5, torch.randn(e, h, i, generator=g) * i ** -0.5
    ad = [(torch.randn(e, r, h, generator=g).requires_grad_(), torch.randn(e, 2 * i, r, generator=g).requires_grad_(),
           2.0), (torch.randn(e, r, i, generator=g).requires_grad_(),
                  torch.randn(e, h, r, generator=g).requires_grad_(), 0.5)]
    rows = t * k
    big = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel() >= rows * min(h, i):
                    big.append(func.__name__)
            return out

    with Record():
        y = OX.apply_lora(ops_, x, idx, w, gu, dn, tuple(ad))
        y.backward(torch.randn(t, h, generator=g))
    assert big == ["index_select.default"], big
    assert lows == {"glu_fwd": [True], "grouped_mm": [False, False, True], "unpermute": [False, False],
                    "unpermute_bwd": [False], "glu_bwd": [True], "grouped_mm_t": [False, False, True],
                    "grouped_wgrad": [False] * 4}, lows
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for a in ad for p in a[:2])
