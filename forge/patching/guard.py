"""Per-call size guard statistics: how many calls of each kernel were fused and how many fell back.

The guard itself is one integer comparison inlined in each replaced forward (``core.py``): a
shape-sensitive kernel (rmsnorm, swiglu, geglu, rope) runs only when the call has at least
``min_elements`` activation elements, else the original forward runs. It executes about 1,400
times per forward of a 24-layer model, so it must cost next to nothing: the closure holds its
threshold as a local int and its counter object directly, and bumps one attribute per call
(tens of nanoseconds; no dict lookup, no lock, no host sync), after a ``torch.compiler.
is_compiling()`` check (~160 ns; under torch.compile's tracing the count is not bumped: dynamo
would specialise on it and recompile each call).

Read the counts from a patched model::

    stats = model._forge_guard_stats      # also forge.patching.guard_stats(model)
    stats.as_dict()   # {"rmsnorm": {"fused": 98, "fallback": 0}, ...}
    stats.reset()

Counts are per call, so gradient checkpointing (which re-runs the forward) counts a layer twice.
"""
from __future__ import annotations

import torch


class _Capture:
    """``CAPTURE.on`` is True while forge captures CUDA graphs (``graphs.py``): the guards then
    fuse every call, whatever its size (looked up only when a call is below its threshold)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


CAPTURE = _Capture()


class _Step:
    """``STEP.rows`` is the decoding step's one-row product mode (decode_runtime._RowProducts)
    while a batch-1 step warms up or is captured under it, else None: forge's gated MLP forward
    asks it for the gate/up product with the activation in one launch."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows = None


STEP = _Step()


def version(t):
    """``t._version``, or None for an inference tensor (made under ``torch.inference_mode``),
    which keeps no version counter: reading it raises. The hand-offs that compare versions (q/k/v
    slots, the decoding step's residual sums) then rely on the tensor's identity alone; within
    inference mode nothing records an in-place change, as nothing would need to. None as well
    inside a torch.compile trace: there the counter is a data-dependent value (a guard on it
    breaks the graph) and ``is_inference()`` is refused; the trace is functional, and the
    hand-offs sit between calls transformers makes back to back."""
    if torch.compiler.is_compiling() or t.is_inference():
        return None
    return t._version


class KeyStats:
    """Counters for one kernel key; the replaced forwards bump these attributes directly."""

    __slots__ = ("fused", "fallback")

    def __init__(self) -> None:
        self.fused = 0
        self.fallback = 0

    def __repr__(self) -> str:
        return f"KeyStats(fused={self.fused}, fallback={self.fallback})"


class GuardStats:
    """Fused / fallback call counts per kernel key, shared by every forward of one patch."""

    def __init__(self) -> None:
        self._keys: dict[str, KeyStats] = {}

    def counter(self, key: str) -> KeyStats:
        """The counter a replaced forward captures (one per key, created on first request)."""
        ks = self._keys.get(key)
        if ks is None:
            ks = self._keys[key] = KeyStats()
        return ks

    def fused(self, key: str) -> int:
        ks = self._keys.get(key)
        return ks.fused if ks else 0

    def fallback(self, key: str) -> int:
        ks = self._keys.get(key)
        return ks.fallback if ks else 0

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"fused": v.fused, "fallback": v.fallback} for k, v in self._keys.items()}

    def reset(self) -> None:
        # zero in place: the forwards hold these very objects
        for ks in self._keys.values():
            ks.fused = 0
            ks.fallback = 0

    def __repr__(self) -> str:
        body = ", ".join(f"{k}: {v.fused} fused / {v.fallback} fallback" for k, v in self._keys.items())
        return f"GuardStats({body})"
