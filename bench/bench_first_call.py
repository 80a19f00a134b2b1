"""First call of each Pallas kernel in a fresh process, the native path's disk cache cold and warm.

    python bench/bench_first_call.py [--kernels rmsnorm,swiglu,geglu,rope,lora_qkv,lora_mlp] [--quick]
    python bench/bench_first_call.py --kernels rmsnorm --profile   # where a warm first forward goes

Per kernel, two fresh subprocesses share one empty ``FORGE_CACHE_DIR``: the first ("cold")
fills the native path's TTIR cache (and Triton's own cache, which it points at the same folder),
the second ("warm") finds everything cached. Each imports forge, gets the pallas op, builds its
inputs, synchronises, then times (1) the first forward call (no autograd) and (2) the first
forward + backward (a new autograd graph: the backward's plan is built here), each to a device
synchronise. It also reports where the plan-building time went (``bridge.native.timings()``:
jaxpr trace, lowering to TTIR, triton.compile), how many passes were traced (a warm process
builds its plans from their recipes on disk: none) and how many kernels Triton compiled, the
time JAX's import and start-up took (``jax_ms``, before anything else: once a process), the
time ``forge.ops.get`` took after it (where the Pallas backend starts Triton, once a process)
and torch's first matrix product (``cublas_ms``: cuBLAS's start, once a process, paid by any
model's first layer; before this column the LoRA kernels' first call paid it), then the kernel's
plain-torch reference once, forward and backward (``torch_ref_ms``: torch's first use of the products and kernels that
math needs at these shapes, which a model's own first step pays patched or not; before this
column the LoRA kernels' first forward paid it, 45-105 ms of torch.mm by cProfile; before its
backward was added, their first backward paid for the products a backward loads, about 70 ms).
The target is a warm first call of at most 50 ms (docs/pallas-native.md).

--quick runs on a CPU: tiny shapes, each ``pallas_call`` evaluated by JAX's interpreter
(``bridge.native.set_launcher("jax", lower=True)``), so the first-call figures are the plan
build plus JAX's compile of the interpreter, not a GPU number; the trace and lowering parts are
the same work as on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as bc  # noqa: E402

KERNELS = ("rmsnorm", "swiglu", "geglu", "rope", "lora_qkv", "lora_mlp")

_CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    t_import = time.perf_counter()
    import forge.ops
    from bridge import native
    kernel, quick, backend = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        native.set_launcher("jax", lower=True)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    m, h, i, r = (8, 64, 96, 8) if quick else (4096, 896, 4864, 16)
    def w(*s, scale=0.1, grad=False):
        return (torch.randn(*s, device=dev) * scale).to(dt).requires_grad_(grad)
    def inputs(grad):
        if kernel == "rmsnorm":
            return (w(m, h, scale=1.0, grad=grad), w(h, scale=1.0, grad=grad)), {"eps": 1e-6}, (0, 1)
        if kernel in ("swiglu", "geglu"):
            return (w(m, i, grad=grad), w(m, i, grad=grad)), {}, (0, 1)
        if kernel == "rope":
            b, s, nh, nkv, d = (1, m, 4, 2, 16) if quick else (1, m, 14, 2, 64)
            return ((w(b, nh, s, d, grad=grad), w(b, nkv, s, d, grad=grad), w(b, s, d), w(b, s, d)), {}, (0, 1))
        if kernel == "lora_qkv":
            ws = []
            for n in (h, h // 4, h // 4):
                ws += [w(n, h), w(n), w(r, h, grad=grad), w(n, r, grad=grad)]
            return (w(m, h, grad=grad), *ws), {"scale_q": 2.0, "scale_k": 2.0, "scale_v": 0.5}, (0,)
        if kernel == "lora_mlp":
            ws = [w(i, h), w(r, h, grad=grad), w(i, r, grad=grad), w(i, h), w(r, h, grad=grad), w(i, r, grad=grad),
                  w(h, i), w(r, i, grad=grad), w(h, r, grad=grad)]
            return (w(m, h, grad=grad), *ws), {"scale_gate": 2.0, "scale_up": 2.0, "scale_down": 0.5}, (0,)
        raise SystemExit(f"unknown kernel {kernel}")
    t_jax = time.perf_counter()
    from bridge import runtime
    runtime.jax_has_gpu()  # importing JAX and starting its backends: once a process, timed apart
    jax_ms = 1e3 * (time.perf_counter() - t_jax)
    t_get = time.perf_counter()
    fn = forge.ops.get(kernel, backend)  # (where the Pallas backend starts Triton: bridge.native.prepare)
    get_ms = 1e3 * (time.perf_counter() - t_get)
    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()
    args, kw, _ = inputs(False)
    args_g, _, _ = inputs(True)
    sync()
    # torch's own first matrix product (cuBLAS's handle and workspace): once a process, paid by
    # whatever multiplies first (a model's first layer; the LoRA kernels' products here), timed apart
    t_mm = time.perf_counter()
    torch.mm(torch.ones(2, 2, device=dev, dtype=dt), torch.ones(2, 2, device=dev, dtype=dt))
    sync()
    cublas_ms = 1e3 * (time.perf_counter() - t_mm)
    # the same math in plain torch first (forge.spec's reference), forward and backward, as a
    # model's own first step runs its products and concatenations before or beside forge's: torch's first use of those
    # kernels at these shapes (cuBLAS picking and loading its GEMMs) lands here, and fwd_ms is
    # the part forge adds
    import importlib
    t_ref = time.perf_counter()
    ref = importlib.import_module("forge.spec." + kernel).reference(*args_g, **kw)
    refs = [o for o in (ref if isinstance(ref, tuple) else (ref,)) if o.requires_grad]
    if refs:  # and its backward: the products a first backward loads are torch's too
        torch.autograd.backward(refs, [torch.ones_like(o) for o in refs])
    del ref, refs
    for t in args_g:
        if isinstance(t, torch.Tensor):
            t.grad = None
    sync()
    torch_ref_ms = 1e3 * (time.perf_counter() - t_ref)
    import os
    prof = None
    if os.environ.get("FORGE_FIRST_CALL_PROFILE"):  # --profile: what the first forward spends its time on
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    mods = len(sys.modules)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(*args, **kw)
    sync()
    t1 = time.perf_counter()
    if prof is not None:
        import pstats
        prof.disable()
        st = pstats.Stats(prof, stream=sys.stderr)
        print(f"first forward: {1e3 * (t1 - t0):.1f} ms, {len(sys.modules) - mods} modules imported", file=sys.stderr)
        st.sort_stats("cumulative").print_stats(35)
        st.sort_stats("tottime").print_stats(15)
    before = native.timings()
    out = fn(*args_g, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
    sync()
    t2 = time.perf_counter()
    st = native.status()
    tm = native.timings()
    print("RESULT " + json.dumps({
        "jax_ms": jax_ms, "get_ms": get_ms, "cublas_ms": cublas_ms, "torch_ref_ms": torch_ref_ms, "fwd_ms": 1e3 * (t1 - t0), "fwd_bwd_ms": 1e3 * (t2 - t1), "traces": st["traces"],
        "trace_ms": 1e3 * tm["trace"], "lower_ms": 1e3 * tm["lower"], "compile_ms": 1e3 * tm["compile"],
        "build_ms": 1e3 * tm["build"], "bwd_build_ms": 1e3 * (tm["build"] - before["build"]),
        "plans": st["plans"], "kernels": st["kernels"], "compiles": st["compiles"],
        "declined": st["declined"], "available": st["available"], "reason": st["reason"]}))
""")


def run_child(kernel: str, quick: bool, cache: str, profile: bool = False, backend: str = "pallas") -> dict:
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, FORGE_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    if profile:
        env["FORGE_FIRST_CALL_PROFILE"] = "1"
    r = subprocess.run([sys.executable, "-c", _CHILD, kernel, "1" if quick else "0", backend], env=env,
                       capture_output=True, text=True, cwd=root)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not line:
        raise RuntimeError(f"{kernel}: the child failed (rc {r.returncode}):\n{r.stderr[-3000:]}")
    if profile:
        print(r.stderr[r.stderr.find("first forward:"):])
    return json.loads(line[-1][len("RESULT "):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--quick", action="store_true", help="tiny shapes, JAX-evaluated kernels (CPU smoke test)")
    ap.add_argument("--backends", default="pallas",
                    help="pallas, and triton for its first call beside it (the same inputs, its own caches)")
    ap.add_argument("--profile", action="store_true",
                    help="print cProfile's view of each warm first forward (writes no results)")
    bc.add_out_argument(ap)
    a = ap.parse_args()
    if a.profile:
        for kernel in a.kernels.split(","):
            with tempfile.TemporaryDirectory(prefix="forge-first-call-") as cache:
                run_child(kernel, a.quick, cache)
                print(f"== {kernel}, warm", run_child(kernel, a.quick, cache, profile=True))
        return
    rows = []
    for backend, kernel in ((b, k) for b in a.backends.split(",") for k in a.kernels.split(",")):
        with tempfile.TemporaryDirectory(prefix="forge-first-call-") as cache:
            for run in ("cold", "warm"):
                res = run_child(kernel, a.quick, cache, backend=backend)
                row = {"backend": backend, "kernel": kernel, "cache": run,
                       **{k: (round(v, 2) if isinstance(v, float) else v)
                                                          for k, v in res.items()}}
                row["declined"] = json.dumps(row["declined"]) if row["declined"] else ""
                rows.append(row)
    cols = ["backend", "kernel", "cache", "jax_ms", "get_ms", "cublas_ms", "torch_ref_ms", "fwd_ms", "fwd_bwd_ms", "trace_ms", "lower_ms", "compile_ms", "build_ms",
            "plans", "traces", "compiles"]
    print(" ".join(f"{c:>11}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>11}" if not isinstance(r[c], float) else f"{r[c]:>11.1f}" for c in cols))
        if r["declined"] or not r["available"]:
            print(f"    (not native: {r['reason'] or r['declined']})")
    warm = [r for r in rows if r["cache"] == "warm" and r["backend"] == "pallas"]
    paths = bc.write_results(a.out, "first_call", rows, {"backends": a.backends,
        "quick": a.quick,
        "note": ("fresh process per row; warm = the second process on the same FORGE_CACHE_DIR; "
                 "target: a warm first call <= 50 ms (fwd_ms; fwd_bwd_ms for the first backward)" + ("; --quick: CPU, JAX-evaluated kernels, not a GPU figure"
                                                     if a.quick else "")),
        "warm_max_fwd_ms": max((r["fwd_ms"] for r in warm), default=None),
        "warm_max_fwd_bwd_ms": max((r["fwd_bwd_ms"] for r in warm), default=None)},
        case="-".join(x for x in ("quick" if a.quick else "", "" if a.backends == "pallas" else a.backends.replace(",", "-")) if x))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
