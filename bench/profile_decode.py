"""Where a decoding step's device time goes: forge with graphs (captured steps on forge's static
cache) against transformers' static cache + torch.compile, per kernel, from torch's profiler.

    python bench/profile_decode.py [--batches 8,32] [--prompt 128] [--new 64] [--top 15] [--variants ...]

For each batch size and variant: one warm generate() call, then one profiled call; prints the
kernels with the most device time (us per decoding step) and the step's total kernel time and
wall time. A diagnosis tool: it writes nothing but its printout.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import forge  # noqa: E402
from forge.patching import stacking  # noqa: E402
from bench_generate import _forget_compiled  # noqa: E402
from presets import PRESETS, build, is_moe  # noqa: E402

STACK_DEFAULT = stacking.STACK_INFER


def _kernels(prof):
    acc = collections.Counter()
    n = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name] += e.device_time
            n[e.name] += 1
    return acc, n


VARIANTS = ("forge graphs", "forge graphs apart", "static + compile", "forge static uncaptured")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    p.add_argument("--batches", default="8,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} ('apart': STACK_INFER off)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--experts-impl", default="grouped_mm", choices=["grouped_mm", "eager"],
                   help="MoE presets: transformers' experts implementation the unpatched variants run")
    a = p.parse_args(argv)
    model = build(a.model, torch.bfloat16, torch.device("cuda"), layers=a.layers).eval()
    if is_moe(a.model):  # (static + compile runs it; forge's variants patch the experts)
        model.set_experts_implementation(a.experts_impl)
    vocab = PRESETS[a.model]["vocab_size"]
    for b in map(int, a.batches.split(",")):
        ids = torch.randint(0, vocab, (b, a.prompt), device="cuda")
        for variant in a.variants.split(","):
            if variant not in VARIANTS:
                p.error(f"--variants: {variant!r} is none of {VARIANTS}")
            _forget_compiled(model)
            kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=a.new, min_new_tokens=a.new)
            if variant.startswith("forge graphs"):
                stacking.STACK_INFER = STACK_DEFAULT and not variant.endswith("apart")
                forge.patch(model, mode="infer", backend="triton", graphs=True)
                stacking.STACK_INFER = STACK_DEFAULT
            else:
                kw["cache_implementation"] = "static"
            if variant == "forge static uncaptured":  # the same kernels, attributed to torch ops
                forge.patch(model, mode="infer", backend="triton")
                kw["disable_compile"] = True
            model.generate(ids, **kw)
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                model.generate(ids, **kw)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            acc, n = _kernels(prof)
            steps = a.new - 1
            total = sum(acc.values())
            print(f"\n== batch {b} {variant}: wall {wall * 1e3:.1f} ms for {a.new} tokens "
                  f"({wall / a.new * 1e3:.2f} ms/token, profiled), kernel time {total / 1e3:.1f} ms "
                  f"({total / steps:.0f} us/step incl. prefill)")
            for name, us in acc.most_common(a.top):
                print(f"  {us / steps:9.1f} us/step  {n[name] / steps:6.1f} calls/step  {name[:110]}")
            if variant.startswith("forge graphs"):
                print("  stats:", model._forge_graphs.stats.as_dict())
            if variant == "forge static uncaptured":
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=a.top))
            forge.unpatch(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
