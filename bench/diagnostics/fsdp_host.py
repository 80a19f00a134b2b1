"""Host time of a LoRA training step under FSDP2, eager peft against forge, on CPU ranks (gloo).

The GPU step of examples/finetune_lora_fsdp2.py is host-bound (docs/fsdp.md): what decides it is
the Python and the torch-op dispatch the host does per step, not the kernels. This measures that
host work on CPU ranks, with forge's Triton launches replaced by a no-op (``_launch.mode
("skip")``'s stand-in, patched in for every thread): the tensors forge allocates, the torch ops
(GEMMs, casts, masks) and every line of forge's Python around the kernels still run; only the
kernel bodies, which the Triton interpreter would run for seconds, do not (their outputs are
left uninitialised, so the losses are meaningless; the time is what counts). The launches are
counted: on a GPU each costs its launch path's host time on top (Triton's own path ~16-18 us,
FastKernel's a few us, forge_triton/_launch.py).

The model: Qwen2 at small widths (the tiny matrices make each torch op cost about its dispatch,
as on a host-bound GPU step), peft LoRA r=16 with dropout on all seven projections, base weights
in fp32 and adapters in fp64 (``--dtype``, ``--adapter-dtype``: the GPU run's bf16 base under
fp32 adapters has the same casts, and this CPU's bf16 GEMMs are ~25x slower than fp32 ones),
``fully_shard`` on every decoder layer and the root, AdamW with ``foreach=True`` (what it picks
on CUDA for DTensor parameters). All variants are built side by side and their steps
interleaved; per variant the median step time, its median difference to the first variant's
step of the same round (paired), the aten ops per step (torch.profiler: count and CPU self time),
the Triton launches, and with ``--cprofile`` where rank 0's Python goes; at two or more
``--layers`` the difference per decoder layer. One rank (``--nproc-per-node 1``) measures the
host work without waiting for another rank; with two ranks on a shared two-core machine the
waits in gloo's collectives dominate the wall time (the op counts are the same).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 1 bench/diagnostics/fsdp_host.py --layers 2 6 --steps 40 \
        --rounds 2 --variants eager forge:after forge:before [--kernels lora_qkv,lora_mlp] [--cprofile 10]

Prints one table on rank 0 and writes fsdp_host-cpu.json into --out.
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
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import forge  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
LAUNCHES = collections.Counter()


def stub_launches() -> None:
    """Every Triton launch of forge_triton becomes a counted no-op (all threads)."""
    from forge_triton import _launch

    def stand_in(name):
        def launch(*args, **meta):
            LAUNCHES[name] += 1

        return launch

    _launch.FastKernel.__getitem__ = lambda self, grid: stand_in(self.kernel.fn.__name__)


def build(a, layers: int):
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen2", hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4,
                               vocab_size=a.vocab, max_position_embeddings=4096, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[a.dtype], attn_implementation="sdpa")
    lc = peft.LoraConfig(r=a.r, lora_alpha=2 * a.r, lora_dropout=a.dropout, target_modules=TARGETS)
    pm = peft.get_peft_model(model, lc).train()  # adapters in fp32 (peft's default)
    for n, prm in pm.named_parameters():
        if "lora_" in n:
            prm.data = prm.data.to(DTYPES[a.adapter_dtype])
    return pm


def shard(model):
    root = model.get_base_model()
    for layer in getattr(root, root.base_model_prefix).layers:
        fully_shard(layer)
    fully_shard(model)


def setup(a, variant: str, layers: int):
    model = build(a, layers)
    kind, _, where = variant.partition(":")
    kw = dict(backend="triton", min_elements=0)
    if a.kernels:
        kw["kernels"] = a.kernels.split(",")
    if kind == "forge" and where == "before":
        forge.patch(model, **kw)
    shard(model)
    if kind == "forge" and where == "after":
        forge.patch(model, **kw)
    # foreach: what AdamW picks on CUDA for DTensor parameters (the CPU default is the for-loop)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    return model, opt


def step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(a, variants, layers, rank):
    """Every variant built side by side at ``layers`` layers, their steps interleaved (one step of
    each in a rotating order, ``--steps`` times): the machine's drift hits all alike, and the
    per-step difference to eager pairs steps taken moments apart."""
    built = {v: setup(a, v, layers) for v in variants}
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    for v in variants:
        for _ in range(a.warmup):
            step(*built[v], ids)
    times = {v: [] for v in variants}
    for i in range(a.steps):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            dist.barrier()
            t0 = time.perf_counter()
            step(*built[v], ids)
            times[v].append(time.perf_counter() - t0)
    out = []
    for v in variants:
        model, opt = built[v]
        r = {"variant": v, "layers": layers, "step_ms": 1e3 * statistics.median(times[v]),
             "step_ms_min": 1e3 * min(times[v])}
        if v != variants[0]:  # paired with the first variant's step of the same round
            r["minus_first_ms"] = 1e3 * statistics.median(t - t0 for t, t0 in zip(times[v], times[variants[0]]))
        r.update(_counts(a, model, opt, ids, rank, v))
        out.append(r)
    del built
    return out


def _counts(a, model, opt, ids, rank, variant):
    """Launches, aten ops (torch.profiler: count, CPU self time), guard calls and (``--cprofile``
    on rank 0) where the Python goes, per step of one variant."""
    LAUNCHES.clear()
    n_prof = 3
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n_prof):
            step(model, opt, ids)
    launches = {k: v / n_prof for k, v in LAUNCHES.items()}
    ops, self_ms = 0, 0.0
    per_op = collections.Counter()
    for e in prof.key_averages():
        if e.key.startswith("aten::") or e.key.startswith("c10d") or e.key.startswith("gloo"):
            ops += e.count
            self_ms += e.self_cpu_time_total / 1e3
            per_op[e.key] += e.count
    guard = model._forge_guard_stats.as_dict() if variant.startswith("forge") else {}
    cprof = None
    if a.cprofile and rank == 0:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.cprofile):
            step(model, opt, ids)
        pr.disable()
        cprof = _cprofile_summary(pr, a.cprofile)
    elif a.cprofile:
        for _ in range(a.cprofile):
            step(model, opt, ids)
    dist.barrier()
    return {"aten_ops_per_step": ops / n_prof, "aten_self_ms_per_step": self_ms / n_prof,
            "top_ops": {k: v / n_prof for k, v in per_op.most_common(60)},
            "launches_per_step": launches, "guard_calls": guard, "cprofile": cprof}


def _area(filename: str) -> str:
    f = filename.replace("\\", "/")
    for key, tag in (("/forge/patching/lora", "forge.patching.lora"), ("/forge_triton/lora", "forge_triton.lora"),
                     ("/forge_triton/", "forge_triton (other)"), ("/forge/spec/", "forge.spec"),
                     ("/forge/", "forge (other)"), ("/peft/", "peft"), ("/fsdp/", "torch fsdp"),
                     ("/distributed/tensor", "torch DTensor"), ("/torch/optim", "torch optim"),
                     ("/torch/autograd", "torch autograd"), ("/torch/nn/", "torch nn"),
                     ("/transformers/", "transformers"), ("/torch/", "torch (other)")):
        if key in f:
            return tag
    return "builtins / C" if f.startswith("~") or f.startswith("<") else "other"


def _cprofile_summary(pr, steps):
    st = pstats.Stats(pr)
    by_area = collections.Counter()
    rows = []
    for (fname, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        by_area[_area(fname)] += tt
        rows.append((tt, nc, ct, f"{Path(fname).name}:{line}:{func}"))
    rows.sort(reverse=True)
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(40)
    return {"tottime_ms_per_step_by_area": {k: 1e3 * v / steps for k, v in by_area.most_common()},
            "top_tottime": [[1e3 * tt / steps, nc / steps, 1e3 * ct / steps, n] for tt, nc, ct, n in rows[:40]],
            "cumulative": buf.getvalue()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["eager", "forge:after", "forge:before"])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 6])
    p.add_argument("--kernels", default=None, help="forge.patch(kernels=...) as a comma list (default: all)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--dtype", default="fp32", choices=DTYPES, help="base weights")
    p.add_argument("--adapter-dtype", default="fp64", choices=DTYPES,
                   help="LoRA weights (default fp64 over fp32: the casts of the GPU's fp32 adapters over bf16, "
                        "without the CPU's slow bf16 GEMMs)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="repeat every variant this many times (interleaved)")
    p.add_argument("--cprofile", type=int, default=0, help="cProfile this many steps on rank 0")
    p.add_argument("--launch", action="store_true", help="keep the real launches (Triton's interpreter: slow)")
    p.add_argument("--out", type=Path, default=Path("forge-bench-results"))
    a = p.parse_args()
    if not a.launch:
        stub_launches()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = []
    try:
        for _ in range(a.rounds):
            for layers in a.layers:
                for r in measure(a, a.variants, layers, rank):
                    res.append(r)
                    if rank == 0:
                        pair = (f"  minus {a.variants[0]} {r['minus_first_ms']:+7.2f} ms"
                                if "minus_first_ms" in r else "")
                        print(f"{r['variant']:14s} L={layers:2d}  {r['step_ms']:8.2f} ms/step "
                              f"(min {r['step_ms_min']:.2f}){pair}  aten ops {r['aten_ops_per_step']:7.0f}  "
                              f"launches {sum(r['launches_per_step'].values()):.0f}", flush=True)
        if rank == 0:
            _report(a, res)
    finally:
        dist.destroy_process_group()


def _report(a, res):
    by = collections.defaultdict(list)
    for r in res:
        by[(r["variant"], r["layers"])].append(r)
    fields = ("step_ms", "step_ms_min", "minus_first_ms", "aten_ops_per_step", "aten_self_ms_per_step")
    med = {k: {f: statistics.median(x[f] for x in v) for f in fields if f in v[0]} for k, v in by.items()}
    print("\nper variant (median over rounds):")
    for (v, layers), m in sorted(med.items(), key=lambda kv: (kv[0][1], a.variants.index(kv[0][0]))):
        pair = f"  minus {a.variants[0]} {m['minus_first_ms']:+7.2f} ms" if "minus_first_ms" in m else ""
        print(f"  {v:14s} L={layers:2d}  {m['step_ms']:8.2f} ms{pair}  ops {m['aten_ops_per_step']:7.0f}  "
              f"op self {m['aten_self_ms_per_step']:7.2f} ms")
    slopes = {}
    if len(a.layers) >= 2:
        lo, hi = min(a.layers), max(a.layers)
        print(f"\nper decoder layer (L={hi} minus L={lo}, divided by {hi - lo}):")
        for v in a.variants:
            s = {f: (med[(v, hi)][f] - med[(v, lo)][f]) / (hi - lo) for f in med[(v, hi)]}
            slopes[v] = s
            pair = f"  minus {a.variants[0]} {s['minus_first_ms']:+7.3f} ms/layer" if "minus_first_ms" in s else ""
            print(f"  {v:14s} {s['step_ms']:7.3f} ms/layer{pair}  ops {s['aten_ops_per_step']:6.1f}/layer  "
                  f"op self {s['aten_self_ms_per_step']:6.3f} ms/layer")
    a.out.mkdir(parents=True, exist_ok=True)
    env = {"command": " ".join(["torchrun --nproc-per-node 2"] + sys.argv), "torch": torch.__version__}
    with contextlib.suppress(Exception):
        import peft
        import transformers

        env.update(transformers=transformers.__version__, peft=peft.__version__)
    out = a.out / "fsdp_host-cpu.json"
    out.write_text(json.dumps({"env": env, "args": {k: str(v) for k, v in vars(a).items()}, "runs": res,
                               "median": {f"{v}@{layers}": m for (v, layers), m in med.items()},
                               "per_layer": slopes}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
