"""peft LoRA -> forge's fused ``lora_qkv``, ``lora_o`` and ``lora_mlp`` (called by ``core.patch``
as ``apply(model, patcher)`` before the generic walker, so the modules taken over here are left
alone by the rmsnorm / swiglu / geglu passes).

What is fused: a peft ``lora.Linear`` over a plain ``nn.Linear`` whose one active adapter is
vanilla LoRA: any ``lora_dropout`` (``nn.Dropout``, not in place, or Identity), no DoRA or other
variant, no LoRA bias, not merged, not disabled, no ``fan_in_fan_out``, base weight (and bias)
frozen (forge.patching.lora_fit). In a module with LoRA on some projections only (peft's default
target modules: q_proj and v_proj), the others must be plain frozen ``nn.Linear``: the fused call
runs their base product. Anything else is left to peft and named in ``model._forge_skipped[key]``
(modules that fit are still fused; counts say how many).

Dropout: when an adapter's ``nn.Dropout`` is in training mode with p > 0 (its own ``training``
flag, as peft reads it), the replaced forward draws one seed for the call from torch's generator
(``forge.spec.lora_dropout.seed``) and hands it and each projection's p to the kernel, which
draws every projection's mask itself (its own stream of the seed). The masks are not peft's
(docs/lora.md says why); keep rate and scaling are. Otherwise no seed: the call is the one
without dropout.

- ``lora_mlp``: the MLP module's forward (``down(act(gate(x)) * up(x))`` in every supported
  architecture) becomes one ``lora_mlp`` call; act from the config (silu -> swiglu,
  gelu_pytorch_tanh -> geglu). Count: one per MLP.
- ``lora_qkv``: HF attention forwards call q_proj, k_proj and v_proj one after another on the same
  hidden_states. q_proj's forward computes q, k and v in one fused call and leaves k and v in a
  one-shot slot keyed by the input tensor's identity and version (forge.patching.qkv's slots,
  which its q/k/v fusion uses too); k_proj's and v_proj's forwards take them from the slot, or
  run their own forward when the slot does not match (another input, another order, a changed
  input). No per-model code. Count: one per attention module with LoRA on q, k or v.
- ``lora_o``: o_proj's own forward becomes one ``lora_o`` call (base product, bias and adapter).
  Count: one per o_proj.

Everything is looked up at call time: weights (FSDP2 swaps them), the active adapter, its
scaling, dropout, merge and disable state. A call whose state does not fit (adapters disabled or
merged, another adapter made active that is DoRA, base weights unfrozen, extra arguments,
DTensor weights outside an FSDP2 forward) runs peft's path for that call. Under autocast the
fused call runs in the autocast dtype, as every matmul of eager peft then does.

Adapters added after ``forge.patch``: an adapter added to (or activated on) layers that were LoRA
layers at patch time is picked up at call time, fused when it fits. LoRA layers created after it
(``get_peft_model``, ``inject_adapter`` or ``add_adapter`` on a projection that had none) are
not, and an attention module with such a projection runs peft's path (the slots check their
modules: forge.patching.qkv.slot_forwards): ``forge.unpatch`` and ``forge.patch`` again. The
replaced forwards are methods bound to the module they replace or its attention / MLP module
(``copy.deepcopy`` of the model rebinds them to the copy) and capture no tensor. A q/k/v slot
that is never taken keeps that layer's k and v alive until the attention's next call.
"""
from __future__ import annotations

import types

import torch

from ..spec import lora_dropout as _drop
from ..spec import lora_mlp as _mlp_spec
from ..spec import lora_o as _o_spec
from ..spec import lora_qkv as _qkv_spec
from . import arch as _arch
from .forwards import _compiling
from .lora_fit import fused_params, misfit, peft_linear, proj_misfit, proj_params
from .qkv import QKV, install_slots

_peft_linear = peft_linear  # (the name the tests and older callers use)
__all__ = ["apply", "fused_params", "misfit"]

_QKV_NAMES = _qkv_spec.TENSORS[:13]  # x, then w, bias, a, b per projection (the seed is a keyword)
_MLP_NAMES = _mlp_spec.TENSORS[:10]  # x, then w, a, b per projection
_O_NAMES = _o_spec.TENSORS[:5]  # x, w, bias, a, b
KEYS = ("lora_qkv", "lora_o", "lora_mlp")
O_PROJ = "o_proj"
_ACT = {name: act for act, names in (("silu", _arch.GLU_ACTS["swiglu"]), ("gelu_tanh", _arch.GLU_ACTS["geglu"]))
        for name in names}


def _compute_dtype(x, args, kwargs, w):
    """The dtype the fused call runs in, or None to defer to peft. Under autocast that is the
    autocast dtype (eager peft runs every matmul of the layer in it); otherwise x's, which must be
    the base weight's (as F.linear requires)."""
    if args or kwargs:
        return None
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype if x.dtype == w.dtype else None


def _one_adapter_dtype(ps) -> bool:
    dts = {p[2].dtype for p in ps if p[2] is not None}
    return len(dts) == 1


def _dropout(x, names, ps) -> dict:
    """``seed``/``dropout_<name>`` when a projection of the call drops now: one seed per call,
    drawn from torch's generator for x's device (on the device: a CUDA graph replay draws anew)."""
    out = {f"dropout_{name}": p[5] for name, p in zip(names, ps) if p[5]}
    if out:
        out["seed"] = _drop.seed(x.device)
    return out


_ADAPTER = frozenset(n for names in (_QKV_NAMES, _MLP_NAMES, _O_NAMES) for n in names
                     if n in ("a", "b") or n.startswith(("a_", "b_")))


def _cast(dtype, names, ts):
    """Autocast's casts of x and the base weights, done here once; the adapters stay as they are
    (the kernels read them in x's dtype and give them gradients in their own)."""
    return [t if t is None or t.dtype == dtype or n in _ADAPTER else t.to(dtype) for n, t in zip(names, ts)]


def _call(x, args, kwargs, ps, names, ts):
    """The tensors of a fused call (``ts`` with autocast's casts), or None when this call does
    not fit: extra arguments, x not in the base's dtype outside autocast, adapters in two dtypes,
    or a float16 model's fp32 adapters outside autocast (peft then runs them in fp32: rounded to
    float16, as the kernels read them, the adapters' gradients went past the oracle's bound)."""
    cd = _compute_dtype(x, args, kwargs, ps[0][0])
    if cd is None or not _one_adapter_dtype(ps):
        return None
    if torch.is_autocast_enabled(x.device.type):
        ts = _cast(cd, names, ts)
    elif cd is torch.float16 and any(p[2] is not None and p[2].dtype is not torch.float16 for p in ps):
        return None
    return ts


# ------------------------------------------------------------------------------------ mlp
# A fused MLP call over more rows than this many (rows x intermediate) elements runs as several
# calls over consecutive row blocks: the backward's (rows, intermediate) buffers (the gradients
# of h, gate and up; with recompute_mlp gate's and up's outputs again) then exist for one block at
# a time, not for the whole sequence. 2**28 is 18,432 rows at intermediate 14336: every 8B step
# of up to 18,432 tokens (4x1024, 1x8192, 8x2048) runs as one call, a 139k-token sequence as 8.
# Each block draws its own dropout seed, so the blocks' masks are independent. (The first
# measurements, docs/lora.md, cut at 2**27; cutting costs two rows x hidden buffers a call.)
CHUNK_ELEMENTS = 2**28
ROW_ALIGN = 256


def row_blocks(rows: int, inter: int) -> list:
    """The row counts a fused MLP call over ``rows`` rows is cut into (one entry: uncut): as few
    blocks as CHUNK_ELEMENTS allows, of about equal size, each but the last a multiple of
    ROW_ALIGN rows."""
    align = ROW_ALIGN
    per = max(align, CHUNK_ELEMENTS // max(inter, 1) // align * align)
    if rows <= per:
        return [rows]
    n = -(-rows // per)
    size = -(-(-(-rows // n)) // align) * align  # ceil(ceil(rows / n) / align) * align <= per
    return [size] * (rows // size) + ([rows % size] if rows % size else [])


def _mlp_forward(kernel, act, act_types, lora_linear, ks, recompute=False):
    """``act_types``: the act_fn classes computing ``act``; a call finding another (act_fn
    swapped after patching), or hooks on it, runs the module's own forward. ``recompute``: forge.patch's
    recompute_mlp (the kernel keeps x, not gate's and up's outputs, for the backward)."""
    extra = {"recompute": True} if recompute else {}

    def one(ts, ps, x):
        drop = _dropout(x, _mlp_spec.PROJ, ps)
        # every tensor bound to its spec name (forge.spec.lora_mlp.TENSORS), never by position
        return kernel(**dict(zip(_MLP_NAMES, ts)), scale_gate=ps[0][4], scale_up=ps[1][4], scale_down=ps[2][4],
                      act=act, **drop, **extra)

    def forward(self, x, *args, **kwargs):
        mods = self._modules
        ps = [proj_params(mods[n], lora_linear, False) for n in _arch.MLP_PROJ]
        ts = None
        a = mods.get("act_fn")
        if None not in ps and type(a) in act_types and not (a._forward_hooks or a._forward_pre_hooks):
            ts = _call(x, args, kwargs, ps, _MLP_NAMES, [x] + [t for w, _, a, b, _, _ in ps for t in (w, a, b)])
        if ts is None:
            if not _compiling():
                ks.fallback += 1
            return type(self).forward(self, x, *args, **kwargs)
        if not _compiling():
            ks.fused += 1
        xin = ts[0]
        blocks = row_blocks(xin.numel() // max(xin.shape[-1], 1), ps[0][0].shape[0])
        if len(blocks) == 1:
            return one(ts, ps, x)
        # split's backward gathers the blocks' input gradients into one tensor (no per-block
        # full-size gradient, as slicing would make)
        parts = xin.reshape(-1, xin.shape[-1]).split(blocks)
        ys = [one([part] + ts[1:], ps, x) for part in parts]
        return torch.cat(ys).view(*xin.shape[:-1], ys[0].shape[-1])

    return forward


# ------------------------------------------------------------------------------------ qkv
def _qkv_compute(kernel, lora_linear):
    """q, k and v from one fused call, for forge.patching.qkv's slot forwards (q_proj's makes
    them, k_proj's and v_proj's take theirs)."""
    def compute(attn, x, args, kwargs):
        ps = [proj_params(attn._modules[n], lora_linear, True) for n in QKV]
        if None in ps:
            return None
        ts = _call(x, args, kwargs, ps, _QKV_NAMES, [x] + [t for w, bias, a, b, _, _ in ps for t in (w, bias, a, b)])
        if ts is None:
            return None
        drop = _dropout(x, _qkv_spec.PROJ, ps)
        # every tensor bound to its spec name (forge.spec.lora_qkv.TENSORS)
        return kernel(**dict(zip(_QKV_NAMES, ts)), scale_q=ps[0][4], scale_k=ps[1][4], scale_v=ps[2][4], **drop)

    return compute


# ------------------------------------------------------------------------------------ o
def _o_forward(kernel, lora_linear, ks):
    """o_proj's forward, bound to the LoRA layer itself: one lora_o call."""
    def forward(self, x, *args, **kwargs):
        p = fused_params(self, lora_linear, True)
        ts = None if p is None else _call(x, args, kwargs, [p], _O_NAMES, [x, *p[:4]])
        if ts is None:
            if not _compiling():
                ks.fallback += 1
            return type(self).forward(self, x, *args, **kwargs)
        drop = {"dropout": p[5], "seed": _drop.seed(x.device)} if p[5] else {}
        if not _compiling():
            ks.fused += 1
        return kernel(**dict(zip(_O_NAMES, ts)), scale=p[4], **drop)

    return forward


# ------------------------------------------------------------------------------------ apply
def _hf_code(mod) -> bool:
    return getattr(type(mod).forward, "__module__", "").startswith("transformers.")


def _free(mod) -> bool:
    # an instance-level forward means someone else (forge, accelerate hooks) already owns it
    return "forward" not in mod.__dict__


def _ready(p, key, found):
    if not p.wants(key) or not found:
        return None
    try:
        return p.kernel(key)
    except Exception as e:  # noqa: BLE001  (a missing backend is a skip, never a crash)
        p.skip(key, f"{key}: {e}")
        return None


def apply(model, p) -> None:
    """Replace the forwards of LoRA'd attention and MLP modules of ``model`` (see module doc)."""
    lora_linear = peft_linear()
    if lora_linear is None:
        for key in KEYS:
            if p.wants(key):
                p.skip(key, "peft is not importable")
        return
    found = {key: [] for key in KEYS}
    for name, mod in model.named_modules():
        cname = type(mod).__name__
        if cname.endswith(_arch.ATTN_SUFFIX):
            if any(isinstance(getattr(mod, n, None), lora_linear) for n in QKV):
                found["lora_qkv"].append((name, mod))
            if isinstance(getattr(mod, O_PROJ, None), lora_linear):
                found["lora_o"].append((f"{name}.{O_PROJ}", getattr(mod, O_PROJ)))
        elif cname.endswith(_arch.MLP_SUFFIX) and any(isinstance(getattr(mod, n, None), lora_linear)
                                                      for n in _arch.MLP_PROJ):
            found["lora_mlp"].append((name, mod))
    for key, what in (("lora_qkv", "attention module has LoRA on q_proj, k_proj or v_proj"),
                      ("lora_o", "attention module has LoRA on o_proj"),
                      ("lora_mlp", "MLP module has LoRA on gate_proj, up_proj or down_proj")):
        if not found[key] and p.wants(key):  # (a kernel with nothing to do: no warning)
            p.skip(key, f"no {what}", applies=False)
    _apply_mlp(model, p, found["lora_mlp"], lora_linear)
    _apply_qkv(p, found["lora_qkv"], lora_linear)
    _apply_o(p, found["lora_o"], lora_linear)


def _split(mods, names, lora_linear, bias_ok):
    """(modules whose projections all fit, ["name.projection: reason", ...] for the others)."""
    fit, why = [], []
    for name, mod in mods:
        bad = next(((n, w) for n in names if (w := proj_misfit(getattr(mod, n, None), lora_linear, bias_ok=bias_ok))),
                   None)
        if bad is None:
            fit.append(mod)
        else:
            why.append(f"{name}.{bad[0]}: {bad[1]}")
    return fit, why


def _skip_some(p, key, why, total, what):
    if why:
        more = f" (+{len(why) - 3} more)" if len(why) > 3 else ""
        p.skip(key, f"{len(why)} of {total} {what} left to peft: " + "; ".join(why[:3]) + more)


def _apply_mlp(model, p, mlps, lora_linear):
    key = "lora_mlp"
    if not p.wants(key) or not mlps:
        return
    act_name = getattr(model.config, p.arch.act_attr, None)
    act = _ACT.get(act_name)
    if act is None:
        p.skip(key, f"config.{p.arch.act_attr}={act_name!r}: the fused MLP computes silu or gelu_pytorch_tanh only")
        return
    free = [(n, m) for n, m in mlps if _free(m) and not p.is_replaced(m)]
    # the activation the MLP calls, whatever the config names (a user may swap act_fn)
    glu = "swiglu" if act == "silu" else "geglu"
    swapped = [f"{n}: act_fn is {type(m._modules.get('act_fn')).__name__}, not the config's {act_name}"
               for n, m in free if _arch.glu_of(m._modules.get("act_fn")) != glu]
    free = [(n, m) for n, m in free if _arch.glu_of(m._modules.get("act_fn")) == glu]
    # the fused call computes down(act(gate(x)) * up(x)): trust that only in transformers' own code
    why = swapped + [f"{n}: {type(m).__name__}.forward is not transformers' own" for n, m in free if not _hf_code(m)]
    fit, bad = _split([(n, m) for n, m in free if _hf_code(m)], _arch.MLP_PROJ, lora_linear, bias_ok=False)
    why += bad
    kernel = _ready(p, key, fit)
    if kernel is not None:
        act_types = frozenset(type(m._modules["act_fn"]) for m in fit)
        fwd = _mlp_forward(kernel, act, act_types, lora_linear, p.stats.counter(key), p.recompute_mlp)
        for mod in fit:
            p.replace_forward(mod, key, types.MethodType(fwd, mod))
    _skip_some(p, key, why, len(mlps), "LoRA MLPs")


def _apply_qkv(p, attns, lora_linear):
    key = "lora_qkv"
    if not p.wants(key) or not attns:
        return
    free = [(n, m) for n, m in attns if all(_free(getattr(m, x)) for x in QKV if hasattr(m, x))]
    fit, why = _split(free, QKV, lora_linear, bias_ok=True)
    kernel = _ready(p, key, fit)
    if kernel is not None:
        install_slots(p, key, fit, _qkv_compute(kernel, lora_linear))
    _skip_some(p, key, why, len(attns), "LoRA attention modules")


def _apply_o(p, layers, lora_linear):
    key = "lora_o"
    if not p.wants(key) or not layers:
        return
    free = [(n, m) for n, m in layers if _free(m)]
    fit, why = [], []
    for n, m in free:
        w = misfit(m, lora_linear, bias_ok=True, call=False)
        if w is None:
            fit.append(m)
        else:
            why.append(f"{n}: {w}")
    kernel = _ready(p, key, fit)
    if kernel is not None:
        fwd = _o_forward(kernel, lora_linear, p.stats.counter(key))
        for layer in fit:
            p.replace_forward(layer, key, types.MethodType(fwd, layer))
    _skip_some(p, key, why, len(layers), "LoRA o_proj layers")
