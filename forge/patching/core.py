"""patch / unpatch: swap forge kernels into a live Hugging Face model, per instance, and back.

Every replacement is an instance attribute: the forward a factory in ``forwards.py`` built, bound
to the module with ``types.MethodType`` and stored in the module's ``__dict__``. The class, the
transformers module and ``torch.nn.functional`` are never touched, so an unpatched model of the
same class in the same process behaves as before. ``unpatch`` deletes the instance attribute (or
restores a previous one), which gives back the class's own forward: outputs are bit-identical.

RoPE: HF attention forwards call the module-level ``apply_rotary_pos_emb``. forge rebuilds the
attention class's forward function with a copy of its globals in which that name is forge's
RoPE, re-creating each decorator wrapper (``deprecate_kwarg`` and friends, found through
``__wrapped__``) around the rebuilt function, and binds the result to the instance.

Fused loss: the CausalLM forward is rebuilt the same way with its innermost function replaced.
In a model in training mode (``model.training``) called with ``labels`` and
``logits_to_keep=0``, it runs the decoder (``use_cache=False`` unless given or unless that would
change the attention masks of packed sequences: ``forwards._masks_blind_to_cache``), shifts the labels
like HF's ``ForCausalLMLoss`` (pad with ignore_index, drop the first), and returns the fused
loss with ``logits=None`` (``num_items_in_batch``, ``ignore_index``, ``shift_labels`` and
gemma2's ``final_logit_softcapping`` honoured). Every other call (no labels, ``model.eval()``, a
``logits_to_keep``, ``generate()``) runs the original forward: an evaluation loop gets its logits.

Order: LoRA first (``forge.patching.lora.apply(model, patcher)``), then the generic walker
(rmsnorm, swiglu/geglu, rope, and the q/k/v projections as one product: ``qkv.py``), which
leaves alone every module that already has an instance-level forward (taken by LoRA, or by
someone else such as accelerate's hooks), then the fused loss, then
(``graphs=True``, ``graphs.py``) each decoder layer's forward wrapped in its graph replay, which
falls back per call to the layer's own forward with forge's kernels inside.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import types

from torch import nn

from .. import defaults, errors, ops
from ..spec import lora_dropout
from . import arch as _arch
from . import args as _args
from . import decode as _decode
from . import experts as _experts
from . import copying
from . import forwards as fw
from . import graphs as _graphs
from . import qkv as _qkv
from . import stacking as _stacking
from . import report as _report
from .guard import GuardStats
from .args import MODES, PATCH_KEYS  # noqa: F401  (forge.patching.core.PATCH_KEYS: tests, bench)
from .patcher import LAYER_KEYS, TORCH, TRAIN_ONLY, Patcher, restore

LORA_KEYS = ("lora_qkv", "lora_o", "lora_mlp")
_PUBLIC = ("_forge_patched_counts", "_forge_skipped", "_forge_guard_stats", "_forge_backends", "_forge_graphs")


@dataclasses.dataclass
class _State:
    args: tuple
    records: list
    undo: list      # callables unpatch runs after restoring the records (transformers' hub kernels)
    chain: list
    call: object    # forge.patch with this patch's arguments bound: patches a copy the same way (copying.py)
    info: _report.Info
    public: tuple   # the values of _PUBLIC


# ---------------------------------------------------------------------------------------------
# model resolution (the arguments: args.py)


def _unwrap(model):
    """([model, ..., root], root): peel peft (PeftModel -> base_model.model), torch.compile
    (``_orig_mod``) and ``.model`` nesting down to the Hugging Face PreTrainedModel."""
    from transformers import PreTrainedModel

    chain, m = [model], model
    for _ in range(8):
        if isinstance(m, PreTrainedModel):
            return chain, m
        if hasattr(m, "peft_config") and callable(getattr(m, "get_base_model", None)):
            m = m.get_base_model()
        elif isinstance(getattr(m, "_orig_mod", None), nn.Module):  # torch.compile's wrapper
            m = m._orig_mod
        elif isinstance(getattr(m, "model", None), nn.Module):
            m = m.model
        else:
            break
        chain.append(m)
    raise errors.UnsupportedModelError(
        f"forge.patch needs a Hugging Face PreTrainedModel (optionally wrapped by peft or held in "
        f"a module's .model), got {type(model).__name__}; supported model_types: "
        f"{', '.join(_arch.SUPPORTED)}")


def _arch_of(root):
    mt = getattr(getattr(root, "config", None), "model_type", None)
    a = _arch.ARCHS.get(mt)
    if a is None:
        raise errors.UnsupportedModelError(
            f"forge does not support model_type {mt!r} ({type(root).__name__}); supported: "
            f"{', '.join(_arch.SUPPORTED)}")
    return a


# ---------------------------------------------------------------------------------------------
# public API


def patch(model, mode="train", backend="auto", min_elements=None, kernels=None, graphs=False,
          recompute_mlp=False, compile_kernels="auto", min_fused=None):
    """Swap forge kernels into ``model`` (see ``forge.patch``); returns ``model``. ``min_fused``:
    the guard's default thresholds (``forge.patch`` hands in ``forge.MIN_FUSED_ELEMENTS``; None:
    ``forge.defaults.MIN_FUSED_ELEMENTS``).

    Patching again with the same arguments is a no-op; with different ones the model is
    unpatched first. Any error while patching leaves the model unpatched.
    """
    args = _args.normalize(mode, backend, min_elements, kernels, graphs, recompute_mlp, compile_kernels)
    chain, root = _unwrap(model)
    arch = _arch_of(root)
    state = root.__dict__.get("_forge_state")
    if state is not None:
        if state.args == args[:7]:
            copying.publish(state, chain, _PUBLIC)  # e.g. the wrapper of a copy whose inner model is patched
            return model
        unpatch(model)
    mode, backend_req, min_req, requested, graphs, recompute_mlp, compile_kernels, explicit = args
    if explicit and not requested and not graphs:
        _report.log.warning("forge.patch(kernels=[]) names no kernel and graphs=False: nothing is patched, "
                            "the model runs its own code (kernels=None patches every kernel)")
    p = Patcher(root, arch, mode, backend_req, min_req, requested, explicit, recompute_mlp, graphs, compile_kernels,
                min_fused)
    # an explicitly named backend that cannot run here, or not on this model, is an error
    for b in sorted({backend_req[k] for k in requested if k in backend_req} - {"auto"}):
        ops.require(b)
        ok, why = ops.fits(b, p.device_types, p.float64)
        if not ok:
            raise errors.BackendUnavailableError(why)
    undo, published = [], []
    try:
        _hub_kernels_off(root, undo)
        if mode == "infer":
            for k in TRAIN_ONLY:
                if k in requested:
                    p.skip(k, f"mode='infer' declines {k}: it only serves training (a loss or adapter gradients)",
                           applies=False)
        _apply_lora(root, p)
        _walk(root, arch, p)
        _apply_fused_ce(root, arch, p)
        _apply_causal_mask(root, p)
        g = _apply_graphs(root, p) if graphs else None
        backends = p.backends()
        info = _report.Info(mode, dict(p.counts), dict(p.skipped), backends, p.thresholds(),
                            {b: b != TORCH and ops.interpreted(b) for b in set(backends.values())})
        # (the default table is not bound: a copy loaded elsewhere reads that process's defaults)
        call = functools.partial(patch, mode=mode, backend=backend_req, min_elements=min_req,
                                 kernels=requested if explicit else None, graphs=graphs, recompute_mlp=recompute_mlp,
                                 compile_kernels=compile_kernels,
                                 min_fused=None if min_fused is defaults.MIN_FUSED_ELEMENTS else min_fused)
        state = _State(args[:7], p._records, undo + p.undo, [], call, info,
                       (info.counts, info.skipped, p.stats, backends, g))
        published = state.chain  # (the wrappers publish puts forge's hooks on, down to root)
        root.__dict__["_forge_state"] = state
        copying.publish(state, chain, _PUBLIC)
        _report.log_patch(root, state, p, g)
    except BaseException:  # (an interrupt or a failing log handler too: the model is left as it was)
        _unpublish([*chain, *published])
        p.restore()
        _run(p.undo)
        _run(undo)
        _stacking.release(root)  # (a saving hook an interrupt caught before its undo was listed)
        raise
    return model


def unpatch(model):
    """Restore every original forward; a no-op on a model forge has not patched."""
    try:
        _chain, root = _unwrap(model)
    except errors.UnsupportedModelError:
        return model
    state = root.__dict__.get("_forge_state")
    if state is None:
        return model
    # Each step takes what it has done off the state (records, undo calls), and the state goes
    # last: an unpatch interrupted part-way (an interrupt, an out-of-memory error while giving
    # stacked weights their own memory) leaves the model patched, and unpatch again finishes it.
    restore(state.records)
    _run(state.undo)
    _stacking.release(root)
    lora_dropout.release()  # the dropout draws' kept ones (the next draw of any model makes them again)
    _unpublish(state.chain)  # (root too where ``model`` is a shallow copy sharing the state)
    root.__dict__.pop("_forge_state", None)
    return model


def _unpublish(objs) -> None:
    """Take forge's public attributes, copy hooks and state off the model and its wrappers (the
    state last: an unpatch stopped before then finds it and finishes)."""
    for obj in objs:
        for name in _PUBLIC + copying.HOOKS:
            obj.__dict__.pop(name, None)
    for obj in objs:
        obj.__dict__.pop("_forge_state", None)


def report(model):
    """``forge.report(model)``: per kernel, backend, modules, fused and fallback calls and skip
    reasons (forge.patching.report.Report); an unpatched model, or a module forge would not
    patch (no Hugging Face model inside), reports ``patched=False``."""
    try:
        _chain, root = _unwrap(model)
    except errors.UnsupportedModelError:
        return _report.foreign(model)
    return _report.build(root, root.__dict__.get("_forge_state"))


def guard_stats(model) -> GuardStats:
    """The guard statistics of a patched model (``model._forge_guard_stats``)."""
    try:
        _chain, root = _unwrap(model)
    except errors.UnsupportedModelError:
        root = None
    if root is None or "_forge_state" not in root.__dict__:
        raise ValueError(f"guard_stats: {type(model).__name__} is not a model forge has patched "
                         "(forge.patch(model) first)")
    return root._forge_guard_stats


def _hub_kernels_off(root, undo: list) -> None:
    """Turn off transformers' hub kernels on ``root`` (``use_kernels``, which ``from_pretrained``
    turns on wherever the ``kernels`` package is installed), the call that turns them back on as
    they were appended to ``undo`` first (so a patch that fails from here on turns them back on).
    While they are on, every ``train()`` or ``eval()`` that changes the model's mode kernelizes it
    again, which puts transformers' forward back on each RMSNorm module: forge's RMSNorm would be
    dropped at the trainer's first ``model.train()``, silently."""
    if not getattr(root, "use_kernels", False):
        return
    config = getattr(root, "kernel_config", None)
    # (back on in the mode the model is in then, as its own train()/eval() would choose it)
    undo.append(lambda: root.set_use_kernels(True, kernel_config=config))
    try:
        root.set_use_kernels(False)
    except Exception as e:  # noqa: BLE001  (transformers cannot kernelize meta weights: offloaded)
        undo.pop()
        _report.log.warning("forge.patch: transformers' hub kernels (use_kernels) could not be turned off for "
                            "this model (%s: %s); they stay on", type(e).__name__, e)
        return
    _report.log.info("forge.patch: transformers' hub kernels (use_kernels) are off for this model while "
                     "it is patched: train()/eval() would kernelize it again over forge's RMSNorm; "
                     "forge.unpatch turns them back on")


def _run(calls) -> None:
    """Run the undo calls, newest first, every one of them: one that raises is logged and the
    rest still run (turning transformers' hub kernels back on raises on a model whose weights
    accelerate offloaded to the meta device; the model is otherwise restored)."""
    while calls:  # (each taken off once it ran: an interrupt leaves the rest, and itself, to a retry)
        try:
            calls[-1]()
        except Exception as e:  # noqa: BLE001
            _report.log.warning("forge: a step of undoing the patch failed and was skipped: %s: %s",
                                type(e).__name__, e)
        calls.pop()


# ---------------------------------------------------------------------------------------------
# the generic walker


def _hf_forward(cls) -> bool:
    """The forward that runs is transformers' own (a user subclass may compute something else)."""
    return getattr(getattr(cls, "forward", None), "__module__", "").startswith("transformers.")


def _walk(root, arch, p):
    norms, mlps, attns, experts, routers = [], [], [], [], []
    lora_mlps = wrapped = 0
    for name, mod in root.named_modules():
        cls = type(mod)
        if "forward" in mod.__dict__ or not _hf_forward(cls):
            # replaced by someone else (e.g. accelerate hooks) or not HF code: leave it
            lora_mlps += p.is_replaced(mod) and cls.__name__.endswith(_arch.MLP_SUFFIX)
            p.foreign += "forward" in mod.__dict__ and not p.is_replaced(mod)
            continue
        cname, leaf = cls.__name__, name.rpartition(".")[2]
        if cname.endswith(_arch.NORM_SUFFIX) and leaf in arch.norms:
            norms.append(mod)
        elif cname.endswith(_arch.NORM_SUFFIX) and not set(name.split(".")[:-1]).isdisjoint(arch.norms):
            wrapped += 1  # a copy inside a wrapper (peft's LN tuning, modules_to_save): left to it
        elif cname.endswith(_arch.MLP_SUFFIX):
            mlps.append((name, mod))
        elif cname.endswith(_arch.ATTN_SUFFIX):
            attns.append(mod)
        elif _experts.is_experts(cls, mod):
            experts.append((name, mod))
        elif _experts.is_router(cls, mod):
            routers.append(mod)
    _apply_rmsnorm(p, arch, norms, wrapped)
    if experts and not mlps and p.wants(arch.glu):
        p.skip(arch.glu, "every MLP of this model is a mixture of experts (the experts kernel)", applies=False)
    _apply_glu(p, arch, mlps, lora_mlps)
    _apply_rope(p, arch, attns)
    _qkv.apply(p, attns)
    _experts.apply(p, experts, lambda: _ready(p, _experts.KEY, experts, "expert modules"), fw._compiling, root,
                   routers)


def _ready(p, key, found, what):
    """The kernel for ``key`` if it should be applied to the modules found, else None (skipped)."""
    if not p.wants(key):
        return None
    if not found:
        why = (f" ({p.foreign} modules have a forward of their own instance, which forge leaves alone: "
               "accelerate's dispatch or offloading hooks? patch before dispatching)") if p.foreign else ""
        p.skip(key, f"no {what} found in {p.arch.model_type} model{why}")
        return None
    try:
        return p.kernel(key)
    except errors.BackendUnavailableError as e:
        p.skip(key, str(e))
        return None


def _apply_rmsnorm(p, arch, norms, wrapped=0):
    if wrapped and not norms and p.wants("rmsnorm"):
        p.skip("rmsnorm", f"the {wrapped} RMSNorm modules are wrapped (peft's LN tuning or modules_to_save?): "
                          "their wrappers run them")
        return
    kernel = _ready(p, "rmsnorm", norms, f"RMSNorm modules named {arch.norms}")
    if kernel is None:
        return
    thr, ks = p.min_elements("rmsnorm"), p.stats.counter("rmsnorm")
    for mod in norms:
        eps_attr = next((a for a in _arch.EPS_ATTRS if isinstance(getattr(mod, a, None), float | int)), None)
        w = getattr(mod, "weight", None)
        if p.is_replaced(mod) or eps_attr is None or w is None or w.dim() != 1:
            continue
        fwd = fw.rmsnorm_forward(kernel, type(mod).forward, eps_attr, arch.norm_casting, arch.norm_offset, thr, ks,
                                 defer=p.defers("rmsnorm"))
        p.replace_forward(mod, "rmsnorm", types.MethodType(fwd, mod))
    if "rmsnorm" not in p.counts:
        p.skip("rmsnorm", "no RMSNorm module has a 1-D weight and an eps attribute " + str(_arch.EPS_ATTRS))


def _apply_glu(p, arch, mlps, lora_mlps):
    """Each MLP gets the GLU kernel of the activation module it calls (``mlp.act_fn``, read
    through ``arch.glu_of``), whatever the config names: a user may swap that module. An MLP
    whose act_fn neither kernel computes keeps its forward, with the reason under the
    architecture's GLU key; the patched forward checks at call time that act_fn is still of the
    class it was built for (forwards.glu_forward)."""
    by_key, odd = {"swiglu": [], "geglu": []}, []
    for name, mod in mlps:
        act_fn = mod._modules.get("act_fn")
        key = _arch.glu_of(act_fn)
        if key is None:
            odd.append(f"{name} calls {type(act_fn).__name__}" if act_fn is not None else f"{name} has no act_fn")
        else:
            by_key[key].append(mod)
    for key, found in by_key.items():
        if not found and key != arch.glu:
            if p.explicit and p.wants(key):
                p.skip(key, f"no MLP of this {arch.model_type} model calls the {key} kernel's activation "
                            f"(its config names {arch.glu})", applies=False)
            continue
        if p.wants(key) and not mlps and lora_mlps:
            p.skip(key, f"the fused lora_mlp kernel runs all {lora_mlps} MLP modules (its {key} included)",
                   applies=False)
        if p.wants(key) and mlps and not found:
            act = getattr(p.model.config, arch.act_attr, None)
            if odd:
                p.skip(key, f"the {key} kernel computes {_arch.GLU_ACTS[key][0]}, but {_glu_odd(odd)} "
                            f"(config.{arch.act_attr}={act!r})")
            else:  # every MLP calls the other GLU's activation, and runs that kernel
                p.skip(key, f"no MLP calls {_arch.GLU_ACTS[key][0]} (config.{arch.act_attr}={act!r})", applies=False)
            continue
        _glu_modules(p, key, found)
    if odd and p.wants(arch.glu) and arch.glu in p.counts:
        p.skip(arch.glu, f"{len(odd)} of {len(mlps)} MLPs keep their own forward: {_glu_odd(odd)}, which no "
                         "GLU kernel computes")


def _glu_odd(odd) -> str:
    return "; ".join(odd[:3]) + (f" (+{len(odd) - 3} more)" if len(odd) > 3 else "")


def _glu_modules(p, key, mlps):
    kernel = _ready(p, key, mlps, "MLP modules")
    if kernel is None:
        return
    thr, ks = p.min_elements(key), p.stats.counter(key)
    # the whole MLP in one call (forge.spec.gated_mlp): under autograd one node that keeps one
    # activation less; without it the three products as bare F.linear calls around the kernel
    mlp = p.companion(key, "gated_mlp")
    act = "silu" if key == "swiglu" else "gelu_tanh"
    for mod in mlps:
        if p.is_replaced(mod) or not all(isinstance(getattr(mod, n, None), nn.Module) for n in _arch.MLP_PROJ):
            continue
        width = getattr(mod.gate_proj, "out_features", None) or mod.intermediate_size
        stack = p.mode == "infer" and not p.never_fuses() and _stacking.stack([mod], _stacking.GATE_UP, p.undo)
        fwd = fw.glu_forward(kernel, mlp, p.mode == "train", act, type(mod._modules["act_fn"]), type(mod).forward,
                             width, thr, ks, p.recompute_mlp, defer=p.defers(key), stack=stack)
        p.replace_forward(mod, key, types.MethodType(fwd, mod))
    if key not in p.counts:
        p.skip(key, f"no MLP module has submodules {_arch.MLP_PROJ} (or all were taken by lora_mlp)")


def _apply_rope(p, arch, attns):
    if not arch.rope and p.wants("rope"):
        p.skip("rope", f"{arch.model_type} attention does not use apply_rotary_pos_emb", applies=False)
    kernel = _ready(p, "rope", attns, "attention modules")
    if kernel is None:
        return
    thr, ks = p.min_elements("rope"), p.stats.counter("rope")
    name, built, why = _arch.ROPE_FUNCTION, {}, []
    for mod in attns:
        cls = type(mod)
        if p.is_replaced(mod):
            continue
        if cls not in built:
            built[cls] = None
            try:
                inner = fw.innermost(cls.forward)
                g = inner.__globals__
                if name not in inner.__code__.co_names or name not in g:
                    raise fw.RebuildError(f"{cls.__name__}.forward does not call a module-level {name}")
                # forge's RoPE under HF's name, in a copy of the modeling module's globals
                rope = fw.rope_function(kernel, g[name], thr, ks, defer=p.defers("rope"))
                built[cls] = fw.rebuilt_with(cls.forward, inner, {name: rope})
            except fw.RebuildError as e:
                why.append(str(e))
        if built[cls] is not None:
            p.replace_forward(mod, "rope", types.MethodType(built[cls], mod))
    if "rope" not in p.counts and why:
        p.skip("rope", "; ".join(why))


# ---------------------------------------------------------------------------------------------
# LoRA and the fused loss


def _has_lora(root) -> bool:
    return any(isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and len(m.lora_A) for m in root.modules())


def _apply_lora(root, p):
    wanted = [k for k in LORA_KEYS if p.wants(k)]
    if not wanted:
        return
    if not _has_lora(root):
        for k in wanted:
            p.skip(k, "the model has no LoRA adapters (no peft LoRA layers)", applies=False)
        return
    try:
        from . import lora
    except ImportError as e:
        for k in wanted:
            p.skip(k, f"forge.patching.lora is not available ({e})")
        return
    lora.apply(root, p)  # LoRA runs first: the modules it takes over are left alone after it
    for k in wanted:
        if k not in p.counts and k not in p.skipped:
            where = "MLP" if k == "lora_mlp" else "attention"
            p.skip(k, f"no {where} module has LoRA adapters on its projections", applies=False)


def _apply_fused_ce(root, arch, p):
    key = "fused_linear_ce"
    if not p.wants(key):
        return
    lm = getattr(root, "lm_head", None)
    decoder = getattr(root, getattr(root, "base_model_prefix", "model"), None)
    if isinstance(lm, nn.Module) and not isinstance(lm, nn.Linear) and isinstance(decoder, nn.Module):
        p.skip(key, fw.head_declines(root))  # (a peft wrapper: an adapter, modules_to_save, trainable tokens)
        return
    if not isinstance(lm, nn.Linear) or not isinstance(decoder, nn.Module):
        p.skip(key, f"{type(root).__name__} has no nn.Linear lm_head over a decoder (not a *ForCausalLM)",
               applies=False)
        return
    if "forward" in root.__dict__ or not _hf_forward(type(root)):
        why = f"{type(root).__name__}.forward is not transformers' own"
    elif "labels" not in inspect.signature(fw.innermost(type(root).forward)).parameters:
        why = f"{type(root).__name__}.forward takes no labels"
    elif getattr(getattr(root, "config", None), "output_router_logits", False):
        why = ("config.output_router_logits is on: every training call adds the experts' auxiliary loss, which "
               "needs the model's own forward (its logits)")
    else:  # (checked again on every call: fw.fused_ce_forward)
        why = fw.head_declines(root)
    if why:
        p.skip(key, why)
        return
    kernel = _ready(p, key, [root], "lm_head")
    if kernel is None:
        return
    inner = fw.innermost(type(root).forward)
    fused = fw.fused_ce_forward(kernel, inner, arch.logit_softcap_attr, p.stats.counter(key))
    try:
        fn = fw.rebuild(type(root).forward, lambda f: fused)
    except fw.RebuildError as e:
        p.skip(key, str(e))
        return
    p.replace_forward(root, key, types.MethodType(fn, root))


# ---------------------------------------------------------------------------------------------
# the causal mask under torch.compile


def _apply_causal_mask(root, p):
    """The decoder model's forward rebuilt with forge's mask builders
    (``forwards.causal_mask_builder``), used only while torch.compile traces a call without an
    attention mask or position ids; eager calls run the class's own forward. Not a kernel: it
    is not counted in ``_forge_patched_counts``, and a decoder whose forward is not
    transformers' own, or builds its mask another way, is left alone."""
    prefix = getattr(root, "base_model_prefix", "model")
    for mod in (getattr(root, prefix, None), root):
        if not isinstance(mod, nn.Module) or "forward" in mod.__dict__ or not _hf_forward(type(mod)):
            continue
        fwd = type(mod).forward
        try:
            inner = fw.innermost(fwd)
            g = inner.__globals__
            names = {n: fw.causal_mask_builder(g[n], sliding) for n, sliding in fw.MASK_BUILDERS.items()
                     if n in inner.__code__.co_names and n in g}
            params = list(inspect.signature(inner).parameters)[1:]  # (after self)
            if not names or not {"attention_mask", "position_ids"} <= set(params):
                continue
            plain = fw.rebuilt_with(fwd, inner, names)
        except fw.RebuildError:
            return
        where = {n: params.index(n) for n in ("attention_mask", "position_ids")}
        p.replace_forward(mod, "causal_mask", types.MethodType(fw.causal_decoder_forward(fwd, plain, where), mod),
                          count=False)
        return


# ---------------------------------------------------------------------------------------------
# CUDA graphs around the decoder layers


def _apply_graphs(root, p):
    """Wrap each decoder layer's forward in its graph replay (forge.patching.graphs); returns the
    Graphs object (``model._forge_graphs``), or None with the reason in ``_forge_skipped``."""
    for key in LAYER_KEYS:
        if key in p.counts and p.backend(key) == "pallas":
            # capturable only when launched on torch's stream (natively, not through JAX)
            ok, why = ops.on_stream("pallas")
            if not ok:
                raise ValueError(
                    f"graphs=True needs the kernels inside the decoder layers on torch's stream; {key!r} runs "
                    f"on 'pallas', whose native launch is unavailable here ({why}), so JAX would launch it on "
                    "its own stream, outside a torch CUDA graph: patch with backend='triton' or graphs=False")
    layers, why = _graphs.decoder_layers(root)
    if layers is None:
        p.skip("graphs", why)
        return None
    forwards = [type(layer).forward for layer in layers]
    _graphs.register_ops()  # the layer op a torch.compile trace of the patched model calls
    g = _graphs.Graphs(root, layers, forwards)
    for i, (layer, orig) in enumerate(zip(layers, forwards)):
        p.replace_forward(layer, "graphs", types.MethodType(_graphs.layer_forward(g, i, orig), layer))
    if p.mode == "infer":  # generate()'s decoding steps, each captured whole on a static cache
        g.decode = _decode.install(root, g, p)
    return g
