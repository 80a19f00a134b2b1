"""generate() with its decoding steps captured on a static KV cache (``forge.patch(model,
mode="infer", graphs=True)``, forge/patching/decode.py and decode_runtime.py).

On the CPU the CUDA graph is replaced by a stand-in (``_FakeGraphs``) whose capture runs the
step and whose replay runs it again on the static buffers, so everything around the graph runs
as on a GPU: the static cache handed to generate, the static inputs, the counters a capture
must put back, the warm-up, the fallbacks and their reasons, cache growth and unpatch. Under
-m gpu the same checks run with real CUDA graphs at the Qwen2.5-0.5B widths in bf16.

Correctness rule (as tests/test_models.py's generate test): the logits of every decoding step,
teacher-forced along both continuations (eager's and forge's) through generate itself, meet the
oracle against a float64 (CPU) / float32 (GPU) copy; forge's tokens equal eager's up to the first
step where eager's top two logits are within twice the forge-vs-eager logit error.
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import contextlib  # noqa: E402
import copy  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import forge  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.patching import decode, decode_loop, decode_runtime  # noqa: E402
from forge.spec import tolerance  # noqa: E402

ARCHS = ["qwen2", "qwen3", "gemma", "gemma2"]
NONE = ["fused_linear_ce"]  # infer mode declines it: no kernel patched, graphs and decode still installed


class _FakeGraph:
    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())


class _FakeGraphs:
    """Stands in for decode_runtime.CudaGraphs on the CPU; counts the warm-ups and captures run
    outside a served generate() call (CudaGraphs.serve: on a GPU, off the capture stream)."""

    def __init__(self):
        self.depth, self.outside, self.ran = 0, 0, 0

    @staticmethod
    def why_not(device):
        return None

    @contextlib.contextmanager
    def serve(self, dev):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def warm(self, fn, owner, dev):
        self.ran += 1
        self.outside += not self.depth
        return fn()

    def capture(self, fn, owner, dev):
        self.ran += 1
        self.outside += not self.depth
        out = fn()
        return _FakeGraph(fn, out), out


@pytest.fixture(autouse=True)
def _host_loop(monkeypatch):
    # these tests are of generate()'s own loop around replayed steps: the device loop
    # (tests/test_decode_loop.py) stays off whatever its default
    monkeypatch.setattr(decode_loop, "DEVICE_LOOP", False)


@pytest.fixture
def fake_graphs(monkeypatch):
    fake = _FakeGraphs()
    monkeypatch.setattr(decode_runtime, "BACKEND", fake)
    monkeypatch.setattr(decode, "BUCKET", 8)  # small caches: growth shows at tiny lengths
    yield fake
    assert fake.outside == 0, "a warm-up or capture ran outside the served generate() call"


def _model(model_type, shape="cpu", dtype=torch.float32, device="cpu", attn=None, **kw):
    if model_type == "gemma2":
        kw.setdefault("sliding_window", 6)  # a window filled within the test: its uncaptured steps run too
    attn = attn or ("eager" if model_type == "gemma2" else "sdpa")  # transformers 5.24 refuses sdpa for gemma2
    return build_model(model_type, shape, dtype=dtype, device=device, attn_implementation=attn, **kw).eval()


def _prompt(model, b, s, device, seed=5, pad=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (b, s), generator=g).to(device)
    mask = torch.ones_like(ids)
    if b > 1 and pad:
        mask[0, : s // 3] = 0  # left padding in the first row
        ids[0, : s // 3] = 0
    return ids, mask


class _Force:
    """A logits processor that makes generate pick ``seq``'s next token (teacher forcing through
    generate, so the logits recorded are those of its decoding steps)."""

    def __init__(self, seq):
        self.seq = seq

    def __call__(self, input_ids, scores):
        nxt = self.seq[:, input_ids.shape[1]]
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, nxt[:, None].to(out.device), 0.0)


def _forced_logits(model, ids, mask, seq):
    from transformers import LogitsProcessorList

    new = seq.shape[1] - ids.shape[1]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         logits_processor=LogitsProcessorList([_Force(seq)]), output_logits=True,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences.cpu(), seq.cpu())
    return torch.stack(out.logits, 1).float()  # (B, new, V)


def _check_generate(model, ids, mask, new, dtype, ref_dtype, **patch_kw):
    """Patch ``model``, generate greedily with and without forge, and apply the rule."""
    eager_model = copy.deepcopy(model)
    ref_model = copy.deepcopy(model).to(ref_dtype)
    kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = eager_model.generate(ids, **kw)
        forge.patch(model, mode="infer", **patch_kw)
        got = model.generate(ids, **kw)
        logits = {}
        for name, seq in (("eager's", want), ("forge's", got)):
            p, e, r = (_forced_logits(m, ids, mask, seq) for m in (model, eager_model, ref_model))
            k = max(model.config.vocab_size, model.config.intermediate_size, seq.numel())
            tolerance.assert_close(f"logits along {name} continuation", p, r, e, dtype, k)
            logits[name] = (p, e)
    b, p0 = ids.shape[0], ids.shape[1]
    (pw, ew), (pg, eg) = logits["eager's"], logits["forge's"]
    chosen = eg.gather(-1, got[:, p0:, None]).squeeze(-1)  # eager's logit of forge's pick
    err_g = (pg - eg).abs().amax(-1)
    assert (chosen >= eg.amax(-1) - 2 * err_g).all(), "forge picked a token eager rates far below its best"
    top2 = ew.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * (pw - ew).abs().amax(-1)
    for row in range(b):
        n = int(clear[row].long().cumprod(0).sum())  # leading steps eager itself can call
        assert torch.equal(got[row, p0: p0 + n], want[row, p0: p0 + n]), (row, n, got, want)
    return want, got


# ---------------------------------------------------------------------------------------------
# CPU: the decoding path around a stand-in graph


@pytest.mark.parametrize("model_type", ARCHS)
def test_greedy_left_padded_batch_matches_eager(model_type, fake_graphs):
    model = _model(model_type)
    # gemma2's float64 reference turns a padded row into NaN (its fully masked rows become -inf
    # in the float32 softmax), so its padded case runs under -m gpu (float32 reference) only
    ids, mask = _prompt(model, 2, 5, "cpu", pad=model_type != "gemma2")
    _check_generate(model, ids, mask, 6, torch.float32, torch.float64, kernels=NONE, graphs=True)
    st = model._forge_graphs.stats
    assert model._forge_patched_counts.get("decode") == 1
    # five decoding steps per generate call (the first token comes from the prefill); the first
    # call warms up twice and captures at its third step; the forced runs replay from then on
    assert st.decode_captures == 1 and st.decode_caches == 1, st
    assert st.why["decoding step: warm-up before capture"] == decode_runtime.WARMUP, st
    # the prompt runs into a DynamicCache and is copied into the static one (three generate
    # calls: the greedy one and two forced ones); gemma2's sliding layers keep the static prefill
    assert model._forge_graphs.decode.prefills == (0 if model_type == "gemma2" else 3)
    full = st.why.get("decoding step: a sliding window is full (transformers' rolling update runs uncaptured)", 0)
    if model_type == "gemma2":  # window 6: steps from cache length 6 on run uncaptured
        assert full > 0 and st.decode_replayed > 0, st
    else:
        assert full == 0 and st.decode_replayed == 5 * 3 - decode_runtime.WARMUP, st


@pytest.mark.parametrize("batch", [1, 3])
def test_unpadded_prompt_runs_into_a_dynamic_cache(batch, fake_graphs, monkeypatch):
    # with no padded row transformers hands SDPA no mask at all (its causal flag serves): the
    # prompt must still run into a DynamicCache (a causal call per layer), not over the static
    # cache's whole capacity (time to first token 32 ms against eager's 21 at batch 1, H200), and
    # with the layer graphs standing aside (they would keep each prompt shape's activations)
    model = _model("qwen2")
    ids, mask = _prompt(model, batch, 5, "cpu", pad=False)
    _check_generate(model, ids, mask, 6, torch.float32, torch.float64, kernels=NONE, graphs=True)
    assert model._forge_graphs.decode.prefills == 3  # the greedy call and the two forced ones
    assert model._forge_graphs.stats.decode_replayed == 5 * 3 - decode_runtime.WARMUP
    # the layer graphs' entry, asked for by the first layer of every pass they may serve (the
    # stand-in graphs' replays rerun the one-token steps through it: those are not counted)
    begun = []
    model._forge_graphs._begin = lambda layer, x, *a: (x.shape[1] > 1 and begun.append(x.shape)) or "test"
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert model._forge_graphs.decode.prefills == 4 and not begun, begun
    # the prompt's keys and values go straight into the static cache: no DynamicCache layer holds
    # a second copy of them during the forward
    from transformers.cache_utils import DynamicLayer

    copies = []
    real = DynamicLayer.update
    monkeypatch.setattr(DynamicLayer, "update", lambda self, *a, **k: copies.append(1) or real(self, *a, **k))
    got = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert model._forge_graphs.decode.prefills == 5 and not copies and got.shape == (batch, 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through the Triton interpreter; on a CUDA "
                    "machine the gpu-marked cases run the compiled kernels inside real graphs")
@pytest.mark.parametrize("append", [None, *forge.ops.BACKENDS])
def test_one_token_update_writes_as_the_static_layer(monkeypatch, append):
    # forge's caches take decode_runtime.one_token_update: the same keys, values and counter as
    # transformers' StaticLayer.update, one token at a time, with no arange for the index (and
    # with a backend's kv_append, in its one launch); several tokens at once run the class's own
    from transformers.cache_utils import StaticLayer

    g = torch.Generator().manual_seed(3)
    ref, ours = StaticLayer(max_cache_len=12), StaticLayer(max_cache_len=12)
    kernel = None if append is None else forge.ops.get("kv_append", append)
    ours.update = functools.partial(decode_runtime.one_token_update, ours, append=kernel)
    kv = [(torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)) for n in (5, 1, 1, 1, 2, 1)]
    aranges = []
    real_arange = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: aranges.append(a) or real_arange(*a, **k))
    for k, v in kv:
        before = len(aranges)
        want, got = ref.update(k, v), ours.update(k, v)
        if k.shape[-2] == 1:
            assert len(aranges) == before + 1  # the reference's, none of ours
        for w, o in zip(want, got):
            assert torch.equal(w, o)
        assert int(ours.cumulative_length) == int(ref.cumulative_length)
    assert int(ours.cumulative_length) == 11


def test_forge_kernels_run_inside_the_captured_step(fake_graphs, monkeypatch):
    import forge_triton

    kernel, calls = forge.ops.get("decode_attention", "triton"), []

    def spy(*a, **k):
        calls.append(a[0].shape)
        return kernel(*a, **k)

    monkeypatch.setattr(forge_triton, "decode_attention", spy)
    model = _model("qwen2")
    ids, mask = _prompt(model, 2, 4, "cpu")
    _check_generate(model, ids, mask, 4, torch.float32, torch.float64, backend="triton", graphs=True)
    assert model._forge_graphs.stats.decode_replayed > 0
    # the warm-up steps and the capture attend through the backend's kernel (a real graph
    # replays what the capture recorded; the stand-in's replay reruns the step with SDPA)
    assert model._forge_graphs.decode.attends == "triton"
    assert len(calls) == model.config.num_hidden_layers * (decode_runtime.WARMUP + 1), calls
    gs = model._forge_guard_stats
    for key in ("rmsnorm", "swiglu", "rope"):
        assert gs.fused(key) > 0, gs  # the capture fuses every size (the guard would fall back here)


def _decode_with_switch(monkeypatch, key, switch, on, batch, shape_arg):
    """Greedy decoding of a small qwen2 through the captured steps (Triton) with ``decode.<switch>``
    on or off, every call of the backend's ``key`` kernel recorded (the shape of its argument
    ``shape_arg``); returns (model, calls). The tokens follow eager's under the test's rule.
    (Triton only: graphs=True declines Pallas in the CPU interpreter; the kernels' own tests cover
    Pallas on the CPU, the gpu cases its decoding steps.)"""
    import forge_triton

    kernel, calls = forge.ops.get(key, "triton"), []
    monkeypatch.setattr(forge_triton, key, lambda *a: calls.append(a[shape_arg].shape) or kernel(*a))
    monkeypatch.setattr(decode, switch, on)
    model = _model("qwen2")
    ids, mask = _prompt(model, batch, 4, "cpu")
    _check_generate(model, ids, mask, 4, torch.float32, torch.float64, backend="triton", graphs=True)
    assert model._forge_graphs.stats.decode_replayed > 0
    if not on:
        assert not calls
    return model, calls


@pytest.mark.parametrize("on", [False, True])
def test_kv_append_writes_the_decoding_steps_cache(fake_graphs, monkeypatch, on):
    # with decode.KV_APPEND on, the decoding steps write keys, values and the length with the
    # attention backend's kv_append; off, it is never called
    model, calls = _decode_with_switch(monkeypatch, "kv_append", "KV_APPEND", on, 2, 2)
    assert (model._forge_graphs.decode.append is not None) == on
    if on:  # (at least the warm-up steps and the capture, a layer each; the stand-in's replays rerun it)
        assert len(calls) >= model.config.num_hidden_layers * (decode_runtime.WARMUP + 1), calls


@pytest.mark.parametrize("on,sums,glu", [(False, True, True), (True, True, False), (True, False, False),
                                         (True, False, True)])
def test_row_linear_takes_the_decoding_steps_one_row_products(fake_graphs, monkeypatch, on, sums, glu):
    # with decode.ROW_LINEAR on, a batch-1 decoding step's products (q/k/v, o, gate/up, down, the
    # head) run the attention backend's row_linear while warmed up and captured; off, it is never
    # called. With decode.ROW_SUMS too, o's and down's products write the residual sums each
    # layer adds next, and both additions take them; with decode.ROW_GLU, each MLP's gate/up
    # product and activation run as the backend's row_glu (the tokens follow eager's each way)
    monkeypatch.setattr(decode, "ROW_SUMS", sums)
    monkeypatch.setattr(decode, "ROW_GLU", glu)
    model, calls = _decode_with_switch(monkeypatch, "row_linear", "ROW_LINEAR", on, 1, 1)
    d = model._forge_graphs.decode
    assert (d.linear is not None) == on
    layers = model.config.num_hidden_layers
    if on:  # (each layer's products and the head, in the warm-up steps and the capture)
        per_step = len(calls) // (decode_runtime.WARMUP + 1)
        assert per_step >= 3 * layers + 1 and calls[-1][0] == model.config.vocab_size, calls
        assert sum(s.row_calls for s in d.slots.values()) == len(calls)
        steps = decode_runtime.WARMUP + 1  # (the stand-in's replays rerun the step outside the mode)
        assert sum(s.row_sums for s in d.slots.values()) == (2 * layers * steps if sums else 0)
        assert sum(s.row_glus for s in d.slots.values()) == (layers * steps if glu else 0)
    assert (d.glu is not None) == (on and glu)


def test_sampling_with_a_seed(fake_graphs):
    model = _model("qwen3")
    ids, mask = _prompt(model, 3, 5, "cpu")
    eager_model = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, temperature=0.7, top_k=5, top_p=0.9,
              pad_token_id=0)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(model.generate(ids, **kw))
    assert torch.equal(runs[0], runs[1]), "the same seed gave different samples"
    seq = runs[0]
    assert seq.shape == (3, 11) and torch.equal(seq[:, :5], ids)
    assert model._forge_graphs.stats.decode_replayed > 0
    # every sampled token is among the top 5 of eager's logits at its step (top_k=5)
    logits = _forced_logits(eager_model, ids, mask, seq)
    top = logits.topk(5, dim=-1).indices
    assert (top == seq[:, 5:, None]).any(-1).all()


@pytest.mark.parametrize("model_type,attn", [("qwen2", "sdpa"), ("qwen3", "sdpa"), ("gemma", "sdpa"),
                                             ("qwen2", "eager")])
def test_prepared_steps_equal_unpatched_generate(model_type, attn, fake_graphs):
    # once a step's graph builds its masks from the 2-D mask (checked against transformers' masks
    # while the step ran uncaptured), forge prepares the decoding steps' inputs: no 4-D masks
    model = _model(model_type, attn=attn)
    eager_model = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    st, d = model._forge_graphs.stats, model._forge_graphs.decode
    ids, mask = _prompt(model, 3, 5, "cpu")
    new = 7
    # padded; no padding (transformers 5.24 then drops the 2-D mask: a second kind of step); padded
    for m in (mask, torch.ones_like(mask), mask):
        kw = dict(attention_mask=m, max_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            got, want = model.generate(ids, **kw), eager_model.generate(ids, **kw)
        assert torch.equal(got, want), (m, got, want)
    steps = 3 * (new - 1)  # the first token of each call comes from the prefill
    assert st.decode_captures == 1 and st.decode_replayed == steps - decode_runtime.WARMUP, st
    slot = d.slots[3]
    (sig, form), = slot.forms.items()
    assert form is not None and form.dtype == (torch.bool if attn == "sdpa" else torch.float32), slot.forms
    # the warm-up steps and the capture ran transformers' prepare; each later step forge's, but
    # for the first step of the second kind
    assert steps - decode_runtime.WARMUP - 2 <= d.prepared <= steps - decode_runtime.WARMUP - 1, d.prepared
    assert set(slot.fast.values()) == {slot.steps[sig]}


def test_prepared_steps_sample_as_unpatched_generate(fake_graphs):
    model = _model("qwen2")
    ids, mask = _prompt(model, 4, 6, "cpu")
    eager_model = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
              pad_token_id=0)
    for seed in (11, 12):
        with torch.no_grad():
            torch.manual_seed(seed)
            got = model.generate(ids, **kw)
            torch.manual_seed(seed)
            want = eager_model.generate(ids, **kw)
        assert torch.equal(got, want), (seed, got, want)
    assert model._forge_graphs.decode.prepared == 2 * 9 - decode_runtime.WARMUP - 1


def test_prepared_steps_fall_back_to_transformers_inputs(fake_graphs):
    model = _model("qwen2")
    ids, mask = _prompt(model, 2, 5, "cpu")
    eager_model = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    st, d = model._forge_graphs.stats, model._forge_graphs.decode
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = eager_model.generate(ids, **kw)
        assert torch.equal(model.generate(ids, **kw), want)
        prepared, replayed = d.prepared, st.decode_replayed
        # a forward pre-hook on the model itself would see forge's marker: transformers prepares
        # the inputs, and the captured step (which builds its masks) replays from its 4-D masks
        h = model.register_forward_pre_hook(lambda *a: None)
        assert torch.equal(model.generate(ids, **kw), want)
        h.remove()
        assert d.prepared == prepared and st.decode_replayed == replayed + 5, st
        # a StepMask reaching a forward that is no step of the call in flight: the masks it stands
        # for (those transformers would build), then the forward as usual
        slot = d.slots[2]
        step = next(iter(slot.fast.values()))
        name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        start = [ly.cumulative_length.clone() for ly in slot.cache.layers]
        x, pos = want[:, -1:], torch.full((2, 1), 9)
        outs = []
        for m in (decode.StepMask(slot, step, mask[:, :4]), slot.build(step.form)):
            for ly, n in zip(slot.cache.layers, start):
                ly.cumulative_length.copy_(n)
            outs.append(model(input_ids=x, position_ids=pos, attention_mask=m, **{name: slot.cache}).logits)
        assert torch.equal(*outs)


def test_someone_elses_prepare_inputs_is_left_alone(fake_graphs):
    model = _model("qwen2")
    ids, mask = _prompt(model, 2, 5, "cpu")
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        theirs = model.prepare_inputs_for_generation  # another library's instance attribute
        model.prepare_inputs_for_generation = theirs
        forge.patch(model, mode="infer", kernels=NONE, graphs=True)
        assert model.__dict__["prepare_inputs_for_generation"] is theirs
        assert torch.equal(model.generate(ids, **kw), want)
    st, d = model._forge_graphs.stats, model._forge_graphs.decode
    assert st.decode_replayed == 4 - decode_runtime.WARMUP and d.prepared == 0, st  # replays, 4-D masks given
    assert [s.form for s in d.slots[2].steps.values()] == [None]  # captured with the masks as inputs
    forge.unpatch(model)
    assert model.__dict__["prepare_inputs_for_generation"] is theirs


def test_masks_built_in_the_graph_are_checked_against_transformers():
    from transformers import StaticCache

    model = _model("qwen2")
    slot = decode_runtime.CachedSteps(StaticCache(config=model.config, max_cache_len=8), 2, 8)
    assert slot.buildable
    for ly in slot.cache.layers:
        ly.cumulative_length.fill_(5)  # the new token goes to position 5
    mask2d = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    want = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)[:, None, None, :]
    low = torch.finfo(torch.float32).min
    as_float = torch.where(want, 0.0, low)
    for sig, mask, keys in ((1, {"full_attention": want}, ("full_attention",)), (2, want, None), (3, as_float, None)):
        slot.check(sig, mask, mask2d)
        form = slot.forms[sig]
        assert form is not None and form.keys == keys and form.dtype == (as_float.dtype if sig == 3 else torch.bool)
        built = slot.build(form)
        assert torch.equal(built["full_attention"], want) if keys else torch.equal(built, mask)
        # from the masks' own row (a replay reached without forge's prepare): they have the form
        assert slot.matches(form, mask, False)
    slot.check(2, want, None)  # no 2-D mask means no padding: these masks are not that
    assert slot.forms[2] is None
    slot.check(2, want, mask2d)  # and a signature that failed once keeps the given form
    assert slot.forms[2] is None
    slot.check(3, as_float, False)  # a step whose 2-D mask was not known: given too
    assert slot.forms[3] is None
    # anything else (a window, a per-head mask, another width, two different masks) is refused
    window = want.clone()
    window[..., :3] = False
    for sig, mask in ((4, window), (5, want.expand(2, 4, 1, 8)), (6, want[..., :6]),
                      (7, {"full_attention": want, "sliding_attention": window})):
        slot.check(sig, mask, mask2d)
        assert slot.forms[sig] is None, sig


def test_max_new_tokens_beyond_the_cache_grows_it(fake_graphs):
    model = _model("qwen2")
    ids, mask = _prompt(model, 2, 5, "cpu")
    eager_model = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    st, d = model._forge_graphs.stats, model._forge_graphs.decode
    for new, caches, capacity in ((3, 1, 8), (3, 1, 8), (20, 2, 24), (3, 3, 8)):
        kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
        got, want = model.generate(ids, **kw), eager_model.generate(ids, **kw)
        assert got.shape == want.shape == (2, 5 + new)
        assert torch.equal(got, want)
        # 5 + 20 tokens do not fit the 8 of the first cache: a new one of 24; back to 3 new
        # tokens, 24 is over twice too long: a new one of 8
        assert st.decode_caches == caches and d.slots[2].capacity == capacity, (new, st)


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_a_returned_cache_is_the_callers(model_type, fake_graphs):
    # return_dict_in_generate handed the caller forge's own cache, which forge keeps: the next
    # call of that batch size reset and refilled it under a caller continuing a conversation with
    # it (turn-2 logits 0.6 off), and past its capacity forge's one-token update wrote nothing
    model = _model(model_type)
    eager_model = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    a, am = _prompt(model, 1, 5, "cpu", seed=1)
    b, bm = _prompt(model, 1, 5, "cpu", seed=2)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    logits = []
    for m in (model, eager_model):
        out = m.generate(a, attention_mask=am, **kw)
        m.generate(b, attention_mask=bm, **kw)  # another conversation, the same batch size
        more = torch.full((1, 2 if model_type == "qwen2" else 1), 7)  # (gemma2: a static cache of 8)
        with torch.no_grad():
            logits.append(m(more, past_key_values=out.past_key_values, use_cache=True).logits)
        if m is model:
            d = model._forge_graphs.decode
            assert d.slots and all(out.past_key_values is not slot.cache for slot in d.slots.values())
            full = model_type == "qwen2"  # (gemma2's sliding layers: a copy of the static cache)
            want = type(eager_model.generate(a, attention_mask=am, **kw).past_key_values)
            assert (type(out.past_key_values) is want) == full
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_calls_the_path_cannot_serve_run_as_before(fake_graphs):
    from transformers import DynamicCache

    model = _model("gemma")
    ids, mask = _prompt(model, 2, 5, "cpu")
    eager_model = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    st = model._forge_graphs.stats
    base = dict(attention_mask=mask, max_new_tokens=3, pad_token_id=0)
    cases = [
        ({"past_key_values": DynamicCache(config=model.config)}, "generate: a cache passed by the caller"),
        ({"num_beams": 2, "do_sample": False},
         "generate: generation mode beam_search (captured: greedy_search, sample)"),
        ({"use_cache": False}, "generate: use_cache=False"),
        ({"output_hidden_states": True, "return_dict_in_generate": True}, "generate: output_hidden_states"),
    ]
    for extra, why in cases:
        kw = {**base, **extra}
        if "past_key_values" in kw:  # a cache is consumed: one each
            want = eager_model.generate(ids, **{**kw, "past_key_values": DynamicCache(config=model.config)})
        else:
            want = eager_model.generate(ids, **kw)
        got = model.generate(ids, **kw)
        got, want = (getattr(x, "sequences", x) for x in (got, want))
        assert torch.equal(got, want), why
        assert st.why.get(why) == 1, (why, st)
    assert st.decode_replayed == st.decode_captures == st.decode_caches == 0
    # transformers' output-capturing hooks (installed for good by the hidden states asked for
    # above) do nothing in a plain call: it is served; a hook of the user's is not
    assert torch.equal(model.generate(ids, **base), eager_model.generate(ids, **base))
    assert st.decode_caches == 1 and "generate: module hooks" not in st.why
    h = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    model.generate(ids, **base)
    h.remove()
    assert st.why.get("generate: module hooks") == 1


def test_unpatch_restores_generate():
    model = _model("qwen2")
    ids, mask = _prompt(model, 2, 5, "cpu")
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    taken = set(decode.TAKEN)
    assert "prepare_inputs_for_generation" in taken
    assert taken <= model.__dict__.keys()
    # no CUDA here: generate runs as before, the reason counted (and the layer graphs count its
    # three decoder passes, a padded mask each)
    assert torch.equal(model.generate(ids, **kw), want)
    assert model._forge_graphs.stats.why == {"generate: the model is on cpu, CUDA graphs need a CUDA device": 1,
                                             "attention mask": 3}
    # a deep copy comes back patched on its own (docs/patching.md): its own graphs and decoding
    dup = copy.deepcopy(model)
    assert torch.equal(dup.generate(ids, **kw), want) and dup._forge_graphs is not model._forge_graphs
    assert taken <= dup.__dict__.keys() and dup.generate.__self__ is dup
    assert sum(model._forge_graphs.stats.why.values()) == 4  # nothing of the copy's is counted
    forge.unpatch(model)
    assert not taken & model.__dict__.keys() and not hasattr(model, "_forge_graphs")
    assert torch.equal(model.generate(ids, **kw), want)
    # train mode keeps generate as it is (the fused loss takes the forward)
    forge.patch(model, kernels=NONE, graphs=True)
    assert "generate" not in model.__dict__ and model._forge_graphs.decode is None


def test_capturable_backends_come_from_the_op_layers_registry(monkeypatch):
    # the decoding path asks forge.ops.on_stream (each registry entry's hook), never a backend:
    # flipping the Pallas hook's answer flips what decode accepts
    from forge import ops

    model = _model("qwen2")
    assert ops.on_stream("triton") == (True, "")
    with pytest.raises(ValueError, match="unknown backend"):
        ops.on_stream("bogus")
    ok, why = ops.availability("pallas")
    if not ok:
        assert ops.on_stream("pallas") == (False, why)
        return
    from bridge import native

    assert ops.on_stream("pallas") == native.available()
    for on in (True, False):
        monkeypatch.setattr(native, "available", lambda on=on: (on, "" if on else "test: no native launch"))
        assert ops.on_stream("pallas") == native.available()
        why = decode.why_not(model, {"rmsnorm": "triton", "rope": "pallas"})
        assert (why is None) if on else ("rope" in why and "'pallas'" in why)


def test_decode_declines_kernels_it_cannot_capture():
    model = _model("qwen2")
    from bridge import native

    why = decode.why_not(model, {"rmsnorm": "triton", "rope": "pallas"})
    if native.available()[0]:  # Pallas launched natively on torch's stream: capturable
        assert why is None
    else:
        assert why and "rope" in why and "'pallas'" in why
    assert decode.why_not(model, {"rmsnorm": "triton", "rope": "bogus"})
    assert decode.why_not(model, {"rmsnorm": "triton"}) is None
    model.generate = model.generate  # someone else's instance attribute: left alone
    assert "already replaced" in decode.why_not(model, {})


def test_steps_captured_before_a_cublas_workspace_clear_are_captured_again(fake_graphs, monkeypatch):
    # torch.compile's CUDA graph trees clear torch's cuBLAS workspaces around every recording: a
    # step captured before a clear would replay over the freed workspace; it is captured again
    cleared = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(1), raising=False)
    model = _model("qwen2")
    eager_model = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    st = model._forge_graphs.stats
    ids, mask = _prompt(model, 2, 5, "cpu")
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = eager_model.generate(ids, **kw)
        first = model.generate(ids, **kw)
        assert st.decode_captures == 1, st
        torch._C._cuda_clearCublasWorkspaces()  # (forge's wrapper counts it and calls through)
        assert cleared == [1]
        again = model.generate(ids, **kw)
        assert st.decode_captures == 2 and any("cuBLAS workspaces were cleared" in k for k in st.why), st
        model.generate(ids, **kw)  # no clear since: replayed, not captured again
    assert st.decode_captures == 2, st
    assert torch.equal(first, want) and torch.equal(again, want)


AGAIN = "generate: decoding steps captured again (the model's weights moved"


@pytest.mark.parametrize("change", ["inference mode", "cast", "replaced head", "none"])
def test_a_cache_is_made_again_when_its_weights_or_mode_change(fake_graphs, change):
    # the captured steps read the weights where they were at capture: after a cast (or a move,
    # or a replaced module) the cache and its steps are dropped and made again; a cache made
    # under torch.inference_mode holds inference tensors, which a call outside it cannot reset
    model = _model("qwen2", tie_word_embeddings=False)
    eager_model = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    st, d = model._forge_graphs.stats, model._forge_graphs.decode
    ids, mask = _prompt(model, 2, 5, "cpu")
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.inference_mode() if change == "inference mode" else torch.no_grad():
        first = model.generate(ids, **kw)
    assert torch.equal(first, eager_model.generate(ids, **kw))
    old = d.slots[2]
    if change == "cast":
        for m in (model, eager_model):
            m.to(torch.float64)
    elif change == "replaced head":
        head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        with torch.no_grad():
            head.weight.normal_()
        model.lm_head, eager_model.lm_head = head, copy.deepcopy(head)
    with torch.no_grad():
        got = model.generate(ids, **kw)
        want = eager_model.generate(ids, **kw)
    assert torch.equal(got, want), change
    again = change != "none"
    assert (d.slots[2] is not old) is again and st.decode_caches == 1 + again, st
    assert any(k.startswith(AGAIN) for k in st.why) is again, st.why
    with torch.no_grad():
        model.generate(ids, **kw)  # nothing changed since: the same cache, its steps replayed
    assert st.decode_caches == 1 + again, st


def test_logits_outside_pool_equal_the_heads_and_restore_it(monkeypatch):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False)
    x = torch.randn(3, 1, 16)
    with decode_runtime.logits_outside_pool(head, 3) as buf:
        assert buf is None  # 480 bytes of logits: they stay in the pool's small segment
    monkeypatch.setattr(decode_runtime, "LARGE", 3 * 40 * 4)
    with decode_runtime.logits_outside_pool(head, 3) as buf:
        assert buf is not None and buf.shape == (3, 1, 40) and "forward" in head.__dict__
        with torch.no_grad():  # (as in generate)
            out = head(x)
            assert out is buf and torch.equal(out, torch.nn.functional.linear(x, head.weight))
            other = head(torch.randn(2, 4, 16))  # not a decoding step's input: the head's own forward
            assert other.shape == (2, 4, 40) and other.data_ptr() != buf.data_ptr()
        tracked = head(x)  # autograd on: the head's own forward (out= records no graph)
        assert tracked is not buf and tracked.requires_grad
    assert "forward" not in head.__dict__
    hooked = torch.nn.Linear(16, 40, bias=False)
    hooked.register_forward_hook(lambda m, i, o: o)
    for other in (torch.nn.Linear(16, 40), hooked, torch.nn.Embedding(4, 4)):  # bias, hook: left alone
        with decode_runtime.logits_outside_pool(other, 3) as buf:
            assert buf is None and "forward" not in other.__dict__


def test_captured_steps_write_logits_outside_the_pool(fake_graphs, monkeypatch):
    # the step's static logits are the buffer logits_outside_pool made before the capture
    made = []
    real = decode_runtime.logits_outside_pool

    @contextlib.contextmanager
    def spy(head, batch):
        with real(head, batch) as buf:
            made.append(buf)
            yield buf

    monkeypatch.setattr(decode_runtime, "logits_outside_pool", spy)
    monkeypatch.setattr(decode_runtime, "LARGE", 1)  # (the tiny model's logits count as large)
    model = _model("qwen2")
    ids, mask = _prompt(model, 2, 4, "cpu")
    _check_generate(model, ids, mask, 5, torch.float32, torch.float64, kernels=NONE, graphs=True)
    (slot,) = model._forge_graphs.decode.slots.values()
    (step,) = slot.steps.values()
    assert len(made) == 1 and made[0] is not None and step.logits is made[0] and step.template.logits is made[0]
    assert "forward" not in model.lm_head.__dict__


# ---------------------------------------------------------------------------------------------
# GPU: real CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
# (mixtures of experts: their routing has no host sync; "olmoe_mha": OLMoE with as many KV heads
# as heads, as its published shape has, whose decoding steps attend through forge's kernel too)
@pytest.mark.parametrize("model_type", ARCHS + ["qwen3_moe", "olmoe_mha"])
def test_greedy_generate_gpu(model_type, graphs):
    # gemma2's window of 40 fills at the prompt's 32 + 8th new token: both kinds of step run
    kw = {"gemma2": {"sliding_window": 40}, "olmoe_mha": {"num_key_value_heads": 14}}.get(model_type, {})
    model = _model(model_type.removesuffix("_mha"), "qwen05b", torch.bfloat16, "cuda", **kw)
    if model_type in ("qwen3_moe", "olmoe_mha"):  # transformers' loop over the experts (its grouped_mm takes no fp32)
        model.set_experts_implementation("eager")
    ids, mask = _prompt(model, 2, 32, "cuda")
    _check_generate(model, ids, mask, 16, torch.bfloat16, torch.float32, backend="triton", graphs=graphs)
    if graphs:
        st = model._forge_graphs.stats
        assert st.decode_captures == 1 and st.decode_replayed > 0, st
        assert not [w for w in st.why if "capture failed" in w], st
        assert model._forge_graphs.decode.attends == "triton"


@pytest.mark.gpu
def test_greedy_generate_pallas_gpu():
    # the Pallas backend's kernels launch natively on torch's stream: its decoding steps are
    # captured too, and attend through its own decoding kernel
    from bridge import native

    if not native.available()[0]:
        pytest.skip(f"the Pallas native launch is unavailable here: {native.available()[1]}")
    model = _model("qwen2", "qwen05b", torch.bfloat16, "cuda")
    ids, mask = _prompt(model, 2, 32, "cuda")
    _check_generate(model, ids, mask, 16, torch.bfloat16, torch.float32, backend="pallas", graphs=True,
                    min_elements=0)
    st = model._forge_graphs.stats
    assert model._forge_graphs.decode.attends == "pallas"
    assert st.decode_captures == 1 and st.decode_replayed > 0, st
    assert not [w for w in st.why if "capture failed" in w], st


@pytest.mark.gpu
@pytest.mark.parametrize("backend", forge.ops.BACKENDS)
@pytest.mark.parametrize("switch,batch", [("KV_APPEND", 2), ("ROW_LINEAR", 1), ("ROW_GLU", 1)])
def test_greedy_generate_switch_gpu(backend, switch, batch, monkeypatch):
    # decode.KV_APPEND on: the captured steps write the cache with the backend's kv_append;
    # decode.ROW_LINEAR on: the captured batch-1 steps run their products with its row_linear
    # (with decode.ROW_SUMS, the residual sums too); decode.ROW_GLU on: the MLPs' gate/up
    # products and activations with its row_glu
    if backend == "pallas":
        from bridge import native

        if not native.available()[0]:
            pytest.skip(f"the Pallas native launch is unavailable here: {native.available()[1]}")
    monkeypatch.setattr(decode, switch, True)
    monkeypatch.setattr(decode, "ROW_SUMS", switch == "ROW_LINEAR")
    model = _model("qwen3", "qwen05b", torch.bfloat16, "cuda")
    ids, mask = _prompt(model, batch, 32, "cuda")
    kw = {"min_elements": 0} if backend == "pallas" else {}
    _check_generate(model, ids, mask, 16, torch.bfloat16, torch.float32, backend=backend, graphs=True, **kw)
    st, d = model._forge_graphs.stats, model._forge_graphs.decode
    kernel = {"KV_APPEND": d.append, "ROW_LINEAR": d.linear, "ROW_GLU": d.glu}[switch]
    assert d.attends == backend and kernel is not None
    assert st.decode_captures == 1 and st.decode_replayed > 0, st
    if switch == "ROW_LINEAR":  # (and ROW_SUMS: o's and down's sums, each layer)
        assert sum(s.row_calls for s in d.slots.values()) > 0
        assert sum(s.row_sums for s in d.slots.values()) >= 2 * model.config.num_hidden_layers
    if switch == "ROW_GLU":
        assert sum(s.row_glus for s in d.slots.values()) >= model.config.num_hidden_layers


@pytest.mark.gpu
def test_sampling_and_batch_sizes_gpu():
    model = _model("qwen2", "gpu_demo", torch.bfloat16, "cuda")
    forge.patch(model, mode="infer", backend="triton", graphs=True)
    st = model._forge_graphs.stats
    for b in (1, 3, 8):
        ids, mask = _prompt(model, b, 16, "cuda", seed=b)
        torch.manual_seed(0)
        a = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20, top_p=0.9,
                           temperature=0.8, pad_token_id=0)
        torch.manual_seed(0)
        c = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20, top_p=0.9,
                           temperature=0.8, pad_token_id=0)
        assert torch.equal(a, c) and a.shape == (b, 28) and int(a.max()) < model.config.vocab_size
    assert st.decode_caches == 3 and st.decode_captures == 3 and st.decode_replayed >= 3 * (2 * 11 - 2), st


@pytest.mark.gpu
def test_unpatch_frees_the_decode_graphs_and_cache():
    model = _model("qwen2", "gpu_demo", torch.bfloat16, "cuda")
    ids, mask = _prompt(model, 8, 64, "cuda")
    forge.patch(model, mode="infer", backend="triton", graphs=True)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert model._forge_graphs.stats.decode_replayed > 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    forge.unpatch(model)
    torch.cuda.empty_cache()  # no gc.collect(): nothing may wait for one
    assert torch.cuda.memory_allocated() < held[0], "unpatch kept the static cache"
    assert torch.cuda.memory_reserved() < held[1], "unpatch kept the graph pool"


@pytest.mark.gpu
def test_a_served_call_keeps_one_cublas_workspace_in_use():
    # torch keeps a cuBLAS workspace per stream for the life of the process (33 MiB on the H200);
    # the graphs use the capture stream's, and a served generate() runs there: it adds that one
    # workspace, not a second one on the caller's stream as well
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        pytest.skip("this torch has no _cuda_clearCublasWorkspaces to measure its workspaces with")
    model = _model("qwen2", "gpu_demo", torch.bfloat16, "cuda")
    ids, mask = _prompt(model, 2, 16, "cuda")
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    clear()
    before = torch.cuda.memory_allocated()
    x @ x  # noqa: B018 - one product on the caller's stream: the size of one workspace
    torch.cuda.synchronize()
    one = torch.cuda.memory_allocated() - before
    if one == 0:
        pytest.skip("this torch build keeps no cuBLAS workspace in the caching allocator")
    forge.patch(model, mode="infer", backend="triton", graphs=True)
    torch.cuda.synchronize()
    clear()
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert model._forge_graphs.stats.decode_replayed > 0
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    clear()  # (the graphs now point at a freed workspace: never replayed again, unpatched below)
    dropped = torch.cuda.memory_allocated() - held
    forge.unpatch(model)
    # (a served call's products with a bias may add cuBLASLt's own small workspace: under 2x one)
    assert one <= -dropped < 2 * one, f"the call left {-dropped / 2**20:.1f} MiB of workspaces, one is {one / 2**20:.1f}"


@pytest.mark.gpu
def test_forge_graphs_after_torch_compiles_cudagraph_trees_gpu():
    # torch.compile(mode="reduce-overhead") records CUDA graph trees in the same process and clears
    # the cuBLAS workspaces around each recording: forge's captured steps are captured again
    # rather than replayed over the freed workspace, and the tokens stay eager's
    model = _model("qwen2", "gpu_demo", torch.bfloat16, "cuda")
    eager_model = copy.deepcopy(model)
    ids, mask = _prompt(model, 2, 16, "cuda")
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = eager_model.generate(ids, **kw)
    forge.patch(model, mode="infer", backend="triton", graphs=True)
    st = model._forge_graphs.stats
    with torch.no_grad():
        first = model.generate(ids, **kw)
    assert st.decode_captures == 1, st
    lin = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)
    step = torch.compile(lambda x: torch.relu(lin(x)) @ lin.weight, mode="reduce-overhead")
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):  # warm-up, record, replay
            y = step(x).clone()
    torch.cuda.synchronize()
    assert torch.allclose(y.float(), (torch.relu(lin(x)) @ lin.weight).float(), atol=1e-2, rtol=1e-2)
    from forge.patching import graphs

    assert graphs.workspace_epoch() > 0, "torch.compile cleared no cuBLAS workspace: nothing was tested"
    with torch.no_grad():
        again = model.generate(ids, **kw)
        model.generate(ids, **kw)
    assert st.decode_captures == 2, st
    assert torch.equal(first, want) and torch.equal(again, want)
    forge.unpatch(model)


@pytest.mark.parametrize("attention", ["sdpa", *forge.ops.BACKENDS])
def test_packed_gqa_attention_matches_repeated_kv(attention):
    # one new token per sequence: the query heads of each KV head attend as that head's rows
    # (SDPA on the packed rows), or through the backend's decoding kernel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    kernel = None if attention == "sdpa" else forge.ops.get("decode_attention", attention)
    g = torch.Generator().manual_seed(0)
    b, hk, groups, length, d = 3, 2, 4, 11, 8
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    q = torch.randn(b, 1, hk * groups, d, generator=g).transpose(1, 2)  # (B, H, 1, D) as a view, like HF's
    k, v = (torch.randn(b, hk, length, d, generator=g) for _ in range(2))
    keep = torch.rand(b, 1, 1, length + 3, generator=g) > 0.3  # wider than the keys, as a static cache's
    keep[..., 0] = True
    calls = []

    def orig(*a, **kw):
        calls.append(a[1].shape)
        return "delegated", None

    for mask in (keep, torch.where(keep, 0.0, float("-inf")), None, keep[:1]):  # (the last: shared by the batch)
        got, _ = decode_runtime._packed_sdpa(orig, kernel, module, q, k, v, mask, scaling=0.3, sliding_window=None)
        m = None if mask is None else mask[..., :length]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=m, scale=0.3)
        torch.testing.assert_close(got, ref.transpose(1, 2))
        assert got.shape == (b, 1, hk * groups, d) and got.is_contiguous()
    assert not calls
    # anything else goes to transformers' own function: two query tokens, a per-head mask, softcapping
    args = (orig, kernel, module)
    assert decode_runtime._packed_sdpa(*args, q.expand(b, hk * groups, 2, d), k, v, None)[0] == "delegated"
    per_head = torch.ones(b, hk * groups, 1, length, dtype=torch.bool)
    assert decode_runtime._packed_sdpa(*args, q, k, v, per_head)[0] == "delegated"
    assert decode_runtime._packed_sdpa(*args, q, k, v, None, softcap=50.0)[0] == "delegated"
    assert len(calls) == 3
    # one query head per KV head (multi-head, OLMoE's): the backend's kernel where there is one,
    # else transformers' SDPA, which reads the cache as it is (orig)
    module.num_key_value_groups = 1
    got, _ = decode_runtime._packed_sdpa(*args, q[:, :hk], k, v, keep, scaling=0.3)
    if kernel is None:
        assert got == "delegated" and len(calls) == 4
    else:
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :hk], k, v, attn_mask=keep[..., :length], scale=0.3)
        torch.testing.assert_close(got, ref.transpose(1, 2))
        assert got.shape == (b, 1, hk, d) and len(calls) == 3
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with decode_runtime.packed_gqa():
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not before
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before and "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping


def test_packed_gqa_is_this_threads_and_overlapping_steps_put_the_entry_back(monkeypatch):
    # packed_gqa swapped transformers' process-wide "sdpa" entry and put back what it had found:
    # two decoding steps overlapping in two threads that ended out of order (A in, B in, A out,
    # B out) left A's function there for good, so every later one-token SDPA call of any model
    # went through forge's attention; and while a step ran, other threads' calls went through it
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns

    monkeypatch.setitem(fns._local_mapping, "sdpa", lambda *a, **k: "orig")
    monkeypatch.setattr(decode_runtime, "_packed_sdpa", lambda orig, kernel, *a, **k: ("packed", kernel))
    mine = fns["sdpa"]
    a, b = decode_runtime.packed_gqa("A"), decode_runtime.packed_gqa("B")
    a.__enter__()
    assert fns["sdpa"]() == ("packed", "A")
    b.__enter__()
    assert fns["sdpa"]() == ("packed", "B")
    elsewhere = []
    t = threading.Thread(target=lambda: elsewhere.append(fns["sdpa"]()))
    t.start()
    t.join()
    assert elsewhere == ["orig"]
    a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    assert fns._local_mapping["sdpa"] is mine and fns["sdpa"]() == "orig"
