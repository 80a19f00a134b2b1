"""TRL's ``SFTTrainer`` on a patched model: the recipe in docs/integrations.md.

As in tests/test_trainer.py: three runs of the same few SGD steps from the same weights and data
(float64 reference, unpatched eager, patched) and the oracle's rule (forge/spec/tolerance.py) on
every step's loss and every parameter's update.

What runs where: SFTTrainer (TRL >= 1.x) gives the model its own chunked LM head
(``trl.trainer.utils.add_fused_lm_head``, an instance ``forward`` wrapping the one it finds) and
computes the loss from its per-token log-probabilities, calling the decoder directly. forge's
RMSNorm, gated MLP and RoPE kernels, which live inside the decoder, run fused; forge's fused
linear cross-entropy is bypassed (TRL's head is the one that avoids the logits there). The test
asserts both, so a TRL release that changes this shows up here.

The data are pre-tokenised rows of a tiny in-memory word-level tokenizer (nothing downloaded).
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

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl; it is in the [test] extras)")
datasets = pytest.importorskip("datasets", reason="TRL's SFTTrainer takes a datasets.Dataset")

BACKEND = "pallas"  # the faster interpreter on a CPU (tests/test_trainer.py)
BATCH, SEQ, STEPS = 2, 8, 3


def tiny_tokenizer(vocab_size):
    """A word-level tokenizer over the words t0 .. t{vocab-1}, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0", eos_token="t1")


class RecordingSFTTrainer(trl.SFTTrainer):
    """Keeps each optimizer step's loss unrounded."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.step_losses.append(loss.detach().float().cpu())
        return loss


def sft(model, tmp_path, tokenizer, rows):
    """(losses, {name: weight update}) after STEPS SGD steps of SFTTrainer."""
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = trl.SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=STEPS, optim="sgd",
        learning_rate=0.5, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to=[],
        save_strategy="no", logging_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True,
        use_cpu=True)
    trainer = RecordingSFTTrainer(model=model, args=args, processing_class=tokenizer,
                                  train_dataset=datasets.Dataset.from_list(rows))
    trainer.step_losses = []
    trainer.train()
    return (torch.stack(trainer.step_losses),
            {n: (p.detach() - start[n]).cpu() for n, p in model.named_parameters()})


def test_sft_trainer_steps_match_unpatched(tmp_path):
    need(BACKEND)
    model = build_model("qwen2")
    c = model.config
    tok = tiny_tokenizer(c.vocab_size)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(2, c.vocab_size, (SEQ,), generator=g).tolist()} for _ in range(BATCH * STEPS)]

    ref = sft(copy.deepcopy(model).double(), tmp_path / "ref", tok, rows)
    eager = sft(copy.deepcopy(model), tmp_path / "eager", tok, rows)
    forge.patch(model, backend=BACKEND, min_elements=0)
    patched = sft(model, tmp_path / "forge", tok, rows)

    k = max(c.vocab_size, c.intermediate_size, c.hidden_size, BATCH * SEQ)
    tolerance.assert_close("losses", patched[0], ref[0], eager[0], torch.float32, k)
    assert patched[1].keys() == ref[1].keys()
    for name in ref[1]:
        tolerance.assert_close(f"update of {name}", patched[1][name], ref[1][name], eager[1][name], torch.float32, k)

    stats = model._forge_guard_stats
    for key in ("rmsnorm", "swiglu", "rope"):
        assert stats.fused(key) > 0, f"{key} never ran fused inside SFTTrainer: {stats}"
    # TRL's own LM head computed the loss: forge's fused loss was patched but never called
    assert model._forge_patched_counts.get("fused_linear_ce") == 1
    assert stats.fused("fused_linear_ce") == 0 and stats.fallback("fused_linear_ce") == 0, stats
