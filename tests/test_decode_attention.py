"""The decoding attention kernel (forge.spec.decode_attention) against its float64 reference,
under the oracle's rule, with SDPA over repeated KV heads as the eager baseline.

Both backends have it (a backend without one would leave the decoding path on SDPA). CPU cases
use tiny shapes in the interpreters; the gpu-marked ones the decoding shapes of the presets
(Qwen2.5-0.5B, a Qwen3-like and a gemma-like head layout).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import forge.ops
from forge.spec import decode_attention as spec
from forge.spec import tolerance

BACKENDS = list(forge.ops.BACKENDS)


def _inputs(b, h, hkv, s, d, dtype, mask, device, gen):
    # q as HF hands it: a (B, H, D) view of a (B, 1, H, D) projection, not contiguous per head
    q = torch.randn(b, 1, h, d, generator=gen).to(device, dtype).transpose(1, 2)[:, :, 0]
    k, v = (torch.randn(b, hkv, s, d, generator=gen).to(device, dtype) for _ in range(2))
    keep = torch.rand(b, s, generator=gen) > 0.3
    keep[:, 0] = True  # every row attends to one key at least (the new token, in decoding)
    keep = keep.to(device)
    if mask == "bool":
        m = keep
    elif mask == "float":
        m = torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)
    else:
        m = None
    return q, k, v, m


def _eager(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    m = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None], k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                         attn_mask=m, scale=scale)
    return out[:, :, 0]


def _check(backend, b, h, hkv, s, d, dtype, mask, device, scale=None):
    f = forge.ops.get("decode_attention", backend)
    gen = torch.Generator().manual_seed(b * 1000 + h * 100 + s)
    q, k, v, m = _inputs(b, h, hkv, s, d, dtype, mask, device, gen)
    out = f(q, k, v, m, scale)
    assert out.shape == (b, h, d) and out.dtype == dtype and out.is_contiguous()
    m64 = None if m is None else (m if m.dtype is torch.bool else m.double())
    ref = spec.reference(q.double(), k.double(), v.double(), m64, scale)
    tolerance.assert_close("out", out, ref, _eager(q, k, v, m, scale), dtype, spec.reductions(q, k)["out"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b,h,hkv,s,d,dtype,mask", [
    (1, 14, 2, 300, 64, torch.float32, "bool"),     # grouped heads, several chunks merged
    (3, 8, 8, 70, 32, torch.float32, None),          # one query head per KV head, a partial tile
    (2, 16, 2, 129, 128, torch.bfloat16, "float"),   # additive mask
    (2, 6, 1, 40, 80, torch.float16, "bool"),        # one KV head, head_dim not a power of two
])
def test_matches_reference(backend, b, h, hkv, s, d, dtype, mask, device):
    _check(backend, b, h, hkv, s, d, dtype, mask, device, scale=0.3 if mask is None else None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_chunks_and_padded_rows(backend, device):
    # the keys past the new token (a static cache's empty tail) masked, whole chunks of them,
    # and a left-padded row: the merge must give those chunks no weight
    f = forge.ops.get("decode_attention", backend)
    gen = torch.Generator().manual_seed(3)
    b, h, hkv, s, d = 2, 4, 2, 400, 16
    q, k, v, _ = _inputs(b, h, hkv, s, d, torch.float32, None, device, gen)
    keep = torch.zeros(b, s, dtype=torch.bool, device=device)
    keep[0, :37] = True
    keep[1, 20:90] = True
    v[:, :, 100:] = 1e6  # where a masked key leaked, the output would show it
    out = f(q, k, v, keep)
    ref = spec.reference(q.double(), k.double(), v.double(), keep)
    tolerance.assert_close("out", out, ref, _eager(q, k, v, keep, None), torch.float32, spec.reductions(q, k)["out"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_a_clear_error(backend, device):
    f = forge.ops.get("decode_attention", backend)
    q, k, v = torch.randn(2, 6, 8, device=device), torch.randn(2, 4, 5, 8, device=device), torch.randn(2, 4, 5, 8, device=device)
    with pytest.raises(ValueError, match="multiple of the cache's 4 KV heads"):
        f(q, k, v)
    q = torch.randn(2, 8, 8, device=device)
    with pytest.raises(ValueError, match=r"mask must be \(B, S\)"):
        f(q, k, v, torch.ones(2, 6, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="bool .* or float"):
        f(q, k, v, torch.ones(2, 5, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor or None, got list"):
        f(q, k, v, [[True] * 5] * 2)
    with pytest.raises(ValueError, match="no keys"):
        f(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(TypeError, match="q is torch.float32 but k is torch.float16"):
        f(q, k.half(), v)
    if backend == "triton":
        with pytest.raises(TypeError, match="float64"):
            f(q.double(), k.double(), v.double())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b", [1, 8, 32])
@pytest.mark.parametrize("h,hkv,d", [(14, 2, 64), (16, 8, 128), (8, 1, 256)])
def test_decoding_shapes_gpu(backend, b, h, hkv, d):
    # a 1,280-key static cache (prompt 1024 + 256 new tokens) under a random padding mask
    _check(backend, b, h, hkv, 1280, d, torch.bfloat16, "bool", torch.device("cuda"))
