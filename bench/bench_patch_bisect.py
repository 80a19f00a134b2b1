"""Where fusion pays on a whole model: eager, each forge kernel alone, all of them together,
torch.compile, forge under torch.compile and Liger-Kernel, side by side in one process.

    python bench/bench_patch_bisect.py --model qwen2.5-0.5b --mode train --batch 4 --seq-len 1024 \
        [--backend triton|pallas|triton,pallas] [--guard-stats] [--min-elements N] [--lora [R,ALPHA,DROPOUT[,MODULE...]]] [--compile] [--liger] [--graphs]
    python bench/bench_patch_bisect.py --quick      # tiny CPU smoke test (interpreters)

"train" is a forward with labels plus backward (all parameters trainable, or only the LoRA
adapters with --lora); "infer" a forward under no_grad. Median step time over --steps steps after
warm-up; peak memory from torch after warm-up (and JAX's own peak for the pallas backend: torch
cannot see it; with --graphs, the graph pools' bytes that no live tensor holds are added, since
torch's allocated-bytes counter does not see the activations the replays write there).
Writes bench_patch_bisect-<model>-<mode>-<B>x<S>[-lora[-R_ALPHA_DROPOUT]]-<backend>[-compile][-liger]-<device>.{json,csv,png}
into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import _common as bc  # noqa: E402
import forge  # noqa: E402
from forge.patching.graphs import graph_pool_bytes  # noqa: E402
from presets import PRESETS, add_step_arguments, build, is_moe  # noqa: E402

COLUMNS = ["variant", "step_ms", "speedup", "speedup_vs_eager_again", "vs_first_backend", "peak_MiB", "mem_frac",
           "reserved_MiB", "reserved_frac", "above_fixed_frac", "graph_held_MiB", "jax_peak_MiB", "compile_s",
           "graph_breaks", "note"]


def fixed_mib(model, mode) -> float:
    """MiB no kernel can shrink: the parameters, and in training a gradient for each trainable one."""
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    if mode == "train":
        total += sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return total / 2**20
ALL_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_config(spec: str):
    """``R,ALPHA,DROPOUT[,MODULE...]`` -> peft LoraConfig keywords (every projection by default).
    A MODULE naming a mixture of experts' 3-D weight (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``) goes to peft's ``target_parameters`` (peft wants DROPOUT 0 then)."""
    parts = spec.split(",")
    if len(parts) < 3:
        raise argparse.ArgumentTypeError(f"--lora takes R,ALPHA,DROPOUT[,MODULE...], got {spec!r}")
    r, alpha, drop = int(parts[0]), float(parts[1]), float(parts[2])
    names = list(parts[3:] or ALL_PROJ)
    params = [n for n in names if "experts." in n]
    cfg = dict(r=r, lora_alpha=alpha, lora_dropout=drop, bias="none",
               target_modules=[n for n in names if n not in params])
    if params:
        cfg["target_parameters"] = params
    return cfg


def _lora(model, spec):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(**lora_config(spec)))


def _jax_peak_mib():
    if "jax" not in sys.modules:
        return None
    try:
        import jax

        st = jax.devices()[0].memory_stats() or {}
        return st.get("peak_bytes_in_use", 0) / 2**20
    except Exception:  # noqa: BLE001
        return None


def _step_fn(model, mode, ids):
    if mode == "infer":
        def step():
            with torch.no_grad():
                return model(input_ids=ids).logits
        return step

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        for p in model.parameters():
            p.grad = None
        return out.loss
    return step


def _time(step, steps, warmup):
    """Step times (ms) of ``steps`` steps after ``warmup`` untimed ones; the peak-memory
    counter restarts after the warm-up (a graph capture's transient is not a step's)."""
    for _ in range(warmup):
        step()
    bc.sync()
    _reset_peak()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        bc.sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return ts


def _reset_peak():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak(row, model=None):
    if torch.cuda.is_available():
        held = graph_pool_bytes(model) if model is not None else 0
        row["peak_MiB"] = max(row.get("peak_MiB") or 0, (torch.cuda.max_memory_allocated() + held) / 2**20)
        row["reserved_MiB"] = max(row.get("reserved_MiB") or 0, torch.cuda.max_memory_reserved() / 2**20)
        if held:  # part of peak_MiB: graph-pool bytes no live tensor holds
            row["graph_held_MiB"] = held / 2**20
    row["jax_peak_MiB"] = _jax_peak_mib()


def _run(name, model, a, ids, compile_=False):
    row = {"variant": name}
    _reset_peak()
    target = model
    if compile_:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        target = torch.compile(model)
        t0 = time.perf_counter()
        _step_fn(target, a.mode, ids)()
        bc.sync()
        row["compile_s"] = time.perf_counter() - t0
        row["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    row["step_ms"] = statistics.median(_time(_step_fn(target, a.mode, ids), a.steps, a.warmup))
    _peak(row)
    return row




def _rounds(variants, model, a, ids, impls=()):
    """Time the patchable variants (eager, each kernel, all) in ``a.rounds`` rotations, patching
    and unpatching each time: this host's step time drifts by tens of percent over minutes and
    between processes, and a rotation spreads the drift over every variant alike. Step time is
    the median over all timed steps; the note gives the spread of the per-round medians."""
    rows = {label: {"variant": label} for label, _, _ in variants}
    times = {label: [] for label, _, _ in variants}
    per_round = {label: [] for label, _, _ in variants}
    for r in bc.progress(range(a.rounds), "rounds"):
        for label, ks, kw in variants:
            row = rows[label]
            if impls:  # transformers' experts implementation (forge's experts node replaces either)
                model.set_experts_implementation(kw.get("experts_impl", impls[0]) if ks is False else impls[0])
            if ks is not False:
                kw = {"min_elements": a.min_elements, "backend": a.backends[0], **kw}
                forge.patch(model, mode=a.mode, kernels=ks, **kw)
                row["note"] = f"patched {dict(model._forge_patched_counts)}"
            warm = a.warmup if r == 0 else 1
            if kw.get("graphs"):  # captured at a shape's second call: keep the capture out of the timing
                warm = max(warm, 3)
            ts = _time(_step_fn(model, a.mode, ids), a.steps, warm)
            _peak(row, model)
            if kw.get("graphs") and r == 0:
                row["graphs"] = model._forge_graphs.stats.as_dict()
            times[label] += ts
            per_round[label].append(statistics.median(ts))
            if ks is None and a.guard_stats and r == 0:
                gs = model._forge_guard_stats
                gs.reset()
                _step_fn(model, a.mode, ids)()
                row["guard"] = gs.as_dict()
                print("guard stats (one step):", gs.as_dict())
            if ks is not False:
                forge.unpatch(model)
    first = f"forge {a.backends[0]}: "
    for label, row in rows.items():
        row["step_ms"] = statistics.median(times[label])
        spread = f"round medians {min(per_round[label]):.1f}-{max(per_round[label]):.1f} ms"
        row["note"] = f"{row.get('note', '')} {spread}".strip()
        # another backend's variant against the first backend's same variant, round by round (the
        # two ran back to back in each round): the ratio this host's drift moves least
        peer = first + label.split(": ", 1)[1] if label.startswith("forge ") and not label.startswith(first) else None
        if peer in per_round:
            ratios = [x / y for x, y in zip(per_round[label], per_round[peer])]
            row["vs_first_backend"] = statistics.median(ratios)
            row["note"] += f" per-round ratio to {a.backends[0]} {min(ratios):.3f}-{max(ratios):.3f}"
        if row.get("guard"):
            row["note"] += f" guard {row.pop('guard')}"
        if row.get("graphs"):
            row["note"] += f" graphs (round 1) {row.pop('graphs')}"
    return list(rows.values())


def _plot(rows, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [r["variant"] for r in rows if r.get("step_ms")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].barh(names, [r["speedup"] for r in rows if r.get("step_ms")])
    axes[0].axvline(1.0, color="k", lw=0.6)
    axes[0].set_xlabel("speed-up over eager")
    axes[1].barh(names, [r.get("mem_frac") or 0 for r in rows if r.get("step_ms")])
    axes[1].axvline(1.0, color="k", lw=0.6)
    axes[1].set_xlabel("peak memory / eager's")
    return bc.save_figure(fig, title, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_arguments(p)
    p.add_argument("--backend", default="triton",
                   help="triton, pallas, or both comma-separated (every 'all' variant per backend, same rotation)")
    p.add_argument("--guard-stats", action="store_true")
    p.add_argument("--min-elements", type=int, default=None)
    p.add_argument("--alt-min-elements", type=json.loads, default=None, metavar="JSON",
                   help='also time every kernel under this guard in the same rotation, e.g. \'{"swiglu": 0}\'')
    p.add_argument("--lora", nargs="?", const="16,32,0.05", default=None, metavar="R,ALPHA,DROPOUT[,MODULE...]",
                   help="peft LoRA (bare --lora: r=16, alpha 32, dropout 0.05 on q,k,v,o,gate,up,down)")
    p.add_argument("--compile", action="store_true", help="also torch.compile(model) and forge under compile")
    p.add_argument("--compile-kernels", default=None, metavar="K1,K2;K3",
                   help="with --compile: also forge patched with only these kernels, then compiled "
                        "(';' separates subsets), e.g. fused_linear_ce")
    p.add_argument("--liger", action="store_true", help="also Liger-Kernel (runs last: it patches globally)")
    p.add_argument("--graphs", action="store_true",
                   help="also every kernel with the decoder layers in CUDA graphs (forge.patch(graphs=True))")
    p.add_argument("--recompute-mlp", action="store_true",
                   help="also every kernel with forge.patch(recompute_mlp=True) (with --graphs: graphs too)"),
    p.add_argument("--experts-impl", default="grouped_mm", metavar="IMPL[,IMPL...]",
                   help="MoE presets: transformers' experts implementation(s) timed unpatched (grouped_mm, eager); "
                        "the first is the baseline every ratio is taken to")
    p.add_argument("--pallas-native-rows", action="store_true",
                   help="the Pallas loss's row chunks natively launched (bridge.fused_linear_ce.NATIVE_ROWS)")
    p.add_argument("--lora-cfg", default=None, metavar="JSON|FILE",
                   help="launch settings of the Triton LoRA kernels to use, {kernel: setting} "
                        "(forge_triton.lora_kernels.CFG), or a tune_lora_kernels.json (its 'best')")
    p.add_argument("--no-single", action="store_true", help="skip the one-kernel-at-a-time variants")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=3, help="rotations over the patchable variants")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny preset on CPU, a few seconds")
    bc.add_out_argument(p)
    a = p.parse_args(argv)
    a.backends = a.backend.split(",")
    if a.pallas_native_rows:
        import bridge.fused_linear_ce as bridge_flce

        bridge_flce.NATIVE_ROWS = True
    if a.lora_cfg:
        from forge_triton import lora_kernels

        cfg = json.loads(Path(a.lora_cfg).read_text()) if Path(a.lora_cfg).is_file() else json.loads(a.lora_cfg)
        cfg = cfg.get("best", cfg)
        for k, v in cfg.items():
            if k not in lora_kernels.CFG or len(v) != len(lora_kernels.CFG[k]):
                p.error(f"--lora-cfg: {k}={v} is no setting of forge_triton.lora_kernels.CFG")
            lora_kernels.CFG[k] = tuple(v)
        print("Triton LoRA kernels' settings:", dict(lora_kernels.CFG))
    if any(b not in ("triton", "pallas") for b in a.backends):
        p.error(f"--backend: triton, pallas or both, not {a.backend!r}")
    if a.quick:
        a.model = "tiny-moe" if is_moe(a.model) else "tiny"
        a.batch, a.seq_len, a.steps, a.warmup, a.rounds, a.layers = 1, 16, 1, 1, 1, None
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build(a.model, dtype, dev, layers=a.layers)
    lora_arg = a.lora
    if a.lora and is_moe(a.model) and len(a.lora.split(",")) == 3:
        a.lora += ",q_proj,k_proj,v_proj,o_proj"  # the attention (the experts' 3-D weights are no Linear modules)
    if a.lora:
        model = _lora(model, a.lora)
    model.train(a.mode == "train")
    if not a.lora and a.mode == "train":
        model.requires_grad_(True)
    vocab = PRESETS[a.model]["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (a.batch, a.seq_len), generator=g).to(dev)

    moe = is_moe(a.model)
    glu = "experts" if moe else "geglu" if PRESETS[a.model]["model_type"].startswith("gemma") else "swiglu"
    keys = ["rmsnorm", glu, "rope"] + (["fused_linear_ce"] if a.mode == "train" else [])
    if a.lora and a.mode == "train":
        keys += ["lora_qkv", "lora_o"] + ([] if moe else ["lora_mlp"])
    base = "peft (eager)" if a.lora else "eager"
    impls = a.experts_impl.split(",") if moe else []
    if moe:
        bad = [i for i in impls if i not in ("grouped_mm", "eager")]
        if bad or not hasattr(model, "set_experts_implementation"):
            p.error(f"--experts-impl: grouped_mm or eager (transformers 5.x), not {bad or a.experts_impl!r}")
        base = f"{base} [experts {impls[0]}]"
    # (label, kernels, patch keywords); kernels False: unpatched, a list: those alone, None: all
    def every(kw, backend):
        extra = "".join(f" + {k}" for k in kw if k != "min_elements")
        guard = f", min_elements={json.dumps(kw['min_elements'])}" if "min_elements" in kw else ""
        return (f"forge {backend}: all{extra}{guard}", None, {**kw, "backend": backend})

    b0 = a.backends[0]
    variants = [(base, False, {})] + [(base.replace(impls[0], i), False, {"experts_impl": i}) for i in impls[1:]]
    variants += [] if a.no_single else [(f"forge {b0}: {k}", [k], {}) for k in keys]
    configs = [{}]
    if a.alt_min_elements is not None:
        configs.append({"min_elements": a.alt_min_elements})
    if a.mode == "train" and a.recompute_mlp:  # (recompute_mlp fuses the MLP at every size)
        configs.append({"recompute_mlp": True})
    if a.graphs:  # captured calls fuse whatever the guard says
        configs.append({"graphs": True})
        if a.recompute_mlp and a.mode == "train":
            configs.append({"graphs": True, "recompute_mlp": True})
    # each configuration's backends back to back, so their per-round ratio sees the least drift
    variants += [every(kw, b) for kw in configs for b in a.backends]
    rows = _rounds(variants, model, a, ids, impls)
    rotated = len(rows)  # the rows after these ran once each, outside the rotation
    if a.compile and dev.type == "cuda":
        rows.append(_run("torch.compile", model, a, ids, compile_=True))
        extras = [{}] + ([{"recompute_mlp": True}] if a.recompute_mlp and a.mode == "train" else [])
        extras += [{"kernels": ks.split(",")} for ks in (a.compile_kernels or "").split(";") if ks]
        for kw in extras:
            label = f"forge {b0}{''.join(f' + {k}' for k in kw if k != 'kernels')}" + (
                f" [{', '.join(kw['kernels'])}]" if "kernels" in kw else "") + " + torch.compile"
            torch._dynamo.reset()
            forge.patch(model, mode=a.mode, backend=b0, min_elements=a.min_elements, **kw)
            try:
                rows.append(_run(label, model, a, ids, compile_=True))
            except Exception as e:  # noqa: BLE001 - report, do not hide
                rows.append({"variant": label, "note": f"failed: {type(e).__name__}: {e}"[:300]})
            forge.unpatch(model)
        torch._dynamo.reset()
    if a.compile or a.liger:  # drift check: eager once more, after the long compile runs
        rows.append(_run(f"{base} (again)", model, a, ids))
    if a.liger and dev.type == "cuda":
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            _apply_liger_kernel_to_instance(model=model.get_base_model() if a.lora else model)
            rows.append(_run("liger-kernel", model, a, ids))
        except Exception as e:  # noqa: BLE001
            rows.append({"variant": "liger-kernel", "note": f"unavailable: {type(e).__name__}: {e}"[:300]})
    eager = rows[0]
    # torch.compile and Liger-Kernel ran after the rotation, once each: their ratio to the eager
    # run just before them ("(again)") as well, which the host's drift since round one spares
    again = next((r for r in rows if r.get("variant") == f"{base} (again)" and r.get("step_ms")), None)
    for r in rows[rotated:]:
        if again is not None and r.get("step_ms") and r is not again:
            r["speedup_vs_eager_again"] = again["step_ms"] / r["step_ms"]
    fixed = fixed_mib(model, a.mode)  # (reserved memory above it: what activations and scratch take)
    for r in rows:
        if r.get("step_ms"):
            r["speedup"] = eager["step_ms"] / r["step_ms"]
        if r.get("peak_MiB") and eager.get("peak_MiB"):
            r["mem_frac"] = r["peak_MiB"] / eager["peak_MiB"]
        if r.get("reserved_MiB") and eager.get("reserved_MiB"):
            r["reserved_frac"] = r["reserved_MiB"] / eager["reserved_MiB"]
            if eager["reserved_MiB"] > fixed:
                r["above_fixed_frac"] = (r["reserved_MiB"] - fixed) / (eager["reserved_MiB"] - fixed)
    title = f"{a.model} {a.mode} {a.batch}x{a.seq_len}{' lora ' + a.lora if a.lora else ''} ({a.backend})"
    print(title)
    bc.print_table(rows, COLUMNS)
    extra = {"args": vars(a), "title": title, "fixed_MiB": fixed}
    # runs that add torch.compile or Liger-Kernel are their own case: a plain re-run keeps them
    lora_tag = "" if not a.lora else "-lora" + ("" if lora_arg == "16,32,0.05" else "-" + lora_arg.replace(",", "_"))
    case = (f"{a.model}{f'-{a.layers}l' if a.layers else ''}-{a.mode}-{a.batch}x{a.seq_len}{lora_tag}-{'-'.join(a.backends)}"
            f"{'-compile' if a.compile else ''}{'-liger' if a.liger else ''}")
    jpath, cpath = bc.write_results(a.out, "bench_patch_bisect", rows, extra, case=case)
    png = _plot(rows, jpath.with_suffix(".png"), title)
    print(f"wrote {jpath}\n      {cpath}" + (f"\n      {png}" if png else ""))
    return rows


if __name__ == "__main__":
    main()
