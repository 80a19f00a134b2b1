"""The Pallas pieces of the MoE expert block (forge_pallas/experts.py, bridge/experts.py), one
by one against the spec's reference pieces in float64 (forge.spec.experts.reference_pieces),
forward and backward pieces, on a routing with an empty expert, an id outside [0, E) and a
group spanning aligned blocks shared with its neighbours; the native plans against the DLPack
path (CPU: each pallas_call evaluated by JAX; GPU: the Triton-compiled kernels on torch's
stream, at the Qwen3-30B-A3B shape). The whole block through the op layer, against the oracle
and against Triton, is tests/test_experts.py (parametrised by backend)."""
from __future__ import annotations

import pytest
import torch

from forge.spec import experts as X
from forge.spec import tolerance

pytest.importorskip("jax")
from bridge import experts as BX  # noqa: E402
from bridge import native  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# t7_e5_k2 of tests/test_experts.py: the same shapes, so a shared process compiles nothing new
T, H, I, E, K = 7, 24, 20, 5, 2


def _routing(t, e, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[ids == 3] = 1  # expert 3 gets no rows
    ids[:, 0] = torch.where(ids[:, 0] == ids[:, 1], 0, ids[:, 0])
    ids[2, 1] = e  # transformers' sentinel: skipped
    return ids.to(device), torch.rand(t, k, generator=g).to(device)


def _tensors(dtype, device, t=T, h=H, i=I, e=E, k=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, scores = _routing(t, e, k, device, seed)
    row_token, offsets, slot_rows = X.route(ids, e)
    s = row_token.numel()

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    return dict(x=r(t, h), scores=scores, gate_up=r(e, 2 * i, h, scale=h ** -0.5), down=r(e, h, i, scale=i ** -0.5),
                row_token=row_token, offsets=offsets, slot_rows=slot_rows, dy=r(s, h), dgu=r(s, 2 * i), dout=r(t, h))


def _calls(p, v):
    """Every piece of the contract on the inputs ``v``: name -> its outputs (tuples)."""
    h, gu = p["glu_fwd"](v["x"], v["row_token"], v["offsets"], v["gate_up"], "silu")
    y = p["grouped_mm"](h, v["down"], v["offsets"])
    return {
        "glu_fwd": (h, gu),
        "grouped_mm": (y,),
        "unpermute": (p["unpermute"](y, v["slot_rows"], v["scores"]),),
        "gather": (p["unpermute"](y, v["slot_rows"], None),),
        "unpermute_bwd": p["unpermute_bwd"](v["dout"], y, v["slot_rows"], v["scores"]),
        "glu_bwd": p["glu_bwd"](v["dy"], gu, v["offsets"], v["down"], "silu"),
        "grouped_mm_t": (p["grouped_mm_t"](v["dgu"], v["gate_up"], v["offsets"]),),
        "wgrad": (p["grouped_wgrad"](v["dy"], h, v["offsets"], None),),
        "wgrad_gather": (p["grouped_wgrad"](v["dgu"], v["x"], v["offsets"], v["row_token"]),),
    }


def _valid_rows(out, v):
    """Rows a piece must write: every routed row of an (S, .) output (the sentinels' rows are
    never computed), everything else whole."""
    s = v["row_token"].numel()
    return out[: int(v["offsets"][-1])] if out.dim() == 2 and out.shape[0] == s else out


# reduction length per piece's output (tolerance): the widths its products sum over
_RED = {"glu_fwd": H, "grouped_mm": I, "unpermute": I * K, "gather": I * K, "unpermute_bwd": H, "glu_bwd": H,
        "grouped_mm_t": 2 * I, "wgrad": T, "wgrad_gather": T}


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
def test_pieces_against_the_float64_reference(dtype):
    """Each Pallas piece against the spec's reference piece, both fed the same inputs (the
    reference's in float64); the grouped products' inputs include a group of 0 rows and an
    invalid id. fp32: the bf16 rounding is the whole block's test (test_experts)."""
    if HAS_CUDA:
        pytest.skip("CPU case (interpret mode): the gpu case below runs the compiled kernels")
    v = _tensors(dtype, "cpu")
    got = _calls(BX.experts_pieces(), v)
    v64 = {n: (t.double() if t.is_floating_point() else t) for n, t in v.items()}
    ref = _calls(X.reference_pieces(), v64)
    for name, outs in got.items():
        for n, (a, b) in enumerate(zip(outs, ref[name])):
            a, b = _valid_rows(a, v), _valid_rows(b, v)
            assert a.shape == b.shape, (name, n)
            assert torch.isfinite(a).all(), f"{name} output {n}: unwritten or non-finite elements"
            err, bound = tolerance.rel_err(a, b), 2 * tolerance.atol(dtype, _RED[name])
            assert err <= bound, f"{name} output {n}: rel err {err:.3e} > {bound:.3e}"


def test_an_expert_without_rows_gets_a_zero_weight_gradient():
    if HAS_CUDA:
        pytest.skip("CPU case (interpret mode)")
    v = _tensors(torch.float32, "cpu")
    dw = BX.grouped_wgrad(v["dy"], v["dy"][:, :I].contiguous(), v["offsets"], None)
    assert int(v["offsets"][3] - v["offsets"][2]) == 0
    assert torch.count_nonzero(dw[3]) == 0 and torch.count_nonzero(dw[0]) > 0


@pytest.fixture
def launcher():
    yield native.set_launcher
    native.set_launcher(None)


def _block(device, dtype, t, h, i, e, k, seed=0):
    from forge import ops

    fn = ops.get("experts", "pallas")
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
    leaves = [(torch.randn(t, h, generator=g)).to(device, dtype), torch.rand(t, k, generator=g).to(device, dtype),
              (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(device, dtype),
              (torch.randn(e, h, i, generator=g) * i ** -0.5).to(device, dtype)]
    dout = torch.randn(t, h, generator=g).to(device, dtype)

    def run():
        xs = [x.clone().requires_grad_() for x in leaves]
        out = fn(xs[0], ids, xs[1], xs[2], xs[3])
        out.backward(dout)
        return [out.detach()] + [x.grad for x in xs]

    return run


def _native_agrees(run, dtype, red):
    native.set_launcher("off")
    ref = run()
    native.set_launcher(None if HAS_CUDA else "jax")
    got = run()
    st = native.status()
    assert st["available"], st["reason"]
    assert not st["declined"], f"declined: {st['declined']}"
    # every piece a plan: glu_fwd, grouped_mm, unpermute (fwd); unpermute_bwd, glu_bwd, two
    # wgrads, grouped_mm_t, the dx gather (bwd)
    assert st["plans"] >= 9, st
    for n, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape and a.dtype == b.dtype
        err, bound = tolerance.rel_err(a, b), 2 * tolerance.atol(dtype, red)
        assert err <= bound, f"output/grad {n}: native vs DLPack rel err {err:.3e} > {bound:.3e}"
    return st


def test_native_plans_match_dlpack_cpu(launcher):
    """The plans of every piece (traced, built from their recipes, each pallas_call evaluated by
    JAX) against the JAX + DLPack path: the pieces' JAX functions hold nothing a plan declines."""
    if HAS_CUDA:
        pytest.skip("CPU case: the gpu case compares the compiled kernels")
    _native_agrees(_block("cpu", torch.float32, T, H, I, E, K), torch.float32, max(H, 2 * I) * K)


@pytest.mark.gpu
def test_native_launch_at_the_qwen3_moe_shape(launcher):
    """Qwen3-30B-A3B (hidden 2048, moe intermediate 768, 128 experts, top-8), 4096 tokens, bf16:
    every piece natively launched (Triton-compiled, on torch's stream: no pass declined, no
    DLPack), agreeing with the JAX + DLPack path."""
    st = _native_agrees(_block("cuda", torch.bfloat16, 4096, 2048, 768, 128, 8), torch.bfloat16, 2048 * 8)
    # (not st["compiles"]: a module an earlier process on this machine compiled comes from
    # Triton's cache on disk, with no triton.compile call in this one)
    assert st["kernels"] >= 7, st
