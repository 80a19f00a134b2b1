"""The Pallas backend's native launch path (bridge/native.py) and the bridge's defects it came with.

On the CPU the plans are built and run with each ``pallas_call`` evaluated by JAX's interpreter
(``launcher="jax"``): that checks the tracing, every torch-side step and the aliasing rules
against the DLPack path. On a GPU (``-m gpu``) the same cases run the Triton-compiled kernels
against the DLPack path, and the whole parity suite goes through the native path by default.
Agreement bound: both paths compute each kernel in fp32 and round once; the XLA work around the
kernels (reductions, products) may round in another order, so ``2 * atol(dtype, reduction)`` as
in test_parity's backend-vs-backend rule.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from forge import ops
from forge.spec import tolerance

pytest.importorskip("jax")
from bridge import _jax_internals as JI  # noqa: E402
from bridge import native  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def _w(*shape, dtype, device, scale=0.1):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _cases(dtype, device, m):
    h, i, r, nh, nkv, d = 64, 96, 8, 4, 2, 16
    x = _w(m, h, dtype=dtype, device=device, scale=1.0)

    def lin(n, k):
        return _w(n, k, dtype=dtype, device=device, scale=k ** -0.5)

    qkv = []
    for n in (nh * d, nkv * d, nkv * d):
        qkv += [lin(n, h), _w(n, dtype=dtype, device=device), lin(r, h), lin(n, r)]
    mlp = [lin(i, h), lin(r, h), lin(i, r), lin(i, h), lin(r, h), lin(i, r), lin(h, i), lin(r, i), lin(h, r)]
    b, s = 2, max(m // 2, 1)

    def keep(*shape):
        return torch.rand(*shape, device=device) > 0.2
    cos, sin = torch.randn(b, s, d, device=device).to(dtype), torch.randn(b, s, d, device=device).to(dtype)
    return {
        "rmsnorm": ((x, _w(h, dtype=dtype, device=device, scale=1.0)), (0, 1), {"eps": 1e-6}),
        "rmsnorm_gemma": ((x, _w(h, dtype=dtype, device=device)), (0, 1), {"eps": 1e-6, "casting": "gemma", "offset": 1.0}),
        "swiglu": ((lin(m, i), lin(m, i)), (0, 1), {}),
        "geglu": ((lin(m, i), lin(m, i)), (0, 1), {}),
        "gated_mlp": ((x, lin(i, h), lin(i, h), lin(h, i)), (0,), {"act": "silu", "recompute": True}),
        "rope": ((torch.randn(b, nh, s, d, device=device).to(dtype), torch.randn(b, nkv, s, d, device=device).to(dtype),
                  cos, sin), (0, 1), {}),
        "lora_qkv": ((x, *qkv), (0, 3, 4, 7, 8, 11, 12), {"scale_q": 2.0, "scale_k": 2.0, "scale_v": 0.5}),
        "lora_mlp": ((x, *mlp), (0, 2, 3, 5, 6, 8, 9), {"scale_gate": 2.0, "scale_up": 2.0, "scale_down": 0.5}),
        # peft's lora_dropout: keep-masks (uint8 views) and the masked adapter paths in the plans
        "lora_qkv_dropout": ((x, *qkv), (0, 3, 4, 7, 8, 11, 12), {
            "scale_q": 2.0, "scale_k": 2.0, "scale_v": 0.5, "mask_q": keep(m, h), "dropout_q": 0.1,
            "mask_v": keep(m, h), "dropout_v": 0.3}),
        "lora_mlp_dropout": ((x, *mlp), (0, 2, 3, 5, 6, 8, 9), {
            "scale_gate": 2.0, "scale_up": 2.0, "scale_down": 0.5, "mask_gate": keep(m, h), "dropout_gate": 0.1,
            "mask_up": keep(m, h), "dropout_up": 0.1, "mask_down": keep(m, i), "dropout_down": 0.3}),
    }


def _run(key, args, diff, kwargs, seed):
    fn = ops.get("gated_mlp" if key == "gated_mlp" else key.removesuffix("_gemma").removesuffix("_dropout"), "pallas")
    leaves = [None if a is None else a.detach().clone().requires_grad_(i in diff) for i, a in enumerate(args)]
    outs = fn(*leaves, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator(device=outs[0].device).manual_seed(seed)
    gouts = [torch.randn(o.shape, generator=g, device=o.device).to(o.dtype) for o in outs]
    torch.autograd.backward(list(outs), gouts)
    return [o.detach() for o in outs] + [leaves[i].grad for i in diff]


@pytest.fixture
def launcher():
    yield native.set_launcher
    native.set_launcher(None)


KEYS = list(_cases(torch.float32, "cpu", 4))


def _agree(key, dtype, device, m, native_name):
    args, diff, kwargs = _cases(dtype, device, m)[key]
    native.set_launcher("off")
    ref = _run(key, args, diff, kwargs, seed=1)
    native.set_launcher(native_name)
    got = _run(key, args, diff, kwargs, seed=1)
    st = native.status()
    assert st["available"], st["reason"]
    assert not st["declined"], f"declined: {st['declined']}"
    assert st["plans"] >= 1
    for n, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape and a.dtype == b.dtype
        err = tolerance.rel_err(a, b)
        bound = 2 * tolerance.atol(dtype, max(m, 96))
        assert err <= bound, f"{key} output/grad {n}: native vs DLPack rel err {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("key", KEYS)
def test_native_plan_matches_dlpack_cpu(key, launcher):
    # float32: the Triton interpreter is not involved here, but JAX's CPU dots in bf16 round
    # differently from torch's; fp32 makes the comparison about the plan, not the dot library
    if HAS_CUDA:
        pytest.skip("CPU case: on a GPU the gpu-marked case compares the compiled kernels")
    _agree(key, torch.float32, "cpu", 37, "jax")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("key", KEYS)
def test_native_launch_matches_dlpack_gpu(key, dtype, launcher):
    _agree(key, dtype, "cuda", 1000, None)


@pytest.mark.parametrize("key", ["rmsnorm", "swiglu", "geglu", "rope"])
def test_gradcheck_through_native_plans(key, launcher):
    jax = pytest.importorskip("jax")
    old = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        launcher("jax" if not HAS_CUDA else None)
        dev = "cuda" if HAS_CUDA else "cpu"

        def f64(*shape):
            return torch.randn(*shape, device=dev, dtype=torch.float64, requires_grad=True)

        fn = ops.get(key, "pallas")
        args = {"rmsnorm": (f64(3, 10), f64(10)), "swiglu": (f64(3, 10), f64(3, 10)),
                "geglu": (f64(3, 10), f64(3, 10)),
                # the kernel gives no gradient for cos and sin (nothing upstream wants one)
                "rope": (f64(1, 2, 3, 8), f64(1, 1, 3, 8), f64(1, 3, 8).detach(), f64(1, 3, 8).detach())}[key]
        assert torch.autograd.gradcheck(lambda *a: fn(*a), args)
        assert native.status()["plans"] >= 2 and not native.status()["declined"], native.status()
    finally:
        jax.config.update("jax_enable_x64", old)


def test_jax_internals_present():
    assert JI.missing() == []


def test_ttir_lowering_on_cpu_changes_only_row_constants():
    """The lowered module of RMSNorm's forward at two row counts differs only in the constants
    that hold the row count: the kernel body, block sizes and layout are the same."""
    import functools
    import re

    import jax
    import jax.numpy as jnp

    from forge_pallas import rmsnorm as k

    def ttir(m):
        fn = functools.partial(k.rmsnorm_fwd, eps=1e-6, casting="llama", offset=0.0)
        jx = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((m, 896), jnp.bfloat16), jax.ShapeDtypeStruct((896,), jnp.bfloat16))
        [eqn] = [e for e in jx.jaxpr.eqns if e.primitive.name == JI.PALLAS_CALL]
        return JI.lower_pallas_call(eqn)

    a, b = ttir(8192), ttir(4096)
    assert "tt.func public @rmsnorm_fwd" in a.ttir
    assert a.grid[0] != b.grid[0]
    la, lb = a.ttir.splitlines(), b.ttir.splitlines()
    assert len(la) == len(lb)
    diff = [(x, y) for x, y in zip(la, lb) if x != y]
    assert diff
    norm = [re.sub(r"8192", "M", x) == re.sub(r"4096", "M", y) for x, y in diff]
    assert all(norm), diff[:4]


def test_stale_weight_after_in_place_update(launcher):
    """A weight JAX had to copy on import (not 64-byte aligned) must not be cached: an in-place
    update (an optimizer step) has to reach the next call."""
    launcher("off")
    dev = "cuda" if HAS_CUDA else "cpu"
    f = ops.get("rmsnorm", "pallas")
    x = torch.randn(4, 64, device=dev)
    w = torch.randn(65, device=dev)[1:]  # 4 bytes past an aligned allocation
    f(x, w, 1e-6)
    w.mul_(2)
    from forge.spec import rmsnorm as spec

    got = f(x, w, 1e-6)
    want = spec.reference(x.double(), w.double(), 1e-6)
    assert tolerance.rel_err(got, want) < 1e-5


def test_bridge_pins_no_weights(launcher):
    """After a call, the bridge holds nothing of a weight: deleting it frees its memory."""
    import weakref

    launcher("off")
    dev = "cuda" if HAS_CUDA else "cpu"
    f = ops.get("rmsnorm", "pallas")
    w = torch.randn(64, device=dev, requires_grad=True)
    x = torch.randn(4, 64, device=dev, requires_grad=True)
    f(x, w, 1e-6).sum().backward()
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs (tensors on cuda:1)")
@pytest.mark.parametrize("path", ["off", None], ids=["dlpack", "native"])
def test_second_device(path, launcher):
    launcher(path)
    from forge.spec import rmsnorm as spec

    x = torch.randn(64, 896, device="cuda:1", requires_grad=True)
    w = torch.randn(896, device="cuda:1", requires_grad=True)
    y = ops.get("rmsnorm", "pallas")(x, w, 1e-6)
    assert y.device == x.device
    y.sum().backward()
    want = spec.reference(x.detach().double(), w.detach().double(), 1e-6)
    assert tolerance.rel_err(y.detach(), want) < 1e-5 and w.grad.device == w.device


@pytest.mark.gpu
def test_native_launch_in_a_fresh_process_is_cached(tmp_path):
    """Second process: the TTIR comes from the disk cache and Triton's own cache: the first call
    of an already compiled kernel stays cheap (the figure is printed; the bench records it)."""
    code = textwrap.dedent("""
        import time, torch
        t0 = time.perf_counter()
        import forge.ops
        from bridge import native
        f = forge.ops.get("rmsnorm", "pallas")
        x = torch.randn(4096, 896, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(896, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        f(x, w, 1e-6); torch.cuda.synchronize()
        t2 = time.perf_counter()
        assert native.status()["plans"] == 1 and not native.status()["declined"], native.status()
        print(f"first_call_ms {1e3 * (t2 - t1):.1f}")
    """)
    env = dict(os.environ, FORGE_CACHE_DIR=str(tmp_path), PYTHONPATH=os.getcwd())
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert any(p.suffix == ".ttir" for p in (tmp_path / "pallas-native").iterdir())
    print(runs[0].stdout, runs[1].stdout)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs (JAX's start-up switches devices)")
def test_starting_jax_keeps_torchs_current_device():
    code = textwrap.dedent("""
        import torch
        from forge import ops
        ops.get("rmsnorm", "pallas")(torch.randn(8, 64, device="cuda"), torch.randn(64, device="cuda"))
        assert torch.cuda.current_device() == 0, torch.cuda.current_device()
    """)
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=os.getcwd()),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
