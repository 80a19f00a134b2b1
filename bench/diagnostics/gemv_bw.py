"""How close a decoding step's products come to the copy bandwidth: cuBLAS (F.linear) against a
plain Triton matrix-vector kernel, at the Llama-3-8B (or, with
``--shape qwen3-30b-a3b``, Qwen3-30B-A3B) decode shapes (1 and 8 rows), bf16.

A decoding step at batch 1-8 reads every weight once, so its products are bound by bytes. This
times each product alone (device time from the profiler, weights rotated over copies larger than
the L2 cache so every call reads DRAM) and prints the fraction of the 4.2 TB/s copy it reaches,
for cuBLAS and for the best of a small grid of Triton settings (rows per program, K tile, warps,
K split across programs with fp32 atomics), and forge's own one-row product
(``forge.spec.row_linear``) on each backend that runs here. The last table sums one token's
products over the layers and the head for each: what a faster product would save per token.

    python bench/diagnostics/gemv_bw.py [--rows 1,8] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _common as bc  # noqa: E402
import forge.ops  # noqa: E402
import forge_triton  # noqa: E402,F401  (sets the Triton mode first)
from forge_triton._common import dot_upcast  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# (name, out features N, in features K, calls per token): Llama-3-8B, q/k/v and gate/up both apart
# and stored together (forge.patching.stacking)
SHAPES = [("qkv", 6144, 4096, 32), ("q", 4096, 4096, 0), ("k or v", 1024, 4096, 0), ("o", 4096, 4096, 32),
          ("gate_up", 28672, 4096, 32), ("gate or up", 14336, 4096, 0), ("down", 4096, 14336, 32),
          ("head", 128256, 4096, 1)]
# Qwen3-30B-A3B's dense products a decoding step reads (48 layers): q/k/v stored together, o, the
# router (128 experts), the head; its experts are forge's grouped kernels (tune_experts_pallas.py)
SHAPES_QWEN3 = [("qkv", 5120, 2048, 48), ("o", 2048, 4096, 48), ("router", 128, 2048, 48),
                ("head", 151936, 2048, 1)]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
L2_BYTES = 256 * 2**20 if DEV == "cuda" else 1  # rotate over this many bytes of weight copies (H100/H200 L2: 50-60 MB)


@triton.jit
def _gemv_row(x_ptr, w_ptr, y_ptr, N, K, k_per, BN: tl.constexpr, BK: tl.constexpr, ATOMIC: tl.constexpr):
    # one row of x: y[n] = sum_k x[k] w[n, k]; program (n tile, k slice)
    pn = tl.program_id(0)
    pk = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BN, BK), tl.float32)
    k_lo = pk * k_per
    for k0 in range(k_lo, k_lo + k_per, BK):
        rk = k0 + tl.arange(0, BK)
        km = rk < K
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & km[None, :], other=0.0)
        x = tl.load(x_ptr + rk, mask=km, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if ATOMIC:
        tl.atomic_add(y_ptr + rn, y, mask=rn < N)
    else:
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _gemv_rows(x_ptr, w_ptr, y_ptr, M, N, K, k_per, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               ATOMIC: tl.constexpr, UPCAST: tl.constexpr):
    # up to BM rows of x (padded to the tensor cores' 16): y[m, n] = sum_k x[m, k] w[n, k]
    pn = tl.program_id(0)
    pk = tl.program_id(1)
    rn = pn * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    k_lo = pk * k_per
    for k0 in range(k_lo, k_lo + k_per, BK):
        rk = k0 + tl.arange(0, BK)
        km = rk < K
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & km[None, :], other=0.0)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & km[None, :], other=0.0)
        if UPCAST:  # (the interpreter's bf16 dot is wrong: forge_triton._common.dot_upcast)
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    out = y_ptr + rm[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def triton_gemv(x, w, bn, bk, warps, split):
    m, k = x.shape
    n = w.shape[0]
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per)
    atomic = split > 1
    y = (torch.zeros if atomic else torch.empty)(m, n, device=x.device, dtype=torch.float32 if atomic else x.dtype)
    grid = (triton.cdiv(n, bn), split)
    if m == 1:
        _gemv_row[grid](x, w, y, n, k, k_per, BN=bn, BK=bk, ATOMIC=atomic, num_warps=warps)
    else:
        _gemv_rows[grid](x, w, y, m, n, k, k_per, BM=16, BN=bn, BK=bk, ATOMIC=atomic,
                            UPCAST=dot_upcast(), num_warps=warps)
    return y.to(x.dtype) if atomic else y


def _rotating(n, k, dtype):
    copies = max(1, -(-L2_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, device=DEV, dtype=dtype) / k ** 0.5 for _ in range(copies)]
    state = {"i": 0}

    def next_w():
        state["i"] = (state["i"] + 1) % copies
        return ws[state["i"]]
    return ws, next_w


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--quick", action="store_true", help="two settings per kernel, for a smoke test")
    ap.add_argument("--shape", default="llama3-8b", choices=["llama3-8b", "qwen3-30b-a3b"])
    a = ap.parse_args()
    rows_list = [int(r) for r in a.rows.split(",")]
    grid_row = list(itertools.product((8, 16, 32), (256, 512), (4, 8), (1, 4)))
    grid_rows = list(itertools.product((16, 32, 64), (128, 256), (4,), (1, 4)))
    if a.quick:
        grid_row, grid_rows = grid_row[:2], grid_rows[:2]
    dtype = torch.bfloat16
    shapes = SHAPES if a.shape == "llama3-8b" else SHAPES_QWEN3
    if a.quick:  # (the interpreter on a CPU: small widths, one L2-sized copy is plenty)
        shapes = [(name, n // 64, k // 64, t) for name, n, k, t in shapes]
    results = []
    row_kernels = []  # (backend, forge's row_linear) for each backend that runs here
    for be in forge.ops.BACKENDS:
        try:
            row_kernels.append((be, forge.ops.get("row_linear", be)))
        except forge.ops.BackendUnavailableError as e:
            print(f"forge {be}: not timed ({e})")
    for m in rows_list:
        for name, n, k, per_token in shapes:
            ws, next_w = _rotating(n, k, dtype)
            x = torch.randn(m, k, device=DEV, dtype=dtype)
            ref = F.linear(x.float(), ws[0].float())
            cublas = bc.device_time_us(lambda: F.linear(x, next_w()), 40)
            best = None
            for bn, bk, warps, split in (grid_row if m == 1 else grid_rows):
                y = triton_gemv(x, ws[0], bn, bk, warps, split)
                err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                if err > 2e-2:
                    raise AssertionError(f"{name} m={m} {bn, bk, warps, split}: relative error {err:.3g}")
                us = bc.device_time_us(lambda: triton_gemv(x, next_w(), bn, bk, warps, split), 40)
                if best is None or us < best[0]:
                    best = (us, (bn, bk, warps, split))
            nbytes = n * k * 2
            frac = lambda us: nbytes / us / 1e3 / bc.COPY_CEILING_GBS  # noqa: E731
            row = {"rows": m, "product": name, "N": n, "K": k, "per_token": per_token,
                   "cublas_us": cublas, "cublas_frac": frac(cublas), "triton_us": best[0],
                   "triton_frac": frac(best[0]), "triton_setting": best[1]}
            for be, f in row_kernels:  # forge's row_linear: the rule of tests/test_row_linear.py, then timed
                err = (f(x, ws[0]).float() - ref).abs().max().item() / ref.abs().max().item()
                if err > 2e-2:
                    raise AssertionError(f"forge {be} row_linear {name} m={m}: relative error {err:.3g}")
                row[f"forge_{be}_us"] = us = bc.device_time_us(lambda: f(x, next_w()), 40)
                row[f"forge_{be}_frac"] = frac(us)
            results.append(row)
            print("m=%d %-11s %6d x %5d  cuBLAS %7.1f us (%.2f)  triton %7.1f us (%.2f) at BN %d, BK %d, %d warps, split %d"
                  % (m, name, n, k, cublas, frac(cublas), best[0], frac(best[0]), *best[1])
                  + "".join(f"  forge {be} {row[f'forge_{be}_us']:.1f} us" for be, _ in row_kernels), flush=True)
            del ws
    for m in rows_list:
        rs = [r for r in results if r["rows"] == m and r["per_token"]]
        cub = sum(r["cublas_us"] * r["per_token"] for r in rs) / 1e3
        tri = sum(min(r["triton_us"], r["cublas_us"]) * r["per_token"] for r in rs) / 1e3
        forge_ms = {be: sum(r[f"forge_{be}_us"] * r["per_token"] for r in rs) / 1e3 for be, _ in row_kernels}
        print(f"rows {m}: one token's products (stacked q/k/v and gate/up, every layer + head): "
              f"cuBLAS {cub:.3f} ms, best of the two per product {tri:.3f} ms"
              + "".join(f", forge {be} {ms:.3f} ms" for be, ms in forge_ms.items()))
    bc.write_results(Path(os.environ.get("FORGE_BENCH_OUT", "forge-bench-results")), "gemv_bw", results,
                     case=f"{a.shape}-rows{a.rows.replace(',', '-')}")


if __name__ == "__main__":
    main()
