"""What a Pallas call costs: host time per call, natively launched (bridge/native/) and through
JAX and DLPack, against forge's Triton call, per kernel, with the DLPack path's parts (torch->jax
import, jit dispatch, jax->torch export); and the Pallas kernels' device time against Triton's,
forward and backward, at the GPU shapes of forge/spec/shapes.py (torch.profiler with CUDA
activity: it sees JAX's kernels on JAX's stream too).

    python bench/bench_bridge_overhead.py [--kernels rmsnorm,swiglu,geglu,rope] [--quick]

Writes bench_bridge_overhead-<device>.{json,csv} into --out (date, GPU, versions, command in the
JSON). --quick: a smoke test of the script (under a minute on a CPU, where both backends run in their
interpreters): one tiny shape per kernel, each call timed once; its numbers measure nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import _common as bc  # noqa: E402
from forge import ops  # noqa: E402
from forge.spec import shapes  # noqa: E402

KERNELS = ("rmsnorm", "swiglu", "geglu", "rope")
# how often each call runs: (iterations, warm-up calls, alternating rounds) for the host rows and
# (iterations, warm-up calls) for the device rows; --quick runs every call as few times as it can
FULL = {"host": (200, 5, 7), "device": (30, 5)}
QUICK = {"host": (1, 1, 1), "device": (1, 1)}
COLUMNS = ["kernel", "measure", "shape", "dtype", "triton_us", "pallas_us", "ratio", "pallas_dlpack_us",
           "pallas_GBs", "pallas_frac_ceiling", "note"]


def _inputs(key, shape, dtype, dev):
    """(args, kwargs, differentiable positions, bytes moved fwd, bytes moved bwd)."""
    es = torch.tensor([], dtype=dtype).element_size()
    if key == "rmsnorm":
        m, n = shape
        x, w = torch.randn(m, n, device=dev, dtype=dtype), torch.randn(n, device=dev, dtype=dtype)
        return (x, w), {}, (0, 1), es * 2 * m * n + 4 * m, es * 3 * m * n + 4 * m
    if key in ("swiglu", "geglu"):
        m, n = shape
        g, u = (torch.randn(m, n, device=dev, dtype=dtype) for _ in range(2))
        return (g, u), {}, (0, 1), es * 3 * m * n, es * 5 * m * n
    b, hq, hk, s, d = shape
    # HF's layout: (B, S, H, D) projections seen through a transpose
    q = torch.randn(b, s, hq, d, device=dev, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, s, hk, d, device=dev, dtype=dtype).transpose(1, 2)
    cos, sin = torch.randn(b, s, d, device=dev, dtype=dtype), torch.randn(b, s, d, device=dev, dtype=dtype)
    qk = es * b * s * d * (hq + hk)
    return (q, k, cos, sin), {}, (0, 1), 2 * qk + 2 * es * b * s * d, 2 * qk + 2 * es * b * s * d


def _fwd(fn, args, kwargs):
    def run():
        with torch.no_grad():
            fn(*args, **kwargs)
    return run


def _bwd(fn, args, kwargs, diff):
    leaves = [a.detach().requires_grad_(i in diff) for i, a in enumerate(args)]
    outs = fn(*leaves, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]
    wrt = [leaves[i] for i in diff]
    return lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True)


def _fwd_bwd(fn, args, kwargs, diff):
    leaves = [a.detach().requires_grad_(i in diff) for i, a in enumerate(args)]

    def run():
        outs = fn(*leaves, **kwargs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.grad(outs, [leaves[i] for i in diff], [torch.ones_like(o) for o in outs])
    return run


def _alternating(a, b, iters, warmup, rounds):
    """Medians of host us per call of ``a`` and ``b``, timed in alternating rounds: a host's
    speed drifts within seconds, so the two are timed side by side, many times."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(bc.wall_us(a, iters=iters, warmup=warmup, reps=1))
        tb.append(bc.wall_us(b, iters=iters, warmup=warmup, reps=1))
    return statistics.median(ta), statistics.median(tb)


def _table(key, quick):
    """The named shapes of ``key`` (forge/spec/shapes.py): the GPU's, or with --quick the CPU's
    smallest (a smoke test: the host and device rows share it, so each kernel compiles once)."""
    gpu, cpu = {"rmsnorm": (shapes.RMSNORM_GPU, shapes.RMSNORM_CPU), "swiglu": (shapes.GLU_GPU, shapes.GLU_CPU),
                "geglu": (shapes.GLU_GPU, shapes.GLU_CPU), "rope": (shapes.ROPE_GPU, shapes.ROPE_CPU)}[key]
    return {"tiny": cpu["tiny"]} if quick else gpu


def host_rows(key, dev, plan, quick=False):
    """Host time per call on tiny inputs (GPU work negligible: the loop is host-bound)."""
    iters, warmup, rounds = plan
    reps = 1 if rounds == 1 else 5
    import jax

    from bridge import dlpack, kernels

    tiny = _table(key, True)["tiny"] if quick else {
        "rmsnorm": (8, 896), "swiglu": (8, 896), "geglu": (8, 896), "rope": (1, 14, 2, 8, 64)}[key]
    args, kwargs, diff, _, _ = _inputs(key, tiny, torch.bfloat16, dev)
    tri, pal = ops.get(key, "triton"), ops.get(key, "pallas")
    rows = []
    from bridge import native

    for measure, make in (("host fwd (no grad)", lambda f: _fwd(f, args, kwargs)),
                          ("host fwd+bwd", lambda f: _fwd_bwd(f, args, kwargs, diff))):
        t, p = _alternating(make(tri), make(pal), iters, warmup, rounds)  # pallas: native where it serves
        native.set_launcher("off")
        try:
            d = bc.wall_us(make(pal), iters=iters, warmup=warmup, reps=reps)
        finally:
            native.set_launcher(None)
        rows.append({"kernel": key, "measure": measure, "shape": str(tiny), "dtype": "bfloat16",
                     "triton_us": t, "pallas_us": p, "ratio": p / t, "pallas_dlpack_us": d,
                     "note": "native" if native.status()["available"] else "native unavailable: " + native.status()["reason"]})
    # the parts of one bridged forward
    kdef = getattr(kernels, key.upper())
    x = args[0].contiguous()
    parts = {
        "torch->jax import (fast path)": lambda: dlpack.import_fast(x),
        "torch->jax jax.dlpack.from_dlpack": lambda: jax.dlpack.from_dlpack(x),
    }
    if key in ("swiglu", "geglu"):
        jx = dlpack.inputs_to_jax(kdef, args)
        fwd = kdef.fwd_fn(())
        out = fwd(*jx)[0][0]
        parts["jit dispatch (jax arrays in, out)"] = lambda: fwd(*jx)
        parts["jax->torch torch.from_dlpack"] = lambda: torch.from_dlpack(out)
    for name, fn in parts.items():
        rows.append({"kernel": key, "measure": "part: " + name, "shape": str(tuple(x.shape)),
                     "dtype": "bfloat16", "pallas_us": bc.wall_us(fn, iters=iters, warmup=warmup, reps=reps)})
    return rows


def device_rows(key, dev, dtype, plan, quick):
    iters, warmup = plan
    named = _table(key, quick)
    tri, pal = ops.get(key, "triton"), ops.get(key, "pallas")
    rows = []
    for sname, shape in bc.progress(named.items(), key):
        args, kwargs, diff, bytes_f, bytes_b = _inputs(key, shape, dtype, dev)
        for measure, nbytes, make in (("device fwd", bytes_f, lambda f: _fwd(f, args, kwargs)),
                                      ("device bwd", bytes_b, lambda f: _bwd(f, args, kwargs, diff))):
            t = bc.device_time_us(make(tri), iters=iters, warmup=warmup)
            p = bc.device_time_us(make(pal), iters=iters, warmup=warmup)
            gbs = nbytes / p / 1e3
            rows.append({"kernel": key, "measure": measure, "shape": f"{sname} {shape}", "dtype": str(dtype).split(".")[-1],
                         "triton_us": t, "pallas_us": p, "ratio": p / t, "pallas_GBs": gbs,
                         "pallas_frac_ceiling": gbs / bc.COPY_CEILING_GBS})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quick", action="store_true", help="smoke test: one tiny shape, each call once (under a minute on a CPU)")
    bc.add_out_argument(ap)
    a = ap.parse_args(argv)
    for b in ("triton", "pallas"):
        ops.require(b)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    plan = QUICK if a.quick else FULL
    rows = []
    for key in a.kernels.split(","):
        rows += host_rows(key, dev, plan["host"], a.quick)
        rows += device_rows(key, dev, dtype, plan["device"], a.quick)
    bc.print_table(rows, COLUMNS)
    paths = bc.write_results(a.out, "bench_bridge_overhead", rows, {"note": (
        "host_us: wall time per call on tiny inputs, loop of calls then one sync (host-bound); "
        "pallas_us: the default path (native launch where it serves), pallas_dlpack_us: JAX + DLPack; "
        "device us: sum of all CUDA kernels per call from torch.profiler (JAX's stream included); "
        "ratio = pallas / triton")})
    print("wrote", *paths)
    return rows


if __name__ == "__main__":
    main()
