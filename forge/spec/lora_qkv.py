"""LoRA q, k and v projections from one input (peft ``lora.Linear`` on q_proj, k_proj, v_proj).

Signature (every backend)::

    lora_qkv(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
             *, scale_q, scale_k, scale_v, seed=None, dropout_q=0.0, dropout_k=0.0, dropout_v=0.0)
        -> (q, k, v)

    x: (..., H)   w_p: (N_p, H) frozen base weight   bias_p: (N_p,) frozen, or None
    a_p: (r_p, H) lora_A.weight   b_p: (N_p, r_p) lora_B.weight   scale_p: float (alpha / r)
    a_p and b_p both None: p has no adapter (its plain base product; peft's default target
    modules adapt q and v only)
    x, w_p, bias_p share one dtype; all a_p, b_p share one (possibly another, e.g. peft's fp32);
    ranks may differ per projection
    dropout_p: peft's lora_dropout on p's adapter input; seed: the call's int64 seed (one element,
    on x's device; needed when a dropout_p > 0), each projection its own stream of it
    (forge/spec/lora_dropout.py: the masks are a hash of seed, SALT[p] and the element's indices)

Equivalent torch, per projection p. The adapter path runs in x's dtype: a_p and b_p are rounded
to it first (peft keeps adapters in fp32 on a bf16 model and computes this path in fp32; forge
runs its products on bf16/fp16 operands with fp32 accumulation, on the tensor cores, and hands
fp32 adapters fp32 gradients)::

    base = F.linear(x, w_p, bias_p)                                     # (..., N_p), x.dtype
    xd_p = lora_dropout.apply(x, seed, SALT[p], dropout_p)             # x if dropout_p == 0
    lora = F.linear(F.linear(xd_p, a_p.to(x.dtype)), b_p.to(x.dtype)) * scale_p
    p = base + lora                                                     # x.dtype (base alone
                                                                        # without an adapter)

Gradients flow to x and to every a_p and b_p. The base weights and biases are frozen: kernels
compute no gradient for them and raise ValueError if one requires grad while grad is enabled
(peft freezes them; train the base with plain nn.Linear instead). Backward, with xa_p = xd_p a_p^T
(M, r_p) saved from the forward, xd_p recomputed from x and the seed, g_p the output gradient::

    d b_p  = scale_p * g_p^T xa_p                       (N_p, r_p)
    d xa_p = scale_p * g_p b_p                          (M, r_p)
    d a_p  = d xa_p^T xd_p                              (r_p, H)
    d x    = sum_p (g_p w_p + drop_p(d xa_p a_p))       accumulated once, base and LoRA paths
                                             (drop_p = lora_dropout.apply of p's stream)

every product with x's dtype as operands (a_p, b_p rounded to it) and fp32 accumulation; d a_p
and d b_p are written in the adapter's dtype (fp32 for peft's fp32 adapters, never rounded
through x's dtype).
"""
from __future__ import annotations

import torch.nn.functional as F

from . import _check, lora_dropout

PROJ = ("q", "k", "v")
# the tensor arguments by name, in the signature's order (the seed is a keyword), and those
# with a gradient: every backend binds its gradients to these names, never to positions
TENSORS = ("x", *(f"{t}_{p}" for p in PROJ for t in ("w", "bias", "a", "b")), "seed")
TRAINABLE = ("x", *(f"{t}_{p}" for p in PROJ for t in ("a", "b")))


def _proj_args(name, x, w, bias, a, b, scale, *, width=None, in_name="x", optional=True):
    """Check one projection's weights against its input: x gives dtype and device, ``width``
    (default x's last dimension) the input features, ``in_name`` the name in messages. The
    arguments are ``w_<name>`` and so on (``w`` ... for name ""). With ``optional`` a and b may
    both be None (no adapter)."""
    def n(t):
        return f"{t}_{name}" if name else t

    _check.tensor(n("w"), w, min_dim=2)
    if w.dim() != 2:
        raise ValueError(f"{n('w')} must be 2-D, got {tuple(w.shape)}")
    _check.no_empty_dims(n("w"), w)
    h = x.shape[-1] if width is None else width
    if w.shape[1] != h:
        raise ValueError(f"{n('w')} has {w.shape[1]} input features but {in_name} has {h}")
    if bias is not None:
        _check.tensor(n("bias"), bias)
        if bias.shape != (w.shape[0],):
            raise ValueError(f"{n('bias')} must have shape ({w.shape[0]},), got {tuple(bias.shape)}")
        _check.same_dtype("x", x, n("bias"), bias)
    _check.same_dtype("x", x, n("w"), w)
    if isinstance(scale, bool) or not isinstance(scale, float | int):
        raise TypeError(f"{n('scale')} must be a number, got {type(scale).__name__}")
    if a is None and b is None and optional:
        _check.same_device(x=x, **{n("w"): w, n("bias"): bias})
        return
    if (a is None) != (b is None) or a is None:
        raise ValueError(f"{n('a')} and {n('b')} must both be given (an adapter)"
                         + (" or both be None (none)" if optional else ""))
    _check.tensor(n("a"), a, min_dim=2)
    _check.tensor(n("b"), b, min_dim=2)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{n('a')} and {n('b')} must be 2-D, got {tuple(a.shape)}, {tuple(b.shape)}")
    _check.no_empty_dims(n("a"), a, "an adapter (rank at least 1)")
    if a.shape[1] != h:
        raise ValueError(f"{n('a')} has {a.shape[1]} input features but {in_name} has {h}")
    if b.shape[0] != w.shape[0]:
        raise ValueError(f"{n('b')} has {b.shape[0]} output features but {n('w')} has {w.shape[0]}")
    if b.shape[1] != a.shape[0]:
        raise ValueError(f"{n('b')} has rank {b.shape[1]} but {n('a')} has rank {a.shape[0]}")
    _check.same_dtype(n("a"), a, n("b"), b)
    _check.same_device(x=x, **{n("w"): w, n("bias"): bias, n("a"): a, n("b"): b})


def check(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
          *, scale_q, scale_k, scale_v, seed=None, dropout_q=0.0, dropout_k=0.0, dropout_v=0.0) -> None:
    _check.tensor("x", x)
    _proj_args("q", x, w_q, bias_q, a_q, b_q, scale_q)
    _proj_args("k", x, w_k, bias_k, a_k, b_k, scale_k)
    _proj_args("v", x, w_v, bias_v, a_v, b_v, scale_v)
    ps = dict(zip(PROJ, (dropout_q, dropout_k, dropout_v)))
    for (p, d), a in zip(ps.items(), (a_q, a_k, a_v)):
        lora_dropout.check(p, d, a is not None)
    lora_dropout.check_seed(seed, ps, x.device)
    # one adapter dtype: kernels run the down-projections as one GEMM
    same_adapter_dtype(a_q=a_q, a_k=a_k, a_v=a_v)


def same_adapter_dtype(**named) -> None:
    """Every adapter given (not None) in one dtype."""
    given = [(n, a) for n, a in named.items() if a is not None]
    for n, a in given[1:]:
        _check.same_dtype(given[0][0], given[0][1], n, a)


def frozen(grad_enabled: bool, **named) -> None:
    """Raise if a base weight or bias would need a gradient (kernels compute none for them)."""
    if not grad_enabled:
        return
    for name, t in named.items():
        if t is not None and t.requires_grad:
            raise ValueError(f"{name} requires grad, but the LoRA kernels keep base weights and biases "
                             "frozen (no gradient); freeze it or use the unfused layer")


def project(x, w, bias, a, b, scale, seed=None, salt=0, p=0.0):
    """One LoRA linear, its adapter rounded to x's dtype and its input dropped out with stream
    (seed, salt): the reference for a single projection (also used by lora_mlp, lora_o). The
    rounding is differentiable: fp32 adapters get fp32 gradients."""
    base = F.linear(x, w, bias)
    if a is None:
        return base
    lora = F.linear(F.linear(lora_dropout.apply(x, seed, salt, p), a.to(x.dtype)), b.to(x.dtype)) * scale
    return base + lora


def reference(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
              *, scale_q, scale_k, scale_v, seed=None, dropout_q=0.0, dropout_k=0.0, dropout_v=0.0):
    check(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
          scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, seed=seed,
          dropout_q=dropout_q, dropout_k=dropout_k, dropout_v=dropout_v)
    salt = lora_dropout.SALT
    return (project(x, w_q, bias_q, a_q, b_q, scale_q, seed, salt["q"], dropout_q),
            project(x, w_k, bias_k, a_k, b_k, scale_k, seed, salt["k"], dropout_k),
            project(x, w_v, bias_v, a_v, b_v, scale_v, seed, salt["v"], dropout_v))


def elements(x, *_a, **_k) -> int:
    """Activation elements per call: rows x hidden."""
    return x.numel()


def reductions(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v, **_k) -> dict:
    """Reduction length behind each output and gradient (scales the tolerance): an output sums
    over H (base) and r (LoRA); d x over every N_p and r_p; d b_p over the rows after xa_p's sum
    over H, d a_p over the rows after d xa_p's sum over N_p (chained sums add up, as in
    forge.spec.lora_mlp's)."""
    h = x.shape[-1]
    rows = x.numel() // max(h, 1)
    r = [0 if a is None else a.shape[0] for a in (a_q, a_k, a_v)]
    out = {p: h + rp for p, rp in zip(PROJ, r)}
    out["x"] = sum(w.shape[0] + rp for w, rp in zip((w_q, w_k, w_v), r))
    n = [w.shape[0] for w in (w_q, w_k, w_v)]
    out.update({f"b_{p}": rows + h for p in PROJ})
    out.update({f"a_{p}": rows + n_p for p, n_p in zip(PROJ, n)})
    return out
