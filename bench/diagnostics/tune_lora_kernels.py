"""Launch settings of the Triton LoRA kernels (forge_triton/lora_kernels.py's CFG) at the 8B
shapes: every kernel of a LoRA step times each setting in a small grid, with and without
dropout, and prints its device time, its bandwidth as a share of the copy ceiling and the
best setting beside today's. A diagnostic: it served the 8B LoRA profile's question (forge's
own kernels took 77 ms of a 263 ms step) and is kept to re-check after a change.

    python bench/diagnostics/tune_lora_kernels.py [--rows 4096] [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _common as bc  # noqa: E402

from forge_triton import lora_kernels as K  # noqa: E402

# (the fourth entry: the largest rank run as outer products on the CUDA cores, 0 = tl.dot always)
TILES = [(bm, bn, w, f) for bm, bn, w, f in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (0, 64))
         if bm * bn <= 16384]
TILE_KERNELS = ("add", "dx", "glu_fwd", "glu_bwd")
# --small: a grid around the settings that won at 8B (32-64 rows, 64-128 columns), for one
# question at a time (each setting of each case compiles: about a second apiece)
SMALL = [(bm, bn, w, f) for bm, bn, w, f in itertools.product((32, 64), (64, 128), (4, 8), (0, 64))]
ROWS = [(bm, bk, w, per_sm) for bm, bk, w, per_sm in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (2, 4))
        if bm * bk <= 16384]


def _time_ms(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40)


def cases(m, r, p, dev):
    """(name, kernel key, bytes moved, callable) per kernel and shape of a Llama-3-8B layer."""
    bf, f32 = torch.bfloat16, torch.float32
    h, i = 4096, 14336
    seed = torch.tensor([12345, 678], dtype=torch.int32, device=dev)
    rnd = lambda *s, dt=bf: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    out = []
    g, u, hh = rnd(m, i), rnd(m, i), rnd(m, i)
    xa, bg, bu = rnd(m, 2 * r), rnd(i, r, dt=f32), rnd(i, r, dt=f32)
    out.append(("glu_fwd gate+up I=14336", "glu_fwd", 5 * m * i * 2,
                lambda: K.glu_fwd_(g, u, hh, xa, bg, bu, r, r, 2.0, 2.0, False)))
    dh, dg, du, dha, ad = rnd(m, i), rnd(m, i), rnd(m, i), rnd(m, r), rnd(r, i, dt=f32)
    for pp in sorted({p, 0.0}):
        out.append((f"glu_bwd I=14336 p={pp}", "glu_bwd", 6 * m * i * 2,
                    lambda pp=pp: K.glu_bwd_(dh, g, u, dg, du, dha, ad, seed, pp, False)))
    x = rnd(m, h)
    for slots, names in ((3, ("q", "k", "v")), (1, ("o",))):
        a_cat, dxa, gx = rnd(slots * r, h), rnd(m, slots * r), rnd(m, h)
        ranks, ps = [r] * slots, [p] * slots
        out.append((f"dx K=4096 x{slots}", "dx", 2 * m * h * 2,
                    lambda a_cat=a_cat, dxa=dxa, gx=gx, ranks=ranks, ps=ps, names=names:
                    K.add_dx_(gx, dxa, a_cat, seed, ranks, ps, names)))
        out.append((f"down K=4096 x{slots}", "down", m * h * 2,
                    lambda a_cat=a_cat, ranks=ranks, ps=ps, names=names: K.down(x, a_cat, seed, ranks, ps, names)))
        out.append((f"grad_a K=4096 x{slots}", "grad_a", m * h * 2,
                    lambda dxa=dxa, ranks=ranks, ps=ps, names=names: K.grad_a(x, dxa, seed, ranks, ps, names)))
    a_d, dxa_d = rnd(r, i), rnd(m, r)
    out.append(("down K=14336 x1", "down", m * i * 2, lambda: K.down(hh, a_d, seed, [r], [p], ["down"])))
    out.append(("grad_a K=14336 x1", "grad_a", m * i * 2, lambda: K.grad_a(hh, dxa_d, seed, [r], [p], ["down"])))
    o, pq, qq = rnd(m, h), rnd(m, r), rnd(r, h)
    out.append(("add N=4096", "add", 2 * m * h * 2, lambda: K.lora_add_(o, pq, qq, 2.0)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.05)
    ap.add_argument("--quick", action="store_true", help="the current settings only")
    ap.add_argument("--kernels", default=None, help="comma-separated CFG keys to time (default: all)")
    ap.add_argument("--fma", choices=["both", "on", "off"], default="both",
                    help="tile kernels: time outer-product and/or tl.dot low-rank terms")
    ap.add_argument("--small", action="store_true", help="tile kernels: the small grid (SMALL) only")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU: it times compiled kernels")
    default = dict(K.CFG)
    rows = []
    want = set(a.kernels.split(",")) if a.kernels else set(default)
    tiles = [t for t in (SMALL if a.small else TILES) if a.fma == "both" or (t[3] > 0) == (a.fma == "on")]
    for name, key, nbytes, fn in cases(a.rows, a.rank, a.dropout, "cuda"):
        if key not in want:
            continue
        grid = [default[key]] if a.quick else (tiles + [default[key]] if key in TILE_KERNELS else ROWS)
        grid = list(dict.fromkeys(grid))
        timed = []
        for cfg in grid:
            K.CFG[key] = cfg
            try:
                ms = _time_ms(fn)
            except Exception as e:  # a setting the compiler refuses (shared memory, registers)
                print(f"  {name} {cfg}: {type(e).__name__}")
                continue
            timed.append((ms, cfg))
        K.CFG[key] = default[key]
        timed.sort()
        now = next((ms for ms, c in timed if c == default[key]), float("nan"))
        best_ms, best = timed[0]
        frac = lambda ms: nbytes / (ms * 1e-3) / 1e9 / bc.COPY_CEILING_GBS  # noqa: E731
        rows.append(dict(case=name, kernel=key, now=default[key], now_us=round(now * 1e3, 1), now_frac=round(frac(now), 3),
                         best=best, best_us=round(best_ms * 1e3, 1), best_frac=round(frac(best_ms), 3),
                         top5=[(round(ms * 1e3, 1), c) for ms, c in timed[:5]],
                         timed=[(round(ms * 1e3, 1), c) for ms, c in timed]))
        r = rows[-1]
        print(f"{name:28s} now {str(r['now']):18s} {r['now_us']:8.1f} us {r['now_frac']:.2f} | "
              f"best {str(best):18s} {r['best_us']:8.1f} us {r['best_frac']:.2f} | top5 {r['top5']}", flush=True)
    best = best_settings(rows)
    print("best per kernel (least total time over its cases):", json.dumps(best))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "tune_lora_kernels.json"), "w") as f:
            json.dump(dict(env=bc.environment(), rows=rows, best=best, command=" ".join(sys.argv)), f, indent=1,
                      default=str)


def best_settings(rows):
    """{kernel: setting} with the least total time over the kernel's cases, among the settings
    every case timed (bench_patch_bisect.py --lora-cfg takes it)."""
    out = {}
    for key in dict.fromkeys(r["kernel"] for r in rows):
        per = [{tuple(c): us for us, c in r["timed"]} for r in rows if r["kernel"] == key]
        common = set.intersection(*(set(d) for d in per))
        if common:
            out[key] = list(min(common, key=lambda c: sum(d[c] for d in per)))
    return out


if __name__ == "__main__":
    main()
