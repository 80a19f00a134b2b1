"""torch.compile with inductor over patched models on a GPU (run with ``pytest -m gpu``): per
architecture and backend, fullgraph compile of a training step (labels through the fused loss)
matching the eager patched model, no recompile across steps at a fixed shape, one compile for
varying sequence lengths with ``dynamic=True``, and ``mode="reduce-overhead"`` (CUDA graphs)."""
from __future__ import annotations

import pytest
import torch

import forge
from forge import ops
from oracle import need_backend
from forge.__main__ import build_model
from forge.patching import arch as arch_table
from forge.spec import tolerance

pytestmark = pytest.mark.gpu
BACKENDS = ops.BACKENDS
ARCHS = arch_table.SUPPORTED  # the mixtures of experts too: their expert block is one op pair


def _step(m, model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = m(ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


PATCH_ALL = dict(min_elements=0, compile_kernels="all")  # every kernel, each one compiled


def _model(model_type, backend, s=128):
    """The 2-layer model at the 0.5B shape and its token ids; patched with every kernel unless
    ``backend`` is None."""
    model = build_model(model_type, "qwen05b", dtype=torch.bfloat16, device="cuda", num_hidden_layers=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, s), generator=g).cuda()
    if backend is not None:
        forge.patch(model, backend=backend, **PATCH_ALL)
    return model, ids, ids.clone()


def _reference(model, ids, labels):
    """The float32 model's loss and gradients and the eager bf16 model's (the oracle's pair)."""
    import copy

    ref_model = copy.deepcopy(model).float()
    ref = _step(ref_model, ref_model, ids, labels)
    del ref_model
    return ref, _step(model, model, ids, labels)


def _assert_oracle(got, ref, eager, model, ids):
    """The oracle's rule for the loss and every gradient (reduction: vocabulary, MLP width or tokens)."""
    k = max(model.config.vocab_size, model.config.intermediate_size, ids.numel())
    (got_loss, got), (ref_loss, ref_g), (eager_loss, eager_g) = got, ref, eager
    tolerance.assert_close("loss", got_loss, ref_loss, eager_loss, torch.bfloat16, k)
    assert got.keys() == ref_g.keys()
    for n in ref_g:
        tolerance.assert_close(f"grad {n}", got[n], ref_g[n], eager_g[n], torch.bfloat16, k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_inductor_default_patch_within_the_oracle(model_type, backend):
    # forge.patch's defaults under inductor: RMSNorm and RoPE left to inductor, the GLU below its
    # threshold left to inductor with its product checkpointed, the fused loss's backward traced
    # into the compiled backward (scaling its saved gradients in place). Compiled, the patched
    # model runs other code than the eager patched one (transformers' RMSNorm and RoPE under
    # inductor, forge's kernels in eager), so the check is the parity suite's oracle: each output
    # as close to the fp32 model as the eager bf16 model is, within the rule's bound
    need_backend(backend)
    torch._dynamo.reset()
    model, ids, labels = _model(model_type, None)
    ref, eager = _reference(model, ids, labels)
    forge.patch(model, backend=backend)
    got = _step(torch.compile(model, fullgraph=True), model, ids, labels)
    _assert_oracle(got, ref, eager, model, ids)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", ARCHS)
def test_inductor_fullgraph_no_recompile(model_type, backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    need_backend(backend)
    torch._dynamo.reset()
    model, ids, labels = _model(model_type, None)
    ref, eager = _reference(model, ids, labels)
    forge.patch(model, backend=backend, **PATCH_ALL)
    explained = torch._dynamo.explain(model)(ids, labels=labels)
    assert explained.graph_break_count == 0, explained.break_reasons
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    got = _step(compiled, model, ids, labels)
    # the oracle's rule against the float32 model, not a fixed bound against the eager patched
    # step: inductor fuses torch's ops around the kernels (the router's softmax and top-k among
    # them) into float32 arithmetic, and a bf16 router's gradient carries an error of several
    # percent whichever order computes it (bench/diagnostics/diag_compile_router.py)
    _assert_oracle(got, ref, eager, model, ids)
    frames = cnt.frame_count
    for _ in range(2):
        _step(compiled, model, ids, labels)
    assert cnt.frame_count == frames, "recompiled at a fixed shape"
    model.eval()
    with torch.no_grad():
        torch.compile(model, fullgraph=True)(ids)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_dynamic_one_compile_for_varying_lengths(model_type, backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    need_backend(backend)
    torch._dynamo.reset()
    model, ids, labels = _model(model_type, backend, s=256)
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=cnt, fullgraph=True, dynamic=True)
    _step(compiled, model, ids[:, :64].contiguous(), labels[:, :64].contiguous())
    # (the first compile may count twice: dynamo restarts its analysis once to specialise the
    # RMSNorm eps it had made a symbolic float; that is one compile of the first call)
    frames = cnt.frame_count
    for s in (96, 200):
        _step(compiled, model, ids[:, :s].contiguous(), labels[:, :s].contiguous())
    assert cnt.frame_count == frames, f"recompiled for new sequence lengths ({cnt.frame_count} > {frames} frames)"


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_overhead(backend):
    need_backend(backend)
    torch._dynamo.reset()
    model, ids, labels = _model("qwen2", backend)
    model.eval()
    with torch.no_grad():
        want = model(ids).logits
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            got = compiled(ids).logits
    assert tolerance.rel_err(got, want) <= 4 * tolerance.atol(torch.bfloat16, model.config.hidden_size)
