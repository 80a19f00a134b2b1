"""Host cost of one decoder layer's LoRA projections, forward + backward: eager peft against
forge's ``lora_qkv`` + ``lora_mlp``, on the CPU with forge's Triton launches replaced by counted
no-ops (as bench/diagnostics/fsdp_host.py; the kernels' bodies are not what a host-bound step waits on).

Per variant: the main thread's CPU time per layer (q, k, v projections and the MLP, forward and
backward, peft's LoRA on all of them), the top-level aten ops per layer other than views and
allocations (torch.profiler: called from Python or the autograd engine, not inside another op;
each launches at least one kernel on a GPU), all aten ops, the Python autograd nodes and the
Triton launches. The tensors are tiny: each op costs about its dispatch, as on a
host-bound GPU step. FSDP2 does not enter here: inside a layer's forward it has swapped the
gathered weights in, and these projections run exactly as they do unsharded
(bench/diagnostics/fsdp_host.py measures whole FSDP2 steps).

    python bench/diagnostics/lora_layer_host.py [--dropout 0.05] [--chunks 60] [--ops]
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from forge import _runtime  # noqa: E402

_runtime.ensure_triton_mode()

import argparse  # noqa: E402
import collections  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import forge  # noqa: E402
from fsdp_host import DTYPES, LAUNCHES, TARGETS, stub_launches  # noqa: E402

# aten ops that launch no device kernel (views, metadata, allocation without a fill)
NO_KERNEL = {"aten::view", "aten::t", "aten::transpose", "aten::as_strided", "aten::reshape", "aten::expand",
             "aten::slice", "aten::narrow", "aten::select", "aten::split", "aten::split_with_sizes",
             "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::alias", "aten::detach", "aten::empty",
             "aten::empty_strided", "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg",
             "aten::_unsafe_view", "aten::lift_fresh", "aten::result_type", "aten::contiguous",
             "aten::_reshape_alias", "aten::chunk", "aten::unbind", "aten::numpy_T", "aten::matrix_H",
             "detach", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense"}


def build(a):
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen2", hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4, vocab_size=64,
                               max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[a.dtype], attn_implementation="sdpa")
    lc = peft.LoraConfig(r=a.r, lora_alpha=2 * a.r, lora_dropout=a.dropout, target_modules=TARGETS)
    pm = peft.get_peft_model(model, lc).train()
    for n, prm in pm.named_parameters():
        if "lora_" in n:
            prm.data = prm.data.to(DTYPES[a.adapter_dtype])
    return pm


def layer_fn(pm, a):
    layer = pm.get_base_model().model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    dt = DTYPES[a.dtype]
    x = torch.randn(a.batch, a.seq, a.hidden, dtype=dt, requires_grad=True)
    gq = torch.randn(a.batch, a.seq, attn.q_proj.out_features, dtype=dt)
    gkv = torch.randn(a.batch, a.seq, attn.k_proj.out_features, dtype=dt)
    gy = torch.randn(a.batch, a.seq, a.hidden, dtype=dt)

    def run():
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        y = mlp(x)
        torch.autograd.backward((q, k, v, y), (gq, gkv, gkv, gy))

    return run


def _chunk_us(run, reps):
    c0 = time.thread_time()
    for _ in range(reps):
        run()
    return 1e6 * (time.thread_time() - c0) / reps


def measure(runs: dict, reps: int, chunks: int) -> dict:
    """Per variant: CPU time per layer, in chunks of ``reps`` calls alternating between the
    variants (the machine's drift hits both; each chunk is paired with the first variant's chunk
    of the same round), then one profiled pass for the op counts."""
    names = list(runs)
    for run in runs.values():
        for _ in range(20):
            run()
    ts = {n: [] for n in names}
    launches = {}
    for i in range(chunks):
        for n in names[i % 2:] + names[:i % 2]:
            before = sum(LAUNCHES.values())
            ts[n].append(_chunk_us(runs[n], reps))
            launches[n] = (sum(LAUNCHES.values()) - before) / reps
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for n in names:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                runs[n]()
        ops, top = collections.Counter(), collections.Counter()
        kernel_ops = py_nodes = 0
        for e in prof.events():
            if e.name.startswith("aten::"):
                ops[e.name] += 1
                parent = e.cpu_parent
                if e.name not in NO_KERNEL and (parent is None or not parent.name.startswith("aten::")):
                    kernel_ops += 1  # called by Python or the autograd engine, not inside another op
                    top[e.name] += 1
            elif e.name.endswith("Backward") and not e.name.startswith("autograd::"):
                py_nodes += 1  # a Python autograd.Function's backward (C++ nodes end in Backward0 etc.)
        out[n] = {"us": statistics.median(ts[n]), "us_min": min(ts[n]), "kernel_ops": kernel_ops / 10,
                  "aten_ops": sum(ops.values()) / 10, "py_backward_nodes": py_nodes / 10, "launches": launches[n],
                  "ops": {k: v / 10 for k, v in ops.most_common()},
                  "top_level_ops": {k: v / 10 for k, v in top.most_common()}}
        if n != names[0]:
            out[n]["minus_first_us"] = statistics.median(a - b for a, b in zip(ts[n], ts[names[0]]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--dtype", default="fp32", choices=DTYPES)
    p.add_argument("--adapter-dtype", default="fp64", choices=DTYPES)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--reps", type=int, default=20, help="calls per timed chunk")
    p.add_argument("--chunks", type=int, default=60, help="timed chunks per variant, alternating")
    p.add_argument("--ops", action="store_true", help="print every aten op count per variant")
    a = p.parse_args()
    torch.set_num_threads(1)
    stub_launches()
    eager, fused = build(a), build(a)  # the same weights (seeded); one left to peft, one patched
    forge.patch(fused, backend="triton", min_elements=0, kernels=["lora_qkv", "lora_mlp"])
    res = measure({"eager peft": layer_fn(eager, a), "forge": layer_fn(fused, a)}, a.reps, a.chunks)
    print(f"one decoder layer's LoRA projections (q, k, v, MLP), forward + backward, CPU; dropout {a.dropout}, "
          f"{a.batch}x{a.seq} tokens, hidden {a.hidden}, base {a.dtype}, adapters {a.adapter_dtype}")
    for k, r in res.items():
        pair = f"  minus eager {r['minus_first_us']:+7.1f} us" if "minus_first_us" in r else ""
        print(f"  {k:11s} {r['us']:8.1f} us (min {r['us_min']:.1f}){pair}  kernel-launching (top-level) aten ops "
              f"{r['kernel_ops']:5.1f}  all aten ops {r['aten_ops']:5.1f}  Python backward nodes "
              f"{r['py_backward_nodes']:.0f}  Triton launches {r['launches']:.0f}")
    if a.ops:
        for k, r in res.items():
            print(k, "top-level:", r["top_level_ops"])
            print(k, "all:", r["ops"])

if __name__ == "__main__":
    main()
