"""What the op layer (``forge.ops``) takes from the Triton backend, and the one place the
functional API turns to it under torch.compile.

Each kernel is described by a :class:`KernelDef`: its forward and backward as plain functions
on torch tensors, which launch the Triton kernels through ``forge_triton._launch`` (so the op
layer can run them with the launches traced or skipped, see :data:`_launch.MODE`). Eager calls
never come here: they keep their direct path (``FastKernel`` launches inside the kernel modules'
autograd.Functions). Under ``torch.compiler.is_compiling()`` the functional wrappers call
:func:`call`, which hands the kernel to the op layer's hook (``torch.ops.forge.triton_<name>_fwd``
and ``_bwd``, registered by forge.ops.library when ``forge.ops.get`` first hands out a Triton
kernel).

This module imports forge._runtime only: the op layer installs itself here (:func:`install`),
never the other way round.
"""
from __future__ import annotations

from forge import _runtime

_compiling = _runtime.op_route()  # torch.compiler.is_compiling, or always with FORGE_THROUGH_OPS=1


class KernelDef:
    """A kernel as the op layer sees it.

    ``fwd(*tensors, **static) -> (outputs tuple, residuals tuple)``: fresh tensors only (none a
    view of an input or of another output). ``bwd(inputs, residuals, grads, needs, **static) ->
    {input name: grad}``: ``inputs`` are the forward's tensors (None where not in ``save``),
    ``grads`` one tensor per output (zeros where none flowed), ``needs`` {input name: bool}
    (gradients are bound by name, not by position); names missing from the result get None.
    ``names``: the tensor inputs' names, in order (None may be passed for optional ones).
    ``diff``: the names that can have a gradient. ``inductor``: on a GPU the op is a
    ``torch.library.triton_op`` (inductor sees and fuses the kernels), else an opaque custom op.
    """

    __slots__ = ("name", "fwd", "bwd", "names", "diff", "save", "n_out", "inductor")

    def __init__(self, name, fwd, bwd, *, names, diff, n_out, save=None, inductor=False):
        self.name, self.fwd, self.bwd = name, fwd, bwd
        self.names, self.diff = tuple(names), tuple(diff)
        self.save = None if save is None else tuple(save)
        self.n_out, self.inductor = n_out, inductor

    def __repr__(self):
        return f"KernelDef({self.name!r})"


_TRACED = None  # the op layer's entry: (kdef, tensors, static dict) -> outputs tuple


def install(traced) -> None:
    """Called by forge.ops.library when it registers this backend's ops."""
    global _TRACED
    _TRACED = traced


def call(kdef: KernelDef, *tensors, **static) -> tuple:
    """The kernel's outputs (a tuple) under torch.compile (or torch.jit.trace): through the op
    layer's registered op, differentiable by its registered autograd."""
    if _TRACED is None:
        raise RuntimeError(f"triton kernel {kdef.name!r} under torch.compile or torch.jit.trace: its ops are not "
                           "registered; take the kernel from forge.ops.get(key, 'triton') (or forge.patch the model)")
    return _TRACED(kdef, tensors, static)


REGISTRY: dict[str, KernelDef] = {}


def register(kdef: KernelDef) -> KernelDef:
    REGISTRY[kdef.name] = kdef
    return kdef


# ------------------------------------------------------------------------------------------
# the adaptor forge.ops.library reads (every backend offers these functions)
def kernels() -> list:
    """Every KernelDef of this backend (imports the kernel modules)."""
    import importlib

    for mod in ("rmsnorm", "glu", "rope", "lora"):
        importlib.import_module(f"{__package__}.{mod}")
    return list(REGISTRY.values())


def op_name(kdef) -> str:
    return kdef.name


def input_names(kdef, n: int) -> tuple:
    return kdef.names


def diff_names(kdef, n: int) -> tuple:
    return kdef.diff


def saved_present(kdef, present) -> tuple:
    """Per input, whether the op's autograd saves it (given, and named in ``save``)."""
    return tuple(p and (kdef.save is None or name in kdef.save) for name, p in zip(kdef.names, present))


def has_bwd(kdef) -> bool:
    return kdef.bwd is not None


def inductor(kdef) -> bool:
    """A triton_op (inductor sees its launches): compiled kernels only (wrap_triton cannot
    trace an interpreted one)."""
    from forge import _runtime

    return kdef.inductor and not _runtime.triton_interpreted()


def wrapped(body):
    """``body`` with this thread's launches going through torch.library.wrap_triton."""
    import functools

    from . import _launch

    @functools.wraps(body)
    def run(*args):
        with _launch.mode("wrap"):
            return body(*args)

    return run


def run_fwd(kdef, tensors, static):
    return kdef.fwd(*tensors, **static)


def fake_fwd(kdef, tensors, static):
    from . import _launch

    with _launch.mode("skip"):  # the body on fake tensors: its allocations, no launch
        return kdef.fwd(*tensors, **static)


def run_bwd(kdef, inputs, res, grads, needs, static, dtypes):
    return kdef.bwd(inputs, res, grads, needs, **static)


def fake_bwd(kdef, inputs, res, grads, needs, static, dtypes):
    from . import _launch

    with _launch.mode("skip"):
        return kdef.bwd(inputs, res, grads, needs, **static)
