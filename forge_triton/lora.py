"""Fused LoRA projections in Triton: ``lora_qkv`` (q, k, v from one input) and ``lora_mlp``
(gated MLP with LoRA on gate, up and down). Specs, signatures and the backward derivations:
forge/spec/lora_qkv.py and forge/spec/lora_mlp.py.

The large matrix products (x W^T, x A^T, dy W, ...) stay with cuBLAS through torch. Triton
fuses what sits around them: the rank-r up-projection ``scale * (x A^T) B^T`` is computed tile
by tile and added onto the base GEMM's output in place (never materialising the (M, N) LoRA
term), and in the MLP the gate/up LoRA terms, the activation and the product are one kernel
forward, and the down LoRA term, the activation's recompute and its derivative one kernel
backward. grad_x is accumulated once by chained ``addmm_`` (cuBLAS beta = 1).

Adapter weights may have another dtype than x (peft keeps them in fp32 for bf16 models): they
are read in x's dtype, so every adapter product runs on x's dtype (the tensor cores for bf16 and
fp16) with fp32 accumulation, and no activation is ever copied into the adapter's dtype. The
adapters' gradients are accumulated in fp32 and written in their own dtype (fp32 for peft's fp32
adapters: cuBLAS's ``mm`` with an fp32 output on CUDA; on the CPU an fp32 product). The kernels
read B in its own dtype and round it in registers; the few-kilobyte A is cast once per call.
Base weights and biases are frozen.

peft's lora_dropout comes in as one bool mask per projection (forge/spec/lora_dropout.py). With
a mask, that projection's down-projection and its gradients read the dropped-out input, which is
recomputed from x and the mask in backward (the mask is all that is kept); the down adapter's
mask is applied inside ``_lora_glu_bwd_kernel``. Without masks the code paths are unchanged.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from forge.spec import lora_dropout as drop_spec
from forge.spec import lora_mlp as mlp_spec
from forge.spec import lora_qkv as qkv_spec

from . import _common, _launch, _ops
from ._common import cast  # rounds bf16 to nearest even in the interpreter too
from .glu import _act_and_grad

BLOCK_M = 64
BLOCK_N = 128


def _block_k(r: int) -> int:
    # tl.dot needs K >= 16; ranks above 64 loop over K (host-side int math: triton's
    # next_power_of_2 is a constexpr_function on Triton 3.6, microseconds a call; it stays for a
    # symbolic rank, which the op layer's fakes may carry)
    return max(16, min(64, _common.next_pow2(r) if type(r) is int else triton.next_power_of_2(r)))


@triton.jit
def _lowrank_tile(p_ptr, q_ptr, rm, rn, M, N, K, s_pm, s_pk, s_qk, s_qn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr,
                  ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """(P Q)[rm, rn] for P (M, K) and Q (K, N) given by strides, K small (the LoRA rank); both
    read in their own dtype and rounded to DT (x's) for the product, accumulated in ACC."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        p = tl.load(p_ptr + rm[:, None] * s_pm + rk[None, :] * s_pk,
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # (BM, BK)
        q = tl.load(q_ptr + rk[:, None] * s_qk + rn[None, :] * s_qn,
                    mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)  # (BK, BN)
        p = cast(p, DT)  # fp32 adapters on a bf16 model: rounded here, products on the tensor cores
        q = cast(q, DT)
        if UPCAST:  # interpreter: bf16 tl.dot is wrong there; float64 stays float64
            p = p.to(ACC)
            q = q.to(ACC)
        if IEEE:  # fp32 models: full fp32 products, as cuBLAS does for eager, not tf32
            acc += tl.dot(p, q, input_precision="ieee")
        else:
            acc += tl.dot(p, q)
    return acc


# out (M, N) += scale * P (M, K) @ Q (K, N); out is the base GEMM's output, updated in place
@triton.jit
def _lora_add_kernel(out_ptr, p_ptr, q_ptr, M, N, K, scale, s_om, s_on, s_pm, s_pk, s_qk, s_qn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr,
                     ACC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = _lowrank_tile(p_ptr, q_ptr, rm, rn, M, N, K, s_pm, s_pk, s_qk, s_qn,
                       BLOCK_M, BLOCK_N, BLOCK_K, DT, ACC, UPCAST, IEEE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = out_ptr + rm[:, None] * s_om + rn[None, :] * s_on
    base = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
    tl.store(ptrs, cast(base + scale * lo, out_ptr.dtype.element_ty), mask=mask)


# g, u (M, I) hold the base GEMMs x W^T; add each LoRA term, store the full pre-activations back
# (backward recomputes act from them) and h = act(g) * u. g and u are rounded to the storage
# dtype before act, and act(g) before the product, as eager peft + HF compute them.
@triton.jit
def _lora_glu_fwd_kernel(g_ptr, u_ptr, h_ptr, xa_ptr, bg_ptr, bu_ptr, M, N, K_G, K_U, scale_g, scale_u,
                         s_xm, s_xk, s_bgk, s_bgn, s_buk, s_bun,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GELU: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
                         IEEE: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    lg = _lowrank_tile(xa_ptr, bg_ptr, rm, rn, M, N, K_G, s_xm, s_xk, s_bgk, s_bgn,
                       BLOCK_M, BLOCK_N, BLOCK_K, DT, ACC, UPCAST, IEEE)
    # the up adapter's xa_u sits K_G columns after xa_gate in the shared (M, K_G + K_U) buffer
    lu = _lowrank_tile(xa_ptr + K_G * s_xk, bu_ptr, rm, rn, M, N, K_U, s_xm, s_xk, s_buk, s_bun,
                       BLOCK_M, BLOCK_N, BLOCK_K, DT, ACC, UPCAST, IEEE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]  # g, u, h are contiguous (M, N)
    dt = h_ptr.dtype.element_ty
    g = cast(tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC) + scale_g * lg, dt)
    u = cast(tl.load(u_ptr + offs, mask=mask, other=0.0).to(ACC) + scale_u * lu, dt)
    tl.store(g_ptr + offs, g, mask=mask)
    tl.store(u_ptr + offs, u, mask=mask)
    a, _ = _act_and_grad(g.to(ACC), GELU)
    tl.store(h_ptr + offs, cast(cast(a, dt).to(ACC) * u.to(ACC), dt), mask=mask)


# dh = dh_base + drop(dha @ A_down) with dh_base = dy W_down in dh_ptr, dha = scale_down * dy B_down
# and drop the down adapter's dropout (DROP: keep-mask in keep_ptr, kept elements times drop_scale);
# then h = act(g) * u  =>  dg = dh * u * act'(g),  du = dh * act(g). h is recomputed (for
# d A_down = dha^T drop(h)) and written over dh_ptr, which is not needed afterwards.
@triton.jit
def _lora_glu_bwd_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, dha_ptr, ad_ptr, keep_ptr, drop_scale, M, N, K,
                         s_dm, s_dk, s_ak, s_an,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DROP: tl.constexpr,
                         GELU: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr,
                         IEEE: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    lo = _lowrank_tile(dha_ptr, ad_ptr, rm, rn, M, N, K, s_dm, s_dk, s_ak, s_an,
                       BLOCK_M, BLOCK_N, BLOCK_K, DT, ACC, UPCAST, IEEE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None] * N + rn[None, :]
    if DROP:  # the adapter saw drop(h): its gradient reaches h only where h was kept
        keep = tl.load(keep_ptr + offs, mask=mask, other=0)
        lo = lo * (keep.to(ACC) * drop_scale)  # a product, as torch's dropout
    dt = dh_ptr.dtype.element_ty
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(ACC) + lo
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(ACC)
    a, da = _act_and_grad(g, GELU)
    tl.store(dg_ptr + offs, cast(dh * u * da, dt), mask=mask)
    tl.store(du_ptr + offs, cast(dh * a, dt), mask=mask)
    tl.store(dh_ptr + offs, cast(cast(a, dt).to(ACC) * u, dt), mask=mask)


# FastKernel: the compiled launcher called directly once a specialisation is known (Triton's own
# launch path is ~10 us more host time a call; six launches a decoder layer, forward + backward)
_LORA_ADD = _launch.FastKernel(_lora_add_kernel)
_LORA_GLU_FWD = _launch.FastKernel(_lora_glu_fwd_kernel)
_LORA_GLU_BWD = _launch.FastKernel(_lora_glu_bwd_kernel)


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}


def _consts_of(dt: torch.dtype, r) -> dict:
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=_block_k(r), DT=_TL[dt], ACC=_common.acc(dt),
                UPCAST=_common.dot_upcast(), IEEE=dt == torch.float32)


_consts_cached = functools.lru_cache(maxsize=256)(_consts_of)


def _consts(dt: torch.dtype, r) -> dict:
    """The constexpr keywords of a launch whose products take ``dt`` (x's dtype) as operands
    (cached: the same few per model; only ever unpacked; a symbolic rank under the op layer's
    fakes is not hashable and is not cached)."""
    return _consts_cached(dt, r) if type(r) is int else _consts_of(dt, r)


def _grid(m, n):
    return (_common.cdiv(m, BLOCK_M), _common.cdiv(n, BLOCK_N))


def lora_add_(out, p, q, scale: float):
    """out (M, N) += scale * p (M, K) @ q (K, N), in place; strided p and q are fine."""
    m, n = out.shape
    if m and n:
        _LORA_ADD[_grid(m, n)](out, p, q, m, n, p.shape[1], float(scale), out.stride(0), out.stride(1),
                                      p.stride(0), p.stride(1), q.stride(0), q.stride(1),
                                      **_consts(out.dtype, p.shape[1]), num_warps=4)
    return out


def _rows(x):
    return x.reshape(-1, x.shape[-1])  # (M, H); copies only when x's strides demand it


_DROPOUT_BWD = torch.ops.aten.native_dropout_backward


def _drop(t, mask, p):
    """``drop_spec.apply(t, mask, p)``: ``t * mask * scale``. On CUDA through torch's dropout
    backward, one kernel forming the same two products in the same order (apply's ``mul`` and
    ``mul_`` are two launches); elsewhere apply itself."""
    if mask is None:
        return t
    if t.is_cuda:
        return _DROPOUT_BWD(t, mask, drop_spec.scale(p))
    return drop_spec.apply(t, mask, p)


def _no_masks(masks) -> bool:
    for m in masks:
        if m is not None:
            return False
    return True


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


_HALF = (torch.bfloat16, torch.float16)


def _in_dt(t, dt):
    return t if t.dtype == dt else t.to(dt)


def _adapter_in(x2, a_list, masks, ps):
    """x a^T for several adapters reading x, in x's dtype (each A rounded to it). Without dropout
    one GEMM reads x once for all: ((M, sum r_p), the stacked A (sum r_p, H) in x's dtype). With
    dropout one GEMM per adapter on its dropped-out input: ([(M, r_p) per adapter], None)."""
    dt = x2.dtype
    if _no_masks(masks):
        a_cat = _in_dt(torch.cat(a_list), dt)  # (R, H)
        return x2 @ a_cat.t(), a_cat
    return [_drop(x2, m, p) @ _in_dt(a, dt).t() for a, m, p in zip(a_list, masks, ps)], None


def _adapter_grads(x2, dxa, a_cat, cuts, masks, ps, ldt):
    """[d a_p] for adapters reading x: dxa_p^T drop_p(x), in the adapters' dtype ``ldt``. Without
    dropout ``dxa`` is (M, R) and one GEMM gives all; with dropout it is the list of (M, r_p)."""
    if a_cat is not None:
        ga = _mm(dxa.t(), x2, ldt)  # (R, H)
        return [ga[cuts[i]:cuts[i + 1]] for i in range(len(masks))]
    return [_mm(d.t(), _drop(x2, m, p), ldt) for d, m, p in zip(dxa, masks, ps)]


def _add_adapter_dx_(gx, dxa, a_cat, a_list, masks, ps):
    """gx (M, H) += sum_p drop_p(dxa_p a_p), the adapters' path of d x (``dxa`` as in
    :func:`_adapter_grads`, in x's dtype)."""
    if a_cat is not None:
        return gx.addmm_(dxa, a_cat)  # one cuBLAS call, beta = 1
    for d, a, m, p in zip(dxa, a_list, masks, ps):
        gx.add_(_drop(d @ _in_dt(a, gx.dtype), m, p))
    return gx


def _dxa(g2, b, s):
    """d xa = s g B, (M, r) in g's dtype (B rounded to it)."""
    return (g2 @ _in_dt(b, g2.dtype)).mul_(s)


def _grad_b(g2, xa, s, ldt):
    """d B = s g^T xa, (N, r) in the adapter's dtype."""
    return _mm(g2.t(), xa, ldt).mul_(s)


# ---------------------------------------------------------------------------------------- qkv
# Each kernel is a forward ``*_fwd(*tensors in spec.TENSORS order, **static) -> (outputs,
# residuals)`` and a backward ``*_bwd(inputs, residuals, grads, needs, **static) -> {name: grad}``
# (``needs`` and the result keyed by the spec's names): the eager autograd.Functions below and the
# op layer's ops (torch.ops.forge.triton_lora_*) run the same two functions. Autocast is off
# inside both: the kernels compute in the dtypes they are given (a caller under autocast casts
# first, as forge.patching.lora does).
_NO_CONTEXT = contextlib.nullcontext()  # reusable, holds nothing


def _no_autocast(tensors):
    """Autocast off for the block on the tensors' device type; nothing to turn off (the usual
    case) costs no context object."""
    # any device type will do when no tensor is given (every output gradient undefined)
    dev = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), "cpu")
    if not torch.is_autocast_enabled(dev):
        return _NO_CONTEXT
    return torch.autocast(dev, enabled=False)


def qkv_fwd(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v, mask_q=None, mask_k=None,
            mask_v=None, *, scales, ps):
    """(q, k, v), residuals: without dropout (xa, a_cat), xa = x a^T for the three adapters
    (M, R) and a_cat their stacked A; with dropout (xa_q, xa_k, xa_v), each (M, r_p) from its
    dropped-out input."""
    with _no_autocast((x,)):
        masks = tuple(drop_spec.rows(m, x.shape[-1]) for m in (mask_q, mask_k, mask_v))
        x2 = _rows(x)  # (M, H)
        ws, biases, bs = (w_q, w_k, w_v), (bias_q, bias_k, bias_v), (b_q, b_k, b_v)
        # R = r_q + r_k + r_v: without dropout one GEMM reads x once for all three
        xa, a_cat = _adapter_in(x2, (a_q, a_k, a_v), masks, ps)
        if a_cat is not None:
            cuts = _cuts((a_q, a_k, a_v))
            xas, res = [xa[:, cuts[i]:cuts[i + 1]] for i in range(3)], (xa, a_cat)
        else:
            xas = res = tuple(xa)
        outs = []
        for w, bias, b, s, xa_p in zip(ws, biases, bs, scales, xas):
            base = F.linear(x2, w, bias)  # (M, N_p), cuBLAS with the bias in its epilogue
            lora_add_(base, xa_p, b.t(), s)
            outs.append(base.view(*x.shape[:-1], w.shape[0]))
        return tuple(outs), res


def _cuts(a_list):
    cuts = [0]
    for a in a_list:
        cuts.append(cuts[-1] + a.shape[0])
    return cuts


def qkv_bwd(inputs, res, grads, needs, *, scales, ps):
    """{name: gradient} for the names ``needs`` asks for (x, a_p, b_p); ``grads`` may hold None
    for a projection whose output got no gradient (k or v unused)."""
    t = dict(zip(qkv_spec.TENSORS, inputs))
    x = t["x"]
    a_list = [t[f"a_{p}"] for p in qkv_spec.PROJ]
    with _no_autocast((x, *grads)):
        x2 = _rows(x)
        masks = tuple(drop_spec.rows(t[f"mask_{p}"], x.shape[-1]) for p in qkv_spec.PROJ)
        cuts = _cuts(a_list)
        if _no_masks(masks):
            xa, a_cat = res
            xas = [xa[:, cuts[i]:cuts[i + 1]] for i in range(3)]
        else:  # with dropout: one (M, r_p) per projection, nothing stacked
            xas, a_cat = res, None
        ldt = a_list[0].dtype
        out = {}
        dxa_parts = []  # d xa_p = s g_p B_p, (M, r_p) each; zero for a projection with no gradient
        gx = None
        for i, (p, g) in enumerate(zip(qkv_spec.PROJ, grads)):
            s, xa_p = scales[i], xas[i]
            if g is None:
                dxa_parts.append(xa_p.new_zeros(xa_p.shape))
                continue
            w, b = t[f"w_{p}"], t[f"b_{p}"]
            g2 = g.reshape(-1, g.shape[-1])  # (M, N_p)
            dxa_parts.append(_dxa(g2, b, s))
            if needs[f"b_{p}"]:
                out[f"b_{p}"] = _grad_b(g2, xa_p, s, ldt)  # d B_p = s g_p^T xa_p   (N_p, r_p)
            if needs["x"]:
                gx = g2 @ w if gx is None else gx.addmm_(g2, w)  # base path, accumulated in place
        # (M, R) for the one GEMM without dropout; with dropout each part is used on its own
        dxa = torch.cat(dxa_parts, dim=1) if a_cat is not None else dxa_parts
        if any(needs[f"a_{p}"] for p in qkv_spec.PROJ):
            for p, ga in zip(qkv_spec.PROJ, _adapter_grads(x2, dxa, a_cat, cuts, masks, ps, ldt)):
                out[f"a_{p}"] = ga
        if needs["x"]:
            if gx is None:
                gx = torch.zeros(x2.shape, dtype=x2.dtype, device=x2.device)
            out["x"] = _add_adapter_dx_(gx, dxa, a_cat, a_list, masks, ps).view(x.shape)  # same buffer
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
    """What the spec's checks read of the arguments other than the masks, as a hashable key:
    x's device, dtype and width, each weight's shape, dtype and device (None for a missing
    bias); None when something is not a tensor (the full checks then say what is wrong)."""
    try:
        key = [extra, x.device, x.dtype, x.shape[-1]]
        for t in ws:
            key += (None, None, None) if t is None else (t.shape, t.dtype, t.device)
        key = tuple(key)
        hash(key)  # an unhashable act: the full checks name it
        return key
    except (AttributeError, IndexError, TypeError):
        return None


def _hot_rest(x, scales, masks, ps, shapes) -> bool:
    """Scales, masks and probabilities as the spec's checks accept them, in a few reads: float
    scales; per projection no mask with probability 0.0, or a bool mask of its input's shape on
    x's device with a float probability in [0, 1]."""
    for s in scales:
        if type(s) is not float:
            return False
    for m, p, shape in zip(masks, ps, shapes):
        if type(p) is not float:
            return False
        if m is None:
            if p != 0.0:
                return False
        elif not (type(m) is torch.Tensor and m.dtype is torch.bool and 0.0 <= p <= 1.0 and m.shape == shape
                  and m.device == x.device):
            return False
    return True


def _any_requires_grad(ts) -> bool:
    for t in ts:
        if t is not None and t.requires_grad:
            return True
    return False


def lora_qkv(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
             *, scale_q, scale_k, scale_v, mask_q=None, mask_k=None, mask_v=None,
             dropout_q=0.0, dropout_k=0.0, dropout_v=0.0):
    """Triton LoRA q, k, v projections (forge.spec.lora_qkv) -> (q, k, v)."""
    compiling = _ops._compiling()
    key = None if compiling else _signature(None, x, (w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v,
                                                      a_v, b_v))
    if key is None or key not in _QKV_OK or not _hot_rest(
            x, (scale_q, scale_k, scale_v), (mask_q, mask_k, mask_v), (dropout_q, dropout_k, dropout_v),
            (x.shape,) * 3):
        qkv_spec.check(x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v,
                       scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, mask_q=mask_q, mask_k=mask_k,
                       mask_v=mask_v, dropout_q=dropout_q, dropout_k=dropout_k, dropout_v=dropout_v)
        _common.check_device(x=x, w_q=w_q, a_q=a_q, b_q=b_q, w_k=w_k, a_k=a_k, b_k=b_k, w_v=w_v, a_v=a_v, b_v=b_v)
        if key is not None:
            _QKV_OK.add(key)
    if torch.is_grad_enabled() and _any_requires_grad((w_q, bias_q, w_k, bias_k, w_v, bias_v)):
        qkv_spec.frozen(True, w_q=w_q, bias_q=bias_q, w_k=w_k, bias_k=bias_k, w_v=w_v, bias_v=bias_v)
    scales = (float(scale_q), float(scale_k), float(scale_v))
    ps = tuple(float(p) if m is not None else 0.0 for m, p in ((mask_q, dropout_q), (mask_k, dropout_k),
                                                                (mask_v, dropout_v)))
    tensors = (x, w_q, bias_q, a_q, b_q, w_k, bias_k, a_k, b_k, w_v, bias_v, a_v, b_v, mask_q, mask_k, mask_v)
    if compiling:
        return _ops.call(QKV, *tensors, scales=scales, ps=ps)
    return LoraQKVFunction.apply(scales, ps, *tensors)


# ---------------------------------------------------------------------------------------- mlp
def mlp_fwd(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, mask_gate=None, mask_up=None,
            mask_down=None, *, scales, gelu, ps):
    """y, (g, u, xa, ha[, a_gu]): the completed pre-activations, the adapters' down-projections
    of x (gate and up side by side) and of h, and (without dropout on gate and up) gate's and
    up's A stacked."""
    s_g, s_u, s_d = scales
    with _no_autocast((x,)):
        m_g, m_u = (drop_spec.rows(m, x.shape[-1]) for m in (mask_gate, mask_up))
        m_d = drop_spec.rows(mask_down, w_gate.shape[0])
        x2 = _rows(x)  # (M, H)
        m, inter, r, r_u = x2.shape[0], w_gate.shape[0], a_gate.shape[0], a_up.shape[0]
        dt = x2.dtype
        xa, a_gu = _adapter_in(x2, (a_gate, a_up), (m_g, m_u), ps[:2])  # (M, r + r_u), (r + r_u, H)
        if a_gu is None:  # with dropout, one product each: the kernel reads both from one buffer
            xa = torch.cat(xa, dim=1)
        g = x2 @ w_gate.t()  # (M, I) base GEMMs; the kernel completes them in place
        u = x2 @ w_up.t()
        h = _common.empty((m, inter), x2.dtype, x2.device)
        if m and inter:
            _LORA_GLU_FWD[_grid(m, inter)](
                g, u, h, xa, b_gate, b_up, m, inter, r, r_u, s_g, s_u, xa.stride(0), xa.stride(1),
                b_gate.stride(1), b_gate.stride(0), b_up.stride(1), b_up.stride(0),
                GELU=gelu, **_consts(dt, max(r, r_u)), num_warps=4)
        ha = _drop(h, m_d, ps[2]) @ _in_dt(a_down, dt).t()  # (M, r)
        y = h @ w_down.t()  # (M, H)
        lora_add_(y, ha, b_down.t(), s_d)
        res = (g, u, xa, ha) if a_gu is None else (g, u, xa, ha, a_gu)
        return (y.view(*x.shape[:-1], w_down.shape[0]),), res


def mlp_bwd(inputs, res, grads, needs, *, scales, gelu, ps):
    """{name: gradient} for the names ``needs`` asks for (x, a_p, b_p)."""
    t = dict(zip(mlp_spec.TENSORS, inputs))
    g, u, xa, ha, *rest = res
    a_gu = rest[0] if rest else None  # None: gate or up had dropout
    x, (dy,) = t["x"], grads
    s_g, s_u, s_d = scales
    with _no_autocast((x, dy)):
        x2 = _rows(x)
        m_g, m_u = (drop_spec.rows(t[k], x.shape[-1]) for k in ("mask_gate", "mask_up"))
        m_d = drop_spec.rows(t["mask_down"], g.shape[1])
        w_gate, w_up, w_down = t["w_gate"], t["w_up"], t["w_down"]
        b_gate, b_up, a_down, b_down = t["b_gate"], t["b_up"], t["a_down"], t["b_down"]
        m, inter, r = g.shape[0], g.shape[1], b_gate.shape[1]  # r: gate's rank
        ldt = t["a_gate"].dtype
        out = {}
        dy2 = dy.reshape(-1, dy.shape[-1])  # (M, H)
        dha = _dxa(dy2, b_down, s_d)  # (M, r)
        if needs["b_down"]:
            out["b_down"] = _grad_b(dy2, ha, s_d, ldt)  # (H, r)
        dh = dy2 @ w_down  # (M, I); becomes h after the kernel
        dg = _common.empty_like(g)
        du = _common.empty_like(u)
        if m and inter:
            _LORA_GLU_BWD[_grid(m, inter)](
                dh, g, u, dg, du, dha, a_down, dha if m_d is None else m_d.view(torch.uint8),
                drop_spec.scale(ps[2]), m, inter, a_down.shape[0], dha.stride(0), dha.stride(1), a_down.stride(0),
                a_down.stride(1), DROP=m_d is not None, GELU=gelu, **_consts(g.dtype, a_down.shape[0]),
                num_warps=4)
        h = dh
        if needs["a_down"]:
            out["a_down"] = _mm(dha.t(), _drop(h, m_d, ps[2]), ldt)  # (r, I)
        dxa = [_dxa(dg, b_gate, s_g), _dxa(du, b_up, s_u)]  # (M, r), (M, r_u)
        if a_gu is not None:
            dxa = torch.cat(dxa, dim=1)  # (M, r + r_u): one GEMM each below
        if needs["b_gate"]:
            out["b_gate"] = _grad_b(dg, xa[:, :r], s_g, ldt)  # (I, r)
        if needs["b_up"]:
            out["b_up"] = _grad_b(du, xa[:, r:], s_u, ldt)
        cuts, masks = (0, r, xa.shape[1]), (m_g, m_u)
        if needs["a_gate"] or needs["a_up"]:
            out["a_gate"], out["a_up"] = _adapter_grads(x2, dxa, a_gu, cuts, masks, ps[:2], ldt)
        if needs["x"]:
            gx = dg @ w_gate  # (M, H): base and LoRA paths accumulated into one buffer
            gx.addmm_(du, w_up)
            out["x"] = _add_adapter_dx_(gx, dxa, a_gu, (t["a_gate"], t["a_up"]), masks, ps[:2]).view(x.shape)
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
             *, scale_gate, scale_up, scale_down, act="silu", mask_gate=None, mask_up=None, mask_down=None,
             dropout_gate=0.0, dropout_up=0.0, dropout_down=0.0):
    """Triton gated MLP with LoRA on gate, up and down (forge.spec.lora_mlp) -> y."""
    compiling = _ops._compiling()
    key = None if compiling else _signature(act, x, (w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down,
                                                     b_down))
    if key is None or key not in _MLP_OK or not _hot_rest(
            x, (scale_gate, scale_up, scale_down), (mask_gate, mask_up, mask_down),
            (dropout_gate, dropout_up, dropout_down), (x.shape, x.shape, (*x.shape[:-1], w_gate.shape[0]))):
        mlp_spec.check(x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down,
                       scale_gate=scale_gate, scale_up=scale_up, scale_down=scale_down, act=act,
                       mask_gate=mask_gate, mask_up=mask_up, mask_down=mask_down, dropout_gate=dropout_gate,
                       dropout_up=dropout_up, dropout_down=dropout_down)
        _common.check_device(x=x, w_gate=w_gate, a_gate=a_gate, b_gate=b_gate, w_up=w_up, a_up=a_up,
                             b_up=b_up, w_down=w_down, a_down=a_down, b_down=b_down)
        if key is not None:
            _MLP_OK.add(key)
    if torch.is_grad_enabled() and _any_requires_grad((w_gate, w_up, w_down)):
        mlp_spec.frozen(True, w_gate=w_gate, w_up=w_up, w_down=w_down)
    scales = (float(scale_gate), float(scale_up), float(scale_down))
    ps = tuple(float(p) if m is not None else 0.0 for m, p in ((mask_gate, dropout_gate), (mask_up, dropout_up),
                                                                (mask_down, dropout_down)))
    tensors = (x, w_gate, a_gate, b_gate, w_up, a_up, b_up, w_down, a_down, b_down, mask_gate, mask_up, mask_down)
    gelu = act == "gelu_tanh"
    if compiling:
        return _ops.call(MLP, *tensors, scales=scales, gelu=gelu, ps=ps)[0]
    return LoraMLPFunction.apply(scales, gelu, ps, *tensors)
