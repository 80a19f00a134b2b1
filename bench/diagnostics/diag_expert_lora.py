"""LoRA on one layer's expert weights (peft's target_parameters form: W + s B A per expert), forward
and backward of the expert block, three ways: forge's rank-r node (the adapters beside the frozen
weights, what a patched peft model runs), forge's kernel on the merged weights (what it would run
reading peft's adapted weights), and torch's grouped_mm on the merged weights (transformers'
``grouped_mm`` experts, what peft runs). Prints each one's time and the peak memory above its
inputs, and the rank-r node's gradients against the merged path's.

    PYTHONPATH=. python bench/diagnostics/diag_expert_lora.py [--shape qwen3|olmoe|mixtral] [--tokens 4096]
                                                          [--rank 16] [--backend triton] [--quick]
"""
from __future__ import annotations

import argparse
import sys

import torch

from forge import ops
from forge.spec import tolerance

SHAPES = {"qwen3": (128, 8, 2048, 768), "olmoe": (64, 8, 2048, 1024), "mixtral": (8, 2, 4096, 14336)}


def _inputs(e, k, h, i, t, r, dt, dev):
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*s, std=1.0):
        return (torch.randn(*s, generator=g) * std).to(dev, dt)

    x = rnd(t, h)
    logits = torch.randn(t, e, generator=g)
    w, idx = torch.softmax(logits, -1).topk(k, -1)
    ws = {"gu": rnd(e, 2 * i, h, std=h ** -0.5), "dn": rnd(e, h, i, std=i ** -0.5)}
    ads = {"a_gu": rnd(e, r, h, std=h ** -0.5), "b_gu": rnd(e, 2 * i, r, std=0.1),
           "a_dn": rnd(e, r, i, std=i ** -0.5), "b_dn": rnd(e, h, r, std=0.1)}
    return x, idx.to(dev), w.to(dev, dt), ws, ads


def _grouped_mm_block(x, idx, w, gu, dn):
    """transformers' grouped_mm experts, in torch: gather, two grouped products, the weighted sum."""
    t, k = idx.shape
    order = idx.reshape(-1).argsort(stable=True)
    counts = torch.bincount(idx.reshape(-1), minlength=gu.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // k]
    g, u = torch._grouped_mm(xs, gu.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(torch.nn.functional.silu(g) * u, dn.transpose(1, 2), offs=offs)
    out = torch.zeros_like(x)
    return out.index_add(0, order // k, y * w.reshape(-1)[order, None])


def _run(fn, leaves, dout):
    for t in leaves:
        t.grad = None
    out = fn()
    out.backward(dout)
    return out.detach(), [t.grad.clone() for t in leaves]


def _time(fn, reps):
    if not torch.cuda.is_available():
        return float("nan"), float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--scale", type=float, default=2.0)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: a smoke test")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.quick
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    e, k, h, i = (4, 2, 32, 24) if a.quick else SHAPES[a.shape]
    t = 16 if a.quick else a.tokens
    r = 2 if a.quick else a.rank
    x, idx, w, ws, ads = _inputs(e, k, h, i, t, r, dt, dev)
    fn = ops.get("experts", a.backend)
    s = a.scale
    x.requires_grad_(True)
    leaves = [x] + [ads[n].requires_grad_(True) for n in ("a_gu", "b_gu", "a_dn", "b_dn")]
    dout = torch.randn_like(x)

    def low_rank():
        return fn(x, idx, w, ws["gu"], ws["dn"], adapters=((ads["a_gu"], ads["b_gu"], s), (ads["a_dn"], ads["b_dn"], s)))

    def merged_weights():
        return (torch.baddbmm(ws["gu"], ads["b_gu"], ads["a_gu"], alpha=s),
                torch.baddbmm(ws["dn"], ads["b_dn"], ads["a_dn"], alpha=s))

    def merged():
        return fn(x, idx, w, *merged_weights())

    variants = {f"forge {a.backend}, rank-r node": low_rank, f"forge {a.backend}, merged weights": merged}
    if cuda:
        variants["torch grouped_mm, merged weights"] = lambda: _grouped_mm_block(x, idx, w, *merged_weights())
    results = {name: _run(v, leaves, dout) for name, v in variants.items()}
    ref = results[f"forge {a.backend}, merged weights"]
    print(f"{a.shape if not a.quick else 'tiny'}: E={e} top-{k} H={h} I={i}, {t} tokens, rank {r}, {dt}, {dev}")
    print(f"{'variant':36s} {'ms fwd+bwd':>11s} {'MiB above inputs':>17s}  max rel err vs merged (out, dx, dA/dB)")
    for name, v in variants.items():
        ms, mib = _time(lambda v=v: _run(v, leaves, dout), a.reps)
        out, grads = results[name]
        err = max([tolerance.rel_err(out, ref[0])] + [tolerance.rel_err(g, gr) for g, gr in zip(grads, ref[1])])
        print(f"{name:36s} {ms:11.3f} {mib:17.1f}  {err:.3e}")
    if not cuda:
        print("SMOKE TEST, NOT A MEASUREMENT: no CUDA device (or --quick): the kernels ran in the interpreters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
