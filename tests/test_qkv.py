"""forge.patch's "qkv" fusion: an attention module's q, k and v projections as one product
(forge.patching.qkv), in training, in the calls forge's CUDA graphs capture. On the CPU (no
capture) the tests set the capture flag the guards read, so the patched forwards run as they do
inside a capture; on the GPU the fused replays meet the oracle."""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import forge  # noqa: E402
from oracle import assert_step_close  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.patching import guard  # noqa: E402
from forge.patching import qkv as qkv_mod  # noqa: E402
from forge.patching import stacking  # noqa: E402

ARCHS = ["qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2"]


def _model(model_type="qwen2"):
    return build_model(model_type, attn_implementation="eager" if model_type == "gemma2" else "sdpa")


def _ids(model, b=2, s=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (b, s), generator=g)


def _step(model, ids, owner=None):
    owner = owner if owner is not None else model  # (a compiled wrapper: the gradients by the model's names)
    owner.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in owner.named_parameters() if p.grad is not None}


def _close(got, want, what):
    (lg, gg), (lw, gw) = got, want
    torch.testing.assert_close(lg, lw, rtol=1e-6, atol=1e-6, msg=f"{what}: loss")
    assert gg.keys() == gw.keys()
    for n in gw:  # fp32: the same dot products, summed in another order at most
        torch.testing.assert_close(gg[n], gw[n], rtol=1e-5, atol=1e-6 * gw[n].abs().max().item(),
                                   msg=f"{what}: grad {n}")


@pytest.fixture
def capturing(monkeypatch):
    """The flag forge's graph capture sets (forge.patching.guard.CAPTURE): calls run as inside a
    capture."""
    monkeypatch.setattr(guard.CAPTURE, "on", True)


def _patched(model):
    forge.patch(model, kernels=["qkv"], graphs=True)  # (a CPU model: every call runs uncaptured)
    return model


@pytest.mark.parametrize("model_type", ARCHS)
def test_one_product_gives_the_three(model_type, capturing):
    base = _model(model_type)
    model = _patched(copy.deepcopy(base))
    n = base.config.num_hidden_layers
    assert model._forge_patched_counts == {"qkv": n, "graphs": n}, model._forge_skipped
    assert model._forge_backends == {"qkv": "torch"} and "torch" in str(forge.report(model))
    ids = _ids(base)
    _close(_step(model, ids), _step(base, ids), model_type)
    assert model._forge_guard_stats.as_dict()["qkv"] == {"fused": n, "fallback": 0}
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)
    forge.unpatch(model)
    assert not [m for m in model.modules() if "forward" in m.__dict__]


def test_uncaptured_calls_run_the_three_products():
    base = _model()
    model = _patched(copy.deepcopy(base))
    ids = _ids(base)
    got, want = _step(model, ids), _step(base, ids)
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    n = base.config.num_hidden_layers
    assert model._forge_guard_stats.as_dict()["qkv"] == {"fused": 0, "fallback": n}


def test_calls_that_do_not_fit_run_the_three_products(capturing):
    model = _patched(_model())
    attn = model.model.layers[0].self_attn
    x, other = torch.randn(2, 3, model.config.hidden_size), torch.randn(2, 3, model.config.hidden_size)
    # k_proj on its own, or on another input than q_proj's: nn.Linear's own forward, exactly
    assert torch.equal(attn.k_proj(x), F.linear(x, attn.k_proj.weight, attn.k_proj.bias))
    q = attn.q_proj(x)
    assert torch.equal(attn.k_proj(other), F.linear(other, attn.k_proj.weight, attn.k_proj.bias))
    # v from the slot once (the one product's), then its own forward
    torch.testing.assert_close(attn.v_proj(x), attn.v_proj(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q, F.linear(x, attn.q_proj.weight, attn.q_proj.bias), rtol=1e-6, atol=1e-6)
    # an input changed in place after q_proj: k and v are made again from it
    attn.q_proj(x)
    x.add_(1.0)
    assert torch.equal(attn.k_proj(x), F.linear(x, attn.k_proj.weight, attn.k_proj.bias))
    # a projection changed after patching (k_proj's bias dropped): checked per call, three products
    fallback = model._forge_guard_stats.as_dict()["qkv"]["fallback"]
    attn.k_proj.bias = None
    assert torch.equal(attn.q_proj(x), F.linear(x, attn.q_proj.weight, attn.q_proj.bias))
    assert torch.equal(attn.k_proj(x), F.linear(x, attn.k_proj.weight))
    assert model._forge_guard_stats.as_dict()["qkv"]["fallback"] == fallback + 1
    forge.unpatch(model)


@pytest.mark.parametrize("fused", [False, True])
def test_peft_over_a_patched_model_runs_its_adapters(fused, monkeypatch):
    # get_peft_model after forge.patch wraps the projections forge replaced: the wrapper calls
    # its base layer, whose fallback is that layer's own product (not the wrapper's, which would
    # call it again); the adapters count, as over the unpatched model
    peft = pytest.importorskip("peft")
    if fused:  # calls as inside a capture: the one product is offered, and declined per call
        monkeypatch.setattr(guard.CAPTURE, "on", True)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(qkv_mod.QKV), init_lora_weights=False)
    base = _model()
    models = []
    for patch in (False, True):
        m = copy.deepcopy(base)
        if patch:
            _patched(m)
        torch.manual_seed(3)  # the same adapters
        models.append(peft.get_peft_model(m, cfg))
    ids = _ids(base)
    _close(_step(models[1], ids), _step(models[0], ids), "peft over a patched model")


def test_declines_with_reasons(monkeypatch):
    model = _model()
    n = model.config.num_hidden_layers
    # without graphs, in inference with the weights not stored together (stacking's switch off;
    # on, inference reads them stored together: tests/test_stacking.py), or with a list that
    # leaves it out: the projections keep theirs
    monkeypatch.setattr(stacking, "STACK_INFER", False)
    for kw in ({}, {"mode": "infer", "graphs": True}, {"kernels": ["rmsnorm"], "graphs": True}):
        forge.patch(model, **{"kernels": ["qkv"], **kw})
        assert "qkv" not in model._forge_patched_counts, kw
        assert "forward" not in model.model.layers[0].self_attn.q_proj.__dict__
        forge.unpatch(model)
    forge.patch(model, kernels=["qkv"])
    assert "graphs=True" in model._forge_skipped["qkv"]
    forge.unpatch(model)
    # a bias on some of the three: that layer runs three products, the others one
    model.model.layers[0].self_attn.k_proj.bias = None
    _patched(model)
    assert model._forge_patched_counts == {"qkv": n - 1, "graphs": n}
    assert "a bias on some" in model._forge_skipped["qkv"]
    forge.unpatch(model)
    # weights over MAX_WEIGHT_BYTES: none is fused, and the report says why
    model = _model()
    monkeypatch.setattr(qkv_mod, "MAX_WEIGHT_BYTES", 0)
    _patched(model)
    assert "qkv" not in model._forge_patched_counts
    assert "MAX_WEIGHT_BYTES" in model._forge_skipped["qkv"]
    forge.unpatch(model)
    with pytest.raises(ValueError, match="unknown kernel key"):
        forge.patch(model, kernels=["qkv_proj"])


def test_under_compile_the_trace_has_the_three_products(capturing):
    """While torch.compile traces, the fusion hands the trace transformers' three products (on
    the GPU the layers are ops and replay fused: tests/test_graphs.py): no graph break, and the
    compiled step is the unpatched one's."""
    base = _model()
    model = _patched(copy.deepcopy(base))
    ids = _ids(base)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(ids, labels=ids)
    assert ex.graph_break_count == 0
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got, want = _step(compiled, ids, model), _step(base, ids)
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    assert model._forge_guard_stats.as_dict()["qkv"] == {"fused": 0, "fallback": 0}  # traced calls not counted
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,compiled", [("qwen2", False), ("llama", False), ("qwen2", True)])
def test_fused_replays_meet_the_oracle(model_type, compiled):
    """bf16 on the GPU, graphs=True (then torch.compile with inductor): the replayed steps run
    the one product; loss and every gradient against an fp32 copy of the unpatched model, with
    the unpatched bf16 model's own error as the bound (tests/oracle.py's rule)."""
    model = build_model(model_type, "gpu_demo", dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    ids = _ids(model, 2, 256).cuda()
    ref = _step(copy.deepcopy(model).float(), ids)
    eager = _step(model, ids)
    forge.patch(model, backend="triton", graphs=True)
    n = model.config.num_hidden_layers
    assert model._forge_patched_counts["qkv"] == n
    torch._dynamo.reset()
    run = torch.compile(model) if compiled else model
    for _ in range(3):  # uncaptured, captured, replayed
        got = _step(run, ids, model)
    assert model._forge_graphs.stats.replayed == 2
    assert model._forge_guard_stats.fused("qkv") >= n  # (the capture's calls)
    assert_step_close(got, ref, eager, model.config, ids.numel())
    torch._dynamo.reset()
