"""Rotary position embedding, Hugging Face's rotate_half convention, q and k together.

Equivalent torch (``transformers``' ``apply_rotary_pos_emb`` with unsqueeze_dim=1)::

    def rotate_half(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat((-x2, x1), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)          # (B|1, 1, S, D)
    q_out = q * cos + rotate_half(q) * sin                 # q: (B, Hq, S, D)
    k_out = k * cos + rotate_half(k) * sin                 # k: (B, Hk, S, D)

rotate_half is linear, R(x) = [-x2, x1], with transpose R^T(g) = [g2, -g1], so the backward is
the same rotation with sin negated and its halves swapped: dx = g * cos + R^T(g * sin).
cos and sin come from the model's rotary embedding, and the kernels give them no gradient: a
call whose cos or sin requires grad (with grad mode on) is refused (:func:`check_tables`) rather
than computed with their gradient silently dropped; a patched model runs Hugging Face's own
function for such a call. Kernels use the full D-wide cos/sin rows, so they are exact for any
cos/sin, not only duplicated halves.
"""
from __future__ import annotations

import torch

from . import _check


def check(q, k, cos, sin, unsqueeze_dim: int = 1) -> None:
    """The kernels' check: :func:`check_args`, and cos and sin asking no gradient."""
    check_args(q, k, cos, sin, unsqueeze_dim)
    _check.same_dtype("cos", cos, "sin", sin)  # (the kernels read both as one dtype)
    check_tables(cos, sin)


def check_args(q, k, cos, sin, unsqueeze_dim: int = 1) -> None:
    """Types, shapes, devices and dtypes (what the reference needs too)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _check.tensor(name, t)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D, got {tuple(q.shape)} and {tuple(k.shape)}")
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int) or unsqueeze_dim not in (1, 2):
        raise ValueError(f"unsqueeze_dim must be 1 (B,H,S,D) or 2 (B,S,H,D), got {unsqueeze_dim}")
    _check.same_device(q=q, k=k, cos=cos, sin=sin)
    _check.same_dtype("q", q, "k", k)
    _check.same_shape("cos", cos, "sin", sin)
    s_dim = 2 if unsqueeze_dim == 1 else 1
    b, s, d = q.shape[0], q.shape[s_dim], q.shape[-1]
    if k.shape[0] != b or k.shape[s_dim] != s or k.shape[-1] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch, seq or head_dim")
    if d % 2:
        raise ValueError(f"head_dim must be even for rotate_half, got {d}")
    if cos.dim() != 3 or cos.shape[1] != s or cos.shape[2] != d or cos.shape[0] not in (1, b):
        raise ValueError(f"cos must be (B or 1, S, D) = ({b}, {s}, {d}), got {tuple(cos.shape)}")


def tables_need_grad(cos, sin) -> bool:
    """A gradient is asked of cos or sin: the kernels cannot give one."""
    return (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled()


def check_tables(cos, sin) -> None:
    """cos and sin must not require grad (in grad mode): the kernels give them none. A few
    attribute reads, so a backend's per-call fast path can afford it where it skips :func:`check`."""
    if tables_need_grad(cos, sin):
        which = "cos" if cos.requires_grad else "sin"
        raise ValueError(f"rope: {which} requires grad, but forge's RoPE kernels give no gradient to cos or sin "
                         "(only to q and k); pass cos.detach() and sin.detach(), or use Hugging Face's "
                         "apply_rotary_pos_emb (forge.spec.rope.reference) where they must learn")


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def reference(q, k, cos, sin, unsqueeze_dim: int = 1):
    check_args(q, k, cos, sin, unsqueeze_dim)  # (plain torch: cos and sin get their gradients)
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def elements(q, k, *_a, **_k) -> int:
    return q.numel() + k.numel()


def reductions(*_a, **_k) -> dict:
    return {"q_out": 2, "k_out": 2, "q": 2, "k": 2}
