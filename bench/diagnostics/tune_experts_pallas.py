"""The MoE expert block's pieces, Pallas (natively launched) against Triton, at the
Qwen3-30B-A3B shape (hidden 2048, moe intermediate 768, 128 experts, top-8, 4096 tokens, bf16):
each piece's device time (CUDA events on torch's stream, median of 20), and the whole block's
forward + backward; with ``--sweep-triton`` / ``--sweep`` each Triton / Pallas piece at the
candidate (tiles, warps, stages) of ``CANDIDATES`` (the best per kind printed last, for the
backends' ``TILES``, and with ``--best-out F`` written to F as JSON), against torch's
``_grouped_mm`` on the same rows (the products transformers' grouped_mm experts run);
``--shape qwen3`` or ``olmoe``, ``--tokens T`` for another token count. ``--few`` sweeps the
few-row tiles instead (``TILES_FEW``, the forward products of a decoding step: run it with a
decode's ``--tokens``, 1 to 32), each piece timed as a replay of a CUDA graph of 10 calls (a
launch from the host takes longer than such a product); with ``--copies N`` those calls cycle
through N copies of the expert weights, so that they come from HBM as in a model's step (with one
copy a decoding step's few experts stay in L2 between calls).

    PYTHONPATH=. python bench/diagnostics/tune_experts_pallas.py [--sweep] [--sweep-triton] [--few]
        [--tokens T] [--current] [--copies N] [--best-out F]
"""
from __future__ import annotations

import argparse
import itertools
import json

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
    if v.get("sets"):  # --copies: the forward products cycle through weight copies (see _rotating)
        return {
            "glu_fwd": _rotating(lambda w: p["glu_fwd"](v["x"], v["row_token"], v["offsets"], w[0], "silu"),
                                 v["sets"]),
            "grouped_mm (down)": _rotating(lambda w: p["grouped_mm"](h, w[1], v["offsets"]), v["sets"]),
        }
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


def _rotating(call, sets):
    """A call of ``call(w)`` on the next of ``sets`` (weight copies) each time. Captured in a
    graph, each captured call keeps its copy, so a replay reads each copy's weights once, from
    HBM, as a model's step reads each layer's: with one copy a decoding step's few experts (25-50
    MB) stay in the 50 MB L2 between calls and the timing reads above HBM's rate."""
    it = itertools.cycle(sets)
    return lambda: call(next(it))


def _block(backend, v):
    fn = ops.get("experts", backend)
    xs = [v[n].clone().requires_grad_() for n in ("x", "scores", "gate_up", "down")]

    def run():
        out = fn(xs[0], v["ids"], xs[1], xs[2], xs[3])
        out.backward(v["dout"])

    return run


SHAPES = {"qwen3": dict(h=2048, i=768, e=128, k=8), "olmoe": dict(h=2048, i=1024, e=64, k=8)}
# (rows, columns, reduction step, warps, stages) per kind, for both backends' TILES (the weight
# gradient's: output rows, output columns, group rows per step)
CANDIDATES = {
    "plain": [(64, 64, 32, 4, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3),
              (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 256, 32, 8, 4)],
    "glu": [(64, 64, 32, 4, 3), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3),
            (128, 128, 32, 8, 4), (128, 64, 64, 4, 4)],
    "glu_bwd": [(64, 64, 32, 4, 3), (64, 128, 64, 4, 4), (64, 128, 64, 4, 3), (64, 128, 64, 8, 4),
                (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (64, 128, 32, 4, 4)],
    "wgrad": [(64, 64, 32, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
              (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 128, 64, 4, 3)],
}
FEW_CANDIDATES = {  # (the last: the wide tiles before TILES_FEW, for comparison)
    "plain": [(16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 128, 64, 4, 4), (16, 64, 64, 4, 6),
              (16, 32, 256, 4, 3), (16, 32, 128, 2, 4), (16, 16, 256, 2, 4), (64, 128, 64, 4, 4)],
    "glu": [(16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 128, 64, 4, 4), (16, 64, 64, 4, 6),
            (16, 32, 256, 4, 3), (16, 32, 128, 2, 4), (16, 16, 256, 2, 4), (128, 128, 64, 8, 4)],
}
FEW_PIECES = ("glu_fwd", "grouped_mm (down)")
PIECES = {"plain": ("grouped_mm (down)", "grouped_mm_t (dx)"), "glu": ("glu_fwd",), "glu_bwd": ("glu_bwd",),
          "wgrad": ("wgrad (down)", "wgrad (gate_up)")}


def _flops(v):
    s, h = v["row_token"].shape[0], v["x"].shape[1]
    two_i = v["gate_up"].shape[1]
    f = {"glu_fwd": 2 * s * h * two_i, "grouped_mm (down)": s * h * two_i}
    f["grouped_mm_t (dx)"], f["wgrad (gate_up)"] = f["glu_fwd"], f["glu_fwd"]
    f["glu_bwd"], f["wgrad (down)"] = f["grouped_mm (down)"], f["grouped_mm (down)"]
    return f


def _grouped_mm_reference(v, flops):
    """torch._grouped_mm on the same rows: the products transformers' grouped_mm experts run."""
    if not hasattr(torch, "_grouped_mm"):
        return
    xg = v["x"][v["row_token"].long()]
    h = torch.randn(xg.shape[0], v["down"].shape[2], device="cuda", dtype=xg.dtype)
    ref = {"glu_fwd": lambda: torch._grouped_mm(xg, v["gate_up"].transpose(1, 2), offs=v["offsets"]),
           "grouped_mm (down)": lambda: torch._grouped_mm(h, v["down"].transpose(1, 2), offs=v["offsets"]),
           "grouped_mm_t (dx)": lambda: torch._grouped_mm(v["dgu"], v["gate_up"], offs=v["offsets"])}
    for name, fn in ref.items():
        try:
            t = _time(fn)
        except Exception as exc:  # (a layout torch's kernel does not take)
            print(f"torch._grouped_mm {name}: failed {type(exc).__name__}: {str(exc)[:120]}")
            continue
        print(f"torch._grouped_mm {name:20s} {t:8.3f} ms  {flops[name] / t / 1e9:6.0f} TFLOP/s")


def _time_graph(fn, n=10, reps=5):
    """Median device time (ms) of one call of ``fn``, replayed from a CUDA graph of ``n`` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    return sorted(times)[len(times) // 2]


def _sweep(backend, v, few=False, current=False):
    """Each piece of ``backend`` at each candidate of its kind (the other kinds at their TILES);
    ``few``: the few-row tiles (TILES_FEW) of the forward products, timed from graphs;
    ``current``: only the tiles in use (to compare two versions of the code, run from each tree)."""
    if backend == "triton":
        import forge_triton
        from forge_triton import experts as tiles_mod

        pieces = forge_triton.experts_pieces
    else:
        import os
        import tempfile

        import bridge
        from bridge import core, native
        from forge_pallas import experts_kernels as tiles_mod

        pieces = bridge.experts_pieces
    flops = _flops(v)
    _grouped_mm_reference(v, flops)
    table = tiles_mod.TILES_FEW if few else tiles_mod.TILES
    base = dict(table)
    timer = _time_graph if few else _time
    best = {}
    for kind, cands in (FEW_CANDIDATES if few else CANDIDATES).items():
        for cfg in [table[kind]] if current else cands:
            table[kind] = cfg
            if backend == "pallas":  # forget every trace of the last tiles: the recipes on disk (keyed
                os.environ["FORGE_CACHE_DIR"] = tempfile.mkdtemp()  # by the code), the native plans,
                native.set_launcher(None)  # the bridge's jitted passes and JAX's own trace caches
                core.forget_traces()
            try:
                calls = _piece_calls(pieces(), v)
                ts = {n: timer(calls[n]) for n in PIECES[kind] if not few or n in FEW_PIECES}
            except Exception as exc:  # (a config past the shared memory or registers: reported, skipped)
                print(f"{backend} {kind} {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")
                continue
            finally:
                table.update(base)
            total = sum(ts.values())
            if kind not in best or total < best[kind][1]:
                best[kind] = (cfg, total)
            print(f"{backend} {kind} {cfg}: " + "  ".join(f"{n} {t:.3f} ms ({flops[n] / t / 1e9:.0f} TF/s)"
                                                          for n, t in ts.items()))
    if backend == "pallas":
        print("pallas native:", {k: native.status()[k] for k in ("plans", "kernels", "declined")})
    if few:
        bytes_ = {"glu_fwd": v["gate_up"], "grouped_mm (down)": v["down"]}
        hit = v["offsets"].diff(prepend=v["offsets"].new_zeros(1)).gt(0).sum().item()
        for kind, (cfg, t) in best.items():
            moved = sum(bytes_[n][0].numel() * 2 * hit for n in PIECES[kind] if n in FEW_PIECES)
            print(f"{backend} {kind} best {cfg}: {moved / t / 1e6:.0f} GB/s of the {hit} experts' weights")
    print(f"{backend} best: " + ", ".join(f"{k} {c} ({t:.3f} ms)" for k, (c, t) in best.items()))
    return {k: c for k, (c, _) in best.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="the Pallas pieces at each candidate tile")
    ap.add_argument("--sweep-triton", action="store_true", help="the Triton pieces at each candidate tile")
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, help="tokens (default 4096)")
    ap.add_argument("--few", action="store_true", help="sweep the few-row tiles (TILES_FEW), timed from graphs")
    ap.add_argument("--current", action="store_true", help="with a sweep: time only the tiles in use")
    ap.add_argument("--copies", type=int, default=1,
                    help="with --few: cycle the forward products through this many copies of the expert "
                         "weights (8 or more: each call reads them from HBM, not L2)")
    ap.add_argument("--best-out", help="write the sweeps' best tiles per backend and kind here (JSON)")
    args = ap.parse_args()
    v = _inputs(**SHAPES[args.shape], **({"t": args.tokens} if args.tokens else {}))
    if args.copies > 1:
        if not args.few:
            ap.error("--copies applies to --few (the forward products of a decoding step)")
        v["sets"] = [(v["gate_up"].clone(), v["down"].clone()) for _ in range(args.copies)]
    if args.sweep_triton or args.sweep:
        backends = ("triton",) * args.sweep_triton + ("pallas",) * args.sweep
        best = {b: _sweep(b, v, args.few, args.current) for b in backends}
        if args.best_out:
            with open(args.best_out, "w") as f:
                json.dump(best, f)
        return
    import bridge
    import forge_triton

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


if __name__ == "__main__":
    main()
