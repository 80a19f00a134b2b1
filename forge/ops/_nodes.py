"""The functional APIs of the backend-neutral nodes, one per backend, built by the registry
(``forge.ops.get``) from the pieces the backend hands over: the spec's checks (one path,
bounded cache of what passed), the eager node, and under torch.compile the node's op pair."""
from __future__ import annotations

import contextlib

import functools

import torch

from .. import _runtime
from ..spec import _check
from ..spec import fused_linear_ce as fl_spec
from ..spec import gated_mlp as mlp_spec
from . import autocast as _autocast
from . import experts as _experts
from . import gated_mlp as _mlp
from . import library
from . import precomputed as _pre

_FLOATS = frozenset(_check.FLOAT_DTYPES)
_through_ops = _runtime.op_route()  # torch.compiler.is_compiling, or always with FORGE_THROUGH_OPS=1


def gated_mlp(backend: str, mlp_act, check_devices):
    """The gated MLP of ``backend`` (forge.spec.gated_mlp), or None without its pieces."""
    if mlp_act is None:
        return None

    @functools.cache
    def ops_for(act):
        return _mlp.ActOps(**mlp_act(act))

    adaptor = _mlp.NodeAdaptor(ops_for)
    adaptor.install(library.traced_entry(backend, adaptor))
    ok = _check.Validated(64)  # (device index, dtype, act) that passed the spec's and device checks

    def gated_mlp(x, w_gate, w_up, w_down, *, act: str = "silu", recompute: bool = False):
        cast = _autocast.target(x.device.type, x, w_gate, w_up, w_down) if isinstance(x, torch.Tensor) else None
        if cast is not None:  # eager's products would run in the autocast dtype: so do the node's
            x, w_gate, w_up, w_down = (_autocast.cast(t, cast) for t in (x, w_gate, w_up, w_down))
            with _autocast.off(x.device.type):
                return gated_mlp(x, w_gate, w_up, w_down, act=act, recompute=recompute)
        compiling = _through_ops()
        if compiling or not _mlp_checked(ok, x, w_gate, w_up, w_down, act):
            mlp_spec.check(x, w_gate, w_up, w_down, act)
            check_devices(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
            if not compiling:
                ok.add((x.device, x.dtype, act))
        if x.numel() == 0 or w_gate.shape[0] == 0:
            return mlp_spec.reference(x, w_gate, w_up, w_down, act=act)
        if compiling:
            return _mlp.traced_apply(adaptor, x, w_gate, w_up, w_down, act, recompute)
        return _mlp.apply(ops_for(act), x, w_gate, w_up, w_down, recompute)

    gated_mlp.__qualname__ = gated_mlp.__name__ = "gated_mlp"
    gated_mlp.__doc__ = f"{backend.capitalize()} gated MLP (forge.spec.gated_mlp): torch's products around the " \
                        "backend's GLU kernels, one autograd node (forge.ops.gated_mlp)."
    return gated_mlp


def _mlp_checked(ok, x, w_gate, w_up, w_down, act) -> bool:
    """The common case in attribute reads: float tensors of one dtype and device whose shapes
    fit, on a (device, dtype, act) that passed the full checks before. False for anything else
    (an argument that is not a tensor, a 0-d x: the full checks then raise, naming it)."""
    try:
        return (x.dtype in _FLOATS and x.dtype is w_gate.dtype is w_up.dtype is w_down.dtype
                and w_gate.dim() == 2 and w_down.dim() == 2 and w_gate.shape == w_up.shape
                and w_gate.shape[1] == x.shape[-1] == w_down.shape[0] and w_down.shape[1] == w_gate.shape[0]
                and x.device == w_gate.device == w_up.device == w_down.device
                and (x.device, x.dtype, act) in ok)
    except (AttributeError, IndexError, TypeError):
        return False


def fused_linear_ce(backend: str, prepare, compute, one_pass):
    """The fused linear cross-entropy of ``backend`` (forge.spec.fused_linear_ce)."""
    adaptor = _pre.NodeAdaptor(compute)
    adaptor.install(library.traced_entry(backend, adaptor))

    def fused_linear_ce(hidden, weight, labels, bias=None, **kwargs):
        dev = hidden.device.type if isinstance(hidden, torch.Tensor) else None
        cast = dev and _autocast.target(dev, hidden, weight, bias)
        if cast:  # as eager's lm_head under autocast: the products in the autocast dtype (the
            # logits and the loss stay fp32), the fp32 parameters' gradients through the casts
            hidden, weight, bias = (_autocast.cast(t, cast) for t in (hidden, weight, bias))
            with _autocast.off(dev):
                return fused_linear_ce(hidden, weight, labels, bias, **kwargs)
        tensors, static = prepare(hidden, weight, labels, bias, **kwargs)
        fp16 = hidden.dtype == torch.float16
        if _through_ops():
            if fp16:  # (the op pair forms the gradients in the forward, which fp16 cannot hold:
                # see forge.ops.precomputed.DeferredGradLoss) the spec's torch loss, fp32 logits
                return fl_spec.reference(hidden, weight, labels, bias, **_spec_kwargs(kwargs))
            return _pre.traced_apply(adaptor, tensors, static, hidden, weight, bias)
        rescaled = functools.partial(_rescaled, compute, tensors, static) if fp16 else None
        return _pre.apply(functools.partial(compute, tensors, static), hidden, weight, bias, one_pass=one_pass,
                          rescaled=rescaled)

    fused_linear_ce.__doc__ = (f"{backend.capitalize()} fused linear cross-entropy with the signature of "
                               "forge.spec.fused_linear_ce.reference (plus the backend's strategy options, "
                               "tile_vocab and chunk_rows); its autograd node is forge.ops.precomputed.\n\n"
                               + (prepare.__doc__ or ""))
    return fused_linear_ce


def _rescaled(compute, tensors, static, c):
    """``compute`` over ``tensors`` with the divisor divided by the cotangent c: every row's
    weight (valid / divisor) times c, so the gradients come out scaled (no host sync)."""
    div = tensors[3]
    return functools.partial(compute, (*tensors[:3], div / c.to(div.dtype), *tensors[4:]), static)


def _spec_kwargs(kwargs):
    return {k: v for k, v in kwargs.items() if k not in ("tile_vocab", "chunk_rows")}


def experts(backend: str, pieces: dict, check_devices):
    """The MoE expert block of ``backend`` (forge.spec.experts) from its pieces (forge.ops.experts
    says what they are): the spec's checks, the eager node, under torch.compile its op pair."""
    ops = _experts.ExpertsOps(**pieces)
    adaptor = _experts.NodeAdaptor(ops)
    adaptor.install(library.traced_entry(backend, adaptor))

    def experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *, act="silu", adapters=None):
        """``adapters``: low-rank updates of the weights, (gate_up, down), each None or (a (E, r, in),
        b (E, out, r), scale), computed as rank-r products joining the weights' (never merged),
        except under autocast and torch.compile, where they are merged into the weights first."""
        dev = hidden.device.type if isinstance(hidden, torch.Tensor) else None
        cast = dev and _autocast.target(dev, hidden, gate_up_proj, down_proj)
        if adapters is not None:
            _experts.check_adapters(adapters, gate_up_proj, down_proj, gate_up_proj.dtype)
            if cast or _through_ops():  # (merged in the weights' dtype, autocast off, as peft folds them)
                with _autocast.off(dev) if cast else contextlib.nullcontext():
                    gate_up_proj, down_proj = _experts.merged(gate_up_proj, down_proj, adapters)
                adapters = None
        if cast:  # eager's expert products run in the autocast dtype: so do the node's; the
            # router's scores stay as given and the output comes back in hidden's dtype, as
            # eager's weighted sum does
            out_dtype = hidden.dtype
            hidden, gate_up_proj, down_proj = (_autocast.cast(t, cast) for t in (hidden, gate_up_proj, down_proj))
            with _autocast.off(dev):
                return experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act=act).to(out_dtype)
        _experts.spec.check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
        if check_devices is not None:
            check_devices(hidden=hidden, gate_up_proj=gate_up_proj, down_proj=down_proj)
        hidden, top_k_weights = hidden.contiguous(), top_k_weights.contiguous()
        if adapters is not None:
            if hidden.dtype != gate_up_proj.dtype:
                raise TypeError(f"hidden is {hidden.dtype}, the expert weights and adapters {gate_up_proj.dtype}")
            return _experts.apply_lora(ops, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, adapters,
                                       act=act)
        if _through_ops():
            return adaptor.traced(_experts.DEF, (hidden, top_k_index, top_k_weights, gate_up_proj, down_proj),
                                  {"act": act})[0]
        return _experts.apply(ops, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act=act)

    experts.ops = ops
    return experts
