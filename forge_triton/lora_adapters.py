"""What forge_triton/lora.py's three kernels share: the adapters reading one input and their
products (cuBLAS without dropout, forge_triton/lora_kernels.py's kernels with it), the dtype
rules of the adapter path, and the per-call checks of the fast path.

Adapter weights may have another dtype than x (peft keeps them in fp32 for bf16 models): they
are read in x's dtype, so every adapter product runs on x's dtype (the tensor cores for bf16 and
fp16) with fp32 accumulation, and no activation is ever copied into the adapter's dtype. The
adapters' gradients are accumulated in fp32 and written in their own dtype (fp32 for peft's fp32
adapters: cuBLAS's ``mm`` with an fp32 output on CUDA; on the CPU an fp32 product).
"""
from __future__ import annotations

import contextlib

import torch

from forge.spec import lora_dropout as drop_spec

from . import lora_kernels as K


def rows(x):
    return x.reshape(-1, x.shape[-1])  # (M, H); copies only when x's strides demand it


_HALF = (torch.bfloat16, torch.float16)


def mm(a, b, out_dtype: torch.dtype):
    """a @ b accumulated in fp32 (fp64 for fp64), written in ``out_dtype``: an adapter's gradient
    in the adapter's dtype from x-dtype operands. On CUDA, bf16/fp16 operands with an fp32 result
    are one cuBLAS call (``mm`` with ``out_dtype``); the CPU has no such ``mm``: the product runs
    in the wider dtype there."""
    if a.dtype == out_dtype:
        return a @ b
    if a.is_cuda and out_dtype == torch.float32 and a.dtype in _HALF:
        return torch.mm(a, b, out_dtype=torch.float32)
    wide = torch.promote_types(a.dtype, out_dtype)
    return (a.to(wide) @ b.to(wide)).to(out_dtype)


def in_dt(t, dt):
    return t if t.dtype == dt else t.to(dt)


class Adapters:
    """The adapters reading one input (q, k, v's; gate and up's; down's): their A and B, scales,
    dropout probabilities and salts, in slot order (only projections that have an adapter)."""

    __slots__ = ("a", "b", "s", "p", "salt", "ranks", "cuts", "drop")

    def __init__(self, a, b, s, p, salt):
        self.a, self.b, self.s, self.p, self.salt = a, b, s, p, salt
        self.ranks = [t.shape[0] for t in a]
        self.cuts = [0]
        for r in self.ranks:
            self.cuts.append(self.cuts[-1] + r)
        self.drop = any(p)

    @classmethod
    def of(cls, names, a, b, scales, ps):
        keep = [i for i, t in enumerate(a) if t is not None]
        return cls([a[i] for i in keep], [b[i] for i in keep], [scales[i] for i in keep], [ps[i] for i in keep],
                   [names[i] for i in keep]), keep

    def __len__(self):
        return len(self.a)


def down(x2, ad, seed):
    """(xa (M, R), a_cat (R, K)): x's down-projection by every adapter reading it, stacked, in
    x's dtype (each A rounded to it, stacked in a_cat). Without dropout one GEMM reads x once for
    all; with dropout one kernel reads x once and drops each adapter's copy in registers."""
    dt = x2.dtype
    a_cat = in_dt(ad.a[0] if len(ad) == 1 else torch.cat(ad.a), dt)
    if not ad.drop:
        return x2 @ a_cat.t(), a_cat
    return K.down(x2, a_cat, seed, ad.ranks, ad.p, ad.salt), a_cat


def grads_a(x2, dxa, ad, seed, ldt):
    """[d a_i] = [dxa_i^T drop_i(x)], in the adapters' dtype ``ldt`` (dxa (M, R) stacked)."""
    if not ad.drop:
        ga = mm(dxa.t(), x2, ldt)  # (R, K): one GEMM for all
    else:
        ga = K.grad_a(x2, dxa, seed, ad.ranks, ad.p, ad.salt).to(ldt)
    return [ga[ad.cuts[i]:ad.cuts[i + 1]] for i in range(len(ad))]


def add_dx_(gx, dxa, a_cat, ad, seed):
    """gx (M, K) += sum_i drop_i(dxa_i A_i), the adapters' path of the input's gradient."""
    if not ad.drop:
        return gx.addmm_(dxa, a_cat)  # one cuBLAS call, beta = 1
    return K.add_dx_(gx, dxa, a_cat, seed, ad.ranks, ad.p, ad.salt)


def dxa(g2, b, s):
    """d xa = s g B, (M, r) in g's dtype (B rounded to it)."""
    return (g2 @ in_dt(b, g2.dtype)).mul_(s)


def grad_b(g2, xa, s, ldt):
    """d B = s g^T xa, (N, r) in the adapter's dtype."""
    return mm(g2.t(), xa, ldt).mul_(s)


def words(seed, ps):
    """The seed as the kernels read it (two int32 words), or None when no projection drops."""
    return drop_spec.words(seed) if seed is not None and any(ps) else None


def none(t):
    return t if t is not None and t.numel() else None


_NO_CONTEXT = contextlib.nullcontext()  # reusable, holds nothing


def no_autocast(tensors):
    """Autocast off for the block on the tensors' device type; nothing to turn off (the usual
    case) costs no context object."""
    # any device type will do when no tensor is given (every output gradient undefined)
    dev = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), "cpu")
    if not torch.is_autocast_enabled(dev):
        return _NO_CONTEXT
    return torch.autocast(dev, enabled=False)


def signature(extra, x, ws):
    """What the spec's checks read of the arguments other than the seed and probabilities, as a
    hashable key: x's device, dtype and width, each weight's shape, dtype and device (None for a
    missing one); None when something is not a tensor (the full checks then say what is wrong)."""
    try:
        key = [extra, x.device, x.dtype, x.shape[-1]]
        for t in ws:
            key += (None, None, None) if t is None else (t.shape, t.dtype, t.device)
        key = tuple(key)
        hash(key)  # an unhashable act: the full checks name it
        return key
    except (AttributeError, IndexError, TypeError):
        return None


def hot_rest(x, scales, seed, ps, adapters) -> bool:
    """Scales, seed and probabilities as the spec's checks accept them, in a few reads: float
    scales; float probabilities in [0, 1], 0 for a projection without an adapter; an int64 seed
    of one element on x's device, or None when every probability is 0."""
    for s in scales:
        if type(s) is not float:
            return False
    drops = False
    for p, a in zip(ps, adapters):
        if type(p) is not float or not 0.0 <= p <= 1.0 or (p and a is None):
            return False
        drops = drops or p != 0.0
    if seed is None:
        return not drops
    return type(seed) is torch.Tensor and seed.dtype is torch.int64 and seed.numel() == 1 and seed.device == x.device


def any_requires_grad(ts) -> bool:
    for t in ts:
        if t is not None and t.requires_grad:
            return True
    return False


