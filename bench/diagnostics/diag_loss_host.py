"""Host time of the fused loss's forward (which forms its gradients too), per strategy, eager
against the same call inside a torch.compile'd function (where it runs as a forge op) (CUDA):

- ``host``: time to enqueue the call while the device is still busy with a sleep kernel queued
  first (no wait on the device in it), median and minimum over ``--reps`` calls, and the same
  with Python's garbage collector off;
- ``device``: the call's device time between two events (its host time is shorter, so no gap);
- one call of each under cProfile: the functions with the most own time. (cProfile charges
  the op's Python kernel, called back from the dispatcher, with its callee's time as well: read
  its cumulative time and its callee's, not its own.)

Prints only. The defaults are train 4x1024 of Qwen2.5-0.5B (4096 x 896, vocabulary 151936).

    python bench/diagnostics/diag_loss_host.py [--rows 4096 --hidden 896 --vocab 151936] [--backend triton]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers

import torch  # noqa: E402

from diag_compile_host import SLEEP_CYCLES  # noqa: E402  (the same sleep ahead of each enqueue)
from forge import ops  # noqa: E402
from forge.spec import fused_linear_ce as spec  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--backend", default="triton")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--top", type=int, default=14)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("diag_loss_host needs CUDA (it times enqueues behind a device sleep)")
    n, hd, v = a.rows, a.hidden, a.vocab
    flce = ops.get("fused_linear_ce", a.backend)
    h = torch.randn(n, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, hd, device="cuda") * hd**-0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")

    def f(h, w, y, **kw):
        return flce(h, w, y, **kw)

    cf = torch.compile(f)

    def run(fn, **kw):
        fn(h, w, y, **kw).backward()
        h.grad = w.grad = None

    def host(fn, nogc=False, **kw):
        ts = []
        for _ in range(a.reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
            if nogc:
                gc.disable()
            t0 = time.perf_counter()
            loss = fn(h, w, y, **kw)
            t1 = time.perf_counter()
            gc.enable()
            torch.cuda.synchronize()
            loss.backward()
            h.grad = w.grad = None
            ts.append((t1 - t0) * 1e3)
        return statistics.median(ts), min(ts)

    def device(fn, **kw):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(5):
            run(fn, **kw)
            torch.cuda.synchronize()
            s.record()
            loss = fn(h, w, y, **kw)
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
            loss.backward()
            h.grad = w.grad = None
        return statistics.median(ts)

    for fn in (f, cf):
        for _ in range(3):
            run(fn)
    torch.cuda.synchronize()
    rows = spec.row_chunk(n, v) or spec.ROW_CHUNK_MIN
    narrow = spec.tile_width(n, v, logits_fraction=1 / 16)
    cases = [("eager, default", f, {}), (f"eager, tiles of {narrow}", f, {"tile_vocab": narrow}),
             (f"eager, row chunks of {rows}", f, {"chunk_rows": rows}), ("compiled, default", cf, {})]
    print(f"fused loss forward {n} x {hd} x {v} ({a.backend}): ms; host median / min over {a.reps} calls")
    print(f"{'call':32s} {'host':>7s} {'min':>7s} {'gc off':>7s} {'min':>7s} {'device':>7s}")
    for name, fn, kw in cases:
        on, off = host(fn, **kw), host(fn, nogc=True, **kw)
        print(f"{name:32s} {on[0]:7.2f} {on[1]:7.2f} {off[0]:7.2f} {off[1]:7.2f} {device(fn, **kw):7.2f}", flush=True)
    for name, fn in (("eager", f), ("compiled", cf)):
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        prof.enable()
        loss = fn(h, w, y)
        prof.disable()
        torch.cuda.synchronize()
        loss.backward()
        h.grad = w.grad = None
        st = pstats.Stats(prof)
        st.calc_callees()
        total = sum(s[2] for s in st.stats.values()) * 1e3
        print(f"\n== {name}: cProfile own time {total:.2f} ms in one call; top own time:")
        for (fl, ln, fnm), s in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:a.top]:
            print(f"   {s[2] * 1e3:8.3f} ms {s[1]:5d} x {Path(fl).name}:{ln}:{fnm}")
            if fnm == "backend_impl":
                for (cfl, cln, cfn), cs in st.all_callees[(fl, ln, fnm)].items():
                    print(f"              its callee {Path(cfl).name}:{cln}:{cfn}: cumulative {cs[3] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
