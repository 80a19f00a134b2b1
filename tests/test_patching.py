"""forge.patch / forge.unpatch: the contract (counts, skips, guard, instance-level patching,
idempotence, exact restore, wrappers, errors). Numerics of patched models: tests/test_models.py.

Most cases use the qwen2 tiny model and keep the interpreted kernel calls few (a subset of
kernels, or a guard threshold that sends every call to the original forward).
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import copy  # noqa: E402
import logging  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import forge  # noqa: E402
from forge import ops  # noqa: E402
from forge.__main__ import build_model, model_config  # noqa: E402
from forge.patching import core  # noqa: E402
from forge.spec import tolerance  # noqa: E402

NEVER = 10**15  # a guard threshold above any call here: every call falls back


def ids_for(model, b=2, s=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (b, s), generator=g)


def instance_forwards(model):
    return [m for m in model.modules() if "forward" in m.__dict__]


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


@pytest.fixture
def qwen2():
    return build_model("qwen2")


def test_counts_24_layer_qwen2_and_qwen3():
    from transformers import AutoModelForCausalLM

    # the numbers; counting needs no forward: 24 layers at the tiny widths (a model on
    # "meta" is declined at patch time: no kernel runs there)
    for model_type, norms in (("qwen2", 49), ("qwen3", 97)):
        model = AutoModelForCausalLM.from_config(model_config(model_type, num_hidden_layers=24))
        forge.patch(model)
        assert model._forge_patched_counts == {"rmsnorm": norms, "swiglu": 24, "rope": 24, "fused_linear_ce": 1}


def test_bare_decoder_and_what_is_left_alone():
    from transformers import AutoModel, AutoModelForCausalLM

    bare = AutoModel.from_config(model_config("qwen2"))  # Qwen2Model: no lm_head
    gemma = AutoModelForCausalLM.from_config(model_config("gemma"))
    forge.patch(bare)
    assert bare._forge_patched_counts == {"rmsnorm": 5, "swiglu": 2, "rope": 2}
    assert "lm_head" in bare._forge_skipped["fused_linear_ce"]
    forge.patch(gemma)
    replaced = {type(m).__name__ for m in instance_forwards(gemma)}
    # gemma's scaled embedding, the decoder layers and the rotary embedding keep HF's forwards;
    # the decoder model's (GemmaModel) builds its causal mask forge's way under torch.compile
    # (the q/k/v fusion needs graphs=True or an integer min_elements: the projections keep theirs)
    assert replaced == {"GemmaRMSNorm", "GemmaMLP", "GemmaAttention", "GemmaForCausalLM", "GemmaModel"}


def test_infer_mode_declines_training_kernels(qwen2):
    forge.patch(qwen2, mode="infer")
    assert "fused_linear_ce" not in qwen2._forge_patched_counts
    for key in ("fused_linear_ce", "lora_qkv", "lora_mlp"):
        assert "infer" in qwen2._forge_skipped[key]
    assert {"rmsnorm", "swiglu", "rope"} <= set(qwen2._forge_patched_counts)


def test_model_without_adapters_declines_lora(qwen2):
    forge.patch(qwen2, kernels=["rmsnorm", "lora_qkv", "lora_mlp"])
    assert qwen2._forge_patched_counts == {"rmsnorm": 5}
    assert "no LoRA adapters" in qwen2._forge_skipped["lora_qkv"]
    assert "no LoRA adapters" in qwen2._forge_skipped["lora_mlp"]


@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_guard_above_every_call_is_bit_identical(qwen2, backend):
    if not ops.availability(backend)[0]:
        pytest.skip(ops.availability(backend)[1])
    ids = ids_for(qwen2)
    want = logits(qwen2, ids)
    forge.patch(qwen2, mode="infer", backend=backend, min_elements=NEVER)
    got = logits(qwen2, ids)
    assert torch.equal(got, want)
    stats = qwen2._forge_guard_stats
    for key in ("rmsnorm", "swiglu", "rope"):
        assert stats.fused(key) == 0 and stats.fallback(key) > 0, stats
    assert stats.fallback("rmsnorm") == 5 and stats.fallback("rope") == 2
    stats.reset()
    assert stats.as_dict()["rmsnorm"] == {"fused": 0, "fallback": 0}
    logits(qwen2, ids)
    assert forge.patching.guard_stats(qwen2).fallback("swiglu") == 2  # same object, counting again


def test_guard_threshold_per_kernel(qwen2):
    # rows x width: rmsnorm calls have 8 x 64 = 512 elements, the rope call 8 x (4+2) x 16 = 768
    ids = ids_for(qwen2)
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm", "rope"], min_elements={"rmsnorm": 513, "rope": 768})
    logits(qwen2, ids)
    stats = qwen2._forge_guard_stats
    assert (stats.fused("rmsnorm"), stats.fallback("rmsnorm")) == (0, 5)
    assert (stats.fused("rope"), stats.fallback("rope")) == (2, 0)


def test_default_threshold_is_forge_min_fused_elements(qwen2, monkeypatch):
    # min_elements=None reads forge.MIN_FUSED_ELEMENTS at patch time: per backend, an int or a
    # dict per kernel
    monkeypatch.setattr(forge, "MIN_FUSED_ELEMENTS", {"triton": {"rmsnorm": NEVER}, "pallas": NEVER})
    forge.patch(qwen2, mode="infer", backend="triton", kernels=["rmsnorm", "swiglu"])
    logits(qwen2, ids_for(qwen2))
    stats = qwen2._forge_guard_stats
    assert (stats.fused("rmsnorm"), stats.fallback("rmsnorm")) == (0, 5)
    assert (stats.fused("swiglu"), stats.fallback("swiglu")) == (2, 0)


def test_a_copy_keeps_a_rebound_default_table(qwen2, monkeypatch):
    # a deep copy is patched again with the original's arguments: a table rebound at
    # forge.MIN_FUSED_ELEMENTS goes with it, the shipped one is read again where the copy is made
    import copy

    monkeypatch.setattr(forge, "MIN_FUSED_ELEMENTS", {"triton": {"rmsnorm": NEVER}, "pallas": NEVER})
    forge.patch(qwen2, mode="infer", backend="triton", kernels=["rmsnorm"])
    twin = copy.deepcopy(qwen2)
    logits(twin, ids_for(twin))
    assert (twin._forge_guard_stats.fused("rmsnorm"), twin._forge_guard_stats.fallback("rmsnorm")) == (0, 5)
    monkeypatch.undo()
    forge.patch(qwen2, mode="infer", backend="triton", kernels=["rope"])
    assert qwen2._forge_state.call.keywords["min_fused"] is None


def test_default_threshold_per_mode(qwen2, monkeypatch):
    # a backend's default may differ per mode ({"infer": ..., "train": ...}, as calibrated)
    monkeypatch.setattr(forge, "MIN_FUSED_ELEMENTS", {"triton": {"infer": {"swiglu": NEVER}, "train": 0}})
    forge.patch(qwen2, mode="infer", backend="triton", kernels=["rmsnorm", "swiglu"])
    logits(qwen2, ids_for(qwen2))
    stats = qwen2._forge_guard_stats
    assert (stats.fused("swiglu"), stats.fallback("swiglu")) == (0, 2)
    assert (stats.fused("rmsnorm"), stats.fallback("rmsnorm")) == (5, 0)
    forge.unpatch(qwen2)
    forge.patch(qwen2, mode="train", backend="triton", kernels=["swiglu"])
    logits(qwen2, ids_for(qwen2))
    assert qwen2._forge_guard_stats.fused("swiglu") == 2


def test_recompute_mlp_fuses_the_mlp_at_every_size(qwen2, monkeypatch):
    # recompute_mlp asks for the MLP's memory saving: in training the MLP's default threshold is
    # then 0; a threshold the caller names still applies
    monkeypatch.setattr(forge, "MIN_FUSED_ELEMENTS", {"triton": {"train": {"swiglu": NEVER, "rmsnorm": NEVER}}})
    forge.patch(qwen2, backend="triton", kernels=["rmsnorm", "swiglu"], recompute_mlp=True)
    logits(qwen2, ids_for(qwen2))
    stats = qwen2._forge_guard_stats
    assert (stats.fused("swiglu"), stats.fallback("swiglu")) == (2, 0)
    assert (stats.fused("rmsnorm"), stats.fallback("rmsnorm")) == (0, 5)
    forge.patch(qwen2, backend="triton", kernels=["swiglu"], recompute_mlp=True, min_elements={"swiglu": NEVER})
    logits(qwen2, ids_for(qwen2))
    assert (qwen2._forge_guard_stats.fused("swiglu"), qwen2._forge_guard_stats.fallback("swiglu")) == (0, 2)


def test_shipped_defaults_resolve_for_every_kernel():
    # the calibrated table names every shape-sensitive kernel, in both modes, for both backends
    from forge.spec import SHAPE_SENSITIVE

    for backend, d in forge.MIN_FUSED_ELEMENTS.items():
        for mode in ("infer", "train"):
            per_mode = d.get(mode, d) if isinstance(d, dict) else d
            for key in SHAPE_SENSITIVE:
                v = per_mode.get(key) if isinstance(per_mode, dict) else per_mode
                assert isinstance(v, int) and v >= 0, (backend, mode, key, v)


def test_unpatch_restores_exactly(qwen2):
    ids = ids_for(qwen2)
    want = logits(qwen2, ids)
    forge.unpatch(qwen2)  # never patched: a no-op
    assert not instance_forwards(qwen2)
    forge.patch(qwen2, kernels=["rmsnorm", "rope", "fused_linear_ce"], min_elements=0)
    assert len(instance_forwards(qwen2)) == 5 + 2 + 1 + 1  # (and the decoder's: its mask under compile)
    logits(qwen2, ids)
    assert qwen2._forge_guard_stats.fused("rmsnorm") == 5  # the kernels really ran
    forge.unpatch(qwen2)
    assert not instance_forwards(qwen2)
    assert torch.equal(logits(qwen2, ids), want)
    for attr in ("_forge_patched_counts", "_forge_skipped", "_forge_guard_stats", "_forge_state"):
        assert not hasattr(qwen2, attr)
    forge.unpatch(qwen2)  # twice: still a no-op


def test_unpatch_says_so_when_a_forward_was_wrapped_after_patching(qwen2, caplog):
    # accelerate's prepare (the HF Trainer with bf16=True) puts an autocast wrapper around the
    # model's forward, forge's (the fused loss'); unpatch removed it with forge's without a word
    forge.patch(qwen2, kernels=["rmsnorm", "fused_linear_ce"], min_elements=0)
    assert "forward" in qwen2.__dict__
    inner = qwen2.forward

    def wrapper(*a, **k):
        return inner(*a, **k)

    qwen2.forward = wrapper
    with caplog.at_level(logging.WARNING, logger="forge"):
        forge.unpatch(qwen2)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("was replaced after forge.patch" in m and "forward" in m for m in said), said
    assert not instance_forwards(qwen2)
    caplog.clear()
    forge.patch(qwen2, kernels=["rmsnorm", "fused_linear_ce"], min_elements=0)
    with caplog.at_level(logging.WARNING, logger="forge"):
        forge.unpatch(qwen2)  # nothing wrapped: nothing said
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_patch_twice_is_a_noop_and_new_arguments_repatch(qwen2):
    assert forge.patch(qwen2, mode="infer") is qwen2
    before = {id(m): m.__dict__["forward"] for m in instance_forwards(qwen2)}
    stats = qwen2._forge_guard_stats
    forge.patch(qwen2, mode="infer")
    assert {id(m): m.__dict__["forward"] for m in instance_forwards(qwen2)} == before
    assert qwen2._forge_guard_stats is stats
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"])  # different arguments: patched afresh
    assert qwen2._forge_patched_counts == {"rmsnorm": 5}
    assert len(instance_forwards(qwen2)) == 5 + 1  # (and the decoder's, not counted: not a kernel)
    forge.unpatch(qwen2)
    assert not instance_forwards(qwen2)


def test_two_models_one_patched():
    from transformers.models.qwen2 import modeling_qwen2 as mq

    a, b = build_model("qwen2", seed=1), build_model("qwen2", seed=2)
    ids = ids_for(a)
    want_b = logits(b, ids)
    module_rope, norm_fwd, attn_fwd = mq.apply_rotary_pos_emb, mq.Qwen2RMSNorm.forward, mq.Qwen2Attention.forward
    forge.patch(a, mode="infer", kernels=["rmsnorm", "rope"], min_elements=0)
    logits(a, ids)
    fused = a._forge_guard_stats.fused("rope")
    assert fused == 2
    # b: same class, unpatched, bit-identical, and it does not touch a's kernels
    assert torch.equal(logits(b, ids), want_b)
    assert a._forge_guard_stats.fused("rope") == fused
    assert not instance_forwards(b)
    # transformers' module and classes are untouched
    assert mq.apply_rotary_pos_emb is module_rope
    assert mq.Qwen2RMSNorm.forward is norm_fwd and mq.Qwen2Attention.forward is attn_fwd


def test_weights_are_read_at_call_time(qwen2):
    # FSDP2 swaps parameters between shards and gathered copies around each forward: a patched
    # forward must use whatever parameter the module holds when it runs, not the one it saw
    ids = ids_for(qwen2)
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"], min_elements=0)
    old = logits(qwen2, ids)
    qwen2.model.norm.weight = nn.Parameter(torch.randn_like(qwen2.model.norm.weight))
    got = logits(qwen2, ids)
    forge.unpatch(qwen2)
    want = logits(qwen2, ids)
    ref = logits(copy.deepcopy(qwen2).double(), ids)
    tolerance.assert_close("logits", got, ref, want, torch.float32, qwen2.config.vocab_size)
    assert (old - want).abs().max() > 100 * (got - want).abs().max()


def test_deepcopy_rebinds_to_the_copy(qwen2):
    forge.patch(qwen2, mode="infer", min_elements=NEVER)
    dup = copy.deepcopy(qwen2)
    for m in instance_forwards(dup):
        owner = m.__dict__["forward"].__self__  # the module, or (q/k/v projections) its attention module
        assert owner is m or any(c is m for c in owner.children()), m
        assert any(owner is d for d in dup.modules())
    ids = ids_for(qwen2)
    assert torch.equal(logits(dup, ids), logits(qwen2, ids))
    forge.unpatch(dup)
    # 10 kernel modules, and q/k/v of each layer (their weights stored together: forge.patching.stacking)
    assert not instance_forwards(dup) and len(instance_forwards(qwen2)) == 10 + 3 * qwen2.config.num_hidden_layers


def test_fused_loss_forward_outputs(qwen2):
    ids = ids_for(qwen2)
    labels = ids.clone()
    labels[0, :2] = -100
    eager_model = copy.deepcopy(qwen2)
    ref_model = copy.deepcopy(qwen2).double()
    eager = eager_model(ids, labels=labels)
    forge.patch(qwen2, kernels=["fused_linear_ce"])
    ks = qwen2._forge_guard_stats
    vocab = qwen2.config.vocab_size

    def close(name, **kw):
        got = qwen2(ids, labels=labels, **kw)
        assert got.logits is None and got.loss.shape == ()  # fused: no logits materialised
        tolerance.assert_close(name, got.loss, ref_model(ids, labels=labels, **kw).loss,
                               eager_model(ids, labels=labels, **kw).loss, torch.float32, vocab)
        return got.loss

    loss = close("loss")
    assert ks.fused("fused_linear_ce") == 1
    # HF's ForCausalLMLoss extras: gradient-accumulation divisor, pre-shifted labels
    close("loss / num_items_in_batch", num_items_in_batch=torch.tensor(11))
    close("loss with shift_labels", shift_labels=torch.roll(labels, -1, dims=1))
    # without labels, with logits_to_keep, or in eval mode: HF's own forward, bit-identical
    assert torch.equal(logits(qwen2, ids), eager.logits.detach())
    assert torch.equal(logits(qwen2, ids, logits_to_keep=1), logits(eager_model, ids, logits_to_keep=1))
    qwen2.eval()
    ev = qwen2(ids, labels=labels)
    assert torch.equal(ev.loss, eager.loss) and torch.equal(ev.logits, eager.logits)
    qwen2.train()
    assert ks.fallback("fused_linear_ce") == 3
    # return_dict=False gives HF's tuple, loss first (to_tuple drops logits=None)
    tup = qwen2(ids, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], loss)


def test_generate_signature_is_hf(qwen2):
    import inspect

    forge.patch(qwen2, kernels=["fused_linear_ce"])
    params = inspect.signature(qwen2.forward).parameters
    assert "logits_to_keep" in params and "labels" in params  # generate() inspects these


def test_unsupported_model_raises():
    from transformers import AutoConfig, AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(forge.UnsupportedModelError, match="gpt2.*qwen2") as e:
        forge.patch(gpt2)
    assert isinstance(e.value, ValueError)
    assert not instance_forwards(gpt2)
    with pytest.raises(forge.UnsupportedModelError, match="Linear"):
        forge.patch(nn.Linear(2, 2))
    with pytest.raises(forge.UnsupportedModelError, match="got Qwen2Config; supported") as e:
        forge.patch(AutoConfig.for_model("qwen2"))  # (it said "model_type None" of a config that has one)
    assert "model_type None" not in str(e.value)


def test_nested_model_attribute(qwen2):
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

    w = Wrapper(qwen2)
    assert forge.patch(w, mode="infer", kernels=["rmsnorm"]) is w
    assert w._forge_patched_counts == qwen2._forge_patched_counts == {"rmsnorm": 5}
    forge.unpatch(w)
    assert not instance_forwards(qwen2) and not hasattr(w, "_forge_patched_counts")


@pytest.mark.parametrize("kwargs,exc,word", [
    (dict(mode="serve"), ValueError, "mode"),
    (dict(kernels=["rmsnorm", "layernorm"]), ValueError, "kernels"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(backend={"rmsnorm": "cutlass"}), ValueError, "backend"),
    (dict(backend={"norm": "triton"}), ValueError, "backend"),
    (dict(backend=3), TypeError, "backend"),
    (dict(min_elements=-1), ValueError, "min_elements"),
    (dict(min_elements={"rope": 1.5}), TypeError, "min_elements"),
])
def test_bad_arguments_name_themselves(qwen2, kwargs, exc, word):
    with pytest.raises(exc, match=word):
        forge.patch(qwen2, **kwargs)
    assert not instance_forwards(qwen2)


def test_explicit_backend_that_cannot_run_raises(qwen2, monkeypatch):
    real = ops.availability

    def fake(b):
        return (False, f"{b} backend unavailable: test") if b == "pallas" else real(b)

    monkeypatch.setattr(ops, "availability", fake)
    with pytest.raises(forge.BackendUnavailableError, match="pallas"):
        forge.patch(qwen2, backend="pallas")
    with pytest.raises(forge.BackendUnavailableError):
        forge.patch(qwen2, backend={"rope": "pallas"})
    assert not instance_forwards(qwen2)
    # auto picks what can run
    forge.patch(qwen2, kernels=["rmsnorm"], backend="auto")
    assert qwen2._forge_backends == {"rmsnorm": "triton"}


def test_auto_falls_through_to_a_backend_that_has_the_kernel(qwen2, monkeypatch):
    real_get = ops.get

    def get(key, backend):
        if backend == "triton" and key == "rope":
            raise ModuleNotFoundError("No module named 'forge_triton.rope'")
        return real_get(key, backend)

    monkeypatch.setattr(ops, "get", get)
    monkeypatch.setattr(ops, "auto_order", lambda: ("triton", "pallas"))  # CUDA's order, on any machine
    if not ops.availability("pallas")[0]:
        pytest.skip(ops.availability("pallas")[1])
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm", "rope"])
    assert qwen2._forge_backends == {"rmsnorm": "triton", "rope": "pallas"}


def test_missing_kernel_is_skipped_with_its_reason(qwen2, monkeypatch):
    real_get = ops.get

    def get(key, backend):
        if key == "rope":
            raise ModuleNotFoundError(f"No module named '{backend}.rope'")
        return real_get(key, backend)

    monkeypatch.setattr(ops, "get", get)
    forge.patch(qwen2, backend="triton")
    assert "rope" not in qwen2._forge_patched_counts
    assert "No module named" in qwen2._forge_skipped["rope"]
    assert qwen2._forge_patched_counts["rmsnorm"] == 5


def test_activation_the_kernel_does_not_compute_is_declined():
    model = build_model("gemma2", hidden_activation="gelu")  # exact erf gelu, not the tanh form
    forge.patch(model, mode="infer")
    assert "geglu" not in model._forge_patched_counts
    assert "gelu" in model._forge_skipped["geglu"]


@pytest.mark.parametrize("where", ["_apply_fused_ce", "publish", "log_patch"])
def test_error_while_patching_leaves_model_unpatched(qwen2, monkeypatch, where):
    # (an error after the kernels were applied, while the state was published or logged, left
    # the model patched, and before the state existed, past what unpatch could undo)
    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(core if where == "_apply_fused_ce" else core.copying if where == "publish" else core._report,
                        where, boom)
    with pytest.raises(RuntimeError, match="boom"):
        forge.patch(qwen2)
    assert not instance_forwards(qwen2) and not hasattr(qwen2, "_forge_state")
    assert not any(k.startswith("_forge") or k in ("__reduce_ex__", "__deepcopy__")
                   for m in qwen2.modules() for k in m.__dict__)


@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_train_mlp_is_one_node_unless_it_cannot_be(qwen2, backend, monkeypatch):
    # train mode with autograd on: the MLP runs as the gated MLP (one autograd node keeping no
    # down-projection input); no grad, autocast, a hook on a projection or a biased projection
    # run the projections as modules around the GLU kernel; every path gives eager's output
    if not ops.availability(backend)[0]:
        pytest.skip(ops.availability(backend)[1])
    mlp = qwen2.model.layers[0].mlp
    x = torch.randn(2, 3, qwen2.config.hidden_size, requires_grad=True)
    want = type(mlp).forward(mlp, x)
    forge.patch(qwen2, mode="train", backend=backend, min_elements=0)
    y = mlp(x)
    assert type(y.grad_fn).__name__ == "GatedMLPFunctionBackward"
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert mlp(x).grad_fn is None
    dev = x.device.type
    with torch.autocast(dev, dtype=torch.bfloat16):
        assert type(mlp(x).grad_fn).__name__ != "GatedMLPFunctionBackward"
    h = mlp.up_proj.register_forward_hook(lambda m, i, o: None)
    assert type(mlp(x).grad_fn).__name__ != "GatedMLPFunctionBackward"
    h.remove()
    assert type(mlp(x).grad_fn).__name__ == "GatedMLPFunctionBackward"
    stats = qwen2._forge_guard_stats.as_dict()["swiglu"]
    assert stats["fused"] == 5 and stats["fallback"] == 0  # the GLU kernel ran on every path
    forge.unpatch(qwen2)
    forge.unpatch(qwen2)
    forge.patch(qwen2, mode="infer", backend=backend, min_elements=0)
    assert type(mlp(x).grad_fn).__name__ != "GatedMLPFunctionBackward"  # infer: no gated MLP node
    # without autograd (either mode) the projections are bare F.linear calls, not module calls,
    # unless a projection's forward is overridden on the instance
    calls = []
    orig_linear = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda m, t: calls.append(m) or orig_linear(m, t))
    with torch.no_grad():
        assert torch.allclose(mlp(x), want, rtol=1e-5, atol=1e-6) and calls == []
        mlp.gate_proj.forward = types.MethodType(torch.nn.Linear.forward, mlp.gate_proj)
        assert torch.allclose(mlp(x), want, rtol=1e-5, atol=1e-6) and len(calls) == 3
        del mlp.gate_proj.forward
    with torch.enable_grad():  # infer mode under autograd: the modules
        calls.clear()
        mlp(x)
        assert len(calls) == 3
