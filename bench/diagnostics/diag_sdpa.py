"""Device time of torch's attention (scaled_dot_product_attention) per backend at a model's
attention shapes (CUDA): forward, and forward + backward, for each SDPA backend that takes the
call, with the keys and values grouped (``enable_gqa=True``) or repeated to every query head
(Hugging Face's ``repeat_kv``), and the queries laid out as Hugging Face hands them (a transposed
view of (B, S, H, D)) or contiguous; the last row of each case is what SDPA picks by itself.

Prints only. The defaults are Qwen2.5-0.5B's (14 query heads, 2 key/value heads, head size 64),
causal, bf16.

    python bench/diagnostics/diag_sdpa.py [--shapes 4x1024,8x2048] [--heads 14 --kv-heads 2 --head-dim 64]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import _common as bc  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _inputs(b, s, h, kvh, d, layout, gqa):
    def make(heads):
        t = torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16)
        t = t.transpose(1, 2)
        return (t.contiguous() if layout == "contiguous" else t).requires_grad_()
    q, k, v = make(h), make(kvh), make(kvh)
    return q, k, v


def _call(q, k, v, gqa):
    if gqa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4x1024,8x2048")
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")  # (SDPA explains each backend it declines, per call)
    print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    rows = []
    for shape in a.shapes.split(","):
        b, s = map(int, shape.split("x"))
        for gqa in (True, False):
            for layout in ("hf", "contiguous"):
                q, k, v = _inputs(b, s, a.heads, a.kv_heads, a.head_dim, layout, gqa)
                dy = torch.randn(b, a.heads, s, a.head_dim, device="cuda", dtype=torch.bfloat16)
                for name in list(BACKENDS) + ["default"]:
                    ctx = sdpa_kernel([BACKENDS[name]]) if name != "default" else contextlib.nullcontext()
                    row = {"shape": shape, "gqa": gqa, "layout": layout, "backend": name}
                    try:
                        with ctx:
                            fwd = bc.device_time_us(lambda: _call(q, k, v, gqa), iters=20)
                            both = bc.device_time_us(lambda: torch.autograd.backward(_call(q, k, v, gqa), dy),
                                                     iters=20)
                        row.update(fwd_ms=round(fwd / 1e3, 3), fwd_bwd_ms=round(both / 1e3, 3))
                        if name == "default":
                            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                                torch.autograd.backward(_call(q, k, v, gqa), dy)
                                torch.cuda.synchronize()
                            ks = [e.key for e in prof.key_averages() if "attention" in e.key.lower()
                                  or "sdpa" in e.key.lower() or "flash" in e.key.lower() or "fmha" in e.key.lower()]
                            row["kernels"] = "; ".join(k[:40] for k in ks[:3])
                    except RuntimeError as e:
                        row["note"] = str(e).splitlines()[0][:60]
                    q.grad = k.grad = v.grad = None
                    rows.append(row)
    bc.print_table(rows, ["shape", "gqa", "layout", "backend", "fwd_ms", "fwd_bwd_ms", "kernels", "note"])


if __name__ == "__main__":
    main()
