"""Hugging Face ``Trainer`` on a patched model: the recipe in docs/integrations.md.

Three runs of the same few steps from the same weights, data order and seed: the model in float64
(the reference), unpatched in the test dtype (eager), and patched. The loss of every step and the
update each parameter received (final minus initial weights) must meet the oracle's rule
(forge/spec/tolerance.py): patched error <= 2 x eager's error + atol. The updates are compared
rather than the weights, whose error would be hidden under their initial values, and the
optimizer is plain SGD: its update is the gradient times the learning rate, so kernel rounding
reaches the weights linearly. (Adam divides by the root of the second moment: for a gradient
near zero that turns rounding noise into a full-size step, in eager as much as in forge.)
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import forge  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.spec import tolerance  # noqa: E402

from test_models import need  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

# The Pallas interpreter is the faster of the two on a CPU (issue 19); on a GPU both compile.
BACKEND = "pallas"  # CPU models (conftest's CPU_TENSOR_MODULES): the faster interpreter
BATCH, SEQ, STEPS = 2, 8, 3


class TokenData(torch.utils.data.Dataset):
    """Random token rows with the first quarter of each masked, in memory (nothing downloaded)."""

    def __init__(self, vocab, rows, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: SEQ // 4] = -100
        return {"input_ids": self.ids[i], "labels": labels}


class RecordingTrainer(transformers.Trainer):
    """Keeps each optimizer step's loss unrounded (the logged one is rounded to 4 digits)."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses.append(loss.detach().float().cpu())
        return loss


def train(model, tmp_path, **args):
    """(losses, {name: weight update}) after STEPS optimizer steps of plain SGD."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    accum = args.get("gradient_accumulation_steps", 1)
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=STEPS, optim="sgd",
        learning_rate=0.5, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        report_to=[], save_strategy="no", logging_strategy="no", seed=0, dataloader_num_workers=0,
        disable_tqdm=True, use_cpu=model.device.type == "cpu", **args)
    trainer = RecordingTrainer(model=model, args=targs,
                               train_dataset=TokenData(model.config.vocab_size, BATCH * STEPS * accum))
    trainer.step_losses = []
    trainer.train()
    losses = torch.stack(trainer.step_losses)
    return losses, {n: (p.detach() - start[n].to(p.device)).cpu() for n, p in model.named_parameters()}


def run_three(tmp_path, dtype=torch.float32, backend=BACKEND, from_pretrained=False, **args):
    model = build_model("qwen2")
    if from_pretrained:  # (transformers' hub kernels on, where the kernels package is installed)
        model.save_pretrained(tmp_path / "model")
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="eager")
    ref = train(copy.deepcopy(model).double(), tmp_path / "ref", **args)
    eager = train(copy.deepcopy(model), tmp_path / "eager", **args)
    patched_model = forge.patch(model, backend=backend, min_elements=0)
    patched = train(patched_model, tmp_path / "forge", **args)
    c = model.config
    # the longest fp32 accumulation any kernel does: vocabulary, MLP width, or the tokens of a
    # weight gradient (tests/test_models.reduction_length)
    k = max(c.vocab_size, c.intermediate_size, c.hidden_size, BATCH * SEQ)
    tolerance.assert_close("losses", patched[0], ref[0], eager[0], dtype, k)
    assert patched[1].keys() == ref[1].keys()
    for name in ref[1]:
        tolerance.assert_close(f"update of {name}", patched[1][name], ref[1][name], eager[1][name], dtype, k)
    stats = model._forge_guard_stats
    for key in model._forge_patched_counts:
        assert stats.fused(key) > 0, f"{key} was patched but never ran fused inside the Trainer: {stats}"
    return model


def test_trainer_steps_match_unpatched(tmp_path):
    need(BACKEND)
    run_three(tmp_path)


def test_trainer_on_a_model_from_pretrained(tmp_path):
    # the Trainer's model.train() re-kernelized a model with transformers' hub kernels on, which
    # dropped forge's RMSNorm before the first step: every patched key must still run fused
    need(BACKEND)
    run_three(tmp_path, from_pretrained=True)


def test_trainer_gradient_accumulation(tmp_path):
    # Trainer passes num_items_in_batch to the model: the fused loss must normalise by the
    # tokens of the whole accumulated batch, as eager's loss does
    need(BACKEND)
    run_three(tmp_path, gradient_accumulation_steps=2)


def test_trainer_gradient_checkpointing(tmp_path):
    need(BACKEND)
    model = run_three(tmp_path, gradient_checkpointing=True)
    # the checkpointed layers ran forge's forwards twice per step (forward and recompute)
    assert model._forge_guard_stats.fused("rope") >= 2 * STEPS * model.config.num_hidden_layers


@pytest.mark.parametrize("backend", ["pallas", "triton"])
def test_trainer_bf16(tmp_path, backend):
    # bf16=True makes Trainer run the forward under torch.autocast(bfloat16), on a CPU as on a GPU;
    # the weights stay fp32, the matmuls and what they feed run in bf16: the bf16 rule applies.
    # Both backends: the Triton loss once corrupted memory exactly here (fp32 weights, autocast)
    need(backend)
    run_three(tmp_path, dtype=torch.bfloat16, backend=backend, bf16=True)


def test_trainer_example_quick():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "examples" / "train_with_trainer.py"), "--quick"],
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained 3 steps" in r.stdout and "rmsnorm" in r.stdout, r.stdout[-2000:]
