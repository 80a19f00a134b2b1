"""The op layer: the backend registry, the torch.library ops of every kernel, and the
backend-neutral autograd nodes.

Layer: above the spec (``forge.spec``) and the backends (``forge_triton``, ``bridge`` over
``forge_pallas``), below the patching (``forge.patching``). Modules here may import the spec,
``forge.errors``, ``forge._runtime`` and (lazily, by name from :data:`BACKENDS`) the backends;
never ``forge.patching``. ``import forge`` loads this package and imports no backend.

- :func:`get` ``(key, backend)``: a kernel in its spec's signature (``forge.spec.<key>``). Eager
  calls run the backend's direct path; under torch.compile the same function runs through the
  ``torch.ops.forge`` ops (:mod:`forge.ops.library`), which torch.compile traces whole.
- :mod:`forge.ops.gated_mlp`, :mod:`forge.ops.precomputed`: the gated MLP node and the loss whose
  gradients come from its forward, shared by every backend, built here from each backend's
  pieces (:data:`NODES`).

Adding a backend (one folder and one entry in :data:`BACKENDS`):

1. A package (say ``forge_new/``) whose attributes are the kernels' functional APIs in the spec's
   signatures (``rmsnorm``, ``swiglu``, ``geglu``, ``rope``, ``lora_qkv``, ``lora_mlp``; any it
   lacks is skipped at patch time) and ``availability() -> (usable, reason)``.
2. The nodes' pieces, where it has them: ``mlp_act(act) -> dict(act, act_bwd, inplace,
   device_type[, act_bwd_fresh])`` for the gated MLP; ``experts_pieces() -> dict`` for the MoE
   expert block (forge.spec.experts lists them); ``fused_linear_ce_prepare``,
   ``fused_linear_ce_compute`` (and optionally ``fused_linear_ce_scale``) for the loss.
3. An adaptor module for the op layer (``forge_triton/_ops.py``, ``bridge/_ops.py`` are the two to
   copy): ``kernels()``, ``op_name``, ``input_names``, ``diff_names``, ``saved_present``,
   ``has_bwd``, ``inductor``, ``wrapped``, ``run_fwd``/``fake_fwd``, ``run_bwd``/``fake_bwd`` (or
   ``traced_bwd``: a backward in plain torch ops, traced into the compiled backward) and
   ``install(traced)``; the functional APIs call the installed ``traced(kdef, tensors, static)``
   under ``torch.compiler.is_compiling()``.
4. An entry here: ``BACKENDS["new"] = Backend(package="forge_new", adaptor="forge_new._ops",
   ...)``, the functions that say where it runs and whether its launches are on torch's stream
   (see :class:`Backend`). Tests take
   their backend list from :data:`BACKENDS`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

from ..errors import BackendUnavailableError
from ..spec import KERNELS


def _triton_interpreted() -> bool:
    from .. import _runtime

    return _runtime.triton_interpreted()


def _triton_fits(device_types, float64):
    from .. import _runtime

    return _runtime.triton_fits(device_types)


def _pallas_interpreted() -> bool:
    from bridge import runtime

    return runtime.interpret()


def _pallas_fits(device_types, float64):
    from bridge import runtime

    return runtime.fits(device_types, float64)


def _triton_on_stream():
    return True, ""


def _pallas_on_stream():
    from bridge import native

    return native.available()


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registry entry: the package holding the functional APIs, the op layer's adaptor
    module, whether it runs in an interpreter here, whether it fits a model's parameters
    (``fits(device_types, float64) -> (usable, reason)``), and whether its kernels launch on
    torch's current stream here (``on_stream() -> (yes, reason)``: what a CUDA graph captures)."""

    package: str
    adaptor: str
    interpreted: object
    fits: object
    on_stream: object


BACKENDS_TABLE: dict[str, Backend] = {
    "triton": Backend("forge_triton", "forge_triton._ops", _triton_interpreted, _triton_fits, _triton_on_stream),
    "pallas": Backend("bridge", "bridge._ops", _pallas_interpreted, _pallas_fits, _pallas_on_stream),
}
BACKENDS = tuple(BACKENDS_TABLE)
NODES = ("gated_mlp", "fused_linear_ce", "experts")  # built here from each backend's pieces


def _entry(backend: str) -> Backend:
    b = BACKENDS_TABLE.get(backend)
    if b is None:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    return b


@functools.cache
def availability(backend: str) -> tuple[bool, str]:
    """(usable, reason) for a backend in this process."""
    entry = _entry(backend)
    try:
        mod = importlib.import_module(entry.package)
    except ImportError as e:  # package missing
        return False, f"{backend} backend unavailable: {e}"
    check = getattr(mod, "availability", None)
    return check() if check else (True, "")


def require(backend: str) -> None:
    ok, why = availability(backend)
    if not ok:
        raise BackendUnavailableError(why)


def _attr(mod, key):
    # (a package whose kernel module shares its public function's name keeps the name for the
    # function itself: forge_triton._Package)
    return getattr(mod, key, None)


@functools.cache
def _ops_installed(backend: str) -> None:
    from . import library

    library.register(backend, importlib.import_module(_entry(backend).adaptor))


# what get() hands out: the spec's kernels, the nodes built here, and the decode attention the
# graph runtime takes with its cache write and one-row products (a backend's other attributes are
# its pieces, not kernels)
KERNEL_KEYS = tuple(dict.fromkeys(KERNELS + NODES + ("decode_attention", "kv_append", "row_linear", "row_glu")))


def get(key: str, backend: str):
    """The kernel ``key`` (one of :data:`KERNEL_KEYS`) of ``backend`` in the spec's signature.
    Raises TypeError / ValueError for a key or backend that is no string or not a known one,
    BackendUnavailableError when the backend cannot run here or lacks the kernel."""
    if not isinstance(key, str):
        raise TypeError(f"forge.ops.get: key must be a kernel key string, one of {KERNEL_KEYS}; "
                        f"got {type(key).__name__}")
    if not isinstance(backend, str):
        raise TypeError(f"forge.ops.get: backend must be one of {BACKENDS}, got {type(backend).__name__}")
    if key not in KERNEL_KEYS:
        raise ValueError(f"forge.ops.get: unknown kernel key {key!r}; valid keys: {KERNEL_KEYS}")
    _entry(backend)  # an unknown backend: ValueError naming the valid ones
    require(backend)
    _ops_installed(backend)
    if key in NODES:
        fn = _node(key, backend)
    else:
        fn = _attr(importlib.import_module(_entry(backend).package), key)
    if fn is None:
        raise BackendUnavailableError(f"kernel {key!r} is not implemented by the {backend} backend")
    return fn


def _piece(backend: str, name: str):
    return _attr(importlib.import_module(_entry(backend).package), name)


@functools.cache
def _node(key: str, backend: str):
    from . import _nodes

    if key == "experts":
        pieces = _piece(backend, "experts_pieces")
        return None if pieces is None else _nodes.experts(backend, pieces(), _piece(backend, "check_devices"))
    if key == "gated_mlp":
        return _nodes.gated_mlp(backend, _piece(backend, "mlp_act"), _piece(backend, "check_devices"))
    prepare, compute = _piece(backend, "fused_linear_ce_prepare"), _piece(backend, "fused_linear_ce_compute")
    if prepare is None or compute is None:
        return None
    return _nodes.fused_linear_ce(backend, prepare, compute, _one_pass_scale(backend))


def _one_pass_scale(backend: str):
    """The fused loss's in-place scaling kernel for ``backend``: its own, else on a CUDA device
    Triton's (whichever backend made the gradient; triton ships with torch's CUDA builds)."""
    own = _piece(backend, "fused_linear_ce_scale")
    if own is not None:
        return own
    from .. import _runtime

    if backend != "triton" and _runtime.has_cuda() and availability("triton")[0]:
        return _piece("triton", "fused_linear_ce_scale")
    return None


def auto_order() -> tuple[str, ...]:
    """The order ``backend="auto"`` tries the backends in. With a CUDA device: triton first (its
    launches cost the least host time). Without one both run in interpreters, and Pallas' (one
    XLA-compiled program per kernel and shape) is several times faster than Triton's (Python per
    program instance): a 4 x 128 training step at hidden 128 took 0.9-2.3 s against 18 s."""
    from .. import _runtime

    return BACKENDS if _runtime.has_cuda() else tuple(reversed(BACKENDS))


def pick_auto() -> str:
    for b in auto_order():
        if availability(b)[0]:
            return b
    raise BackendUnavailableError("; ".join(availability(b)[1] for b in auto_order()))


def interpreted(backend: str) -> bool:
    """Whether ``backend`` runs its kernels in its interpreter (CPU) in this process."""
    return _entry(backend).interpreted()


def on_stream(backend: str) -> tuple[bool, str]:
    """(yes, reason): whether ``backend``'s kernels launch on torch's current stream in this
    process, so a torch CUDA graph captures them (Triton: always; Pallas: where its native
    launch runs, not through JAX and DLPack on JAX's own stream). The graph runtime
    (``forge.patching.graphs``, ``decode``) asks this instead of the backends themselves."""
    ok, why = availability(backend)
    if not ok:
        return False, why
    return _entry(backend).on_stream()


def fits(backend: str, device_types: frozenset, float64: bool) -> tuple[bool, str]:
    """(usable, reason) for running ``backend`` on a model whose parameters live on
    ``device_types`` (e.g. {"cpu"}) and, with ``float64``, include float64 ones: what would make
    the first call fail, said at patch time. Call after :func:`availability` says True."""
    if "meta" in device_types:
        return False, (f"{backend}: the model's parameters are on the meta device, where no kernel runs; "
                       "patch after the model is on its device (to_empty() and loading its weights)")
    return _entry(backend).fits(device_types, float64)
