"""The fp32 one-row LoRA q/k/v case (tests/test_lora_dropout.py, ``one_row-float32-bias-r8``),
over many seeds: each gradient's relative error against float64 for the kernel (Triton and
Pallas, with and without dropout) and for eager fp32, and how often the oracle's bound
(2 x eager + atol) is passed. Tells a kernel less accurate than eager (its errors larger on
average) from a bound that one seed's eager error makes tight (same averages).

    PYTHONPATH=.:tests python bench/diagnostics/diag_lora_one_row.py [--seeds 200]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from forge import ops
from forge.spec import lora_qkv as qkv_spec
from forge.spec import tolerance
from oracle import _backward, _forward
from test_lora import ONE_ROW, qkv_case
from test_lora_dropout import QKV_DROP, with_dropout


def _grads(fn, case, grads_out, to=None):
    outs, leaves = _forward(fn, case["tensors"], case["diff"], case["kwargs"], to=to)
    return _backward(outs, leaves, case["diff"], grads_out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", default="triton,pallas")
    args = ap.parse_args()
    dev = args.device
    for backend in args.backends.split(","):
        for drop in (False, True):
            errs = {}  # name -> [(kernel, eager, bound)]
            for s in range(args.seeds):
                torch.manual_seed(s)
                case = qkv_case(ONE_ROW["qkv"], 8, True, torch.float32, dev)
                if drop:
                    case = with_dropout(case, QKV_DROP, dev)
                ref_outs, ref_leaves = _forward(qkv_spec.reference, case["tensors"], case["diff"], case["kwargs"],
                                                to=(dev, torch.float64))
                g = [torch.randn(o.shape, dtype=torch.float64, device=dev) for o in ref_outs]
                ref = _backward(ref_outs, ref_leaves, case["diff"], g)
                eag = _grads(qkv_spec.reference, case, g)
                ker = _grads(ops.get("lora_qkv", backend), case, g)
                for n in case["diff"]:
                    e_k = tolerance.rel_err(ker[n], ref[n])
                    e_e = tolerance.rel_err(eag[n], ref[n])
                    b = tolerance.bound(e_e, torch.float32, case["reductions"].get(n, 1))
                    errs.setdefault(n, []).append((e_k, e_e, b))
            print(f"== {backend} dropout={drop} ({args.seeds} seeds)")
            for n, v in errs.items():
                k = [a for a, _, _ in v]
                e = [b for _, b, _ in v]
                fails = sum(a > c for a, _, c in v)
                print(f"  d{n:6s} kernel mean {statistics.mean(k):.3e} max {max(k):.3e} | eager mean "
                      f"{statistics.mean(e):.3e} max {max(e):.3e} | over bound {fails}/{len(v)}")


if __name__ == "__main__":
    main()
