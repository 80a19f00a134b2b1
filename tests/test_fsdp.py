"""forge under FSDP2 (``torch.distributed.fsdp.fully_shard``), two processes.

Each module-scoped launch runs ``tests/fsdp_worker.py`` under ``torch.distributed.run`` (two
ranks, a free port): the same random-weight qwen2 on both ranks, ``fully_shard`` on every decoder
layer and on the root, patched by forge before or after sharding, AdamW steps on per-rank tokens.
Between sharding and the step the parameters are DTensor shards; FSDP2 swaps the gathered
tensors in around each forward and backward, which forge's forwards read at call time
(forge/patching/forwards.py): a weight captured at patch time would be stale or sharded.

The checks: the global loss at every step (and on CPU the first step's gradients, gathered to
full tensors) meet the oracle's rule (forge/spec/tolerance.py) against the same FSDP2 run
unpatched in float64 (CPU) or float32 (GPU), with the unpatched FSDP2 run in the test dtype as
the eager baseline; every kernel forge patched fused every call (``min_elements=0``); the layers
were really sharded; and what FSDP2 frees stays free: no tensor saved for the backward is a copy
of a gathered weight, and (full fine-tune) every layer is resharded before the backward reaches
the embedding (``assert_holds_nothing``; saving a copy of one weight per layer fails it).

CPU (gloo): torch 2.13's ``fully_shard`` runs on CPU tensors with gloo, so this is FSDP2 itself,
not a stand-in. The tiny qwen2 (hidden 64, 2 layers), 2 AdamW steps, both interpreters: full
fine-tune patched with Triton before sharding and Pallas after, LoRA with Triton after and
Pallas before (every backend and placement once; the interpreters make each run seconds).

GPU (``-m gpu``, two GPUs, NCCL): 4 layers at the Qwen2.5-0.5B widths, 2 x 512 tokens per rank,
20 AdamW steps, both backends, both placements. Full fine-tune with fp32 master weights computed
in bf16 (FSDP2's MixedPrecisionPolicy); LoRA r=16 on all seven projections with the base in
bf16 and adapters in fp32. With ``lora_dropout=0.05`` the dropout masks are random draws, so
forge's run cannot be compared bit-for-bit-close with eager's; it must track eager's loss within
1% at every step, the issue's criterion for the fine-tuning example.
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from forge import ops  # noqa: E402
from forge.__main__ import SHAPES  # noqa: E402
from forge.spec import tolerance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "fsdp_worker.py"


def _fsdp_missing() -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return f"torch.distributed.fsdp.fully_shard (FSDP2) is missing: {e}"
    return None


pytestmark = pytest.mark.skipif(_fsdp_missing() is not None, reason=str(_fsdp_missing()))


def launch(tmp: Path, runs: list[str], *args: str, timeout: int) -> dict:
    """Run the worker on two ranks; returns {"runs": {name: info}, "grads": {name: {param: grad}}}."""
    out = tmp / "res"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
           "--runs", *runs, *args, "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"worker failed (rc {r.returncode}):\n{(r.stdout + r.stderr)[-6000:]}"
    res = json.loads(out.with_suffix(".json").read_text())
    grads = out.with_suffix(".pt")
    res["grads"] = torch.load(grads) if grads.exists() else {}
    return res


def reduction(shape: str, tokens: int) -> int:
    # the longest fp32 accumulation behind the loss: vocab, widths, tokens (test_lora_patching)
    s = SHAPES[shape]
    return max(s["vocab_size"], s["intermediate_size"], s["hidden_size"], tokens)


def assert_rule(res, name, ref, eager, dtype, k):
    runs = res["runs"]
    lf, lr, le = (torch.tensor(runs[n]["losses"], dtype=torch.float64) for n in (name, ref, eager))
    assert len(lf) == len(lr) == len(le)
    for i in range(len(lf)):
        tolerance.assert_close(f"{name} loss at step {i}", lf[i], lr[i], le[i], dtype, k)
    gf, gr, ge = (res["grads"].get(n, {}) for n in (name, ref, eager))
    assert gf.keys() == gr.keys() == ge.keys()
    for p in gr:
        assert gf[p].abs().sum() > 0, f"{name}: {p} has a zero gradient"
        tolerance.assert_close(f"{name} grad {p}", gf[p], gr[p], ge[p], dtype, k)


def assert_fused(info, layers, lora):
    """Every kernel forge patched ran fused on every call; the layers were FSDP2-sharded."""
    counts, guard = info["counts"], info["guard"]
    assert info["layer_class"].startswith("FSDP"), info["layer_class"]
    want = ("lora_qkv", "lora_mlp") if lora else ("swiglu",)
    for key in ("rmsnorm", "rope", "fused_linear_ce") + want:
        assert counts.get(key), f"{key} not patched: {info['skipped'].get(key)}"
    for key in want:
        assert counts[key] == layers, (key, counts, info["skipped"])
    for key, st in guard.items():
        assert st["fallback"] == 0 and (st["fused"] > 0 or key not in counts), (key, guard)


def assert_holds_nothing(info, name, full):
    """What FSDP2 frees, forge leaves free (tests/fsdp_worker.py::watched_forward): no copy of a
    layer's gathered weight saved for the backward, and (a full fine-tune, whose backward reaches
    the embedding) every decoder layer resharded by then."""
    w = info["watch"]
    assert w["saved"] > 0, (name, w)
    assert w["weight_copies"] == 0, f"{name}: {w['weight_copies']} saved copies of a gathered weight outlive the forward"
    if full:
        assert w.get("gathered") == 0, f"{name}: decoder layers still gathered after their backward: {w}"


# ------------------------------------------------------------------ CPU: gloo, interpreters
CPU_RUNS = {  # name -> (fine-tune, kind); each backend and placement once
    "triton_before": ("", "triton:before"),
    "pallas_after": ("", "pallas:after"),
    "lora_triton_after": ("lora/", "triton:after"),
    "lora_pallas_before": ("lora/", "pallas:before"),
}
CPU_TOKENS = (1, 16)  # batch x sequence per rank


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    runs = ["ref=eager:fp64", "eager=eager", "lora_ref=lora/eager:fp64", "lora_eager=lora/eager",
            "dlora_eager=dlora/eager"]
    runs += [f"{n}={ft}{kind}" for n, (ft, kind) in CPU_RUNS.items() if ops.availability(kind.split(":")[0])[0]]
    if ops.availability("triton")[0]:
        runs.append("dlora_triton_after=dlora/triton:after")
    b, s = CPU_TOKENS
    return launch(tmp_path_factory.mktemp("fsdp_cpu"), runs, "--device", "cpu", "--steps", "2", "--batch", str(b),
                  "--seq", str(s), "--grads", "--lora-dropout", "0.05", timeout=600)


@pytest.mark.parametrize("name", list(CPU_RUNS))
def test_fsdp2_cpu_matches_eager(cpu_results, name):
    ft, kind = CPU_RUNS[name]
    ok, why = ops.availability(kind.split(":")[0])
    if not ok:
        pytest.skip(why)
    lora = ft == "lora/"
    info = cpu_results["runs"][name]
    assert_fused(info, SHAPES["cpu"]["num_hidden_layers"], lora)
    pre = "lora_" if lora else ""
    assert_holds_nothing(cpu_results["runs"][pre + "eager"], pre + "eager", not lora)  # (eager keeps it too)
    assert_holds_nothing(info, name, not lora)
    assert_rule(cpu_results, name, pre + "ref", pre + "eager", torch.float32, reduction("cpu", CPU_TOKENS[0] * CPU_TOKENS[1]))


def test_fsdp2_cpu_lora_dropout_tracks_eager(cpu_results):
    """LoRA with lora_dropout=0.05, patched after fully_shard (examples/finetune_lora_fsdp2.py's
    setting): forge draws its masks in the kernels (docs/lora.md), independent of peft's, so its
    losses track eager's within 1% at every step (the GPU test's criterion), and they differ
    from the same run without dropout (the masks are applied)."""
    ok, why = ops.availability("triton")
    if not ok:
        pytest.skip(why)
    info = cpu_results["runs"]["dlora_triton_after"]
    assert_fused(info, SHAPES["cpu"]["num_hidden_layers"], True)
    runs = cpu_results["runs"]
    for i, (f, e) in enumerate(zip(runs["dlora_triton_after"]["losses"], runs["dlora_eager"]["losses"])):
        assert abs(f - e) <= 0.01 * abs(e), f"loss at step {i}: forge {f} vs eager {e}"
    if "lora_triton_after" in runs:
        assert runs["dlora_triton_after"]["losses"] != runs["lora_triton_after"]["losses"]
    gf = cpu_results["grads"]["dlora_triton_after"]
    assert gf.keys() == cpu_results["grads"]["dlora_eager"].keys() and gf
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in gf.values())


# ------------------------------------------------------------------ two GPUs: NCCL, compiled kernels
GPU_SHAPE, GPU_TOKENS, GPU_STEPS = "gpu_demo", (2, 512), 20
GPU_ARGS = ("--device", "cuda", "--shape", GPU_SHAPE, "--dtype", "bf16", "--steps", str(GPU_STEPS),
            "--batch", str(GPU_TOKENS[0]), "--seq", str(GPU_TOKENS[1]), "--lr", "1e-4", "--lora-lr", "1e-3",
            "--lora-r", "16", "--lora-dropout", "0.05")
FTS = ("full", "lora", "dlora")  # full fine-tune; LoRA r=16 without and with dropout 0.05


def _two_gpus() -> str | None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return None if n >= 2 else f"needs two CUDA GPUs for two FSDP2 ranks; {n} visible"


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory):
    """One launch per backend (``eager`` holds the references): a backend that fails on one rank
    fails its own tests only."""
    cache = {}

    def get(backend):
        if backend not in cache:
            why = _two_gpus()
            if why:
                pytest.skip(why)
            if backend == "eager":
                runs = [f"{ft}_ref={ft}/eager:fp32" for ft in ("full", "lora")] + [f"{ft}_eager={ft}/eager" for ft in FTS]
            else:
                runs = [f"{ft}_{w}={ft}/{backend}:{w}" for ft in FTS for w in ("before", "after")]
                if backend == "triton":
                    runs.append(f"full_graphs=full/{backend}:after+graphs")
            cache[backend] = launch(tmp_path_factory.mktemp(f"fsdp_{backend}"), runs, *GPU_ARGS, timeout=900)
        return cache[backend]

    return get


@pytest.mark.gpu
@pytest.mark.skipif(_two_gpus() is not None, reason=str(_two_gpus()))
@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("ft", FTS)
@pytest.mark.parametrize("backend", ops.BACKENDS)
def test_fsdp2_two_gpus_matches_eager(gpu_results, backend, ft, where):
    ok, why = ops.availability(backend)
    if not ok:
        pytest.skip(why)
    base, res = gpu_results("eager"), gpu_results(backend)
    name = f"{ft}_{where}"
    info = res["runs"][name]
    assert_fused(info, SHAPES[GPU_SHAPE]["num_hidden_layers"], ft != "full")
    assert_holds_nothing(base["runs"][f"{ft}_eager"], f"{ft}_eager", ft == "full")
    assert_holds_nothing(info, name, ft == "full")
    eager = base["runs"][f"{ft}_eager"]["losses"]
    if ft == "dlora":  # independent dropout draws: the 1% criterion, step by step
        for i, (f, e) in enumerate(zip(info["losses"], eager)):
            assert abs(f - e) <= 0.01 * abs(e), f"step {i}: forge {f:.4f} vs eager {e:.4f}"
        return
    merged = {"runs": {name: info, **base["runs"]}, "grads": {}}
    assert_rule(merged, name, f"{ft}_ref", f"{ft}_eager", torch.bfloat16, reduction(GPU_SHAPE, GPU_TOKENS[0] * GPU_TOKENS[1]))


@pytest.mark.gpu
@pytest.mark.skipif(_two_gpus() is not None, reason=str(_two_gpus()))
def test_fsdp2_graphs_decline_module_hooks(gpu_results):
    """graphs=True under FSDP2: every pass runs uncaptured, because fully_shard registers forward
    hooks on each decoder layer (forge.patching.graphs replays only unhooked layers); the step is
    still forge's, and right."""
    base, res = gpu_results("eager"), gpu_results("triton")
    info = res["runs"]["full_graphs"]
    st = info["graphs"]
    assert st["replayed"] == 0 and st["captures"] == 0, st
    assert st["why_uncaptured"] == {"module hooks": GPU_STEPS}, st
    merged = {"runs": {"full_graphs": info, **base["runs"]}, "grads": {}}
    assert_rule(merged, "full_graphs", "full_ref", "full_eager", torch.bfloat16,
                reduction(GPU_SHAPE, GPU_TOKENS[0] * GPU_TOKENS[1]))


# ------------------------------------------------------------------ the example, as CI runs it
def test_finetune_example_quick(tmp_path):
    # examples/finetune_lora_fsdp2.py --quick: two gloo ranks on the CPU, eager and forge side by
    # side, LoRA with dropout 0.05, a tokenizer trained here on installed packages' docs; every
    # artifact the example promises is written and forge's losses track eager's
    import csv

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ft"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(root / "examples" / "finetune_lora_fsdp2.py"), "--quick", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=root)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["args"]["lora_dropout"] == 0.05
    for mode in ("eager", "forge"):
        ranks = summary["per_rank"][mode]
        assert len(ranks) == 2 and all(x["tokens_per_s"] > 0 for x in ranks), ranks
        assert (out / f"adapter-{mode}" / "adapter_model.safetensors").stat().st_size > 0
    assert summary["forge"]["counts"].get("lora_qkv") and summary["forge"]["counts"].get("lora_mlp"), summary["forge"]
    rows = list(csv.DictReader((out / "loss.csv").open()))
    assert len(rows) == summary["args"]["steps"]
    for row in rows:  # the rule for the example: within 1% at every logged step
        e, f = float(row["loss_eager"]), float(row["loss_forge"])
        assert abs(f - e) <= 0.01 * abs(e), row
    svg = (out / "loss.svg").read_text()  # drawn with no extra install
    assert svg.startswith("<svg") and svg.count("<polyline") == 2
