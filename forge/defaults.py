"""The guard's default thresholds, re-exported as ``forge.MIN_FUSED_ELEMENTS`` and ``forge.NEVER``
(users read and change them there: ``forge.patch`` reads ``forge.MIN_FUSED_ELEMENTS`` at patch
time). Imports nothing, so every layer may read it.
"""
from __future__ import annotations

# Per-call guard defaults: the activation elements (rows x width) from which a shape-sensitive
# call (rmsnorm, swiglu, geglu, rope) is fused; smaller calls run the original forward. Per
# backend: an int, a dict kernel key -> int, or a dict mode ("infer"/"train") -> either. Read at
# patch time; ``forge.patch(min_elements=...)`` overrides it (0 = always fuse).
#
# Calibrated on one H200 host with bench/bench_guard.py (streams of calls, eager and fused timed
# alternately): the smallest size from which the fused call was at least as fast as eager at
# every larger size of the sweep, or NEVER where it was not (there the host cost of a call
# exceeds what the kernel saves on the device up to the largest size swept). The GLU keys in
# training run the whole MLP as one node (forge.spec.gated_mlp), swept as such.
# bench/results/bench_guard-gated_mlp-rmsnorm-rope-swiglu-h200.*: rmsnorm and rope pay from the
# smallest call on both backends; the GLU from 4096 x 4864 (pallas in inference; triton's
# crossover there is lower, its default kept from the earlier sweep) and the gated MLP in
# training from 8192 x 4864 on both.
# "pallas" holds for Pallas kernels launched natively on torch's stream (bridge/native/);
# "pallas-dlpack" where that path is unavailable (CPU interpret mode, or a JAX whose internals
# changed) and every call goes through DLPack and JAX's runtime at 0.3-0.7 ms of host time:
# there the shape-sensitive kernels never paid up to the largest size swept.
# Below its crossover the gated MLP still saves one rows x 4864 activation per layer (train
# 4x1024: 30% of eager's peak memory instead of 42%) for ~0.1 ms of host time per layer call:
# ``min_elements={"swiglu": 0}`` takes that trade.
NEVER = 1 << 62
MIN_FUSED_ELEMENTS: dict = {
    "triton": {
        "infer": {"rmsnorm": 0, "rope": 0, "swiglu": 4096 * 4864, "geglu": 4096 * 4864},
        "train": {"rmsnorm": 0, "rope": 0, "swiglu": 8192 * 4864, "geglu": 8192 * 4864},
    },
    "pallas": {
        "infer": {"rmsnorm": 0, "rope": 0, "swiglu": 4096 * 4864, "geglu": 4096 * 4864},
        "train": {"rmsnorm": 0, "rope": 0, "swiglu": 8192 * 4864, "geglu": 8192 * 4864},
    },
    "pallas-dlpack": {
        "infer": NEVER,
        "train": {"rmsnorm": NEVER, "rope": NEVER, "swiglu": 16384 * 4864, "geglu": 16384 * 4864},
    },
}
