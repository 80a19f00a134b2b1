"""JAX runtime setup for the bridge: memory, device, interpret mode, availability.

Memory: JAX preallocates 75% of GPU memory when its GPU backend starts, which would starve
PyTorch in the same process. Importing ``bridge`` sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
unless the user already set it, so JAX grows its pool on demand. This only takes effect if JAX
has not initialised its backend yet: import ``bridge`` (or ``forge``'s pallas backend) before any
JAX computation, or export the variable yourself. Other JAX memory variables
(``XLA_PYTHON_CLIENT_MEM_FRACTION``, ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``) are left to the
user. Note torch's memory statistics do not see JAX's allocations (outputs of bridged kernels
live in JAX's pool and are handed to torch zero-copy).

XLA's command buffers are turned off (``--xla_gpu_enable_command_buffer=``, see below) unless
``XLA_FLAGS`` names that flag.

Interpret mode: with no GPU in JAX, the Pallas kernels run with ``interpret=True`` (on CPU
tensors); ``FORGE_PALLAS_INTERPRET=1`` forces it (debugging on a GPU machine).
"""
from __future__ import annotations

import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# XLA runs parts of an executable as CUDA graphs ("command buffers") and patches each graph's
# memcpy nodes with the buffers of the current call. The bridge's executables get torch's
# buffers, at a new address every call; one such patch failed on the H200 (the fused loss, after
# calls at other shapes in the same process: "Failed to set memcpy D2D node params:
# CUDA_ERROR_INVALID_VALUE"). Command buffers buy nothing for one executable per kernel call,
# so they are off unless the user's XLA_FLAGS says otherwise.
if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()


@functools.cache
def jax_module():
    """Import jax (lazily: ``import bridge`` must not fail when jax is missing) and start its
    backends here, keeping torch's current CUDA device: starting JAX's GPU backend initialises
    every visible GPU and leaves the last one current, so with two GPUs a later
    ``tensor.cuda()`` in the user's code would land on cuda:1."""
    import jax

    import torch

    dev = torch.cuda.current_device() if torch.cuda.is_available() else None
    try:
        jax.devices()
    except RuntimeError:
        pass
    finally:
        if dev is not None and torch.cuda.current_device() != dev:
            torch.cuda.set_device(dev)
    return jax


@functools.cache
def jax_has_gpu() -> bool:
    jax = jax_module()
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:  # no GPU backend in this jax build
        return False


def interpret() -> bool:
    """Whether Pallas kernels run in the interpreter (forge_pallas decides, once per process)."""
    from forge_pallas import _common

    return _common.interpret()


@functools.cache
def availability() -> tuple[bool, str]:
    """(usable, reason) for the pallas backend: jax importable, and on a GPU when torch is."""
    try:
        jax_module()
        import jax.experimental.pallas  # noqa: F401
        import jax.experimental.pallas.triton  # noqa: F401
    except ImportError as e:
        return False, f"pallas backend unavailable: jax (with pallas) is not importable ({e}); pip install 'jax[cuda13]'"
    import torch

    if torch.cuda.is_available() and not jax_has_gpu():
        return False, (
            "pallas backend unavailable: torch sees a CUDA GPU but jax has no GPU backend "
            f"(jax {jax_module().__version__}, devices {jax_module().devices()}); install a CUDA build "
            "of jax (pip install 'jax[cuda13]') or use backend='triton'"
        )
    return True, ""


def require() -> None:
    ok, why = availability()
    if not ok:
        from forge.errors import BackendUnavailableError

        raise BackendUnavailableError(why)


def fits(device_types, float64: bool) -> tuple[bool, str]:
    """(usable, reason) for Pallas kernels on a model whose parameters live on ``device_types``
    and, with ``float64``, include float64 ones (JAX would compute those in float32 without x64)."""
    want = "cpu" if interpret() else "cuda"
    other = sorted(set(device_types) - {want})
    if other:
        where = "interpreted on the CPU" if want == "cpu" else "compiled for the GPU"
        return False, f"pallas: the model is on {', '.join(other)}, but the Pallas kernels run {where} in this process"
    if float64 and not x64_enabled():
        return False, ("pallas: the model has float64 parameters but JAX runs without x64 (it would compute in "
                       "float32); call jax.config.update('jax_enable_x64', True) before patching")
    return True, ""


def x64_enabled() -> bool:
    return bool(jax_module().config.read("jax_enable_x64"))
