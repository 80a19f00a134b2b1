"""CI smoke tests of the benchmark scripts (--quick: tiny shapes, CPU interpreters): they run,
say that their numbers are a smoke test, and write result files named after the script
(``<script>[-<case>]-<device>``) holding the expected columns. No speed is asserted here."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "SMOKE TEST, NOT A MEASUREMENT"
# what tqdm draws: carriage returns between redraws, block characters, the rate
BAR_MARKS = ("\r", "it/s", "s/it", "\u2588", "%|")


def _run(script, args, tmp_path, out=True, cwd=ROOT):
    """Run a benchmark as a user sends its output to a file (stdout and stderr both, not a
    terminal): it must succeed and the file must hold no progress bar."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("FORGE_BENCH_OUT", None)
    log = tmp_path / "output.txt"
    with log.open("w") as f:
        p = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args,
                            *(["--out", str(tmp_path)] if out else [])],
                           stdout=f, stderr=subprocess.STDOUT, text=True, env=env, timeout=600, cwd=cwd)
    text = log.read_text()
    assert p.returncode == 0, text[-6000:]
    assert not [m for m in BAR_MARKS if m in text], text[-2000:]
    if "--quick" in args:  # printed before its tables: nobody reads a CPU's speed-ups as results
        assert SMOKE in text, text[-2000:]
    return text


def _rows(folder, stem):
    csvs = sorted(folder.glob(f"{stem}*.csv"))
    jsons = sorted(folder.glob(f"{stem}*.json"))
    assert len(csvs) == 1 and len(jsons) == 1, list(folder.iterdir())
    assert csvs[0].stem == jsons[0].stem and jsons[0].stem.endswith("-cpu")  # stable name, no stamp
    meta = json.loads(jsons[0].read_text())
    assert meta["benchmark"] == stem.split("-")[0] and SMOKE in meta["smoke_test"], meta.get("smoke_test")
    for key in ("date", "device", "torch", "command"):
        assert meta["environment"][key], key
    with (folder / "history.csv").open() as f:
        hist = list(csv.DictReader(f))
    assert [h["file"] for h in hist] == [jsons[0].stem] and hist[0]["summary"], hist
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
    # a backend that is missing here (Liger-Kernel is not installed on CPU CI) gives a row with
    # no timings, and the plot, drawn whenever matplotlib imports, must pass over it
    pytest.importorskip("matplotlib", reason="the plot is drawn only with matplotlib installed")
    backends = ["eager", "triton", "liger"]
    _run("bench_backends.py", ["--quick", "--kernels", "rmsnorm,rope", "--backends", ",".join(backends)], tmp_path)
    rows = _rows(tmp_path, "bench_backends")
    assert {"kernel", "backend", "fwd_us", "bwd_us", "fwd_frac_ceiling", "host_us_per_call"} <= rows[0].keys()
    assert {(r["kernel"], r["backend"]) for r in rows} == {(k, b) for k in ("rmsnorm", "rope") for b in backends}
    timed = [r for r in rows if r["note"] != "unavailable"]
    assert {r["backend"] for r in timed} >= {"eager", "triton"}
    assert all(float(r["fwd_us"]) > 0 and float(r["bwd_us"]) > 0 for r in timed)
    png = tmp_path / "bench_backends-cpu.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_flce_quick(tmp_path):
    # no --out and no $FORGE_BENCH_OUT: results go to ./forge-bench-results of the caller
    text = _run("bench_flce.py", ["--quick"], tmp_path, out=False, cwd=tmp_path)
    folder = tmp_path / "forge-bench-results"
    rows = _rows(folder, "bench_flce-tiny")
    assert [r["impl"] for r in rows] == ["eager", "triton", "pallas"] and {r["case"] for r in rows} == {"tiny"}
    assert all(float(r["ms"]) > 0 and float(r["extra_mib"]) >= 0 and r["time_vs_eager"] for r in rows)
    failed = [(r["impl"], r.get("skipped"), r.get("exit_rc")) for r in rows if r.get("skipped") or r.get("exit_rc")]
    assert not failed, (failed, text[-4000:])  # the output holds each such process's stderr


@pytest.mark.slow
def test_bench_bridge_overhead_quick(tmp_path):
    # --quick is a smoke test (each call timed once at the CPU's smallest shape), not 11 minutes
    _run("bench_bridge_overhead.py", ["--quick", "--kernels", "swiglu,rope"], tmp_path)
    rows = _rows(tmp_path, "bench_bridge_overhead")
    assert {r["kernel"] for r in rows} == {"swiglu", "rope"}
    timed = [r for r in rows if r["measure"].startswith(("host", "device"))]
    assert len(timed) == 8 and all(float(r["triton_us"]) > 0 and float(r["pallas_us"]) > 0 for r in timed)
    assert any(r["measure"] == "part: jit dispatch (jax arrays in, out)" for r in rows)


@pytest.mark.slow
def test_bench_guard_quick(tmp_path):
    # one process for both sweeps (a process start costs CI ~10 s)
    _run("bench_guard.py", ["--quick", "--kernels", "swiglu,gated_mlp", "--backends", "triton"], tmp_path)
    rows = _rows(tmp_path, "bench_guard")
    assert {"kernel", "backend", "mode", "elements", "eager_us", "fused_us", "speedup"} <= rows[0].keys()
    for kernel in ("swiglu", "gated_mlp"):
        assert {r["mode"] for r in rows if r["kernel"] == kernel} == {"infer", "train"}
    # the MLP sweep's elements are rows x intermediate, the guard's metric for swiglu/geglu
    assert {int(r["elements"]) for r in rows if r["kernel"] == "gated_mlp"} == {1 * 4864, 4 * 4864}


def test_guard_crossover_rule():
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_guard import crossover

    sizes = [1, 2, 4, 8, 16]
    # fused wins from 4 on, and a win at 1 below a loss at 2 does not count
    assert crossover(sizes, [5, 5, 5, 5, 5], [4, 6, 5, 3, 1]) == 4
    assert crossover(sizes, [1] * 5, [2] * 5) is None
    assert crossover(sizes, [2] * 5, [1] * 5) == 1


def test_lora_spec_puts_expert_weights_in_target_parameters():
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_patch_bisect import ALL_PROJ, lora_config

    assert lora_config("16,32,0.05") == dict(r=16, lora_alpha=32.0, lora_dropout=0.05, bias="none",
                                             target_modules=list(ALL_PROJ))
    got = lora_config("8,16,0,q_proj,v_proj,mlp.experts.gate_up_proj,mlp.experts.down_proj")
    assert got["target_modules"] == ["q_proj", "v_proj"]
    assert got["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_fixed_memory_counts_parameters_and_trainable_gradients():
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_patch_bisect import fixed_mib

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 128, bias=False))
    model[1].requires_grad_(False)
    params = (256 * 512 + 512 + 512 * 128) * 4 / 2**20
    assert fixed_mib(model, "infer") == params
    assert fixed_mib(model, "train") == params + (256 * 512 + 512) * 4 / 2**20


def test_max_seq_search_doubles_bisects_and_stops_at_its_cap(monkeypatch):
    # bench_max_seq's search against a fake step that runs out of memory above ``fits`` tokens
    sys.path.insert(0, str(ROOT / "bench"))
    import types

    import bench_max_seq as bms

    fits, tried = 21_000, []

    def step(_model, n, _device):
        tried.append(n)
        return None if n > fits else (1.0, 2.0)

    monkeypatch.setattr(bms, "_step", step)
    a = types.SimpleNamespace(start=4096, limit=262144, granularity=1024)
    n, stats, reached, probes = bms.longest(None, a, "cpu")
    assert not reached and fits - 1024 < n <= fits and stats == (1.0, 2.0) and probes == len(tried)
    assert tried[:4] == [4096, 8192, 16384, 32768]  # doubling, then bisecting between 16384 and 32768
    tried.clear()
    n, _, reached, probes = bms.longest(None, a, "cpu", limit=12288)  # a cap below the failure
    assert reached and n == 12288 and tried == [4096, 8192, 12288]
    tried.clear()  # the cap probed first: one step answers when it fits, the search follows when not
    assert bms.longest(None, a, "cpu", limit=12288, cap_first=True)[::2] == (12288, True) and tried == [12288]
    tried.clear()
    n, _, reached, _ = bms.longest(None, a, "cpu", limit=32768, cap_first=True)
    assert not reached and fits - 1024 < n <= fits and tried[:3] == [32768, 4096, 8192]


def test_bench_max_seq_quick(tmp_path):
    _run("bench_max_seq.py", ["--quick", "--upto-ratio", "2"], tmp_path)
    rows = _rows(tmp_path, "bench_max_seq")
    assert {(r["variant"], r["checkpointing"]) for r in rows} == {
        ("eager", "off"), ("forge triton", "off"), ("eager", "on"), ("forge triton", "on")}
    assert all(int(r["max_len"]) == 32 for r in rows)  # the --quick limit: nothing runs out of memory on a CPU


def test_bench_fsdp_quick(tmp_path):
    # one CPU process (FSDP2 over one gloo rank): a full fine-tune with activation checkpointing
    # under FSDP2's mixed-precision policy, eager and forge patched after fully_shard, same tokens
    _run("bench_fsdp.py", ["--quick", "--cases", "full", "--checkpointing", "on", "--patch", "after", "--profile"],
         tmp_path)
    rows = _rows(tmp_path, "bench_fsdp")
    assert [(r["case"], r["checkpointing"], r["variant"]) for r in rows] == [
        ("full", "on", "eager"), ("full", "on", "forge:triton:after")]
    assert "'fused_linear_ce': 1" in rows[1]["note"] and "'rmsnorm'" in rows[1]["note"]
    for key in ("loss_first", "loss_last"):  # the same model, tokens and step: rounding apart
        assert abs(float(rows[1][key]) - float(rows[0][key])) <= 1e-2 * abs(float(rows[0][key])), rows
    assert all(float(r["step_ms"]) > 0 for r in rows)
    assert rows[1]["fallbacks"] == "{}", rows[1]  # every forge call fused under FSDP2
    assert all(float(r["prof_host_op_ms"]) > 0 for r in rows), rows  # (--profile: rank 0's host time)


def test_device_gaps_charge_idle_time_to_the_launching_ops():
    # a synthetic trace: k2 launched late inside op > mm (its 60 us gap is the host's), k3
    # launched long before the device reached it (a 100 us gap that is not); a 10 us gap and a
    # memcpy overlapping k1 count for nothing; the step starts 30 us before k1
    sys.path.insert(0, str(ROOT / "bench"))
    from profile_step import device_gaps

    def ev(cat, name, ts, dur, corr=None):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {} if corr is None else {"correlation": corr}}

    trace = {"traceEvents": [
        ev("cpu_op", "step", -30, 430), ev("cpu_op", "op", 140, 30), ev("cpu_op", "aten::mm", 145, 20),
        ev("cuda_runtime", "cudaLaunchKernel", 150, 5, corr=2), ev("cuda_driver", "cuLaunchKernelEx", 50, 5, corr=3),
        ev("kernel", "k1", 0, 100, corr=1), ev("gpu_memcpy", "m", 20, 30), ev("kernel", "k2", 160, 40, corr=2),
        ev("kernel", "k3", 300, 50, corr=3), ev("kernel", "k4", 360, 10),
    ]}
    got = device_gaps(trace, min_us=20.0)
    # the 30 us before k1 (launched by no recorded call) counts as idle, its launcher unknown
    assert got["device_idle_ms"] == pytest.approx(0.19)
    assert got["device_idle_host_bound_ms"] == pytest.approx(0.06)
    assert got["idle_by_launcher"] == [["step (launched early)", 0.1, 1], ["step > op > aten::mm", 0.06, 1],
                                       ["? (no launch recorded)", 0.03, 1]]


@pytest.mark.slow
def test_profile_step_quick(tmp_path):
    _run("profile_step.py", ["--quick", "--variants", "eager,rmsnorm"], tmp_path)
    rows = _rows(tmp_path, "profile_step")
    assert [r["variant"] for r in rows] == ["eager", "rmsnorm"]
    assert {"ms", "device_busy_ms", "host_self_ms", "top_host"} <= rows[0].keys()
    assert all(float(r["ms"]) > 0 and float(r["host_self_ms"]) > 0 for r in rows)


@pytest.mark.slow
def test_bench_compile_quick(tmp_path):
    _run("bench_compile.py", ["--quick", "--variants", "eager,compile,forge+compile"], tmp_path)
    rows = {r["variant"]: r for r in _rows(tmp_path, "bench_compile")}
    assert list(rows) == ["eager", "compile", "forge+compile"]
    assert float(rows["compile"]["vs_compile"]) == 1.0 and float(rows["forge+compile"]["vs_compile"]) > 0
    assert float(rows["compile"]["b2b_vs_compile"]) == 1.0 and float(rows["forge+compile"]["b2b_ms"]) > 0
    assert rows["forge+compile"]["graph_breaks"] == "0" and float(rows["forge+compile"]["compile_s"]) > 0
    assert not rows["eager"]["compile_s"]


@pytest.mark.slow
def test_bench_generate_quick(tmp_path):
    _run("bench_generate.py", ["--quick"], tmp_path)
    rows = _rows(tmp_path, "bench_generate")
    assert {"batch", "prompt", "variant", "tok_s", "ttft_ms", "first_s", "same_tokens"} <= rows[0].keys()
    assert [r["variant"] for r in rows] == ["eager", "forge", "forge graphs", "forge graphs loop", "static + compile"]
    assert all(float(r["tok_s"]) > 0 for r in rows[:4])
    # the time per decoding step is the total less the first token's (a median of separate calls):
    # left empty where the CPU's noise makes that difference no larger than zero
    ms = [r["ms_token"] for r in rows[:4]]
    assert any(ms) and all(float(m) > 0 for m in ms if m), ms
    # no CUDA: the graphs variants' generate() runs as before, and says why
    assert all("the model is on cpu" in r["note"] for r in rows[2:4]) and "skipped" in rows[4]["note"]
    assert all(float(r["same_tokens"]) == 1.0 for r in rows[1:4])
    assert all(float(r["ttft_eager_ms"]) > 0 for r in rows[1:4])  # the unpatched twin's first token
    import importlib.util

    # the plot is drawn whenever matplotlib imports (not a test dependency)
    assert len(list(tmp_path.glob("bench_generate*.png"))) == (importlib.util.find_spec("matplotlib") is not None)


def test_generate_twin_is_an_unshared_copy():
    # bench_generate's unpatched twin (eager's first token): the same weights in memory of its own,
    # ties kept (the head and the embedding share one weight where the model does)
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_generate
    from presets import build

    model = build("tiny", torch.float32, torch.device("cpu"))
    model.lm_head.weight = model.model.embed_tokens.weight
    twin = bench_generate._cpu_twin(model)
    mine, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, p in mine.items():
        assert torch.equal(p, theirs[name]) and p.data_ptr() != theirs[name].data_ptr(), name
        assert isinstance(theirs[name], torch.nn.Parameter) and theirs[name].requires_grad == p.requires_grad
    assert twin.lm_head.weight is twin.model.embed_tokens.weight
    for (name, b), (_, c) in zip(model.named_buffers(), twin.named_buffers()):
        assert torch.equal(b, c) and b.data_ptr() != c.data_ptr(), name


def test_profile_decode_host_cpu(tmp_path):
    # a no-op replay on the CPU: the host time of generate's loop per decoding step, split
    out = _run("diagnostics/profile_decode_host.py", ["--device", "cpu", "--model", "tiny", "--batches", "2",
                                                      "--prompt", "8", "--new", "12", "--reps", "1", "--pad"],
               tmp_path, out=False)
    row = next(line.split() for line in out.splitlines() if line.lstrip().startswith("2 forge graphs"))
    # batch, the variant (2 words), the step, its 6 parts and the rest, the graph's device time, the call
    assert len(row) == 13 and float(row[3]) > 0 and row[11] == "-", out
    # three calls of 11 decoding steps: after the capture (the third) forge prepared every step
    assert "'decode_captures': 1" in out and "'prepared': 30" in out, out


def test_results_overwrite_latest_and_append_history(tmp_path, monkeypatch):
    """A re-run of a case replaces its result files and adds a history row; bench/record.py
    copies results made elsewhere into a results folder the same way."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import _common as bc
    import record

    made = tmp_path / "gpu_out"
    for ms in (2.0, 1.5):
        jpath, _ = bc.write_results(made, "profile_step", [{"variant": "eager", "ms": ms}], case="tiny-train-1x16")
    assert sorted(p.name for p in made.iterdir()) == [
        "history.csv", "profile_step-tiny-train-1x16-cpu.csv", "profile_step-tiny-train-1x16-cpu.json"]
    assert json.loads(jpath.read_text())["rows"] == [{"variant": "eager", "ms": 1.5}]
    with (made / "history.csv").open() as f:
        hist = list(csv.DictReader(f))
    assert [h["summary"] for h in hist] == ["eager: ms=2", "eager: ms=1.5"]
    assert {h["case"] for h in hist} == {"tiny-train-1x16"} and all(h["date"] for h in hist)

    repo = tmp_path / "results"
    record.record([jpath], repo)
    record.record([jpath], repo)
    assert (repo / jpath.name).read_text() == jpath.read_text() and (repo / "profile_step-tiny-train-1x16-cpu.csv").exists()
    with (repo / "history.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2
    with pytest.raises(SystemExit, match="not a result file"):
        record.record([made / "history.csv"], repo)


def test_device_tag_names_the_chip(monkeypatch):
    # result files carry the chip's model word, not the name's last word (an H100 once wrote
    # bench_patch_bisect-...-hbm3.json)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import _common as bc

    names = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA A100-SXM4-80GB": "a100",
             "NVIDIA GeForce RTX 4090": "4090", "cpu": "cpu"}
    assert {n: bc.device_tag(n) for n in names} == names


def test_results_are_named_after_the_script(tmp_path, monkeypatch):
    """Whatever name a benchmark passes, its files carry its script's name: results of
    bench/bench_flce.py are bench_flce-<case>-<device>.*, a diagnostic's the same way."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import _common as bc

    for script, given in (("bench_flce.py", "flce"), ("diagnostics/diag_flce_grad_w.py", "flce_grad_w")):
        monkeypatch.setattr(sys.modules["__main__"], "__file__", str(ROOT / "bench" / script), raising=False)
        jpath, cpath = bc.write_results(tmp_path, given, [{"case": "tiny", "impl": "eager", "ms": 1.0}], case="tiny")
        stem = Path(script).stem
        assert jpath.name == f"{stem}-tiny-cpu.json" and cpath.name == f"{stem}-tiny-cpu.csv"
        assert json.loads(jpath.read_text())["benchmark"] == stem
    # the project's recorded results follow the rule (a name older runs had is not left behind)
    scripts = {p.stem for p in (ROOT / "bench").rglob("*.py")} | {p.stem for p in (ROOT / "examples").glob("*.py")}
    for f in (ROOT / "bench" / "results").iterdir():
        if f.name != "history.csv":
            assert any(f.name.startswith(s + "-") for s in scripts), f"{f.name}: not <script>-<case>-<device>"


@pytest.mark.slow
def test_bench_lora_curve_quick(tmp_path):
    # the curves' plot is SVG from the standard library: drawn with or without matplotlib
    _run("bench_lora_curve.py", ["--quick"], tmp_path)
    rows = _rows(tmp_path, "bench_lora_curve")
    assert {"step", "eager", "eager, other dropout seed"} <= rows[0].keys()
    svg = next(tmp_path.glob("bench_lora_curve*.svg")).read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 3


def test_svg_line_chart(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import svgplot

    assert svgplot.ticks(0.0, 1.0) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    t = svgplot.ticks(2.13, 9.7)
    assert t[0] <= 2.13 and t[-1] >= 9.7 and len(t) <= 7
    path = svgplot.line_chart(tmp_path / "c.svg", {"a <1>": [3.0, 2.0, float("nan"), 1.0], "b": [1.0, 1.5]},
                              title="t & u", xlabel="step", ylabel="loss")
    svg = path.read_text()
    # both series drawn (the NaN left out of the first), labels escaped
    assert svg.count("<polyline") == 2 and "a &lt;1&gt;" in svg and "t &amp; u" in svg
    first = svg.split('<polyline points="')[1].split('"')[0].split()
    assert len(first) == 3
    with pytest.raises(ValueError, match="nothing to plot"):
        svgplot.line_chart(tmp_path / "e.svg", {"a": [float("nan")]})
