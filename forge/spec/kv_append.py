"""One new token's keys and values written into a static KV cache, and the cache's length advanced.

The decoding step's cache write (``forge.patching.decode_runtime``): transformers' static cache
writes a token with two ``index_copy_`` launches (keys, values) and advances its length counter
with a third. At batch 1 each moves a few KiB, so the three are launch latency: ~2.3 us each on an
H200, about 5% of a Qwen3-30B-A3B decoding step. This is the same work in one launch. Equivalent
torch::

    pos = int(n)
    keys[:, :, pos] = k[:, :, 0]; values[:, :, pos] = v[:, :, 0]
    n += 1

Arguments: ``keys`` and ``values`` (B, H, C, D), contiguous, one float dtype; ``k`` and ``v``
(B, H, 1, D) of that dtype (any strides); ``n`` the cache's length counter, a 0-dim int64
tensor on the cache's device holding a position in [0, 2**31). Writes in place and returns None.

The position is read on the device (no host sync). A position at or past the capacity C writes
nothing, where ``index_copy_`` would stop the process with a device-side assert: the kernels
touch no memory outside the cache, and ``n`` advances all the same. A negative position (outside
the contract: checking it would read ``n`` back to the host) writes nothing either; ``n`` is then
left undefined. The decoding path never gets
there: its caches are sized for the call's whole length.

How a backend advances ``n`` within one launch: every program reads the position first, then
takes a ticket (an atomic add on the high 32-bit word of ``n``, which a position below 2**31
leaves 0); the program that takes the last ticket stores the position plus one in the low word
and zero in the high one. No program reads ``n`` after taking its ticket, and the atomic's
release order puts every program's read before it. (Little-endian words, as on every GPU torch
runs on.)
"""
from __future__ import annotations

import torch

from . import _check


def check(keys, values, k, v, n) -> None:
    for name, t in (("keys", keys), ("values", values), ("k", k), ("v", v)):
        _check.tensor(name, t)
    if keys.dim() != 4:
        raise ValueError(f"keys must be (B, H, C, D), got {tuple(keys.shape)}")
    _check.same_shape("keys", keys, "values", values)
    b, h, _, d = keys.shape
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (b, h, 1, d):
            raise ValueError(f"{name} must be (B, H, 1, D) = {(b, h, 1, d)} for a cache {tuple(keys.shape)}, "
                             f"got {tuple(t.shape)}")
        _check.same_dtype("keys", keys, name, t)
    _check.same_dtype("keys", keys, "values", values)
    if not isinstance(n, torch.Tensor) or n.dtype != torch.int64 or n.dim() != 0:
        raise TypeError(f"n must be a 0-dim int64 tensor (the cache's length), got "
                        f"{type(n).__name__ if not isinstance(n, torch.Tensor) else (n.dtype, tuple(n.shape))}")
    _check.same_device(keys=keys, values=values, k=k, v=v, n=n)
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("keys and values must be contiguous (B, H, C, D) tensors, as a static cache allocates them")


def reference(keys, values, k, v, n) -> None:
    check(keys, values, k, v, n)
    pos = int(n)
    if 0 <= pos < keys.shape[2]:
        keys[:, :, pos] = k[:, :, 0]
        values[:, :, pos] = v[:, :, 0]
    n.add_(1)


def counter_words(n: torch.Tensor) -> torch.Tensor:
    """``n``'s storage as two int32 words (low: the position; high: the ticket, 0 between launches)."""
    return n.view(1).view(torch.int32)
