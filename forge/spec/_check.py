"""Argument checks shared by the spec modules: clear errors naming the argument."""
from __future__ import annotations

import functools

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(name: str, t, *, min_dim: int = 1) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(t.shape)}")


def no_empty_dims(name: str, t, what: str = "a weight") -> None:
    """Every dimension of ``t`` at least 1: the kernels tile over these sizes, and a zero one (an
    adapter of rank 0, a vocabulary or expert width of 0) has no meaning as ``what``."""
    if 0 in t.shape:
        raise ValueError(f"{name} has a dimension of size 0 (shape {tuple(t.shape)}); {what} needs every "
                         "dimension at least 1")


def same_device(**named) -> None:
    items = [(k, v) for k, v in named.items() if v is not None]
    dev = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev:
            raise ValueError(f"{k} is on {v.device} but {items[0][0]} is on {dev}")


def same_shape(a_name: str, a, b_name: str, b) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{a_name} has shape {tuple(a.shape)} but {b_name} has shape {tuple(b.shape)}")


def same_dtype(a_name: str, a, b_name: str, b) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{a_name} is {a.dtype} but {b_name} is {b.dtype}")


class BoundedCache(dict):
    """A dict of at most ``maxsize`` entries (launch configurations per shape): when full, the
    oldest entry goes, so a process that sees ever new shapes does not grow it without bound."""

    __slots__ = ("maxsize",)

    def __init__(self, maxsize: int = 1024):
        super().__init__()
        self.maxsize = maxsize

    def __setitem__(self, key, value):
        if len(self) >= self.maxsize and key not in self:
            del self[next(iter(self))]
        super().__setitem__(key, value)


class Validated(BoundedCache):
    """A bounded set of argument signatures the spec's checks already accepted."""

    __slots__ = ()

    def add(self, key) -> None:
        self[key] = None


def no_double_backward(name: str):
    """Decorate an autograd backward of forge's kernel ``name``: a backward run with
    ``create_graph=True`` (autograd then runs it in grad mode) raises at once, naming the kernel.

    forge's backward passes launch kernels autograd cannot see through, so their gradients would
    carry no graph: torch's ``once_differentiable`` raises only where an incoming gradient
    requires grad, and otherwise hands back gradients that a second backward silently treats as
    constants (a wrong second derivative, no error). Refusing every ``create_graph`` backward is
    the one rule that never gives a wrong value."""
    def deco(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if torch.is_grad_enabled():
                refuse_double_backward(name)
            return backward(ctx, *grads)
        return wrapper
    return deco


def refuse_double_backward(name: str):
    """Raise the error of :func:`no_double_backward` (for a backward whose kernel name is known
    only at call time)."""
    raise RuntimeError(
        f"forge's {name} kernel has no double backward: a backward with create_graph=True (second-order "
        "gradients, gradient penalties) cannot run through it. Run that model unpatched (forge.unpatch), "
        "or patch it without that kernel (forge.patch(kernels=...))")
