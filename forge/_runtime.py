"""Where the kernels run: compiled on a CUDA GPU, or in their interpreters on a CPU.

forge decides this once per process. Triton reads ``TRITON_INTERPRET`` when a kernel is
decorated, so :func:`ensure_triton_mode` must run before any ``forge_triton`` kernel module is
imported; ``forge_triton/__init__.py`` calls it first thing.
"""
from __future__ import annotations

import functools
import os
import sys


@functools.cache
def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def ensure_triton_mode() -> None:
    """Turn on Triton's interpreter when there is no CUDA device (unless the user chose)."""
    if "TRITON_INTERPRET" not in os.environ and not has_cuda():
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton.language" in sys.modules:
            _reinterpret_triton_language()


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
