"""What a training forward under FSDP2 leaves alive for its backward, eager against forge.

FSDP2 (``fully_shard`` per decoder layer, reshard after forward) frees each layer's gathered
weights once the layer's forward is done and gathers them again before its backward: a tensor
autograd saved that *is* a gathered weight costs nothing between the two. A tensor saved that
was *made from* one (a cast, a transpose made contiguous, a concatenation) keeps its own memory
until the backward, a copy of the layer's weights per layer. This script runs one forward with
labels under FSDP2 over one rank (no torchrun needed; gloo on the CPU, NCCL on a GPU), records
every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``), and after the
forward sums the memory still allocated behind them, by storage (each counted once), for the
unpatched model and for forge patched after ``fully_shard``. It prints the largest storages
that are alive and are shaped like a weight of the model.

    python bench/diagnostics/fsdp_saved.py                      # tiny preset, CPU (interpreters)
    python bench/diagnostics/fsdp_saved.py --preset llama3-8b --layers 2 --gpu
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "examples")]

import _common as bc  # noqa: E402,F401  (first: the Triton mode, before transformers imports triton)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import finetune_lora_fsdp2 as ex  # noqa: E402
import forge  # noqa: E402


def _alive(saved):
    """{storage pointer: (bytes, shape, dtype)} of the saved tensors whose storage still holds memory."""
    out = {}
    for t in saved:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in out:
            out[st.data_ptr()] = (st.nbytes(), tuple(t.shape), t.dtype)
    return out


def run(a, device, patched: bool):
    args = argparse.Namespace(model=None, preset=a.preset, full=not a.lora, checkpointing=False, lora_r=16,
                              lora_dropout=0.0, seed=0, precision="bf16")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    from presets import PRESETS

    if a.layers:
        PRESETS[a.preset] = dict(PRESETS[a.preset], num_hidden_layers=a.layers)
    model = ex.build(args, device, dtype)
    ex.shard(model, "bf16")
    if patched:
        forge.patch(model, backend=a.backend, min_elements=0)
    weight_shapes = {tuple(p.full_tensor().shape) if hasattr(p, "full_tensor") else tuple(p.shape)
                     for p in model.parameters()}
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    alive = _alive(saved)
    total = sum(b for b, _, _ in alive.values())
    weights = {k: v for k, v in alive.items() if v[1] in weight_shapes or tuple(reversed(v[1])) in weight_shapes}
    name = f"forge {a.backend}" if patched else "eager"
    print(f"{name}: {len(saved)} saved tensors, {len(alive)} storages alive after the forward, "
          f"{total / 2**20:.2f} MiB; weight-shaped: {len(weights)}, "
          f"{sum(b for b, _, _ in weights.values()) / 2**20:.2f} MiB")
    for b, shape, dt in sorted(weights.values(), reverse=True)[:a.top]:
        print(f"    {b / 2**20:9.3f} MiB  {shape}  {dt}")
    # FSDP2 reshards a layer (its parameters back to DTensor shards) when the layer's backward is
    # done; a layer whose post-backward hook does not fire stays gathered, with its gradients,
    # until the end of the whole backward. Count the gathered layers when the embedding's
    # gradient arrives (after every layer's backward).
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = list(getattr(root, root.base_model_prefix).layers)
    seen = {}

    def at_embedding(_grad):
        seen["gathered"] = sum(not hasattr(next(m.parameters()), "full_tensor") for m in layers)

    loss.backward()
    print("    (a second forward, to hook the embedding's output)")
    def hook_output(_m, _i, out):
        out.register_hook(at_embedding)  # (returns None: the output stays as it is)

    h = getattr(root, root.base_model_prefix).embed_tokens.register_forward_hook(hook_output)
    model(input_ids=ids, labels=ids).loss.backward()
    h.remove()
    print(f"    layers still gathered when the embedding's gradient arrived: {seen.get('gathered')} of {len(layers)}")
    del model, loss, saved


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--backend", default="triton")
    p.add_argument("--lora", action="store_true", help="peft LoRA (r=16, all seven) instead of a full fine-tune")
    p.add_argument("--gpu", action="store_true", help="NCCL on the GPU (default: gloo on the CPU)")
    p.add_argument("--dtype", default=None, help="the weights' dtype (default: bfloat16 on a GPU, else float32)")
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    ex.single_process_env()
    device = ex.init_group(quick=not a.gpu)
    try:
        for patched in (False, True):
            run(a, device, patched)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (as the example: skip the interpreter's teardown after gloo)


if __name__ == "__main__":
    main()
