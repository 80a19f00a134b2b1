"""The patching layer at its edges (issue 19): save/load and deepcopy of a patched model, backend
checks at patch time, auto's choice on a CPU, threads in Triton's interpreter, the "forge"
logger and forge.report, argument types, ``forge.ops`` after ``import forge``.

Tiny models; most cases fall back through the guard (``min_elements=NEVER``: the patched
forwards run and count, the kernels do not) so few interpreted kernels run. On a CUDA machine
the unmarked (CPU) cases skip (tests/conftest.py) and the gpu-marked case runs.
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import ast  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import io  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import forge  # noqa: E402
from forge import ops  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.patching import report as report_mod  # noqa: E402
from forge.spec import tolerance  # noqa: E402

NEVER = forge.NEVER
ROOT = pathlib.Path(__file__).resolve().parents[1]
PALLAS = ops.availability("pallas")
needs_pallas = pytest.mark.skipif(not PALLAS[0], reason=f"pallas backend unavailable: {PALLAS[1]}")


def ids_for(model, b=2, s=4):
    return torch.randint(0, model.config.vocab_size, (b, s))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def forge_entries(model):
    """Modules carrying anything forge installs on an instance."""
    return [m for m in model.modules() if {"forward", "__reduce_ex__", "__deepcopy__"} & m.__dict__.keys()
            or any(k.startswith("_forge") for k in m.__dict__)]


@pytest.fixture
def qwen2():
    return build_model("qwen2")


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(report_mod, "_WARNED", set())


def run_py(code, **env):
    e = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# ---------------------------------------------------------------------------------------------
# 1. torch.save / torch.load: the loaded model comes back patched, on its own statistics


def test_save_load_comes_back_patched(qwen2):
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm", "rope"], min_elements=NEVER)
    ids = ids_for(qwen2)
    want = logits(qwen2, ids)
    buf = io.BytesIO()
    torch.save(qwen2, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded._forge_patched_counts == {"rmsnorm": 5, "rope": 2}
    assert forge.report(loaded).patched
    assert torch.equal(logits(loaded, ids), want)
    # the loaded model's patched forwards ran, and counted in its own statistics
    assert loaded._forge_guard_stats.as_dict() == {"rmsnorm": {"fused": 0, "fallback": 5},
                                                   "rope": {"fused": 0, "fallback": 2}}
    assert qwen2._forge_guard_stats.fallback("rmsnorm") == 5
    forge.unpatch(loaded)
    assert not forge_entries(loaded) and not forge.report(loaded).patched
    forge.patch(loaded, mode="infer", kernels=["rmsnorm"])  # patch() works on it
    assert loaded._forge_patched_counts == {"rmsnorm": 5}


def test_save_load_of_a_peft_wrapped_model():
    peft = pytest.importorskip("peft")
    model = build_model("qwen2")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"]))
    forge.patch(pm, mode="infer", kernels=["rmsnorm"], min_elements=NEVER)
    buf = io.BytesIO()
    torch.save(pm, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for obj in (loaded, loaded.get_base_model()):
        assert obj._forge_patched_counts == {"rmsnorm": 5}
    ids = ids_for(model)
    assert torch.equal(logits(loaded, ids), logits(pm, ids))
    assert loaded._forge_guard_stats.fallback("rmsnorm") == 5
    forge.unpatch(loaded)
    assert not forge_entries(loaded)
    # deepcopy through peft's wrappers (which forward unknown attributes to the model inside)
    dup = copy.deepcopy(pm)
    assert type(dup.base_model) is type(pm.base_model) and dup.get_base_model() is not model
    assert dup._forge_guard_stats is not pm._forge_guard_stats
    assert torch.equal(logits(dup, ids), logits(pm, ids)) and dup._forge_guard_stats.fallback("rmsnorm") == 5


# ---------------------------------------------------------------------------------------------
# 2. copy.deepcopy: an independent patched copy


def test_deepcopy_has_its_own_statistics(qwen2):
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm", "rope"], min_elements=NEVER)
    dup = copy.deepcopy(qwen2)
    assert dup._forge_guard_stats is not qwen2._forge_guard_stats
    logits(dup, ids_for(dup))
    assert dup._forge_guard_stats.fallback("rmsnorm") == 5
    assert qwen2._forge_guard_stats.as_dict() == {"rmsnorm": {"fused": 0, "fallback": 0},
                                                  "rope": {"fused": 0, "fallback": 0}}
    forge.unpatch(dup)
    # the original keeps its 5 RMSNorm, 2 attention and 1 decoder (the mask under torch.compile) forwards
    assert not forge_entries(dup) and len([m for m in qwen2.modules() if "forward" in m.__dict__]) == 8


def test_deepcopy_runs_on_its_own_weights(qwen2):
    ids = ids_for(qwen2)
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"], min_elements=0)
    before = logits(qwen2, ids)
    dup = copy.deepcopy(qwen2)
    with torch.no_grad():
        dup.model.norm.weight.mul_(torch.rand_like(dup.model.norm.weight) * 4)
    got = logits(dup, ids)
    assert dup._forge_guard_stats.fused("rmsnorm") == 5  # the copy's kernels ran
    assert torch.equal(logits(qwen2, ids), before)  # the original is untouched
    eager = copy.deepcopy(dup)
    forge.unpatch(eager)
    want = logits(eager, ids)
    ref = logits(eager.double(), ids)
    tolerance.assert_close("logits", got, ref, want, torch.float32, qwen2.config.vocab_size)
    assert (before - want).abs().max() > 100 * (got - want).abs().max()


def test_copy_of_one_layer_is_unpatched_and_shallow_copy_shares(qwen2):
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"], min_elements=NEVER)
    layer = copy.deepcopy(qwen2.model.layers[0])
    assert not forge_entries(layer)
    shallow = copy.copy(qwen2)
    assert shallow.model is qwen2.model and shallow._forge_patched_counts == {"rmsnorm": 5}


def test_unpatching_a_shallow_copy_leaves_no_half_patched_original(qwen2):
    # the shared modules are unpatched with it: the original said it was still patched
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"], min_elements=NEVER)
    forge.unpatch(copy.copy(qwen2))
    assert not forge.report(qwen2).patched and not forge_entries(qwen2)


def test_deepcopy_of_a_shallow_copy(qwen2):
    # the shallow copy carries the original's hooks in its own dict: it deep-copies as the
    # original (whose modules it shares), a patched model of its own
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"], min_elements=NEVER)
    dup = copy.deepcopy(copy.copy(qwen2))
    assert type(dup) is type(qwen2) and dup.model is not qwen2.model and forge.report(dup).patched
    ids = ids_for(qwen2)
    assert torch.equal(logits(dup, ids), logits(qwen2, ids))


@pytest.mark.parametrize("wrap", ["peft", "compile"])
def test_deepcopy_of_a_wrapper_made_after_patching_keeps_the_wrapper(qwen2, wrap):
    # PeftModel and torch.compile's OptimizedModule hand unknown attributes to their child, so
    # copy.deepcopy found the patched model's own hook and returned a copy of the bare model
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"], min_elements=NEVER)
    if wrap == "peft":
        peft = pytest.importorskip("peft")
        outer = peft.get_peft_model(qwen2, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    else:
        outer = torch.compile(qwen2)
    dup = copy.deepcopy(outer)
    assert type(dup) is type(outer)
    inner = dup.get_base_model() if wrap == "peft" else dup._orig_mod
    assert inner is not qwen2 and forge.report(inner).patched
    assert inner._forge_guard_stats is not qwen2._forge_guard_stats


def test_deepcopy_of_a_forward_wrapped_after_patching_warns(qwen2, caplog):
    # (accelerate's prepare wraps forward around forge's: the wrapper closes over the original's
    # forge forward, so the copy cannot keep it, and says so)
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"], min_elements=NEVER)
    norm = qwen2.model.norm
    inner = norm.forward
    norm.forward = lambda *a, **k: inner(*a, **k)
    with caplog.at_level(logging.WARNING, logger="forge"):
        dup = copy.deepcopy(qwen2)
    assert any("replaced after forge.patch" in r.getMessage() for r in caplog.records)
    assert forge.report(dup).patched


# ---------------------------------------------------------------------------------------------
# 3. a backend that cannot run this model is refused at patch time (auto takes another)


def test_triton_compiled_on_a_cpu_machine_is_refused_at_patch_time():
    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    out = run_py(
        "import forge, torch\n"
        "from forge.__main__ import build_model\n"
        "m = build_model('qwen2')\n"
        "try:\n"
        "    forge.patch(m, backend='triton')\n"
        "except forge.BackendUnavailableError as e:\n"
        "    print('refused:', e)\n"
        "forge.patch(m, mode='infer', kernels=['rmsnorm'], min_elements=0)\n"
        "print('auto:', m._forge_backends, m._forge_skipped.get('rmsnorm'))\n"
        "m(torch.zeros(1, 3, dtype=torch.long))\n",
        TRITON_INTERPRET="0")
    assert "refused: triton: TRITON_INTERPRET=0 and there is no CUDA device" in out
    if PALLAS[0]:
        assert "auto: {'rmsnorm': 'pallas'} None" in out
    else:
        assert "auto: {} no backend can run rmsnorm" in out


@needs_pallas
def test_float64_with_pallas_needs_x64(monkeypatch):
    from bridge import runtime

    monkeypatch.setattr(runtime, "x64_enabled", lambda: False)
    model = build_model("qwen2", dtype=torch.float64)
    with pytest.raises(forge.BackendUnavailableError, match="float64 parameters but JAX runs without x64"):
        forge.patch(model, backend="pallas")
    assert not forge_entries(model)
    forge.patch(model, mode="infer", kernels=["rmsnorm"], min_elements=NEVER)
    assert model._forge_backends == {"rmsnorm": "triton"}


def test_meta_device_model_is_declined_at_patch_time():
    from transformers import AutoModelForCausalLM

    from forge.__main__ import model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config("qwen2"))
    with pytest.raises(forge.BackendUnavailableError, match="meta device"):
        forge.patch(model, backend="triton")
    forge.patch(model, kernels=["rmsnorm", "rope"])
    assert model._forge_patched_counts == {}
    assert "meta device" in model._forge_skipped["rmsnorm"] and "meta device" in model._forge_skipped["rope"]


# ---------------------------------------------------------------------------------------------
# 4. auto on a CPU: Pallas' interpreter (faster), said once in the log


def test_auto_on_cpu_prefers_the_pallas_interpreter(qwen2, monkeypatch, caplog, fresh_warnings):
    if torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    caplog.set_level(logging.INFO, logger="forge")
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"])
    assert qwen2._forge_backends == {"rmsnorm": "pallas" if PALLAS[0] else "triton"}
    forge.patch(build_model("qwen2"), mode="infer", kernels=["rmsnorm"])
    slow = [r for r in caplog.records if "interpreters" in r.getMessage()]
    assert len(slow) == 1 and slow[0].levelno == logging.INFO
    real = ops.availability
    monkeypatch.setattr(ops, "availability", lambda b: (False, "test: no jax") if b == "pallas" else real(b))
    forge.patch(qwen2, mode="infer", kernels=["rope"])
    assert qwen2._forge_backends == {"rope": "triton"}


# ---------------------------------------------------------------------------------------------
# 5. threads: interpreted Triton launches are serialised


def test_two_threads_in_the_triton_interpreter(qwen2):
    if not _runtime.triton_interpreted():
        pytest.skip("Triton compiles for the GPU here: no interpreter")
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"], backend="triton", min_elements=0)
    inputs = [ids_for(qwen2, 2, 8) for _ in range(2)]
    want = [logits(qwen2, ids) for ids in inputs]
    got, errors = [[], []], []
    start = threading.Barrier(2)
    # a race: without the lock this crashed ("Did you forget to add @triton.jit?") in 7 of 8 runs here
    # (each after a Pallas test); with it, it cannot crash
    N = 30

    def work(i):
        try:
            start.wait()
            for _ in range(N):
                got[i].append(logits(qwen2, inputs[i]))
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert len(got[i]) == N and all(torch.equal(g, want[i]) for g in got[i])


# ---------------------------------------------------------------------------------------------
# 6. the "forge" logger and forge.report


def test_patch_logs_a_summary_and_warns_once_per_reason(caplog, fresh_warnings, monkeypatch):
    caplog.set_level(logging.INFO, logger="forge")
    monkeypatch.setattr(forge, "MIN_FUSED_ELEMENTS", {"triton": NEVER, "pallas": NEVER})
    model = build_model("gemma2", hidden_activation="gelu")  # exact gelu: geglu declined
    forge.patch(model, mode="infer", kernels=["rmsnorm", "geglu"], graphs=True)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("forge.patch: Gemma2ForCausalLM (mode=infer)" in m and "rmsnorm" in m for m in info)
    assert sum("geglu declined" in m and "gelu" in m for m in warn) == 1
    assert sum("graphs=True" in m and "uncaptured" in m for m in warn) == 1
    assert sum("rmsnorm" in m and "default min_elements is forge.NEVER" in m for m in warn) == 1
    caplog.clear()
    forge.patch(build_model("gemma2", hidden_activation="gelu"), mode="infer", kernels=["rmsnorm", "geglu"],
                graphs=True)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # each reason once
    # kernels that merely do not apply (no adapters, infer mode) are in the summary, not warned;
    # a guard the caller set to NEVER is no surprise either
    caplog.clear()
    forge.patch(build_model("qwen2"), mode="infer", min_elements=NEVER)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_report_counts_what_ran(qwen2):
    assert not forge.report(qwen2).patched and "not patched" in str(forge.report(qwen2))
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm", "rope", "lora_qkv"],
                min_elements={"rmsnorm": NEVER, "rope": NEVER})
    logits(qwen2, ids_for(qwen2))
    rep = forge.report(qwen2)
    rms = rep.kernels["rmsnorm"]
    assert (rms.modules, rms.fused, rms.fallback, rms.min_elements) == (5, 0, 5, NEVER)
    assert rms.backend in ops.BACKENDS and rep.kernels["rope"].fallback == 2
    assert rep.kernels["lora_qkv"].skipped and rep.kernels["lora_qkv"].backend is None
    text = str(rep)
    assert "rmsnorm" in text and "never" in text and "lora_qkv: mode='infer' declines lora_qkv" in text
    assert "a compiled call is not counted" in text  # (the counters stand still under torch.compile)
    assert "not counted" not in rep.table(calls=False)
    assert rep.as_dict()["kernels"]["rmsnorm"]["fallback"] == 5


def test_glu_skip_says_lora_took_the_mlps():
    peft = pytest.importorskip("peft")
    model = build_model("qwen2")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
    forge.patch(pm, kernels=["swiglu", "lora_mlp"])
    assert pm._forge_patched_counts == {"lora_mlp": 2}
    assert "lora_mlp kernel runs all 2 MLP modules" in pm._forge_skipped["swiglu"]


def test_no_print_in_forge():
    # forge speaks through logging.getLogger("forge"); the demo (__main__) prints its table
    offenders = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in (ROOT / "forge").rglob("*.py") if p.name != "__main__.py"
                 for n in ast.walk(ast.parse(p.read_text()))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
    assert not offenders


# ---------------------------------------------------------------------------------------------
# 7. integer-like min_elements; 8. forge.ops after a plain import


@pytest.mark.parametrize("value", [np.int64(0), torch.tensor(3), {"rmsnorm": np.int32(7)}])
def test_min_elements_accepts_integer_like(qwen2, value):
    forge.patch(qwen2, mode="infer", kernels=["rmsnorm"], min_elements=value)
    want = 7 if isinstance(value, dict) else int(value)
    assert forge.report(qwen2).kernels["rmsnorm"].min_elements == want


@pytest.mark.parametrize("value", [True, 1.0, np.float64(2), {"rope": 1.5}, {"rope": False}, "8"])
def test_min_elements_refuses_bools_and_floats(qwen2, value):
    with pytest.raises(TypeError, match="min_elements must be None, a non-negative integer"):
        forge.patch(qwen2, min_elements=value)
    assert not forge_entries(qwen2)


@pytest.mark.parametrize("value, err, match", [
    ("none", TypeError, "compile_kernels must be 'auto', 'all' or a list"),
    (True, TypeError, "compile_kernels must be 'auto', 'all' or a list"),
    (["rmsnorm", "fused_linear_ce"], ValueError, "the fused loss and LoRA kernels always do"),
    (["rms_norm"], ValueError, "compile_kernels lists which of"),
])
def test_compile_kernels_refuses_bad_values(qwen2, value, err, match):
    with pytest.raises(err, match=match):
        forge.patch(qwen2, compile_kernels=value)
    assert not forge_entries(qwen2)


def test_forge_ops_after_plain_import():
    out = run_py("import sys, forge\n"
                 "print(callable(forge.ops.get), forge.ops.BACKENDS)\n"
                 "print(sorted(m for m in ('forge_triton', 'bridge', 'jax', 'triton') if m in sys.modules))\n")
    assert out.splitlines() == ["True ('triton', 'pallas')", "[]"]


# ---------------------------------------------------------------------------------------------
# the same on a GPU: compiled kernels in copies, and a CPU model refused where Triton compiles


@pytest.mark.gpu
def test_gpu_copies_run_fused_and_a_cpu_model_is_refused():
    model = build_model("qwen2", device="cuda")
    forge.patch(model, mode="infer", kernels=["rmsnorm", "rope"], min_elements=0)
    assert model._forge_backends == {"rmsnorm": "triton", "rope": "triton"}  # auto on CUDA: triton
    ids = ids_for(model).cuda()
    want = logits(model, ids)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for dup in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert dup._forge_backends == model._forge_backends
        assert torch.equal(logits(dup, ids), want)
        assert dup._forge_guard_stats.as_dict() == {"rmsnorm": {"fused": 5, "fallback": 0},
                                                    "rope": {"fused": 2, "fallback": 0}}
    assert model._forge_guard_stats.fused("rmsnorm") == 5  # only its own call
    cpu_model = build_model("qwen2")
    with pytest.raises(forge.BackendUnavailableError, match="triton: the model is on cpu, but Triton compiles for CUDA"):
        forge.patch(cpu_model, backend="triton")
    forge.patch(cpu_model, mode="infer", kernels=["rmsnorm"])
    assert cpu_model._forge_patched_counts == {}
    assert "no backend can run rmsnorm" in cpu_model._forge_skipped["rmsnorm"]


def test_pallas_defaults_follow_its_launch_path(monkeypatch):
    # MIN_FUSED_ELEMENTS["pallas"] is calibrated for the native launch; where every call goes
    # through DLPack (no native path: CPU, or a JAX whose internals moved) "pallas-dlpack" holds
    ok, why = ops.availability("pallas")
    if not ok:
        pytest.skip(why)
    from bridge import native

    def threshold(native_ok):
        monkeypatch.setattr(native, "available", lambda: (native_ok, "" if native_ok else "test: no native path"))
        model = build_model("qwen2")
        forge.patch(model, mode="infer", backend="pallas", kernels=["rmsnorm"])
        return forge.report(model).kernels["rmsnorm"].min_elements

    tables = forge.MIN_FUSED_ELEMENTS
    assert threshold(True) == tables["pallas"]["infer"]["rmsnorm"] == 0
    assert threshold(False) == NEVER  # tables["pallas-dlpack"]["infer"]
    monkeypatch.setattr(forge, "MIN_FUSED_ELEMENTS", {"triton": 0, "pallas": 7})  # no dlpack entry: "pallas"
    assert threshold(False) == 7


def _forge_forwards(model):
    return [n for n, m in model.named_modules()
            if getattr(getattr(m.__dict__.get("forward"), "__func__", None), "__module__", "").startswith("forge.")]


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_patched_then_offloaded_by_accelerate(mode):
    # patch, then accelerate's cpu_offload (its hooks wrap forge's forwards and load each
    # module's weights from the meta device per call): the outputs equal the unpatched model's
    # under the same hooks; unpatch gives the hooks the module's own forward (it had removed the
    # hooks with forge's forwards: the next call ran on meta weights), and removing the hooks
    # afterwards brings no forge forward back
    accelerate = pytest.importorskip("accelerate")
    from accelerate.hooks import remove_hook_from_module

    ref = build_model("qwen2").eval()
    model = copy.deepcopy(ref)
    ids = torch.randint(0, ref.config.vocab_size, (2, 8))
    forge.patch(model, mode=mode, min_elements=0)
    accelerate.cpu_offload(ref, execution_device="cpu")
    accelerate.cpu_offload(model, execution_device="cpu")
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
        hooked = {n for n, m in model.named_modules() if "_hf_hook" in m.__dict__}
        forge.unpatch(model)
        assert hooked and hooked == {n for n, m in model.named_modules() if "_hf_hook" in m.__dict__}
        assert all("forward" in model.get_submodule(n).__dict__ for n in hooked)  # the hooks' forwards
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    remove_hook_from_module(model, recurse=True)
    assert not _forge_forwards(model) and not forge.report(model).patched


def test_lora_patched_then_offloaded_runs_peft_on_meta_weights():
    # the fused LoRA kernels read weights directly: on layers accelerate offloaded (meta weights,
    # loaded by a hook per call) peft's code runs (the kernel had received a meta base weight)
    accelerate = pytest.importorskip("accelerate")
    peft = pytest.importorskip("peft")
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    ref = peft.get_peft_model(build_model("qwen2"), peft.LoraConfig(**cfg))
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 256, (2, 8))
    forge.patch(model, min_elements=0)
    accelerate.cpu_offload(ref, execution_device="cpu")
    accelerate.cpu_offload(model, execution_device="cpu")
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss,
                               rtol=1e-5, atol=1e-6)


def test_unpatch_finishes_when_an_undo_step_raises(caplog):
    # one undo step raising (transformers' hub kernels turned back on over a model accelerate
    # offloaded to meta) is logged; the rest of unpatch still runs
    model = forge.patch(build_model("qwen2"), min_elements=0)

    def boom():
        raise ValueError("boom")

    model._forge_state.undo.append(boom)
    with caplog.at_level(logging.WARNING, logger="forge"):
        forge.unpatch(model)
    assert any("boom" in r.getMessage() for r in caplog.records)
    assert not forge.report(model).patched and not _forge_forwards(model)
    assert not [k for k in model.__dict__ if k.startswith("_forge")]


def test_patching_after_dispatch_says_why_nothing_is_patched():
    # accelerate's hooks own every module's forward: forge leaves them, and its reasons say so
    accelerate = pytest.importorskip("accelerate")
    model = build_model("qwen2").eval()
    accelerate.cpu_offload(model, execution_device="cpu")
    forge.patch(model, min_elements=0)
    assert "patch before dispatching" in model._forge_skipped["rmsnorm"]
    assert not any(model._forge_patched_counts.get(k) for k in ("rmsnorm", "swiglu", "rope"))


def _owns(p):
    return p.untyped_storage().nbytes() == p.numel() * p.element_size()


class _Raising(logging.Filter):
    """A logging filter that raises on a record holding ``text`` (a broken log sink, or an
    interrupt arriving while forge logs)."""

    def __init__(self, text):
        super().__init__()
        self.text = text

    def filter(self, record):
        if self.text in record.getMessage():
            raise RuntimeError("log sink down")
        return True


@contextlib.contextmanager
def _raising_logs(text):
    log, f = logging.getLogger("forge"), _Raising(text)
    level = log.level
    log.addFilter(f)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeFilter(f)
        log.setLevel(level)


def test_an_unpatch_stopped_part_way_is_finished_by_the_next():
    # unpatch took forge's state off the model before restoring anything: stopped part-way (here
    # its warning about a forward wrapped after patching raising; equally an interrupt) it left
    # forge's forwards on the model for good, report said unpatched, and unpatch again did nothing
    model = build_model("qwen2").eval()
    ids = ids_for(model)
    ref = logits(model, ids)
    forge.patch(model, min_elements=0)
    inner = model.forward
    model.forward = lambda *a, **k: inner(*a, **k)  # (a wrapper put on after patching, as accelerate's prepare)
    with _raising_logs("replaced after forge.patch"), pytest.raises(RuntimeError, match="log sink down"):
        forge.unpatch(model)
    assert forge.report(model).patched
    forge.unpatch(model)
    assert not forge.report(model).patched and not _forge_forwards(model)
    assert not [k for k in model.__dict__ if k.startswith("_forge")]
    assert torch.equal(logits(model, ids), ref)


def test_an_interrupted_infer_patch_leaves_each_weight_its_own_memory(monkeypatch):
    # mode="infer" moved q/k/v and gate/up weights into one block before their group reached the
    # patch's undo list: an interrupt in between left them sharing one storage for good (a later
    # patch took them for a loader's layout and unpatch left them; savers then drop the views)
    from forge.patching import stacking

    model = build_model("qwen2").eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(_owns(p) for p in model.parameters())

    def interrupted(ts):
        raise KeyboardInterrupt

    monkeypatch.setattr(stacking, "_block_of", interrupted)
    with pytest.raises(KeyboardInterrupt):
        forge.patch(model, mode="infer", min_elements=0)
    monkeypatch.undo()
    assert not forge.report(model).patched
    for n, p in model.named_parameters():
        assert _owns(p) and torch.equal(p, before[n]), n


def test_unpatch_parts_stacked_weights_after_an_out_of_memory_error(monkeypatch):
    # giving stacked weights their own memory back can run out of memory: the error was logged and
    # swallowed, the saving hooks that part them were gone, and the unpatched model kept q/k/v and
    # gate/up as views of one block. Now a failed group keeps its hook and unpatch tries it again;
    # where it fails again unpatch raises, the model stays patched, and the next unpatch finishes
    from forge.patching import stacking

    real = stacking._unmove
    for fails in (1, 1000):
        model = build_model("qwen2").eval()
        ids = ids_for(model)
        ref = logits(model, ids)
        forge.patch(model, mode="infer", min_elements=0)
        assert not all(_owns(p) for p in model.parameters())
        left = [fails]

        def oom(g):
            if left[0] > 0:
                left[0] -= 1
                raise torch.OutOfMemoryError("out of memory (simulated)")
            return real(g)

        monkeypatch.setattr(stacking, "_unmove", oom)
        if fails == 1:
            forge.unpatch(model)
        else:
            with pytest.raises(torch.OutOfMemoryError):
                forge.unpatch(model)
            assert forge.report(model).patched
            monkeypatch.setattr(stacking, "_unmove", real)
            forge.unpatch(model)
        monkeypatch.setattr(stacking, "_unmove", real)
        assert not forge.report(model).patched
        assert all(_owns(p) for p in model.parameters()), fails
        assert not any(m._state_dict_pre_hooks for m in model.modules())
        assert torch.equal(logits(model, ids), ref)


def test_a_failed_patch_turns_transformers_hub_kernels_back_on(tmp_path):
    # patch turned transformers' hub kernels off and made their undo only afterwards: a patch that
    # failed in between (here its own log line raising) left them off for good
    from transformers import AutoModelForCausalLM

    build_model("qwen2").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    if not model.use_kernels:
        pytest.skip("transformers turned no hub kernels on here (no kernels package, or USE_HUB_KERNELS=0)")
    with _raising_logs("hub kernels"), pytest.raises(RuntimeError, match="log sink down"):
        forge.patch(model, min_elements=0)
    assert model.use_kernels and not forge.report(model).patched


def test_an_interrupted_rebuild_leaves_no_module_globals_behind(monkeypatch):
    # a forward rebuilt over a copy of its module's globals registers that copy in sys.modules;
    # a rebuild that failed other than by RebuildError (an interrupt) left the entry behind
    from forge.patching import forwards

    def interrupted(fn, make):
        raise KeyboardInterrupt

    def fn():
        return 1

    monkeypatch.setattr(forwards, "rebuild", interrupted)
    before = {k for k in sys.modules if k.startswith("forge._patched_globals.")}
    with pytest.raises(KeyboardInterrupt):
        forwards.rebuilt_with(fn, fn, {})
    assert {k for k in sys.modules if k.startswith("forge._patched_globals.")} == before


def test_a_failed_patch_of_a_peft_model_leaves_no_hook_on_its_wrappers():
    # a patch failing after it put its copy hooks on the wrappers (here its closing log line
    # raising) took them off the model it was called on and the inner model, not off peft's
    # LoraModel between them, which kept forge's __deepcopy__ with no state to remove it
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(build_model("qwen2"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False))
    ids = ids_for(model)
    ref = logits(model, ids)
    with _raising_logs("  kernel "), pytest.raises(RuntimeError, match="log sink down"):  # (its table)
        forge.patch(model, min_elements=0)
    assert not forge.report(model).patched
    assert not forge_entries(model)
    assert torch.equal(logits(model, ids), ref)
