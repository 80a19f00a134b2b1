"""Calibrate the per-call guard: for each shape-sensitive kernel and backend, sweep the elements
per call and find the crossover above which the fused kernel beats eager torch.

A 24-layer model makes ~1,400 kernel calls per forward, back to back, so each point times a
stream of calls (host time and device time overlap: the slower one shows), forward only
("infer") and forward + backward ("train"). The crossover is the smallest size from which the
fused call is at least as fast as eager at every larger size of the sweep; the larger of the two
modes becomes the default in forge.MIN_FUSED_ELEMENTS.

    python bench/bench_guard.py [--backends triton,pallas] [--kernels ...] [--quick]

Writes bench_guard-<kernels>-<device>.{json,csv} into --out (one result per set of kernels swept).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import _common as bc  # noqa: E402
from bench_backends import _case, _impl  # noqa: E402

# per kernel: (label of the swept dimension, make shape from the swept value, values)
SWEEPS = {
    "rmsnorm": ("rows x 896", lambda r: (r, 896), [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]),
    "swiglu": ("rows x 4864", lambda r: (r, 4864), [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192, 16384]),
    "geglu": ("rows x 4864", lambda r: (r, 4864), [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192, 16384]),
    "rope": ("seq (1,14,2,S,64)", lambda s: (1, 14, 2, s, 64), [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]),
    # the whole MLP (896 -> 4864 -> 896, silu): what the swiglu/geglu key runs in train mode;
    # elements are rows x 4864, the guard's metric for those keys
    "gated_mlp": ("rows x 4864 (MLP)", lambda r: (r, 896, 4864), [1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384]),
}


def _stream(fn, inputs, diff, train, calls):
    """A closure running ``calls`` calls back to back (forward, or forward + backward)."""
    leaves = [t.detach().clone().requires_grad_(train and i in diff) for i, t in enumerate(inputs)]
    if not train:
        def run():
            with torch.no_grad():
                for _ in range(calls):
                    fn(*leaves)
    else:
        def run():
            for _ in range(calls):
                out = fn(*leaves)
                outs = out if isinstance(out, tuple) else (out,)
                torch.autograd.grad(outs, [leaves[i] for i in diff], [torch.ones_like(o) for o in outs])
    return run


def _pair_us(eager_fn, fn, inputs, diff, train, calls, reps=7):
    """(eager, fused) us per call, medians over ``reps`` alternating measurements: this host's
    speed drifts by tens of percent within a minute, so the two are never timed apart."""
    runs = [_stream(f, inputs, diff, train, calls) for f in (eager_fn, fn)]
    for r in runs:
        r(), r()
    bc.sync()
    out = ([], [])
    for _ in range(reps):
        for r, acc in zip(runs, out):
            t0 = time.perf_counter()
            r()
            bc.sync()
            acc.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(out[0]), statistics.median(out[1])


def crossover(sizes, eager, fused):
    """Smallest size from which fused <= eager at every larger size (None if never)."""
    best = None
    for s, e, f in reversed(list(zip(sizes, eager, fused))):
        if f <= e:
            best = s
        else:
            break
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="triton,pallas")
    p.add_argument("--kernels", default=",".join(SWEEPS))
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--quick", action="store_true")
    bc.add_out_argument(p)
    a = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows, summary = [], []
    for key in a.kernels.split(","):
        label, make, values = SWEEPS[key]
        if a.quick:
            values, a.calls = values[:2], 1
        eager_fn = _impl(key, "eager")
        for be in a.backends.split(","):
            fn = _impl(key, be)
            if fn is None:
                summary.append({"kernel": key, "backend": be, "note": "backend unavailable"})
                continue
            per_mode = {}
            for mode in ("infer", "train"):
                e_t, f_t, elems = [], [], []
                for v in bc.progress(values, f"{key} {be} {mode}"):
                    inputs, diff, _, _ = _case(key, make(v), dtype, dev)
                    n = inputs[0].numel() + (inputs[1].numel() if key == "rope" else 0)
                    if key == "gated_mlp":
                        n = inputs[0].shape[0] * inputs[1].shape[0]
                    e, f = _pair_us(eager_fn, fn, inputs, diff, mode == "train", a.calls, 1 if a.quick else 7)
                    e_t.append(e), f_t.append(f), elems.append(n)
                    rows.append({"kernel": key, "backend": be, "mode": mode, label: v, "elements": n,
                                 "eager_us": e, "fused_us": f, "speedup": e / f})
                per_mode[mode] = crossover(elems, e_t, f_t)
            known = [v for v in per_mode.values() if v is not None]
            summary.append({"kernel": key, "backend": be, "crossover_infer": per_mode["infer"],
                            "crossover_train": per_mode["train"],
                            "min_fused_elements": max(known) if len(known) == 2 else None})
    bc.print_table(rows, ["kernel", "backend", "mode", "elements", "eager_us", "fused_us", "speedup"])
    print()
    bc.print_table(summary, ["kernel", "backend", "crossover_infer", "crossover_train", "min_fused_elements", "note"])
    # the defaults this sweep suggests, in forge.MIN_FUSED_ELEMENTS's per-mode form (the smallest
    # swept size counts as 0: fused from the first call; no crossover: NEVER)
    suggest = {}
    for srow in summary:
        for mode in ("infer", "train"):
            c = srow.get(f"crossover_{mode}", "missing")
            if c == "missing":
                continue
            smallest = min(r["elements"] for r in rows if r["kernel"] == srow["kernel"])
            val = "NEVER" if c is None else (0 if c == smallest else c)
            suggest.setdefault(srow["backend"], {}).setdefault(mode, {})[srow["kernel"]] = val
    print("suggested forge.MIN_FUSED_ELEMENTS:", suggest)
    # one result per set of kernels swept: a sweep of one kernel keeps the others' latest
    bc.write_results(a.out, "bench_guard", rows, {"summary": summary, "suggested_min_fused_elements": suggest},
                     case="-".join(sorted(a.kernels.split(","))))
    return summary


if __name__ == "__main__":
    main()
