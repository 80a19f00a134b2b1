"""CI smoke tests of the benchmark scripts (--quick: tiny shapes, CPU interpreters): they run,
and write result files holding the expected columns. No speed is asserted here."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script, args, tmp_path):
    env = dict(os.environ, FORGE_BENCH_RESULTS=str(tmp_path), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                       env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p.stdout


def _rows(tmp_path, stem):
    csvs = sorted(tmp_path.glob(f"{stem}*.csv"))
    jsons = sorted(tmp_path.glob(f"{stem}*.json"))
    assert len(csvs) == 1 and len(jsons) == 1, list(tmp_path.iterdir())
    meta = json.loads(jsons[0].read_text())
    for key in ("date", "device", "torch", "command"):
        assert meta["environment"][key], key
    with csvs[0].open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_bench_patch_bisect_quick(tmp_path):
    out = _run("bench_patch_bisect.py", ["--quick", "--guard-stats", "--graphs"], tmp_path)
    rows = _rows(tmp_path, "bench_patch_bisect")
    assert {"variant", "step_ms", "speedup"} <= rows[0].keys()
    variants = [r["variant"] for r in rows]
    assert variants[0] == "eager" and "forge triton: all" in variants
    graphed = next(r for r in rows if r["variant"] == "forge triton: all + graphs")
    assert "'graphs': 2" in graphed["note"] and "hidden states not a CUDA tensor" in graphed["note"]
    assert all(float(r["step_ms"]) > 0 for r in rows)
    assert "guard stats" in out


@pytest.mark.slow
def test_bench_backends_quick(tmp_path):
    _run("bench_backends.py", ["--quick", "--kernels", "rmsnorm,rope", "--backends", "eager,triton"], tmp_path)
    rows = _rows(tmp_path, "bench_backends")
    assert {"kernel", "backend", "fwd_us", "bwd_us", "fwd_frac_ceiling", "host_us_per_call"} <= rows[0].keys()
    assert {(r["kernel"], r["backend"]) for r in rows} == {(k, b) for k in ("rmsnorm", "rope") for b in ("eager", "triton")}
    assert all(float(r["fwd_us"]) > 0 and float(r["bwd_us"]) > 0 for r in rows)


@pytest.mark.slow
def test_bench_guard_quick(tmp_path):
    _run("bench_guard.py", ["--quick", "--kernels", "swiglu", "--backends", "triton"], tmp_path)
    rows = _rows(tmp_path, "bench_guard")
    assert {"kernel", "backend", "mode", "elements", "eager_us", "fused_us", "speedup"} <= rows[0].keys()
    assert {r["mode"] for r in rows} == {"infer", "train"}


def test_guard_crossover_rule():
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_guard import crossover

    sizes = [1, 2, 4, 8, 16]
    # fused wins from 4 on, and a win at 1 below a loss at 2 does not count
    assert crossover(sizes, [5, 5, 5, 5, 5], [4, 6, 5, 3, 1]) == 4
    assert crossover(sizes, [1] * 5, [2] * 5) is None
    assert crossover(sizes, [2] * 5, [1] * 5) == 1


@pytest.mark.slow
def test_profile_step_quick(tmp_path):
    _run("profile_step.py", ["--quick", "--variants", "eager,rmsnorm"], tmp_path)
    rows = _rows(tmp_path, "profile_step")
    assert [r["variant"] for r in rows] == ["eager", "rmsnorm"]
    assert {"ms", "device_busy_ms", "host_self_ms", "top_host"} <= rows[0].keys()
    assert all(float(r["ms"]) > 0 and float(r["host_self_ms"]) > 0 for r in rows)


@pytest.mark.slow
def test_bench_guard_gated_mlp_quick(tmp_path):
    # the MLP sweep's elements are rows x intermediate, the guard's metric for swiglu/geglu
    _run("bench_guard.py", ["--quick", "--kernels", "gated_mlp", "--backends", "triton"], tmp_path)
    rows = _rows(tmp_path, "bench_guard")
    assert {int(r["elements"]) for r in rows} == {1 * 4864, 4 * 4864}


@pytest.mark.slow
def test_bench_generate_quick(tmp_path):
    _run("bench_generate.py", ["--quick"], tmp_path)
    rows = _rows(tmp_path, "bench_generate")
    assert {"batch", "prompt", "variant", "tok_s", "ttft_ms", "first_s", "same_tokens"} <= rows[0].keys()
    assert [r["variant"] for r in rows] == ["eager", "forge", "forge graphs", "static + compile"]
    assert all(float(r["tok_s"]) > 0 for r in rows[:3])
    # no CUDA: the graphs variant's generate() runs as before, and says why
    assert "the model is on cpu" in rows[2]["note"] and "skipped" in rows[3]["note"]
    assert float(rows[1]["same_tokens"]) == 1.0 and float(rows[2]["same_tokens"]) == 1.0
    assert len(list(tmp_path.glob("bench_generate*.png"))) == 1
