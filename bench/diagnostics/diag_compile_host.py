"""Where a compiled training step's host time goes, forge then torch.compile against
torch.compile alone (CUDA): for each variant, side by side in rounds,

- ``wall``: a synchronised step (forward, backward, grads dropped), median per round;
- ``fwd_host`` / ``bwd_host``: the host time to enqueue the forward / the backward while the
  device is still busy with a long sleep kernel queued first, so no wait on the device is in it
  (``blocked`` counts the enqueues that outlasted the sleep: a host sync or a full launch queue);
- one step under cProfile (each half behind a sleep the same way): the functions with the
  most own time;
- one step under ``torch.cuda.set_sync_debug_mode("warn")``: the host syncs it makes.

``--rows`` adds, for each forge variant, the same step with the fused loss's row chunks forced
(``spec.ROW_CHUNK_MIN = 0``) instead of its vocabulary tiles: the op is opaque to the trace, so
the same compiled graph runs. Prints only.

    python bench/diagnostics/diag_compile_host.py --mode train --batch 4 --seq-len 1024 \
        [--variants compile,forge+compile,forge-min0+compile] [--rows]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import _common as bc  # noqa: E402
import forge  # noqa: E402
from bench_compile import _patch_kw  # noqa: E402
from forge.spec import fused_linear_ce as flce_spec  # noqa: E402
from presets import PRESETS, add_step_arguments, build  # noqa: E402

SLEEP_CYCLES = 400_000_000  # about 0.2 s at the H200's clock: longer than any enqueue here


def _drop_grads(model):
    for p in model.parameters():
        p.grad = None


def _enqueue_times(target, model, ids):
    """(fwd_host_ms, bwd_host_ms, blocked): each half enqueued behind a sleep kernel."""
    blocked = 0
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    done = torch.cuda.Event()
    done.record()
    t0 = time.perf_counter()
    loss = target(input_ids=ids, labels=ids).loss
    t1 = time.perf_counter()
    blocked += done.query()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    done = torch.cuda.Event()
    done.record()
    t2 = time.perf_counter()
    loss.backward()
    _drop_grads(model)
    t3 = time.perf_counter()
    blocked += done.query()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3, (t3 - t2) * 1e3, blocked


def _wall(target, model, ids):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    target(input_ids=ids, labels=ids).loss.backward()
    _drop_grads(model)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _cprofile(target, model, ids, top):
    """One step under cProfile, each half enqueued behind a sleep kernel (the whole step's
    launches can outnumber the launch queue, and a launch into a full queue waits for the
    device): (own time ms, top functions by own time)."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    prof.enable()
    loss = target(input_ids=ids, labels=ids).loss
    prof.disable()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    prof.enable()
    loss.backward()
    _drop_grads(model)
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own (total) time
    total = sum(v[2] for v in st.stats.values())
    return total * 1e3, [(f"{Path(f).name}:{ln}:{fn}", v[1], v[2] * 1e3) for (f, ln, fn), v in rows]


def _syncs(target, model, ids):
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            target(input_ids=ids, labels=ids).loss.backward()
            _drop_grads(model)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return [str(w.message).splitlines()[0][:120] for w in caught if "synchroniz" in str(w.message)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_arguments(p)
    p.add_argument("--variants", default="compile,forge+compile")
    p.add_argument("--rows", action="store_true", help="also each forge variant with the loss's row chunks forced")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=16)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("diag_compile_host needs CUDA (it times enqueues behind a device sleep)")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, PRESETS[a.model]["vocab_size"], (a.batch, a.seq_len), generator=g).to(dev)
    runs = {}
    for name in a.variants.split(","):
        torch.manual_seed(0)
        model = build(a.model, dtype, dev, layers=a.layers)
        model.train(True)
        kw = _patch_kw(name)
        if kw is not None:
            forge.patch(model, mode="train", **kw)
        target = torch.compile(model) if "compile" in name else model
        t0 = time.perf_counter()
        for _ in range(3):
            _wall(target, model, ids)
        print(f"ready: {name} ({time.perf_counter() - t0:.1f} s with compile)", flush=True)
        runs[name] = (target, model)
        if kw is not None and a.rows:
            runs[name + " [rows]"] = (target, model)
    default_min = flce_spec.ROW_CHUNK_MIN
    res = {n: {"wall": [], "fwd": [], "bwd": [], "blocked": 0} for n in runs}
    for _ in range(a.rounds):
        for name, (target, model) in runs.items():
            flce_spec.ROW_CHUNK_MIN = 0 if name.endswith("[rows]") else default_min
            _wall(target, model, ids)
            r = res[name]
            r["wall"].append(statistics.median(_wall(target, model, ids) for _ in range(a.steps)))
            f, b, blk = zip(*(_enqueue_times(target, model, ids) for _ in range(2)))
            r["fwd"].append(statistics.median(f))
            r["bwd"].append(statistics.median(b))
            r["blocked"] += sum(blk)
    ref = res[next(iter(res))]["wall"]
    print(f"\n{a.model} train {a.batch}x{a.seq_len}: ms, medians over {a.rounds} rounds "
          f"(vs first: its wall over this one's, per round)")
    print(f"{'variant':34s} {'wall':>7s} {'vs_first':>9s} {'fwd_host':>9s} {'bwd_host':>9s} {'blocked':>8s}")
    for name, r in res.items():
        ratio = statistics.median(x / y for x, y in zip(ref, r["wall"]))
        print(f"{name:34s} {statistics.median(r['wall']):7.2f} {ratio:9.3f} {statistics.median(r['fwd']):9.2f} "
              f"{statistics.median(r['bwd']):9.2f} {r['blocked']:8d}")
    for name, (target, model) in runs.items():
        flce_spec.ROW_CHUNK_MIN = 0 if name.endswith("[rows]") else default_min
        total, top = _cprofile(target, model, ids, a.top)
        print(f"\n== {name}: cProfile own time {total:.1f} ms in one step (device busy); top own time:")
        for k, calls, ms in top:
            print(f"   {ms:8.3f} ms {calls:6d} x {k}")
        syncs = _syncs(target, model, ids)
        print(f"   host syncs in one step: {len(syncs)}", *sorted(set(syncs))[:5], sep="\n     ")
    flce_spec.ROW_CHUNK_MIN = default_min


if __name__ == "__main__":
    main()
