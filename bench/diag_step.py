"""Diagnose a whole-model step: eager, forge (one kernel), eager again, in one process, with
torch.profiler summaries (host time per op, device time) of one step each.

    python bench/diag_step.py [--kernels rmsnorm] [--backend triton]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import forge  # noqa: E402
from bench_patch_bisect import _step_fn, _time  # noqa: E402
from presets import build  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", default="rmsnorm")
    p.add_argument("--backend", default="triton")
    p.add_argument("--mode", default="train")
    a = p.parse_args()
    model = build("qwen2.5-0.5b", torch.bfloat16, "cuda")
    model.train(a.mode == "train")
    ids = torch.randint(0, 151936, (4, 1024), device="cuda")
    step = _step_fn(model, a.mode, ids)
    for label in ("eager", "forge", "eager-again"):
        if label == "forge":
            forge.patch(model, mode=a.mode, backend=a.backend, kernels=a.kernels.split(","))
        if label == "eager-again":
            forge.unpatch(model)
        ms = _time(step, 10, 3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"== {label}: {ms:.1f} ms/step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    main()
