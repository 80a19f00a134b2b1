"""The DLPack transport between torch and JAX: torch tensors handed to JAX as arrays (zero copy)
and JAX arrays handed back to torch, with the bridge's dtype decisions. The path every bridged
call takes where the native launch (``bridge.native``) does not serve it.

Inputs are exported as detached views (torch refuses to export a tensor that requires grad),
made contiguous if they are not (DLPack import needs compact strides), copied if they do not
start :data:`ALIGN`-byte aligned (JAX's GPU runtime would not copy them; see :func:`to_jax`) and
imported with ``jax.dlpack.from_dlpack`` semantics: zero copy, and JAX's stream waits for what
torch queued on its current stream. Outputs come back with ``torch.from_dlpack``, which makes
torch's current stream wait for JAX's. Memory and stream safety across the two allocators rest
on two rules every kernel keeps:
(1) each launch imports its torch tensors afresh (nothing is cached), so JAX's stream is
ordered after everything torch queued before the call, including reads of JAX-owned outputs
that torch has since freed (JAX may reuse that memory at once); (2) every output and residual
goes through ``torch.from_dlpack`` before the call returns, so torch's stream is ordered after
the JAX computation, which may still be reading torch memory that the caller frees next.

Dtypes (both paths, :func:`prepare`): int64 inputs are narrowed to int32 in torch when JAX runs
without x64 (JAX would otherwise copy them silently; indices and labels fit in int32); float64
inputs without x64 raise TypeError (JAX would silently compute in float32).
"""
from __future__ import annotations

import functools

import torch

from . import runtime


@functools.cache
def _device_info(dl_type: int, dev_id: int):
    """(jax device, stream for external ready events) for a DLPack device; fixed per process."""
    jax = runtime.jax_module()
    from jax._src import xla_bridge

    platform = "cpu" if dl_type == 1 else "cuda"
    dev = xla_bridge.get_backend(platform).device_from_local_hardware_id(dev_id)
    stream = None
    if dl_type != 1:
        try:
            stream = dev.get_stream_for_external_ready_events()
        except jax.errors.JaxRuntimeError:  # not implemented on this platform
            stream = None
    return dev, stream


def import_public(t):
    """``t`` as a JAX array through ``jax.dlpack.from_dlpack`` (on ``t``'s own CUDA device)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        with torch.cuda.device(t.device):  # torch exports only from the current device
            return runtime.jax_module().dlpack.from_dlpack(t)
    return runtime.jax_module().dlpack.from_dlpack(t)


def import_fast(t):
    """``t`` as a JAX array through the C++ entry point ``jax.dlpack.from_dlpack`` ends in, minus
    its per-call Python (platform lookup, stream query, dtype canonicalisation, placement), with
    the per-device facts cached; :func:`import_public` where this JAX lacks that entry point or
    the device is neither a CPU nor a CUDA one. :func:`to_jax` uses it once a first call has
    checked it against the public path."""
    if _jaxlib is None:
        return import_public(t)
    dl_type, dev_id = t.__dlpack_device__()
    if dl_type != 1 and dl_type != 2:  # pinned host, ROCm, ...: let jax handle it
        return import_public(t)
    dev, stream = _device_info(int(dl_type), dev_id)
    if dl_type == 2 and dev_id != torch.cuda.current_device():
        with torch.cuda.device(dev_id):  # torch exports only from the current device
            cap = t.__dlpack__(stream=stream)
    else:
        cap = t.__dlpack__(stream=stream)
    if _FAST_NEW_SIG:
        return _jaxlib.dlpack_managed_tensor_to_buffer(cap, dev, stream, None, int(dl_type))
    return _jaxlib.dlpack_managed_tensor_to_buffer(cap, dev, stream, None)


try:  # private, checked against the public path on first use; falls back if anything differs
    from jax._src.lib import _jax as _jaxlib
    from jax._src.lib import jaxlib_extension_version as _ext

    _FAST_NEW_SIG = _ext >= 467
    _import = import_fast
except Exception:  # noqa: BLE001  (jax missing or moved: the public path still works)
    _jaxlib = None
    _import = import_public
_import_checked = False


def _check_fast_path(t):
    global _import, _import_checked
    _import_checked = True
    if _import is import_public:
        return
    try:
        a = import_fast(t)
        ok = a.shape == tuple(t.shape) and str(a.dtype) == str(t.dtype).removeprefix("torch.")
        if t.data_ptr() % 256 == 0:  # (a misaligned buffer is legitimately copied by JAX)
            ok = ok and a.unsafe_buffer_pointer() == t.data_ptr()
    except Exception:  # noqa: BLE001
        ok = False
    if not ok:
        _import = import_public


def prepare(t: torch.Tensor, pos: int, kname: str, detach: bool = True, compact: bool = True):
    """``t`` as the bridge hands it to a kernel: detached, compact (unless ``compact=False``),
    int64 narrowed to int32 where JAX runs without x64; float64 without x64 raises TypeError
    naming the kernel ``kname`` and the input's position ``pos``."""
    if detach and t.requires_grad:
        t = t.detach()
    if compact and not t.is_contiguous():
        t = t.contiguous()
    dt = t.dtype
    if dt == torch.int64 or dt == torch.float64:
        if not runtime.x64_enabled():
            if dt == torch.int64:
                t = t.to(torch.int32)
            else:
                raise TypeError(f"{kname}: input {pos} is float64 but JAX runs without x64; "
                                "enable jax_enable_x64 or pass float32")
    return t


_WIDE = (torch.int64, torch.float64)


def prepare_all(tensors: tuple, kname: str, detach: bool = True) -> tuple:
    """The dtype decisions of :func:`prepare` (and the detach, unless ``detach=False``: inside
    an autograd.Function autograd records nothing anyway) for a call that tries a native plan
    first; ``tensors`` itself when none needs a change, checked without a call per tensor.
    Strides are left as they are: a plan hands each kernel a compact tensor itself
    (``bridge.native.launch.ready``), and the DLPack path prepares what it exports
    (:func:`to_jax`)."""
    for t in tensors:
        if (detach and t.requires_grad) or t.dtype in _WIDE:
            return tuple([prepare(t, i, kname, detach, compact=False) for i, t in enumerate(tensors)])
    return tensors


# Every buffer the bridge hands JAX starts at a multiple of this many bytes. JAX's GPU runtime
# imports a DLPack tensor as a view wherever it points: only its CPU runtime copies a misaligned
# one (jaxlib's dlpack import falls back to a copy for kDLCPU alone). XLA's GPU executable then
# refuses an entry parameter that is not 16-byte aligned ("Address of buffer N must be a
# multiple of ...", seen on the H200 for a weight 4 bytes into its storage), and the Pallas
# kernels' lowering declares every pointer 32-byte aligned (tt.divisibility = 32), as the
# native path's launches do (bridge.native.launch.ready). The copy is made afresh on every call,
# like every import, so an in-place update of the tensor (an optimizer step) reaches the next call.
ALIGN = 32


def to_jax(t: torch.Tensor, pos: int = 0, kname: str = "bridge"):
    """A JAX view of ``t`` (after the dtype decisions of :func:`prepare`): zero copy, except for
    a tensor not :data:`ALIGN`-byte aligned, which JAX gets a fresh copy of."""
    t = prepare(t, pos, kname)
    if t.data_ptr() % ALIGN:
        t = t.clone()
    if not _import_checked:
        _check_fast_path(t)
    return _import(t)


def to_torch(a) -> torch.Tensor:
    return torch.from_dlpack(a)


def inputs_to_jax(kdef, tensors):
    """Every input of a call of ``kdef`` as a JAX array (:func:`to_jax`)."""
    # Every input is imported afresh on every call, weights too. A cache of weight views would
    # save ~0.1 ms per weight and call, but (a) a tensor that cannot be aliased (an address not
    # ALIGN-byte aligned, copied by to_jax; on the CPU JAX itself copies one not 64-byte
    # aligned) is imported as a copy, so a cached copy misses every later in-place update (an
    # optimizer step), and (b) a cached view pins its tensor's storage: torch keeps a tensor's
    # Python object alive while the DLPack capsule holds it, so no weak reference ever tells
    # the cache that the model is gone. The native path (bridge.native) imports nothing.
    return tuple(to_jax(t, i, kdef.name) for i, t in enumerate(tensors))
