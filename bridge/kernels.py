"""The bridged functional APIs: Pallas kernels on torch tensors, in the spec's signatures.

Each function validates its arguments with the spec once per call signature (shapes, dtypes,
devices, static args; a bounded set of them), then goes straight to ``core.apply``; under
torch.compile every call is checked while tracing (the graph's guards keep it valid). Empty inputs (zero rows) return
the spec's torch reference: there is nothing to launch.
"""
from __future__ import annotations

import functools

import torch

from forge.spec import _check
from forge.spec import decode_attention as decode_attention_spec
from forge.spec import geglu as geglu_spec
from forge.spec import kv_append as kv_append_spec
from forge.spec import rmsnorm as rmsnorm_spec
from forge.spec import rope as rope_spec
from forge.spec import row_linear as row_linear_spec
from forge.spec import swiglu as swiglu_spec
from forge_pallas import decode_attention as _decode_attention
from forge_pallas import glu as _glu
from forge_pallas import linear as _linear
from forge_pallas import rmsnorm as _rmsnorm
from forge_pallas import rope as _rope

from . import core, native, runtime

RMSNORM = core.KernelDef("rmsnorm", _rmsnorm.rmsnorm_fwd, _rmsnorm.rmsnorm_bwd, diff=(0, 1))
SWIGLU = core.KernelDef("swiglu", _glu.swiglu_fwd, _glu.swiglu_bwd, diff=(0, 1))
GEGLU = core.KernelDef("geglu", _glu.geglu_fwd, _glu.geglu_bwd, diff=(0, 1))
# the gated MLP's backward step: (dh, gate, up) -> (d_gate, d_up, h); called without autograd
GLU_BWD_ACT = {kind: core.KernelDef(f"{kind}_bwd_act", functools.partial(_glu.glu_bwd_act, kind=kind), None,
                                    diff=()) for kind in ("swiglu", "geglu")}
# backward needs only cos and sin (saving q and k would pin activations torch's own rope does not)
ROPE = core.KernelDef("rope", _rope.rope_fwd, _rope.rope_bwd, diff=(0, 1), save=(2, 3))
DECODE_ATTENTION = core.KernelDef("decode_attention", _decode_attention.decode_attention_fwd, None, diff=())
# (keys, values and the counter's words updated in place: the launch writes the caller's buffers)
KV_APPEND = core.KernelDef("kv_append", _decode_attention.kv_append_fwd, None, diff=(), writes=(0, 1, 4))
ROW_LINEAR = core.KernelDef("row_linear", _linear.row_linear_fwd, None, diff=())
ROW_GLU = core.KernelDef("row_glu", _linear.row_glu_fwd, None, diff=())

_SEEN = _check.Validated()  # call signatures already validated


def checked(sig, check, *args, **kwargs) -> None:
    """Run ``check`` once per call signature ``sig`` (every call while torch.compile traces)."""
    if torch.compiler.is_compiling():
        check(*args, **kwargs)
    elif sig not in _SEEN:
        check(*args, **kwargs)
        _SEEN.add(sig)


def _tsig(*ts) -> tuple:
    """The part of a call signature a tensor argument gives (shape, dtype, device); a non-tensor
    gives its type, so the signature is new and the spec's check names the argument."""
    try:  # (every call: the common case in one list comprehension)
        return tuple([(t.shape, t.dtype, t.device) for t in ts])
    except AttributeError:
        return tuple([(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t) for t in ts])


def _strides(*ts) -> tuple | None:
    """The strides of the tensor arguments whose spec check depends on their layout (contiguity,
    a unit stride), as part of the call signature: a later call of the same shapes but another
    layout is checked too. None for a non-tensor (the signature's type already makes it new)."""
    try:
        return tuple([t.stride() for t in ts])
    except AttributeError:
        return None


_WANT = "cpu" if runtime.interpret() else "cuda"  # where the kernels take tensors (fixed per process)


def check_devices(**named) -> None:
    # (while torch.compile traces, the value read at import: interpret() calls into JAX)
    want = _WANT if torch.compiler.is_compiling() else ("cpu" if runtime.interpret() else "cuda")
    for name, t in named.items():
        if t.device.type != want:
            where = "CPU tensors (JAX has no GPU: Pallas interpret mode)" if want == "cpu" else "CUDA tensors"
            raise ValueError(f"{name} is on {t.device}, but the pallas backend here takes {where}")


def _check_rmsnorm(x, weight, eps, casting, offset):
    rmsnorm_spec.check(x, weight, eps, casting, offset)
    check_devices(x=x, weight=weight)


def rmsnorm(x, weight, eps=1e-6, *, casting="llama", offset=0.0):
    sig = ("rmsnorm", _tsig(x, weight), eps, casting, offset)
    checked(sig, _check_rmsnorm, x, weight, eps, casting, offset)
    if x.numel() == 0:
        return rmsnorm_spec.reference(x, weight, eps, casting=casting, offset=offset)
    return core.apply(RMSNORM, x, weight, eps=float(eps), casting=casting, offset=float(offset))


def _check_glu(spec, gate, up):
    spec.check(gate, up)
    check_devices(gate=gate, up=up)


# The GLU kernels count a call's elements in int32 (forge_pallas/glu.py): a call of more elements
# than GLU_MAX_ELEMENTS (rows x intermediate: 1 x 131072 tokens at Qwen2.5-7B's 18944 has 2.5e9)
# runs as calls over consecutive pieces of GLU_PIECE elements of the flattened tensors, and its
# outputs are joined (one copy, at those sizes only). Without it the count wrapped and most of the
# output was never written.
GLU_MAX_ELEMENTS = (1 << 31) - 4096
GLU_PIECE = 1 << 30


def _glu_apply(kdef, *ts):
    n = ts[0].numel()
    if n <= GLU_MAX_ELEMENTS:
        return core.apply(kdef, *ts)
    flats = [t.reshape(-1) for t in ts]
    outs = [core.apply(kdef, *(f[o:o + GLU_PIECE] for f in flats)) for o in range(0, n, GLU_PIECE)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts).view(ts[0].shape) for parts in zip(*outs))
    return torch.cat(outs).view(ts[0].shape)


def _glu(kdef, spec, gate, up):
    sig = (kdef.name, _tsig(gate, up))
    checked(sig, _check_glu, spec, gate, up)
    if gate.numel() == 0:
        return spec.reference(gate, up)
    return _glu_apply(kdef, gate, up)


def swiglu(gate, up):
    return _glu(SWIGLU, swiglu_spec, gate, up)


def geglu(gate, up):
    return _glu(GEGLU, geglu_spec, gate, up)


def mlp_act(act: str) -> dict:
    """The gated MLP's pieces for the op layer's node (forge.ops.gated_mlp): the bridged GLU
    forward and its backward step (fresh tensors; both go through the op layer's ops under
    torch.compile, as every ``core.apply`` does)."""
    kind = "swiglu" if act == "silu" else "geglu"
    kdef, bwd_act = (SWIGLU if kind == "swiglu" else GEGLU), GLU_BWD_ACT[kind]
    return dict(act=lambda g, u: _glu_apply(kdef, g, u), act_bwd=lambda dh, g, u: _glu_apply(bwd_act, dh, g, u),
                inplace=False, device_type="cpu" if runtime.interpret() else "cuda")


_OTHER = {"bhsd": "bshd", "bshd": "bhsd"}
_DTYPE_NAME = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
               torch.float64: "float64"}


def _physical(t, logical):
    """(tensor with compact strides, its layout): HF's q/k are transposed views of a (B, S, H, D)
    projection, so a (B, H, S, D) view whose transpose is contiguous goes over without a copy."""
    layout = _layout(t, logical)
    if layout != logical:
        return t.transpose(1, 2), layout
    return t.contiguous(), logical


def _layout(t, logical):
    """The layout the kernel reads ``t`` (4-D, laid out as ``logical``) in, decided from its
    strides without making a view: the other one where ``t.transpose(1, 2)`` is contiguous."""
    if t.is_contiguous() or not native.compact_as(t, (0, 2, 1, 3)):
        return logical
    return _OTHER[logical]


def _check_rope(q, k, cos, sin, unsqueeze_dim):
    rope_spec.check(q, k, cos, sin, unsqueeze_dim)
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos is {cos.dtype} but sin is {sin.dtype}")
    check_devices(q=q, k=k, cos=cos, sin=sin)


def rope(q, k, cos, sin, unsqueeze_dim=1):
    sig = ("rope", _tsig(q, k, cos, sin), unsqueeze_dim)
    checked(sig, _check_rope, q, k, cos, sin, unsqueeze_dim)
    rope_spec.check_tables(cos, sin)  # per call: whether a gradient is asked of them is no part of sig
    if q.numel() == 0 or k.numel() == 0:
        return rope_spec.reference(q, k, cos, sin, unsqueeze_dim)
    logical = "bhsd" if unsqueeze_dim == 1 else "bshd"
    in_dtype = _DTYPE_NAME[q.dtype]
    if not core.through_ops():  # the kernel reads each of q, k in the layout of its storage (no copy)
        return core.apply(ROPE, q, k, cos, sin, q_layout=_layout(q, logical), k_layout=_layout(k, logical),
                          in_dtype=in_dtype, view=logical)
    # traced by torch.compile: the op takes q and k as compact tensors in their kernel layouts
    qp, q_layout = _physical(q, logical)
    kp, k_layout = _physical(k, logical)
    qo, ko = core.apply(ROPE, qp, kp, cos, sin, q_layout=q_layout, k_layout=k_layout, in_dtype=in_dtype)
    if q_layout != logical:
        qo = qo.transpose(1, 2)
    if k_layout != logical:
        ko = ko.transpose(1, 2)
    return qo, ko


# -- decoding attention (forward only: the decoding steps of generate()) ------------------------
def _check_decode_attention(q, k, v, mask, scale):
    decode_attention_spec.check(q, k, v, mask, scale)
    check_devices(q=q, k=k, v=v, **({} if mask is None else {"mask": mask}))


def decode_attention(q, k, v, mask=None, scale=None):
    """Pallas decoding attention with the signature of ``forge.spec.decode_attention.reference``."""
    sig = ("decode_attention", _tsig(q, k, v), None if mask is None else _tsig(mask), scale)
    checked(sig, _check_decode_attention, q, k, v, mask, scale)
    if q.numel() == 0:
        return decode_attention_spec.reference(q, k, v, mask, scale)
    d = q.shape[-1]
    scale = 1.0 / d ** 0.5 if scale is None else float(scale)
    if mask is None:
        kind, mask = "none", torch.zeros((1, 1), dtype=torch.uint8, device=q.device)
    elif mask.dtype is torch.bool:
        kind, mask = "bool", mask.contiguous().view(torch.uint8)
    else:
        kind, mask = "float", mask.contiguous()
    return core.apply(DECODE_ATTENTION, q.contiguous(), k.contiguous(), v.contiguous(), mask,
                      mask_kind=kind, scale=scale)


def _check_kv_append(keys, values, k, v, n):
    kv_append_spec.check(keys, values, k, v, n)
    check_devices(keys=keys, values=values, k=k, v=v, n=n)


def kv_append(keys, values, k, v, n):
    """Pallas cache write with the signature of ``forge.spec.kv_append.reference``: in place,
    through outputs aliasing keys, values and n's words (launched natively on the GPU, the same
    buffers; the interpreter's outputs are copied back)."""
    sig = ("kv_append", _tsig(keys, values, k, v, n), _strides(keys, values))
    checked(sig, _check_kv_append, keys, values, k, v, n)
    b, h, c, d = keys.shape
    words = kv_append_spec.counter_words(n)
    if not (b and h and d):
        words[0] += 1  # (no rows to write: the position still advances)
        return
    outs = core.apply(KV_APPEND, keys.view(b * h * c, d), values.view(b * h * c, d), k.reshape(b * h, d),
                      v.reshape(b * h, d), words)
    for out, dst in zip(outs, (keys, values, words)):
        if out.data_ptr() != dst.data_ptr():
            dst.view(out.shape).copy_(out)


# -- one-row products (forward only: the decoding steps' dense products at batch 1) -------------
def _check_row_linear(x, w, b, r):
    row_linear_spec.check(x, w, b, r)
    check_devices(x=x, w=w, **{n: t for n, t in (("b", b), ("r", r)) if t is not None})


def row_linear(x, w, b=None, r=None):
    """Pallas product with the signature of ``forge.spec.row_linear.reference``."""
    sig = ("row_linear", _tsig(x, w), _strides(x, w), None if b is None else _tsig(b),
           None if r is None else (_tsig(r), _strides(r)))
    checked(sig, _check_row_linear, x, w, b, r)
    if not (x.shape[0] and w.shape[0] and x.shape[1]):
        return row_linear_spec.reference(x, w, b, r)
    bias = w.new_zeros(1) if b is None else b
    res = w.new_zeros(1) if r is None else r.contiguous()
    outs = core.apply(ROW_LINEAR, x.contiguous(), w, bias, res, has_bias=b is not None, has_res=r is not None)
    return outs if r is None else tuple(outs)


def _check_row_glu(x, w, act):
    row_linear_spec.check_glu(x, w, act)
    check_devices(x=x, w=w)


def row_glu(x, w, act):
    """Pallas product and gated activation with the signature of
    ``forge.spec.row_linear.glu_reference``."""
    sig = ("row_glu", _tsig(x, w), _strides(x, w), act)
    checked(sig, _check_row_glu, x, w, act)
    if not (x.shape[0] and w.shape[0] and x.shape[1]):
        return row_linear_spec.glu_reference(x, w, act)
    return core.apply(ROW_GLU, x.contiguous(), w, kind="swiglu" if act == "silu" else "geglu")
