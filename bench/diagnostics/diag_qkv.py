"""Device time of a decoder layer's q/k/v projections, forward + backward (CUDA): three
``F.linear`` calls (what transformers runs) against one product over the three weights
concatenated (``torch.cat`` of the weights and biases, one ``F.linear``, the result split into
three views), at a model's attention widths; the kernels of each, by name.

Prints only. The defaults are Qwen2.5-0.5B's (hidden 896, 14 query heads and 2 key/value heads
of 64, biases), bf16.

    python bench/diagnostics/diag_qkv.py [--rows 4096,16384] [--hidden 896 --q 896 --kv 128] [--no-bias]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _common as bc  # noqa: E402


def _separate(x, ws, bs):
    return [F.linear(x, w, b) for w, b in zip(ws, bs)]


def _fused(x, ws, bs):
    y = F.linear(x, torch.cat(ws), None if bs[0] is None else torch.cat(bs))
    return y.split([w.shape[0] for w in ws], dim=-1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="4096,16384")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--q", type=int, default=896)
    p.add_argument("--kv", type=int, default=128)
    p.add_argument("--no-bias", action="store_true")
    a = p.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    rows = []
    for n in map(int, a.rows.split(",")):
        x = torch.randn(n, a.hidden, device=dev, dtype=dt, requires_grad=True)
        ws = [torch.randn(o, a.hidden, device=dev, dtype=dt, requires_grad=True) * 0.02 for o in (a.q, a.kv, a.kv)]
        ws = [w.detach().requires_grad_() for w in ws]
        bs = [None if a.no_bias else torch.zeros(w.shape[0], device=dev, dtype=dt, requires_grad=True) for w in ws]
        gs = [torch.randn(n, w.shape[0], device=dev, dtype=dt) for w in ws]
        for name, fn in (("three products", _separate), ("one product", _fused)):
            def fwd():
                return fn(x, ws, bs)

            def both():
                torch.autograd.backward(fn(x, ws, bs), gs)
                for t in [x] + ws + [b for b in bs if b is not None]:
                    t.grad = None

            rows.append({"rows": n, "variant": name, "fwd_us": round(bc.device_time_us(fwd), 1),
                         "fwd_bwd_us": round(bc.device_time_us(both), 1)})
    bc.print_table(rows, ["rows", "variant", "fwd_us", "fwd_bwd_us"])


if __name__ == "__main__":
    main()
