"""Everything the native launch path (``bridge/native/``) takes from JAX's private modules.

The native path needs one thing JAX has no public API for: the Triton IR (TTIR) that Pallas'
Triton lowering makes of a ``pallas_call``. JAX builds it inside the ``pallas_call`` lowering
rule (``jax._src.pallas.triton.pallas_call_registration``) with
``lowering.lower_jaxpr_to_triton_module`` and hands it to its own bundled Triton. We lower a
one-equation function with ``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``,
catch the module that function returns, print it without debug info and stop the lowering
there. Lowering needs no GPU, so this runs, and is tested, on the CPU too: JAX 0.10 falls back
to compute capability 9.0 without one; JAX 0.11 asks ``gpu_info.get_gpu_info()`` and raises
without a GPU (or an abstract one), so without a GPU :func:`lower_pallas_call` answers that
question with the same 9.0 (an H100/H200's: what the CPU tests' TTIR is compared against).

If a future JAX moves any of these names, :func:`missing` says which, and the bridge keeps every
kernel on the DLPack path with that reason (``bridge.native.status()``).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import threading

_REG = "jax._src.pallas.triton.pallas_call_registration"
_NEEDED = (
    (_REG, "lowering"),  # the lowering module as the registration rule sees it
    ("jax._src.pallas.triton.lowering", "lower_jaxpr_to_triton_module"),
    ("jax._src.pallas.core", "GridMapping"),
)
PALLAS_CALL = "pallas_call"


def missing() -> list[str]:
    """The private JAX names this module needs that this JAX does not have (empty if all)."""
    out = []
    for mod, attr in _NEEDED:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            out.append(mod)
            continue
        if not hasattr(m, attr):
            out.append(f"{mod}.{attr}")
    try:
        import jax

        jax.jit(lambda x: x).trace  # noqa: B018 - the staged API the lowering goes through
    except AttributeError:
        out.append("jax.jit(...).trace")
    return out


@dataclasses.dataclass(frozen=True)
class Lowered:
    """One ``pallas_call`` lowered for Triton: its IR text and how to launch it."""

    ttir: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int


class _Caught(Exception):
    pass


_LOCK = threading.Lock()  # the capture swaps a module attribute: one lowering at a time


def lower_pallas_call(eqn) -> Lowered:
    """The TTIR of one ``pallas_call`` equation of a jaxpr (traced with any ``interpret``)."""
    import jax

    reg = importlib.import_module(_REG)
    params = dict(eqn.params, interpret=False)
    cp = params.get("compiler_params")
    num_warps = getattr(cp, "num_warps", None) or 4
    num_stages = getattr(cp, "num_stages", None) or 3
    got = {}
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def catch(*args, **kwargs):
        res = orig(*args, **kwargs)
        got["ttir"] = res.module.operation.get_asm(enable_debug_info=False)
        grid = tuple(int(g) for g in res.grid)
        got["grid"] = grid + (1,) * (3 - len(grid))
        raise _Caught

    consts = {i: v.val for i, v in enumerate(eqn.invars) if is_literal(v)}
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for i, v in enumerate(eqn.invars) if i not in consts]

    def one(*xs):
        it = iter(xs)
        args = [consts[i] if i in consts else next(it) for i in range(len(eqn.invars))]
        return eqn.primitive.bind(*args, **params)

    with _LOCK:
        reg.lowering.lower_jaxpr_to_triton_module = catch
        info = getattr(reg, "gpu_info_lib", None)  # JAX >= 0.11
        orig_info = None if info is None else info.get_gpu_info
        if info is not None and not _has_gpu_info(orig_info):
            info.get_gpu_info = functools.partial(_default_gpu_info, info)
        try:
            jax.jit(one).trace(*avals).lower(lowering_platforms=("cuda",))
        except _Caught:
            pass
        finally:
            reg.lowering.lower_jaxpr_to_triton_module = orig
            if info is not None:
                info.get_gpu_info = orig_info
    if "ttir" not in got:
        raise RuntimeError("the pallas_call lowering rule did not reach lower_jaxpr_to_triton_module")
    return Lowered(got["ttir"], got["grid"], int(num_warps), int(num_stages))


def _has_gpu_info(get) -> bool:
    try:
        get()
        return True
    except ValueError:  # no GPU (the CPU tests)
        return False


def _default_gpu_info(info):
    """JAX 0.10's fallback without a GPU (compute capability 9.0), in JAX 0.11's terms."""
    return info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)


def is_literal(v) -> bool:
    """A constant operand of an equation (``jax.core.Literal``) rather than a variable."""
    return type(v).__name__ == "Literal"


def subjaxpr(eqn):
    """The inner jaxpr of a call-like equation (jit/pjit/closed_call), or None."""
    for key in ("jaxpr", "call_jaxpr"):
        j = eqn.params.get(key)
        if j is not None and eqn.primitive.name != PALLAS_CALL:
            return j
    return None
