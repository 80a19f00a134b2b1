"""Fused LoRA projections in Triton: ``lora_qkv`` (q, k, v from one input), ``lora_o`` (one LoRA
linear: the attention's o_proj) and ``lora_mlp`` (gated MLP with LoRA on gate, up and down; a
projection of q/k/v or of the MLP may have no adapter: its plain base product). Specs,
signatures and the backward derivations: forge/spec/lora_qkv.py, lora_o.py and lora_mlp.py; the
kernels: forge_triton/lora_kernels.py; the adapters' shared products: lora_adapters.py.

The large matrix products (x W^T, dy W, ...) stay with cuBLAS through torch. Triton fuses what
sits around them: the rank-r up-projection ``scale * (x A^T) B^T`` is computed tile by tile and
added onto the base GEMM's output in place (never materialising the (M, N) LoRA term), and in
the MLP the gate/up LoRA terms, the activation and the product are one kernel forward, and the
down LoRA term, the activation's recompute and its derivative one kernel backward. grad_x is
accumulated once in one buffer (cuBLAS ``addmm_``, beta = 1, and the kernels add in place).

Adapter weights are read in x's dtype (lora_adapters.py has the dtype rules): the kernels read B
in its own dtype and round it in registers; the few-kilobyte A is cast once per call. Base
weights and biases are frozen.

Dropout (peft's lora_dropout) is drawn inside the kernels from the call's seed, each projection
its own stream (forge/spec/lora_dropout.py). Without dropout the adapters' down-projection and
its gradients are cuBLAS products over all adapters reading x at once; with it, kernels that
read x once, drop each adapter's copy in registers and multiply (lora_kernels.down, grad_a,
add_dx_).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from forge.spec import lora_mlp as mlp_spec
from forge.spec import lora_o as o_spec
from forge.spec import lora_qkv as qkv_spec
from forge.spec._check import no_double_backward

from . import _common, _ops
from . import lora_adapters as A
from . import lora_kernels as K


# ---------------------------------------------------------------------------------------- qkv
# Each kernel is a forward ``*_fwd(*tensors in spec.TENSORS order, **static) -> (outputs,
# residuals)`` and a backward ``*_bwd(inputs, residuals, grads, needs, **static) -> {name: grad}``
# (``needs`` and the result keyed by the spec's names): the eager autograd.Functions below and the
# op layer's ops (torch.ops.forge.triton_lora_*) run the same two functions. Autocast is off
# inside both: the kernels compute in the dtypes they are given (a caller under autocast casts
# first, as forge.patching.lora does). A residual that does not exist is an empty tensor.
def _qkv_adapters(t, scales, ps):
    p = qkv_spec.PROJ
    return A.Adapters.of(p, [t[f"a_{n}"] for n in p], [t[f"b_{n}"] for n in p], scales, ps)


def qkv_fwd(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v, seed=None, *, scales, ps):
    """(q, k, v), residuals (xa, a_cat): the adapters' down-projections of x (M, R) and their A
    stacked in x's dtype (R, H)."""
    t = dict(zip(qkv_spec.TENSORS, (x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v)))
    with A.no_autocast((x,)):
        x2 = A.rows(x)  # (M, H)
        ad, which = _qkv_adapters(t, scales, ps)
        xa = a_cat = None
        if len(ad):
            xa, a_cat = A.down(x2, ad, A.words(seed, ps))
        outs = []
        for i, p in enumerate(qkv_spec.PROJ):
            w = t[f"w_{p}"]
            base = F.linear(x2, w, t[f"bias_{p}"])  # (M, N_p), cuBLAS with the bias in its epilogue
            if i in which:
                j = which.index(i)
                K.lora_add_(base, xa[:, ad.cuts[j]:ad.cuts[j + 1]], ad.b[j].t(), ad.s[j])
            outs.append(base.view(*x.shape[:-1], w.shape[0]))
        empty = x2.new_empty(0)
        return tuple(outs), (empty if xa is None else xa, empty if a_cat is None else a_cat)


def qkv_bwd(inputs, res, grads, needs, *, scales, ps):
    """{name: gradient} for the names ``needs`` asks for (x, a_p, b_p); ``grads`` may hold None
    for a projection whose output got no gradient (k or v unused)."""
    t = dict(zip(qkv_spec.TENSORS, inputs))
    x = t["x"]
    xa, a_cat = A.none(res[0]), A.none(res[1])
    with A.no_autocast((x, *grads)):
        x2 = A.rows(x)
        ad, which = _qkv_adapters(t, scales, ps)
        seed = A.words(t["seed"], ps)
        out = {}
        dxa_parts = []  # d xa_i = s g_i B_i, (M, r_i) each; zero for a projection with no gradient
        gx = None
        for i, (p, g) in enumerate(zip(qkv_spec.PROJ, grads)):
            j = which.index(i) if i in which else None
            if g is None:
                if j is not None:
                    dxa_parts.append(xa.new_zeros((xa.shape[0], ad.ranks[j])))
                continue
            g2 = g.reshape(-1, g.shape[-1])  # (M, N_p)
            if needs["x"]:
                gx = g2 @ t[f"w_{p}"] if gx is None else gx.addmm_(g2, t[f"w_{p}"])  # base path, in place
            if j is None:
                continue
            dxa_parts.append(A.dxa(g2, ad.b[j], ad.s[j]))
            if needs[f"b_{p}"]:  # d B_p = s g_p^T xa_p   (N_p, r_p)
                out[f"b_{p}"] = A.grad_b(g2, xa[:, ad.cuts[j]:ad.cuts[j + 1]], ad.s[j], ad.b[j].dtype)
        if len(ad):
            dxa = dxa_parts[0] if len(ad) == 1 else torch.cat(dxa_parts, dim=1)  # (M, R)
            if any(needs[f"a_{qkv_spec.PROJ[i]}"] for i in which):
                for i, ga in zip(which, A.grads_a(x2, dxa, ad, seed, ad.a[0].dtype)):
                    out[f"a_{qkv_spec.PROJ[i]}"] = ga
        if needs["x"]:
            if gx is None:
                gx = torch.zeros(x2.shape, dtype=x2.dtype, device=x2.device)
            if len(ad):
                A.add_dx_(gx, dxa, a_cat, ad, seed)
            out["x"] = gx.view(x.shape)
        return out


_KEEP: dict = {}


class KernelFunction(torch.autograd.Function):
    """The eager autograd node of every Triton LoRA kernel, built from its KernelDef: the forward
    and backward the op layer runs under torch.compile (``kdef.fwd`` / ``kdef.bwd``, static
    settings as keywords), the inputs named in ``kdef.save`` kept for the backward."""

    @staticmethod
    def forward(ctx, kdef, static, *tensors):
        outs, res = kdef.fwd(*tensors, **static)
        keep = _KEEP.get(kdef)
        if keep is None:  # per input, whether the backward reads it (decided once per kernel)
            keep = _KEEP[kdef] = tuple(kdef.save is None or n in kdef.save for n in kdef.names)
        ctx.save_for_backward(*(t if k else None for k, t in zip(keep, tensors)), *res)
        ctx.kdef, ctx.static = kdef, static
        if kdef.n_out > 1:  # lora_qkv: k or v may be unused, their terms skipped (None gradients)
            ctx.set_materialize_grads(False)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    @no_double_backward("LoRA")  # the Triton kernels are not differentiable themselves
    def backward(ctx, *grads):
        kdef, saved = ctx.kdef, ctx.saved_tensors
        n = len(kdef.names)
        needs = dict(zip(kdef.names, ctx.needs_input_grad[2:]))
        out = kdef.bwd(saved[:n], saved[n:], grads, needs, **ctx.static)
        return (None, None, *(out.get(name) for name in kdef.names))


_QKV_SAVE = frozenset(qkv_spec.TENSORS) - {f"bias_{p}" for p in qkv_spec.PROJ}
QKV = _ops.register(_ops.KernelDef("lora_qkv", qkv_fwd, qkv_bwd, names=qkv_spec.TENSORS, diff=qkv_spec.TRAINABLE,
                                   n_out=3, save=tuple(n for n in qkv_spec.TENSORS if n in _QKV_SAVE)))


# The spec's checks (shapes, dtypes, devices of every argument) cost ~30 us of Python a call;
# each signature they accept is remembered and a later call with the same one only reads it
# (bounded caches, as the other kernels' hot paths).
_QKV_OK = _common.Validated()
_MLP_OK = _common.Validated()
_O_OK = _common.Validated()


def lora_qkv(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
             *, scale_q, scale_k, scale_v, seed=None, dropout_q=0.0, dropout_k=0.0, dropout_v=0.0):
    """Triton LoRA q, k, v projections (forge.spec.lora_qkv) -> (q, k, v)."""
    compiling = _ops._compiling()
    key = None if compiling else A.signature(None, x, (w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v,
                                                      a_v, b_v))
    if key is None or key not in _QKV_OK or not A.hot_rest(
            x, (scale_q, scale_k, scale_v), seed, (dropout_q, dropout_k, dropout_v), (a_q, a_k, a_v)):
        qkv_spec.check(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
                       scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, seed=seed, dropout_q=dropout_q,
                       dropout_k=dropout_k, dropout_v=dropout_v)
        _common.check_device(x=x, w_q=w_q, a_q=a_q, b_q=b_q, w_k=w_k, a_k=a_k, b_k=b_k, w_v=w_v, a_v=a_v, b_v=b_v)
        if key is not None:
            _QKV_OK.add(key)
    if torch.is_grad_enabled() and A.any_requires_grad((w_q, bias_q, w_k, bias_k, w_v, bias_v)):
        qkv_spec.frozen(True, w_q=w_q, bias_q=bias_q, w_k=w_k, bias_k=bias_k, w_v=w_v, bias_v=bias_v)
    scales = (float(scale_q), float(scale_k), float(scale_v))
    ps = (float(dropout_q), float(dropout_k), float(dropout_v))
    tensors = (x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v, seed if any(ps) else None)
    if compiling:
        return _ops.call(QKV, *tensors, scales=scales, ps=ps)
    return KernelFunction.apply(QKV, dict(scales=scales, ps=ps), *tensors)


# ---------------------------------------------------------------------------------------- mlp
def _mlp_adapters(t, scales, ps):
    """(gate and up's adapters and their positions, down's adapters)."""
    gu = A.Adapters.of(("gate", "up"), [t["a_gate"], t["a_up"]], [t["b_gate"], t["b_up"]], scales[:2], ps[:2])
    down, _ = A.Adapters.of(("down",), [t["a_down"]], [t["b_down"]], scales[2:], ps[2:])
    return gu, down


def mlp_fwd(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, seed=None, *, scales, gelu, ps,
            recompute=False):
    """y, (g, u, xa, a_gu, ha): the completed pre-activations, the gate and up adapters'
    down-projections of x side by side and their A stacked, and the down adapter's of h. With
    ``recompute`` g and u are not kept (empty): the backward makes them again from x."""
    t = dict(zip(mlp_spec.TENSORS, (x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down)))
    with A.no_autocast((x,)):
        x2 = A.rows(x)  # (M, H)
        m, inter = x2.shape[0], w_gate.shape[0]
        (gu, which), down = _mlp_adapters(t, scales, ps)
        words = A.words(seed, ps)
        empty = x2.new_empty(0)
        xa, a_gu = A.down(x2, gu, words) if len(gu) else (empty, empty)
        g = x2 @ w_gate.t()  # (M, I) base GEMMs; the kernel completes them in place
        u = x2 @ w_up.t()
        h = _common.empty((m, inter), x2.dtype, x2.device)
        r_g = a_gate.shape[0] if a_gate is not None else 0
        r_u = a_up.shape[0] if a_up is not None else 0
        K.glu_fwd_(g, u, h, xa if len(gu) else g, b_gate, b_up, r_g, r_u, scales[0], scales[1], gelu)
        y = h @ w_down.t()  # (M, H)
        ha = empty
        if len(down):
            ha, _ = A.down(h, down, words)  # (M, r_down)
            K.lora_add_(y, ha, b_down.t(), scales[2])
        if recompute:  # (two fresh empties: an op's outputs may not alias one another)
            g, u = x2.new_empty(0), x2.new_empty(0)
        return (y.view(*x.shape[:-1], w_down.shape[0]),), (g, u, xa, a_gu, ha)


def _pre_activations(x2, t, gu, xa, scales, gelu, scratch):
    """g and u again, completed by gate's and up's adapter terms as the forward completed them
    (the same products and kernel; ``scratch``, (M, I), takes the activation it also writes)."""
    g = x2 @ t["w_gate"].t()
    u = x2 @ t["w_up"].t()
    if len(gu):
        r_g = t["a_gate"].shape[0] if t["a_gate"] is not None else 0
        r_u = t["a_up"].shape[0] if t["a_up"] is not None else 0
        K.glu_fwd_(g, u, scratch, xa, t["b_gate"], t["b_up"], r_g, r_u, scales[0], scales[1], gelu)
    return g, u


def mlp_bwd(inputs, res, grads, needs, *, scales, gelu, ps, recompute=False):
    """{name: gradient} for the names ``needs`` asks for (x, a_p, b_p)."""
    t = dict(zip(mlp_spec.TENSORS, inputs))
    g, u, xa, a_gu, ha = res
    x, (dy,) = t["x"], grads
    s_g, s_u, s_d = scales
    with A.no_autocast((x, dy)):
        x2 = A.rows(x)
        (gu, which), down = _mlp_adapters(t, scales, ps)
        seed = A.words(t["seed"], ps)
        w_gate, w_up, w_down = t["w_gate"], t["w_up"], t["w_down"]
        out = {}
        dy2 = dy.reshape(-1, dy.shape[-1])  # (M, H)
        dha = None
        if len(down):
            dha = A.dxa(dy2, t["b_down"], s_d)  # (M, r)
            if needs["b_down"]:
                out["b_down"] = A.grad_b(dy2, ha, s_d, t["b_down"].dtype)  # (H, r)
        dh = dy2 @ w_down  # (M, I); becomes h in the kernel
        dg = _common.empty_like(dh)
        du = _common.empty_like(dh)
        if recompute:
            g, u = _pre_activations(x2, t, gu, xa, scales, gelu, dg)
        K.glu_bwd_(dh, g, u, dg, du, dha, t["a_down"], seed, ps[2], gelu)
        h = dh
        if len(down) and needs["a_down"]:
            (out["a_down"],) = A.grads_a(h, dha, down, seed, t["a_down"].dtype)  # (r, I)
        if len(gu):
            names = [("gate", dg), ("up", du)]
            parts = []
            for j, i in enumerate(which):
                name, gp = names[i]
                parts.append(A.dxa(gp, gu.b[j], gu.s[j]))  # (M, r_p)
                if needs[f"b_{name}"]:
                    out[f"b_{name}"] = A.grad_b(gp, xa[:, gu.cuts[j]:gu.cuts[j + 1]], gu.s[j], gu.b[j].dtype)
            dxa = parts[0] if len(gu) == 1 else torch.cat(parts, dim=1)  # (M, R)
            if any(needs[f"a_{names[i][0]}"] for i in which):
                for i, ga in zip(which, A.grads_a(x2, dxa, gu, seed, gu.a[0].dtype)):
                    out[f"a_{names[i][0]}"] = ga
        if needs["x"]:
            gx = dg @ w_gate  # (M, H): base and LoRA paths accumulated into one buffer
            gx.addmm_(du, w_up)
            if len(gu):
                A.add_dx_(gx, dxa, a_gu, gu, seed)
            out["x"] = gx.view(x.shape)
        return out


MLP = _ops.register(_ops.KernelDef("lora_mlp", mlp_fwd, mlp_bwd, names=mlp_spec.TENSORS, diff=mlp_spec.TRAINABLE,
                                   n_out=1))


def lora_mlp(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
             *, scale_gate, scale_up, scale_down, act="silu", seed=None, dropout_gate=0.0, dropout_up=0.0,
             dropout_down=0.0, recompute=False):
    """Triton gated MLP with LoRA on gate, up and down (forge.spec.lora_mlp) -> y. ``recompute``:
    keep x, not the (M, I) pre-activations, for the backward (two products more there)."""
    compiling = _ops._compiling()
    key = None if compiling else A.signature(act, x, (w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down,
                                                     b_down))
    if key is None or key not in _MLP_OK or not A.hot_rest(
            x, (scale_gate, scale_up, scale_down), seed, (dropout_gate, dropout_up, dropout_down),
            (a_gate, a_up, a_down)):
        mlp_spec.check(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
                       scale_gate=scale_gate, scale_up=scale_up, scale_down=scale_down, act=act, seed=seed,
                       dropout_gate=dropout_gate, dropout_up=dropout_up, dropout_down=dropout_down)
        _common.check_device(x=x, w_gate=w_gate, a_gate=a_gate, b_gate=b_gate, w_up=w_up, a_up=a_up,
                             b_up=b_up, w_down=w_down, a_down=a_down, b_down=b_down)
        if key is not None:
            _MLP_OK.add(key)
    if torch.is_grad_enabled() and A.any_requires_grad((w_gate, w_up, w_down)):
        mlp_spec.frozen(True, w_gate=w_gate, w_up=w_up, w_down=w_down)
    scales = (float(scale_gate), float(scale_up), float(scale_down))
    ps = (float(dropout_gate), float(dropout_up), float(dropout_down))
    tensors = (x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, seed if any(ps) else None)
    gelu = act == "gelu_tanh"
    static = dict(scales=scales, gelu=gelu, ps=ps, recompute=bool(recompute))
    if compiling:
        return _ops.call(MLP, *tensors, **static)[0]
    return KernelFunction.apply(MLP, static, *tensors)


# ---------------------------------------------------------------------------------------- o
def o_fwd(x, w, bias, a, b, seed=None, *, scale, p):
    """y, (xa, a_x): the adapter's down-projection of x (M, r) and its A in x's dtype."""
    with A.no_autocast((x,)):
        x2 = A.rows(x)  # (M, K)
        ad = A.Adapters([a], [b], [scale], [p], ["o"])
        xa, a_x = A.down(x2, ad, A.words(seed, (p,)))
        y = F.linear(x2, w, bias)  # (M, N)
        K.lora_add_(y, xa, b.t(), scale)
        return (y.view(*x.shape[:-1], w.shape[0]),), (xa, a_x)


def o_bwd(inputs, res, grads, needs, *, scale, p):
    t = dict(zip(o_spec.TENSORS, inputs))
    x, (g,) = t["x"], grads
    xa, a_x = res
    with A.no_autocast((x, g)):
        x2, g2 = A.rows(x), g.reshape(-1, g.shape[-1])
        ad = A.Adapters([t["a"]], [t["b"]], [scale], [p], ["o"])
        seed = A.words(t["seed"], (p,))
        out = {}
        dxa = A.dxa(g2, t["b"], scale)  # (M, r)
        if needs["b"]:
            out["b"] = A.grad_b(g2, xa, scale, t["b"].dtype)
        if needs["a"]:
            (out["a"],) = A.grads_a(x2, dxa, ad, seed, t["a"].dtype)
        if needs["x"]:
            gx = g2 @ t["w"]
            out["x"] = A.add_dx_(gx, dxa, a_x, ad, seed).view(x.shape)
        return out


_O_SAVE = frozenset(o_spec.TENSORS) - {"bias"}
O = _ops.register(_ops.KernelDef("lora_o", o_fwd, o_bwd, names=o_spec.TENSORS, diff=o_spec.TRAINABLE, n_out=1,
                                 save=tuple(n for n in o_spec.TENSORS if n in _O_SAVE)))


def lora_o(x, w, bias, a, b, *, scale, seed=None, dropout=0.0):
    """Triton LoRA linear (forge.spec.lora_o) -> y."""
    compiling = _ops._compiling()
    key = None if compiling else A.signature("o", x, (w, bias, a, b))
    if key is None or key not in _O_OK or not A.hot_rest(x, (scale,), seed, (dropout,), (a,)) or a is None:
        o_spec.check(x, w, bias, a, b, scale=scale, seed=seed, dropout=dropout)
        _common.check_device(x=x, w=w, a=a, b=b)
        if key is not None:
            _O_OK.add(key)
    if torch.is_grad_enabled() and A.any_requires_grad((w, bias)):
        o_spec.frozen(True, w=w, bias=bias)
    p = float(dropout)
    tensors = (x, w, bias, a, b, seed if p else None)
    if compiling:
        return _ops.call(O, *tensors, scale=float(scale), p=p)[0]
    return KernelFunction.apply(O, dict(scale=float(scale), p=p), *tensors)
