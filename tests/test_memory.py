"""Nothing is kept: build, patch, train, infer, unpatch, delete and collect a model, and the GPU
memory forge and the Pallas bridge hold (torch's allocations, graph pools and cuBLAS workspaces
included, plus JAX's live arrays) returns to where it was. GPU only: on the CPU neither CUDA
graphs nor JAX device buffers exist."""
from __future__ import annotations

from forge import _runtime

_runtime.ensure_triton_mode()

import gc  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import forge  # noqa: E402
from forge.__main__ import build_model  # noqa: E402


def _held() -> int:
    """torch's allocated bytes plus the bytes of JAX's live arrays (torch cannot see those)."""
    n = torch.cuda.memory_allocated()
    try:
        import jax

        n += sum(a.nbytes for a in jax.live_arrays())
    except ImportError:
        pass
    return n


def _cycle(backend, graphs, model_type="qwen2"):
    model = build_model(model_type, "gpu_demo", dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa",
                        num_hidden_layers=4)
    forge.patch(model, backend=backend, min_elements=0, graphs=graphs, recompute_mlp=graphs)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 256), generator=g).cuda()
    model.train()
    for _ in range(3):  # the third call replays when graphs=True
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            model(ids)
    forge.unpatch(model)
    del model
    gc.collect()
    torch.cuda.synchronize()


def _assert_cycles_free(backend, graphs, model_type="qwen2"):
    _cycle(backend, graphs, model_type)  # first use: compiles, cuBLAS handles and workspaces, the capture stream
    base = _held()
    for _ in range(2):
        _cycle(backend, graphs, model_type)
    grown = _held() - base
    assert grown < 4 * 2**20, f"{grown / 2**20:.1f} MiB more held after two more cycles"


@pytest.mark.gpu
@pytest.mark.parametrize("backend,graphs", [("pallas", False), ("triton", True), ("pallas", True)])
def test_patch_train_infer_unpatch_delete_frees_everything(backend, graphs):
    _assert_cycles_free(backend, graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "pallas"])
def test_moe_cycle_frees_everything(backend):
    # a mixture of experts (qwen3_moe, its experts patched): the expert block's node keeps its
    # routing and activations only until its backward
    _assert_cycles_free(backend, False, "qwen3_moe")
