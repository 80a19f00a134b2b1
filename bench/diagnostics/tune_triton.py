"""Sweep the launch settings of the Triton RMSNorm and RoPE kernels on the GPU (device time per
call, bf16) and print the best; the winners become the module defaults.

    python bench/diagnostics/tune_triton.py [--out DIR]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers

import torch  # noqa: E402

import _common as bc  # noqa: E402
from forge.spec import shapes  # noqa: E402
import forge_triton  # noqa: E402,F401  (sets the Triton mode first)
import importlib  # noqa: E402

# the modules, not the functions forge_triton exports under the same names
R = importlib.import_module("forge_triton.rmsnorm")
P = importlib.import_module("forge_triton.rope")


def _rms(shape, tile, progs_per_sm):
    R.TILE, R.BWD_PROGS_PER_SM = tile, progs_per_sm
    R._CFG.clear()  # launch configs are cached per width
    m, n = shape
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y, x2, rstd = R.rmsnorm_fwd(x, w, 1e-6, "llama", 0.0)
    f = bc.device_time_us(lambda: R.rmsnorm_fwd(x, w, 1e-6, "llama", 0.0), 20)
    b = bc.device_time_us(lambda: R.rmsnorm_bwd(dy, x2, w, rstd, "llama", 0.0), 20)
    return f, b, 2 * x.numel() * 2 / f / 1e3 / bc.COPY_CEILING_GBS, 3 * x.numel() * 2 / b / 1e3 / bc.COPY_CEILING_GBS


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bc.add_out_argument(ap)
    args = ap.parse_args()
    rows = []
    for (name, shape), tile, pps in itertools.product(shapes.RMSNORM_GPU.items(), (1024, 2048, 4096, 8192), (2, 4, 8, 16)):
        f, b, ff, fb = _rms(shape, tile, pps)
        rows.append({"kernel": "rmsnorm", "shape": name, "tile": tile, "progs_per_sm": pps,
                     "fwd_us": f, "bwd_us": b, "fwd_frac": ff, "bwd_frac": fb})
    for (name, shape), warps in itertools.product(shapes.ROPE_GPU.items(), (1, 2, 4, 8)):
        P.WARPS = warps
        bsz, hq, hk, s, d = shape
        q = torch.randn(bsz, s, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(bsz, s, hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        cos = torch.randn(1, s, d, device="cuda", dtype=torch.bfloat16)
        f = bc.device_time_us(lambda: P.rope_apply(q, k, cos, cos, False), 20)
        rows.append({"kernel": "rope", "shape": name, "warps": warps, "fwd_us": f,
                     "fwd_frac": 2 * (q.numel() + k.numel()) * 2 / f / 1e3 / bc.COPY_CEILING_GBS})
    bc.print_table(rows, ["kernel", "shape", "tile", "progs_per_sm", "warps", "fwd_us", "bwd_us", "fwd_frac", "bwd_frac"])
    bc.write_results(args.out, "tune_triton", rows)


if __name__ == "__main__":
    main()
