"""q, k and v in one matrix product: ``forge.patch`` key ``"qkv"`` (in the default set), and the
one-shot slots through which a fused q_proj call hands k and v to k_proj and v_proj (shared with
the ``lora_qkv`` patch, forge.patching.lora).

transformers' attention forwards call ``q_proj``, ``k_proj`` and ``v_proj`` (three ``nn.Linear``)
one after another on the same hidden states. With grouped-query attention the key and value
products are narrow (128 columns at Qwen2.5-0.5B), too narrow for cuBLAS to fill the GPU. One
product over the three weights concatenated (and their biases) does the three's work, forward
and backward, in about 60% of their device time at Qwen2.5-0.5B's widths (bench/diagnostics/diag_qkv.py on
the H200: 76.6 against 124 us per layer at 4096 rows, 218 against 321 at 16384), and autograd
then runs one product for the input's gradient and one for the weights' where it ran three of
each (and the two additions of the input's gradient).

How: q_proj's forward makes q, k and v in one call and leaves k and v in a slot keyed by the
attention module, holding the input tensor, its version and the grad mode; k_proj's and
v_proj's forwards take them when called on that same input, else run ``nn.Linear``'s own
forward (another input, another order, a changed input). q and k are views of the product (the
RoPE that follows writes new tensors); v is made contiguous, so attention gets the layout it
gets unpatched. No per-model code. Count: one per attention module.

When: in training with ``graphs=True``, in the calls forge's CUDA graphs capture (so in every
replay); the model's uncaptured calls run the three products. In an eager step the one
product's extra host work (the concatenations, the split, the slots) outweighed the device time
it saves, and in inference most of the saving (the backward's) is not there, so the key is
skipped there (quietly, unless named in ``kernels=``). Measured on the H200 at Qwen2.5-0.5B
train 4x1024 (bench_compile.py, ten paired rounds): ``graphs=True`` then compile 36.4 ms
against 37.5 without the fusion, with ``recompute_mlp`` 39.5 against 40.6; eager, with the
fusion in every call, 59.8 against 57.5 ms, within that host-bound step's round-to-round
spread (45-81 ms) but not ahead.

What is fused: an attention module whose q_proj, k_proj and v_proj are plain ``nn.Linear`` of
one dtype and device, with biases on all three or on none, whose weights take at most
``MAX_WEIGHT_BYTES`` together. The concatenation copies the weights on every call and autograd
keeps the copy for the backward (2 MiB per layer at Qwen2.5-0.5B); it pays less as the products
widen (bench/diagnostics/diag_qkv.py, forward + backward at 4096 rows: 142 against 194 us at hidden 1536
with 256-wide keys and values, 249 against 290 at 2048 / 512, 588 against 639 at 3584 / 512,
where the weights are 31.5 MiB). A call runs the three products instead while torch.compile
traces (inductor schedules them; under ``graphs=True`` the layers run as ops and replay fused),
when a weight is not a plain tensor (an FSDP2 shard, which graphs decline anyway), with extra
arguments, or when a projection was replaced.

Numerics: each output element is the same dot product of the same operands as unpatched, but
cuBLAS may pick another kernel for the wider product, so the last bits may differ.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from . import stacking
from .forwards import _compiling
from .guard import CAPTURE, version

KEY = "qkv"
QKV = ("q_proj", "k_proj", "v_proj")
MAX_WEIGHT_BYTES = 8 << 20  # q, k and v weights of one layer together (Qwen2.5-0.5B: 2 MiB)


def install_slots(p, key, attns, compute) -> None:
    """Give each attention module of ``attns`` the three forwards of :func:`slot_forwards`
    (q_proj makes the three with ``compute``; k_proj and v_proj take theirs from the slot),
    remembering the projections they were installed on."""
    mods: dict[int, tuple] = {}
    q_fwd, k_fwd, v_fwd = slot_forwards(compute, p.stats.counter(key), mods)
    for attn in attns:
        # (q_proj carries the one count per attention module: one fused call per forward)
        p.replace_forward(attn.q_proj, key, types.MethodType(q_fwd, attn))
        p.replace_forward(attn.k_proj, key, types.MethodType(k_fwd, attn), count=False)
        p.replace_forward(attn.v_proj, key, types.MethodType(v_fwd, attn), count=False)
        mods[id(attn)] = tuple(attn._modules[n] for n in QKV)


def slot_forwards(compute, ks, mods):
    """(q_proj forward, k_proj forward, v_proj forward), each to be bound to the attention
    module. ``compute(attn, x, args, kwargs)`` returns (q, k, v) or None; with None, and for k or
    v without a matching slot, the projection's own forward runs (:func:`own_forward`).
    ``ks``: the guard counter (fused / fallback calls of q_proj, counted outside traces).
    ``mods``: id(attention module) -> the projections the forwards were installed on. Where one
    is another module now (peft wrapped it in a LoRA layer after patching: its forward adds its
    adapter to what its base layer, forge's forward, returns), ``compute`` is not asked, since it
    reads the attention module's projections as they are now and would add that adapter too."""
    slots: dict[int, list] = {}  # id(attention module) -> [x, version(x), grad mode, k, v]

    def mine(attn, i):
        """The projection forge put forward ``i`` on: its class's forward is the fallback (where
        a wrapper took its place since, peft's over a patched model, the wrapper's would call
        forge's again)."""
        want = mods.get(id(attn))
        return attn._modules[QKV[i]] if want is None else want[i]

    def q_forward(attn, x, *args, **kwargs):
        want = mods.get(id(attn))
        mo = attn._modules
        same = (want is not None and mo.get("q_proj") is want[0] and mo.get("k_proj") is want[1]
                and mo.get("v_proj") is want[2])
        out = compute(attn, x, args, kwargs) if same else None
        if out is not None:
            q, k, v = out
            slots[id(attn)] = [x, version(x), torch.is_grad_enabled(), k, v]
            if not _compiling():
                ks.fused += 1
            return q
        slots.pop(id(attn), None)
        if not _compiling():
            ks.fallback += 1
        return own_forward(mine(attn, 0), x, *args, **kwargs)

    def taker(idx):
        def forward(attn, x, *args, **kwargs):
            s = slots.get(id(attn))
            if (s is not None and s[idx] is not None and s[0] is x and s[1] == version(x)
                    and s[2] == torch.is_grad_enabled() and not args and not kwargs):
                out, s[idx] = s[idx], None
                if s[3] is None and s[4] is None:
                    slots.pop(id(attn), None)  # both taken: drop the reference to x
                return out
            return own_forward(mine(attn, idx - 2), x, *args, **kwargs)

        return forward

    return q_forward, taker(3), taker(4)


def misfit(attn) -> str | None:
    """Why the projections of ``attn`` cannot run as one product (None when they can)."""
    mods = [attn._modules.get(n) for n in QKV]
    why = stacking.misfit(mods, QKV)
    if why is not None:
        return why
    ws = [m.weight for m in mods]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    if nbytes > MAX_WEIGHT_BYTES:
        return (f"q/k/v weights of {nbytes / 2**20:.1f} MiB per layer, over MAX_WEIGHT_BYTES "
                f"({MAX_WEIGHT_BYTES >> 20} MiB): at this width the three products fill the GPU")
    return None


def own_forward(m, x, *args, **kwargs):
    """The projection's own forward (its class's), as if forge had not replaced it."""
    return type(m).forward(m, x, *args, **kwargs)


def _fused(attn, x, args, kwargs):
    """(q, k, v) from one product while forge captures a layer's graphs, else None: run the
    three (see the module doc). Checked again per call with :func:`misfit` (projections, weights
    or biases may be replaced after patching); it runs only while a capture records the layer."""
    if not CAPTURE.on or args or kwargs or _compiling() or misfit(attn) is not None:
        return None
    mods = [attn._modules[n] for n in QKV]
    bias = None if mods[0].bias is None else torch.cat([m.bias for m in mods])
    y = F.linear(x, torch.cat([m.weight for m in mods]), bias)
    q, k, v = y.split([m.weight.shape[0] for m in mods], dim=-1)
    return q, k, v.contiguous()


def apply(p, attns) -> None:
    """Fuse the projections of the attention modules ``attns`` (Patcher ``p``)."""
    if not p.wants(KEY) or not attns:
        return
    if p.mode == "infer":
        if stacking.STACK_INFER and p.never_fuses():
            p.skip(KEY, "min_elements=forge.NEVER: every call runs the model's own products (no weights stored "
                        "together)", applies=False)
        elif stacking.STACK_INFER:
            _apply_stacked(p, attns)
        else:
            p.skip(KEY, "mode='infer': most of what the one product saves is in the backward (weights stored "
                        "together for it: forge.patching.stacking.STACK_INFER)", applies=False)
        return
    if not p.graphs:
        p.skip(KEY, "fuses inside forge's CUDA graphs only (graphs=True): in an eager step its host time "
                    "outweighed the device time it saves", applies=False)
        return
    free = _free(attns)
    if not free:
        p.skip(KEY, "every attention module's projections are taken (lora_qkv) or replaced by another library",
               applies=False)
        return
    fit, why = [], []
    for a in free:
        w = misfit(a)
        if w is None:
            fit.append(a)
        else:
            why.append(w)
    if not fit:  # (a fusion, not a kernel: a decline only warns when "qkv" was asked for by name)
        p.skip(KEY, why[0] if why else "no attention module fits", applies=False)
        return
    _install(p, fit, _fused)
    if why:
        p.skip(KEY, f"{len(why)} of {len(free)} attention modules run three products: {why[0]}", applies=False)


def _stacked(attn, x, args, kwargs, threshold=0):
    """(q, k, v) from one product over the weights stored together (forge.patching.stacking), else
    None. Inference only; k and v are views of the product (the cache update and attention read
    strided rows as they do a transposed projection). Only in calls the guard fuses: x of at
    least ``threshold`` elements (RoPE's guard in x's terms: :func:`_x_threshold`), or captured."""
    if args or kwargs or _compiling() or (x.numel() < threshold and not CAPTURE.on):
        return None
    wb = stacking.weights(attn, QKV, x)
    if wb is None:
        return None
    y = F.linear(x, *wb)
    return tuple(y.split([attn._modules[n].weight.shape[0] for n in QKV], dim=-1))


def _apply_stacked(p, attns) -> None:
    """mode="infer" with stacking on: the projections' weights moved back to back, one product."""
    free = _free(attns)
    stacking.stack(free, QKV, p.undo)
    fit = [a for a in free if stacking.stacked([a._modules[n].weight for n in QKV]) is not None]
    if not fit:
        p.skip(KEY, "no attention module's q/k/v weights could be stored together (plain nn.Linear of one "
                    "dtype and device, their memory shared with no other tensor)", applies=False)
        return
    # (RoPE's threshold where forge patched RoPE, else none: the fusion was asked for alone)
    thr = 0
    if "rope" in p.counts:
        p.inherited[KEY] = "rope"
        thr = _x_threshold(p.min_elements("rope"), fit[0])
    _install(p, fit, functools.partial(_stacked, threshold=thr))


def _x_threshold(rope_min: int, attn) -> int:
    """RoPE's guard, which counts q's and k's elements (rows x (q + k widths)), as a count of x's
    elements (rows x hidden): the same calls pass both. (The layers of a model share widths.)"""
    m = attn._modules
    qk = m["q_proj"].weight.shape[0] + m["k_proj"].weight.shape[0]
    return -(-rope_min // qk) * m["q_proj"].weight.shape[1]


def _free(attns):
    """The attention modules none of whose projections has an instance-level forward (taken by
    lora_qkv, or by another library)."""
    return [a for a in attns if not any("forward" in getattr(a._modules.get(n), "__dict__", {}) for n in QKV)]


def _install(p, attns, compute) -> None:
    """q_proj makes the three with ``compute``; k_proj and v_proj take theirs from the slot."""
    p.runs_torch(KEY)
    install_slots(p, KEY, attns, compute)
