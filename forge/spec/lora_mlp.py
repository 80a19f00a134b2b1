"""A gated MLP with peft LoRA on gate_proj, up_proj and down_proj (qwen2, qwen3, llama: silu;
gemma, gemma2: gelu_tanh), as ``MLP.forward`` computes it: ``down(act(gate(x)) * up(x))``.

Signature (every backend)::

    lora_mlp(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
             *, scale_gate, scale_up, scale_down, act="silu", seed=None, dropout_gate=0.0,
             dropout_up=0.0, dropout_down=0.0, recompute=False) -> y

    x: (..., H)   w_gate, w_up: (I, H)   w_down: (H, I)   frozen base weights, no bias
    a_gate, a_up: (r, H)   b_gate, b_up: (I, r)   a_down: (r, I)   b_down: (H, r)
    scale_*: float (alpha / r)   act: "silu" (swiglu) or "gelu_tanh" (geglu)
    a_p and b_p both None: p has no adapter (its plain base product)
    x and the w's share one dtype, the a's and b's one (possibly another); ranks may differ
    dropout_*: peft's lora_dropout on each adapter's input (down's input is h); seed: the call's
    int64 seed, each projection its own stream of it (forge/spec/lora_dropout.py)

Equivalent torch (``project`` is one peft LoRA linear, see ``forge.spec.lora_qkv``)::

    g = project(x, w_gate, None, a_gate, b_gate, scale_gate, seed, SALT["gate"], dropout_gate)  # (..., I)
    u = project(x, w_up, None, a_up, b_up, scale_up, seed, SALT["up"], dropout_up)              # (..., I)
    h = act(g) * u                                                                # (..., I), x.dtype
    y = project(h, w_down, None, a_down, b_down, scale_down, seed, SALT["down"], dropout_down)  # (..., H)

Kernels save x, g, u, the seed and the rank-r products xa_p = drop_p(x) a_p^T and
ha = drop_down(h) a_down^T, and recompute act(g), h and the masks in backward. With
``recompute=True`` (forge.patch's recompute_mlp) they keep x and not g and u, and make g and u
again in backward (the base products and the adapters' terms, as the forward made them). Gradients flow to x and to
every a and b; base weights are frozen (ValueError if one requires grad while grad is enabled).
Backward, with dy the output gradient::

    dh_a  = scale_down * dy b_down               (M, r)     d b_down = scale_down * dy^T ha
    dh    = dy w_down + drop_down(dh_a a_down)   (M, I)     d a_down = dh_a^T drop_down(h)
    dg    = dh * u * act'(g);   du = dh * act(g)             (act' as in the swiglu / geglu specs)
    dxa_p = scale_p * dp b_p  (p = gate, up)     d b_p = scale_p * dp^T xa_p;  d a_p = dxa_p^T drop_p(x)
    dx    = dg w_gate + du w_up + drop_gate(dxa_gate a_gate) + drop_up(dxa_up a_up)   accumulated once

(drop_p: lora_dropout.apply of p's stream, the identity for dropout_p = 0)
"""
from __future__ import annotations

import torch

from . import _check, lora_dropout
from .lora_qkv import _proj_args, frozen, project, same_adapter_dtype

ACTS = ("silu", "gelu_tanh")
PROJ = ("gate", "up", "down")
# the tensor arguments by name, in the signature's order (the seed is a keyword), and those
# with a gradient: every backend binds its gradients to these names, never to positions
TENSORS = ("x", *(f"{t}_{p}" for p in PROJ for t in ("w", "a", "b")), "seed")
TRAINABLE = ("x", *(f"{t}_{p}" for p in PROJ for t in ("a", "b")))


def check(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
          *, scale_gate, scale_up, scale_down, act="silu", seed=None, dropout_gate=0.0, dropout_up=0.0,
          dropout_down=0.0) -> None:
    _check.tensor("x", x)
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    _proj_args("gate", x, w_gate, None, a_gate, b_gate, scale_gate)
    _proj_args("up", x, w_up, None, a_up, b_up, scale_up)
    _check.same_shape("w_gate", w_gate, "w_up", w_up)
    inter = w_gate.shape[0]
    # down takes h = act(g) * u, shaped (..., I), in x's dtype
    _proj_args("down", x, w_down, None, a_down, b_down, scale_down, width=inter, in_name="h = act(gate) * up")
    if w_down.shape[0] != x.shape[-1]:
        raise ValueError(f"w_down has {w_down.shape[0]} output features but x's last dimension is {x.shape[-1]}")
    same_adapter_dtype(a_gate=a_gate, a_up=a_up, a_down=a_down)
    ps = {"gate": dropout_gate, "up": dropout_up, "down": dropout_down}
    for (p, d), a in zip(ps.items(), (a_gate, a_up, a_down)):
        lora_dropout.check(p, d, a is not None)
    lora_dropout.check_seed(seed, ps, x.device)


def activation(g, act: str):
    if act == "silu":
        return torch.nn.functional.silu(g)
    return torch.nn.functional.gelu(g, approximate="tanh")


def reference(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
              *, scale_gate, scale_up, scale_down, act="silu", seed=None, dropout_gate=0.0, dropout_up=0.0,
              dropout_down=0.0):
    check(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
          scale_gate=scale_gate, scale_up=scale_up, scale_down=scale_down, act=act, seed=seed,
          dropout_gate=dropout_gate, dropout_up=dropout_up, dropout_down=dropout_down)
    salt = lora_dropout.SALT
    g = project(x, w_gate, None, a_gate, b_gate, scale_gate, seed, salt["gate"], dropout_gate)
    u = project(x, w_up, None, a_up, b_up, scale_up, seed, salt["up"], dropout_up)
    return project(activation(g, act) * u, w_down, None, a_down, b_down, scale_down, seed, salt["down"],
                   dropout_down)


def elements(x, *_a, **_k) -> int:
    """Activation elements per call: rows x hidden."""
    return x.numel()


def reductions(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, **_k) -> dict:
    """Reduction length behind each output and gradient (scales the tolerance): y sums over I
    after sums over H; d x over I twice after the sum over H in dh; the adapters' gradients over
    the rows after the sums behind their two factors (gate's and up's d b: dg, from dh's sum over
    H, and xa's over H; their d a: d xa's sum over I after dh's; down's d b: ha's sum over I after
    h's over H; down's d a: d ha's sum over H)."""
    h, inter = x.shape[-1], w_gate.shape[0]
    r = max(0 if a is None else a.shape[0] for a in (a_gate, a_up, a_down))
    rows = x.numel() // max(h, 1)
    out = {"y": h + inter + 2 * r, "x": h + 2 * inter + 3 * r}
    out.update({"b_gate": rows + h + r, "b_up": rows + h + r, "a_gate": rows + h + inter + r,
                "a_up": rows + h + inter + r, "b_down": rows + h + inter + r, "a_down": rows + h + r})
    return out


__all__ = ["ACTS", "activation", "check", "elements", "frozen", "reductions", "reference"]
