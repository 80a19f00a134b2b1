import os

# Every forge_triton allocation is filled with NaN first, so an element a kernel forgot to write
# shows up as a non-finite error. Set before forge_triton is imported.
os.environ.setdefault("FORGE_POISON", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if not os.environ.get("CUDA_VISIBLE_DEVICES", "x") or not os.path.exists("/dev/nvidia0"):
    # CPU: XLA compiles every interpreted Pallas kernel (~1 s each); its cheapest optimisation
    # level halves the suite's time and the tiny test shapes do not care.
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    # Without a GPU the suite is CPU-bound interpreter work: where pytest-xdist is installed (the
    # test extra) and no -n was given, it runs on two worker processes (about 25% less wall time
    # on CI's two cores). With a GPU it stays in one process: the gpu cases share one device and
    # some measure its memory. -n 0 (or -p no:xdist) runs it in one process anyway.
    if HAS_CUDA or not config.pluginmanager.hasplugin("xdist") or config.getoption("collectonly"):
        return
    if hasattr(config, "workerinput") or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a worker itself: it runs what it is sent, it starts no workers of its own
    if config.getoption("numprocesses", None) is None and config.getoption("dist", "no") == "no":
        config.option.numprocesses = min(2, os.cpu_count() or 1)
        if config.option.numprocesses > 1:
            config.option.dist = "load"


# Modules whose unmarked cases build their models and tensors on the CPU (the interpreters'
# path); their gpu-marked cases are the same checks on CUDA at real shapes.
CPU_TENSOR_MODULES = ("test_patching.py", "test_lora_patching.py", "test_flce_contract.py",
                      "test_patching_edges.py", "test_fsdp.py", "test_trainer.py",
                      "test_sft_trainer.py", "test_save_reload.py", "test_patching_faithful.py",
                      "test_moe_models.py", "test_stacking.py")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        skip = pytest.mark.skip(reason="builds CPU tensors for the interpreters; on a CUDA machine the "
                                       "kernels are compiled for the GPU and the gpu-marked cases run instead")
        for item in items:
            if item.fspath.basename in CPU_TENSOR_MODULES and "gpu" not in item.keywords:
                item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (real shapes, compiled kernels): run pytest -m gpu on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _seed(request):
    # fresh but reproducible inputs per test
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
