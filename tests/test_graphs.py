"""CUDA graphs around the decoder layers (``forge.patch(model, graphs=True)``,
forge/patching/graphs.py).

On the CPU: the arguments, the refusals, and that every call there runs uncaptured and gives
exactly what forge without graphs gives. Under -m gpu: replayed training steps against the same
model patched without graphs (the same kernels, launched one by one), over optimizer steps,
gradient accumulation, two forwards before their backwards, a replaced parameter, a new shape,
hooks, retain_graph, deep copies and unpatch.
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import copy  # noqa: E402
import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import forge  # noqa: E402
from oracle import assert_step_close  # noqa: E402
from forge import ops  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.patching import graphs as graphs_mod  # noqa: E402
from forge.patching.core import PATCH_KEYS  # noqa: E402


def _ids(model, b, s, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (b, s), generator=g).to(device)
    labels = ids.clone()
    labels[:, :2] = -100
    return ids, labels


def _step(model, ids, labels, zero=True):
    if zero:
        model.zero_grad(set_to_none=True)
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.detach().clone(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


def _same(a, b, what):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb), f"{what}: loss {la.item()} != {lb.item()}"
    assert ga.keys() == gb.keys() and ga, f"{what}: different parameters got gradients"
    for n in ga:
        assert torch.equal(ga[n], gb[n]), f"{what}: grad {n} differs by {(ga[n] - gb[n]).abs().max().item()}"


# ---------------------------------------------------------------------------------------------
# CPU: arguments, refusals, uncaptured calls


def test_bad_graphs_arguments():
    model = build_model("qwen2")
    with pytest.raises(TypeError, match="graphs must be True or False"):
        forge.patch(model, graphs="yes")
    with pytest.raises(TypeError, match="recompute_mlp must be True or False"):
        forge.patch(model, recompute_mlp=1)
    assert not hasattr(model, "_forge_state")


def bridge_interpret() -> bool:
    from bridge import runtime

    return runtime.interpret()


def test_graphs_take_pallas_only_when_launched_natively():
    ok, why = ops.availability("pallas")
    if not ok:
        pytest.skip(why)
    from bridge import native

    # where the Pallas kernels take tensors here: the GPU where JAX has one, else the CPU
    model = build_model("qwen2", device="cpu" if bridge_interpret() else "cuda")
    native_ok, _ = native.available()
    if native_ok:  # launched on torch's stream: capturable
        forge.patch(model, backend={"rmsnorm": "pallas"}, graphs=True)
        assert model._forge_graphs is not None
        return
    with pytest.raises(ValueError, match="'rmsnorm' runs on 'pallas', whose native launch is unavailable"):
        forge.patch(model, backend={"rmsnorm": "pallas"}, graphs=True)
    assert not [m for m in model.modules() if "forward" in m.__dict__], "a refused patch left forwards behind"


def test_graphs_accept_pallas_wherever_it_launches_natively(monkeypatch):
    # the decision alone (CPU): with the native path available, no other check refuses Pallas
    ok, why = ops.availability("pallas")
    if not ok:
        pytest.skip(why)
    from bridge import native

    monkeypatch.setattr(native, "available", lambda: (True, ""))
    model = build_model("qwen2", device="cpu" if bridge_interpret() else "cuda")
    forge.patch(model, backend="pallas", graphs=True)
    # (the q/k/v fusion runs torch's own product: backend "torch")
    backends = dict(model._forge_backends)
    assert backends.pop("qkv") == "torch"
    assert model._forge_graphs is not None and set(backends.values()) == {"pallas"}
    forge.unpatch(model)


# CPU models through the interpreted kernels; a CUDA process compiles Triton for the GPU and refuses
# a CPU model, so on a GPU machine the gpu twins (test_compiled_replay_meets_the_oracle,
# test_compiled_lora_replay_meets_the_oracle, test_replayed_steps_match_uncaptured) run instead
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU model through the interpreted kernels: a CUDA "
                              "process compiles Triton for the GPU; the gpu-marked twins run there")


@CPU_ONLY
def test_cpu_calls_run_uncaptured_and_unpatch_restores():
    model = build_model("qwen2", attn_implementation="sdpa")
    ids, labels = _ids(model, 2, 8, "cpu")
    with torch.no_grad():
        before = model(ids).logits
    forge.patch(model, kernels=["fused_linear_ce"])  # interpreted kernels: keep them few
    plain = _step(model, ids, labels)
    forge.patch(model, kernels=["fused_linear_ce"], graphs=True)
    assert model._forge_patched_counts == {"fused_linear_ce": 1, "graphs": 2}
    g = model._forge_graphs
    _same(_step(model, ids, labels), plain, "uncaptured on the CPU")
    assert g.stats.replayed == 0 and g.stats.captures == 0
    assert g.stats.uncaptured == 1 and g.stats.why == {"hidden states not a CUDA tensor": 1}
    with torch.no_grad():
        model(ids)
    assert g.stats.why == {"hidden states not a CUDA tensor": 2}
    forge.unpatch(model)
    assert not [m for m in model.modules() if "forward" in m.__dict__] and not hasattr(model, "_forge_graphs")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_transformers_recording_hooks_count_only_while_a_call_records():
    # transformers installs its output-recording hooks the first time a call asks for hidden
    # states (or attentions, or router logits) and leaves them: between such calls they return at
    # once and do not keep passes from being captured; while a call records, or any other hook,
    # they do
    recording = pytest.importorskip("transformers.utils.output_capturing",
                                    reason="transformers without output-recording hooks (before 5.x)")
    model = build_model("qwen2", attn_implementation="sdpa")
    forge.patch(model, kernels=["rmsnorm"], graphs=True)
    g = model._forge_graphs
    assert not g._hooked()
    ids, _ = _ids(model, 1, 4, "cpu")
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert any(m._forward_hooks for m in model.model.layers.modules()), "transformers installed no hooks"
    assert not g._hooked()
    token = recording._active_collector.set({"hidden_states": []})
    try:
        assert g._hooked()
    finally:
        recording._active_collector.reset(token)
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert g._hooked()
    handle.remove()
    assert not g._hooked()


def test_fused_loss_asks_for_no_kv_cache_unless_given(device):
    model = build_model("qwen2", attn_implementation="sdpa").to(device)
    ids, labels = _ids(model, 1, 6, device)
    forge.patch(model, kernels=["fused_linear_ce"])
    out = model(ids, labels=labels)
    assert out.logits is None and out.past_key_values is None
    out = model(ids, labels=labels, use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 6


def test_deepcopy_of_a_graphs_patched_model_runs():
    model = build_model("qwen2", attn_implementation="sdpa")
    forge.patch(model, kernels=["fused_linear_ce"], graphs=True)
    dup = copy.deepcopy(model)
    ids, labels = _ids(model, 1, 6, "cpu")
    _same(_step(dup, ids, labels), _step(model, ids, labels), "deep copy")
    # the copy is patched again: its own graphs, over its own layers
    assert dup._forge_graphs is not model._forge_graphs and dup._forge_graphs.layers[0] is dup.model.layers[0]


def _compiled_step(compiled, model, ids, labels):
    """_step through a compiled wrapper (gradients read off the model's own names)."""
    model.zero_grad(set_to_none=True)
    loss = compiled(ids, labels=labels).loss
    loss.backward()
    return loss.detach().clone(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


@CPU_ONLY
def test_under_compile_each_layer_is_one_op(monkeypatch):
    """graphs=True under torch.compile(fullgraph=True): each decoder layer is one
    forge::graph_layer op. On the CPU (let through the op here; a CPU model's calls never
    replay) the op runs the layer uncaptured, recorded and differentiated by autograd inside it,
    and the compiled step equals the eager patched one bit for bit."""
    monkeypatch.setattr(graphs_mod, "OP_DEVICES", ("cuda", "cpu"))
    model = build_model("qwen2", attn_implementation="sdpa")
    plain = copy.deepcopy(model)
    forge.patch(plain, kernels=["fused_linear_ce"])
    forge.patch(model, kernels=["fused_linear_ce"], graphs=True)
    ids, labels = _ids(model, 2, 8, "cpu")
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(ids, labels=labels)
    assert ex.graph_break_count == 0
    code = "".join(g.code for g in ex.graphs)
    assert code.count("forge.graph_layer") == model.config.num_hidden_layers, code
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for step in range(3):
        _same(_compiled_step(compiled, model, ids, labels), _step(plain, ids, labels), f"compiled step {step}")
    g = model._forge_graphs
    assert g.stats.replayed == 0 and g.stats.why.get("hidden states not a CUDA tensor", 0) >= 3
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, plain(ids).logits)
    # two forwards before a backward: the first's activations are gone, its backward says so
    l1 = compiled(ids, labels=labels).loss
    l2 = compiled(ids, labels=labels).loss
    with pytest.raises(RuntimeError, match="another forward ran before this backward"):
        (l1 + l2).backward()
    # a hooked layer (FSDP2 hooks every layer) is traced as it is, not as the op
    h = model.model.layers[0].register_forward_pre_hook(lambda *a: None)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(ids, labels=labels)
    assert "".join(g.code for g in ex.graphs).count("forge.graph_layer") == model.config.num_hidden_layers - 1
    h.remove()
    # torch.compile's own CUDA graphs over forge's: refused while inductor traces, in words
    torch._dynamo.reset()
    with pytest.raises(Exception, match="mode='reduce-overhead'"):
        torch.compile(model, fullgraph=True, mode="reduce-overhead")(ids, labels=labels)
    torch._dynamo.reset()
    forge.unpatch(model)
    assert not [m for m in model.modules() if "forward" in m.__dict__]


def _peft_lora(model, dropout):
    """``model`` under peft LoRA adapters on every projection, B drawn (peft starts it at zero)
    so the adapters' gradients show."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, bias="none",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02)
    return model


@CPU_ONLY
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_under_compile_lora_layers_are_ops(monkeypatch, dropout):
    """A peft LoRA model with graphs=True under torch.compile: each layer one op whose
    trainable parameters are the adapters (the frozen weights are read inside it); on the CPU
    the compiled step equals the eager patched step bit for bit, dropout masks included (drawn
    inside the op from the same seed)."""
    pytest.importorskip("peft", reason="peft is not installed")
    monkeypatch.setattr(graphs_mod, "OP_DEVICES", ("cuda", "cpu"))
    model = _peft_lora(build_model("qwen2", attn_implementation="sdpa"), dropout)
    plain = copy.deepcopy(model)
    keys = ["fused_linear_ce", "lora_qkv", "lora_mlp"]
    # one backend for both: graphs=True takes Triton for the layer kernels where "auto" would
    # give a CPU model Pallas, and the two round differently
    forge.patch(plain, kernels=keys, backend="triton")
    forge.patch(model, kernels=keys, backend="triton", graphs=True)
    assert model._forge_patched_counts.get("lora_qkv") == model.config.num_hidden_layers
    ids, labels = _ids(model, 2, 8, "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(2):
        torch.manual_seed(step)
        got = _compiled_step(compiled, model, ids, labels)
        torch.manual_seed(step)
        _same(got, _step(plain, ids, labels), f"compiled lora step {step}")
        assert all("lora_" in n for n in got[1])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    why = model._forge_graphs.stats.why
    assert why.get("hidden states not a CUDA tensor", 0) >= 2, why
    torch._dynamo.reset()
    forge.unpatch(model)


def test_the_layer_op_passes_opcheck():
    """torch.library.opcheck on forge::graph_layer (schema, autograd registration, fake, and a
    traced forward + backward through its backward op), called as a compiled step calls it; on
    the CPU its calls run the layer uncaptured inside the op."""
    model = build_model("qwen2", attn_implementation="sdpa")
    forge.patch(model, kernels=["fused_linear_ce"], graphs=True)
    layer = model.model.layers[0]
    x = torch.randn(2, 8, model.config.hidden_size, requires_grad=True)
    cos, sin = model.model.rotary_emb(x, torch.arange(8)[None].expand(2, 8))
    params = [p for p in layer.parameters() if p.requires_grad]
    torch.library.opcheck(torch.ops.forge.graph_layer.default,
                          (x, cos, sin, params, model._forge_graphs.gid, 0, True, True))
    forge.unpatch(model)

# ---------------------------------------------------------------------------------------------
# GPU: replays against the uncaptured kernels

ARCHS = ["qwen2", "qwen3", "gemma", "gemma2"]


def _gpu_model(model_type, layers=3, dtype=torch.bfloat16):
    return build_model(model_type, "gpu_demo", dtype=dtype, device="cuda", attn_implementation="sdpa",
                       num_hidden_layers=layers)


def _twins(model_type, recompute_mlp=False, backend="triton", **kw):
    """Two identical models: one patched without graphs, one with (both without the q/k/v
    fusion, which only captured calls run: tests/test_qkv.py checks it against the oracle)."""
    a = _gpu_model(model_type, **kw)
    b = copy.deepcopy(a)
    keys = [k for k in PATCH_KEYS if k != "qkv"]
    forge.patch(a, backend=backend, min_elements=0, recompute_mlp=recompute_mlp, kernels=keys)
    forge.patch(b, backend=backend, min_elements=0, recompute_mlp=recompute_mlp, kernels=keys, graphs=True)
    return a, b


@pytest.fixture
def math_sdpa():
    """SDPA's math backend: flash attention's backward accumulates dq with atomics, so two runs
    of the same step may differ in the last bits; with the math backend every kernel of the
    step is deterministic and a replay must give exactly the uncaptured step's bits."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def _sgd(model, lr=1e-2):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,recompute_mlp,backend",
                         [(a, False, "triton") for a in ARCHS] + [("qwen2", True, "triton")]
                         + [("qwen2", False, "pallas"), ("gemma2", False, "pallas"), ("qwen2", True, "pallas")]
                         # mixtures of experts: the routing has no host sync, so their layers capture
                         + [("qwen3_moe", False, "triton"), ("mixtral", False, "pallas"), ("olmoe", False, "triton")])
def test_replayed_steps_match_uncaptured(model_type, recompute_mlp, backend, math_sdpa):
    plain, graphed = _twins(model_type, recompute_mlp, backend)
    ids, labels = _ids(plain, 2, 256, "cuda")
    for step in range(4):  # optimizer steps in between: the graphs read the updated weights
        _same(_step(graphed, ids, labels), _step(plain, ids, labels), f"{model_type} step {step}")
        _sgd(plain)
        _sgd(graphed)
    st = graphed._forge_graphs.stats
    # a shape is captured the second time it comes: step 0 uncaptured, 1 captures, 2-3 replay
    assert st.captures == 1 and st.replayed == 3 and st.why == {"first call of this shape": 1}, st


@pytest.mark.gpu
def test_forward_sets_in_and_out_of_inference_mode(math_sdpa):
    # a set captured under torch.inference_mode holds inference tensors, which a pass outside it
    # could not copy its input into: each mode captures its own set
    plain, graphed = _twins("qwen2")
    ids, _ = _ids(plain, 2, 128, "cuda")
    for ctx in (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad):
        for _ in range(3):  # uncaptured, captured, replayed (then replayed thrice)
            with ctx():
                got, want = (m(ids, use_cache=False).logits for m in (graphed, plain))
            assert torch.equal(got, want), ctx.__name__
    st = graphed._forge_graphs.stats
    assert st.captures == 2 and st.replayed == 2 * 2 + 2 * 3, st  # (a capturing call replays too)


@pytest.mark.gpu
def test_device_bound_passes_run_uncaptured(monkeypatch, math_sdpa):
    """A pass at or above graphs.DEVICE_BOUND_ELEMENTS hidden-state elements is never captured
    (no graphs, no pool held) and steps exactly as plain forge.patch; a smaller one still is."""
    plain, graphed = _twins("qwen2")
    small_ids, small_labels = _ids(plain, 1, 64, "cuda")
    ids, labels = _ids(plain, 2, 256, "cuda")
    monkeypatch.setattr(graphs_mod, "DEVICE_BOUND_ELEMENTS", 2 * 256 * plain.config.hidden_size)
    for step in range(3):
        _same(_step(graphed, ids, labels), _step(plain, ids, labels), f"device-bound step {step}")
    st = graphed._forge_graphs.stats
    assert st.captures == 0 and st.replayed == 0 and graphed._forge_graphs.sets == {}, st
    assert list(st.why) == [f"bound by the device (hidden states of {2 * 256 * plain.config.hidden_size} "
                            "elements or more)"] and st.why[next(iter(st.why))] == 3, st
    for step in range(3):
        _same(_step(graphed, small_ids, small_labels), _step(plain, small_ids, small_labels), f"small step {step}")
    assert st.captures == 1 and st.replayed == 2, st  # small steps: 0 uncaptured, 1 captures, 2 replays


@pytest.mark.parametrize("model_type,scale", [("qwen2", 1), ("olmoe", None), ("mixtral", None)])
def test_mixtures_of_experts_stay_captured_to_larger_passes(model_type, scale):
    # the device-bound size is scaled by num_experts / top_k for a mixture of experts' layers
    # (capped), by 1 for dense ones
    model = build_model(model_type)
    cfg = model.config
    mods = [list(layer.modules()) for layer in model.model.layers]
    if scale is None:
        e = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        scale = min(graphs_mod.MOE_BOUND_SCALE, e // cfg.num_experts_per_tok)
        assert scale > 1
    assert graphs_mod._bound_scale(cfg, mods) == scale
    assert graphs_mod._bound_scale(types.SimpleNamespace(), mods) == 1  # a config it cannot read: the dense bound


@pytest.mark.gpu
def test_gradient_accumulation_and_two_forwards_before_backward(math_sdpa):
    plain, graphed = _twins("qwen2")
    a, la = _ids(plain, 2, 128, "cuda", seed=1)
    b, lb = _ids(plain, 2, 128, "cuda", seed=2)
    g = graphed._forge_graphs
    _step(graphed, a, la)  # the shape's first call: uncaptured
    # accumulation: two micro-batches into the same .grad
    for m in (plain, graphed):
        _step(m, a, la)
    _same(_step(graphed, b, lb, zero=False), _step(plain, b, lb, zero=False), "accumulated")
    assert g.stats.replayed == 2
    # two forwards, then both backwards: the second forward must not overwrite the first's
    # activations (it runs uncaptured)
    res = []
    for m in (plain, graphed):
        m.zero_grad(set_to_none=True)
        l1 = m(a, labels=la).loss
        l2 = m(b, labels=lb).loss
        (l1 + 2 * l2).backward()
        res.append(((l1 + 2 * l2).detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    _same(res[1], res[0], "two forwards, one backward")
    assert g.stats.why.get("an earlier replay's backward has not run") == 1
    # a forward whose graph was dropped without a backward does not block the next replay
    graphed(a, labels=la)
    n = g.stats.replayed
    _step(graphed, a, la)
    assert g.stats.replayed == n + 1


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,recompute_mlp", [("qwen2", True), ("gemma2", False)])
def test_flash_attention_replay_meets_the_oracle(model_type, recompute_mlp):
    """The default SDPA backend (flash attention, not bit-reproducible in backward): the replayed
    step against an fp32 copy of the unpatched model, with the unpatched bf16 model as the eager
    baseline (tests/oracle.py's rule, as tests/test_models.py)."""
    model = _gpu_model(model_type)
    ids, labels = _ids(model, 2, 256, "cuda")
    ref = _step(copy.deepcopy(model).float(), ids, labels)
    eager = _step(model, ids, labels)
    forge.patch(model, backend="triton", graphs=True, recompute_mlp=recompute_mlp)
    for _ in range(3):  # uncaptured, captured, replayed
        got = _step(model, ids, labels)
    assert model._forge_graphs.stats.replayed == 2
    assert_step_close(got, ref, eager, model.config, ids.numel())


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,recompute_mlp,backend", [("qwen2", False, "triton"), ("qwen3", True, "triton"),
                                                               ("gemma", False, "triton"), ("qwen2", False, "pallas")])
def test_compiled_replay_meets_the_oracle(model_type, recompute_mlp, backend):
    """graphs=True, then torch.compile(fullgraph=True) with inductor: the layers replay their
    graphs from inside the compiled step (one op each); loss and gradients against an fp32
    copy of the unpatched model, with the unpatched bf16 model as the eager baseline."""
    model = _gpu_model(model_type)
    ids, labels = _ids(model, 2, 256, "cuda")
    ref = _step(copy.deepcopy(model).float(), ids, labels)
    eager = _step(model, ids, labels)
    # min_elements=0: the uncaptured calls run the kernels the captured ones do (a capture fuses
    # every call), so the no-grad check below can ask for the same bits; for the same reason no
    # q/k/v fusion, which only captured calls run (tests/test_qkv.py)
    forge.patch(model, backend=backend, graphs=True, recompute_mlp=recompute_mlp, min_elements=0,
                kernels=[k for k in PATCH_KEYS if k != "qkv"])
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for _ in range(4):  # uncaptured, captured, replayed twice
        got = _compiled_step(compiled, model, ids, labels)
    st = model._forge_graphs.stats
    assert st.captures == 1 and st.replayed == 3 and st.why == {"first call of this shape": 1}, st
    assert_step_close(got, ref, eager, model.config, ids.numel())
    # without grad: the forward's graphs (a set of their own: uncaptured, captured, replayed);
    # the replay gives the uncaptured layers' bits
    with torch.no_grad():
        outs = [compiled(ids, use_cache=False).logits for _ in range(3)]
    assert st.captures == 2 and st.replayed == 5, st
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])


@pytest.mark.gpu
def test_compiled_lora_replay_meets_the_oracle():
    """A peft LoRA model, graphs=True, then torch.compile with inductor: the layers replay from
    inside the compiled step; the loss and the adapters' gradients against an fp32 copy of the
    unpatched model, with the unpatched bf16 model as the eager baseline."""
    pytest.importorskip("peft", reason="peft is not installed")
    model = _peft_lora(_gpu_model("qwen2"), 0.0)
    ids, labels = _ids(model, 2, 256, "cuda")
    ref = _step(copy.deepcopy(model).float(), ids, labels)
    eager = _step(model, ids, labels)
    forge.patch(model, backend="triton", graphs=True, min_elements=0)
    assert model._forge_patched_counts.get("lora_qkv") == 3
    torch._dynamo.reset()
    compiled = torch.compile(model)
    for _ in range(4):  # uncaptured, captured, replayed twice
        got = _compiled_step(compiled, model, ids, labels)
    st = model._forge_graphs.stats
    assert st.captures == 1 and st.replayed == 3 and st.why == {"first call of this shape": 1}, st
    assert ref[1].keys() == got[1].keys() and all("lora_" in n for n in got[1])
    assert_step_close(got, ref, eager, model.config, ids.numel())
    torch._dynamo.reset()


@pytest.mark.gpu
def test_retain_graph_second_backward_raises():
    _plain, graphed = _twins("qwen2")
    ids, labels = _ids(graphed, 2, 64, "cuda")
    _step(graphed, ids, labels)  # first call of the shape: uncaptured
    loss = graphed(ids, labels=labels).loss
    assert graphed._forge_graphs.stats.replayed == 1
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


@pytest.mark.gpu
def test_replaced_parameter_new_shape_hooks_and_no_grad(math_sdpa):
    plain, graphed = _twins("qwen2")
    ids, labels = _ids(plain, 2, 128, "cuda")
    g = graphed._forge_graphs
    for _ in range(2):
        _same(_step(graphed, ids, labels), _step(plain, ids, labels), "first")
    assert g.stats.captures == 1
    # a parameter replaced by a new tensor: the set is captured again
    for m in (plain, graphed):
        lin = m.model.layers[1].mlp.down_proj
        lin.weight = nn.Parameter(lin.weight.detach() * 0.5)
    _same(_step(graphed, ids, labels), _step(plain, ids, labels), "replaced weight")
    assert g.stats.captures == 2
    # another shape: another set, from its second call, in the same pool: its activations reuse
    # the memory of the first set's (the sum would be 1.75x the first's alone)
    held = graphs_mod.graph_pool_bytes(graphed)
    ids2, labels2 = _ids(plain, 2, 96, "cuda")
    for _ in range(2):
        _same(_step(graphed, ids2, labels2), _step(plain, ids2, labels2), "second shape")
    assert len(g.sets) == 2
    assert graphs_mod.graph_pool_bytes(graphed) <= 1.3 * held, (held, graphs_mod.graph_pool_bytes(graphed))
    _same(_step(graphed, ids, labels), _step(plain, ids, labels), "first shape again")
    # a forward hook on a module inside a layer: uncaptured (a replay would not call it)
    seen = []
    h = graphed.model.layers[0].self_attn.register_forward_hook(lambda *a: seen.append(1))
    _same(_step(graphed, ids, labels), _step(plain, ids, labels), "hooked")
    assert seen and g.stats.why.get("module hooks") == 1
    h.remove()
    # without grad (a KV cache by default): a forward-only set, replayed from the second call
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(graphed(ids).logits, plain(ids).logits)
    assert len(g.sets) == 3


@pytest.mark.gpu
def test_unpatch_releases_the_graphs():
    _plain, graphed = _twins("qwen2")
    ids, labels = _ids(graphed, 2, 256, "cuda")
    for _ in range(2):
        _step(graphed, ids, labels)
    assert graphs_mod.graph_pool_bytes(graphed) > 0
    graphed.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    forge.unpatch(graphed)
    torch.cuda.empty_cache()  # no gc.collect(): nothing of the graphs may wait for one
    assert torch.cuda.memory_reserved() < held, "unpatch left the graph pool reserved"
    assert not [m for m in graphed.modules() if "forward" in m.__dict__]


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_peft_lora_replay_matches_uncaptured(dropout, math_sdpa):
    """LoRA adapters (forge's lora_qkv / lora_mlp inside the captured layers): only the adapters
    train, the frozen base weights are read by the graphs. With lora_dropout the masks are drawn
    inside the graphs: seeded alike, a replay draws the uncaptured step's masks (fresh each step)."""
    pytest.importorskip("peft", reason="peft is not installed")
    plain = _peft_lora(_gpu_model("qwen2"), dropout)
    graphed = copy.deepcopy(plain)
    forge.patch(plain, backend="triton", min_elements=0)
    forge.patch(graphed, backend="triton", min_elements=0, graphs=True)
    assert graphed._forge_patched_counts.get("lora_qkv") == 3 and graphed._forge_patched_counts.get("graphs") == 3
    ids, labels = _ids(plain, 2, 128, "cuda")
    losses = []
    for step in range(3):
        torch.manual_seed(step)
        got = _step(graphed, ids, labels)
        torch.manual_seed(step)
        _same(got, _step(plain, ids, labels), f"lora step {step}")
        losses.append(got[0])
        _sgd(plain)
        _sgd(graphed)
    assert graphed._forge_graphs.stats.replayed == 2
    if dropout:  # replays draw new masks: the same weights give another loss under another seed
        seeded = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            seeded.append(_step(graphed, ids, labels)[0])
        assert not torch.equal(*seeded) and graphed._forge_graphs.stats.replayed == 4


@pytest.mark.gpu
def test_peft_expert_lora_replay_matches_uncaptured(math_sdpa):
    """peft's LoRA on the expert weights (forge's forward of peft's wrapper: the factors read
    inside the captured layer) and on attention: replays bit-equal to uncaptured steps as the
    adapters train."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    plain = peft.get_peft_model(_gpu_model("qwen3_moe"), cfg)
    with torch.no_grad():
        for n, p in plain.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02)
    graphed = copy.deepcopy(plain)
    forge.patch(plain, backend="triton", min_elements=0)
    forge.patch(graphed, backend="triton", min_elements=0, graphs=True)
    ids, labels = _ids(plain, 2, 128, "cuda")
    for step in range(3):
        _same(_step(graphed, ids, labels), _step(plain, ids, labels), f"expert lora step {step}")
        _sgd(plain)
        _sgd(graphed)
    assert graphed._forge_graphs.stats.replayed == 2, graphed._forge_graphs.stats
    assert graphed._forge_guard_stats.fallback("experts") == 0


@pytest.mark.gpu
def test_inference_prefill_replays_into_the_kv_cache(math_sdpa):
    plain = _gpu_model("gemma2").eval()  # gemma2: sliding-window cache layers too
    graphed = copy.deepcopy(plain)
    forge.patch(plain, mode="infer", backend="triton", min_elements=0)
    forge.patch(graphed, mode="infer", backend="triton", min_elements=0, graphs=True)
    g = graphed._forge_graphs
    with torch.no_grad():
        for seed in range(3):  # new inputs each time; captured at the second
            ids, _ = _ids(plain, 2, 128, "cuda", seed=seed)
            a, b = graphed(ids), plain(ids)  # HF's default use_cache=True: an empty DynamicCache
            assert torch.equal(a.logits, b.logits), seed
            for la, lb in zip(a.past_key_values.layers, b.past_key_values.layers):
                assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values), seed
    assert g.stats.captures == 1 and g.stats.replayed == 2
    # generate() is forge.patching.decode's (tests/test_decode.py checks its tokens): a static
    # cache, its prefill uncaptured here, its decoding steps captured whole (3 per call: two
    # warm up, then they replay)
    ids, _ = _ids(plain, 1, 16, "cuda")
    for _ in range(2):
        assert graphed.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 20)
    assert g.stats.captures == 1 and g.stats.replayed == 2
    assert g.stats.decode_captures == 1 and g.stats.decode_replayed == 4, g.stats
    prefill = ("attention mask", "KV cache (not an empty DynamicCache in a forward without grad)")
    assert sum(g.stats.why.get(w, 0) for w in prefill) == 2, g.stats


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["olmoe", "qwen3_moe"])
def test_moe_inference_replays_and_router_logits_run_uncaptured(model_type, math_sdpa):
    # a mixture of experts' decoder loop passes output_router_logits to its layers: false, the
    # prefill replays; true, transformers records the router logits with hooks, and the pass
    # runs uncaptured with the same logits and router logits
    plain = _gpu_model(model_type).eval()
    graphed = copy.deepcopy(plain)
    forge.patch(plain, mode="infer", backend="triton", min_elements=0)
    forge.patch(graphed, mode="infer", backend="triton", min_elements=0, graphs=True)
    g = graphed._forge_graphs
    with torch.no_grad():
        for seed in range(3):
            ids, _ = _ids(plain, 2, 64, "cuda", seed=seed)
            assert torch.equal(graphed(ids).logits, plain(ids).logits), seed
        assert g.stats.captures == 1 and g.stats.replayed == 2, g.stats
        a, b = graphed(ids, output_router_logits=True), plain(ids, output_router_logits=True)
    assert torch.equal(a.logits, b.logits)
    assert len(a.router_logits) == len(b.router_logits) == plain.config.num_hidden_layers
    assert all(torch.equal(x, y) for x, y in zip(a.router_logits, b.router_logits))
    assert g.stats.replayed == 2 and g.stats.why.get("module hooks", 0) + g.stats.why.get("router logits recorded", 0) == 1


def test_a_cublas_workspace_clear_makes_captured_sets_stale(monkeypatch):
    # torch.compile's CUDA graph trees clear torch's cuBLAS workspaces around every recording; a
    # layer set captured before a clear would replay over the freed workspace: it counts as
    # changed (captured again on its next use)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None, raising=False)
    graphs_mod.watch_workspaces()
    graphs_mod.watch_workspaces()  # once: a second call does not wrap the wrapper
    s = graphs_mod._Set(grad=False)
    assert s.unchanged()
    n = graphs_mod.workspace_epoch()
    torch._C._cuda_clearCublasWorkspaces()
    assert graphs_mod.workspace_epoch() == n + 1
    assert not s.unchanged() and graphs_mod._Set(grad=False).unchanged()


@pytest.mark.gpu
def test_a_failed_capture_leaves_the_process_as_it_was_gpu():
    # torch leaves the capture stream current, the pool recording and the CUDA generators in
    # their capture state when a capture fails; after forge's recording() the caller's stream
    # is current, random draws work and the next capture (another decoding signature, another
    # layer set) captures and replays right
    from types import SimpleNamespace

    from forge.patching.graphs import capture_stream, recording

    dev = torch.device("cuda")
    side, owner, cur = capture_stream(dev), SimpleNamespace(pool=None), torch.cuda.current_stream(dev)
    x = torch.ones(4096, device=dev)
    with pytest.raises(Exception):
        with recording(torch.cuda.CUDAGraph(), owner, side):
            torch.rand(8, device=dev)
            (x * 2).sum().item()  # a host sync: the capture is invalidated
    assert torch.cuda.current_stream(dev) == cur
    torch.rand(8, device=dev)
    g = torch.cuda.CUDAGraph()
    with recording(g, owner, side):
        y = x * 3 + torch.rand(4096, device=dev) * 0
    x.fill_(2.0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 6.0))


@pytest.mark.gpu
def test_another_threads_cuda_calls_leave_a_capture_alone_gpu():
    # forge captures in torch's "thread_local" mode (graphs.CAPTURE_MODE): a CUDA call that
    # synchronises, made by another thread on its own stream while a capture runs (as a runtime's
    # worker threads may), neither fails there nor invalidates the capture, which replays right
    import threading
    from types import SimpleNamespace

    from forge.patching.graphs import capture_stream, recording

    dev = torch.device("cuda")
    side, owner = capture_stream(dev), SimpleNamespace(pool=None)
    x = torch.ones(4096, device=dev)
    other, done = {}, threading.Event()

    def work():
        try:
            with torch.cuda.stream(torch.cuda.Stream(device=dev)):
                other["sum"] = float(torch.full((1 << 20,), 2.0, device=dev).sum())  # (a host sync)
        except Exception as e:  # noqa: BLE001 - asserted below
            other["error"] = e
        done.set()

    g = torch.cuda.CUDAGraph()
    with recording(g, owner, side):
        y = x * 3
        t = threading.Thread(target=work)
        t.start()
        assert done.wait(60)
        y = y + 1
    t.join()
    assert other == {"sum": float(2 << 20)}, other
    x.fill_(2.0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 7.0))
