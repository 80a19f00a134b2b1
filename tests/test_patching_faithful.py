"""A patched model computes what the unpatched one computes for the same call, and forge's errors
name the argument the user gave (issue 44).

- the GLU kernel follows the activation module the MLP calls (``mlp.act_fn``), swapped before
  or after patching, whatever the config names; the LoRA MLP kernel too;
- packed sequences (``position_ids`` restarting at 0, no attention mask): the fused loss runs
  the decoder as the unpatched call does (the same attention masks);
- RoPE gives cos/sin no gradient: a patched model hands such calls to HF's function, the
  functional op refuses them;
- labels of any dtype but int64 raise ``forge.LabelDtypeError`` before anything runs;
- ``forge.ops.get``, ``forge.patch(kernels=, backend=)`` and ``forge.report`` on wrong input.

Numbers follow the oracle (tests/oracle.py): patched fp32 against the unpatched model in
float64, bounded by the unpatched fp32 model's own error. Tiny models, few interpreted kernel
calls; the gpu-marked cases are the same checks at a real shape.
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import copy  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import forge  # noqa: E402
import forge.patching  # noqa: E402
from forge import ops  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.patching import arch as arch_table  # noqa: E402
from forge.spec import tolerance  # noqa: E402
from oracle import need_backend  # noqa: E402

BACKENDS = ops.BACKENDS
CPU_BACKEND = ops.auto_order()[0]  # the faster interpreter on a CPU (Pallas' where it runs)


def ids_for(model, b=2, s=8, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (b, s), generator=g).to(device)


def assert_oracle(name, got, eager, ref, dtype, k):
    tolerance.assert_close(name, got, ref, eager, dtype, k)


# ---------------------------------------------------------------------------------------------
# 1. the activation the MLP calls


def gelu_tanh():
    from transformers.activations import ACT2FN

    return ACT2FN["gelu_pytorch_tanh"]


def swap_acts(model):
    """Layer 0's MLP calls ReLU (no GLU kernel computes it), layer 1's the tanh GELU; the config
    still names silu."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    layers = base.model.layers
    layers[0].mlp.act_fn = nn.ReLU()
    layers[1].mlp.act_fn = gelu_tanh()
    return model


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids).logits


# the choice is the patching layer's, the same for every backend: one on the CPU, all on a GPU
@pytest.mark.parametrize("backend", [CPU_BACKEND])
@pytest.mark.parametrize("when", ["before", "after"])
def test_glu_follows_the_act_fn_the_mlp_calls(backend, when):
    need_backend(backend)
    eager = swap_acts(build_model("qwen2"))
    assert eager.config.hidden_act == "silu"
    ids = ids_for(eager)
    want, ref = logits_of(eager, ids), logits_of(copy.deepcopy(eager).double(), ids)
    model = build_model("qwen2")
    if when == "before":
        swap_acts(model)
    forge.patch(model, backend=backend, kernels=["swiglu", "geglu"], min_elements=0)
    if when == "before":  # chosen from the module: geglu where it calls the tanh GELU, nothing for ReLU
        assert model._forge_patched_counts == {"geglu": 1}
        assert "ReLU" in model._forge_skipped["swiglu"] and "layers.0.mlp" in model._forge_skipped["swiglu"]
    else:  # swapped after patching: each patched forward sees an act_fn it was not built for
        assert model._forge_patched_counts == {"swiglu": 2}
        swap_acts(model)
    got = logits_of(model, ids)
    assert_oracle("logits", got, want, ref, torch.float32, model.config.intermediate_size)
    stats = model._forge_guard_stats
    if when == "before":
        assert stats.fused("geglu") == 1 and stats.fallback("geglu") == 0
    else:
        assert stats.fused("swiglu") == 0 and stats.fallback("swiglu") == 2
    forge.unpatch(model)
    assert torch.equal(logits_of(model, ids), want)


def test_lora_mlp_follows_the_act_fn_the_mlp_calls():
    peft = pytest.importorskip("peft")

    def lora(model):
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
                              init_lora_weights=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            return peft.get_peft_model(model, cfg)

    need_backend(CPU_BACKEND)
    eager = lora(build_model("qwen2"))
    swap_acts(eager)
    ids = ids_for(eager)
    want, ref = logits_of(eager, ids), logits_of(copy.deepcopy(eager).double(), ids)
    # swapped before patching: the modules whose act_fn is not the config's activation are left to peft
    before = swap_acts(lora(build_model("qwen2")))
    forge.patch(before, backend=CPU_BACKEND, kernels=["lora_mlp"])
    assert "lora_mlp" not in before._forge_patched_counts and "ReLU" in before._forge_skipped["lora_mlp"]
    assert_oracle("logits", logits_of(before, ids), want, ref, torch.float32, eager.config.intermediate_size)
    # swapped after patching: the fused forward sees an act_fn it was not built for and falls back
    after = lora(build_model("qwen2"))
    forge.patch(after, backend=CPU_BACKEND, kernels=["lora_mlp"])
    assert after._forge_patched_counts == {"lora_mlp": 2}
    swap_acts(after)
    assert_oracle("logits", logits_of(after, ids), want, ref, torch.float32, eager.config.intermediate_size)
    assert after._forge_guard_stats.fused("lora_mlp") == 0 and after._forge_guard_stats.fallback("lora_mlp") == 2


@pytest.mark.parametrize("lora", [False, True])
def test_hooks_on_act_fn_run(lora):
    # the fused GLU computes the activation itself: a hook on mlp.act_fn (activation capture)
    # was skipped silently, called 0 times where eager calls it once per MLP
    need_backend(CPU_BACKEND)
    model = build_model("qwen2")
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
    key = "lora_mlp" if lora else "swiglu"
    forge.patch(model, backend=CPU_BACKEND, kernels=[key], min_elements=0)
    seen = []
    layers = model.get_base_model().model.layers if lora else model.model.layers
    layers[0].mlp.act_fn.register_forward_hook(lambda m, i, o: seen.append(o))
    logits_of(model, ids_for(model))
    assert len(seen) == 1
    assert model._forge_guard_stats.as_dict()[key] == {"fused": 1, "fallback": 1}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_glu_follows_the_act_fn_gpu(backend):
    need_backend(backend)
    eager = swap_acts(build_model("qwen2", "gpu_demo", dtype=torch.bfloat16, device="cuda"))
    ids = ids_for(eager, 4, 512, device="cuda")
    ref_model = copy.deepcopy(eager).float()
    want, ref = logits_of(eager, ids), logits_of(ref_model, ids)
    del ref_model
    model = build_model("qwen2", "gpu_demo", dtype=torch.bfloat16, device="cuda")
    forge.patch(model, backend=backend, kernels=["swiglu", "geglu"], min_elements=0)
    swap_acts(model)  # layers 0 and 1 fall back, 2 and 3 still fuse
    got = logits_of(model, ids)
    assert_oracle("logits", got, want, ref, torch.bfloat16, model.config.vocab_size)
    assert model._forge_guard_stats.as_dict()["swiglu"] == {"fused": 2, "fallback": 2}


# ---------------------------------------------------------------------------------------------
# 2. packed sequences: the decoder runs as the unpatched call runs it


PACKED = [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 0, 1]]


def losses(model, ids, cases):
    return [model(ids, labels=ids, **kw).loss.detach() for kw in cases]


def packed_cases(device="cpu", positions=PACKED):
    pos = torch.tensor(positions, device=device)
    return {
        # HF builds its default KV cache, and with a cache no packed-sequence mask: the
        # sequences attend to each other, as in the unpatched model
        "packed": dict(position_ids=pos),
        # without a cache HF separates the sequences (block-diagonal mask)
        "packed, use_cache=False": dict(position_ids=pos, use_cache=False),
        "packed, attention mask": dict(position_ids=pos, attention_mask=torch.ones_like(pos)),
        "plain": {},
    }


# the masks are transformers' shared builders' (masking_utils): the plain llama layout, the
# sliding-window ones (mistral; gemma2 with its eager attention and softcapping) and qwen2 on
# the CPU; every architecture on a GPU
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "mistral", "gemma2"])
def test_packed_sequences_loss_as_unpatched(model_type):
    need_backend(CPU_BACKEND)
    # (gemma2 has no SDPA attention in transformers: its eager one; the masks are built alike)
    model = build_model(model_type, attn_implementation="eager" if model_type == "gemma2" else "sdpa")
    ids = ids_for(model)
    cases = packed_cases()
    eager = losses(model, ids, cases.values())
    ref = losses(copy.deepcopy(model).double(), ids, cases.values())
    # the cases differ in what attends to what: a patched model taking the wrong one shows
    assert abs(eager[0] - eager[1]) > 1e-3 * abs(eager[0])
    forge.patch(model, backend=CPU_BACKEND, kernels=["fused_linear_ce"])
    got = losses(model, ids, cases.values())
    assert model._forge_guard_stats.fused("fused_linear_ce") == len(cases)
    for name, g, e, r in zip(cases, got, eager, ref):
        assert_oracle(f"loss ({name})", g, e, r, torch.float32, model.config.vocab_size)
    # where HF's masks cannot tell, the fused path still builds no KV cache
    assert model(ids, labels=ids).past_key_values is None
    assert model(ids, labels=ids, **cases["packed"]).past_key_values is not None  # as eager's


GPU_PACKED = [(m, BACKENDS[0]) for m in arch_table.DENSE] + [("qwen2", b) for b in BACKENDS[1:]]


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,backend", GPU_PACKED)
def test_packed_sequences_loss_as_unpatched_gpu(model_type, backend):
    need_backend(backend)
    model = build_model(model_type, "gpu_demo", dtype=torch.bfloat16, device="cuda",
                        attn_implementation="eager" if model_type == "gemma2" else "sdpa")
    ids = ids_for(model, 2, 1024, device="cuda")
    positions = [list(range(300)) + list(range(500)) + list(range(224)), list(range(1000)) + list(range(24))]
    cases = packed_cases("cuda", positions)
    ref_model = copy.deepcopy(model).float()
    ref = losses(ref_model, ids, cases.values())
    del ref_model
    eager = losses(model, ids, cases.values())
    forge.patch(model, backend=backend, kernels=["fused_linear_ce"])
    got = losses(model, ids, cases.values())
    for name, g, e, r in zip(cases, got, eager, ref):
        assert_oracle(f"loss ({name})", g, e, r, torch.bfloat16, model.config.vocab_size)


# ---------------------------------------------------------------------------------------------
# 3. RoPE: cos and sin that require grad


def rope_inputs(model, requires_grad, b=2, s=8, device="cpu"):
    attn = model.model.layers[0].self_attn
    g = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(b, s, model.config.hidden_size, generator=g, device=device, dtype=model.dtype)
    pos = torch.arange(s, device=device).expand(b, s)
    cos, sin = model.model.rotary_emb(x, pos)
    cos, sin = cos.detach().requires_grad_(requires_grad), sin.detach().requires_grad_(requires_grad)
    return attn, x, cos, sin


def attn_grads(attn, x, cos, sin):
    out = attn(x, position_embeddings=(cos, sin), attention_mask=None)[0]
    out.square().sum().backward()
    return out.detach(), cos.grad, sin.grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_with_cos_sin_that_require_grad_runs_hf(backend):
    need_backend(backend)
    model = build_model("qwen2", attn_implementation="sdpa")
    want = attn_grads(*rope_inputs(model, True))
    assert want[1] is not None and want[1].abs().sum() > 0
    forge.patch(model, backend=backend, kernels=["rope"], min_elements=0)
    got = attn_grads(*rope_inputs(model, True))
    for w, g in zip(want, got):
        assert g is not None and torch.equal(w, g)  # HF's own function ran
    assert model._forge_guard_stats.as_dict()["rope"] == {"fused": 0, "fallback": 1}
    # cos and sin without grad: the kernel
    attn_grads(*rope_inputs(model, False))
    assert model._forge_guard_stats.as_dict()["rope"] == {"fused": 1, "fallback": 1}


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_dim_position_ids_fail_as_in_hf(backend):
    # 1-D position_ids with a batch of 2 give 2-D cos/sin tables: HF's own function runs and
    # raises HF's error (before, forge's kernel check named its internal cos tensor)
    need_backend(backend)
    model = build_model("qwen2", attn_implementation="sdpa")
    ids, pos = torch.randint(0, model.config.vocab_size, (2, 10)), torch.arange(3, 13)
    with pytest.raises(Exception) as want:
        model(input_ids=ids, position_ids=pos)
    forge.patch(model, backend=backend, kernels=["rope"], min_elements=0)
    with pytest.raises(type(want.value), match=re.escape(str(want.value))):
        model(input_ids=ids, position_ids=pos)
    assert model._forge_guard_stats.as_dict()["rope"]["fallback"] == 1
    model(input_ids=ids, position_ids=pos[None])  # (1, S): broadcast over the batch, fused
    assert model._forge_guard_stats.as_dict()["rope"]["fused"] >= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_rope_refuses_cos_sin_that_require_grad(backend):
    need_backend(backend)
    rope = ops.get("rope", backend)
    q, k = torch.randn(1, 2, 8, 16, requires_grad=True), torch.randn(1, 2, 8, 16, requires_grad=True)
    cos, sin = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    rope(q, k, cos, sin)  # warm: the same shapes, already checked once (backends cache that)
    for which in ("cos", "sin"):
        c, s = (cos.clone().requires_grad_(which == "cos"), sin.clone().requires_grad_(which == "sin"))
        with pytest.raises(ValueError, match=rf"{which} requires grad.*no gradient to cos or sin"):
            rope(q, k, c, s)
        with torch.no_grad():  # no gradient asked for: nothing to drop
            rope(q, k, c, s)
    from forge.spec import rope as rope_spec

    with pytest.raises(ValueError, match="requires grad"):
        rope_spec.check(q, k, cos.requires_grad_(), sin)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_functional_rope_refuses_cos_sin_that_require_grad_gpu(backend):
    # Qwen2.5-0.5B's attention at 4 x 1024, on each backend's compiled (native) path
    need_backend(backend)
    rope = ops.get("rope", backend)
    q = torch.randn(4, 14, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(4, 2, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (torch.randn(1, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rope(q, k, cos, sin)[0].sum().backward()  # warm, and q gets its gradient
    assert q.grad is not None
    with pytest.raises(ValueError, match="sin requires grad"):
        rope(q, k, cos, sin.requires_grad_())


# ---------------------------------------------------------------------------------------------
# 4. label dtypes

LABEL_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.bool, torch.float32]


@pytest.mark.parametrize("dtype", LABEL_DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_functional_loss_label_dtype_error(backend, dtype):
    from forge.spec import fused_linear_ce as spec

    if backend == "reference":
        fn = spec.reference
    else:
        need_backend(backend)
        fn = ops.get("fused_linear_ce", backend)
    h, w = torch.randn(3, 8), torch.randn(10, 8)
    labels = torch.tensor([1, 0, 2]).to(dtype)
    name = str(dtype)
    with pytest.raises(forge.LabelDtypeError, match=rf"got {name}.*labels\.long\(\)"):
        fn(h, w, labels)
    # before anything else: a hidden of the wrong width does not get there first
    with pytest.raises(forge.LabelDtypeError, match=name):
        fn(torch.randn(3, 7), w, labels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_patched_model_label_dtype_error_before_the_decoder(backend):
    need_backend(backend)
    model = build_model("qwen2")
    forge.patch(model, backend=backend, kernels=["fused_linear_ce"])
    calls = []
    model.model.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = ids_for(model)
    for dtype in LABEL_DTYPES:
        with pytest.raises(forge.LabelDtypeError, match=rf"got {dtype}.*labels\.long\(\)"):
            model(ids, labels=ids.to(dtype))
        with pytest.raises(forge.LabelDtypeError, match=str(dtype)):
            model(ids, labels=ids, shift_labels=ids.to(dtype))
    assert not calls, "the decoder ran before the labels were refused"


# ---------------------------------------------------------------------------------------------
# 4b. the head and the loss as they are at call time: the fused loss calls neither lm_head nor
# the model's loss function, so a change that arrives after patching sends the call to HF


def _smoothed_loss(logits, labels, vocab_size, **_):
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab_size).float(), labels[:, 1:].reshape(-1),
                           label_smoothing=0.5)


def _lm_head_lora(model):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return peft.get_peft_model(model, cfg)


CHANGES = {
    "loss_function": lambda m: setattr(m, "loss_function", _smoothed_loss),
    "forward hook": lambda m: m.lm_head.register_forward_hook(lambda mod, i, out: out * 0.5),
    "forward pre-hook": lambda m: m.lm_head.register_forward_pre_hook(lambda mod, i: (i[0] * 2.0,)),
    "global forward hook": lambda m: nn.modules.module.register_module_forward_hook(
        lambda mod, i, out: out * 0.5 if mod is m.lm_head else None),
    "lm_head LoRA": _lm_head_lora,
}


@pytest.mark.parametrize("change", CHANGES)
def test_fused_loss_steps_aside_for_a_head_or_loss_set_after_patching(change):
    need_backend(CPU_BACKEND)
    model = build_model("qwen2", tie_word_embeddings=False)
    ids = ids_for(model)
    forge.patch(model, backend=CPU_BACKEND, kernels=["fused_linear_ce"])
    plain = model(ids, labels=ids).loss.detach()
    stats = model._forge_guard_stats
    assert stats.as_dict()["fused_linear_ce"] == {"fused": 1, "fallback": 0}
    handle = CHANGES[change](model)
    caller = handle if change == "lm_head LoRA" else model
    try:
        got = caller(ids, labels=ids).loss
        got.backward()
        assert stats.as_dict()["fused_linear_ce"] == {"fused": 1, "fallback": 1}
        forge.unpatch(model)
        want = caller(ids, labels=ids).loss
        assert abs(float(want.detach()) - float(plain)) > 1e-3  # the change changes the loss...
        assert torch.equal(got.detach(), want.detach())  # ...and the patched call has it
        if change == "lm_head LoRA":  # the head's adapter trains
            assert model.lm_head.lora_B["default"].weight.grad.abs().sum() > 0
    finally:
        if hasattr(handle, "remove"):
            handle.remove()


def test_fused_loss_resumes_once_a_hook_is_removed():
    need_backend(CPU_BACKEND)
    model = build_model("qwen2")
    ids = ids_for(model)
    forge.patch(model, backend=CPU_BACKEND, kernels=["fused_linear_ce"])
    handle = model.lm_head.register_forward_hook(lambda mod, i, out: None)
    model(ids, labels=ids)
    handle.remove()
    model(ids, labels=ids)
    assert model._forge_guard_stats.as_dict()["fused_linear_ce"] == {"fused": 1, "fallback": 1}


def test_patch_declines_the_fused_loss_for_a_head_with_its_own_forward():
    need_backend(CPU_BACKEND)

    class ScaledHead(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5

    model = build_model("qwen2", tie_word_embeddings=False)
    head = ScaledHead(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    forge.patch(model, backend=CPU_BACKEND, kernels=["fused_linear_ce"])
    assert "lm_head is a ScaledHead with its own forward" in str(forge.report(model))


@pytest.mark.parametrize("how", ["instance", "property", "method"])
def test_a_custom_loss_function_keeps_the_fused_loss_out(how):
    # a subclass's own loss_function (focal loss, a task weight) was replaced by the fused
    # plain cross-entropy, silently: 4.88 where the model computes 9.76
    from transformers.loss.loss_utils import ForCausalLMLoss

    need_backend(CPU_BACKEND)

    def doubled(logits, labels, vocab_size, **kw):
        return 2.0 * ForCausalLMLoss(logits, labels, vocab_size, **kw)

    model = build_model("qwen2")
    if how == "property":
        model.__class__ = type("Doubled", (type(model),), {"loss_function": property(lambda self: doubled)})
    elif how == "method":
        model.__class__ = type("Doubled", (type(model),), {"loss_function": staticmethod(doubled)})
    else:
        model.loss_function = doubled
    ids = ids_for(model)
    want = model(ids, labels=ids).loss
    forge.patch(model, backend=CPU_BACKEND, kernels=["rmsnorm", "fused_linear_ce"], min_elements=0)
    assert model._forge_skipped["fused_linear_ce"] == "the model has a custom loss function"
    got = model(ids, labels=ids).loss
    assert model._forge_guard_stats.fused("fused_linear_ce") == 0
    assert torch.allclose(got, want, rtol=1e-5), (got, want)


# ---------------------------------------------------------------------------------------------
# 5. arguments: forge.ops.get, forge.patch, forge.report


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_refuses_cos_and_sin_of_two_dtypes(backend):
    # the kernels read both tables as one dtype; torch's formula would promote instead
    need_backend(backend)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="cos is torch.float32 but sin is torch.bfloat16"):
        ops.get("rope", backend)(q, q, torch.randn(1, 3, 8), torch.randn(1, 3, 8).bfloat16())


def test_ops_get_checks_its_arguments():
    for bad in ("importlib", "availability", "functools", "mlp_act", "rope "):
        with pytest.raises(ValueError, match=r"unknown kernel key .*valid keys.*'rmsnorm'.*'gated_mlp'"):
            ops.get(bad, "triton")
    with pytest.raises(ValueError, match="'availability'"):
        ops.get("availability", "pallas")
    with pytest.raises(TypeError, match="key must be a kernel key string.*got int"):
        ops.get(5, "triton")
    with pytest.raises(TypeError, match="backend must be.*got NoneType"):
        ops.get("rmsnorm", None)
    with pytest.raises(ValueError, match=r"unknown backend 'cuda'.*'triton'"):
        ops.get("rmsnorm", "cuda")
    need_backend("triton")
    assert callable(ops.get("rmsnorm", "triton"))


def test_patch_errors_name_the_argument_given():
    model = build_model("qwen2")
    for bad in (5, 1.5, object()):
        with pytest.raises(TypeError, match=r"kernels must be None, a kernel key or a list of them.*got"):
            forge.patch(model, kernels=bad)
    with pytest.raises(TypeError, match=r"kernels.*\[5\]"):
        forge.patch(model, kernels=["rmsnorm", 5])
    with pytest.raises(ValueError, match=r"unknown kernel key\(s\) \['rmsnrom'\].*'rmsnorm'.*'rope'"):
        forge.patch(model, kernels=["rmsnrom"])
    with pytest.raises(ValueError, match=r"backend='cuda'.*'auto', 'triton', 'pallas'") as e:
        forge.patch(model, backend="cuda")
    assert "rmsnorm" not in str(e.value)  # a kernel the user never mentioned
    with pytest.raises(ValueError, match=r"backend\['rope'\]='cuda'.*'auto', 'triton', 'pallas'"):
        forge.patch(model, backend={"rope": "cuda"})
    for bad in (5, None):  # the wrong type: TypeError; a wrong name: ValueError
        with pytest.raises(TypeError, match=r"mode must be a str, one of \('train', 'infer'\)"):
            forge.patch(model, mode=bad)
    with pytest.raises(ValueError, match=r"mode must be one of \('train', 'infer'\), got 'inference'"):
        forge.patch(model, mode="inference")
    assert not hasattr(model, "_forge_patched_counts")


def test_report_names_why_some_modules_were_declined():
    # a kernel patched on some modules and declined on others: the report's row keeps the reason
    model = build_model("qwen2")
    model.model.layers[0].mlp.act_fn = nn.GELU()
    forge.patch(model, backend=CPU_BACKEND, kernels=["swiglu"])
    row = forge.report(model).kernels["swiglu"]
    assert row.modules == model.config.num_hidden_layers - 1
    assert row.skipped and "model.layers.0.mlp" in row.skipped, row
    assert f"swiglu: {row.skipped}" in str(forge.report(model))


def test_report_on_a_module_forge_does_not_patch():
    r = forge.report(nn.Linear(2, 2))
    assert not r.patched and r.kernels == {}
    text = str(r)
    assert text.startswith("Linear: not patched by forge") and "not a Hugging Face" in text
    assert "forge.patch needs" not in text
    with pytest.raises(ValueError, match="Linear is not a model forge has patched"):
        forge.patching.guard_stats(nn.Linear(2, 2))
