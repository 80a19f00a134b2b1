"""Fused LoRA projections in Triton: ``lora_qkv`` (q, k, v from one input) and ``lora_mlp``
(gated MLP with LoRA on gate, up and down). Specs, signatures and the backward derivations:
forge/spec/lora_qkv.py and forge/spec/lora_mlp.py; the kernels: forge_triton/lora_kernels.py.

The large matrix products (x W^T, dy W, ...) stay with cuBLAS through torch. Triton fuses what
sits around them: the rank-r up-projection ``scale * (x A^T) B^T`` is computed tile by tile and
added onto the base GEMM's output in place (never materialising the (M, N) LoRA term), and in
the MLP the gate/up LoRA terms, the activation and the product are one kernel forward, and the
down LoRA term, the activation's recompute and its derivative one kernel backward. grad_x is
accumulated once in one buffer (cuBLAS ``addmm_``, beta = 1, and the kernels add in place).

Adapter weights may have another dtype than x (peft keeps them in fp32 for bf16 models): they
are read in x's dtype, so every adapter product runs on x's dtype (the tensor cores for bf16 and
fp16) with fp32 accumulation, and no activation is ever copied into the adapter's dtype. The
adapters' gradients are accumulated in fp32 and written in their own dtype (fp32 for peft's fp32
adapters: cuBLAS's ``mm`` with an fp32 output on CUDA; on the CPU an fp32 product). The kernels
read B in its own dtype and round it in registers; the few-kilobyte A is cast once per call.
Base weights and biases are frozen.

Dropout (peft's lora_dropout) is drawn inside the kernels from the call's seed, each projection
its own stream (forge/spec/lora_dropout.py). Without dropout the adapters' down-projection and
its gradients are cuBLAS products over all adapters reading x at once; with it, kernels that
read x once, drop each adapter's copy in registers and multiply (lora_kernels.down_, grad_a,
add_dx_).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from forge.spec import lora_dropout as drop_spec
from forge.spec import lora_mlp as mlp_spec
from forge.spec import lora_qkv as qkv_spec

from . import _common, _ops
from . import lora_kernels as K


def _rows(x):
    return x.reshape(-1, x.shape[-1])  # (M, H); copies only when x's strides demand it


_HALF = (torch.bfloat16, torch.float16)


def _mm(a, b, out_dtype: torch.dtype):
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


def _in_dt(t, dt):
    return t if t.dtype == dt else t.to(dt)


class _Adapters:
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


def _down(x2, ad, seed):
    """(xa (M, R), a_cat (R, K)): x's down-projection by every adapter reading it, stacked, in
    x's dtype (each A rounded to it, stacked in a_cat). Without dropout one GEMM reads x once for
    all; with dropout one kernel reads x once and drops each adapter's copy in registers."""
    dt = x2.dtype
    a_cat = _in_dt(ad.a[0] if len(ad) == 1 else torch.cat(ad.a), dt)
    if not ad.drop:
        return x2 @ a_cat.t(), a_cat
    xa = _common.empty((x2.shape[0], a_cat.shape[0]), dt, x2.device)
    return K.down_(x2, a_cat, xa, seed, ad.ranks, ad.p, ad.salt), a_cat


def _grads_a(x2, dxa, ad, seed, ldt):
    """[d a_i] = [dxa_i^T drop_i(x)], in the adapters' dtype ``ldt`` (dxa (M, R) stacked)."""
    if not ad.drop:
        ga = _mm(dxa.t(), x2, ldt)  # (R, K): one GEMM for all
    else:
        ga = K.grad_a(x2, dxa, seed, ad.ranks, ad.p, ad.salt).to(ldt)
    return [ga[ad.cuts[i]:ad.cuts[i + 1]] for i in range(len(ad))]


def _add_dx_(gx, dxa, a_cat, ad, seed):
    """gx (M, K) += sum_i drop_i(dxa_i A_i), the adapters' path of the input's gradient."""
    if not ad.drop:
        return gx.addmm_(dxa, a_cat)  # one cuBLAS call, beta = 1
    return K.add_dx_(gx, dxa, a_cat, seed, ad.ranks, ad.p, ad.salt)


def _dxa(g2, b, s):
    """d xa = s g B, (M, r) in g's dtype (B rounded to it)."""
    return (g2 @ _in_dt(b, g2.dtype)).mul_(s)


def _grad_b(g2, xa, s, ldt):
    """d B = s g^T xa, (N, r) in the adapter's dtype."""
    return _mm(g2.t(), xa, ldt).mul_(s)


def _words(seed, ps):
    """The seed as the kernels read it (two int32 words), or None when no projection drops."""
    return drop_spec.words(seed) if seed is not None and any(ps) else None


def _none(t):
    return t if t is not None and t.numel() else None


# ---------------------------------------------------------------------------------------- qkv
# Each kernel is a forward ``*_fwd(*tensors in spec.TENSORS order, **static) -> (outputs,
# residuals)`` and a backward ``*_bwd(inputs, residuals, grads, needs, **static) -> {name: grad}``
# (``needs`` and the result keyed by the spec's names): the eager autograd.Functions below and the
# op layer's ops (torch.ops.forge.triton_lora_*) run the same two functions. Autocast is off
# inside both: the kernels compute in the dtypes they are given (a caller under autocast casts
# first, as forge.patching.lora does). A residual that does not exist is an empty tensor.
_NO_CONTEXT = contextlib.nullcontext()  # reusable, holds nothing


def _no_autocast(tensors):
    """Autocast off for the block on the tensors' device type; nothing to turn off (the usual
    case) costs no context object."""
    # any device type will do when no tensor is given (every output gradient undefined)
    dev = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), "cpu")
    if not torch.is_autocast_enabled(dev):
        return _NO_CONTEXT
    return torch.autocast(dev, enabled=False)


def _qkv_adapters(t, scales, ps):
    p = qkv_spec.PROJ
    return _Adapters.of(p, [t[f"a_{n}"] for n in p], [t[f"b_{n}"] for n in p], scales, ps)


def qkv_fwd(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v, seed=None, *, scales, ps):
    """(q, k, v), residuals (xa, a_cat): the adapters' down-projections of x (M, R) and their A
    stacked in x's dtype (R, H)."""
    t = dict(zip(qkv_spec.TENSORS, (x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v)))
    with _no_autocast((x,)):
        x2 = _rows(x)  # (M, H)
        ad, which = _qkv_adapters(t, scales, ps)
        xa = a_cat = None
        if len(ad):
            xa, a_cat = _down(x2, ad, _words(seed, ps))
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
    xa, a_cat = _none(res[0]), _none(res[1])
    with _no_autocast((x, *grads)):
        x2 = _rows(x)
        ad, which = _qkv_adapters(t, scales, ps)
        seed = _words(t["seed"], ps)
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
            dxa_parts.append(_dxa(g2, ad.b[j], ad.s[j]))
            if needs[f"b_{p}"]:  # d B_p = s g_p^T xa_p   (N_p, r_p)
                out[f"b_{p}"] = _grad_b(g2, xa[:, ad.cuts[j]:ad.cuts[j + 1]], ad.s[j], ad.b[j].dtype)
        if len(ad):
            dxa = dxa_parts[0] if len(ad) == 1 else torch.cat(dxa_parts, dim=1)  # (M, R)
            if any(needs[f"a_{qkv_spec.PROJ[i]}"] for i in which):
                for i, ga in zip(which, _grads_a(x2, dxa, ad, seed, ad.a[0].dtype)):
                    out[f"a_{qkv_spec.PROJ[i]}"] = ga
        if needs["x"]:
            if gx is None:
                gx = torch.zeros(x2.shape, dtype=x2.dtype, device=x2.device)
            if len(ad):
                _add_dx_(gx, dxa, a_cat, ad, seed)
            out["x"] = gx.view(x.shape)
        return out


def _saved(names, tensors, keep):
    return tuple(t if n in keep else None for n, t in zip(names, tensors))


class LoraQKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scales, ps, *tensors):
        outs, res = qkv_fwd(*tensors, scales=scales, ps=ps)
        ctx.save_for_backward(*_saved(qkv_spec.TENSORS, tensors, _QKV_SAVE), *res)
        ctx.scales, ctx.ps = scales, ps
        ctx.set_materialize_grads(False)  # k or v may be unused; skip their terms
        return outs

    @staticmethod
    @once_differentiable  # the Triton kernels are not differentiable themselves
    def backward(ctx, gq, gk, gv):
        saved = ctx.saved_tensors
        n = len(qkv_spec.TENSORS)
        needs = dict(zip(qkv_spec.TENSORS, ctx.needs_input_grad[2:]))
        out = qkv_bwd(saved[:n], saved[n:], (gq, gk, gv), needs, scales=ctx.scales, ps=ctx.ps)
        return (None, None, *(out.get(name) for name in qkv_spec.TENSORS))


_QKV_SAVE = frozenset(qkv_spec.TENSORS) - {f"bias_{p}" for p in qkv_spec.PROJ}
QKV = _ops.register(_ops.KernelDef("lora_qkv", qkv_fwd, qkv_bwd, names=qkv_spec.TENSORS, diff=qkv_spec.TRAINABLE,
                                   n_out=3, save=tuple(n for n in qkv_spec.TENSORS if n in _QKV_SAVE)))


# The spec's checks (shapes, dtypes, devices of every argument) cost ~30 us of Python a call;
# each signature they accept is remembered and a later call with the same one only reads it
# (bounded caches, as the other kernels' hot paths).
_QKV_OK = _common.Validated()
_MLP_OK = _common.Validated()


def _signature(extra, x, ws):
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


def _hot_rest(x, scales, seed, ps, adapters) -> bool:
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


def _any_requires_grad(ts) -> bool:
    for t in ts:
        if t is not None and t.requires_grad:
            return True
    return False


def lora_qkv(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
             *, scale_q, scale_k, scale_v, seed=None, dropout_q=0.0, dropout_k=0.0, dropout_v=0.0):
    """Triton LoRA q, k, v projections (forge.spec.lora_qkv) -> (q, k, v)."""
    compiling = _ops._compiling()
    key = None if compiling else _signature(None, x, (w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v,
                                                      a_v, b_v))
    if key is None or key not in _QKV_OK or not _hot_rest(
            x, (scale_q, scale_k, scale_v), seed, (dropout_q, dropout_k, dropout_v), (a_q, a_k, a_v)):
        qkv_spec.check(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
                       scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, seed=seed, dropout_q=dropout_q,
                       dropout_k=dropout_k, dropout_v=dropout_v)
        _common.check_device(x=x, w_q=w_q, a_q=a_q, b_q=b_q, w_k=w_k, a_k=a_k, b_k=b_k, w_v=w_v, a_v=a_v, b_v=b_v)
        if key is not None:
            _QKV_OK.add(key)
    if torch.is_grad_enabled() and _any_requires_grad((w_q, bias_q, w_k, bias_k, w_v, bias_v)):
        qkv_spec.frozen(True, w_q=w_q, bias_q=bias_q, w_k=w_k, bias_k=bias_k, w_v=w_v, bias_v=bias_v)
    scales = (float(scale_q), float(scale_k), float(scale_v))
    ps = (float(dropout_q), float(dropout_k), float(dropout_v))
    tensors = (x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v, seed if any(ps) else None)
    if compiling:
        return _ops.call(QKV, *tensors, scales=scales, ps=ps)
    return LoraQKVFunction.apply(scales, ps, *tensors)


# ---------------------------------------------------------------------------------------- mlp
def _mlp_adapters(t, scales, ps):
    """(gate and up's adapters and their positions, down's adapters)."""
    gu = _Adapters.of(("gate", "up"), [t["a_gate"], t["a_up"]], [t["b_gate"], t["b_up"]], scales[:2], ps[:2])
    down, _ = _Adapters.of(("down",), [t["a_down"]], [t["b_down"]], scales[2:], ps[2:])
    return gu, down


def mlp_fwd(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, seed=None, *, scales, gelu, ps):
    """y, (g, u, xa, a_gu, ha): the completed pre-activations, the gate and up adapters'
    down-projections of x side by side and their A stacked, and the down adapter's of h."""
    t = dict(zip(mlp_spec.TENSORS, (x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down)))
    with _no_autocast((x,)):
        x2 = _rows(x)  # (M, H)
        m, inter = x2.shape[0], w_gate.shape[0]
        (gu, which), down = _mlp_adapters(t, scales, ps)
        words = _words(seed, ps)
        empty = x2.new_empty(0)
        xa, a_gu = _down(x2, gu, words) if len(gu) else (empty, empty)
        g = x2 @ w_gate.t()  # (M, I) base GEMMs; the kernel completes them in place
        u = x2 @ w_up.t()
        h = _common.empty((m, inter), x2.dtype, x2.device)
        r_g = a_gate.shape[0] if a_gate is not None else 0
        r_u = a_up.shape[0] if a_up is not None else 0
        K.glu_fwd_(g, u, h, xa if len(gu) else g, b_gate, b_up, r_g, r_u, scales[0], scales[1], gelu)
        y = h @ w_down.t()  # (M, H)
        ha = empty
        if len(down):
            ha, _ = _down(h, down, words)  # (M, r_down)
            K.lora_add_(y, ha, b_down.t(), scales[2])
        return (y.view(*x.shape[:-1], w_down.shape[0]),), (g, u, xa, a_gu, ha)


def mlp_bwd(inputs, res, grads, needs, *, scales, gelu, ps):
    """{name: gradient} for the names ``needs`` asks for (x, a_p, b_p)."""
    t = dict(zip(mlp_spec.TENSORS, inputs))
    g, u, xa, a_gu, ha = res
    x, (dy,) = t["x"], grads
    s_g, s_u, s_d = scales
    with _no_autocast((x, dy)):
        x2 = _rows(x)
        (gu, which), down = _mlp_adapters(t, scales, ps)
        seed = _words(t["seed"], ps)
        w_gate, w_up, w_down = t["w_gate"], t["w_up"], t["w_down"]
        out = {}
        dy2 = dy.reshape(-1, dy.shape[-1])  # (M, H)
        dha = None
        if len(down):
            dha = _dxa(dy2, t["b_down"], s_d)  # (M, r)
            if needs["b_down"]:
                out["b_down"] = _grad_b(dy2, ha, s_d, t["b_down"].dtype)  # (H, r)
        dh = dy2 @ w_down  # (M, I); becomes h in the kernel
        dg = _common.empty_like(g)
        du = _common.empty_like(u)
        K.glu_bwd_(dh, g, u, dg, du, dha, t["a_down"], seed, ps[2], gelu)
        h = dh
        if len(down) and needs["a_down"]:
            (out["a_down"],) = _grads_a(h, dha, down, seed, t["a_down"].dtype)  # (r, I)
        if len(gu):
            names = [("gate", dg), ("up", du)]
            parts = []
            for j, i in enumerate(which):
                name, gp = names[i]
                parts.append(_dxa(gp, gu.b[j], gu.s[j]))  # (M, r_p)
                if needs[f"b_{name}"]:
                    out[f"b_{name}"] = _grad_b(gp, xa[:, gu.cuts[j]:gu.cuts[j + 1]], gu.s[j], gu.b[j].dtype)
            dxa = parts[0] if len(gu) == 1 else torch.cat(parts, dim=1)  # (M, R)
            if any(needs[f"a_{names[i][0]}"] for i in which):
                for i, ga in zip(which, _grads_a(x2, dxa, gu, seed, gu.a[0].dtype)):
                    out[f"a_{names[i][0]}"] = ga
        if needs["x"]:
            gx = dg @ w_gate  # (M, H): base and LoRA paths accumulated into one buffer
            gx.addmm_(du, w_up)
            if len(gu):
                _add_dx_(gx, dxa, a_gu, gu, seed)
            out["x"] = gx.view(x.shape)
        return out


class LoraMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scales, gelu, ps, *tensors):
        (y,), res = mlp_fwd(*tensors, scales=scales, gelu=gelu, ps=ps)
        ctx.save_for_backward(*tensors, *res)
        ctx.scales, ctx.gelu, ctx.ps = scales, gelu, ps
        return y

    @staticmethod
    @once_differentiable  # the Triton kernels are not differentiable themselves
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        n = len(mlp_spec.TENSORS)
        needs = dict(zip(mlp_spec.TENSORS, ctx.needs_input_grad[3:]))
        out = mlp_bwd(saved[:n], saved[n:], (dy,), needs, scales=ctx.scales, gelu=ctx.gelu, ps=ctx.ps)
        return (None, None, None, *(out.get(name) for name in mlp_spec.TENSORS))


MLP = _ops.register(_ops.KernelDef("lora_mlp", mlp_fwd, mlp_bwd, names=mlp_spec.TENSORS, diff=mlp_spec.TRAINABLE,
                                   n_out=1))


def lora_mlp(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
             *, scale_gate, scale_up, scale_down, act="silu", seed=None, dropout_gate=0.0, dropout_up=0.0,
             dropout_down=0.0):
    """Triton gated MLP with LoRA on gate, up and down (forge.spec.lora_mlp) -> y."""
    compiling = _ops._compiling()
    key = None if compiling else _signature(act, x, (w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down,
                                                     b_down))
    if key is None or key not in _MLP_OK or not _hot_rest(
            x, (scale_gate, scale_up, scale_down), seed, (dropout_gate, dropout_up, dropout_down),
            (a_gate, a_up, a_down)):
        mlp_spec.check(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
                       scale_gate=scale_gate, scale_up=scale_up, scale_down=scale_down, act=act, seed=seed,
                       dropout_gate=dropout_gate, dropout_up=dropout_up, dropout_down=dropout_down)
        _common.check_device(x=x, w_gate=w_gate, a_gate=a_gate, b_gate=b_gate, w_up=w_up, a_up=a_up,
                             b_up=b_up, w_down=w_down, a_down=a_down, b_down=b_down)
        if key is not None:
            _MLP_OK.add(key)
    if torch.is_grad_enabled() and _any_requires_grad((w_gate, w_up, w_down)):
        mlp_spec.frozen(True, w_gate=w_gate, w_up=w_up, w_down=w_down)
    scales = (float(scale_gate), float(scale_up), float(scale_down))
    ps = (float(dropout_gate), float(dropout_up), float(dropout_down))
    tensors = (x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, seed if any(ps) else None)
    gelu = act == "gelu_tanh"
    if compiling:
        return _ops.call(MLP, *tensors, scales=scales, gelu=gelu, ps=ps)[0]
    return LoraMLPFunction.apply(scales, gelu, ps, *tensors)
