"""Named shapes shared by the tests and the benchmarks.

``CPU`` shapes are tiny (the interpreters run them in CI); ``GPU`` shapes are the real ones
(Qwen2.5-0.5B: hidden 896, intermediate 4864, 14 heads, 2 KV heads, head_dim 64).
"""
from __future__ import annotations

# rows x width
RMSNORM_CPU = {"tiny": (1, 8), "odd": (5, 1000), "qwen_row": (3, 896), "blocky": (67, 64), "empty": (0, 32)}
RMSNORM_GPU = {
    "qwen05b_hidden": (4096, 896),
    "qwen05b_heads": (4096 * 14, 64),
    "large": (32768, 4096),
    "llama8b_hidden": (4096, 4096),  # a train 4x1024 step's norms at the Llama-3-8B shape
    "odd": (4097, 1000),
}
# rows x width of gate / up
GLU_CPU = {"tiny": (1, 8), "odd": (7, 1000), "qwen_row": (2, 896), "empty": (0, 16)}
GLU_GPU = {"qwen05b": (4096, 4864), "large": (16384, 4864), "llama8b": (4096, 14336), "odd": (4097, 1000)}
# (batch, q heads, kv heads, seq, head_dim)
ROPE_CPU = {"tiny": (1, 2, 1, 3, 8), "gqa": (2, 4, 2, 5, 16), "odd": (1, 3, 3, 7, 10), "empty": (1, 2, 1, 0, 8)}
ROPE_GPU = {"qwen05b": (4, 14, 2, 1024, 64), "large": (8, 32, 8, 2048, 128), "llama8b": (4, 32, 8, 1024, 128),
            "odd": (3, 7, 1, 1000, 64)}
# gated MLP (train mode): rows x hidden x intermediate
MLP_CPU = {"tiny": (1, 8, 16), "odd": (7, 24, 40), "qwen_row": (3, 896, 64)}
MLP_GPU = {"qwen05b": (4096, 896, 4864), "one_row": (1, 896, 4864), "odd": (4097, 1000, 2000)}
