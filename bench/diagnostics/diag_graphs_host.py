"""Where a compiled ``graphs=True`` training step waits for the host (CUDA): host timestamps and
device events at the step's start, at the first layer op's entry (before its replay), after the
last layer op of the forward, at the first and after the last layer op of the backward, and at
the step's end. Each device event runs when the device reaches it, so the device time between
two events is the work queued between them plus any wait for the host; where the host reaches a
mark later than the device (``host ahead`` negative) the device waited.

Prints only (medians over --steps synced steps). Train 4x1024 of Qwen2.5-0.5B by default.

    python bench/diagnostics/diag_graphs_host.py [--recompute] [--batch 4 --seq-len 1024] [--steps 12]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import forge  # noqa: E402
from forge.patching import graphs as G  # noqa: E402
from presets import add_step_arguments, build  # noqa: E402

MARKS = ("start", "fwd op 0", "fwd last op done", "bwd first op", "bwd op 0 done", "end")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_arguments(p)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args(argv)
    model = build(a.model, torch.bfloat16, "cuda", layers=a.layers)
    model.train()
    forge.patch(model, graphs=True, recompute_mlp=a.recompute)
    n = model.config.num_hidden_layers
    compiled = torch.compile(model)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq_len), device="cuda")
    rec = {}

    def mark(name):
        if rec is not None and name not in rec:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            rec[name] = (time.perf_counter(), ev)

    fwd0, bwd0 = G.Graphs.op_forward, G.Graphs.op_backward

    def op_forward(self, i, *args):
        if i == 0:
            mark("fwd op 0")
        out = fwd0(self, i, *args)
        if i == n - 1:
            mark("fwd last op done")
        return out

    def op_backward(self, i, *args):
        if i == n - 1:
            mark("bwd first op")
        out = bwd0(self, i, *args)
        if i == 0:
            mark("bwd op 0 done")
        return out

    G.Graphs.op_forward, G.Graphs.op_backward = op_forward, op_backward

    def step():
        mark("start")
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        for t in model.parameters():
            t.grad = None
        mark("end")

    for _ in range(4):
        rec = {}
        step()
        torch.cuda.synchronize()
    host, dev, wall = {m: [] for m in MARKS}, {m: [] for m in MARKS}, []
    for _ in range(a.steps):
        rec = {}
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        h0, e0 = rec["start"]
        for m in MARKS:
            h, e = rec[m]
            host[m].append((h - h0) * 1e3)
            dev[m].append(e0.elapsed_time(e))
    print(f"{a.model} train {a.batch}x{a.seq_len}, graphs=True{' recompute_mlp' if a.recompute else ''}, then "
          f"torch.compile; {model._forge_graphs.stats}")
    print(f"synced step: {statistics.median(wall):.2f} ms (median of {a.steps})")
    print(f"{'mark':<18} {'host (ms)':>10} {'device (ms)':>12} {'host ahead':>11}")
    for m in MARKS:
        hm, dm = statistics.median(host[m]), statistics.median(dev[m])
        print(f"{m:<18} {hm:10.2f} {dm:12.2f} {dm - hm:11.2f}")


if __name__ == "__main__":
    main()
