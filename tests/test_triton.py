"""Triton backend specifics: gradcheck in float64, argument errors, agreement with eager."""
from __future__ import annotations

import pytest
import torch

import forge_triton


def _dev(device):
    return dict(device=device, dtype=torch.float64)


def test_gradcheck_rmsnorm(device):
    x = torch.randn(3, 10, **_dev(device), requires_grad=True)
    w = torch.randn(10, **_dev(device), requires_grad=True)
    for casting, offset in (("llama", 0.0), ("gemma", 1.0)):
        assert torch.autograd.gradcheck(lambda a, b: forge_triton.rmsnorm(a, b, 1e-6, casting=casting, offset=offset), (x, w))


@pytest.mark.parametrize("key", ["swiglu", "geglu"])
def test_gradcheck_glu(key, device):
    g = torch.randn(2, 7, **_dev(device), requires_grad=True)
    u = torch.randn(2, 7, **_dev(device), requires_grad=True)
    assert torch.autograd.gradcheck(getattr(forge_triton, key), (g, u))


def test_gradcheck_rope(device):
    q = torch.randn(1, 2, 3, 6, **_dev(device), requires_grad=True)
    k = torch.randn(1, 1, 3, 6, **_dev(device), requires_grad=True)
    cos, sin = torch.randn(1, 3, 6, **_dev(device)), torch.randn(1, 3, 6, **_dev(device))
    assert torch.autograd.gradcheck(lambda a, b: forge_triton.rope(a, b, cos, sin), (q, k))


def test_rope_matches_transformers(device):
    from transformers.models.qwen2 import modeling_qwen2

    q = torch.randn(2, 4, 5, 16, device=device, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 5, 16, device=device, dtype=torch.bfloat16)
    cos, sin = torch.randn(2, 5, 16, device=device).bfloat16(), torch.randn(2, 5, 16, device=device).bfloat16()
    ref = modeling_qwen2.apply_rotary_pos_emb(q, k, cos, sin)
    out = forge_triton.rope(q, k, cos, sin)
    for o, r in zip(out, ref):  # same math, fp32 inside vs bf16 steps: within bf16 rounding
        torch.testing.assert_close(o, r, rtol=2**-7, atol=2**-6)


def test_glu_forward_rounds_like_eager(device):
    # act(gate) is rounded to bf16 before the product, as eager does: most elements bit-equal
    g = torch.randn(64, 96, device=device, dtype=torch.bfloat16)
    u = torch.randn(64, 96, device=device, dtype=torch.bfloat16)
    eager = torch.nn.functional.silu(g) * u
    assert (forge_triton.swiglu(g, u) == eager).float().mean() > 0.99


# ---------------------------------------------------------------- bad input
def test_errors_name_the_argument(device):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, device=device)
    with pytest.raises(TypeError, match="x must be"):
        forge_triton.rmsnorm(torch.ones(4, 8, dtype=torch.int32, device=device), w)
    with pytest.raises(ValueError, match="weight has width 7"):
        forge_triton.rmsnorm(x, torch.randn(7, device=device))
    with pytest.raises(ValueError, match="casting"):
        forge_triton.rmsnorm(x, w, casting="t5")
    with pytest.raises(ValueError, match="gate has shape"):
        forge_triton.swiglu(x, torch.randn(4, 9, device=device))
    with pytest.raises(TypeError, match="gate is torch.float32 but up is torch.float16"):
        forge_triton.geglu(x, x.half())
    q = torch.randn(1, 2, 3, 8, device=device)
    with pytest.raises(ValueError, match="cos must be"):
        forge_triton.rope(q, q, torch.randn(1, 4, 8, device=device), torch.randn(1, 4, 8, device=device))
    with pytest.raises(ValueError, match="head_dim must be even"):
        forge_triton.rope(q[..., :7], q[..., :7], torch.randn(1, 3, 7, device=device), torch.randn(1, 3, 7, device=device))
    with pytest.raises(TypeError, match="cos must be a torch.Tensor"):
        forge_triton.rope(q, q, None, None)


def test_wrong_device_is_a_clear_error():
    # the Triton path runs on CUDA (compiled) or on CPU (interpreter), never the other one
    from forge import _runtime

    other = "cuda" if _runtime.triton_interpreted() else "cpu"
    if other == "cuda" and not torch.cuda.is_available():
        x = torch.randn(2, 8, device="meta")
        w = torch.randn(8, device="meta")
    else:
        x, w = torch.randn(2, 8, device=other), torch.randn(8, device=other)
    with pytest.raises(ValueError, match="triton backend here runs on"):
        forge_triton.rmsnorm(x, w)


# ---------------------------------------------------------------- the cached launch path
def test_fast_launch_key_refines_triton_specialisation(device):
    # Two calls may share a compiled kernel only if Triton would specialise them alike: dtype and
    # 16-byte alignment per tensor; per int its type, == 1, multiple of 16, 32-bit range
    from forge_triton import _launch

    key = _launch._arg_key
    t = torch.zeros(64, device=device)
    assert key(t) == key(torch.zeros(32, device=device))
    assert key(t) != key(t[1:])  # 4 bytes in: not 16-byte aligned
    assert key(t) != key(t.double()) and key(t) != key(t.half())
    assert key(16) == key(4096) and key(16) != key(17) and key(1) != key(17)
    assert key(16) != key(2**32) and key(2**32) == key(2**33)
    assert key(True) != key(1) and key(1.0) == key(2.5) and key(1.0) != key(1)
    assert key(None) == key(None)


def test_fast_launch_passes_constexprs_in_signature_order():
    # the compiled launcher takes every parameter in order, constexprs included, defaults filled
    from forge_triton import _launch

    class P:
        def __init__(self, name, default=None):
            self.name, self.has_default, self.default = name, default is not None, default

    class Kernel:
        arg_names = ["x", "n", "BLOCK", "FLAG", "ACC"]
        params = [P("x"), P("n"), P("BLOCK"), P("FLAG", default=True), P("ACC")]

    class Compiled:
        run = object()

    fk = _launch.FastKernel(Kernel())
    _, run, tail = fk._entry(Compiled(), ("x", 3), {"ACC": "fp32", "BLOCK": 128, "num_warps": 4})
    assert run is Compiled.run and tail == (128, True, "fp32")
    with pytest.raises(TypeError, match="BLOCK"):
        fk._entry(Compiled(), ("x", 3), {"ACC": "fp32"})


def test_fast_launch_matches_the_plain_launch(device):
    # the same kernel through FastKernel and through Triton's own launch, twice (the second
    # FastKernel call takes the cached path on a GPU), on aligned and misaligned views
    from forge_triton import _common, glu

    g, u = torch.randn(2, 4099, device=device), torch.randn(2, 4099, device=device)
    for gs, us in ((g, u), (g.view(-1)[1:4097], u.view(-1)[3:4099])):
        want = torch.empty_like(gs)
        glu._glu_fwd_kernel[(_common.cdiv(gs.numel(), glu.BLOCK),)](
            gs, us, want, gs.numel(), BLOCK=glu.BLOCK, GELU=False, ACC=_common.acc(gs.dtype), num_warps=8)
        for _ in range(2):
            got = torch.full_like(gs, float("nan"))
            glu._fwd[(_common.cdiv(gs.numel(), glu.BLOCK),)](
                gs, us, got, gs.numel(), BLOCK=glu.BLOCK, GELU=False, ACC=_common.acc(gs.dtype), num_warps=8)
            assert torch.equal(got, want)


def test_plain_launches_take_tritons_own_path_inside_the_block(monkeypatch):
    # forge_triton.plain_launches() (bench/bench_host_overhead.py times both paths): inside the
    # block a FastKernel hands out the kernel's own launcher, afterwards its direct path again,
    # also when the block raised
    from forge_triton import _launch, glu

    def forges(launch):  # forge's direct path, or what Triton's kernel[grid] hands out
        return launch.__qualname__.startswith("FastKernel.")

    monkeypatch.setattr(_launch, "FAST", True)  # (the interpreter never takes the direct path)
    assert forges(glu._fwd[(1,)])
    with pytest.raises(RuntimeError, match="inside"):
        with forge_triton.plain_launches():
            assert not forges(glu._fwd[(1,)])
            raise RuntimeError("inside")
    assert _launch.FAST and forges(glu._fwd[(1,)])


def test_public_functions_stay_functions_once_the_op_layer_loads_the_kernels():
    # rmsnorm, rope and decode_attention share their module's name, and a module's first import
    # (the op layer's, forge_triton._ops.kernels, or anyone's) bound it over the function, so
    # forge_triton.rmsnorm(...) failed after any op-layer call (a fresh interpreter: no earlier
    # access may have cached the function)
    import subprocess
    import sys

    code = ("import types, forge_triton\n"
            "import forge_triton.decode_attention\n"  # (a direct submodule import, the same binding)
            "from forge_triton import _ops\n"
            "_ops.kernels()\n"
            "for name in ('rmsnorm', 'rope', 'decode_attention', 'swiglu'):\n"
            "    fn = getattr(forge_triton, name)\n"
            "    assert callable(fn) and not isinstance(fn, types.ModuleType), (name, fn)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
