"""Fused linear cross-entropy strategies side by side at the 8B and 0.5B shapes (one process):
eager (F.linear + cross_entropy on fp32 logits), the three products alone through cuBLAS (the
floor the fused loss's products aim at), and forge's strategies: vocabulary tiles and row
chunks of several heights, on each backend asked for. Forward + backward (grads for hidden and
weight), bf16, 10% of labels ignored; median of --reps steps timed with CUDA events, extra peak
memory above the inputs.

    python bench/diagnostics/flce_strategies.py [--shapes 4096x4096x128256,...] [--backends triton,pallas]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _common as bc  # noqa: E402
from forge import ops  # noqa: E402

SHAPES = "4096x4096x128256,8192x4096x128256,16384x4096x128256,4096x3584x152064,4096x896x151936"


def _time(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--backends", default="triton,pallas")
    p.add_argument("--reps", type=int, default=10)
    bc.add_out_argument(p)
    a = p.parse_args()
    rows = []
    for shp in a.shapes.split(","):
        n, h, v = map(int, shp.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        hid = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(True)
        w = (torch.randn(v, h, device="cuda", generator=g) * h ** -0.5).bfloat16().requires_grad_(True)
        y = torch.randint(0, v, (n,), device="cuda", generator=g)
        y[torch.rand(n, device="cuda", generator=g) < 0.1] = -100
        hd, wd = hid.detach(), w.detach()

        def eager():
            hid.grad = w.grad = None
            F.cross_entropy(F.linear(hid, w).float(), y).backward()

        def products():  # logits, grad_h, grad_W: the three products eager makes, bf16 out
            z = hd @ wd.t()
            gh = z @ wd
            gw = z.t() @ hd
            del z, gh, gw

        variants = {"eager": eager, "cublas_3_products": products}
        for be in a.backends.split(","):
            if not ops.availability(be)[0]:
                continue
            def mk(loss=ops.get("fused_linear_ce", be), **kw):
                def step():
                    hid.grad = w.grad = None
                    loss(hid, w, y, **kw).backward()
                return step

            variants[f"{be}_default"] = mk()
            variants[f"{be}_tiles"] = mk(tile_vocab=max(4096, v // 8))
            for c in (1024, 2048, 4096, 8192):
                if c <= n:
                    variants[f"{be}_rows{c}"] = mk(chunk_rows=c)
        ref = None
        for name, step in variants.items():
            try:
                ms = _time(step, a.reps)
                mib = _peak(step)
            except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
                print(f"{shp} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if name == "eager":
                ref = ms
            row = dict(shape=shp, variant=name, ms=round(ms, 3), extra_MiB=round(mib, 1),
                       vs_eager=round(ref / ms, 3) if ref else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del hid, w, y, hd, wd
        torch.cuda.empty_cache()
    bc.write_results(a.out, "flce_strategies", rows, {"args": vars(a)})
    print(f"\n{'shape':22} {'variant':22} {'ms':>9} {'extra MiB':>10} {'x eager':>8}")
    for r in rows:
        print(f"{r['shape']:22} {r['variant']:22} {r['ms']:9.2f} {r['extra_MiB']:10.1f} {r['vs_eager'] or 0:8.2f}")


if __name__ == "__main__":
    main()
