"""Fine-tune a causal LM with Hugging Face's Trainer, forge patched in.

    python examples/train_with_trainer.py [--model PATH] [--steps 50] [--quick]

--model: local Hugging Face weights; without it a random-weight model of the Qwen2.5-0.5B
shape (on a GPU) or a tiny one (--quick, on a CPU). The data are random token sequences: the
point is the recipe, `Trainer(model=forge.patch(model), ...)`, not the loss it reaches. Prints
the loss per logged step and forge's report of what ran.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import forge  # noqa: E402
from forge.__main__ import build_model  # noqa: E402


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab, n, seq_len, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="local Hugging Face model folder")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="a tiny model for a few steps on the CPU")
    a = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cuda = torch.cuda.is_available() and not a.quick
    if a.quick:
        a.steps, a.batch, a.seq_len = 3, 2, 16
    if a.model:
        model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16 if cuda else torch.float32)
    else:
        model = build_model("qwen2", "gpu_demo" if cuda else "cpu", dtype=torch.float32,
                            device="cuda" if cuda else "cpu", attn_implementation="sdpa")
    if cuda:
        model = model.cuda()
    forge.patch(model)  # the whole recipe: patch, then hand the model to the Trainer
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=a.batch, max_steps=a.steps,
                                 learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no",
                                 bf16=cuda, use_cpu=not cuda, disable_tqdm=not sys.stderr.isatty())
        data = RandomTokens(model.config.vocab_size, a.batch * a.steps, a.seq_len)
        result = Trainer(model=model, args=args, train_dataset=data).train()
    print(f"trained {a.steps} steps, final training loss {result.training_loss:.4f}")
    print(forge.report(model))
    return result


if __name__ == "__main__":
    main()
