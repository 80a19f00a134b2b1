"""FSDP2 at the sizes that need it: eager against forge, side by side in one run, per case
(full fine-tune or peft LoRA; activation checkpointing off or on), forge patched before and after
``fully_shard``.

    torchrun --nproc-per-node 2 bench/bench_fsdp.py                  # llama3-8b, 4x1024 per rank
    torchrun --nproc-per-node 2 bench/bench_fsdp.py --cases lora --checkpointing off --patch after
    python bench/bench_fsdp.py --quick                               # one CPU process: a smoke test

Each variant builds the preset's model (random weights, seed 0; LoRA r=16, alpha 32, dropout 0.05
on q, k, v, o, gate, up, down: peft's adapters), shards every decoder layer and the root with
FSDP2's MixedPrecisionPolicy (fp32 weights, bf16 compute, fp32 gradient reduction;
``--precision bf16``: bf16 weights, no policy), trains with AdamW on random tokens for
``--warmup`` untimed and ``--steps`` timed steps, and is freed before the next. The step time is
the slowest rank's median (a step ends when its loss is all-reduced); memory is the largest
rank's peak reserved. Ratios are to the same case's eager variant. Model building, sharding and
patching reuse examples/finetune_lora_fsdp2.py.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "examples")]

import _common as bc  # noqa: E402  (first: the Triton mode, before transformers imports triton)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import finetune_lora_fsdp2 as ex  # noqa: E402
import forge  # noqa: E402
from presets import PRESETS  # noqa: E402

COLUMNS = ["case", "checkpointing", "variant", "step_ms", "speedup", "peak_MiB", "reserved_MiB", "reserved_frac",
           "loss_first", "loss_last", "prof_host_op_ms", "prof_device_busy_ms", "fallbacks", "note"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--cases", default="lora,full", help="lora, full, or both comma-separated")
    p.add_argument("--checkpointing", default="off,on", help="off, on, or both comma-separated")
    p.add_argument("--patch", default="after,before", help="forge patched after or before fully_shard, or both")
    p.add_argument("--backend", default="triton", help="forge's backend: triton, pallas, or both comma-separated")
    p.add_argument("--precision", default="mixed", choices=("mixed", "bf16"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true",
                   help="also profile two more steps (one with --quick) of each variant on rank 0 (torch.profiler): "
                        "its host op time against the device's busy time, to tell a host-bound step from a "
                        "device-bound one")
    p.add_argument("--quick", action="store_true", help="tiny preset on the CPU, a few steps")
    bc.add_out_argument(p)
    a = p.parse_args(argv)
    if a.quick:
        # (short: a forge step takes seconds in the interpreters)
        a.model, a.batch, a.seq_len, a.steps, a.warmup = "tiny", 2, 16, 1, 1
    return a


def _variant_args(a, case: str, ckpt: bool) -> argparse.Namespace:
    # what examples/finetune_lora_fsdp2.py's build() reads
    return argparse.Namespace(model=None, preset=a.model, full=case == "full", checkpointing=ckpt, lora_r=16,
                              lora_dropout=0.05, seed=0, precision=a.precision)


def run_variant(a, case: str, ckpt: bool, variant: str, device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    va = _variant_args(a, case, ckpt)
    model = ex.build(va, device, ex.weights_dtype(va, device))
    row = {"case": case, "checkpointing": "on" if ckpt else "off", "variant": variant}
    if variant != "eager":
        _, backend, where = variant.split(":")  # forge:<backend>:<before|after>
        kw = dict(backend=backend, min_elements=0 if a.quick else None)  # (--quick: tiny calls fused too)
    if variant != "eager" and where == "before":
        forge.patch(model, **kw)
    ex.shard(model, a.precision)
    if variant != "eager" and where == "after":
        forge.patch(model, **kw)
    if variant != "eager":
        row["note"] = f"patched {dict(model._forge_patched_counts)}"
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5 if va.full else 2e-4)
    vocab = model.config.vocab_size
    cuda = device.type == "cuda"
    losses, times = [], []

    def step_(step):
        g = torch.Generator().manual_seed(1000 * step + rank)  # the same tokens for every variant
        ids = torch.randint(0, vocab, (a.batch, a.seq_len), generator=g).to(device)
        torch.manual_seed(step * world + rank)  # dropout seeded alike
        return ex.train_step(model, opt, ids, world)

    for step in range(a.warmup + a.steps):
        if step == a.warmup and cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        loss, secs = step_(step)
        if step >= a.warmup:
            times.append(secs * 1e3)
        losses.append(loss)
    if variant != "eager":  # calls that ran the original forward instead of forge's (none expected)
        st = model._forge_guard_stats.as_dict()
        row["fallbacks"] = {k: v["fallback"] for k, v in st.items() if v.get("fallback")}
    if a.profile:
        row.update(_profiled(lambda s: step_(a.warmup + a.steps + s), device, 1 if a.quick else 2))
    mine = [statistics.median(times),
            torch.cuda.max_memory_allocated(device) / 2**20 if cuda else 0.0,
            torch.cuda.max_memory_reserved(device) / 2**20 if cuda else 0.0]
    every = [None] * world
    dist.all_gather_object(every, mine)
    row.update(step_ms=max(r[0] for r in every), peak_MiB=max(r[1] for r in every) or None,
               reserved_MiB=max(r[2] for r in every) or None, loss_first=losses[0], loss_last=losses[-1],
               step_ms_per_rank=[r[0] for r in every])
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return row


def _profiled(step, device, steps) -> dict:
    """``steps`` more steps, rank 0 under torch.profiler: host op time and device busy time per step."""
    p = ex.profile_steps(step, device, steps=steps)
    if p is None:
        return {}
    return {"prof_wall_ms": p["wall_ms_per_step"], "prof_host_op_ms": p["host_op_ms_per_step"],
            "prof_device_busy_ms": p["compute_busy_ms_per_step"],
            "prof_nccl_ms": p["device_ms_per_step"]["nccl (all-gather / reduce-scatter)"]}


def main(a):
    standalone = ex.single_process_env()
    device = ex.init_group(a.quick)
    rows = []
    try:
        variants = ["eager"] + [f"forge:{b}:{w}" for b in a.backend.split(",") for w in a.patch.split(",")]
        for case in a.cases.split(","):
            for ckpt in a.checkpointing.split(","):
                for v in variants:
                    rows.append(run_variant(a, case, ckpt == "on", v, device))
                    if dist.get_rank() == 0:
                        r = rows[-1]
                        print(f"{case} checkpointing {r['checkpointing']} {v}: {r['step_ms']:.1f} ms", flush=True)
        if dist.get_rank() == 0:
            for r in rows:
                e = next(x for x in rows if x["case"] == r["case"] and x["checkpointing"] == r["checkpointing"]
                         and x["variant"] == "eager")
                r["speedup"] = e["step_ms"] / r["step_ms"]
                if r.get("reserved_MiB") and e.get("reserved_MiB"):
                    r["reserved_frac"] = r["reserved_MiB"] / e["reserved_MiB"]
            world = dist.get_world_size()
            title = (f"{a.model} FSDP2 over {world} rank(s), {a.batch}x{a.seq_len} per rank, "
                     f"precision {a.precision}{'' if not standalone else ' (one process)'}")
            print(title)
            bc.print_table(rows, COLUMNS)
            out = Path(a.out)
            bc.write_results(out, "bench_fsdp", rows, extra={"args": vars(a), "title": title, "world_size": world},
                             case=(f"{a.model}-{a.batch}x{a.seq_len}-{world}ranks-{a.cases.replace(',', '-')}"
                                   f"-ckpt-{a.checkpointing.replace(',', '-')}-{a.precision}"))
        dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    main(parse())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (as the example: skip the interpreter's teardown after gloo)
