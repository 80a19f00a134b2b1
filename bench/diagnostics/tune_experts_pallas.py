"""The MoE expert block's pieces, Pallas (natively launched) against Triton, at the
Qwen3-30B-A3B shape (hidden 2048, moe intermediate 768, 128 experts, top-8, 4096 tokens, bf16):
each piece's device time (CUDA events on torch's stream, median of 20), and the whole block's
forward + backward; with ``--sweep`` the Pallas grouped products at a few tile sizes, with
``--sweep-triton`` each Triton piece at a few (tiles, warps, stages), against torch's
``_grouped_mm`` on the same rows (the products transformers' grouped_mm experts run).

    PYTHONPATH=. python bench/diagnostics/tune_experts_pallas.py [--sweep] [--sweep-triton]
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


SHAPES = {"qwen3": dict(h=2048, i=768, e=128, k=8), "olmoe": dict(h=2048, i=1024, e=64, k=8)}
TRITON_CANDIDATES = {
    "plain": [(64, 64, 32, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
              (128, 64, 64, 4, 4), (128, 256, 64, 8, 3), (64, 64, 64, 4, 4)],
    "glu": [(64, 64, 32, 4, 3), (64, 64, 64, 4, 4), (128, 64, 64, 8, 3), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3),
            (128, 64, 64, 4, 4)],
    "wgrad": [(64, 64, 32, 4, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 64, 64, 4, 4),
              (64, 128, 64, 4, 4), (128, 128, 64, 4, 3)],
}
TRITON_PIECES = {"plain": ("grouped_mm (down)", "grouped_mm_t (dx)"), "glu": ("glu_fwd",), "wgrad": (
    "wgrad (down)", "wgrad (gate_up)")}


def _sweep_triton(v):
    """Each Triton piece at each candidate config; torch._grouped_mm on the same products."""
    import forge_triton
    from forge_triton import experts as T

    calls = _piece_calls(forge_triton.experts_pieces(), v)
    xg = v["x"][v["row_token"].long()]
    gu_t, down_t = v["gate_up"].transpose(1, 2), v["down"].transpose(1, 2)
    h = torch.randn(xg.shape[0], v["down"].shape[2], device="cuda", dtype=xg.dtype)
    s = xg.shape[0]
    flops = {"glu_fwd": 2 * s * xg.shape[1] * v["gate_up"].shape[1], "grouped_mm (down)": 2 * s * h.shape[1] * xg.shape[1]}
    flops["grouped_mm_t (dx)"] = flops["glu_fwd"]
    flops["glu_bwd"] = flops["grouped_mm (down)"]
    flops["wgrad (down)"], flops["wgrad (gate_up)"] = flops["grouped_mm (down)"], flops["glu_fwd"]
    if hasattr(torch, "_grouped_mm"):
        ref = {"glu_fwd": lambda: torch._grouped_mm(xg, gu_t, offs=v["offsets"]),
               "grouped_mm (down)": lambda: torch._grouped_mm(h, down_t, offs=v["offsets"]),
               "grouped_mm_t (dx)": lambda: torch._grouped_mm(v["dgu"], v["gate_up"], offs=v["offsets"])}
        for name, fn in ref.items():
            try:
                t = _time(fn)
            except Exception as exc:  # (a layout torch's kernel does not take)
                print(f"torch._grouped_mm {name}: failed {type(exc).__name__}: {str(exc)[:120]}")
                continue
            print(f"torch._grouped_mm {name:20s} {t:8.3f} ms  {flops[name] / t / 1e9:6.0f} TFLOP/s")
    base = dict(T.TILES)
    for kind, cands in TRITON_CANDIDATES.items():
        pieces = TRITON_PIECES[kind] + (("glu_bwd",) if kind == "plain" else ())
        for cfg in cands:
            T.TILES.update({kind: cfg, **({"glu_bwd": cfg} if kind == "plain" else {})})
            try:
                ts = {n: _time(calls[n]) for n in pieces}
            except Exception as exc:  # (a config past the shared memory or registers: reported, skipped)
                print(f"{kind} {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")
                continue
            finally:
                T.TILES.update(base)
            print(f"{kind} {cfg}: " + "  ".join(f"{n} {t:.3f} ms ({flops[n] / t / 1e9:.0f} TF/s)"
                                                  for n, t in ts.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-triton", action="store_true")
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    args = ap.parse_args()
    if args.sweep_triton:
        return _sweep_triton(_inputs(**SHAPES[args.shape]))
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
