"""``python -m forge`` (or ``forge-demo``): patch a random-weight model of every supported
architecture with every available backend and show that it computes what the model computed.

Each model goes through the real loading path (``save_pretrained`` to a temporary directory,
``from_pretrained`` back). On a CPU the kernels run in their interpreters on a tiny config
(fp32); on a GPU they run compiled on a larger one (bf16, the Qwen2.5-0.5B widths, 4 layers).
Columns: patched counts, kernels declined (reason with ``-v``), loss in train mode with labels
(fused linear cross-entropy when patched) against eager, the largest logit difference, and
whether ``forge.unpatch`` gave back bit-identical logits.

``build_model`` and the shape presets are shared with the tests (tests/test_models.py).
"""
from __future__ import annotations

from forge import _runtime

# Triton reads TRITON_INTERPRET when it is first imported, which building a transformers model
# already does: decide the mode before anything else.
_runtime.ensure_triton_mode()

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

# Tiny (interpreters on CPU) and real (Qwen2.5-0.5B: hidden 896, intermediate 4864, 24 layers,
# 14 heads, 2 KV heads, vocab 151936, tied embeddings, rope_theta 1e6) widths, for every arch.
SHAPES = {
    "cpu": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=256),
    "qwen05b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, head_dim=64, vocab_size=151936, rope_theta=1e6),
}
SHAPES["gpu_demo"] = dict(SHAPES["qwen05b"], num_hidden_layers=4)
# the tiny mixture-of-experts fields (8 experts, top-2, expert width 32) of each MoE arch
MOE_CPU = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
}

# and at the real widths (GPU): the Qwen3-30B-A3B / OLMoE expert widths, Mixtral's 8 experts top-2
MOE_REAL = {
    "qwen3_moe": dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=1792),
    "olmoe": dict(num_experts=64, num_experts_per_tok=8, intermediate_size=1024),
}


def model_config(model_type: str, shape: str = "cpu", **overrides):
    from transformers import AutoConfig

    kw = dict(SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True)
    if model_type == "gemma2":
        kw["query_pre_attn_scalar"] = kw["head_dim"]
    kw.update((MOE_CPU if shape == "cpu" else MOE_REAL).get(model_type, {}))
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def build_model(model_type: str, shape: str = "cpu", dtype=torch.float32, device="cpu", seed: int = 0,
                attn_implementation: str = "eager", **overrides):
    """A random-weight causal LM, saved to a temporary directory and loaded back with
    ``from_pretrained`` (the path a user's checkpoint takes), in training mode."""
    from transformers import AutoModelForCausalLM

    cfg = model_config(model_type, shape, **overrides)
    device = torch.device(device)
    # random init where the model will run: on a GPU that is seconds for the 0.5B shape, where
    # the CPU takes ~15 s (the GPU tests build a dozen of them)
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="forge-demo-") as d:
        model.save_pretrained(d)
        del model
        model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).train()


def _short(counts: dict) -> str:
    abbrev = {"fused_linear_ce": "flce"}
    return " ".join(f"{abbrev.get(k, k)}={v}" for k, v in counts.items()) or "-"


def run_one(model_type, backend, shape, dtype, device, batch, seq):
    import forge

    model = build_model(model_type, shape, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen).to(device)
    with torch.no_grad():
        loss_e = model(ids, labels=ids).loss
        logits_e = model(ids).logits
        forge.patch(model, backend=backend, min_elements=0)
        counts, skipped = dict(model._forge_patched_counts), dict(model._forge_skipped)
        loss_f = model(ids, labels=ids).loss  # train mode + labels: the fused loss when patched
        logits_f = model(ids).logits
        forge.unpatch(model)
        restored = torch.equal(model(ids).logits, logits_e)
    return dict(arch=model_type, backend=backend, counts=counts, skipped=skipped, loss_eager=loss_e.item(),
                loss_forge=loss_f.item(), dlogit=(logits_f.float() - logits_e.float()).abs().max().item(),
                restored=restored)


def main(argv=None) -> int:
    from forge import ops
    from forge.patching import arch

    ap = argparse.ArgumentParser(prog="python -m forge", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="*", default=list(arch.SUPPORTED), choices=arch.SUPPORTED)
    ap.add_argument("--backend", nargs="*", default=list(ops.BACKENDS), choices=ops.BACKENDS)
    ap.add_argument("-v", "--verbose", action="store_true", help="print why each kernel was declined")
    a = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the table is the output; HF's advice would interleave it
    hf_logging.disable_progress_bar()

    gpu = torch.cuda.is_available()
    shape, dtype, device, batch, seq = (("gpu_demo", torch.bfloat16, "cuda", 2, 256) if gpu
                                        else ("cpu", torch.float32, "cpu", 1, 6))
    where = "GPU, compiled kernels" if gpu else "CPU, Triton and Pallas interpreters"
    print(f"forge demo ({where}): {shape} config, {dtype}, batch {batch} x seq {seq}")
    backends = []
    for b in a.backend:
        ok, why = ops.availability(b)
        if ok:
            backends.append(b)
        else:
            print(f"  backend {b} skipped: {why}")
    head = (f"{'arch':8} {'backend':8} {'patched':42} {'declined':28} {'loss eager':>10} {'|dloss|':>9} "
            f"{'max|dlogit|':>11} {'unpatch':>8}")
    print(head)
    print("-" * len(head))
    t0, ok_all = time.time(), True
    for mt in a.arch:
        for b in backends:
            r = run_one(mt, b, shape, dtype, device, batch, seq)
            ok_all &= r["restored"]
            declined = " ".join(sorted(r["skipped"])) or "-"
            print(f"{mt:8} {b:8} {_short(r['counts']):42} {declined:28} {r['loss_eager']:10.5f} "
                  f"{abs(r['loss_forge'] - r['loss_eager']):9.2e} {r['dlogit']:11.2e} "
                  f"{'exact' if r['restored'] else 'DIFFERS':>8}")
            if a.verbose:
                for k, why in r["skipped"].items():
                    print(f"{'':18}{k}: {why}")
    print(f"done in {time.time() - t0:.1f} s")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
