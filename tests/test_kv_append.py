"""The decoding path's cache write (forge.spec.kv_append) against its reference: exact (it copies),
on both backends; the position advances once per call however many programs a launch has; a
position past the capacity writes nothing; bad arguments get the spec's errors.

CPU cases run the interpreters; the gpu-marked ones the decoding shapes of the presets (Llama-3's
and Qwen3's 8 KV heads of 128, batch 1 to 32) on the device, where the programs of one launch run
at once and race for the ticket.
"""
from __future__ import annotations

import pytest
import torch

import forge.ops
from forge.spec import kv_append as spec
from oracle import ON_CPU_AND_GPU, skip_interpreters_on_gpu

BACKENDS = list(forge.ops.BACKENDS)
GPU = torch.cuda.is_available()


def _case(b, h, c, d, dtype, device, gen, strided):
    keys, values = (torch.randn(b, h, c, d, generator=gen).to(device, dtype) for _ in range(2))
    if strided:  # as HF hands them: (B, 1, H, D) projections seen as (B, H, 1, D), v a slice of a wider row
        k = torch.randn(b, 1, h, d, generator=gen).to(device, dtype).transpose(1, 2)
        v = torch.randn(b, 1, 3 * h * d, generator=gen).to(device, dtype)[..., h * d:2 * h * d]
        v = v.view(b, 1, h, d).transpose(1, 2)
    else:
        k, v = (torch.randn(b, h, 1, d, generator=gen).to(device, dtype) for _ in range(2))
    return keys, values, k, v


def _run(backend, b, h, c, d, dtype, device, starts, strided=False, autocast=False):
    f = forge.ops.get("kv_append", backend)
    gen = torch.Generator().manual_seed(b * 100 + h * 10 + c)
    keys, values, _, _ = _case(b, h, c, d, dtype, device, gen, strided)
    want_k, want_v = keys.clone(), values.clone()
    n = torch.tensor(starts, dtype=torch.int64, device=device)
    want_n = n.clone()
    for step in range(3):  # consecutive calls: the ticket word is back at 0 after each
        _, _, k, v = _case(b, h, c, d, dtype, device, gen, strided)
        if autocast:  # (the HF Trainer's bf16=True over a float32 model: a copy must stay a copy)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                assert f(keys, values, k, v, n) is None
        else:
            assert f(keys, values, k, v, n) is None
        spec.reference(want_k, want_v, k, v, want_n)
        assert int(n) == starts + step + 1 == int(want_n)
        assert spec.counter_words(n).tolist() == [starts + step + 1, 0]
        assert torch.equal(keys, want_k) and torch.equal(values, want_v), f"step {step}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b,h,c,d,dtype,start,strided", [
    (1, 2, 9, 16, torch.float32, 0, False),
    (3, 4, 7, 16, torch.float32, 2, True),      # 12 rows: more than one program a launch (Triton: 8 rows each)
    (2, 5, 6, 24, torch.bfloat16, 3, True),     # a head size below its power of two; the last slot filled
    (1, 3, 4, 16, torch.float16, 5, False),     # past the capacity: nothing written, the position advances
])
def test_kv_append_cpu(backend, b, h, c, d, dtype, start, strided):
    _run(backend, b, h, c, d, dtype, "cpu", start, strided)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [1, 8, 32])
def test_kv_append_gpu(backend, b, monkeypatch):
    shared = []
    if backend == "pallas":  # natively launched, the outputs are the inputs' own buffers: nothing copied back
        import bridge.core

        real = bridge.core.apply

        def spy(kdef, *tensors, **static):
            outs = real(kdef, *tensors, **static)
            if kdef.name == "kv_append":
                shared.append([o.data_ptr() == t.data_ptr() for o, t in zip(outs, tensors[:2] + tensors[4:])])
            return outs

        monkeypatch.setattr(bridge.core, "apply", spy)
    _run(backend, b, 8, 384, 128, torch.bfloat16, "cuda", 130, strided=True)
    assert backend != "pallas" or shared == [[True, True, True]] * 3, shared


@pytest.mark.parametrize("backend", BACKENDS)
@ON_CPU_AND_GPU
def test_kv_append_float32_cache_under_autocast(backend, device):
    # a float32 cache written under autocast(bf16): exact, nothing rounded to bf16
    skip_interpreters_on_gpu(device)
    h, c, d = (8, 384, 128) if device == "cuda" else (3, 9, 16)
    _run(backend, 2, h, c, d, torch.float32, device, 4, strided=True, autocast=True)


def test_pallas_plan_writes_the_callers_buffers():
    # the native plan's recipe (what a GPU launches): the outputs aliasing keys, values and the
    # counter's words are those tensors' own buffers (KernelDef.writes), not copies of them; a
    # kernel that does not hand its inputs over copies each aliased one first
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from bridge import kernels as BK
    from bridge.native import recipe

    rows, c, d = 4, 8, 16
    avals = [jax.ShapeDtypeStruct((rows * c, d), jnp.bfloat16)] * 2 + [
        jax.ShapeDtypeStruct((rows, d), jnp.bfloat16)] * 2 + [jax.ShapeDtypeStruct((2,), jnp.int32)]
    fn = BK.KV_APPEND.py_fn("fwd", ())

    def copies(writes):
        rec, _ = recipe.trace(fn, avals, ("test", "kv_append"), writes)
        calls = [st for st in rec["steps"] if "alias" in st]
        assert len(calls) == 1 and sorted(calls[0]["alias"]) == [[0, 2], [1, 3], [2, 4]], calls
        return calls[0]["copy"]

    assert BK.KV_APPEND.writes == (0, 1, 4)
    assert copies(BK.KV_APPEND.writes) == []
    assert sorted(copies(())) == [0, 1, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_append_negative_position_writes_nothing(backend):
    # outside the contract (n in [0, 2**31)), but no write outside the cache: three caches side
    # by side in one storage, the middle one written at position -1
    f = forge.ops.get("kv_append", backend)
    b, h, c, d = 2, 2, 5, 16
    store = torch.zeros(4, b, h, c, d)
    k, v = torch.ones(b, h, 1, d), torch.full((b, h, 1, d), 2.0)
    assert f(store[1], store[2], k, v, torch.tensor(-1)) is None
    assert torch.equal(store, torch.zeros_like(store))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_append_layout_checked_on_every_signature(backend):
    # an accepted call, then one of the same shapes over a non-contiguous cache: refused as well
    f = forge.ops.get("kv_append", backend)
    b, h, c, d = 1, 2, 4, 16
    k = torch.ones(b, h, 1, d)
    f(torch.zeros(b, h, c, d), torch.zeros(b, h, c, d), k, k, torch.tensor(0))
    wide = torch.zeros(b, h, 2 * c, d)
    with pytest.raises(ValueError, match="contiguous"):
        f(wide[:, :, :c], wide[:, :, c:], k, k, torch.tensor(1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_append_errors(backend):
    f = forge.ops.get("kv_append", backend)
    keys, values = torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16)
    k, v = torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16)
    with pytest.raises(TypeError, match="0-dim int64"):
        f(keys, values, k, v, torch.tensor(0, dtype=torch.int32))
    with pytest.raises(TypeError, match="0-dim int64"):
        f(keys, values, k, v, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"k must be \(B, H, 1, D\)"):
        f(keys, values, torch.zeros(1, 2, 2, 16), v, torch.tensor(0))
    with pytest.raises(TypeError, match="is torch.float32 but v is torch.bfloat16"):
        f(keys, values, k, v.bfloat16(), torch.tensor(0))
    with pytest.raises(ValueError, match="contiguous"):
        f(keys.transpose(2, 3).contiguous().transpose(2, 3), values, k, v, torch.tensor(0))
    n = torch.tensor(1)
    assert torch.equal(keys, torch.zeros_like(keys)) and int(n) == 1  # (the refused calls touched nothing)
