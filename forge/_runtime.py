"""Where the kernels run: compiled on a CUDA GPU, or in their interpreters on a CPU.

forge decides this once per process. Triton reads ``TRITON_INTERPRET`` when a kernel is
decorated, so :func:`ensure_triton_mode` must run before any ``forge_triton`` kernel module is
imported; ``forge_triton/__init__.py`` calls it first thing.

Threads: Triton's interpreter keeps the program being run in process-wide state (the grid
index, the patched ``triton.language`` functions), so two threads launching interpreted kernels
at once corrupt each other. In interpreter mode every interpreted launch, forge's or anyone's,
takes one process-wide lock (:func:`serialise_interpreter`); compiled launches on a GPU never see
it.
"""
from __future__ import annotations

import functools
import os
import sys
import threading


@functools.cache
def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# FORGE_THROUGH_OPS=1 (read once, at import): every kernel call takes the path torch.compile
# traces (the torch.ops.forge op with its registered autograd) in eager mode too, so the parity
# suite can run the op layer itself (see tests/test_compile.py and docs/design.md).
THROUGH_OPS = os.environ.get("FORGE_THROUGH_OPS", "0") == "1"


@functools.cache
def _smem(index: int) -> int:
    import torch

    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)


def shared_memory(device=None) -> int:
    """Bytes of shared memory one program may use on ``device`` (a torch.device; default: the
    current CUDA device); for the interpreters (no GPU, or a CPU device) an H100's 227 KB."""
    if not has_cuda() or (device is not None and device.type != "cuda"):
        return 227 * 1024
    import torch

    index = None if device is None else device.index
    return _smem(torch.cuda.current_device() if index is None else index)


def pipeline_fit(block: int, stage_bytes, limit: int, smallest: int = 16) -> tuple:
    """(block, stages) for a kernel loop that keeps ``stage_bytes(block)`` of tiles in shared
    memory per pipeline stage: the most stages up to Triton's default 3 within 7/8 of ``limit``
    (the rest for the compiler's own scratch), halving ``block`` down to ``smallest`` when even
    one stage does not fit (then one stage, whatever it needs)."""
    limit = limit * 7 // 8
    while True:
        for stages in (3, 2, 1):
            if stages * stage_bytes(block) <= limit:
                return block, stages
        if block <= smallest:
            return block, 1
        block //= 2


def _always() -> bool:
    return True


def op_route():
    """The function the backends ask whether a kernel call goes through the op layer: while
    torch.compile traces, while ``torch.jit.trace`` records (the direct paths launch kernels the
    tracer cannot see: a trace would keep their outputs as constants, or the kernels would read
    traced sizes); or, with ``FORGE_THROUGH_OPS=1``, always."""
    if THROUGH_OPS:
        return _always
    import torch

    compiling, tracing = torch.compiler.is_compiling, torch._C._get_tracing_state

    def route() -> bool:
        return compiling() or tracing() is not None

    return route


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def ensure_triton_mode() -> None:
    """Turn on Triton's interpreter when there is no CUDA device (unless the user chose)."""
    if "TRITON_INTERPRET" not in os.environ and not has_cuda():
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton.language" in sys.modules:
            _reinterpret_triton_language()
    if triton_interpreted():
        serialise_interpreter()


def triton_fits(device_types) -> tuple[bool, str]:
    """(usable, reason) for Triton kernels on tensors of these device types in this process:
    compiled kernels take CUDA tensors, the interpreter CPU ones."""
    if triton_interpreted():
        other = sorted(set(device_types) - {"cpu"})
        if other:
            return False, (f"triton: the model is on {', '.join(other)}, but Triton runs in its interpreter in "
                           "this process (TRITON_INTERPRET=1), which takes CPU tensors only")
        return True, ""
    if not has_cuda():
        return False, ("triton: TRITON_INTERPRET=0 and there is no CUDA device: compiled Triton kernels need "
                       "one; set TRITON_INTERPRET=1 (or leave it unset: forge then turns the interpreter on) "
                       "before importing forge")
    other = sorted(set(device_types) - {"cuda"})
    if other:
        return False, (f"triton: the model is on {', '.join(other)}, but Triton compiles for CUDA in this process; "
                       "move the model to the GPU before patching")
    return True, ""


INTERPRETER_LOCK = threading.RLock()


def serialise_interpreter() -> None:
    """Make every interpreted Triton launch take :data:`INTERPRETER_LOCK` (once per process).
    Only ``InterpretedFunction.run`` is wrapped: the class compiled kernels use is untouched."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    if getattr(run, "_forge_serialised", False):
        return

    @functools.wraps(run)
    def locked_run(self, *args, **kwargs):
        with INTERPRETER_LOCK:
            return run(self, *args, **kwargs)

    locked_run._forge_serialised = True
    InterpretedFunction.run = locked_run


def _reinterpret_triton_language() -> None:
    """Triton was imported before the switch (torch 2.13 imports it lazily for some CPU ops, so
    a model that ran before ``import forge_triton`` does it): its library functions (tl.sum,
    tl.max, ...) were decorated as compiled JITFunctions, which the interpreter refuses to call.
    Re-wrap them as interpreted functions, in every triton.language module that holds them."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    done: dict[int, InterpretedFunction] = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("triton.language"):
            continue
        for attr, val in list(vars(mod).items()):
            if isinstance(val, JITFunction):
                new = done.get(id(val))
                if new is None:
                    new = done[id(val)] = InterpretedFunction(val.fn)
                setattr(mod, attr, new)
