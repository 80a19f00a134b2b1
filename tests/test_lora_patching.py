"""peft LoRA models patched with forge's fused lora_qkv / lora_mlp (forge/patching/lora.py).

Tiny random models of every architecture (forge.__main__.build_model: save_pretrained and
from_pretrained) get LoRA on q, k, v, o, gate, up, down. The patched model's loss and every
adapter gradient meet the oracle's rule (forge/spec/tolerance.py) against the unpatched model
run in float64, with the unpatched fp32 model as the eager baseline; base weights get no
gradient. Adapters that do not fit are left to peft with a reason; call-time state (disabled,
merged, another adapter) falls back per call; unpatch restores; re-patching picks up new layers.
Only the two LoRA kernels are patched here (the full patch with LoRA is in test_models.py).
"""
from __future__ import annotations

import forge_triton  # noqa: F401  (first: sets TRITON_INTERPRET before peft imports triton)
import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import forge  # noqa: E402
from forge import ops  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.spec import lora_dropout as forge_lora_dropout  # noqa: E402
from forge.spec import tolerance  # noqa: E402

peft = pytest.importorskip("peft")

LORA = ["lora_qkv", "lora_o", "lora_mlp"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# qwen2 (q/k/v biases), qwen3 (q/k norms), gemma, gemma2 (softcapping) and llama (the plain
# one); mistral is llama's layout. Pallas compiles each model's shapes for seconds in its
# interpreter: on CPU two architectures cover it (bias + silu, no bias + gelu_tanh); on a GPU all
ARCHS = ("qwen2", "qwen3", "gemma", "gemma2", "llama")
PALLAS_CPU = ("qwen2", "gemma2")
CASES = [pytest.param(mt, "triton", id=f"{mt}-triton") for mt in ARCHS] + [
    pytest.param(mt, "pallas", id=f"{mt}-pallas", marks=() if mt in PALLAS_CPU else pytest.mark.gpu)
    for mt in ARCHS]


def lora_model(model_type, device="cpu", r=8, shape="cpu", dtype=torch.float32, seed=1, **lora_kw):
    model = build_model(model_type, shape, dtype=dtype, device=device)
    kw = dict(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    kw.update(lora_kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # init_lora_weights=False: random B, so every adapter matters
        return peft.get_peft_model(model, peft.LoraConfig(**kw))


def batch(model, device, b=2, s=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (b, s), generator=g).to(device)
    return ids


def step(model, ids):
    """(loss, {trainable param name: grad}) of one training step; asserts frozen params got none."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen, f"frozen base weights received gradients: {frozen[:3]}"
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads), "only adapters are trainable"
    return loss.detach(), grads


def assert_like_eager(patched, eager, ref, model, ids, dtype=None):
    # K: the longest fp32 accumulation behind any output (vocab in the loss, widths, tokens)
    c = model.config
    k = max(c.vocab_size, c.intermediate_size, c.hidden_size, ids.numel())
    (lp, gp), (le, ge), (lr, gr) = patched, eager, ref
    dtype = dtype or lp.dtype  # the compute dtype (bf16 under autocast, with fp32 results)
    tolerance.assert_close("loss", lp, lr, le, dtype, k)
    assert gp.keys() == gr.keys()
    for name in gr:
        assert gp[name].abs().sum() > 0, f"{name}: zero gradient"
        tolerance.assert_close(f"grad {name}", gp[name], gr[name], ge[name], dtype, k)


def need(backend):
    ok, why = ops.availability(backend)
    if not ok:
        pytest.skip(why)


def run_case(pm, backend, device, **patch_kw):
    ids = batch(pm, device)
    ref = step(copy.deepcopy(pm).double(), ids)
    eager = step(pm, ids)
    forge.patch(pm, backend=backend, kernels=LORA, **patch_kw)
    patched = step(pm, ids)
    assert_like_eager(patched, eager, ref, pm, ids)
    return ids, eager


@pytest.mark.parametrize("model_type,backend", CASES)
def test_lora_model_matches_eager(model_type, backend, device):
    need(backend)
    pm = lora_model(model_type, device)
    n = pm.config.num_hidden_layers
    ids, eager = run_case(pm, backend, device)
    assert pm._forge_patched_counts == {"lora_qkv": n, "lora_o": n, "lora_mlp": n}, pm._forge_skipped
    stats = pm._forge_guard_stats
    assert all(stats.fused(k) == n and stats.fallback(k) == 0 for k in LORA), stats
    forge.unpatch(pm)
    assert not any("forward" in m.__dict__ for m in pm.modules())
    assert torch.equal(step(pm, ids)[0], eager[0]), "unpatch did not restore the exact loss"


# ------------------------------------------------------------------ adapters that do not fit
def _inplace_dropout_in_layer_1(pm):
    # one layer's adapter gets an in-place dropout after the fact: the other layer is still fused
    layer = pm.base_model.model.model.layers[1]
    for proj in (layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.up_proj):
        proj.lora_dropout["default"] = torch.nn.Dropout(0.1, inplace=True)


def _two_active_adapters(pm):
    with torch.random.fork_rng(devices=[]):
        pm.add_adapter("second", peft.LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False))
    pm.base_model.set_adapter(["default", "second"])


MISFITS = [
    pytest.param(dict(use_dora=True), None, "DoRA", {}, id="dora"),
    pytest.param(dict(lora_bias=True), None, "LoRA bias", {}, id="lora_bias"),
    pytest.param({}, _two_active_adapters, "2 active adapters", {}, id="two_active"),
    pytest.param({}, _inplace_dropout_in_layer_1, "1 of 2", dict.fromkeys(LORA, 1), id="one_layer"),
]


@pytest.mark.parametrize("lora_kw,edit,reason,counts", MISFITS)
def test_misfit_adapters_left_to_peft(lora_kw, edit, reason, counts):
    pm = lora_model("qwen2", **lora_kw)
    if edit:
        edit(pm)
    forge.patch(pm, backend="triton", kernels=LORA)
    assert pm._forge_patched_counts == counts
    for key in LORA:
        assert reason in pm._forge_skipped[key], pm._forge_skipped
    layers = pm.base_model.model.model.layers
    fused = 0 if not counts else 1
    assert sum("forward" in l.mlp.__dict__ for l in layers) == fused  # the others run peft's path
    assert sum("forward" in l.self_attn.q_proj.__dict__ for l in layers) == fused
    assert sum("forward" in l.self_attn.o_proj.__dict__ for l in layers) == fused


# ------------------------------------------------------------------ partial target sets
# peft's default LoraConfig (target_modules None: q_proj and v_proj for these models), attention
# only, MLP only, and odd subsets: a projection without an adapter runs its base product inside
# the fused call; loss and every adapter gradient as unpatched peft's under the oracle's rule
PARTIAL = [pytest.param("qwen2", None, id="qwen2-peft_default_qv"),
           pytest.param("llama", ["q_proj", "k_proj", "v_proj", "o_proj"], id="llama-attention"),
           pytest.param("gemma", ["gate_proj", "up_proj", "down_proj"], id="gemma-mlp"),
           pytest.param("qwen3", ["k_proj", "o_proj", "up_proj"], id="qwen3-k_o_up", marks=pytest.mark.gpu),
           pytest.param("qwen2", ["v_proj", "gate_proj", "down_proj"], id="qwen2-v_gate_down", marks=pytest.mark.gpu)]


def _want_counts(targets, n):
    attn, mlp = {"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj", "down_proj"}
    return {k: n for k, hit in (("lora_qkv", attn & targets), ("lora_o", "o_proj" in targets), ("lora_mlp", mlp & targets))
            if hit}


@pytest.mark.parametrize("backend", ["triton", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model_type,targets", PARTIAL)
def test_partial_targets_fused(model_type, targets, backend, device):
    need(backend)
    pm = lora_model(model_type, device, target_modules=targets)
    adapted = {n.rsplit(".", 1)[-1] for n, m in pm.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)}
    assert adapted == (set(targets) if targets else {"q_proj", "v_proj"}), adapted
    n = pm.config.num_hidden_layers
    run_case(pm, backend, device)
    want = _want_counts(adapted, n)
    assert pm._forge_patched_counts == want, pm._forge_skipped
    for key in LORA:  # nothing declined; a kernel with nothing to do says so
        assert key not in pm._forge_skipped if key in want else "has LoRA on" in pm._forge_skipped[key]
    assert all(pm._forge_guard_stats.fallback(k) == 0 for k in LORA)


def test_partial_target_with_a_trainable_plain_projection_is_left_to_peft():
    # q and v adapted, k a plain nn.Linear whose weight trains: the fused call would give it no
    # gradient, so that attention module is left to peft (with the reason), the other is fused
    pm = lora_model("qwen2", target_modules=["q_proj", "v_proj"])
    pm.base_model.model.model.layers[0].self_attn.k_proj.weight.requires_grad_(True)
    forge.patch(pm, backend="triton", kernels=LORA)
    assert pm._forge_patched_counts == {"lora_qkv": 1}
    assert "k_proj: weight is trainable" in pm._forge_skipped["lora_qkv"]


@pytest.mark.parametrize("first", [["q_proj", "v_proj"], ["k_proj"]])
def test_an_adapter_added_after_patching_on_a_plain_projection(first):
    # LoRA on some of q/k/v at patch time: the fused call also makes the plain ones, whose
    # forwards take theirs from its slot. An adapter added later on such a projection made peft
    # wrap it; the fused call read the wrapper's adapter, and the wrapper added it again to what
    # its base layer (forge's forward) returned: logits 31% off, the adapter counted twice
    peft = pytest.importorskip("peft")
    pm = lora_model("llama", target_modules=first)
    ref = copy.deepcopy(pm)
    forge.patch(pm, backend="triton", kernels=LORA)
    assert pm._forge_patched_counts.get("lora_qkv") == pm.config.num_hidden_layers
    for m in (pm, ref):
        torch.manual_seed(9)
        m.add_adapter("new", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                                             init_lora_weights=False))
        m.set_adapter("new")
    ids = batch(pm, "cpu")
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert pm._forge_guard_stats.fallback("lora_qkv") == pm.config.num_hidden_layers  # (left to peft)


def test_infer_mode_skips():
    pm = lora_model("gemma")
    forge.patch(pm, mode="infer", backend="triton", kernels=LORA)
    assert pm._forge_patched_counts == {}
    assert all("infer" in pm._forge_skipped[k] for k in LORA)


# ------------------------------------------------------------------ lora_dropout
class _HashDropout(torch.nn.Module):
    """The unpatched models' lora_dropout in the dropout test: forge's masks
    (forge/spec/lora_dropout.py) with the seeds the patched model draws, drawn at the same points
    of the RNG stream: the first projection of a fused call draws the call's seed (q of q/k/v,
    gate of the MLP, o alone), the call's other projections reuse it."""

    FIRST = ("q", "gate", "o")

    def __init__(self, p, name, shared):
        super().__init__()
        self.p, self.name, self.shared = p, name, shared

    def forward(self, x):
        if not self.training or not self.p:
            return x
        if self.name in self.FIRST:
            self.shared["seed"] = forge_lora_dropout.seed(x.device)
        return forge_lora_dropout.apply(x, self.shared["seed"], forge_lora_dropout.SALT[self.name], self.p)


def _hash_dropout(model):
    """``model`` with every LoRA layer's dropout replaced by :class:`_HashDropout`, one shared seed
    per attention module's q/k/v, o, and MLP."""
    for mod in model.modules():
        groups = [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj", "down_proj")]
        for group in groups:
            shared = {}
            for proj in group:
                layer = getattr(mod, proj, None)
                drops = getattr(layer, "lora_dropout", None)
                if isinstance(drops, torch.nn.ModuleDict) and type(drops["default"]) is torch.nn.Dropout:
                    drops["default"] = _HashDropout(drops["default"].p, proj.removesuffix("_proj"), shared)
    return model


def _seeded_step(model, ids, seed=5):
    torch.manual_seed(seed)  # each model draws its seeds from the same RNG state
    return step(model, ids)


# CPU: qwen2 (q/k/v biases) with Triton (Pallas compiles a model's worth of new variants for a
# minute in its interpreter; its kernels with dropout are in test_lora_dropout.py); the GPU: both
# models x both backends
DROPOUT_CASES = [pytest.param("qwen2", "triton", id="qwen2-triton")] + [
    pytest.param(mt, b, id=f"{mt}-{b}-gpu", marks=pytest.mark.gpu) for mt in ("qwen2", "llama") for b in ops.BACKENDS]


@pytest.mark.parametrize("model_type,backend", DROPOUT_CASES)
def test_lora_dropout_matches_the_reference(model_type, backend, device, monkeypatch):
    # peft's usual lora_dropout=0.05 in training: fused (counted), one seed drawn per fused call,
    # the masks drawn in the kernels. The unpatched models apply the same masks (_HashDropout):
    # loss and every adapter gradient meet the oracle against the float64 one
    need(backend)
    pm = lora_model(model_type, device, lora_dropout=0.05).train()
    ids = batch(pm, device)
    ref, eager = _hash_dropout(copy.deepcopy(pm).double()), _hash_dropout(copy.deepcopy(pm))
    r, e = _seeded_step(ref, ids), _seeded_step(eager, ids)
    forge.patch(pm, backend=backend, kernels=LORA)
    n = pm.config.num_hidden_layers
    assert pm._forge_patched_counts == dict.fromkeys(LORA, n), pm._forge_skipped
    seeds = []
    draw = forge_lora_dropout.seed
    monkeypatch.setattr(forge_lora_dropout, "seed", lambda dev: seeds.append(draw(dev)) or seeds[-1])
    patched = _seeded_step(pm, ids)
    assert all(pm._forge_guard_stats.fused(k) == n for k in LORA)
    assert len(seeds) == 3 * n and len({int(t) for t in seeds}) == 3 * n  # a fresh seed per call and layer
    assert_like_eager(patched, e, r, pm, ids)
    assert torch.equal(_seeded_step(pm, ids)[0], patched[0])  # torch.manual_seed reproduces the step
    # the masks matter: without them the reference's loss is off by far more than the bound
    off = step(ref.eval(), ids)[0]
    k = max(pm.config.vocab_size, pm.config.intermediate_size, ids.numel())
    assert tolerance.rel_err(off, r[0]) > 10 * tolerance.bound(tolerance.rel_err(e[0], r[0]), torch.float32, k)
    forge.unpatch(pm)


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "row_blocks"])
def test_lora_dropout_under_gradient_checkpointing(cut, monkeypatch):
    # the recompute draws its seeds again from the RNG state torch's checkpoint restores: the same
    # masks as the forward, so the step equals the step without checkpointing (with the MLP in
    # row blocks too: one seed per block, drawn again in the same order)
    pm = lora_model("qwen3", lora_dropout=0.1).train()
    if cut:
        from forge.patching import lora as patch_lora

        monkeypatch.setattr(patch_lora, "CHUNK_ELEMENTS", 5 * pm.config.intermediate_size)
        monkeypatch.setattr(patch_lora, "ROW_ALIGN", 2)
        assert patch_lora.row_blocks(batch(pm, "cpu").numel(), pm.config.intermediate_size) == [4] * 4
    plain = copy.deepcopy(pm)
    pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for m in (pm, plain):
        forge.patch(m, backend="triton", kernels=LORA)
    ids = batch(pm, "cpu")
    (la, ga), (lb, gb) = _seeded_step(pm, ids), _seeded_step(plain, ids)
    assert pm._forge_guard_stats.fused("lora_mlp") == 2 * pm.config.num_hidden_layers  # (recomputed)
    assert torch.equal(la, lb)
    for name in gb:
        assert tolerance.rel_err(ga[name], gb[name]) <= 1e-6, name


@pytest.mark.parametrize("backend", ["triton", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_lora_dropout_off_is_bit_identical(backend, device):
    # eval mode, p = 0 in training, or a Dropout switched to eval on its own: exactly the call
    # without dropout (an Identity-dropout twin patched the same way)
    need(backend)
    pm = lora_model("qwen2", device, lora_dropout=0.1)
    plain = copy.deepcopy(pm)
    for m in plain.modules():
        if isinstance(getattr(m, "lora_dropout", None), torch.nn.ModuleDict):
            m.lora_dropout["default"] = torch.nn.Identity()
    ids = batch(pm, device)
    for model in (pm, plain):
        forge.patch(model, backend=backend, kernels=LORA)
    drops = [m for m in pm.modules() if type(m) is torch.nn.Dropout]
    assert len(drops) == 7 * pm.config.num_hidden_layers

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits

    want = logits(plain.eval())
    assert torch.equal(logits(pm.eval()), want)
    pm.train()
    plain.train()
    assert not torch.equal(logits(pm), want)  # dropout active: the check can fail
    for d in drops:
        d.eval()  # the dropout module's own flag decides, as in peft
    assert torch.equal(logits(pm), logits(plain))
    for d in drops:
        d.train()
        d.p = 0.0
    assert torch.equal(logits(pm), logits(plain))
    assert pm._forge_guard_stats.fallback("lora_qkv") == 0 and pm._forge_guard_stats.fallback("lora_mlp") == 0


# ------------------------------------------------------------------ call-time state, later adapters
def test_patched_peft_model_under_inference_mode():
    # evaluation under torch.inference_mode: the q/k/v hand-off reads no version counter of an
    # inference tensor (there is none); the logits are those of no_grad
    pm = lora_model("qwen2")
    ids = batch(pm, "cpu")
    forge.patch(pm, backend="triton", kernels=LORA, min_elements=0)
    pm.eval()
    with torch.no_grad():
        want = pm(ids).logits
    with torch.inference_mode():
        got = pm(ids).logits
    assert torch.equal(got, want) and pm._forge_guard_stats.fused("lora_qkv") == 2 * pm.config.num_hidden_layers


def test_call_time_state_and_later_adapters():
    pm = lora_model("qwen2")
    ref = copy.deepcopy(pm)  # unpatched twin
    ids = batch(pm, "cpu")
    forge.patch(pm, backend="triton", kernels=LORA)
    stats = pm._forge_guard_stats
    with torch.no_grad():
        with pm.disable_adapter(), ref.disable_adapter():  # adapters off: peft's path, base only
            assert torch.equal(pm(ids).logits, ref(ids).logits)
        assert stats.fallback("lora_qkv") == 2 and stats.fallback("lora_mlp") == 2 and stats.fused("lora_mlp") == 0
    # an adapter added and activated after forge.patch is picked up at call time (fused)
    for m in (pm, ref):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            cfg = peft.LoraConfig(r=16, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
            m.add_adapter("second", cfg)
        m.set_adapter("second")
    eager, patched = step(ref, ids), step(pm, ids)
    assert_like_eager(patched, eager, step(copy.deepcopy(ref).double(), ids), pm, ids)
    assert set(patched[1]) == {n for n, p in pm.named_parameters() if p.requires_grad} and all(
        ".second." in n for n in patched[1])
    assert stats.fused("lora_qkv") == 2 and stats.fused("lora_mlp") == 2


def test_mixed_adapter_batches_and_hooked_projections_run_peft():
    # peft's mixed-batch inference (adapter_names=) routes rows through forward pre-hooks on each
    # LoRA layer, and a user's hook on a projection changes its output: the fused kernels read the
    # weights without calling the layers, so such calls run peft's code (the MLP's had ignored
    # the hooks: adapter "b"'s row 1.04 off, its greedy tokens others)
    pm = lora_model("qwen2")
    pm.add_adapter("b", peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False))
    eager = copy.deepcopy(pm).eval()
    forge.patch(pm, min_elements=0)
    pm.eval()
    ids = batch(pm, "cpu")
    with torch.no_grad():
        want = eager(input_ids=ids, adapter_names=["default", "b"]).logits
        assert (want[1] - eager(input_ids=ids).logits[1]).abs().max() > 0.1  # "b" matters
        got = pm(input_ids=ids, adapter_names=["default", "b"]).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert pm._forge_guard_stats.fused("lora_mlp") == 0
    up = pm.base_model.model.model.layers[0].mlp.up_proj
    handle = up.register_forward_hook(lambda m, a, out: out * 0.5)
    eager.base_model.model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, a, out: out * 0.5)
    pm.train()
    eager.train()
    try:
        torch.testing.assert_close(step(pm, ids)[0], step(eager, ids)[0], rtol=1e-5, atol=1e-6)
    finally:
        handle.remove()


def test_repatch_picks_up_new_lora_layers():
    model = build_model("qwen2")
    forge.patch(model, backend="triton", kernels=LORA)
    assert "no LoRA adapters" in model._forge_skipped["lora_qkv"]
    pm = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=TARGETS, init_lora_weights=False))
    forge.unpatch(pm)
    forge.patch(pm, backend="triton", kernels=LORA)
    assert pm._forge_patched_counts == dict.fromkeys(LORA, 2)


def test_qkv_slot_only_serves_the_same_input():
    pm = lora_model("qwen2")
    forge.patch(pm, backend="triton", kernels=LORA)
    attn = pm.base_model.model.model.layers[0].self_attn
    x, y = torch.randn(2, 3, 64), torch.randn(2, 3, 64)

    def peft_out(name, t):
        m = getattr(attn, name)
        return type(m).forward(m, t)

    with torch.no_grad():
        q = attn.q_proj(x)  # fused: k(x), v(x) wait in the slot
        k_y = attn.k_proj(y)  # another input: peft's own forward
        v_x = attn.v_proj(x)  # from the slot
        attn.q_proj(x)
        x.mul_(2)  # changed in place: the slot's k(x) is stale
        k_x2 = attn.k_proj(x)
    torch.testing.assert_close(q, peft_out("q_proj", x / 2))
    torch.testing.assert_close(k_y, peft_out("k_proj", y))
    torch.testing.assert_close(v_x, peft_out("v_proj", x / 2))
    torch.testing.assert_close(k_x2, peft_out("k_proj", x))
    # deepcopy rebinds the fused forwards to the copy's modules
    pm2 = copy.deepcopy(pm)
    attn2 = pm2.base_model.model.model.layers[0].self_attn
    assert attn2.k_proj.forward.__self__ is attn2


# ------------------------------------------------------------------ the H200: Qwen2.5-0.5B shape
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_qwen05b_lora_training_tracks_eager(backend):
    """20 AdamW steps of r=16 LoRA on q, k, v, o, gate, up, down in bf16 (peft keeps adapters in
    fp32): the patched loss stays within 1% of the unpatched one at every step."""
    need(backend)
    losses = {}
    for name in ("eager", "forge"):
        pm = lora_model("qwen2", "cuda", r=16, shape="qwen05b", dtype=torch.bfloat16, init_lora_weights=True)
        if name == "forge":
            forge.patch(pm, backend=backend)
            assert pm._forge_patched_counts["lora_qkv"] == 24 and pm._forge_patched_counts["lora_mlp"] == 24
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=2e-4)
        out = []
        for i in range(20):
            ids = batch(pm, "cuda", b=4, s=1024, seed=i % 4)
            loss = pm(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        losses[name] = out
        del pm, opt
        torch.cuda.empty_cache()
    for i, (e, f) in enumerate(zip(losses["eager"], losses["forge"])):
        assert abs(f - e) <= 0.01 * abs(e), f"step {i}: forge {f:.4f} vs eager {e:.4f}; {losses}"


@pytest.mark.parametrize("backend", ["triton", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cut", [False, True], ids=["whole", "row_blocks"])
def test_autocast_bf16(backend, cut, device, monkeypatch):
    # HF Trainer's bf16 mixed precision: fp32 weights under autocast. Eager peft then runs every
    # matmul in bf16; the fused call casts the same way and runs in bf16 (not a fallback), the
    # MLP in row blocks too (cut after the cast)
    need(backend)
    pm = lora_model("qwen2", device)
    if cut:
        from forge.patching import lora as patch_lora

        monkeypatch.setattr(patch_lora, "CHUNK_ELEMENTS", 5 * pm.config.intermediate_size)
        monkeypatch.setattr(patch_lora, "ROW_ALIGN", 2)
        assert len(patch_lora.row_blocks(batch(pm, device).numel(), pm.config.intermediate_size)) == 4
    ids = batch(pm, device)
    ref = step(copy.deepcopy(pm).double(), ids)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        eager = step(pm, ids)
        forge.patch(pm, backend=backend, kernels=LORA)
        patched = step(pm, ids)
    assert pm._forge_guard_stats.fused("lora_qkv") == 2 and pm._forge_guard_stats.fallback("lora_mlp") == 0
    assert all(g.dtype == torch.float32 for g in patched[1].values())
    assert_like_eager(patched, eager, ref, pm, ids, dtype=torch.bfloat16)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    # the recompute runs q_proj's fused call and the k/v slot again (twice per layer in all)
    pm = lora_model("qwen3")
    pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        pm.enable_input_require_grads()
    run_case(pm, "triton", "cpu")
    n = 2 * pm.config.num_hidden_layers
    assert pm._forge_guard_stats.fused("lora_qkv") == n and pm._forge_guard_stats.fused("lora_mlp") == n


@pytest.mark.parametrize("state", ["merged", "disabled", "copied_merged"])
def test_patched_while_merged_or_disabled_fuses_once_restored(state):
    # merged / disabled are call-time states: patched in them (or a deep copy made in them), the
    # layers were declined for good and ran peft's code after unmerge / enable
    pm = lora_model("qwen2")
    ref = copy.deepcopy(pm)
    ids = batch(pm, "cpu")

    def enter(m):
        m.base_model.disable_adapter_layers() if state == "disabled" else m.merge_adapter()

    def leave(m):
        m.base_model.enable_adapter_layers() if state == "disabled" else m.unmerge_adapter()

    enter(pm)
    enter(ref)
    forge.patch(pm, backend="triton", kernels=LORA)
    if state == "copied_merged":
        pm = copy.deepcopy(pm)
    assert pm._forge_patched_counts == dict.fromkeys(LORA, 2)
    with torch.no_grad():  # still merged / disabled: peft's own path, as unpatched
        assert torch.equal(pm(ids).logits, ref(ids).logits)
    assert pm._forge_guard_stats.fused("lora_qkv") == 0
    leave(pm)
    leave(ref)
    eager, patched = step(ref, ids), step(pm, ids)
    assert_like_eager(patched, eager, step(copy.deepcopy(ref).double(), ids), pm, ids)
    assert pm._forge_guard_stats.fused("lora_qkv") == 2 and pm._forge_guard_stats.fused("lora_mlp") == 2


def test_float16_model_with_fp32_adapters_runs_peft():
    # peft runs fp32 adapters of a float16 model in fp32; the kernels read them in float16, and
    # the adapters' gradients went past the oracle's bound (lora_B 1.3x it). Outside autocast such
    # calls run peft's code; adapters in float16 fuse
    for adapters in (torch.float32, torch.float16):
        pm = lora_model("llama", dtype=torch.float16)
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(adapters)
        forge.patch(pm, backend="triton", kernels=LORA)
        with torch.no_grad():
            pm(batch(pm, "cpu"))
        stats = pm._forge_guard_stats
        fused = adapters is torch.float16
        assert (stats.fused("lora_qkv") > 0) is fused and (stats.fallback("lora_qkv") > 0) is not fused


def test_call_time_check_agrees_with_reasons():
    # fused_params (the per-call fast path) and misfit (the readable reasons) must agree
    from forge.patching.lora import _peft_linear, fused_params, misfit

    lin = _peft_linear()
    pm = lora_model("qwen2")
    attn = pm.base_model.model.model.layers[0].self_attn

    def agree(layer, bias_ok=True):
        why = misfit(layer, lin, bias_ok=bias_ok)
        got = fused_params(layer, lin, bias_ok)
        assert (why is None) == (got is not None), why
        return why

    assert agree(attn.q_proj) is None
    assert "has a bias" in agree(attn.q_proj, bias_ok=False)  # qwen2's q/k/v carry biases
    attn.k_proj.lora_dropout["default"] = torch.nn.Dropout(0.1)
    assert agree(attn.k_proj) is None and fused_params(attn.k_proj, lin, True)[5] == 0.1
    attn.k_proj.lora_dropout["default"].eval()  # peft reads the Dropout's own mode: no dropout now
    assert agree(attn.k_proj) is None and fused_params(attn.k_proj, lin, True)[5] == 0.0
    attn.k_proj.lora_dropout["default"] = torch.nn.Dropout(0.1, inplace=True)
    assert "in-place" in agree(attn.k_proj)
    attn.k_proj.lora_dropout["default"] = torch.nn.AlphaDropout(0.1)
    assert "AlphaDropout" in agree(attn.k_proj)
    attn.k_proj.lora_dropout["default"] = torch.nn.Identity()
    attn.v_proj.base_layer.weight.requires_grad_(True)
    assert "trainable" in agree(attn.v_proj)
    with pm.disable_adapter():
        assert "disabled" in agree(attn.q_proj)
    pm.merge_adapter()
    assert "merged" in agree(attn.q_proj)
    pm.unmerge_adapter()
    assert agree(attn.q_proj) is None


@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_recompute_mlp_reaches_the_lora_mlp(backend, device):
    # forge.patch(recompute_mlp=True) on a LoRA model: the fused LoRA MLP keeps x, not gate's and
    # up's outputs, and the step's loss and adapter gradients are those without it
    need(backend)
    pm = lora_model("llama", device)
    ids = batch(pm, device)
    forge.patch(pm, backend=backend, kernels=LORA)
    plain = step(pm, ids)
    inter = pm.config.intermediate_size
    kept = {}
    for rc in (False, True):
        forge.patch(pm, backend=backend, kernels=LORA, recompute_mlp=rc)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape[-1:]) or t, lambda t: t):
            pm.zero_grad(set_to_none=True)
            loss = pm(input_ids=ids, labels=ids).loss
        kept[rc] = saved.count(torch.Size([inter]))
        loss.backward()
    assert pm._forge_patched_counts["lora_mlp"] == pm.config.num_hidden_layers
    # per layer, g and u (rows x intermediate) no longer kept
    assert kept[False] - kept[True] == 2 * pm.config.num_hidden_layers, kept
    again = step(pm, ids)
    assert torch.equal(again[0], plain[0]) and all(torch.equal(again[1][n], plain[1][n]) for n in plain[1])


@pytest.mark.parametrize("backend", ["triton", pytest.param("triton", marks=pytest.mark.gpu, id="triton-gpu"),
                                     pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_long_mlp_calls_run_in_row_blocks(backend, recompute, device, monkeypatch):
    # a fused MLP call over more than CHUNK_ELEMENTS (rows x intermediate) runs as calls over row
    # blocks (the backward's (rows, intermediate) buffers exist for one block at a time): the
    # step meets the oracle against float64, each block draws its own dropout seed, and the step
    # equals the uncut one within fp32 rounding when dropout is off
    from forge.patching import lora as patch_lora

    need(backend)
    pm = lora_model("llama", device, lora_dropout=0.1).eval()  # (eval: dropout off until the end)
    ids = batch(pm, device, s=9)  # 18 rows: blocks of 4, 4, 4, 4, 2
    ref = step(copy.deepcopy(pm).double(), ids)
    eager = step(pm, ids)
    forge.patch(pm, backend=backend, kernels=LORA, recompute_mlp=recompute)
    whole = step(pm, ids)
    inter = pm.config.intermediate_size
    monkeypatch.setattr(patch_lora, "CHUNK_ELEMENTS", 5 * inter)
    monkeypatch.setattr(patch_lora, "ROW_ALIGN", 2)
    assert patch_lora.row_blocks(ids.numel(), inter) == [4, 4, 4, 4, 2]
    n = pm.config.num_hidden_layers
    calls = []
    real = patch_lora._mlp_spec.PROJ  # the blocks' calls, counted through the dropout helper
    monkeypatch.setattr(patch_lora, "_dropout", lambda x, names, ps: calls.append(names) or {})
    cut = step(pm, ids)
    assert calls.count(real) == 5 * n and pm._forge_guard_stats.fused("lora_mlp") >= n
    assert_like_eager(cut, eager, ref, pm, ids)
    assert tolerance.rel_err(cut[0], whole[0]) <= 1e-6
    for name in whole[1]:
        assert tolerance.rel_err(cut[1][name], whole[1][name]) <= 1e-5, name
    # with dropout, a fresh seed per block: the blocks' masks are independent
    monkeypatch.undo()
    monkeypatch.setattr(patch_lora, "CHUNK_ELEMENTS", 5 * inter)
    monkeypatch.setattr(patch_lora, "ROW_ALIGN", 2)
    seeds = []
    draw = forge_lora_dropout.seed
    monkeypatch.setattr(forge_lora_dropout, "seed", lambda dev: seeds.append(draw(dev)) or seeds[-1])
    step(pm.train(), ids)
    assert len(seeds) == (5 + 2) * n and len({int(t) for t in seeds}) == len(seeds)  # + q/k/v and o
    forge.unpatch(pm)


@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_recompute_mlp_under_compile(backend):
    # the op pair under torch.compile (aot_eager: the op layer's registered forward and backward)
    # with the pre-activations not kept: the same step as eager forge within fp32 rounding
    need(backend)
    pm = lora_model("llama")
    ids = batch(pm, "cpu")
    forge.patch(pm, backend=backend, kernels=LORA, recompute_mlp=True)
    want = step(pm, ids)
    compiled = torch.compile(pm, backend="aot_eager")
    pm.zero_grad(set_to_none=True)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss.detach(), want[0], rtol=1e-6, atol=0)
    for n, p in pm.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, want[1][n], rtol=1e-5, atol=1e-6 * want[1][n].abs().max().item())


@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_recompute_mlp_under_autocast(backend, device):
    # float32 parameters under autocast (the Trainer's bf16=True): the fused LoRA MLP recomputing
    # gate and up gives the step it gives keeping them
    need(backend)
    pm = lora_model("llama", device)
    ids = batch(pm, device)
    got = {}
    for rc in (False, True):
        forge.patch(pm, backend=backend, kernels=LORA, recompute_mlp=rc)
        pm.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        got[rc] = (loss.detach(), {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad})
    assert pm._forge_guard_stats.fused("lora_mlp") > 0
    assert torch.equal(got[True][0], got[False][0])
    for n, g in got[False][1].items():
        assert g.dtype == torch.float32 and torch.equal(got[True][1][n], g), n
