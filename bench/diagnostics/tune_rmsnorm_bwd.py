"""Sweep the Triton RMSNorm backward's dw partials and their reduction (programs per SM, the
reduction's tile and warps) at the 8B and 0.5B widths, bf16; prints every setting and the best
per shape (device time, fraction of the 4.2 TB/s copy ceiling for reading x and dy and writing dx).

    python bench/diagnostics/tune_rmsnorm_bwd.py
"""
from __future__ import annotations

import importlib
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import _common as bc  # noqa: E402
import forge_triton  # noqa: E402,F401  (sets the Triton mode first)

R = importlib.import_module("forge_triton.rmsnorm")
SHAPES = [(4096, 4096), (8192, 4096), (4096, 3584), (4096, 896), (32768, 4096)]
REDUCE = [(128, 32, 4), (32, 32, 4), (32, 128, 4), (32, 128, 8), (16, 256, 8), (64, 64, 4), (32, 64, 2)]


def main():
    rows = []
    for (m, n), pps, (dwn, dwp, dww) in itertools.product(SHAPES, (2, 4, 8), REDUCE):
        R.BWD_PROGS_PER_SM, R.DW_BLOCK_N, R.DW_BLOCK_P, R.DW_WARPS = pps, dwn, dwp, dww
        R._CFG.clear()
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        _, x2, rstd = R.rmsnorm_fwd(x, w, 1e-6, "llama", 0.0)
        us = bc.device_time_us(lambda: R.rmsnorm_bwd(dy, x2, w, rstd, "llama", 0.0), 20)
        rows.append((m, n, pps, dwn, dwp, dww, us, 3 * x.numel() * 2 / us / 1e3 / bc.COPY_CEILING_GBS))
    best = {}
    for r in sorted(rows, key=lambda r: (r[0], r[1], -r[7])):
        best.setdefault((r[0], r[1]), r)
        print("%5d x %5d  progs/SM %d  reduce %3d cols x %3d rows, %d warps  %7.1f us  %.2f of the ceiling" % r)
    print("best per shape:")
    for r in best.values():
        print("%5d x %5d  progs/SM %d  reduce %3d cols x %3d rows, %d warps  %7.1f us  %.2f of the ceiling" % r)


if __name__ == "__main__":
    main()
