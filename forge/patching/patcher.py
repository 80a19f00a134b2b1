"""The Patcher: what one ``forge.patch`` pass knows and records, and the object handed to
``forge.patching.lora.apply(model, patcher)``.

Interface (kept stable for the LoRA patcher): ``mode``; ``stats`` (the guard statistics);
``min_elements(key)``; ``backend(key)`` and ``kernel(key)`` (raise BackendUnavailableError when
no backend can run the kernel); ``wants(key)`` (requested and allowed in this mode);
``replace_forward(module, key, new_forward)``; ``skip(key, reason)``.
"""
from __future__ import annotations

import logging
import types

import torch

from .. import defaults, errors, ops
from ..spec import SHAPE_SENSITIVE
from . import copying
from .guard import GuardStats

log = logging.getLogger("forge")

TRAIN_ONLY = ("fused_linear_ce", "lora_qkv", "lora_o", "lora_mlp")  # need a loss / adapter gradients
# kernels whose patched forward can hand a torch.compile trace the original code instead
# (forge.patch(compile_kernels=)); the fused loss and the LoRA kernels always stay forge's
DEFERRED_UNDER_COMPILE = ("rmsnorm", "swiglu", "geglu", "rope")
LAYER_KEYS = ("rmsnorm", "swiglu", "geglu", "rope", "lora_qkv", "lora_o", "lora_mlp")  # inside decoder layers
TORCH = "torch"  # the backend name of a key that runs torch's own operations (Patcher.runs_torch)


class Patcher:
    """What a patch pass knows; handed to ``forge.patching.lora.apply(model, patcher)``.

    ``replace_forward(module, key, new_forward)`` stores ``new_forward`` as the instance's
    ``forward`` exactly as given (pass a bound method or a closure over the module; it is called
    like ``module.forward(*args, **kwargs)``) and remembers the original for ``unpatch``.
    """

    def __init__(self, root, arch, mode, backend_req, min_req, requested, explicit, recompute_mlp=False,
                 graphs=False, compile_kernels="auto", min_fused=None):
        self.model, self.arch, self.mode = root, arch, mode
        self.stats = GuardStats()
        self.counts: dict[str, int] = {}
        self.skipped: dict[str, str] = {}
        self._backend_req, self._min_req = backend_req, min_req
        self._requested, self.explicit = requested, explicit
        self.recompute_mlp = recompute_mlp  # the gated MLP keeps only its input (forge.patch)
        self._auto = ops.auto_order()
        self._graphs = graphs  # CUDA graphs capture Triton kernels: auto tries triton first in layers
        self._compile_kernels = compile_kernels  # forge.patch(compile_kernels=): see defers()
        self._min_fused = min_fused  # the default thresholds (forge.MIN_FUSED_ELEMENTS); None: forge.defaults'
        self._loaded: dict[str, tuple] = {}
        self.inherited: dict[str, str] = {}  # a kernel that follows another's size guard -> that kernel
        self._records: list[list] = []       # [module, had_instance_attr, old_attr, key, attr name, forge's]
        self._by_id: dict[int, list] = {}
        self.quiet: set[str] = set()         # skips that only say a kernel does not apply
        self.undo: list = []                 # callables unpatch runs (and a failed patch), e.g. unstacking
        self.foreign = 0                     # modules the walk left: a forward of their instance, not forge's
        # where the kernels would run: a backend that cannot run there is declined at patch time
        params = list(root.parameters())
        self.device_types = frozenset(t.device.type for t in params)
        self.float64 = any(t.dtype == torch.float64 for t in params)

    def defers(self, key: str) -> bool:
        """Inside a torch.compile trace, ``key``'s patched forward runs the original code (which
        inductor fuses with its neighbours) instead of forge's op. "auto": RMSNorm and RoPE
        defer; the GLU defers in inference only (in training forge's gated MLP node keeps two
        rows x intermediate activations per layer where inductor's trace keeps three); the fused
        loss and the LoRA kernels stay forge's (inductor has no counterpart for them)."""
        ck = self._compile_kernels
        if ck == "all":
            return False
        if ck == "auto":
            return key in DEFERRED_UNDER_COMPILE and not (self.mode == "train" and key in ("swiglu", "geglu"))
        return key not in ck

    # -- the interface the LoRA patcher uses -------------------------------------------------
    def wants(self, key: str) -> bool:
        return (key in self._requested and key not in self.skipped
                and not (self.mode == "infer" and key in TRAIN_ONLY))

    def backend(self, key: str) -> str:
        b, hit = self._load(key)
        if b is None:
            raise errors.BackendUnavailableError(hit)
        return b

    def kernel(self, key: str):
        """The kernel function the patched forwards call (``forge.ops.get``): eagerly the
        backend's direct path, under torch.compile its ``torch.ops.forge`` ops, which dynamo
        traces into the graph (no graph break)."""
        b, hit = self._load(key)
        if b is None:
            raise errors.BackendUnavailableError(hit)
        return hit

    def companion(self, key: str, fn_name: str):
        """Another function of the backend that runs ``key`` (e.g. the gated MLP beside swiglu);
        None when that backend lacks it."""
        try:
            return ops.get(fn_name, self.backend(key))
        except errors.BackendUnavailableError:
            return None

    def min_elements(self, key: str) -> int:
        if key not in SHAPE_SENSITIVE:
            return 0
        m = self._min_req
        if isinstance(m, dict) and key in m:
            return m[key]
        if isinstance(m, int):
            return m
        if self.recompute_mlp and self.mode == "train" and key in ("swiglu", "geglu"):
            return 0  # asked for the MLP's memory saving: fused at every size
        table = defaults.MIN_FUSED_ELEMENTS if self._min_fused is None else self._min_fused
        backend = self.backend(key)
        if backend == "pallas" and "pallas-dlpack" in table and not ops.on_stream("pallas")[0]:
            backend = "pallas-dlpack"  # not launched natively: every call pays DLPack and JAX's runtime
        d = table.get(backend, 0)
        if isinstance(d, dict) and d.keys() & {"infer", "train"}:
            d = d.get(self.mode, 0)  # per-mode defaults
        return int(d.get(key, 0) if isinstance(d, dict) else d)

    def never_fuses(self) -> bool:
        """forge.patch(min_elements=forge.NEVER): every call is to run the model's own code, so
        nothing outside the guard (the weights stored together of forge.patching.stacking) applies."""
        return isinstance(self._min_req, int) and self._min_req >= defaults.NEVER

    def min_elements_given(self, key: str) -> bool:
        """forge.patch(min_elements=...) set the threshold of ``key`` (else a default)."""
        return isinstance(self._min_req, int) or (isinstance(self._min_req, dict) and key in self._min_req)

    @property
    def graphs(self) -> bool:
        """forge.patch(graphs=True)."""
        return self._graphs

    def runs_torch(self, key: str) -> None:
        """``key`` runs torch's own operations, no backend's kernel (the q/k/v fusion): its
        backend reads ``TORCH`` in ``_forge_backends`` and the report."""
        self._loaded[key] = (TORCH, None)

    def replace_forward(self, module, key: str, new_forward, count: bool = True) -> None:
        """(``count=False``: not a kernel, kept out of ``_forge_patched_counts``.)"""
        counted = key if count else None
        rec = self._by_id.get(id(module))
        if rec is None:
            had = "forward" in module.__dict__
            rec = [module, had, module.__dict__.get("forward"), counted, "forward", None]
            self._records.append(rec)
            self._by_id[id(module)] = rec
            # copy.deepcopy / pickle copy the module without forge's forward (copying.py)
            module.__dict__["__reduce_ex__"] = copying.module_hook(module, had, rec[2])
        else:  # a later kernel takes the module over (e.g. lora_mlp after swiglu)
            if rec[3] is not None:
                self._count(rec[3], -1)
            rec[3] = counted
        module.__dict__["forward"] = rec[5] = new_forward
        copying.mark(new_forward)
        if count:
            self._count(key, 1)

    def skip(self, key: str, reason: str, applies: bool = True) -> None:
        """Record why ``key`` is declined. ``applies=False``: the kernel has nothing to do in
        this model or mode (logged in the summary; a warning only if asked for by name)."""
        self.skipped[key] = reason
        if not applies and not self.explicit:
            self.quiet.add(key)

    def replace_method(self, module, name: str, new) -> None:
        """Store ``new`` as the instance attribute ``name`` (a method other than forward that forge
        takes over, such as ``generate``); unpatch restores what was there. Not counted."""
        self._records.append([module, name in module.__dict__, module.__dict__.get(name), None, name, new])
        module.__dict__[name] = new

    # -- internals ---------------------------------------------------------------------------
    def is_replaced(self, module) -> bool:
        return id(module) in self._by_id

    def _count(self, key, d):
        n = self.counts.get(key, 0) + d
        if n:
            self.counts[key] = n
        else:
            self.counts.pop(key, None)

    def _load(self, key):
        hit = self._loaded.get(key)
        if hit is None:
            hit = self._loaded[key] = _find_kernel(key, self._backend_req[key],
                                                      ops.BACKENDS if self._graphs and key in LAYER_KEYS else self._auto,
                                                      self.device_types, self.float64)
        return hit

    def thresholds(self) -> dict[str, int]:
        """min_elements of each patched kernel that has a size guard (rmsnorm, swiglu, ...; the
        infer-mode q/k/v product follows RoPE's)."""
        return {k: self.min_elements(self.inherited.get(k, k)) for k in self.counts
                if k in SHAPE_SENSITIVE or k in self.inherited}

    def backends(self) -> dict[str, str]:
        return {k: v[0] for k, v in self._loaded.items() if v[0] is not None and k in self.counts}

    def restore(self) -> None:
        restore(self._records)
        self._records.clear()
        self._by_id.clear()


def _find_kernel(key, want, auto, device_types, float64):
    """(backend, fn) for the first backend that can run ``key`` on this model, else (None,
    reason). ``auto``: the order ``backend="auto"`` tries them in."""
    why = []
    for b in auto if want == "auto" else (want,):
        ok, reason = ops.availability(b)
        if ok:
            ok, reason = ops.fits(b, device_types, float64)
        if not ok:
            why.append(reason)
            continue
        try:
            return b, ops.get(key, b)
        except Exception as e:  # kernel module not written yet, or broken: skip, never crash
            why.append(f"{b}: {type(e).__name__}: {e}")
    return None, f"no backend can run {key}: " + "; ".join(why)


def restore(records) -> None:
    """Undo replace_forward / replace_method records, newest first: delete the instance attribute,
    or put back the one that was there, so the module's forward is again exactly what it was.
    Each record is taken off the list once done (an interrupt leaves the rest to a retry), and the
    warnings come after all of them."""
    replaced = []
    while records:
        module, had, old, _key, name, ours = records[-1]
        d = module.__dict__
        for hook in copying.HOOKS:
            d.pop(hook, None)
        if d.get(name) is not ours and d.get("_old_forward") is ours and "_hf_hook" in d:
            # accelerate's hook (dispatch, offloading) wraps forge's forward and calls the one
            # in _old_forward: that gets the module's own back, the hook stays as unpatched
            d["_old_forward"] = old if had else types.MethodType(type(module).forward, module)
        else:
            if d.get(name) is not ours:
                replaced.append((type(module).__name__, name))
            if had:
                d[name] = old
            else:
                d.pop(name, None)
        records.pop()
    for cls, name in replaced:
        log.warning("forge.unpatch: %s.%s was replaced after forge.patch (accelerate's prepare, which the "
                    "HF Trainer calls, wraps a model's forward around forge's for mixed precision): the "
                    "replacement is removed with forge's, and the module runs its own %s without it. "
                    "Unpatch before wrapping the model to keep such a wrapper", cls, name, name)

