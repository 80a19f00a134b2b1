"""The patching layer: forge kernels swapped into live Hugging Face models, per instance.

``core`` holds patch/unpatch and the generic walker; ``forwards`` the closure factory (the
forwards forge installs); ``patcher`` the Patcher a patch pass records into (and hands to
``lora.apply``); ``arch`` the architecture table (data); ``guard`` the guard's statistics;
``report`` forge.report and the "forge" logger's messages; ``copying`` how a patched model is
deep-copied and pickled (the copy comes back patched, on its own statistics).
"""
from .core import guard_stats, patch, unpatch
from .guard import GuardStats
from .patcher import Patcher

__all__ = ["GuardStats", "Patcher", "guard_stats", "patch", "unpatch"]
