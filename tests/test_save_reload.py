"""save_pretrained / from_pretrained of a patched model (docs/patching.md, "Checkpoints").

A patched model saves exactly what the same model unpatched saves (every tensor of the
safetensors files, config.json and generation_config.json: nothing of forge's in them), loads
back unpatched with equal weights, and ``forge.patch`` on the loaded model computes what the
patched original computed. The same for a peft model, whose save writes only the adapter.

Tiny models on the CPU (conftest's CPU_TENSOR_MODULES); the kernels run in the Pallas interpreter.
"""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()  # before transformers imports triton (building a model does)

import copy  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import forge  # noqa: E402
from forge.__main__ import build_model  # noqa: E402
from forge.spec import tolerance  # noqa: E402

from test_models import need  # noqa: E402

BACKEND = "pallas"


def saved(folder: Path) -> dict:
    """{file name: content} of a save_pretrained folder: tensors per safetensors file, JSON parsed."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.iterdir()):
        if f.suffix == ".safetensors":
            out[f.name] = load_file(f)
        elif f.suffix == ".json":
            out[f.name] = json.loads(f.read_text())
            if isinstance(out[f.name].get("target_modules"), list):  # peft writes a set, in set order
                out[f.name]["target_modules"] = sorted(out[f.name]["target_modules"])
        else:
            out[f.name] = f.read_bytes()
    return out


def assert_same_save(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith(".safetensors"):
            assert a[name].keys() == b[name].keys(), name
            for k in a[name]:
                assert torch.equal(a[name][k], b[name][k]), f"{name}: {k}"
        else:
            assert a[name] == b[name], name


def json_keys(v):
    if isinstance(v, dict):
        for k, x in v.items():
            yield k
            yield from json_keys(x)
    elif isinstance(v, list):
        for x in v:
            yield from json_keys(x)


def no_forge_keys(content: dict):
    """No key of forge's in the JSON files (build_model's temporary folder, named forge-demo-*,
    may appear as a value: the path the base model was loaded from)."""
    for name, v in content.items():
        if name.endswith(".json"):
            bad = [k for k in json_keys(v) if "forge" in k.lower()]
            assert not bad, f"{name} has forge keys {bad}"


def forge_entries(model):
    return [n for n, m in model.named_modules() if {"forward", "__reduce_ex__", "__deepcopy__"} & m.__dict__.keys()
            or any(k.startswith("_forge") for k in m.__dict__)]


def batch(model, b=2, s=8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (b, s), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    return ids, labels


def test_save_pretrained_of_a_patched_model_and_reload(tmp_path):
    need(BACKEND)
    from transformers import AutoModelForCausalLM

    model = build_model("qwen2")
    plain = copy.deepcopy(model)
    ref = copy.deepcopy(model).double()
    forge.patch(model, backend=BACKEND, min_elements=0)
    ids, labels = batch(model)
    loss = model(ids, labels=labels).loss  # a training step first: the guard counted, gradients exist
    loss.backward()
    assert model._forge_guard_stats.fused("fused_linear_ce") == 1

    model.save_pretrained(tmp_path / "patched")
    plain.save_pretrained(tmp_path / "plain")
    patched_files, plain_files = saved(tmp_path / "patched"), saved(tmp_path / "plain")
    assert "config.json" in patched_files and any(n.endswith(".safetensors") for n in patched_files)
    assert_same_save(patched_files, plain_files)
    no_forge_keys(patched_files)
    assert forge.report(model).patched  # saving left the model patched

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "patched", attn_implementation="eager").train()
    assert not forge.report(loaded).patched and not forge_entries(loaded)
    sd, want = loaded.state_dict(), model.state_dict()
    assert sd.keys() == want.keys()
    for k in want:
        assert torch.equal(sd[k], want[k]), k

    forge.patch(loaded, backend=BACKEND, min_elements=0)
    assert loaded._forge_patched_counts == model._forge_patched_counts
    out = loaded(ids, labels=labels)
    assert out.logits is None and loaded._forge_guard_stats.fused("fused_linear_ce") == 1  # the fused loss ran
    assert torch.equal(out.loss, model(ids, labels=labels).loss)  # same kernels, same weights
    with torch.no_grad():
        lg = loaded(ids).logits  # logits without labels: the decoder's kernels
        lg_model = model(ids).logits
        lg_plain, lg_ref = plain(ids).logits, ref(ids).logits
    assert torch.equal(lg, lg_model)
    k = max(model.config.vocab_size, model.config.intermediate_size)
    tolerance.assert_close("logits of the reloaded, patched model", lg, lg_ref, lg_plain, torch.float32, k)
    assert loaded._forge_guard_stats.fused("rmsnorm") > 0


def test_save_pretrained_of_a_patched_peft_model(tmp_path):
    peft = pytest.importorskip("peft", reason="peft is in the [test] extras")
    need(BACKEND)
    from transformers import AutoModelForCausalLM

    base = build_model("qwen2")
    base.save_pretrained(tmp_path / "base")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                                                             "down_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    pm = peft.get_peft_model(base, cfg)
    plain = copy.deepcopy(pm)
    forge.patch(pm, backend=BACKEND, min_elements=0)
    assert {"lora_qkv", "lora_mlp"} <= pm._forge_patched_counts.keys()
    ids, labels = batch(base)
    pm(ids, labels=labels).loss.backward()

    pm.save_pretrained(tmp_path / "patched")
    plain.save_pretrained(tmp_path / "plain")
    patched_files = saved(tmp_path / "patched")
    assert "adapter_config.json" in patched_files and "adapter_model.safetensors" in patched_files
    assert_same_save(patched_files, saved(tmp_path / "plain"))
    no_forge_keys(patched_files)

    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "patched", is_trainable=True)
    assert not forge.report(loaded).patched and not forge_entries(loaded)
    forge.patch(loaded, backend=BACKEND, min_elements=0)
    assert loaded.get_base_model()._forge_patched_counts == pm.get_base_model()._forge_patched_counts
    loaded.train()
    pm.train()
    assert torch.equal(loaded(ids, labels=labels).loss, pm(ids, labels=labels).loss)


def test_transformers_hub_kernels_do_not_undo_the_patch(tmp_path):
    # from_pretrained turns transformers' hub kernels on wherever the kernels package is
    # installed, and then every train()/eval() that changes the mode kernelizes the model again,
    # which put transformers' forward back on each RMSNorm: forge's RMSNorm was silently gone
    # after the trainer's first model.train(). forge turns them off while patched, unpatch back on
    need(BACKEND)
    from transformers import AutoModelForCausalLM

    build_model("qwen2").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    if not model.use_kernels:
        pytest.skip("transformers turned no hub kernels on here (no kernels package, or USE_HUB_KERNELS=0)")
    forge.patch(model, backend=BACKEND, min_elements=0)
    assert not model.use_kernels
    for switch in (model.train, model.eval, model.train):
        switch()
    norms = 2 * model.config.num_hidden_layers + 1
    assert all("forward" in model.get_submodule(n).__dict__ for n in
               [f"model.layers.{i}.{a}" for i in range(model.config.num_hidden_layers)
                for a in ("input_layernorm", "post_attention_layernorm")] + ["model.norm"])
    model(batch(model)[0])
    assert model._forge_guard_stats.fused("rmsnorm") == norms
    forge.unpatch(model)
    assert model.use_kernels and str(model.kernels_mode).endswith("TRAINING"), model.kernels_mode
    assert "forward" not in model.model.norm.__dict__
