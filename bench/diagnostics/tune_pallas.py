"""Sweep the launch settings of the Pallas GLU and RoPE kernels on the GPU: device time per call
through the native launch, forward and backward, bf16, at forge/spec/shapes.py's GPU shapes,
each setting beside forge_triton's same call in the same process (the ratio is what counts).

    python bench/diagnostics/tune_pallas.py [--kernels swiglu,rope] [--quick]

GLU: elements per program and warps (``forge_pallas.glu._BLOCK``, ``_WARPS``). RoPE: programs
per SM that the positions per program aim at, warps, and heads per loop step
(``forge_pallas.rope._PROGS_PER_SM``, ``_WARPS``, ``_HEADS_PER_STEP``). Each setting runs in
its own process with its own kernel cache, so no trace or lowering of another setting is reused.
Prints the table; writes tune_pallas-<device>.{json,csv} into --out. The winners become the
module defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

COLUMNS = ["kernel", "setting", "shape", "measure", "triton_us", "pallas_us", "ratio", "note"]
SETTINGS = {
    # (elements per program, warps); the first is the module default
    "swiglu": [(1024, 4), (2048, 8), (512, 2), (512, 4), (1024, 2), (256, 1)],
    # (programs per SM, warps or None for the tile-size rule, heads per loop step)
    "rope": [(4, None, 1), (4, None, 2), (4, None, 4), (8, None, 2), (8, None, 4), (4, 4, 2), (2, None, 4)],
}


def _apply(kernel, setting):
    import importlib

    if kernel in ("swiglu", "geglu"):
        m = importlib.import_module("forge_pallas.glu")
        m._BLOCK, m._WARPS = setting
    else:
        m = importlib.import_module("forge_pallas.rope")
        m._PROGS_PER_SM, m._WARPS, m._HEADS_PER_STEP = setting


def child(kernel, setting, quick):
    """One setting: rows for every shape, forward and backward, Triton then Pallas."""
    import torch

    import _common as bc
    import bench_bridge_overhead as bo
    from forge import ops
    from forge.spec import shapes

    _apply(kernel, setting)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = {"swiglu": shapes.GLU_GPU, "geglu": shapes.GLU_GPU, "rope": shapes.ROPE_GPU}[kernel]
    if quick:
        table = {"swiglu": shapes.GLU_CPU, "geglu": shapes.GLU_CPU, "rope": shapes.ROPE_CPU}[kernel]
    tri, pal = ops.get(kernel, "triton"), ops.get(kernel, "pallas")
    iters = 3 if quick else 30
    rows = []
    for sname, shape in table.items():
        if sname == "empty":
            continue
        args, kwargs, diff, _, _ = bo._inputs(kernel, shape, torch.bfloat16 if dev.type == "cuda" else torch.float32, dev)
        for measure, make in (("fwd", lambda f: bo._fwd(f, args, kwargs)),
                              ("bwd", lambda f: bo._bwd(f, args, kwargs, diff))):
            t = bc.device_time_us(make(tri), iters=iters)
            p = bc.device_time_us(make(pal), iters=iters)
            rows.append({"kernel": kernel, "setting": str(setting), "shape": f"{sname} {shape}",
                         "measure": measure, "triton_us": t, "pallas_us": p, "ratio": p / t})
    from bridge import native
    from bridge.native import state

    note = "native" if native.status()["available"] else "native unavailable: " + native.status()["reason"]
    if state.KERNELS:  # what was compiled: the setting's warps must be among them
        note += f", warps compiled {sorted({k[1] for k in state.KERNELS})}"
    for r in rows:
        r["note"] = note
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="swiglu,rope")
    ap.add_argument("--quick", action="store_true", help="CPU shapes, first two settings (a smoke test)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    import _common as bc

    bc.add_out_argument(ap)
    a = ap.parse_args(argv)
    if a.child:
        kernel, setting = json.loads(a.child)
        print("ROWS " + json.dumps(child(kernel, tuple(setting), a.quick)))
        return None
    rows = []
    for kernel in a.kernels.split(","):
        settings = SETTINGS["swiglu" if kernel == "geglu" else kernel]
        for setting in settings[:2] if a.quick else settings:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "FORGE_CACHE_DIR": cache}
                cmd = [sys.executable, __file__, "--child", json.dumps([kernel, setting])] + (["--quick"] if a.quick else [])
                r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            got = [ln for ln in r.stdout.splitlines() if ln.startswith("ROWS ")]
            if r.returncode or not got:
                tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
                rows.append({"kernel": kernel, "setting": str(setting), "note": f"failed: {tail[0]}"[:300]})
                continue
            rows += json.loads(got[0][5:])
            print(f"{kernel} {setting}: done", flush=True)
    bc.print_table(rows, COLUMNS)
    jpath, cpath = bc.write_results(a.out, "tune_pallas", rows, {"args": vars(a)}, case=a.kernels.replace(",", "-"))
    print(f"wrote {jpath}\n      {cpath}")
    return rows


if __name__ == "__main__":
    main()
