"""The native launch's cache on disk (``FORGE_CACHE_DIR``, default ``~/.cache/forge``, folder
``pallas-native``): the TTIR of each lowered ``pallas_call`` and each plan's recipe (its steps as
plain data, from which every plan is built), keyed by the JAX, jaxlib and Triton versions, a
stamp of forge_pallas' and this package's code, the kernel, its static arguments and shapes, so
a second process neither traces nor lowers again. Files are written atomically; a folder that
cannot be written only costs the next process the work again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import time

import torch

from .. import _jax_internals as JI
from . import prims, state


def cache_dir() -> str:
    return os.environ.get("FORGE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "forge")


@functools.cache
def versions() -> tuple:
    import jax
    import jaxlib

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "none"
    return (jax.__version__, jaxlib.__version__, tv)


def lowered(key: str, eqn_of):
    """The TTIR of a ``pallas_call``, from the disk cache or lowered now (and stored); ``eqn_of()``
    gives its equation (a trace, when the plan came from a recipe on disk)."""
    path = os.path.join(cache_dir(), "pallas-native", key + ".json")
    try:
        with open(path) as f:
            d = json.load(f)
        return JI.Lowered(d["ttir"], tuple(d["grid"]), d["num_warps"], d["num_stages"])
    except (OSError, ValueError, KeyError):
        pass
    eqn = eqn_of()
    t0 = time.perf_counter()
    low = JI.lower_pallas_call(eqn)
    state.TIMES["lower"] += time.perf_counter() - t0
    write_json(path, {"ttir": low.ttir, "grid": low.grid, "num_warps": low.num_warps,
                       "num_stages": low.num_stages})
    return low


def write_json(path, data) -> None:
    """Write ``data`` to ``path`` atomically; a read-only cache folder only costs the next
    process the work again."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as e:
        state.log.debug("forge: cannot write the native-launch cache %s: %s", path, e)


# A recipe on disk lets a later process build the plan without tracing (the trace was most of a
# warm first call's plan build). Kept only when it is all plain data: small constants, scalar
# literals, an output tree of tuples.
_CONST_MAX = 1024


def recipe_json(rec):
    """``rec`` as JSON data, or None where it holds something a file would not give back."""
    consts = {}
    for i, c in rec["consts"].items():
        if c.numel() > _CONST_MAX:
            return None
        consts[str(i)] = [str(c.dtype).removeprefix("torch."), list(c.shape), c.flatten().tolist()]

    def plain_tree(t):
        return t is None or type(t) is int or (type(t) is tuple and all(plain_tree(x) for x in t))

    if not plain_tree(rec["out"]) or not all(v is None or type(v) in (bool, int, float) for v in rec["template"]):
        return None
    return {**rec, "consts": consts}


def recipe_from_json(d):
    d["consts"] = {int(i): torch.tensor(v, dtype=prims.torch_dtype(dt)).reshape(shape) for i, (dt, shape, v) in d["consts"].items()}
    return d


def recipe_path(key_prefix) -> str:
    key = hashlib.sha256(repr((versions(), code_stamp(), key_prefix)).encode()).hexdigest()[:32]
    return os.path.join(cache_dir(), "pallas-native", f"plan-{key}.json")


@functools.cache
def code_stamp() -> str:
    """A hash of the code that decides what a cached recipe or TTIR holds: forge_pallas' kernels,
    this package and its JAX internals. A new forge (or an edited kernel) lowers again."""
    import forge_pallas

    here = os.path.dirname(os.path.abspath(__file__))

    def sources(folder):
        return [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]

    h = hashlib.sha256()
    files = sources(os.path.dirname(os.path.abspath(forge_pallas.__file__))) + sources(here)
    for f in files + [os.path.join(os.path.dirname(here), "_jax_internals.py")]:
        with open(f, "rb") as fh:
            h.update(os.path.basename(f).encode() + b"\0" + fh.read())
    return h.hexdigest()[:16]


def ttir_file(digest: str, ttir: str) -> str:
    """The TTIR file Triton compiles, named by its hash (``digest``): written once, shared by
    every process (Triton's own cache entry is keyed by the same text)."""
    path = os.path.join(cache_dir(), "pallas-native", f"ttir-{digest[:32]}.ttir")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(ttir)
        os.replace(tmp, path)
    return path
