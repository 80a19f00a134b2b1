"""A LoRA fine-tune's loss curve, forge against eager (peft), from the same initial adapters on
the same token stream, and how far apart they may be: dropout draws different masks in forge
(its own in-kernel generator) than in torch, so the yardstick is a second eager run whose masks
differ only by torch's seed. The measure is the largest gap between two curves' moving averages
(--window steps); forge passes when its gap to eager is at most twice the eager-vs-eager gap plus
the spread of bf16 rounding (the gap between forge and eager at dropout 0 is printed beside it).

    python bench/bench_lora_curve.py --model llama3-8b --steps 200 [--lora R,ALPHA,DROPOUT] [--quick]

The token stream is learnable on random weights: every sequence walks a small vocabulary with a
fixed rule (next = (a * token + b) mod V, a random token in 10% of places), so the adapters have
something to fit and the loss falls. Writes a CSV (step, loss per run) and a plot.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import _common as bc  # noqa: E402
import forge  # noqa: E402
from bench_patch_bisect import _lora  # noqa: E402
from presets import PRESETS, build  # noqa: E402

WORDS = 512  # the walk's vocabulary


def stream(steps, batch, length, vocab, device, seed=1234):
    """The same ``steps`` batches of token ids for every run."""
    g = torch.Generator().manual_seed(seed)
    n = min(WORDS, vocab)
    words = torch.randperm(vocab, generator=g)[:n]
    a, b = 37, 11
    out = []
    for _ in range(steps):
        t = torch.empty(batch, length, dtype=torch.long)
        t[:, 0] = torch.randint(0, n, (batch,), generator=g)
        for j in range(1, length):
            t[:, j] = (a * t[:, j - 1] + b) % n
        noise = torch.rand(batch, length, generator=g) < 0.1
        t[noise] = torch.randint(0, n, (int(noise.sum()),), generator=g)
        out.append(words[t].to(device))
    return out


def run(model, batches, init, lr, seed):
    """Loss per step of AdamW on the adapters from ``init``, torch's generator at ``seed``."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in init:
                p.copy_(init[n])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    torch.manual_seed(seed)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(x) for x in torch.stack(losses).cpu()]


def smooth(xs, w):
    return [sum(xs[max(0, i - w + 1):i + 1]) / len(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def gap(a, b, w):
    return max(abs(x - y) for x, y in zip(smooth(a, w), smooth(b, w), strict=True))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--lora", default="16,32,0.05", help="peft LoRA R,ALPHA,DROPOUT[,MODULE...]")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny preset on the CPU: a smoke test")
    bc.add_out_argument(ap)
    a = ap.parse_args(argv)
    if a.quick:
        a.model, a.steps, a.batch, a.seq_len, a.window = "tiny", 3, 1, 16, 2
    bc.say_smoke_test()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _lora(build(a.model, torch.bfloat16 if device == "cuda" else torch.float32, device), a.lora)
    model.train()
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():  # peft starts B at zero; a drawn B makes step 0 exercise every path
        for n in init:
            if "lora_B" in n:
                init[n].normal_(std=1e-3)
    batches = stream(a.steps, a.batch, a.seq_len, model.config.vocab_size, device)
    no_drop = a.lora.split(",")
    no_drop[2] = "0"
    curves = {"eager": run(model, batches, init, a.lr, seed=0),
              "eager, other dropout seed": run(model, batches, init, a.lr, seed=1)}
    forge.patch(model, backend=a.backend)
    curves[f"forge {a.backend}"] = run(model, batches, init, a.lr, seed=0)
    forge.unpatch(model)
    # the rounding yardstick: dropout 0 (same masks: none), forge against eager
    for m in model.modules():
        if hasattr(m, "lora_dropout"):
            for k in m.lora_dropout:
                m.lora_dropout[k].p = 0.0
    eager0 = run(model, batches, init, a.lr, seed=0)
    forge.patch(model, backend=a.backend)
    forge0 = run(model, batches, init, a.lr, seed=0)
    forge.unpatch(model)
    w = a.window
    noise = gap(curves["eager"], curves["eager, other dropout seed"], w)
    rounding = gap(eager0, forge0, w)
    got = gap(curves["eager"], curves[f"forge {a.backend}"], w)
    ok = got <= 2 * noise + rounding
    rows = [{"step": i, **{k: v[i] for k, v in curves.items()}, "eager, dropout 0": eager0[i],
             f"forge {a.backend}, dropout 0": forge0[i]} for i in range(a.steps)]
    print(f"{a.model}, LoRA {a.lora}, {a.batch}x{a.seq_len}, {a.steps} steps, AdamW lr {a.lr}")
    print(f"loss: first {curves['eager'][0]:.4f}, last (window {w}) eager {smooth(curves['eager'], w)[-1]:.4f}, "
          f"forge {smooth(curves[f'forge {a.backend}'], w)[-1]:.4f}")
    print(f"largest gap of the {w}-step moving averages: forge vs eager {got:.4f}; eager vs eager with other "
          f"dropout masks {noise:.4f}; forge vs eager at dropout 0 {rounding:.4f} -> "
          f"{'within' if ok else 'OUTSIDE'} 2 x dropout noise + rounding")
    summary = {"gap_forge_eager": got, "gap_dropout_noise": noise, "gap_rounding": rounding, "within": ok}
    case = f"{a.model}-{a.backend}"
    jpath, _ = bc.write_results(a.out, "bench_lora_curve", rows, case=case,
                                extra={"summary": summary, "args": {k: str(v) for k, v in vars(a).items()}})
    import svgplot  # (the standard library only: the curves are drawn on any machine)

    svgplot.line_chart(jpath.with_suffix(".svg"), {k: smooth(v, w) for k, v in curves.items()},
                       title=f"{a.model} LoRA {a.lora}: loss curves", xlabel="step",
                       ylabel=f"loss ({w}-step moving average)")

if __name__ == "__main__":
    main()
