"""Where a compiled mixture-of-experts step's router gradient departs from the eager one: the
2-layer model of tests/test_compile_gpu.py in float32 (the reference), eager bf16, compiled bf16,
forge-patched eager bf16 and forge-patched compiled bf16, each gradient's relative error against
the float32 model and the compiled-against-eager differences, with and without forge. Tells
inductor's own reordering of the router's arithmetic from a fault of forge's compiled ops.

    PYTHONPATH=.:tests python bench/diagnostics/diag_compile_router.py [--models olmoe qwen3_moe] [--backends triton pallas]
"""
from __future__ import annotations

import argparse
import copy

import torch

import forge
from forge.__main__ import build_model
from forge.spec import tolerance


def _step(m, model, ids):
    model.zero_grad(set_to_none=True)
    loss = m(ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.detach().float(),
            **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _groups(names):
    """The router weights one by one, every other gradient as its worst case."""
    return [n for n in names if n.endswith("mlp.gate.weight")] + ["loss"]


def run(model_type, backends, device="cuda"):
    torch._dynamo.reset()
    model = build_model(model_type, "qwen05b", dtype=torch.bfloat16, device=device, num_hidden_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0)).to(device)
    ref_model = copy.deepcopy(model).float()
    ref = _step(ref_model, ref_model, ids)
    del ref_model
    runs = {"eager": _step(model, model, ids), "compiled": _step(torch.compile(model), model, ids)}
    for backend in backends:
        torch._dynamo.reset()
        forge.patch(model, backend=backend, min_elements=0, compile_kernels="all")
        runs[f"{backend} eager"] = _step(model, model, ids)
        runs[f"{backend} compiled"] = _step(torch.compile(model, fullgraph=True), model, ids)
        forge.unpatch(model)
    k = max(model.config.vocab_size, model.config.intermediate_size, ids.numel())
    print(f"== {model_type}: 4 x atol(bf16, {k}) = {4 * tolerance.atol(torch.bfloat16, k):.4f}")
    names = _groups(ref)
    others = [n for n in ref if n not in names]
    print(f"{'gradient':34s} " + " ".join(f"{r:>16s}" for r in runs) + "   compiled-vs-eager: "
          + " ".join(f"{r.split()[0] if ' ' in r else 'torch':>8s}" for r in runs if r.endswith("compiled")))
    for n in names + ["(worst other)"]:
        keys = [n] if n != "(worst other)" else others
        errs = [max(tolerance.rel_err(runs[r][x], ref[x]) for x in keys) for r in runs]
        diffs = [max(tolerance.rel_err(runs[r][x], runs[r.replace("compiled", "eager")][x]) for x in keys)
                 for r in runs if r.endswith("compiled")]
        print(f"{n[-34:]:34s} " + " ".join(f"{e:16.4e}" for e in errs) + "   "
              + " ".join(f"{d:8.4f}" for d in diffs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["olmoe", "qwen3_moe"])
    ap.add_argument("--backends", nargs="*", default=["triton", "pallas"])
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    for m in a.models:
        run(m, a.backends, a.device)


if __name__ == "__main__":
    main()
