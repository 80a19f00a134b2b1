"""The patching layer: forge kernels swapped into live Hugging Face models, per instance.

``core`` holds patch/unpatch and the generic walker; ``forwards`` the closure factory (the
forwards forge installs); ``patcher`` the Patcher a patch pass records into (and hands to
``lora.apply``); ``arch`` the architecture table (data); ``guard`` the guard's statistics;
``report`` forge.report and the "forge" logger's messages; ``copying`` how a patched model is
deep-copied and pickled (the copy comes back patched, on its own statistics); ``graphs`` the
CUDA graphs around the decoder layers; ``decode`` and ``decode_runtime`` captured decoding for
generate() (when and which cache; the capture and replay); ``lora`` the peft LoRA kernels' forwards;
``qkv`` the q/k/v projections as one product of torch's (no kernel; its slots hand k and v on,
for ``lora`` too).

Layer: the top one. It may import everything below (``forge.ops``, which hands out the kernels
in their spec signatures and says whether a backend launches on torch's stream, ``forge.spec``,
``forge.errors``, ``forge._runtime``, ``forge.defaults``) but reaches a backend only through
``forge.ops``: no module here imports ``forge_triton``, ``forge_pallas`` or ``bridge``. Nothing
below imports it (``tests/test_layers.py``).
"""
from .core import guard_stats, patch, unpatch
from .guard import GuardStats
from .patcher import Patcher

__all__ = ["GuardStats", "Patcher", "guard_stats", "patch", "unpatch"]
