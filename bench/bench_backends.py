"""Per kernel: eager vs triton vs pallas (and Liger-Kernel when importable) at the shared named
shapes: forward and backward device time, achieved GB/s and the fraction of the measured copy
ceiling, plus each backend's host time per call on a tiny input (the launch / bridge overhead).

    python bench/bench_backends.py [--kernels rmsnorm,swiglu,geglu,rope] [--backends ...] [--quick]

Writes bench_backends-<device>.{json,csv,png} into --out. --quick runs tiny CPU shapes in the
interpreters (a smoke test for CI: it checks files and columns, not speed).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import _common as bc  # noqa: E402
from forge import ops  # noqa: E402
from forge.spec import geglu, rmsnorm, rope, shapes, swiglu  # noqa: E402

COLUMNS = ["kernel", "shape", "dtype", "backend", "fwd_us", "bwd_us", "fwd_GBs", "bwd_GBs",
           "fwd_frac_ceiling", "bwd_frac_ceiling", "host_us_per_call", "note"]


def _liger(key):
    try:
        if key == "rmsnorm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction as F

            return lambda x, w, eps=1e-6, casting="llama", offset=0.0: F.apply(x, w, eps, offset, casting)
        if key == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as F

            return lambda g, u: F.apply(g, u)
        if key == "geglu":
            from liger_kernel.ops.geglu import LigerGELUMulFunction as F

            return lambda g, u: F.apply(g, u)
        if key == "rope":
            from liger_kernel.ops.rope import LigerRopeFunction as F

            return lambda q, k, c, s: F.apply(q, k, c, s)
    except Exception:  # noqa: BLE001 - Liger is optional
        return None


def _impl(key, backend):
    if backend == "eager":
        from forge.spec import gated_mlp

        return {"rmsnorm": rmsnorm.reference, "swiglu": swiglu.reference, "geglu": geglu.reference,
                "rope": rope.reference, "gated_mlp": gated_mlp.reference}[key]
    if backend == "liger":
        return _liger(key)
    ok, _ = ops.availability(backend)
    return ops.get(key, backend) if ok else None


def _case(key, shape, dtype, dev):
    """(inputs, differentiable names, bytes fwd, bytes bwd) with the minimum traffic counted."""
    b = torch.tensor([], dtype=dtype).element_size()
    if key == "rmsnorm":
        m, n = shape
        x = torch.randn(m, n, device=dev, dtype=dtype)
        w = torch.randn(n, device=dev, dtype=dtype)
        return [x, w], (0, 1), 2 * m * n * b + 4 * m, 3 * m * n * b + 4 * m
    if key == "gated_mlp":  # (rows, hidden, intermediate): x, w_gate, w_up, w_down
        m, h, i = shape
        x = torch.randn(m, h, device=dev, dtype=dtype)
        ws = [torch.randn(*s, device=dev, dtype=dtype) * s[1] ** -0.5 for s in ((i, h), (i, h), (h, i))]
        return [x, *ws], (0, 1, 2, 3), (2 * m * h + 3 * h * i) * b, (4 * m * h + 6 * h * i) * b
    if key in ("swiglu", "geglu"):
        m, n = shape
        g = torch.randn(m, n, device=dev, dtype=dtype)
        u = torch.randn(m, n, device=dev, dtype=dtype)
        return [g, u], (0, 1), 3 * m * n * b, 5 * m * n * b
    bsz, hq, hk, s, d = shape
    q = torch.randn(bsz, s, hq, d, device=dev, dtype=dtype).transpose(1, 2)
    k = torch.randn(bsz, s, hk, d, device=dev, dtype=dtype).transpose(1, 2)
    cos = torch.randn(1, s, d, device=dev, dtype=dtype)
    sin = torch.randn(1, s, d, device=dev, dtype=dtype)
    qk = (q.numel() + k.numel()) * b
    return [q, k, cos, sin], (0, 1), 2 * qk + 2 * s * d * b, 2 * qk + 2 * s * d * b


def _measure(fn, inputs, diff, iters):
    leaves = [t.detach().clone().requires_grad_(i in diff) for i, t in enumerate(inputs)]
    fwd = lambda: fn(*leaves)  # noqa: E731
    t_f = bc.device_time_us(fwd, iters)
    out = fwd()
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn_like(o) for o in outs]
    bwd = lambda: torch.autograd.grad(outs, [leaves[i] for i in diff], grads, retain_graph=True)  # noqa: E731
    t_b = bc.device_time_us(bwd, iters)
    return t_f, t_b


def _host_us(fn, key, dtype, dev):
    small = {"rmsnorm": (1, 64), "swiglu": (1, 64), "geglu": (1, 64), "rope": (1, 2, 1, 1, 64)}[key]
    inputs, _, _, _ = _case(key, small, dtype, dev)
    return bc.wall_us(lambda: fn(*inputs), iters=50 if dev.type == "cuda" else 3, reps=5 if dev.type == "cuda" else 1)


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in rows if "fwd_us" in r]  # unavailable backends have no bar
    if not rows:
        return None
    labels = sorted({(r["kernel"], r["shape"]) for r in rows})
    backends = sorted({r["backend"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, col in zip(axes, ("fwd_frac_ceiling", "bwd_frac_ceiling")):
        width = 0.8 / max(len(backends), 1)
        for i, be in enumerate(backends):
            vals = [next((r[col] or 0 for r in rows if (r["kernel"], r["shape"]) == lab and r["backend"] == be), 0)
                    for lab in labels]
            ax.bar([j + i * width for j in range(len(labels))], vals, width, label=be)
        ax.set_xticks([j + 0.4 for j in range(len(labels))])
        ax.set_xticklabels([f"{k}\n{s}" for k, s in labels], rotation=60, fontsize=7)
        ax.set_title(col.replace("_", " ") + " (copy ceiling 4.22 TB/s)")
        ax.axhline(0.8, color="k", lw=0.5, ls="--")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", default="rmsnorm,swiglu,geglu,rope")
    p.add_argument("--backends", default="eager,triton,pallas,liger")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="tiny CPU shapes, interpreters; smoke test")
    bc.add_out_argument(p)
    a = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    dtype = getattr(torch, a.dtype)
    table = {"rmsnorm": shapes.RMSNORM_GPU, "swiglu": shapes.GLU_GPU, "geglu": shapes.GLU_GPU, "rope": shapes.ROPE_GPU}
    if a.quick or dev.type == "cpu":
        table = {"rmsnorm": {"tiny": (4, 64)}, "swiglu": {"tiny": (4, 64)}, "geglu": {"tiny": (4, 64)},
                 "rope": {"tiny": (1, 2, 1, 4, 16)}}
        a.iters = 2
    rows = []
    jobs = [(k, n, s, be) for k in a.kernels.split(",") for n, s in table[k].items() for be in a.backends.split(",")]
    for key, name, shape, be in bc.progress(jobs, "bench_backends"):
        fn = _impl(key, be)
        row = {"kernel": key, "shape": f"{name} {shape}", "dtype": a.dtype, "backend": be}
        if fn is None:
            row["note"] = "unavailable"
            rows.append(row)
            continue
        inputs, diff, bytes_f, bytes_b = _case(key, shape, dtype, dev)
        t_f, t_b = _measure(fn, inputs, diff, a.iters)
        row.update(fwd_us=t_f, bwd_us=t_b, fwd_GBs=bytes_f / t_f / 1e3, bwd_GBs=bytes_b / t_b / 1e3)
        row["fwd_frac_ceiling"] = row["fwd_GBs"] / bc.COPY_CEILING_GBS
        row["bwd_frac_ceiling"] = row["bwd_GBs"] / bc.COPY_CEILING_GBS
        row["host_us_per_call"] = _host_us(fn, key, dtype, dev)
        rows.append(row)
        del inputs
    bc.print_table(rows, COLUMNS)
    jpath, cpath = bc.write_results(a.out, "bench_backends", rows, {"ceiling_GBs": bc.COPY_CEILING_GBS})
    png = _plot(rows, jpath.with_suffix(".png"))
    print(f"wrote {jpath}\n      {cpath}" + (f"\n      {png}" if png else ""))
    return rows


if __name__ == "__main__":
    main()
