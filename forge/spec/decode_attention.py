"""Attention for one new token per sequence over a KV cache, grouped KV heads read once.

The decoding step's attention (``forge.patching.decode_runtime``): each sequence has one query
per head, and the cache holds ``H_kv`` key/value heads, each shared by ``G = H / H_kv`` query
heads (grouped-query attention; G = 1 is plain multi-head). Equivalent torch::

    k = k.repeat_interleave(G, dim=1); v = v.repeat_interleave(G, dim=1)      # (B, H, S, D)
    s = (q[:, :, None, :] @ k.transpose(-1, -2))[:, :, 0] * scale             # (B, H, S)
    s = s.masked_fill(~mask[:, None], -inf)   # bool mask: True = attend
    # or s = s + mask[:, None]                # float mask: added to the scores
    out = softmax(s, -1)[:, :, None, :] @ v                                   # (B, H, 1, D)

Arguments: ``q`` (B, H, D), ``k`` and ``v`` (B, H_kv, S, D), ``mask`` (B, S) bool or float,
or None (every key attended), ``scale`` (default 1 / sqrt(D)). Returns (B, H, D) in q's dtype.
A row whose keys are all masked has no defined softmax (SDPA gives NaN or zeros by backend);
callers never pass one (the new token always attends to itself). Forward only: it serves
inference; no size guard applies (it runs inside captured decoding steps), so unlike the other
kernels' specs this one has no ``elements``.
"""
from __future__ import annotations

import math

import torch

from . import _check


def check(q, k, v, mask=None, scale=None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check.tensor(name, t)
    if q.dim() != 3 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q must be (B, H, D) and k, v (B, H_kv, S, D), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    _check.same_device(q=q, k=k, v=v, mask=mask)
    _check.same_dtype("q", q, "k", k)
    _check.same_dtype("q", q, "v", v)
    _check.same_shape("k", k, "v", v)
    b, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    if k.shape[2] == 0:
        raise ValueError("k and v hold no keys (S = 0): attention over an empty cache is undefined")
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"q's {h} heads are not a multiple of the cache's {k.shape[1]} KV heads")
    if mask is not None:
        if mask.dtype is not torch.bool and not mask.dtype.is_floating_point:
            raise TypeError(f"mask must be bool (True = attend) or float (added to the scores), got {mask.dtype}")
        if tuple(mask.shape) != (b, k.shape[2]):
            raise ValueError(f"mask must be (B, S) = ({b}, {k.shape[2]}), got {tuple(mask.shape)}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number or None, got {type(scale).__name__}")


def reference(q, k, v, mask=None, scale=None):
    check(q, k, v, mask, scale)
    g = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("bhd,bhsd->bhs", q, kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None], float("-inf")) if mask.dtype is torch.bool else s + mask[:, None].to(s.dtype)
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(s, dim=-1), vv)


def reductions(q, k, *_a, **_k) -> dict:
    return {"out": k.shape[2]}
