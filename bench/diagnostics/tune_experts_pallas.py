"""The MoE expert block's pieces, Pallas (natively launched) against Triton, at the
Qwen3-30B-A3B shape (hidden 2048, moe intermediate 768, 128 experts, top-8, 4096 tokens, bf16):
each piece's device time (CUDA events on torch's stream, median of 20), and the whole block's
forward + backward; with ``--sweep`` the Pallas grouped products at a few tile sizes.

    PYTHONPATH=. python bench/diagnostics/tune_experts_pallas.py [--sweep]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from forge import ops
from forge.spec import experts as X


def _time(fn, n=20):
    """Median device time (ms) of ``fn`` by CUDA events: flce_strategies' timer."""
    from flce_strategies import _time as event_time  # (a sibling script: this folder is on sys.path)

    return event_time(fn, n)


def _inputs(t=4096, h=2048, i=768, e=128, k=8, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    ids = torch.rand(t, e, generator=g, device=dev).topk(k, dim=1).indices
    v = dict(x=torch.randn(t, h, generator=g, device=dev).to(bf), ids=ids,
             scores=torch.rand(t, k, generator=g, device=dev).to(bf),
             gate_up=(torch.randn(e, 2 * i, h, generator=g, device=dev) * h ** -0.5).to(bf),
             down=(torch.randn(e, h, i, generator=g, device=dev) * i ** -0.5).to(bf))
    v["row_token"], v["offsets"], v["slot_rows"] = X.route(ids, e)
    s = t * k
    v["dy"] = torch.randn(s, h, generator=g, device=dev).to(bf)
    v["dgu"] = torch.randn(s, 2 * i, generator=g, device=dev).to(bf)
    v["dout"] = torch.randn(t, h, generator=g, device=dev).to(bf)
    return v


def _piece_calls(p, v):
    h, gu = p["glu_fwd"](v["x"], v["row_token"], v["offsets"], v["gate_up"], "silu")
    y = p["grouped_mm"](h, v["down"], v["offsets"])
    return {
        "glu_fwd": lambda: p["glu_fwd"](v["x"], v["row_token"], v["offsets"], v["gate_up"], "silu"),
        "grouped_mm (down)": lambda: p["grouped_mm"](h, v["down"], v["offsets"]),
        "unpermute": lambda: p["unpermute"](y, v["slot_rows"], v["scores"]),
        "unpermute_bwd": lambda: p["unpermute_bwd"](v["dout"], y, v["slot_rows"], v["scores"]),
        "glu_bwd": lambda: p["glu_bwd"](v["dy"], gu, v["offsets"], v["down"], "silu"),
        "grouped_mm_t (dx)": lambda: p["grouped_mm_t"](v["dgu"], v["gate_up"], v["offsets"]),
        "wgrad (down)": lambda: p["grouped_wgrad"](v["dy"], h, v["offsets"], None),
        "wgrad (gate_up)": lambda: p["grouped_wgrad"](v["dgu"], v["x"], v["offsets"], v["row_token"]),
    }


def _block(backend, v):
    fn = ops.get("experts", backend)
    xs = [v[n].clone().requires_grad_() for n in ("x", "scores", "gate_up", "down")]

    def run():
        out = fn(xs[0], v["ids"], xs[1], xs[2], xs[3])
        out.backward(v["dout"])

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    import bridge
    import forge_triton

    v = _inputs()
    res = {}
    for backend, mod in (("triton", forge_triton), ("pallas", bridge)):
        for name, fn in _piece_calls(mod.experts_pieces(), v).items():
            res.setdefault(name, {})[backend] = _time(fn)
        res.setdefault("block fwd+bwd", {})[backend] = _time(_block(backend, v), n=10)
    print(f"{'piece':24s} {'triton ms':>10s} {'pallas ms':>10s} {'pallas/triton':>14s}")
    for name, r in res.items():
        print(f"{name:24s} {r['triton']:10.3f} {r['pallas']:10.3f} {r['pallas'] / r['triton']:14.2f}")
    from bridge import native

    print("native:", {k: native.status()[k] for k in ("plans", "kernels", "declined")})
    if args.sweep:
        from forge_pallas import experts_kernels as K

        p = bridge.experts_pieces()
        for bm, bn, bk in itertools.product((64, 128), (64, 128), (32, 64)):
            K.BLOCK_M, K.BLOCK_N, K.BLOCK_K = bm, bn, bk
            import os
            import tempfile

            os.environ["FORGE_CACHE_DIR"] = tempfile.mkdtemp()  # (recipes on disk are keyed by the code, not the tiles)
            native.set_launcher(None)  # new plans for the new tiles
            calls = _piece_calls(p, v)
            ts = {n: _time(calls[n]) for n in ("glu_fwd", "grouped_mm (down)", "glu_bwd", "grouped_mm_t (dx)")}
            print(f"BM {bm} BN {bn} BK {bk}: " + "  ".join(f"{n} {t:.3f}" for n, t in ts.items()))


if __name__ == "__main__":
    main()
