"""What the native launch knows of this process: whether it runs here (the launcher setting and
the availability checks), its tables (plans, compiled kernels, declined passes) and its
counters. Every other module of ``bridge.native`` reads and fills these; nothing here builds or
runs a plan."""
from __future__ import annotations

import collections
import functools
import logging
import os
import threading

from .. import _jax_internals as JI

log = logging.getLogger("forge")

PLANS_MAX = 512
PLANS: "collections.OrderedDict" = collections.OrderedDict()  # signature -> plan (False: declined)
DECLINED: dict = {}  # (kernel, pass) -> reason (the latest)
_WARNED: set = set()
LOCK = threading.RLock()
LAUNCHER = None  # None: decide ("triton" on a GPU); tests set "jax" (bridge.native.set_launcher)
LOWER_WITH_JAX = False  # launcher "jax": also lower each pallas_call and key it (tests)
# compiled kernels by what Triton compiles: (sha256 of the TTIR, num_warps, num_stages). Row
# counts share a module (forge_pallas reads them at run time), so they share one entry; each
# plan keeps its own grid. Under launcher "jax" (lower=True) the entries hold the TTIR only.
KERNELS: dict = {}
COMPILES = [0]  # triton.compile calls in this process
# seconds spent building plans, by part (bench/bench_first_call.py reports them)
TIMES = {"trace": 0.0, "lower": 0.0, "compile": 0.0, "build": 0.0}
TRACES = [0]  # jaxpr traces in this process (a plan from a recipe on disk traces nothing)


class Unsupported(Exception):
    """This kernel pass cannot run natively; the message says why."""


@functools.cache
def process_reason() -> str | None:
    if os.environ.get("FORGE_PALLAS_NATIVE", "1") == "0":
        return "FORGE_PALLAS_NATIVE=0"
    miss = JI.missing()
    if miss:
        return "this JAX lacks the internals the native path lowers through: " + ", ".join(miss)
    if launcher() == "triton":
        try:
            import triton  # noqa: F401
            import triton.compiler  # noqa: F401
        except ImportError as e:
            return f"triton is not importable ({e})"
    return None


def launcher() -> str:
    if LAUNCHER is not None:
        return LAUNCHER
    from forge_pallas import _common

    return "none" if _common.interpret() else "triton"


def available() -> tuple[bool, str]:
    """(on, reason) for the native path in this process."""
    if launcher() == "none":
        return False, "Pallas runs in interpret mode (JAX has no GPU): the DLPack path serves every call"
    if launcher() == "off":
        return False, "turned off (bridge.native.set_launcher('off'))"
    why = process_reason()
    return (why is None), (why or "")


@functools.cache
def is_on() -> bool:
    """:func:`available`'s answer, cached: the check a call makes where the path is off."""
    return available()[0]


def clear() -> None:
    with LOCK:
        PLANS.clear()
        DECLINED.clear()


def decline(kname, which, why):
    DECLINED[(kname, which)] = why
    if (kname, which, why) not in _WARNED:
        _WARNED.add((kname, which, why))
        log.warning("pallas %s (%s) runs through JAX and DLPack, not natively: %s", kname, which, why)
