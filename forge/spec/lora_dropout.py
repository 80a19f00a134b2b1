"""Dropout on a LoRA adapter's input, drawn inside the kernels (``lora_qkv``, ``lora_o``,
``lora_mlp``; every backend) from a counter-based hash.

peft's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: only the
adapter path sees dropout, and each projection has its own mask. The kernels take one seed per
call and a probability per projection::

    seed: int64 tensor of one element on x's device (draw it with :func:`seed`), or None
    dropout_p: float in [0, 1]; p > 0 needs a seed

    dropped = x * keep(seed, SALT[p], x's rows and columns, dropout_p) * scale(dropout_p)
    lora_p  = F.linear(F.linear(dropped, a_p), b_p) * scale_p

The keep-mask is a pure function of the seed, the projection's salt and each element's row
(index over the input's leading dimensions, flattened) and column (index in the last one): the
kernels compute it where they read the adapter's input, in forward and again in backward, and
keep nothing mask-sized. :func:`bits` is that function in torch (the reference); the Triton and
Pallas kernels compute the same bits, so their masks are identical element for element.

The hash, all arithmetic on unsigned 32-bit words (wrapping)::

    mix(h):   h ^= h >> 16; h *= 0x7FEB352D; h ^= h >> 15; h *= 0x846CA68B; h ^= h >> 16
              (a bijection of 32-bit words with good avalanche: C. Wellons' "lowbias32")
    key_row = mix(seed_lo ^ mix(seed_hi ^ salt_word(salt)))    seed_lo, seed_hi: the seed's halves
    key_col = mix(key_row ^ 0x9E3779B9)
    bits[r, c] = mix(mix(r ^ key_row) ^ mix(c ^ key_col))
    keep[r, c] = (bits[r, c] >> 8) >= threshold(p)             threshold(p) = round(p * 2**24)

So an element is kept with probability ``1 - threshold(p) / 2**24`` (p to within 2**-25; p = 0
keeps all, p = 1 drops all) and scaled by ``1 / (1 - p)`` (0 for p = 1), as torch's dropout does.
A kernel's row and column keys are computed once per tile row and column, one ``mix`` per
element.

Streams: every projection has its own salt (:data:`SALT`), every call draws a fresh seed from
torch's generator for the device (so ``torch.manual_seed`` reproduces a run, torch's gradient
checkpointing, which restores the RNG before its recompute, sees the same masks again, and a
CUDA graph replay draws a fresh seed on the device: no host read of the seed anywhere).
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B
THRESHOLD_BITS = 24  # the compare uses the hash's top 24 bits
# one stream per projection within a call (a call's projections share its seed)
SALT = {"q": 1, "k": 2, "v": 3, "o": 4, "gate": 5, "up": 6, "down": 7}


def scale(p: float) -> float:
    """Factor on the kept elements; 0 when everything is dropped (as torch's dropout)."""
    return 0.0 if p >= 1 else 1.0 / (1.0 - p)


def threshold(p: float) -> int:
    """Kept where the hash's top 24 bits are at least this (an int in [0, 2**24])."""
    return int(round(float(p) * (1 << THRESHOLD_BITS)))


def mix_word(h: int) -> int:
    """``mix`` on one Python int (host side: the salt words)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * MUL1) & MASK32
    h ^= h >> 15
    h = (h * MUL2) & MASK32
    return h ^ (h >> 16)


def salt_word(salt: int) -> int:
    """The 32-bit word a salt enters the key as (unsigned)."""
    return mix_word(salt * GOLDEN)


def signed(word: int) -> int:
    """A 32-bit word as the signed int32 with the same bits (what kernels take as an argument)."""
    word &= MASK32
    return word - (1 << 32) if word >= 1 << 31 else word


SEED_BITS = 62  # a range whose width fits int64 (compiled random-number code subtracts the bounds)


def seed(device) -> torch.Tensor:
    """One int64 seed in [0, 2**62), shape (1,), drawn from torch's generator for ``device`` on
    the device itself (a CUDA graph capture records the draw: each replay draws anew)."""
    return torch.randint(0, 1 << SEED_BITS, (1,), dtype=torch.int64, device=device)


def release() -> None:
    """Nothing of the dropout is kept between calls; ``forge.unpatch`` calls this all the same."""


# -------------------------------------------------------------------------- the hash in torch
def _mul(h: torch.Tensor, c: int) -> torch.Tensor:
    # (h * c) mod 2**32 for h in [0, 2**32) held in int64, without overflowing int64: c in halves
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix(h: torch.Tensor) -> torch.Tensor:
    """``mix`` on int64 tensors holding 32-bit words."""
    h = h ^ (h >> 16)
    h = _mul(h, MUL1)
    h = h ^ (h >> 15)
    h = _mul(h, MUL2)
    return h ^ (h >> 16)


def keys(seed_t: torch.Tensor, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_row, key_col) as int64 scalars on the seed's device."""
    s = seed_t.reshape(()).to(torch.int64)
    lo, hi = s & MASK32, (s >> 32) & MASK32
    k_row = mix(lo ^ mix(hi ^ salt_word(salt)))
    return k_row, mix(k_row ^ GOLDEN)


def bits(seed_t: torch.Tensor, salt: int, rows: int, cols: int) -> torch.Tensor:
    """The (rows, cols) hash words (int64 holding uint32) of stream ``(seed, salt)``."""
    k_row, k_col = keys(seed_t, salt)
    dev = seed_t.device
    rk = mix(torch.arange(rows, dtype=torch.int64, device=dev) ^ k_row)
    ck = mix(torch.arange(cols, dtype=torch.int64, device=dev) ^ k_col)
    return mix(rk[:, None] ^ ck[None, :])


def keep(seed_t: torch.Tensor, salt: int, shape, p: float) -> torch.Tensor:
    """The bool keep-mask of an input of ``shape`` (rows: the leading dimensions flattened)."""
    shape = tuple(shape)
    cols = shape[-1] if shape else 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    b = bits(seed_t, salt, rows, cols)
    return ((b >> 8) >= threshold(p)).reshape(shape)


def apply(t: torch.Tensor, seed_t, salt: int, p: float) -> torch.Tensor:
    """Dropout of stream ``(seed, salt)`` with probability ``p``: ``t`` where kept, scaled by
    :func:`scale`; 0 elsewhere (a product, as torch's dropout: NaN stays NaN). Also the
    backward of dropout (the same map on the gradient). ``p == 0`` returns ``t``."""
    if not p:
        return t
    return torch.mul(t, keep(seed_t, salt, t.shape, p).to(t.device)).mul_(scale(p))


def _arg(name: str) -> str:
    return f"dropout_{name}" if name else "dropout"


def check(name: str, p, has_adapter: bool = True) -> None:
    """``dropout_<name>`` (``dropout`` for name ""): a number in [0, 1], and 0 for a projection
    without an adapter."""
    if isinstance(p, bool) or not isinstance(p, float | int):
        raise TypeError(f"{_arg(name)} must be a number, got {type(p).__name__}")
    if not 0 <= p <= 1:
        raise ValueError(f"{_arg(name)} must be in [0, 1], got {p}")
    if p and not has_adapter:
        raise ValueError(f"{_arg(name)}={p} but {name} has no adapter (a_{name} and b_{name} are None)")


def check_seed(seed_t, ps, device) -> None:
    """The seed a call's dropout needs: required when any probability is > 0."""
    if seed_t is None:
        wants = [name for name, p in ps.items() if p]
        if wants:
            raise ValueError(f"{_arg(wants[0])}={ps[wants[0]]} needs a seed (draw one with "
                             "forge.spec.lora_dropout.seed(device))")
        return
    if not isinstance(seed_t, torch.Tensor):
        raise TypeError(f"seed must be a torch.Tensor (int64, one element), got {type(seed_t).__name__}")
    if seed_t.dtype != torch.int64 or seed_t.numel() != 1:
        raise TypeError(f"seed must be an int64 tensor of one element, got {seed_t.dtype} of shape "
                        f"{tuple(seed_t.shape)}")
    if seed_t.device != device:
        raise ValueError(f"seed is on {seed_t.device} but x is on {device}")


def words(seed_t: torch.Tensor) -> torch.Tensor:
    """The seed as the kernels read it: two int32 words (low, high), a view of its memory."""
    return seed_t.reshape(1).view(torch.int32)


__all__ = ["SALT", "apply", "bits", "check", "check_seed", "keep", "release", "salt_word", "scale", "seed",
           "signed", "threshold", "words"]
