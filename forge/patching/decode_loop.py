"""generate() with the host out of the loop: the device loop (``model._forge_graphs.decode.device_loop``).

Where a ``generate()`` call is one forge can serve whole (greedy or sampling with temperature,
top-k and top-p; eos ids, ``max_new_tokens`` / ``max_length``, ``min_new_tokens`` /
``min_length``; a left-padded batch; no streamer, no other logits processor or stopping
criterion, a plain token tensor returned), forge runs the call's decoding steps itself: after
the prompt's forward (as today, into forge's static cache), each step picks the next token on
the device, appends it to a device buffer, updates the finished flags (a finished row gets the
pad token, as transformers' loop does) and feeds the next step. ``CHUNK`` such steps are one
captured graph; the host replays it and reads the finished flags once per chunk (one wait for
the device per ``CHUNK`` tokens), and ends with a captured single step for the tail so that
``max_new_tokens`` is exact. The tokens after the step where every row had finished are cut
off, so the result is what transformers' ``generate()`` returns.

The call reaches this module through transformers' ``custom_generate`` hook (a callable in place
of ``_sample``, called after transformers resolved the generation config and built the logits
processors and stopping criteria); ``decode.Decoder.generate`` passes it. Anything this loop
cannot serve goes to transformers' own decoding method with the same arguments, the reason
counted as ``"device loop: <reason>"``.

Selection: greedy is ``argmax`` of the processed scores, as transformers. Sampling draws by an
exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)`` per token (the index is distributed as
``p``), from torch's own generator (``torch.manual_seed`` reproduces a run; in a CUDA graph each
replay draws new numbers). It is not transformers' ``multinomial`` draw: same distribution,
other tokens. Temperature, top-k and top-p are transformers' own warpers, run on the device.

On the CPU (tests) the graph is ``decode_runtime.BACKEND``'s stand-in, and the steps run as
plain calls.
"""
from __future__ import annotations

import gc
import logging

import torch

from . import decode_runtime as rt
from .guard import CAPTURE

DEVICE_LOOP = True  # Decoder.device_loop's default (on since its GPU tests passed and it led the host loop)
CHUNK = 8  # decoding steps per captured graph (one device read per chunk)
WARMUP = 2  # uncaptured steps before the first capture on a cache (Triton compiles, cuBLAS picks)
log = logging.getLogger("forge")


def _warpers():
    from transformers.generation import logits_process as lp

    return (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper)


def _min_lengths():
    from transformers.generation import logits_process as lp

    return {lp.MinLengthLogitsProcessor: lambda p: p.min_length,
            lp.MinNewTokensLengthLogitsProcessor: lambda p: p.prompt_length_to_skip + p.min_new_tokens}


def _ints(x):
    return tuple(int(v) for v in torch.as_tensor(x).flatten().tolist())


class Plan:
    """What the call's logits processors and stopping criteria do, in a form the step runs on
    the device; ``key`` names a captured graph (values baked into it)."""

    def __init__(self, sample, procs, max_length, eos, pad, key):
        self.sample, self.procs, self.max_length, self.eos, self.pad, self.key = sample, procs, max_length, eos, pad, key

    @staticmethod
    def of(cfg, logits_processor, stopping_criteria):
        """(Plan, None), or (None, why this call is not one the loop serves)."""
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        if cfg.return_dict_in_generate:
            return None, "return_dict_in_generate"
        if getattr(cfg, "num_beams", 1) not in (None, 1):
            return None, "beam search"
        procs, key = [], [bool(cfg.do_sample)]
        mins = _min_lengths()
        for p in logits_processor:
            t = type(p)
            if t in _warpers():
                params = tuple(sorted((k, v) for k, v in vars(p).items() if isinstance(v, (bool, int, float))))
                procs.append(("warp", p))
                key.append((t.__name__, params))
            elif t in mins:
                eos = _ints(p.eos_token_id)
                procs.append(("min", (mins[t](p), eos)))
                key.append(("min", mins[t](p), eos))
            else:
                return None, f"logits processor {t.__name__}"
        max_length, eos = None, None
        for c in stopping_criteria:
            if type(c) is MaxLengthCriteria:
                max_length = c.max_length if max_length is None else min(max_length, c.max_length)
            elif type(c) is EosTokenCriteria:
                eos = _ints(c.eos_token_id) + (eos or ())
            else:
                return None, f"stopping criterion {type(c).__name__}"
        if max_length is None:
            return None, "no max_length"
        pad = cfg._pad_token_tensor if eos is not None else None
        if eos is not None and pad is None:
            return None, "eos ids without a pad token"
        pad = None if pad is None else int(pad)
        return Plan(bool(cfg.do_sample), procs, max_length, eos, pad, tuple(key) + (eos, pad)), None


class Loop:
    """The device loop's state on one static cache (``decode_runtime.CachedSteps``): static
    buffers the captured steps read and write, and the graphs per (plan key, steps)."""

    def __init__(self, slot, dev):
        b, c = slot.batch, slot.capacity
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731
        self.slot = slot
        self.ids, self.pos, self.out = z(b, 1), z(b, 1), z(b, c)  # next step's input; new tokens
        self.t, self.length, self.live = z(1), z(1), z(1)  # tokens appended; sequence length; steps with a row unfinished
        self.unfinished = torch.ones(b, dtype=torch.bool, device=dev)
        self.graphs: dict[tuple, object] = {}
        self.failed: dict[tuple, str] = {}
        self.ran = 0  # uncaptured steps on this cache (warm-up before the first capture)
        self.eos = None  # (plan.eos as a device tensor, for the plan in flight)
        self.min_eos = []  # per processor: (V,) bool, the eos ids of a min_length one
        self.consts: dict[tuple, tuple] = {}  # (plan key, vocabulary) -> (eos, min_eos), kept
        self.plan = None
        self.form = None
        self.forward = None

    def tensors(self):
        return [self.ids, self.pos, self.out, self.t, self.length, self.live, self.unfinished]

    # -- one step, all on the device ---------------------------------------------------------
    def select(self, logits):
        """The next token per row from (B, V) float32 logits, as transformers' loop picks it."""
        scores = logits
        for (kind, p), eos in zip(self.plan.procs, self.min_eos):
            if kind == "warp":
                scores = p(self.ids, scores)  # (transformers' warpers do not read the ids)
            else:  # min_length: eos is out while the sequence is shorter
                scores = scores.masked_fill(eos & (self.length < p[0]), -float("inf"))
        if not self.plan.sample:
            return scores.argmax(-1)
        probs = torch.softmax(scores, dim=-1)
        race = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)
        return (probs / race).argmax(-1)

    def append(self, nxt):
        """Append the chosen tokens (pad for rows already finished) and update the flags."""
        self.live += self.unfinished.any().long()
        if self.plan.eos is not None:
            nxt = torch.where(self.unfinished, nxt, self.plan.pad)
            self.unfinished &= ~torch.isin(nxt, self.eos)
        self.out.index_copy_(1, self.t, nxt[:, None])
        self.ids.copy_(nxt[:, None])
        self.t += 1
        self.length += 1

    def step(self):
        """One decoding step: the model's forward for the last token, selection, append."""
        slot = self.slot
        out = self.forward(input_ids=self.ids, position_ids=self.pos, attention_mask=slot.build(self.form))
        self.append(self.select(out.logits[:, -1].float()))
        self.pos += 1
        return self.t

    def steps(self, n):
        for _ in range(n):
            out = self.step()
        return out

    # -- the host side ---------------------------------------------------------------------------
    def start(self, plan, form, forward, mask2d, pos, length, vocab):
        """Set the buffers for a call: its plan, mask form and forward, the prompt's 2-D mask
        (None: no padding), position ids (B, L) and length, and the vocabulary size."""
        self.plan, self.form, self.forward = plan, form, forward
        # the plan's device constants: made before any capture (which cannot copy from the host),
        # and kept per plan, since its graphs read them at the addresses they were captured with
        if (plan.key, vocab) not in self.consts:
            dev = self.ids.device
            eos = None if plan.eos is None else torch.tensor(plan.eos, device=dev)
            mins = [None if kind == "warp" else torch.isin(torch.arange(vocab, device=dev), torch.tensor(p[1], device=dev))
                    for kind, p in plan.procs]
            self.consts[(plan.key, vocab)] = eos, mins
        self.eos, self.min_eos = self.consts[(plan.key, vocab)]
        slot = self.slot
        slot.load_keep(mask2d)
        if mask2d is not None:
            slot.keep[:, mask2d.shape[1]:] = True  # the new tokens' columns (a longer earlier call's stay)
        self.pos.copy_(pos[:, -1:] + 1)
        self.t.zero_()
        self.live.zero_()
        self.length.fill_(length)
        self.unfinished.fill_(True)

    def run(self, n, backend, owner, stats):
        """``n`` decoding steps: a captured graph's replay, or uncaptured (warm-up, a failed
        capture)."""
        key = (self.plan.key, n, self.form)
        g = self.graphs.get(key)
        if g is None and key not in self.failed and self.ran >= WARMUP:
            g = self._capture(key, n, backend, owner, stats)
        if g is not None:
            g.replay()
            stats.decode_replayed += 1
            return
        self.ran += n
        CAPTURE.on = True  # the kernels the capture records (fused at every size)
        try:
            with rt.step_kernels(self.slot):
                backend.warm(lambda: self.steps(n), owner, self.ids.device)
        finally:
            CAPTURE.on = False

    def _capture(self, key, n, backend, owner, stats):
        rt.watch_workspaces()
        self.slot.epoch = rt.workspace_epoch()
        saved = [t.clone() for t in self.tensors()]
        layers = [(ly, ly.cumulative_length.clone()) for ly in self.slot.cache.layers]
        gc.collect()
        gc_was = gc.isenabled()
        gc.disable()
        CAPTURE.on = True
        try:
            with rt.step_kernels(self.slot):
                graph, _ = backend.capture(lambda: self.steps(n), owner, self.ids.device)
        except Exception as e:  # noqa: BLE001 - never break generate(): these steps run uncaptured
            self.failed[key] = f"capture failed ({type(e).__name__}: {str(e)[:200]})"
            log.warning("forge decode: device loop %s; its steps run uncaptured", self.failed[key])
            if self.ids.device.type == "cuda":
                torch.cuda.synchronize(self.ids.device)
            return None
        finally:
            CAPTURE.on = False
            if gc_was:
                gc.enable()
            # a capture records without running (a stand-in runs): the state as before it
            for t, s in zip(self.tensors(), saved):
                t.copy_(s)
            for ly, s in layers:
                ly.cumulative_length.copy_(s)
        self.graphs[key] = graph
        stats.decode_captures += 1
        return graph


# -- the custom_generate hook ------------------------------------------------------------------
_SAMPLE_KWARGS = frozenset({"attention_mask", "position_ids", "use_cache", "logits_to_keep"})
_DECLINE = ("custom_generate", "assistant_model", "streamer", "synced_gpus", "tokenizer", "assistant_tokenizer",
            "trust_remote_code")


def why_not_hook(args, kwargs) -> str | None:
    """Why a generate() call cannot be handed to the loop through ``custom_generate`` (checked
    before transformers resolves anything), or None."""
    try:
        from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin  # noqa: F401
    except ImportError:
        return "this transformers has no GENERATION_MODES_MAPPING"
    if not hasattr(GenerationMixin, "_extract_generation_mode_kwargs"):
        return "this transformers' generate() takes no callable custom_generate"
    if len(args) > 1:
        return "positional arguments after the inputs"
    given = [k for k in _DECLINE if kwargs.get(k) is not None]
    if given:
        return f"{given[0]} given"
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return "torch.distributed with several ranks (synced_gpus)"
    return None


def _fallback(model, input_ids, logits_processor, stopping_criteria, cfg, synced_gpus, streamer, model_kwargs):
    """transformers' own decoding method for the call, as generate() would have called it."""
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    mode = cfg.get_generation_mode()
    name = GENERATION_MODES_MAPPING[mode]
    if "/" in name:  # generate() would have asked for trust_remote_code (given: no custom_generate passed)
        raise ValueError(f"{mode.name} was moved to a `custom_generate` repo (https://hf.co/{name}); "
                         f"it needs trust_remote_code=True")
    extra = {"synced_gpus": synced_gpus} if synced_gpus else {}
    if streamer is not None:
        extra["streamer"] = streamer
    return getattr(type(model), name)(model, input_ids, logits_processor=logits_processor,
                                      stopping_criteria=stopping_criteria, generation_config=cfg, **extra,
                                      **model_kwargs)


def generate(decoder, model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
             streamer=None, **model_kwargs):
    """transformers' ``custom_generate`` callable (its ``_sample``'s arguments): the device loop
    where it serves the call, else transformers' own decoding method."""
    args = (model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
            model_kwargs)
    why = _why_not(decoder, *args)
    if why is None:
        out, why = _serve(decoder, *args)
        if why is None:
            return out
        decoder.slot.reset()  # the prompt ran: transformers' method starts again from an empty cache
    if why:  # ("": already counted as "generate: <reason>")
        decoder.graphs.stats.count("device loop: " + why)
    return _fallback(*args)


def _why_not(d, model, input_ids, logits_processor, stopping_criteria, cfg, synced_gpus, streamer, model_kwargs):
    slot = d.slot
    mode = getattr(cfg.get_generation_mode(), "value", None)
    if mode not in ("greedy_search", "sample"):
        return f"generation mode {mode}"
    if slot is None or model_kwargs.get(d.cache_name) is not slot.cache:
        return ""  # forge's static cache does not serve the call: counted as "generate: <reason>"
    if not slot.buildable:
        return "sliding-window cache layers"
    if not d.servable:
        return f"{type(model).__name__} prepares its own generate() inputs"
    if synced_gpus or streamer is not None:
        return "synced_gpus or a streamer"
    if model._forward_hooks or model._forward_pre_hooks:  # (the loop calls the class's forward)
        return "forward hooks on the model"
    extra = model_kwargs.keys() - _SAMPLE_KWARGS - {d.cache_name}
    if extra:
        return f"arguments {sorted(extra)}"
    if model_kwargs.get("use_cache") is False:
        return "use_cache=False"
    if input_ids.dim() != 2 or input_ids.shape[1] < 2 or input_ids.device != d.device:
        return "input_ids not (batch, prompt of 2 or more) on the model's device"
    if not isinstance(model_kwargs.get("position_ids"), torch.Tensor):
        return "no position ids"
    return None


def _serve(d, model, input_ids, logits_processor, stopping_criteria, cfg, synced_gpus, streamer, model_kwargs):
    """(the generated sequences, None), or (None, why) with nothing generated."""
    import functools

    plan, why = Plan.of(cfg, logits_processor, stopping_criteria)
    if why is not None:
        return None, why
    slot, (b, n) = d.slot, input_ids.shape
    if not n < plan.max_length <= slot.capacity + 1:
        return None, f"max_length {plan.max_length} not in (prompt {n}, cache {slot.capacity} + 1]"
    # the prompt's forward, as transformers' loop runs it (forge's forward: into the static cache)
    if hasattr(type(model), "_prefill"):  # transformers 5.24 and later
        outputs = model._prefill(input_ids, cfg, model_kwargs)
    else:
        outputs = model(**type(model).prepare_inputs_for_generation(model, input_ids, **model_kwargs), return_dict=True)
    # the masks transformers would build for the first decoding step: of a form the step builds?
    kw = type(model)._update_model_kwargs_for_generation(model, outputs, dict(model_kwargs))
    nxt = torch.cat([input_ids, input_ids[:, -1:]], 1)
    prep = type(model).prepare_inputs_for_generation(model, nxt, next_sequence_length=1, **kw)
    mask = prep.get("attention_mask")
    form = rt.MaskForm.of(mask, b, slot.capacity)
    if not slot.matches(form, mask, kw.get("attention_mask")):
        return None, "transformers' decoding masks are not of a form the loop builds"
    if slot.loop is None:
        slot.loop = Loop(slot, input_ids.device)
    loop, g = slot.loop, d.graphs
    fwd = functools.partial(type(model).forward, model, **{d.cache_name: slot.cache}, return_dict=True,
                            **{k: model_kwargs[k] for k in ("use_cache", "logits_to_keep") if k in model_kwargs})
    logits = outputs.logits[:, -1].float()
    del outputs, prep, mask
    loop.start(plan, form, fwd, model_kwargs.get("attention_mask"), model_kwargs["position_ids"], n, logits.shape[-1])
    loop.append(loop.select(logits))  # the first new token, from the prompt's logits
    steps, done = plan.max_length - n - 1, 0
    g.paused = True  # (the layer graphs stand aside)
    try:
        while done < steps:
            k = CHUNK if steps - done >= CHUNK else 1
            loop.run(k, rt.BACKEND, g, g.stats)
            done += k
            if plan.eos is not None and k == CHUNK and not bool(loop.unfinished.any()):  # one device read
                break
    finally:
        g.paused = False
    count = int(loop.live)
    d.loop_calls += 1
    d.loop_tokens += count * b
    return torch.cat([input_ids, loop.out[:, :count]], 1), None
