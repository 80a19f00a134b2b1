"""The "forge" logger's levels (issue 44): forge's own defaults never warn about themselves.

A default ``forge.patch`` (on a CPU: Pallas' interpreter, whose default guard leaves RMSNorm and
RoPE eager) and peft's default ``LoraConfig`` (q and v only: forge's LoRA kernels do not apply)
log their choices at INFO. A WARNING is kept for what the caller asked for that does not happen:
a kernel named in ``kernels=`` that is declined or never fuses. Patch-time only: no kernel runs.
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import forge  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.patching import arch  # noqa: E402
from forge.patching import report as report_mod  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="checks the defaults of a machine without CUDA (the "
                                                "gpu-marked case checks a CUDA model)")


@pytest.fixture
def log(caplog, monkeypatch):
    monkeypatch.setattr(report_mod, "_WARNED", set())  # each reason is said once per process
    caplog.set_level(logging.INFO, logger="forge")
    return caplog


def levels(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "forge" and r.levelno == level]


@cpu_only
@pytest.mark.parametrize("model_type", sorted(arch.SUPPORTED))
def test_default_patch_on_a_cpu_does_not_warn(model_type, log):
    model = forge.patch(build_model(model_type))
    assert not levels(log, logging.WARNING) and not levels(log, logging.ERROR)
    info = "\n".join(levels(log, logging.INFO))
    assert "interpreters" in info and f"{type(model).__name__} (mode=train)" in info
    # what the defaults leave eager is still said, at INFO
    never = [k for k, t in model._forge_state.info.thresholds.items() if t >= forge.NEVER]
    for key in never:
        assert f"{key} on " in info and "forge.NEVER" in info


@cpu_only
def test_default_infer_patch_on_a_cpu_does_not_warn(log):
    forge.patch(build_model("qwen2"), mode="infer")
    assert not levels(log, logging.WARNING)
    assert "mode='infer' declines fused_linear_ce" in "\n".join(levels(log, logging.INFO))


@pytest.mark.gpu
def test_default_patch_on_cuda_does_not_warn(log):
    forge.patch(build_model("qwen2", dtype=torch.bfloat16, device="cuda"))
    forge.patch(build_model("qwen2", dtype=torch.bfloat16, device="cuda"), mode="infer")
    assert not levels(log, logging.WARNING)


@cpu_only
def test_a_named_kernel_that_never_fuses_still_warns(log):
    if forge.patch(build_model("qwen2"), kernels=["rmsnorm"])._forge_state.info.thresholds["rmsnorm"] < forge.NEVER:
        pytest.skip("rmsnorm's default guard fuses on this machine's backend: nothing to warn about")
    assert any("rmsnorm" in m and "forge.NEVER" in m for m in levels(log, logging.WARNING))


def test_no_kernel_named_warns(log):
    model = forge.patch(build_model("qwen2"), kernels=[])
    assert any("nothing is patched" in m for m in levels(log, logging.WARNING))
    assert not any(model._forge_patched_counts.values())


def test_peft_default_lora_config_does_not_warn(log):
    peft = pytest.importorskip("peft")
    device = "cuda" if HAS_CUDA else "cpu"
    pm = peft.get_peft_model(build_model("qwen2", device=device), peft.LoraConfig(r=8))  # q_proj, v_proj
    forge.patch(pm)
    assert not levels(log, logging.WARNING)
    # q and v fused (k's plain product inside the same call); the kernels with nothing to do
    # are in the summary, with the reason
    assert pm._forge_patched_counts["lora_qkv"] == pm.config.num_hidden_layers
    assert "no MLP module has LoRA" in pm._forge_skipped["lora_mlp"]
    info = "\n".join(levels(log, logging.INFO))
    assert "lora_mlp:" in info


def test_lora_kernels_asked_for_by_name_warn_when_they_do_not_apply(log):
    peft = pytest.importorskip("peft")
    device = "cuda" if HAS_CUDA else "cpu"
    pm = peft.get_peft_model(build_model("qwen2", device=device), peft.LoraConfig(r=8))
    forge.patch(pm, kernels=["lora_qkv", "lora_mlp"])
    warn = levels(log, logging.WARNING)
    assert not any("lora_qkv declined" in m for m in warn)  # q and v fused, k plain in the call
    assert sum("lora_mlp declined" in m for m in warn) == 1


@pytest.mark.parametrize("case", ["lm_head_adapter", "ln_tuning"])
def test_peft_wrapped_head_or_norms_are_declined_with_the_wrapper_named(case, log):
    # the reasons named the wrong cause: "no nn.Linear lm_head over a decoder (not a
    # *ForCausalLM)" for a LoRA on lm_head, "no RMSNorm modules named ... found" for LN tuning
    peft = pytest.importorskip("peft")
    device = "cuda" if HAS_CUDA else "cpu"
    if case == "lm_head_adapter":
        cfg = peft.LoraConfig(r=4, target_modules=["lm_head"])
        key, want = "fused_linear_ce", "lm_head is a Linear (from peft)"
    else:
        cfg = peft.LNTuningConfig(target_modules=["input_layernorm", "post_attention_layernorm", "norm"])
        key, want = "rmsnorm", "RMSNorm modules are wrapped"
    pm = peft.get_peft_model(build_model("qwen2", device=device), cfg)
    forge.patch(pm, kernels=[key])
    assert want in pm._forge_skipped[key]
    assert any(f"{key} declined" in m and want in m for m in levels(log, logging.WARNING))


def test_infer_qkv_follows_ropes_guard_and_reports_it(log):
    # the one q/k/v product compared x's elements (rows x hidden) with RoPE's threshold, which
    # RoPE compares with q's and k's (rows x (q + k widths)): at a threshold between the two
    # RoPE fused and the product did not; the report said qkv had no size guard
    model = build_model("qwen2").eval()
    c = model.config
    rows = 2 * 8
    qk = rows * (c.num_attention_heads + c.num_key_value_heads) * (c.hidden_size // c.num_attention_heads)
    assert rows * c.hidden_size < qk
    forge.patch(model, mode="infer", kernels=["rope", "qkv"], min_elements={"rope": qk})
    with torch.no_grad():
        model(torch.zeros(2, 8, dtype=torch.long))
    stats = model._forge_guard_stats
    assert stats.fused("rope") == stats.fused("qkv") == c.num_hidden_layers
    assert forge.report(model).kernels["qkv"].min_elements == qk
