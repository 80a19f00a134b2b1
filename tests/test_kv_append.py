"""The decoding path's cache write (forge.spec.kv_append) against its reference: exact (it copies),
on both backends; the position advances once per call however many programs a launch has; a
position past the capacity writes nothing; bad arguments get the spec's errors.

CPU cases run the interpreters; the gpu-marked ones the decoding shapes of the presets (Llama-3's
and Qwen3's 8 KV heads of 128, batch 1 to 32) on the device, where the programs of one launch run
at once and race for the ticket (Triton), or check that the Pallas write refuses a GPU's tensors
(its compiled launch did not advance the counter: docs/generate.md).
"""
from __future__ import annotations

import pytest
import torch

import forge.ops
from forge.spec import kv_append as spec

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


def _run(backend, b, h, c, d, dtype, device, starts, strided=False):
    f = forge.ops.get("kv_append", backend)
    gen = torch.Generator().manual_seed(b * 100 + h * 10 + c)
    keys, values, _, _ = _case(b, h, c, d, dtype, device, gen, strided)
    want_k, want_v = keys.clone(), values.clone()
    n = torch.tensor(starts, dtype=torch.int64, device=device)
    want_n = n.clone()
    for step in range(3):  # consecutive calls: the ticket word is back at 0 after each
        _, _, k, v = _case(b, h, c, d, dtype, device, gen, strided)
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
def test_kv_append_gpu(backend, b):
    if backend == "pallas":  # refused on a GPU: its compiled launch did not advance the counter (H100)
        gen = torch.Generator().manual_seed(b)
        keys, values, k, v = _case(b, 8, 384, 128, torch.bfloat16, "cuda", gen, True)
        before, n = keys.clone(), torch.tensor(130, device="cuda")
        with pytest.raises(NotImplementedError, match="not served on a GPU"):
            forge.ops.get("kv_append", backend)(keys, values, k, v, n)
        assert int(n) == 130 and torch.equal(keys, before)
        return
    _run(backend, b, 8, 384, 128, torch.bfloat16, "cuda", 130, strided=True)


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
