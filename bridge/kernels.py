"""The bridged functional APIs: Pallas kernels on torch tensors, in the spec's signatures.

Each function validates its arguments with the spec once per call signature (shapes, dtypes,
devices, static args), then goes straight to ``core.apply``. Empty inputs (zero rows) return
the spec's torch reference: there is nothing to launch.
"""
from __future__ import annotations

import functools

import torch

from forge import _gated_mlp
from forge.spec import gated_mlp as mlp_spec
from forge.spec import geglu as geglu_spec
from forge.spec import rmsnorm as rmsnorm_spec
from forge.spec import rope as rope_spec
from forge.spec import swiglu as swiglu_spec
from forge_pallas import glu as _glu
from forge_pallas import rmsnorm as _rmsnorm
from forge_pallas import rope as _rope

from . import core, runtime

RMSNORM = core.KernelDef("rmsnorm", _rmsnorm.rmsnorm_fwd, _rmsnorm.rmsnorm_bwd, diff=(0, 1))
SWIGLU = core.KernelDef("swiglu", _glu.swiglu_fwd, _glu.swiglu_bwd, diff=(0, 1))
GEGLU = core.KernelDef("geglu", _glu.geglu_fwd, _glu.geglu_bwd, diff=(0, 1))
# the gated MLP's backward step: (dh, gate, up) -> (d_gate, d_up, h); called without autograd
GLU_BWD_ACT = {kind: core.KernelDef(f"{kind}_bwd_act", functools.partial(_glu.glu_bwd_act, kind=kind), None,
                                    diff=()) for kind in ("swiglu", "geglu")}
# backward needs only cos and sin (saving q and k would pin activations torch's own rope does not)
ROPE = core.KernelDef("rope", _rope.rope_fwd, _rope.rope_bwd, diff=(0, 1), save=(2, 3))

_SEEN: set = set()  # call signatures already validated


def _check_devices(**named) -> None:
    want = "cpu" if runtime.interpret() else "cuda"
    for name, t in named.items():
        if t.device.type != want:
            where = "CPU tensors (JAX has no GPU: Pallas interpret mode)" if want == "cpu" else "CUDA tensors"
            raise ValueError(f"{name} is on {t.device}, but the pallas backend here takes {where}")


def rmsnorm(x, weight, eps=1e-6, *, casting="llama", offset=0.0):
    sig = ("rmsnorm", x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device, eps, casting, offset)
    if sig not in _SEEN:
        rmsnorm_spec.check(x, weight, eps, casting, offset)
        _check_devices(x=x, weight=weight)
        _SEEN.add(sig)
    if x.numel() == 0:
        return rmsnorm_spec.reference(x, weight, eps, casting=casting, offset=offset)
    n = x.shape[-1]
    y = core.apply(RMSNORM, x.reshape(-1, n), weight, eps=float(eps), casting=casting, offset=float(offset))
    return y.view(x.shape)


def _glu(kdef, spec, gate, up):
    sig = (kdef.name, gate.shape, gate.dtype, gate.device, up.shape, up.dtype, up.device)
    if sig not in _SEEN:
        spec.check(gate, up)
        _check_devices(gate=gate, up=up)
        _SEEN.add(sig)
    if gate.numel() == 0:
        return spec.reference(gate, up)
    return core.apply(kdef, gate, up)


def swiglu(gate, up):
    return _glu(SWIGLU, swiglu_spec, gate, up)


def geglu(gate, up):
    return _glu(GEGLU, geglu_spec, gate, up)


def _mlp_ops(kdef, bwd_act):
    return _gated_mlp.ActOps(act=lambda g, u: core.apply(kdef, g, u),
                             act_bwd=lambda dh, g, u: core.apply(bwd_act, dh, g, u),
                             inplace=False, device_type="cpu" if runtime.interpret() else "cuda")


@functools.cache
def _mlp_ops_for(act):
    kind = "swiglu" if act == "silu" else "geglu"
    return _mlp_ops(SWIGLU if kind == "swiglu" else GEGLU, GLU_BWD_ACT[kind])


def gated_mlp(x, w_gate, w_up, w_down, *, act="silu", recompute=False):
    """Pallas gated MLP (forge.spec.gated_mlp): torch's products around the bridged GLU kernels."""
    sig = ("gated_mlp", x.shape, x.dtype, x.device, w_gate.shape, w_gate.dtype, w_gate.device,
           w_up.shape, w_up.dtype, w_up.device, w_down.shape, w_down.dtype, w_down.device, act)
    if sig not in _SEEN:
        mlp_spec.check(x, w_gate, w_up, w_down, act)
        _check_devices(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
        _SEEN.add(sig)
    if x.numel() == 0 or w_gate.shape[0] == 0:
        return mlp_spec.reference(x, w_gate, w_up, w_down, act=act)
    return _gated_mlp.apply(_mlp_ops_for(act), x, w_gate, w_up, w_down, recompute)


_OTHER = {"bhsd": "bshd", "bshd": "bhsd"}
_DTYPE_NAME = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
               torch.float64: "float64"}


def _physical(t, logical):
    """(tensor with compact strides, its layout): HF's q/k are transposed views of a (B, S, H, D)
    projection, so a (B, H, S, D) view whose transpose is contiguous goes over without a copy."""
    if t.is_contiguous():
        return t, logical
    tt = t.transpose(1, 2)
    if tt.is_contiguous():
        return tt, _OTHER[logical]
    return t.contiguous(), logical


def rope(q, k, cos, sin, unsqueeze_dim=1):
    sig = ("rope", q.shape, k.shape, cos.shape, sin.shape, q.dtype, k.dtype, cos.dtype, sin.dtype,
           q.device, k.device, cos.device, sin.device, unsqueeze_dim)
    if sig not in _SEEN:
        rope_spec.check(q, k, cos, sin, unsqueeze_dim)
        if cos.dtype != sin.dtype:
            raise TypeError(f"cos is {cos.dtype} but sin is {sin.dtype}")
        _check_devices(q=q, k=k, cos=cos, sin=sin)
        _SEEN.add(sig)
    if q.numel() == 0 or k.numel() == 0:
        return rope_spec.reference(q, k, cos, sin, unsqueeze_dim)
    logical = "bhsd" if unsqueeze_dim == 1 else "bshd"
    qp, q_layout = _physical(q, logical)
    kp, k_layout = _physical(k, logical)
    qo, ko = core.apply(ROPE, qp, kp, cos, sin, q_layout=q_layout, k_layout=k_layout,
                        in_dtype=_DTYPE_NAME[q.dtype])
    if q_layout != logical:
        qo = qo.transpose(1, 2)
    if k_layout != logical:
        ko = ko.transpose(1, 2)
    return qo, ko
