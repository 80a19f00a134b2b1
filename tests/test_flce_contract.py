"""The fused loss's contract with its callers, beyond its numbers (tests/test_fused_linear_ce.py):
which labels it takes (int64, each in [0, V) or ignore_index), at the kernel and through a
patched model, and the tuple a patched model returns with ``return_dict=False``.

Eager ``F.cross_entropy`` is the yardstick: it refuses int32 labels with a RuntimeError, an
out-of-range label with an IndexError on the CPU and a device-side assert on a GPU. The CPU cases
run both backends in their interpreters on tiny shapes; the gpu-marked case checks the
device-side assert in a child process (an assert leaves the CUDA context unusable).
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import forge  # noqa: E402
from forge import ops  # noqa: E402
from oracle import need_backend  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.patching import arch as arch_table  # noqa: E402
from forge.spec import fused_linear_ce as spec  # noqa: E402

BACKENDS = ops.BACKENDS
V = 10  # the kernel-level vocabulary




def loss_fn(backend):
    if backend == "reference":
        return spec.reference
    need_backend(backend)
    return ops.get("fused_linear_ce", backend)


# ------------------------------------------------------------------ the kernel's entry (spec.check)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("bad,kw", [
    (V, {}), (V + 7, {}), (-1, {}), (-101, {}),
    (2**40, {}),  # would wrap into range where int64 labels are narrowed to int32 (Pallas, no x64)
    (-100, {"ignore_index": -1}),  # -100 is only skipped when it is the ignore_index
])
def test_out_of_range_label_raises_index_error(backend, bad, kw):
    # the CPU path: an IndexError, as eager's, naming the label and the vocabulary size
    h, w = torch.randn(4, 8), torch.randn(V, 8)
    labels = torch.tensor([3, -100 if kw else 0, bad, V - 1])
    with pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(F.linear(h, w), labels, **kw)
    with pytest.raises(IndexError, match=rf"label {bad} is out of bounds for vocabulary size {V}\b"):
        loss_fn(backend)(h, w, labels, **kw)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_int32_labels_raise_as_eager(backend):
    h, w = torch.randn(3, 8), torch.randn(V, 8)
    labels = torch.tensor([1, -100, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="expected target dtype"):
        F.cross_entropy(F.linear(h, w), labels)
    with pytest.raises(RuntimeError, match="labels must be int64.*got torch.int32") as e:
        loss_fn(backend)(h, w, labels)
    assert isinstance(e.value, TypeError)  # and forge's own kind for a wrong dtype


# ------------------------------------------------------------------ through a patched model


def tiny(model_type):
    return build_model(model_type)


def ids_labels(model, b=2, s=5):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (b, s), generator=g)
    labels = ids.clone()
    labels[:, :1] = -100
    return ids, labels


@pytest.mark.parametrize("backend", BACKENDS)
def test_patched_model_rejects_bad_labels_as_eager(backend):
    model = tiny("qwen2")
    ids, labels = ids_labels(model)
    v = model.config.vocab_size
    too_big = labels.clone()
    too_big[0, 2] = v  # a shifted label: position 1 predicts it
    with pytest.raises(IndexError):
        model(ids, labels=too_big)
    with pytest.raises(RuntimeError):
        model(ids, labels=labels.int())
    need_backend(backend)
    forge.patch(model, backend=backend, kernels=["fused_linear_ce"])
    decoder_calls = []
    model.model.register_forward_pre_hook(lambda *_: decoder_calls.append(1))
    with pytest.raises(IndexError, match=f"label {v} is out of bounds for vocabulary size {v}"):
        model(ids, labels=too_big)
    decoder_calls.clear()
    with pytest.raises(RuntimeError, match="labels must be int64"):
        model(ids, labels=labels.int())
    assert not decoder_calls, "int32 labels were refused only after the decoder ran"
    assert model._forge_guard_stats.fallback("fused_linear_ce") == 0  # the fused path refused them


@pytest.mark.parametrize("model_type", arch_table.MOE)
def test_moe_output_keeps_the_models_output_class(model_type):
    # the fused path returned a CausalLMOutputWithPast: out.aux_loss and out.router_logits,
    # None in eager's MoeCausalLMOutputWithPast, raised AttributeError
    model = build_model(model_type)
    ids, labels = ids_labels(model)
    eager = model(ids, labels=labels)
    need_backend(BACKENDS[0])
    forge.patch(model, backend=BACKENDS[0], kernels=["fused_linear_ce"])
    out = model(ids, labels=labels)
    assert model._forge_guard_stats.fused("fused_linear_ce") == 1
    assert isinstance(out, type(eager)) and out.logits is None
    assert out.aux_loss is None and out.router_logits is None and eager.aux_loss is None
    tup = model(ids, labels=labels, return_dict=False)
    assert len(tup) == len(eager.to_tuple()) and tup[1] is None


def _structure(out):
    return [type(x).__name__ for x in out]


# every architecture (the cache rule is its decoder's) on one backend, the others on qwen2: the
# tuple is built around the kernel's loss, whichever backend computed it
TUPLE_CASES = [(m, BACKENDS[0]) for m in arch_table.DENSE] + [("qwen2", b) for b in BACKENDS[1:]]


@pytest.mark.parametrize("model_type,backend", TUPLE_CASES)
def test_return_dict_false_matches_eager_positions(model_type, backend):
    # eager's tuple drops None fields: (loss, logits[, cache][, hidden_states][, attentions]).
    # Patched: the same length and positions, logits (and a cache forge did not build) None
    model = build_model(model_type)
    ids, labels = ids_labels(model)
    cases = [{"output_hidden_states": True, "output_attentions": True}, {"use_cache": False}, {}]

    def outputs():
        got = [model(ids, labels=labels, return_dict=False, **kw) for kw in cases[:-1]]
        model.activation_checkpointing_enable()  # the last case: eager then builds no cache
        got.append(model(ids, labels=labels, return_dict=False))
        model.activation_checkpointing_disable()
        return got

    eager = outputs()
    need_backend(backend)
    forge.patch(model, backend=backend, kernels=["fused_linear_ce"])
    patched = outputs()
    assert model._forge_guard_stats.fused("fused_linear_ce") == len(cases)
    for kw, e, p in zip(cases, eager, patched):
        assert len(p) == len(e), (kw, _structure(e), _structure(p))
        assert p[0].dim() == 0 and p[0].requires_grad and p[1] is None, (kw, _structure(p))
        for i, (x, y) in enumerate(zip(e[2:], p[2:]), 2):
            if isinstance(x, tuple):  # hidden states / attentions: the decoder ran as eager's
                assert len(x) == len(y) and all(torch.equal(a, b) for a, b in zip(x, y)), (kw, i)
            else:  # the KV cache eager builds and forge skips (use_cache not asked for)
                assert type(x).__name__.endswith("Cache") and y is None, (kw, i, _structure(p))
    d = model(ids, labels=labels, use_cache=False)
    assert torch.equal(d.loss, patched[1][0]) and d.logits is None
    assert len(d.to_tuple()) == 2 and d.to_tuple()[1] is None and d[1] is None  # (loss, None)


# ------------------------------------------------------------------ the H200: a device-side assert

_CHILD = """
import torch
from forge import ops

fn = ops.get("fused_linear_ce", {backend!r})
h = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
good = torch.randint(0, 1000, (256,), device="cuda")
fn(h, w, good).backward()  # compile and warm up on valid labels
torch.cuda.synchronize()
bad = good.clone()
bad[17] = {bad}
torch.cuda.set_sync_debug_mode("error")  # a host sync in the check would raise here
try:
    fn(h, w, bad).backward()
    print("QUEUED", flush=True)
finally:
    torch.cuda.set_sync_debug_mode("default")
torch.cuda.synchronize()
print("NO ASSERT", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [1000, -5])
def test_out_of_range_label_device_assert_without_sync(backend, bad):
    need_backend(backend)
    code = textwrap.dedent(_CHILD).format(backend=backend, bad=bad)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=540, cwd=root,
                       env=dict(os.environ, CUDA_LAUNCH_BLOCKING="0"))
    out = r.stdout + r.stderr
    assert "synchronizing CUDA operation" not in out, out[-3000:]  # the check queued, no host read
    assert "NO ASSERT" not in out and r.returncode != 0, out[-3000:]
    # torch reports the assert at the next call that syncs (or at a later launch); JAX by its
    # driver error name
    assert "device-side assert" in out or "CUDA_ERROR_ASSERT" in out, out[-3000:]
