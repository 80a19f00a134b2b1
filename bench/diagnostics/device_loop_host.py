"""Host time per generated token with forge's device loop on and off (decode.device_loop).

    python bench/diagnostics/device_loop_host.py                       # GPU, Qwen2.5-0.5B shape
    python bench/diagnostics/device_loop_host.py --device cpu --layers 2 --vocab 1024

Per batch size and setting: the fastest of --reps generate() calls of --new tokens (min_new_tokens
too, so every call decodes them all) and of one new token, after two untimed calls of each
(warm-up and captures); ``per token`` = (full - one) / (new - 1) in microseconds. On a GPU that is
the wall time of a decoding step; on the CPU every replay is a no-op (profile_decode_host's
NoOpGraphs: the capture runs the steps once, a replay does nothing), so it is the host's own
work per token: generate()'s loop around a replay with the loop off, one replay and one flag
read per 8 tokens with it on.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: its helpers

import torch  # noqa: E402
from profile_decode_host import NoOpGraphs, _sync  # noqa: E402

import forge  # noqa: E402
from forge.patching import decode_runtime  # noqa: E402
from presets import PRESETS, build  # noqa: E402


def _fastest(model, ids, kw, reps, dev):
    for _ in range(2):
        model.generate(ids, **kw)
    times = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sample", action="store_true", help="do_sample with temperature 0.7, top_k 50, top_p 0.9")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    cfg = dict(PRESETS[a.model])
    cfg.update({k: v for k, v in (("num_hidden_layers", a.layers), ("vocab_size", a.vocab)) if v})
    PRESETS[a.model] = cfg
    if dev.type == "cpu":
        decode_runtime.BACKEND = NoOpGraphs()
        torch.set_num_threads(1)
    model = build(a.model, torch.bfloat16 if dev.type == "cuda" else torch.float32, dev).eval()
    model.generation_config.eos_token_id = None
    forge.patch(model, mode="infer", backend="triton", graphs=True,
                kernels=None if dev.type == "cuda" else ["fused_linear_ce"])
    d = model._forge_graphs.decode
    print(f"# {a.model} layers={cfg['num_hidden_layers']} vocab={cfg['vocab_size']} on {dev.type}"
          f"{' (no-op replays)' if dev.type == 'cpu' else ''}, prompt {a.prompt}, {a.new} new tokens, "
          f"{'sampling' if a.sample else 'greedy'}")
    print(f"{'batch':>5} {'device loop':>11} {'full ms':>9} {'one ms':>8} {'per token us':>13}")
    for b in map(int, a.batches.split(",")):
        ids = torch.randint(1, cfg["vocab_size"], (b, a.prompt), generator=torch.Generator().manual_seed(b)).to(dev)
        kw = dict(do_sample=a.sample, pad_token_id=0, **(dict(temperature=0.7, top_k=50, top_p=0.9) if a.sample else {}))
        for on in (False, True):
            d.device_loop = on
            with torch.no_grad():
                full = _fastest(model, ids, dict(kw, max_new_tokens=a.new, min_new_tokens=a.new), a.reps, dev)
                one = _fastest(model, ids, dict(kw, max_new_tokens=1), a.reps, dev)
            print(f"{b:>5} {str(on):>11} {1e3 * full:>9.2f} {1e3 * one:>8.2f} {1e6 * (full - one) / (a.new - 1):>13.1f}",
                  flush=True)
    print("stats:", model._forge_graphs.stats.as_dict(), "device-loop calls", d.loop_calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
