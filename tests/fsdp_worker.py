"""One rank of tests/test_fsdp.py's runs: launched by ``torch.distributed.run`` (never collected).

Each *run* builds the same random-weight qwen2 on every rank (forge.__main__.model_config), adds
peft LoRA adapters if asked, shards it with FSDP2 (``fully_shard`` per decoder layer, then the
root), patches it with forge before or after sharding (or not at all), and takes AdamW steps on
per-rank random tokens. Rank 0 writes every run's global loss per step (the mean over ranks),
the first step's gradients of every trainable parameter (gathered to full tensors), and what
forge patched and fused, to ``--out`` (``.json`` and ``.pt``), for the test to judge with the
oracle's rule.

A run is ``name=[ft/]kind``: ft ``lora`` (adapters of rank ``--lora-r``, dropout 0), ``dlora``
(the same with ``--lora-dropout``) or none (full fine-tune); kind ``eager``, ``eager:<dtype>``
(the reference), ``<backend>:before`` or ``<backend>:after``, optionally ``+graphs``.
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import forge  # noqa: E402
from forge.__main__ import model_config  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


def shard(model, mp=None):
    """FSDP2 as its docs recommend: each decoder layer its own group, the rest at the root."""
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in _layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _hf(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _layers(model):
    root = _hf(model)
    return getattr(root, root.base_model_prefix).layers


def build(a, lora, dropout, dtype, device):
    """The run's model, identical on every rank and in every run (built in fp32, then cast). LoRA:
    base in ``dtype``, adapters in fp32 (as peft keeps them), random B so that every adapter gets
    a gradient at the first step."""
    # from the config, not build_model's save/load round trip: under torch.distributed
    # save_pretrained writes on rank 0 only
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_config("qwen2", a.shape), dtype=torch.float32,
                                                 attn_implementation="sdpa").train()
    if not lora:  # full fine-tune: fp32 master weights (the fp64 reference: fp64)
        return model.double() if dtype is torch.float64 else model
    import peft

    cfg = peft.LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, lora_dropout=dropout, target_modules=TARGETS,
                          init_lora_weights=False)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(1)
        pm = peft.get_peft_model(model, cfg)
    for n, p in pm.named_parameters():  # cast after init: every run starts from the same values
        if dtype is torch.float64 or "lora_" not in n:
            p.data = p.data.to(dtype)
    return pm


def watched_forward(model, ids):
    """A forward under FSDP2, watched for what forge must not hold. Returns (the loss, a dict):
    ``saved``, the tensors autograd saved; ``weight_copies``, those still holding memory after the
    forward that equal a decoder layer's weight (or its transpose, in any dtype; LoRA's factors
    aside); and, once the
    caller's backward has passed the embedding, ``gathered``: the decoder layers still gathered
    then (only where the embedding's output takes a gradient: a full fine-tune).

    FSDP2 frees each layer's gathered weights after the layer's forward and gathers them again for
    its backward: a saved tensor that *is* a gathered weight costs nothing in between, a copy made
    of one holds that memory until the backward, per layer. A layer whose post-backward hook does
    not fire stays gathered, with its gradients, to the end of the whole backward."""
    saved, seen = [], {}
    layers = list(_layers(model))
    root = _hf(model)

    def pack(t):
        saved.append(t)
        return t

    def at_embedding(_grad):  # every layer's backward is done when the embedding's gradient arrives
        seen["gathered"] = sum(not hasattr(next(m.parameters()), "full_tensor") for m in layers)

    def hook_output(_m, _i, out):  # (returns None: the output stays as it is)
        if out.requires_grad:  # (a frozen embedding, as under LoRA: the backward never reaches it)
            out.register_hook(at_embedding)

    handle = getattr(root, root.base_model_prefix).embed_tokens.register_forward_hook(hook_output)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
    finally:
        handle.remove()
    alive = [t for t in saved if t.dim() == 2 and t.is_floating_point() and t.untyped_storage().nbytes()]
    # (collective) the layers' weights, not LoRA's rank-r factors: forge keeps an adapter's A in the
    # input's dtype for its backward by design (rank x width, kilobytes; a copy where they differ)
    weights = [p.full_tensor() for layer in layers for n, p in layer.named_parameters() if p.dim() == 2
               and "lora_" not in n]
    seen["saved"] = len(saved)
    seen["weight_copies"] = sum(
        any(w.shape in (t.shape, t.T.shape) and torch.equal(t, (w if w.shape == t.shape else w.T).to(t.dtype))
            for w in weights) for t in alive)
    return loss, seen


def run(a, kind, rank, world, device):
    ft, _, kind = kind.rpartition("/")
    kind, graphs = kind.removesuffix("+graphs"), kind.endswith("+graphs")
    lora = ft in ("lora", "dlora")
    backend, _, where = kind.partition(":")
    ref = backend == "eager" and where in DTYPES
    dtype = DTYPES[where] if ref else DTYPES[a.dtype]
    model = build(a, lora, a.lora_dropout if ft == "dlora" else 0.0, dtype, device)
    # full fine-tune: fp32 master weights, computed in the test dtype (FSDP2's mixed precision)
    mp = None
    if not lora and dtype not in (torch.float32, torch.float64):
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    patch = dict(backend=backend, min_elements=0, graphs=graphs)  # every kernel fused at every size
    if where == "before":
        forge.patch(model, **patch)
    shard(model, mp)
    if where == "after":
        forge.patch(model, **patch)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lora_lr if lora else a.lr, weight_decay=0.0)
    vocab = _hf(model).config.vocab_size
    losses, grads = [], {}
    for step in range(a.steps):
        torch.manual_seed(1000 * step + rank)  # dropout masks: the same per (step, rank) in every run
        g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
        ids = torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(device)
        if step == 0:  # (watched: see watched_forward)
            loss, watch = watched_forward(model, ids)
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0 and a.grads:
            for n, p in model.named_parameters():
                if p.requires_grad:  # full_tensor: every rank takes part in the all-gather
                    grads[n] = p.grad.full_tensor().detach().to("cpu", torch.float64)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().double()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    info = {"losses": losses, "watch": watch}
    if backend != "eager":
        info["counts"] = dict(model._forge_patched_counts)
        info["skipped"] = dict(model._forge_skipped)
        info["guard"] = model._forge_guard_stats.as_dict()
        info["layer_class"] = type(_layers(model)[0]).__name__
        if graphs:
            info["graphs"] = model._forge_graphs.stats.as_dict()
    del model, opt, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info, grads


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", nargs="+", required=True, help="name=kind ...")
    p.add_argument("--shape", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=DTYPES)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3, help="full fine-tune")
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--grads", action="store_true", help="save the first step's gradients")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    out, all_grads = {}, {}
    try:
        for spec in a.runs:
            name, _, kind = spec.partition("=")
            t0 = time.perf_counter()
            out[name], all_grads[name] = run(a, kind, rank, world, device)
            out[name]["seconds"] = time.perf_counter() - t0
        if rank == 0:
            if a.grads:
                torch.save(all_grads, a.out + ".pt")
            with open(a.out + ".json", "w") as f:
                json.dump({"world": world, "runs": out}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
