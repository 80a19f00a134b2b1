"""Weights stored back to back for inference (forge.patching.stacking, ``STACK_INFER``): q/k/v
and gate/up each read by one product; the parameters keep their objects and values, unpatch
gives each its own memory again, and calls where the weights are apart again (or a gradient is
wanted) run the separate products."""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import forge  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.patching import stacking  # noqa: E402
from forge.patching.stacking import GATE_UP, QKV  # noqa: E402
from forge import ops  # noqa: E402
from oracle import need_backend  # noqa: E402
from test_decode import fake_graphs  # noqa: E402,F401  (the CUDA graphs' CPU stand-in)

BACKENDS = ops.BACKENDS

KERNELS = ["rmsnorm", "swiglu", "geglu", "rope", "qkv"]


@pytest.fixture
def stack_on(monkeypatch):
    monkeypatch.setattr(stacking, "STACK_INFER", True)


def _model(model_type="qwen2", dtype=torch.float32):
    return build_model(model_type, dtype=dtype).eval()


def _ids(model, b=2, s=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (b, s), generator=g)


def _groups(model):
    """(parent, names) of every projection group stacking applies to."""
    for m in model.modules():
        if all(isinstance(m._modules.get(n), torch.nn.Linear) for n in QKV):
            yield m, QKV
        if all(isinstance(m._modules.get(n), torch.nn.Linear) for n in GATE_UP):
            yield m, GATE_UP


def _own_memory(t):
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama", "gemma", "gemma2"])  # (qwen2: q/k/v biases; qwen3: q/k norms on views; gemma: GeGLU)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stacked_steps_equal_the_separate_products(model_type, backend, monkeypatch):
    need_backend(backend)
    model = _model(model_type)
    ref = copy.deepcopy(model)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    monkeypatch.setattr(stacking, "STACK_INFER", False)
    forge.patch(ref, mode="infer", backend=backend, kernels=KERNELS, min_elements=0)  # the same kernels, apart
    monkeypatch.setattr(stacking, "STACK_INFER", True)
    forge.patch(model, mode="infer", backend=backend, kernels=KERNELS, min_elements=0)
    # every group lies back to back in one block, each parameter the same object with its values
    for parent, names in _groups(model):
        assert stacking.stacked([parent._modules[n].weight for n in names]) is not None, names
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n
    # decoding-sized calls (one row per sequence) and a prompt, without gradients
    for s in (1, 7):
        ids = _ids(model, 3, s)
        with torch.no_grad():
            got, want = model(ids).logits, ref(ids).logits
        # fp32: the same dot products, summed in another order at most (a wider product)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    st = model._forge_guard_stats
    assert st.fused("qkv") == 2 * model.config.num_hidden_layers, st.as_dict()
    glu = "geglu" if model_type.startswith("gemma") else "swiglu"
    assert st.fused(glu) >= model.config.num_hidden_layers  # (the one-row calls at least: one product)
    forge.unpatch(model)
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]) and _own_memory(p), n


def test_on_by_default():
    model = _model()
    forge.patch(model, mode="infer", min_elements=0)
    assert model._forge_patched_counts.get("qkv") == model.config.num_hidden_layers
    for parent, names in _groups(model):
        assert stacking.stacked([parent._modules[n].weight for n in names]) is not None, names


def test_a_guard_that_never_fuses_keeps_the_kernel_out(stack_on):
    # a GLU threshold of forge.NEVER: weights stored together are read as one only in calls the
    # guard fuses, so a decoding-sized call runs the module's own code, counted as a fallback
    model = _model("llama")
    ref = copy.deepcopy(model)
    forge.patch(model, mode="infer", backend="triton", kernels=["swiglu"], min_elements={"swiglu": forge.NEVER})
    for mlp in (m for m in model.modules() if hasattr(m, "gate_proj")):
        assert stacking.stacked([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None
    ids = _ids(model, 2, 1)
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    st = model._forge_guard_stats
    assert st.fused("swiglu") == 0 and st.fallback("swiglu") == model.config.num_hidden_layers, st.as_dict()


def test_min_elements_never_stacks_nothing(stack_on):
    # min_elements=forge.NEVER asks for the model's own code on every call: no weights move
    model = _model()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    forge.patch(model, mode="infer", min_elements=forge.NEVER)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert "qkv" not in model._forge_patched_counts and "NEVER" in model._forge_skipped["qkv"]


def test_stacking_alone_with_graphs(stack_on):
    # kernels=["qkv"] in inference with graphs: the only "kernel" is torch's own product; the
    # decoding path attends with SDPA (no backend's attention kernel to pick) and patching works
    model = _model()
    forge.patch(model, mode="infer", kernels=["qkv"], graphs=True)
    assert model._forge_patched_counts["qkv"] == model.config.num_hidden_layers
    assert model._forge_graphs.decode.attends == "sdpa"
    forge.unpatch(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_weights_under_autocast(backend, stack_on):
    # float32 parameters under torch.autocast (bf16): the product over the weights stored
    # together is cast as the three module calls are; logits as the unpatched model's under
    # the same autocast, within bf16's rounding
    need_backend(backend)
    model = _model("llama")
    ref = copy.deepcopy(model)
    forge.patch(model, mode="infer", backend=backend, kernels=KERNELS, min_elements=0)
    ids = _ids(model, 2, 1)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(ids).logits, ref(ids).logits
    assert model._forge_guard_stats.fused("qkv") == model.config.num_hidden_layers
    eps = torch.finfo(torch.bfloat16).eps  # (one rounding of bf16)
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps * want.float().abs().max().item())


def test_inference_mode_and_peft_over_the_stacked_model(stack_on):
    # under torch.inference_mode the q/k/v hand-off has no version counter to read (inference
    # tensors keep none); peft's get_peft_model over the patched model wraps the projections
    # forge replaced and its adapters count
    peft = pytest.importorskip("peft")
    model = _model()
    ref = copy.deepcopy(model)
    forge.patch(model, mode="infer", backend=ops.auto_order()[0], min_elements=0)
    ids = _ids(model, 2, 3)
    with torch.no_grad():
        want = ref(ids).logits
        plain = model(ids).logits
    with torch.inference_mode():
        got = model(ids).logits
    assert torch.equal(got, plain)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    assert model._forge_guard_stats.fused("qkv") > 0
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(QKV), init_lora_weights=False)
    torch.manual_seed(3)
    pm = peft.get_peft_model(model, cfg).eval()
    torch.manual_seed(3)
    pref = peft.get_peft_model(ref, cfg).eval()
    with torch.inference_mode():
        got, want = pm(input_ids=ids).logits, pref(input_ids=ids).logits
    assert not torch.allclose(want, plain, rtol=1e-3, atol=1e-3)  # (the adapters change the logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_switched_off_nothing_moves(monkeypatch):
    monkeypatch.setattr(stacking, "STACK_INFER", False)
    model = _model()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    forge.patch(model, mode="infer", min_elements=0)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert "qkv" not in model._forge_patched_counts


def test_training_never_stacks(stack_on):
    model = _model()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    forge.patch(model, mode="train", min_elements=0)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs


def test_gradients_and_moved_weights_run_the_separate_products(monkeypatch):
    model = _model()
    ref = copy.deepcopy(model)
    kw = dict(mode="infer", backend="triton", kernels=KERNELS, min_elements=0)  # (triton: float64 below)
    monkeypatch.setattr(stacking, "STACK_INFER", False)
    forge.patch(ref, **kw)  # the same kernels, weights apart
    monkeypatch.setattr(stacking, "STACK_INFER", True)
    forge.patch(model, **kw)
    ids = _ids(model, 2, 1)
    st = model._forge_guard_stats
    # a call under autograd with parameters that require grad: the separate products, gradients right
    model(ids).logits.sum().backward()
    ref(ids).logits.sum().backward()
    assert st.fused("qkv") == 0 and st.fallback("qkv") == model.config.num_hidden_layers
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    # .to() gives every parameter its own tensor: no longer back to back, the separate products
    model.to(torch.float64)
    ref.to(torch.float64)
    parent, names = next(_groups(model))
    assert stacking.stacked([parent._modules[n].weight for n in names]) is None
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)  # the same products
    assert st.fused("qkv") == 0
    forge.unpatch(model)


def test_a_pre_hook_on_a_projection_keeps_its_own_product(stack_on):
    # a forward pre-hook may change the input its projection is called with: that projection's
    # group runs the separate products, and the hook's change shows in the logits
    model = _model()
    ref = copy.deepcopy(model)
    forge.patch(model, mode="infer", backend="triton", kernels=KERNELS, min_elements=0)
    attn = model.model.layers[0].self_attn
    hook = attn.k_proj.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
    ref.model.layers[0].self_attn.k_proj.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
    ids = _ids(model, 2, 1)
    st = model._forge_guard_stats
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    assert st.fallback("qkv") == 1 and st.fused("qkv") == model.config.num_hidden_layers - 1, st.as_dict()
    hook.remove()
    forge.unpatch(model)


def test_weights_already_together_are_left_so(stack_on):
    # tensors a loader placed back to back in one block (as a file's memory can hold them): used
    # as they lie, not moved, and unpatch leaves them so
    model = _model()
    for parent, names in _groups(model):
        ws = [parent._modules[n].weight for n in names]
        block = torch.cat([w.detach() for w in ws])
        o = 0
        for w in ws:
            w.data = block[o:o + w.shape[0]]
            o += w.shape[0]
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    forge.patch(model, mode="infer", kernels=KERNELS, min_elements=0)
    ws_ptrs = {n: p.data_ptr() for n, p in model.named_parameters() if "bias" not in n}
    assert ws_ptrs == {n: v for n, v in ptrs.items() if n in ws_ptrs}  # the weights stayed where they were
    with torch.no_grad():
        model(_ids(model))
    assert model._forge_guard_stats.fused("qkv") == model.config.num_hidden_layers
    forge.unpatch(model)
    parent, names = next(_groups(model))
    assert stacking.stacked([parent._modules[n].weight for n in names]) is not None


def test_save_pretrained_and_reload(stack_on, tmp_path):
    model = _model()
    forge.patch(model, mode="infer", kernels=KERNELS, min_elements=0)
    model.save_pretrained(tmp_path)  # transformers copies disjoint slices of one block before writing
    back = type(model).from_pretrained(tmp_path).eval()
    for (n, p), (_, q) in zip(model.named_parameters(), back.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_greedy_generate_equals_unpatched(stack_on):
    model = _model("llama")
    ref = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=KERNELS, min_elements=0)
    ids = _ids(model, 2, 5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_stacked_weights_keep_the_captured_decoding_path(stack_on, fake_graphs):
    # the one q/k/v product runs torch's own ops (backend "torch"), which a CUDA graph captures:
    # the decoding path must not decline the model for it (it did, 2026-12-06 on an H200: the
    # stacked variant of bench_generate ran uncaptured at a third of the speed)
    model = _model("llama")
    ref = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=KERNELS, min_elements=0, graphs=True)
    assert model._forge_backends["qkv"] == "torch"
    assert not [w for w in model._forge_graphs.stats.why if "decode" in w], model._forge_graphs.stats.why
    ids = _ids(model, 2, 5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    assert model._forge_graphs.stats.decode_captures >= 1, model._forge_graphs.stats
    assert model._forge_guard_stats.fused("qkv") > 0


def _storages(sd):
    return {t.untyped_storage().data_ptr() for t in sd.values()}


def test_state_dict_gives_each_weight_its_own_storage(stack_on, tmp_path):
    # savers that keep one tensor per storage (accelerate's save_model dropped every view but the
    # first: k, v and up missing from the checkpoint; safetensors' save_model refused the model):
    # state_dict() first gives the stacked weights their own memory, as unpatch does
    from safetensors.torch import load_file, save_model

    model = build_model("llama", tie_word_embeddings=False).eval()
    ref = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=KERNELS, min_elements=0)
    assert not all(_own_memory(p) for p in model.parameters())  # stacked
    sd = model.state_dict()
    assert all(_own_memory(p) for p in model.parameters())
    assert sd.keys() == ref.state_dict().keys() and len(_storages(sd)) == len(sd)
    save_model(model, tmp_path / "m.safetensors")
    back = load_file(tmp_path / "m.safetensors")
    assert back.keys() == ref.state_dict().keys()
    for n, t in ref.state_dict().items():
        assert torch.equal(back[n], t), n
    ids = _ids(model, 2, 3)
    with torch.no_grad():  # the separate products from now on, with the same results
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-6)
    forge.unpatch(model)
    assert all(not m._state_dict_pre_hooks for m in model.modules())


def test_a_pickled_copy_unpatches_to_own_memory(stack_on):
    # a pickle keeps the stacked weights' shared storage; the loaded copy (patched again as it
    # loads) knows them for forge's by the saving hooks it brings along: its unpatch and its
    # state_dict give each weight its own memory, as the original's do
    import io

    model = _model()
    forge.patch(model, mode="infer", kernels=KERNELS, min_elements=0)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert not all(_own_memory(p) for p in back.parameters())
    hooks = [h for m in back.modules() for h in m._state_dict_pre_hooks.values()]
    assert len(hooks) == sum(1 for _ in _groups(back))  # one saving hook per group, none doubled
    forge.unpatch(back)
    assert all(_own_memory(p) for p in back.parameters())
    assert all(not m._state_dict_pre_hooks for m in back.modules())
    for (n, p), q in zip(model.named_parameters(), back.parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("then", ["state_dict", "unpatch"])
def test_weights_pointed_elsewhere_after_patch_keep_their_memory(stack_on, then):
    # weights the user points at memory of their own after patching (a flat buffer) are not
    # forge's block any more: state_dict() and unpatch leave them there (they had copied every
    # weight that sat in a larger block, so later writes to the buffer stopped reaching them)
    model = _model()
    ref = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=KERNELS, min_elements=0)
    params = [p for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    o = 0
    for p in params:
        p.data = flat[o:o + p.numel()].view_as(p)
        o += p.numel()
    model.state_dict() if then == "state_dict" else forge.unpatch(model)
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in params)
    flat.mul_(0.5)  # reaches every weight, as in the unpatched model
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
        ids = _ids(model, 2, 3)
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["another_model", "flat_buffer"])
def test_weights_sharing_memory_at_patch_time_stay_where_they_are(stack_on, how):
    # TRL's reference model shares its first layers' storages with the policy's (ref.data =
    # policy.data); stacking moved them into forge's block: the sharing ended (a write to the
    # policy's weight no longer reached the reference) and the old memory stayed beside the block
    model = _model()
    ref = copy.deepcopy(model)
    if how == "another_model":
        other = copy.deepcopy(model)
        for p, q in zip(model.model.layers[0].parameters(), other.model.layers[0].parameters()):
            q.data = p.data
        shared = list(other.model.layers[0].parameters())
        target = other
    else:
        shared = list(model.model.layers[0].parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in shared])
        o = 0
        for p in shared:
            p.data = flat[o:o + p.numel()].view_as(p)
            o += p.numel()
        target = model
    before = [p.data_ptr() for p in shared]
    forge.patch(target, mode="infer", kernels=KERNELS, min_elements=0)
    assert [p.data_ptr() for p in shared] == before
    layer1 = target.model.layers[1].self_attn  # (nothing shared there: stacked as before)
    assert stacking.stacked([layer1._modules[n].weight for n in QKV]) is not None
    with torch.no_grad():
        for p in (model.model.layers[0].parameters() if how == "another_model" else shared):
            p.mul_(0.5)
        for p in ref.model.layers[0].parameters():
            p.mul_(0.5)
        ids = _ids(target, 2, 3)
        torch.testing.assert_close(target(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-6)


def test_a_copied_layer_brings_no_hooks_past_unpatch(stack_on):
    # a decoder layer deep-copied from an infer-patched model carries forge's saving hooks (a copy
    # of a part comes back unpatched, its weights its own); put into the model, unpatch removes them
    model = _model()
    forge.patch(model, mode="infer", kernels=KERNELS, min_elements=0)
    layer = copy.deepcopy(model.model.layers[1])
    layer.self_attn.layer_idx = 0
    assert any(m._state_dict_pre_hooks for m in layer.modules())
    model.model.layers[0] = layer
    forge.unpatch(model)
    assert all(not m._state_dict_pre_hooks for m in model.modules())
    assert all(_own_memory(p) for p in model.parameters())


def test_a_deep_copy_stacks_and_unstacks_its_own_weights(stack_on):
    # the copy is patched again (its parameters were copied one by one, then stacked anew): its
    # state_dict() and unpatch give them their own memory, as the original's do
    model = _model()
    forge.patch(model, mode="infer", kernels=KERNELS, min_elements=0)
    dup = copy.deepcopy(model)
    assert not all(_own_memory(p) for p in dup.parameters())
    dup.state_dict()
    assert all(_own_memory(p) for p in dup.parameters())
    forge.unpatch(dup)
    assert all(not m._state_dict_pre_hooks for m in dup.modules())


def test_a_failed_patch_unstacks(stack_on, monkeypatch):
    model = _model()
    import forge.patching.core as core

    def boom(*_a):
        raise RuntimeError("boom")

    monkeypatch.setattr(core, "_apply_fused_ce", boom)
    with pytest.raises(RuntimeError, match="boom"):
        forge.patch(model, mode="infer", kernels=KERNELS, min_elements=0)
    assert all(_own_memory(p) for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_stacked_generate_gpu(model_type, monkeypatch):
    """Real widths, bf16, forge's captured decoding steps on the stacked weights: greedy
    generate() by test_decode's rule (logits along both continuations against a float32 copy),
    the stacked products taken in the captured steps."""
    from test_decode import _check_generate, _model as _decode_model, _prompt

    monkeypatch.setattr(stacking, "STACK_INFER", True)
    model = _decode_model(model_type, "qwen05b", torch.bfloat16, "cuda")
    ids, mask = _prompt(model, 2, 32, "cuda")
    _check_generate(model, ids, mask, 20, torch.bfloat16, torch.float32, backend="triton", graphs=True)
    st = model._forge_graphs.stats
    assert st.decode_captures >= 1 and not [w for w in st.why if "capture failed" in w], st
    parent, names = next(_groups(model))
    assert stacking.stacked([parent._modules[n].weight for n in names]) is not None
    assert model._forge_guard_stats.fused("qkv") > 0
