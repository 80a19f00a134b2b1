"""The Pallas fused loss's grad_W accumulate (forge_pallas.fused_linear_ce._gw_accumulate):
block sizes against XLA's dot + add, and the row-chunk loss's memory and time by chunk count.

    python bench/diagnostics/diag_flce_grad_w.py --gemm   # grad_W += dz^T h at the two issue shapes, per
                                              # (BV, BH, BK, warps, stages), against XLA
    python bench/diagnostics/diag_flce_grad_w.py --rows   # 16384 x 4096 x 128256: the compiled function's
                                              # memory (XLA's own analysis) and time, 16-32 chunks

JAX only (no torch tensors, no bridge): what the kernel and the chunking cost by themselves.
Session 5 on the H200 (docs/lab-notes.md): XLA's dot + add 1.91 ms, the kernel 2.83 ms at
(128, 256, 64), 8 warps, 4 stages (128256 x 4096, 1024 rows); the loss at 16 chunks 2,007 MiB,
92 ms; 32 chunks 1,647 MiB, 105 ms. Writes flce_grad_w-<device>.{json,csv} into --out.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import _common as bc  # noqa: E402
from forge_pallas import fused_linear_ce as K  # noqa: E402

CONFIGS = [((128, 256, 64), 8, 3), ((128, 256, 64), 8, 4), ((128, 128, 64), 4, 4), ((128, 128, 64), 8, 4),
           ((128, 256, 128), 8, 2), ((256, 128, 64), 8, 3), ((64, 256, 64), 4, 4), ((256, 256, 64), 8, 2)]


def _ms(f, args, n):
    jax.block_until_ready(f(*args))  # compile
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def gemm(iters, shapes):
    rows = []
    for v, hd, c in shapes:
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
        g = (jax.random.normal(k1, (c, v), jnp.float32) * 1e-3).astype(jnp.bfloat16)
        h = jax.random.normal(k2, (c, hd), jnp.float32).astype(jnp.bfloat16)
        gw = (jax.random.normal(k3, (v, hd), jnp.float32) * 1e-2).astype(jnp.bfloat16)
        xla = jax.jit(lambda gw, g, h: gw + jnp.dot(g.T, h, preferred_element_type=jnp.bfloat16))
        rows.append(dict(vocab=v, hidden=hd, rows=c, impl="xla dot + add", ms=_ms(xla, (gw, g, h), iters)))
        for blocks, warps, stages in CONFIGS:
            f = jax.jit(functools.partial(K._gw_accumulate, blocks=blocks, warps=warps, stages=stages))
            try:
                ms = _ms(f, (gw, g, h), iters)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects is a result too
                ms = f"failed: {e!r}"[:200]
            rows.append(dict(vocab=v, hidden=hd, rows=c, impl=f"pallas {blocks} w{warps} s{stages}", ms=ms))
        for r in rows[-len(CONFIGS) - 1:]:
            if isinstance(r["ms"], float):
                r["tflops"] = 2 * v * hd * c / r["ms"] / 1e9
    return rows


def chunked(iters, chunk_counts):
    n, hd, v = 16384, 4096, 128256
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    hidden = jax.random.normal(k1, (n, hd), jnp.float32).astype(jnp.bfloat16)
    weight = (jax.random.normal(k2, (v, hd), jnp.float32) * hd**-0.5).astype(jnp.bfloat16)
    labels = jax.random.randint(k3, (n,), 0, v)
    div = jnp.float32(n)
    rows = []
    for chunks in chunk_counts:
        size = -(-(-(-n // chunks)) // 64) * 64  # n / chunks rounded up to 64 rows
        f = jax.jit(functools.partial(K._flce_rows, bias=None, ignore_index=-100, softcap=None,
                                      label_smoothing=0.0, z_loss=0.0, chunk_rows=size,
                                      grads_for=(True, True, False)))
        ma = f.lower(hidden, weight, labels, div).compile().memory_analysis()
        rows.append(dict(chunks=chunks, chunk_rows=size, temp_mib=ma.temp_size_in_bytes / 2**20,
                         out_mib=ma.output_size_in_bytes / 2**20,
                         total_mib=(ma.temp_size_in_bytes + ma.output_size_in_bytes) / 2**20,
                         ms=_ms(f, (hidden, weight, labels, div), iters)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--rows", action="store_true")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (the interpreter on CPU)")
    bc.add_out_argument(ap)
    args = ap.parse_args()
    rows = []
    if args.gemm:
        shapes = [(256, 64, 32)] if args.quick else [(128256, 4096, 1024), (151936, 896, 1024)]
        got = gemm(1 if args.quick else args.iters, shapes)
        bc.print_table(got, ["vocab", "hidden", "rows", "impl", "ms", "tflops"])
        rows += got
    if args.rows:
        got = chunked(args.iters, [16, 20, 24, 32])
        bc.print_table(got, ["chunks", "chunk_rows", "temp_mib", "out_mib", "total_mib", "ms"])
        rows += got
    if rows:
        jpath, _ = bc.write_results(args.out, "flce_grad_w", rows)
        print(f"wrote {jpath}")


if __name__ == "__main__":
    main()
