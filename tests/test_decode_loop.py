"""generate() served on the device (forge/patching/decode_loop.py, ``decode.device_loop``).

On the CPU the CUDA graphs are test_decode's stand-in (``fake_graphs``: a capture runs the steps,
a replay runs them again on the static buffers), so the loop's own logic runs as on a GPU: token
selection, eos and pad, the finished flags, the chunks and the tail, the trim, the fallbacks.
Greedy decoding is the same arithmetic as transformers' loop (argmax of the same float32
logits through the same processors), so its tokens are compared for equality: with the
unpatched model, and with forge's host loop (device loop off: the same kernels and cache, so
equal bit for bit). Sampling draws from torch's generator by an exponential race, not
transformers' multinomial: its statistics are tested instead (support under top-k / top-p,
frequencies against the warped distribution), and a seed reproduces a run.
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from test_decode import NONE, _check_generate, _model, _prompt, fake_graphs  # noqa: E402,F401

import forge  # noqa: E402
from forge.patching import decode_loop  # noqa: E402


@pytest.fixture
def loop_on(monkeypatch):
    monkeypatch.setattr(decode_loop, "DEVICE_LOOP", True)  # the default a patch starts from


def _pair(model_type, **kw):
    """(patched model with the device loop on, an unpatched copy)."""
    model = _model(model_type, **kw)
    ref = copy.deepcopy(model)
    forge.patch(model, mode="infer", kernels=NONE, graphs=True)
    model._forge_graphs.decode.device_loop = True
    return model, ref


def _gen(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, **{"do_sample": False, "pad_token_id": 0, **kw})


# ---------------------------------------------------------------------------------------------
# CPU: the loop's logic, steps run through the stand-in graphs


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "gemma", "qwen3_moe"])
def test_greedy_equals_unpatched_and_the_host_loop(model_type, fake_graphs):
    model, ref = _pair(model_type)
    ids, mask = _prompt(model, 3, 5, "cpu")  # the first row left-padded
    new = 2 * decode_loop.CHUNK + 3  # the first token, two chunks, a tail of single steps
    want = _gen(ref, ids, attention_mask=mask, max_new_tokens=new)
    got = _gen(model, ids, attention_mask=mask, max_new_tokens=new)
    assert torch.equal(got, want), (got, want)
    d, st = model._forge_graphs.decode, model._forge_graphs.stats
    assert d.loop_calls == 1 and d.loop_tokens == 3 * new
    # the first chunk warms up uncaptured; the second chunk and the tail step are captured
    assert st.decode_captures == 2 and st.decode_replayed == 1 + 2, st
    d.device_loop = False
    host = _gen(model, ids, attention_mask=mask, max_new_tokens=new)
    assert torch.equal(host, got) and d.loop_calls == 1
    d.device_loop = True
    again = _gen(model, ids, attention_mask=mask, max_new_tokens=new)  # replays only
    assert torch.equal(again, want) and d.loop_calls == 2 and st.decode_captures == 3, st


@pytest.mark.parametrize("loop", [True, False])
def test_a_callers_longer_max_length_criteria(loop, fake_graphs):
    # transformers lets a caller's MaxLengthCriteria replace its own, so a call may run past the
    # config's max_length: the cache is sized for the longest such criterion (it had been sized
    # for the config's length, and the call wrote past it)
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    model, ref = _pair("qwen2")
    model._forge_graphs.decode.device_loop = loop
    ids, mask = _prompt(model, 2, 6, "cpu")
    for length in (18, 46):  # past the 8-token cache a length of 6 + 5 asks for, then past 24 and 40
        kw = dict(attention_mask=mask, max_new_tokens=5,
                  stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(length)]))
        want = _gen(ref, ids, **kw)
        got = _gen(model, ids, **kw)
        assert want.shape == (2, length) and torch.equal(got, want), length
    assert model._forge_graphs.decode.slots[2].capacity >= 45


def test_greedy_check_rule_against_eager(loop_on, fake_graphs):
    # test_decode's rule (logits along both continuations under the oracle) with the loop on
    model = _model("qwen3")
    ids, mask = _prompt(model, 2, 5, "cpu")
    _check_generate(model, ids, mask, 11, torch.float32, torch.float64, kernels=NONE, graphs=True)
    assert model._forge_graphs.decode.loop_calls == 1
    # the teacher-forced calls (a logits processor of the test's own, output_logits) are declined
    why = model._forge_graphs.stats.why
    assert why.get("device loop: return_dict_in_generate") == 2, why


def test_row_linear_in_the_loops_steps(loop_on, fake_graphs, monkeypatch):
    # decode.ROW_LINEAR on at batch 1: the loop's chunks run their one-row products (q/k/v, o, the
    # router, the head) with the attention backend's row_linear, and follow eager under the rule
    from forge.patching import decode

    monkeypatch.setattr(decode, "ROW_LINEAR", True)
    model = _model("qwen3_moe")
    model.set_experts_implementation("eager")  # (transformers' grouped_mm takes no float64 reference)
    ids, mask = _prompt(model, 1, 5, "cpu")
    _check_generate(model, ids, mask, decode_loop.CHUNK + 2, torch.float32, torch.float64, backend="triton",
                    kernels=["rope"], graphs=True)
    d = model._forge_graphs.decode
    assert d.loop_calls == 1 and d.linear is not None
    assert sum(s.row_calls for s in d.slots.values()) > 0


@pytest.mark.parametrize("when", ["one row", "every row early"])
def test_eos_pads_finished_rows_and_stops_as_transformers(when, fake_graphs):
    model, ref = _pair("qwen2")
    ids, mask = _prompt(model, 3, 5, "cpu")
    new = 3 * decode_loop.CHUNK
    free = _gen(ref, ids, attention_mask=mask, max_new_tokens=new)[:, 5:]
    if when == "one row":
        eos = [int(free[1, 4])]
    else:  # every row meets one of the eos ids within the first chunk
        eos = sorted({int(free[r, 2 + r]) for r in range(3)})
    kw = dict(attention_mask=mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=7)
    want, got = _gen(ref, ids, **kw), _gen(model, ids, **kw)
    assert torch.equal(got, want), (got, want)
    if when == "every row early":
        assert want.shape[1] < 5 + decode_loop.CHUNK  # transformers stopped early: so did the loop
        assert model._forge_graphs.stats.decode_replayed == 0  # (stopped after the warm-up chunk)
    else:
        assert want.shape[1] == 5 + new and (want[1, 5 + 5:] == 7).all()  # row 1 padded after its eos
    assert model._forge_graphs.decode.loop_calls == 1
    # a graph reads the eos ids at the address it was captured with: a later call with the same
    # settings must hand it the same tensor, not a new one
    loop = next(iter(model._forge_graphs.decode.slots.values())).loop
    eos_t = loop.eos
    assert torch.equal(_gen(model, ids, **kw), want) and loop.eos is eos_t


def test_min_new_tokens_and_max_length(fake_graphs):
    model, ref = _pair("qwen2")
    ids, mask = _prompt(model, 2, 6, "cpu")
    free = _gen(ref, ids, attention_mask=mask, max_new_tokens=12)[:, 6:]
    eos = [int(free[0, 1]), int(free[1, 1])]  # would end both rows at their second token
    for kw in (dict(max_new_tokens=12, min_new_tokens=9), dict(max_length=6 + 10, min_length=6 + 4),
               dict(max_new_tokens=1), dict(max_new_tokens=decode_loop.CHUNK + 1)):
        kw = dict(attention_mask=mask, eos_token_id=eos, **kw)
        want, got = _gen(ref, ids, **kw), _gen(model, ids, **kw)
        assert torch.equal(got, want), (kw, got, want)
    assert model._forge_graphs.decode.loop_calls == 4


def test_sampling_seeded_top_k_top_p(fake_graphs):
    model, ref = _pair("qwen2")
    ids, mask = _prompt(model, 3, 5, "cpu")
    kw = dict(attention_mask=mask, max_new_tokens=decode_loop.CHUNK + 4, do_sample=True, temperature=0.7, top_k=4,
              top_p=0.9)
    for _ in range(2):  # warm-up, then the chunk's capture (a stand-in capture runs the steps: it draws too)
        _gen(model, ids, **kw)
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(_gen(model, ids, **kw))
    assert torch.equal(runs[0], runs[1]), "the same seed gave different samples"
    assert not torch.equal(runs[0], runs[2]), "another seed gave the same samples"
    # every token sampled is among the top 4 of the unpatched model's logits at its step
    from test_decode import _forced_logits

    for seq in runs:
        logits = _forced_logits(ref, ids, mask, seq)
        assert (logits.topk(4, dim=-1).indices == seq[:, 5:, None]).any(-1).all()
    # top_k=1 leaves one token: sampling is greedy's argmax
    torch.manual_seed(0)
    one = _gen(model, ids, **{**kw, "top_k": 1})
    assert torch.equal(one, _gen(ref, ids, attention_mask=mask, max_new_tokens=kw["max_new_tokens"]))
    assert model._forge_graphs.decode.loop_calls == 6


def _draws(procs, logits, n):
    """``n`` tokens drawn by the loop's selection from one row of logits through transformers'
    warpers for ``procs`` (in generate's order), and the warped distribution."""
    from transformers import GenerationConfig
    from transformers.generation import logits_process as lp
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    order = [("temperature", lp.TemperatureLogitsWarper), ("top_k", lp.TopKLogitsWarper),
             ("top_p", lp.TopPLogitsWarper)]
    warpers = [cls(procs[k]) for k, cls in order if k in procs]
    cfg = GenerationConfig(do_sample=True)
    cfg._pad_token_tensor = None
    assert decode_loop.Plan.of(cfg, warpers, []) == (None, "no max_length")
    plan, why = decode_loop.Plan.of(cfg, warpers, [MaxLengthCriteria(10)])
    assert why is None and plan.sample
    loop = decode_loop.Loop.__new__(decode_loop.Loop)  # (select reads only these)
    loop.plan, loop.min_eos, loop.ids, loop.length = plan, [None] * len(warpers), None, torch.zeros(1)
    warped = logits[None]
    for w in warpers:
        warped = w(None, warped)
    return loop.select(logits.expand(n, -1).clone()), torch.softmax(warped[0].double(), -1)


@pytest.mark.parametrize("procs", [dict(temperature=0.5), dict(top_k=3), dict(top_p=0.7), dict(temperature=1.7,
                                                                                                top_k=5, top_p=0.9)])
def test_sampling_frequencies_follow_the_warped_distribution(procs):
    torch.manual_seed(1)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 40_000
    tok, p = _draws(procs, logits, n)
    freq = torch.bincount(tok, minlength=logits.numel()).double() / n
    assert (freq[p == 0] == 0).all(), (freq, p)  # nothing outside top-k / the nucleus is drawn
    bound = 5 * (p * (1 - p) / n).sqrt() + 1e-9  # 5 standard deviations of a frequency
    assert ((freq - p).abs() <= bound).all(), (freq, p)
    if "temperature" in procs and len(procs) == 1:  # the temperature is applied: not the plain softmax
        assert (freq - torch.softmax(logits.double(), -1)).abs().max() > 0.05


def test_calls_the_loop_cannot_serve_run_as_transformers(fake_graphs):
    from transformers import TextStreamer

    model, ref = _pair("qwen2")
    ids, mask = _prompt(model, 1, 5, "cpu")  # (a TextStreamer takes one row)
    base = dict(attention_mask=mask, max_new_tokens=6)
    cases = {"device loop: logits processor RepetitionPenaltyLogitsProcessor": dict(repetition_penalty=1.3),
             "device loop: return_dict_in_generate": dict(return_dict_in_generate=True),
             "device loop: streamer given": dict(streamer=TextStreamer(_Tok())),
             "device loop: generation mode beam_search": dict(num_beams=2)}
    why = model._forge_graphs.stats.why
    for reason, kw in cases.items():
        want, got = _gen(ref, ids, **base, **kw), _gen(model, ids, **base, **kw)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), reason
        else:
            assert torch.equal(got.sequences, want.sequences), reason
        assert why.get(reason) == 1, (reason, why)
    assert model._forge_graphs.decode.loop_calls == 0
    model._forge_graphs.decode.device_loop = False  # off: the hook is not even passed
    _gen(model, ids, **base)
    assert model._forge_graphs.decode.loop_calls == 0 and sum(v for k, v in why.items() if "loop" in k) == 4


def test_sliding_window_caches_decline_the_loop(fake_graphs):
    model, ref = _pair("gemma2")
    ids, mask = _prompt(model, 2, 5, "cpu", pad=False)
    kw = dict(attention_mask=mask, max_new_tokens=4)
    assert torch.equal(_gen(model, ids, **kw), _gen(ref, ids, **kw))
    assert model._forge_graphs.stats.why.get("device loop: sliding-window cache layers") == 1


class _Tok:
    def decode(self, *a, **k):
        return ""


# ---------------------------------------------------------------------------------------------
# GPU: real CUDA graphs of CHUNK steps


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "gemma", "qwen3_moe"])  # (qwen3_moe: routing inside a chunk's graph)
def test_device_loop_greedy_gpu(model_type, loop_on):
    model = _model(model_type, "qwen05b", torch.bfloat16, "cuda")
    if model_type == "qwen3_moe":  # transformers' loop over the experts: its grouped_mm takes no float32 reference
        model.set_experts_implementation("eager")
    ids, mask = _prompt(model, 2, 32, "cuda")
    _check_generate(model, ids, mask, 2 * decode_loop.CHUNK + 3, torch.bfloat16, torch.float32, backend="triton",
                    graphs=True)
    d, st = model._forge_graphs.decode, model._forge_graphs.stats
    # captures: the loop's chunk of CHUNK steps and its single tail step, and the host loop's
    # step (the forced-logits calls of _check_generate ask for return_dict_in_generate, which the
    # device loop leaves to transformers' loop around forge's replayed step)
    assert d.loop_calls == 1 and st.decode_captures == 3, st
    assert st.why["device loop: return_dict_in_generate"] == 2, st
    assert not [w for w in st.why if "capture failed" in w], st
    # the host loop (same kernels, same cache) gives the same tokens
    kw = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        on = model.generate(ids, **kw)
        d.device_loop = False
        off = model.generate(ids, **kw)
    assert torch.equal(on, off)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", forge.ops.BACKENDS)
def test_device_loop_row_linear_gpu(backend, loop_on, monkeypatch):
    # decode.ROW_LINEAR on: the loop's captured batch-1 chunks (qwen3_moe: the router's product
    # too) run their products with the backend's row_linear
    from forge.patching import decode

    if backend == "pallas":
        from bridge import native

        if not native.available()[0]:
            pytest.skip(f"the Pallas native launch is unavailable here: {native.available()[1]}")
    monkeypatch.setattr(decode, "ROW_LINEAR", True)
    model = _model("qwen3_moe", "qwen05b", torch.bfloat16, "cuda")
    model.set_experts_implementation("eager")  # (transformers' grouped_mm takes no float32 reference)
    ids, mask = _prompt(model, 1, 32, "cuda")
    kw = {"min_elements": 0} if backend == "pallas" else {}
    _check_generate(model, ids, mask, 2 * decode_loop.CHUNK + 3, torch.bfloat16, torch.float32, backend=backend,
                    graphs=True, **kw)
    d, st = model._forge_graphs.decode, model._forge_graphs.stats
    assert d.loop_calls == 1 and d.attends == backend and d.linear is not None
    assert sum(s.row_calls for s in d.slots.values()) > 0
    assert not [w for w in st.why if "capture failed" in w], st


@pytest.mark.gpu
def test_device_loop_sampling_and_eos_gpu(loop_on):
    model = _model("qwen2", "gpu_demo", torch.bfloat16, "cuda")
    ref = copy.deepcopy(model)
    forge.patch(model, mode="infer", backend="triton", graphs=True)
    d = model._forge_graphs.decode
    for b in (1, 3, 8):
        ids, mask = _prompt(model, b, 16, "cuda", seed=b)
        kw = dict(attention_mask=mask, max_new_tokens=29, do_sample=True, top_k=20, top_p=0.9, temperature=0.8,
                  pad_token_id=0)
        for _ in range(2):  # warm-up, then the chunk's capture: later calls replay only
            _gen(model, ids, **kw)
        torch.manual_seed(0)
        a = _gen(model, ids, **kw)
        torch.manual_seed(0)
        c = _gen(model, ids, **kw)
        assert torch.equal(a, c) and a.shape == (b, 16 + 29), "the same seed gave different samples"
        from test_decode import _forced_logits

        # every sampled token within the top 20 up to rounding: a random-weight model's logits are
        # near-flat, so its 20th and 21st logits tie within bf16 rounding, which differs between
        # the loop's captured chunk and the host loop's step (the H200 run of 2026-12-04 saw one
        # token of forge's own 21st rank); the rule: within twice the patched-vs-eager logit
        # error of eager's 20th best (the greedy rule of test_decode._check_generate)
        e, p = _forced_logits(ref, ids, mask, a), _forced_logits(model, ids, mask, a)
        picked = a[:, 16:, None]
        err = (p - e).abs().amax(-1)
        assert (e.gather(-1, picked).squeeze(-1) >= e.topk(20, dim=-1).values[..., -1] - 2 * err).all()
        # eos: rows end and pad as in forge's host loop (the same kernels: greedy tokens compare)
        free = _gen(model, ids, attention_mask=mask, max_new_tokens=29)[:, 16:]
        eos = sorted({int(free[r, min(r, 20)]) for r in range(b)})
        g = dict(attention_mask=mask, max_new_tokens=29, eos_token_id=eos, pad_token_id=3)
        on = _gen(model, ids, **g)
        d.device_loop = False
        off = _gen(model, ids, **g)
        d.device_loop = True
        assert torch.equal(on, off)
        if b == 1:  # its only row ends at its first token: generate() stops there, nothing to pad
            assert on.shape[1] == 16 + 1 and int(on[0, 16]) in eos, on
        else:  # row 0 ends at its first token and is padded while the others go on
            assert (on[0, 17:] == 3).all() and (on[:, 16:] == 3).any(), on
    assert d.loop_calls == 3 * 6, d.loop_calls
    assert not [w for w in model._forge_graphs.stats.why if "capture failed" in w]
