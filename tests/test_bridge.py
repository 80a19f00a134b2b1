"""The torch <-> JAX bridge: gradcheck through it, transport decisions (non-contiguous, requires
grad, int64, float64), caches, availability errors, and (GPU) stream ordering both ways."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import bridge
from bridge import core, dlpack, runtime
from forge import ops
from forge.errors import BackendUnavailableError
from forge.spec import rmsnorm as rmsnorm_spec
from forge.spec import rope as rope_spec

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


@pytest.fixture(autouse=True)
def _dlpack_path():
    """These tests are about the JAX + DLPack transport: the native launch path (which serves
    CUDA calls by default) is off here; tests/test_native.py covers it."""
    from bridge import native

    native.set_launcher("off")
    yield
    native.set_launcher(None)


@pytest.fixture
def jax_x64():
    """JAX x64 on for one test only (float64 through DLPack), then restored."""
    old = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", old)


def _f64(device, *shape):
    return torch.randn(*shape, device=device, dtype=torch.float64, requires_grad=True)


# ---------------------------------------------------------------- gradcheck in float64
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
def test_gradcheck_rmsnorm(jax_x64, casting, offset, device):
    x, w = _f64(device, 3, 10), _f64(device, 10)
    assert torch.autograd.gradcheck(lambda a, b: bridge.rmsnorm(a, b, 1e-6, casting=casting, offset=offset), (x, w))


@pytest.mark.parametrize("key", ["swiglu", "geglu"])
def test_gradcheck_glu(jax_x64, key, device):
    assert torch.autograd.gradcheck(getattr(bridge, key), (_f64(device, 2, 7), _f64(device, 2, 7)))


def test_gradcheck_rope(jax_x64, device):
    # q arrives as HF's transposed view (layout "bshd" inside), k contiguous (B, H, S, D)
    q = torch.randn(1, 3, 2, 6, device=device, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = _f64(device, 1, 1, 3, 6)
    cos = torch.randn(1, 3, 6, device=device, dtype=torch.float64)
    sin = torch.randn(1, 3, 6, device=device, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: bridge.rope(a, b, cos, sin), (q, k))


def test_x64_restored():
    # the fixture above must not leak x64 into the rest of the suite
    assert jax.config.read("jax_enable_x64") is False


# ---------------------------------------------------------------- transport decisions
def test_noncontiguous_and_requires_grad_export(device):
    t = torch.randn(6, 8, device=device, requires_grad=True)
    v = t.t()  # non-contiguous view of a tensor that requires grad
    a = dlpack.to_jax(v)
    assert a.shape == (8, 6)
    torch.testing.assert_close(torch.from_dlpack(a), v.detach(), rtol=0, atol=0)


def test_contiguous_export_is_zero_copy(device):
    t = torch.randn(4, 16, device=device, dtype=torch.bfloat16)
    a = dlpack.to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    back = dlpack.to_torch(a)
    assert back.data_ptr() == t.data_ptr()


def test_int64_narrowed_to_int32_without_x64(device):
    # decision: without x64 the bridge narrows int64 (labels, indices) to int32 in torch,
    # explicitly, instead of JAX's silent copy; values must survive
    t = torch.tensor([0, -100, 151935, 2**31 - 1], device=device, dtype=torch.int64)
    a = dlpack.to_jax(t)
    assert a.dtype == jnp.int32
    assert dlpack.to_torch(a).tolist() == t.tolist()


def test_int64_kept_with_x64(jax_x64, device):
    t = torch.tensor([2**40, -3], device=device, dtype=torch.int64)
    a = dlpack.to_jax(t)
    assert a.dtype == jnp.int64 and dlpack.to_torch(a).tolist() == t.tolist()


def test_float64_without_x64_is_an_error(device):
    x = torch.randn(2, 8, device=device, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64.*x64"):
        bridge.rmsnorm(x, torch.ones(8, device=device, dtype=torch.float64))


def test_inplace_edit_after_forward_raises(device):
    x = torch.randn(3, 8, device=device, requires_grad=True)
    w = torch.randn(8, device=device, requires_grad=True)
    y = bridge.rmsnorm(x * 1.0, w)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ---------------------------------------------------------------- caches
def test_compile_cache_per_signature(device):
    x = torch.randn(4, 24, device=device)
    w = torch.randn(24, device=device)
    skey = (("eps", 1e-6), ("casting", "llama"), ("offset", 0.0))
    bridge.rmsnorm(x, w)
    fn = core.registry()["rmsnorm"].fwd_fn(skey)
    n0 = fn._cache_size()
    bridge.rmsnorm(torch.randn_like(x), w)  # same signature: no new compile
    assert fn._cache_size() == n0
    bridge.rmsnorm(torch.randn(5, 24, device=device), w)  # new shape: one more
    assert fn._cache_size() == n0 + 1


def test_weights_follow_in_place_updates_and_new_storage(device):
    x = torch.randn(3, 16, device=device)
    w = torch.nn.Parameter(torch.randn(16, device=device))
    y1 = bridge.rmsnorm(x, w)
    torch.testing.assert_close(y1, rmsnorm_spec.reference(x, w.detach()))
    with torch.no_grad():
        w.mul_(3)  # same storage, new values
    torch.testing.assert_close(bridge.rmsnorm(x, w), rmsnorm_spec.reference(x, w.detach()))
    w.data = torch.randn(16, device=device)  # new storage (as FSDP2 re-gathers)
    torch.testing.assert_close(bridge.rmsnorm(x, w), rmsnorm_spec.reference(x, w.detach()))


def test_no_grad_path_matches_autograd_path(device):
    q = torch.randn(1, 2, 3, 8, device=device)
    k = torch.randn(1, 1, 3, 8, device=device)
    cos, sin = torch.randn(1, 3, 8, device=device), torch.randn(1, 3, 8, device=device)
    with torch.no_grad():
        a = bridge.rope(q, k, cos, sin)
    b = bridge.rope(q.requires_grad_(), k, cos, sin)
    assert b[0].requires_grad and not a[0].requires_grad
    for u, v, r in zip(a, b, rope_spec.reference(q.detach(), k, cos, sin)):
        torch.testing.assert_close(u, v.detach(), rtol=0, atol=0)
        torch.testing.assert_close(u, r)


# ---------------------------------------------------------------- availability and errors
def test_pallas_backend_registered():
    assert ops.availability("pallas") == (True, "")
    assert ops.get("rmsnorm", "pallas") is bridge.rmsnorm


def test_missing_jax_reports_clearly(monkeypatch):
    def no_jax():
        raise ImportError("No module named 'jax'")

    monkeypatch.setattr(runtime, "jax_module", no_jax)
    ok, why = runtime.availability.__wrapped__()
    assert not ok and "jax" in why and "pip install" in why


def test_cpu_only_jax_with_cuda_torch_reports_clearly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "jax_has_gpu", lambda: False)
    ok, why = runtime.availability.__wrapped__()
    assert not ok and "no GPU backend" in why and "backend='triton'" in why


def test_require_raises_backend_unavailable(monkeypatch):
    monkeypatch.setattr(runtime, "availability", lambda: (False, "pallas backend unavailable: test"))
    with pytest.raises(BackendUnavailableError, match="pallas backend unavailable: test"):
        runtime.require()


def test_wrong_device_is_a_value_error(monkeypatch):
    # tensors on the other device kind than the one JAX runs the kernels on
    if not runtime.interpret():
        x, w = torch.randn(2, 8), torch.randn(8)
    elif torch.cuda.is_available():
        x, w = torch.randn(2, 8, device="cuda"), torch.randn(8, device="cuda")
    else:
        monkeypatch.setattr(runtime, "interpret", lambda: False)  # pretend JAX has a GPU
        x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match="x is on"):
        bridge.rmsnorm(x, w, 1e-6, casting="gemma", offset=0.5)


def test_forge_pallas_never_imports_torch():
    code = ("import sys, forge_pallas, forge_pallas.rmsnorm, forge_pallas.glu, forge_pallas.rope; "
            "print('torch' in sys.modules)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "False"


def _preallocate_seen_by_bridge(env) -> str:
    code = "import bridge, os; print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=root)
    return out.stdout.strip()


def test_preallocation_off_by_default():
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    assert _preallocate_seen_by_bridge(env) == "false"
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"  # the user's choice wins
    assert _preallocate_seen_by_bridge(env) == "true"


# ---------------------------------------------------------------- streams (GPU)
ITERS = 200


def _slow_torch_work(n=4096):
    a = torch.randn(n, n, device="cuda")
    return a @ a  # ~0.2 ms queued ahead of what follows on the same stream


@pytest.mark.gpu
@pytest.mark.parametrize("side_stream", [False, True])
def test_stream_race_torch_to_jax(side_stream):
    # torch writes, JAX reads at once: JAX's stream must wait for torch's current stream
    mismatches = 0
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for i in range(ITERS):
            _slow_torch_work()
            t = torch.full((1 << 22,), float(i), device="cuda")  # fresh data, queued behind the matmul
            a = dlpack.to_jax(t)
            mismatches += int(not bool(jnp.all(a == float(i))))
    assert mismatches == 0


@pytest.mark.gpu
@pytest.mark.parametrize("side_stream", [False, True])
def test_stream_race_jax_to_torch(side_stream):
    # JAX writes, torch reads at once: torch's current stream must wait for JAX's
    big = jnp.ones((4096, 4096), jnp.float32)
    # the full matmul (summed, so XLA cannot shrink it) delays the fill on JAX's stream
    fill = jax.jit(lambda m, v: jnp.sum(m @ m) * 0.0 + jnp.full((1 << 22,), v, jnp.float32))
    mismatches = 0
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for i in range(ITERS):
            t = dlpack.to_torch(fill(big, float(i)))
            mismatches += int((t != float(i)).any().item())
    assert mismatches == 0


@pytest.mark.gpu
def test_stream_race_through_a_bridged_kernel():
    # torch produces -> Pallas kernel -> torch consumes, with no synchronisation by the test
    mismatches = 0
    for _ in range(ITERS):
        g = _slow_torch_work(2048)[:256].contiguous()
        u = torch.randn_like(g)
        y = bridge.swiglu(g, u)
        ref = torch.nn.functional.silu(g) * u
        mismatches += int(not torch.allclose(y, ref, rtol=1e-5, atol=1e-5))
    assert mismatches == 0


@pytest.mark.gpu
def test_freed_output_memory_is_not_overwritten_early():
    # torch reads a bridged output slowly and drops it; the next bridged call may get the same
    # JAX memory, but its stream waits for torch's queued work (fresh input import), so the
    # slow read still sees the old values
    w = torch.randn(4096, 4096, device="cuda")
    mismatches = 0
    for _ in range(ITERS // 4):
        g, u = torch.randn(1024, 4096, device="cuda"), torch.randn(1024, 4096, device="cuda")
        y = bridge.swiglu(g, u)
        expect = (torch.nn.functional.silu(g) * u) @ w
        z = y @ w
        del y
        bridge.swiglu(torch.randn_like(g), torch.randn_like(u))
        mismatches += int(not torch.allclose(z, expect, rtol=1e-3, atol=1e-2))
    assert mismatches == 0


def test_jitted_functions_per_kernel_are_bounded():
    # a static key can hold a row count (the fused loss's chunk rows): a run of ever new token
    # counts kept a compiled program for each (~5 MB apiece on the CPU), without bound
    kd = core.KernelDef("test_bounded_jits", lambda x, n: (x * n,), None, diff=())
    try:
        for n in range(core._JITS + 10):
            kd.fwd_fn((("n", n),))
            kd.py_fn("fwd", (("n", n),))
        assert len(kd._fwd_jit) == len(kd._py) == core._JITS
        assert (("n", core._JITS + 9),) in kd._fwd_jit and (("n", 0),) not in kd._fwd_jit
    finally:
        core._REGISTRY.pop("test_bounded_jits", None)
