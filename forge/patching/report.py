"""What forge did to a model, said two ways: ``forge.report(model)`` (a structured object that
prints as a table), and the ``"forge"`` logger at patch time: one INFO summary per patch, and
one WARNING per distinct reason, once per process, for what the caller asked for that does not
happen (a kernel that fails to apply, a kernel named in ``kernels=`` that never fuses, graphs
off CUDA). forge's own defaults never warn about themselves: a kernel that does not apply to the
model, or a default size guard that never fuses here, is said at INFO.

``_forge_patched_counts`` counts the modules whose forward was replaced; it does not say whether
their calls fuse. The report adds what the guard counted since the patch (or the last
``stats.reset()``): fused calls, and fallback calls that ran the original forward (below the
size threshold, or a call the kernel does not cover).
"""
from __future__ import annotations

import dataclasses
import logging

from .. import defaults

log = logging.getLogger("forge")

_WARNED: set[str] = set()  # reasons already warned about in this process


def warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.warning("%s", reason)


def info_once(message: str) -> None:
    if "info: " + message not in _WARNED:  # (said at INFO once does not stop a later WARNING)
        _WARNED.add("info: " + message)
        log.info("%s", message)


@dataclasses.dataclass
class Info:
    """What one patch decided (kept in the model's ``_forge_state``)."""
    mode: str
    counts: dict
    skipped: dict
    backends: dict
    thresholds: dict   # min_elements of the patched kernels that have a size guard
    interpreted: dict  # backend -> runs in its interpreter here


@dataclasses.dataclass(frozen=True)
class KernelReport:
    key: str
    backend: str | None      # "triton" / "pallas" (None when skipped, and for "graphs")
    interpreted: bool        # the backend runs in its interpreter (CPU)
    modules: int             # modules (call sites) whose forward runs this kernel
    min_elements: int | None  # calls with fewer activation elements run the original forward
                              # (None: the kernel has no size guard)
    fused: int               # calls that ran the kernel
    fallback: int            # calls that ran the original forward
    skipped: str | None      # why the kernel was declined (None when patched everywhere; for a
                             # kernel patched on some modules only, why the others were declined)


@dataclasses.dataclass(frozen=True)
class Report:
    """``forge.report(model)``: per kernel, what runs where. ``kernels`` is keyed by kernel."""

    model: str
    patched: bool
    mode: str | None = None
    kernels: dict = dataclasses.field(default_factory=dict)
    note: str | None = None  # why an unpatched module is one forge would not patch

    def as_dict(self) -> dict:
        return {"model": self.model, "patched": self.patched, "mode": self.mode,
                "kernels": {k: dataclasses.asdict(v) for k, v in self.kernels.items()}, "note": self.note}

    def table(self, calls: bool = True) -> str:
        if not self.patched:
            return f"{self.model}: not patched by forge" + (f" ({self.note})" if self.note else "")
        head = ["kernel", "backend", "modules", "min_elements"] + (["fused", "fallback"] if calls else [])
        rows, skips = [], []
        for k in self.kernels.values():
            if k.skipped is not None:
                skips.append(f"  {k.key}: {k.skipped}")
                continue
            be = (k.backend or "-") + (" (interpreter)" if k.interpreted else "")
            thr = ("-" if k.min_elements is None else "never" if k.min_elements >= _never()
                   else str(k.min_elements))
            rows.append([k.key, be, str(k.modules), thr] + ([str(k.fused), str(k.fallback)] if calls else []))
        w = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        lines = [f"{self.model} (mode={self.mode})"]
        lines += ["  " + "  ".join(c.ljust(n) for c, n in zip(r, w)).rstrip() for r in [head] + rows]
        if skips:
            lines += ["skipped:"] + skips
        if calls and rows:
            lines.append("(fused / fallback count the calls run outside torch.compile; a compiled call is not "
                         "counted, and compile_kernels says which kernels a trace keeps)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _never() -> int:
    return defaults.NEVER


def foreign(module) -> Report:
    """The report of a module that is no model forge.patch takes (no Hugging Face
    PreTrainedModel inside it): not patched, and why."""
    return Report(type(module).__name__, False,
                  note="not a Hugging Face PreTrainedModel, nor one wrapped by peft or torch.compile: "
                       "forge patches only those")


def build(root, state) -> Report:
    """The report of a root model and its ``_forge_state`` (None: not patched)."""
    name = type(root).__name__
    if state is None:
        return Report(name, False)
    info = state.info
    stats = root.__dict__.get("_forge_guard_stats")
    kernels = {}
    for key, n in info.counts.items():
        be = info.backends.get(key)
        kernels[key] = KernelReport(key, be, info.interpreted.get(be, False), n, info.thresholds.get(key),
                                    stats.fused(key) if stats else 0, stats.fallback(key) if stats else 0,
                                    info.skipped.get(key))
    for key, why in info.skipped.items():
        if key not in kernels:
            kernels[key] = KernelReport(key, None, False, 0, 0, 0, 0, why)
    return Report(name, True, info.mode, kernels)


def log_patch(root, state, p, graphs) -> None:
    """At the end of a patch (Patcher ``p``): the INFO summary, then one WARNING per decline
    reason not yet warned in this process. Kernels whose skip only says they do not apply (no
    LoRA adapters or LoRA on some projections only, infer mode declining a training kernel, the
    other GLU; ``p.quiet``) and were not asked for by name appear in the summary, not as
    warnings; so does a default guard of forge.NEVER (on a CPU, Pallas' RMSNorm and RoPE) unless
    the kernel was named in ``kernels=``."""
    info = state.info
    if any(info.interpreted.values()):
        info_once("forge: no CUDA device: the kernels run in their interpreters (on the CPU), which are slow "
                  "and meant for testing; backend='auto' takes Pallas' (several times faster than Triton's) "
                  "when jax is importable")
    if log.isEnabledFor(logging.INFO):
        log.info("forge.patch: %s", build(root, state).table(calls=False))
    for key, why in info.skipped.items():
        if key not in p.quiet:
            warn_once(f"forge.patch: {key} declined: {why}")
    # declines that are no skip: a guard that never fuses by default, graphs that never replay
    for key, t in info.thresholds.items():
        if t >= _never() and not p.min_elements_given(p.inherited.get(key, key)):
            (warn_once if p.explicit else info_once)(f"forge.patch: {key} on {info.backends[key]} in mode={p.mode!r}: its default min_elements is "
                      "forge.NEVER (forge.MIN_FUSED_ELEMENTS), so every call runs the original forward; "
                      "forge.patch(min_elements=...) fuses")
    if graphs is not None and p.device_types != {"cuda"}:
        warn_once("forge.patch: graphs=True on a model not on a CUDA device: every call runs uncaptured")
