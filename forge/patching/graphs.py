"""CUDA graphs around the decoder layers: ``forge.patch(model, graphs=True)``.

A small model's step is host-bound: at Qwen2.5-0.5B train 4 x 1024 the H200 is busy ~32 ms of
a ~70 ms forge step, at infer 4 x 1024 ~8 ms of ~16 (docs/lab-notes.md, session 3); the
rest is Hugging Face's Python and torch's per-op dispatch, ~40 launches per layer forward and ~80
backward. With graphs on, each decoder layer's forward and backward are captured once per input
shape and replayed: one launch each, whatever forge's kernels and the layer's own ops inside.

What is captured, per *set* (one per kind of pass: grad mode on or off, the layers' training
flag, the hidden states' shape, dtype, device and requires_grad, cos/sin's shapes and dtypes):
for every layer, its forward (the layer's own forward with forge's kernels patched inside; the
size guard always fuses there, since a replay pays no host time per kernel) and, with grad mode
on, its backward (``torch.autograd.grad`` of the layer's output with respect to its input and
trainable parameters), captured in the order a step runs them: forward 0..N-1, then backward
N-1..0. All sets share one private memory pool: a set's capture reuses the memory other sets'
graphs hold between their passes, so several shapes cost about the largest one's activations,
not their sum, and no pass replays while another set's pass still waits for its backward. A forward without grad (inference, evaluation) replays its
forward graphs alone. The second call of a new kind captures (two warm-up passes, then the
capture: about a second at Qwen2.5-0.5B's size; a shape seen once, such as a one-off prompt,
is never captured); at most ``MAX_SETS`` sets are kept. A forward without grad into an empty
``DynamicCache`` (a prefill, HF's default ``use_cache=True``) is captured too: the graphs write
the keys and values, which the replay hands to the cache's ``update``.

Memory: each layer's activations live in the pool at fixed addresses (as many as eager autograd
keeps at the end of a forward), held between calls until ``forge.unpatch``. torch's
``memory_allocated`` does not count pool memory that no live tensor holds
(``graph_pool_bytes`` does; bench_patch_bisect adds it to the peak it reports). Layer i+1 reads
layer i's output buffer in place; the hidden-state gradient goes through one buffer shared by all
layers, the parameter gradients through one flat buffer shared by all layers; both are cloned per
layer in backward, so no gradient autograd hands on aliases graph memory (``.grad`` accumulates
as usual).

A call replays only when replaying is safe and gives what the uncaptured forward would; else it
runs the forward as patched without graphs (counted in ``stats``, with the reason):

- the pass: no gradient checkpointing, no autocast, CUDA hidden states, ``attention_mask``
  None (the causal mask left to SDPA), no KV cache but an empty ``DynamicCache`` without grad
  (the fused loss asks the decoder for none in training; ``generate()``'s decoding steps are
  captured whole by ``decode.py`` in mode="infer"), attention ``sdpa`` or ``eager`` (position_ids
  unused), ``output_router_logits`` false (a mixture of experts' loop passes it; when true,
  transformers records the routers' outputs with hooks), no other arguments, no hooks on the
  layers or their modules (transformers' output-recording hooks count only while a call
  records), fewer hidden-state elements than DEVICE_BOUND_ELEMENTS (for a mixture
  of experts whose expert weights take no gradient, up to MOE_BOUND_SCALE times more),
  parameters the same tensors at the same addresses with the same requires_grad as captured;
- the layers are called in order 0..N-1, each on the previous one's output with the same cos/sin
  (anything else ends the pass's replay, and the rest of the pass runs uncaptured);
- no earlier replay still waits for its backward: a second forward before the first's backward
  would overwrite the activations that backward reads. A forward whose graph was dropped
  without a backward (evaluation with grad on, an exception) does not block.

A second backward through a replayed layer (``retain_graph=True``) raises: the first backward's
buffers were reused. Graphs capture Triton kernels and Pallas kernels launched natively on
torch's stream (bridge/native/); where that path is unavailable (JAX would launch on its own
stream, outside torch's capture) ``graphs=True`` with a Pallas layer kernel is refused at patch
time, and a Pallas pass the native path declines fails its capture, which then runs uncaptured.

Under torch.compile each layer call that fits is one op, ``forge::graph_layer``, which runs the
same pass logic when the compiled code calls it (see "Under torch.compile" below): the compiled
step replays the layers' graphs, and inductor compiles what lies around them (embedding, final
norm, the loss's op). ``mode="reduce-overhead"`` is refused while inductor traces (its CUDA
graphs would capture forge's replays).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import weakref

import torch
from torch import nn

from ..ops.gated_mlp import _any_autocast
from ..spec._check import no_double_backward
from . import experts as _experts
from .guard import CAPTURE

log = logging.getLogger("forge")

MAX_SETS = 4          # input shapes captured per model; calls of further shapes run uncaptured
MAX_CAPTURES = 8      # captures per patch (a set dropped for changed parameters is captured again)
WARMUP = 2            # passes before capture (Triton compiles, cuBLAS and SDPA pick kernels)
ATTN_OK = ("sdpa", "eager")
# A pass whose hidden states hold this many elements (rows x hidden) or more runs uncaptured: its
# layers are bound by the device, so a replay saves no time, and the graphs would hold their
# activations' pool besides (H200, docs/performance.md: Qwen2.5-0.5B train 8x2048, 14.7M
# elements, replayed 1.51x eager against 1.52x uncaptured; Llama-3-8B train 4x1024, 16.8M,
# 1.15x against 1.21x with 13.5 GB held; 4x1024 at 0.5B, 3.7M, 2.78x against 1.32x).
DEVICE_BOUND_ELEMENTS = 1 << 23
# A mixture of experts' layer does about top_k / num_experts of a dense layer's products per row
# of hidden state, behind more host work (routing, grouped products, adapters): where its expert
# weights take no gradient (LoRA, inference) its passes stay host-bound to larger sizes, and the
# bound above is scaled by num_experts / top_k, at most by this. Where they do (a full fine-tune)
# their weight-gradient products bind the device as a dense layer's do: the bound stays. (H100,
# docs/moe.md, 4 x 1024 at 2^23 elements: OLMoE-1B-7B, top-8 of 64, LoRA 76.6 ms replayed against
# 96.9 uncaptured, Qwen3-30B-A3B at 16 layers 87.2 against 151; full fine-tune of the latter 125
# against 120.)
MOE_BOUND_SCALE = 8
# arguments HF's decoder loops pass; position_ids / cache_position / num_items_in_batch are not
# read by sdpa or eager attention without a cache; a mixture of experts' loop passes
# output_router_logits on to its layers, which no layer reads (transformers records the router
# logits with forward hooks on the routers, which keep a pass uncaptured: see _hooked)
_KWARGS = frozenset({"attention_mask", "position_embeddings", "position_ids", "cache", "past_key_values",
                     "use_cache", "cache_position", "num_items_in_batch", "output_router_logits"})
_module_mod = nn.modules.module


def decoder_layers(root):
    """The decoder's layer list (``root.<base_model_prefix>.layers``), or a reason why not."""
    decoder = getattr(root, getattr(root, "base_model_prefix", "model"), None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return None, f"{type(root).__name__} has no decoder layer list (.{root.base_model_prefix}.layers)"
    for i, layer in enumerate(layers):
        if "forward" in layer.__dict__:
            return None, f"decoder layer {i} already has an instance-level forward (hooks of another library)"
    return list(layers), None


def _inert_recorder(hook) -> bool:
    """transformers' output-recording hook while no call records: transformers installs it on
    the layers (hidden states, attentions) or the routers (router logits) the first time a call
    asks for them, and leaves it there; between such calls it returns at once, so a replay that
    skips it loses nothing. While a call records (or for any other hook) this is False."""
    if getattr(hook, "__name__", None) != "output_capturing_hook":
        return False
    collector = getattr(sys.modules.get(getattr(hook, "__module__", None) or ""), "_active_collector", None)
    try:
        return collector is not None and collector.get() is None
    except Exception:  # noqa: BLE001 - another library's hook of that name: a hook like any other
        return False


def _is_experts(m) -> bool:
    return _experts.is_experts(type(m), m)


def _bound_scale(config, mods) -> int:
    """How much larger a pass of these layers whose expert weights take no gradient may be than
    DEVICE_BOUND_ELEMENTS and stay worth capturing: num_experts / top_k (at most
    MOE_BOUND_SCALE) where a layer holds a mixture of experts, else 1."""
    if not any(_is_experts(m) for ms in mods for m in ms):
        return 1
    e = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    k = getattr(config, "num_experts_per_tok", None)
    if not (isinstance(e, int) and isinstance(k, int) and 0 < k <= e):
        return 1
    return max(1, min(MOE_BOUND_SCALE, e // k))


def graph_pool_bytes(model, whole: bool = False) -> int:
    """Bytes held by ``model``'s graph pool that no live tensor holds (invisible to torch's
    ``memory_allocated``; replays write there), or with ``whole`` all of the pool's bytes (the
    live tensors in it too). 0 without graphs."""
    g = getattr(model, "_forge_graphs", None)
    if g is None or g.pool is None:
        return 0
    held = 0
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) == g.pool:
            held += sum(b["size"] for b in seg["blocks"] if whole or b["state"] != "active_allocated")
    return held


class _Token:
    """One replayed layer forward, kept by its autograd node; the layer keeps a weak reference."""

    __slots__ = ("done", "__weakref__")

    def __init__(self):
        self.done = False


class _Layer:
    # g, flat: the set's shared gradient buffers (held here, not the set: no reference cycle, so
    # unpatch frees the graphs and their pool at once, never in a garbage collection mid-capture)
    __slots__ = ("g", "flat", "fwd", "bwd", "x", "out", "params", "grad_mask", "nflat", "x_grad", "copy_in", "last",
                 "kv", "grad")


class _Set:
    """The graphs of every layer for one input shape, and the buffers they share."""

    def __init__(self, grad):
        self.grad = grad
        self.layers: list[_Layer] = []
        self.cos = self.sin = self.g = self.flat = None
        self.recorder = self.cache_name = None  # a prefill into an empty KV cache
        self.checks: list = []  # (module, name, tensor, data_ptr, requires_grad) per param/buffer
        self.epoch = workspace_epoch()  # (captured after this many cuBLAS workspace clears)

    def unchanged(self) -> bool:
        if self.epoch != workspace_epoch():
            return False  # torch's cuBLAS workspaces were cleared since the capture
        for mod, name, t, ptr, rg in self.checks:
            cur = mod._parameters.get(name) if rg is not None else mod._buffers.get(name)
            if cur is not t or t.data_ptr() != ptr or (rg is not None and t.requires_grad is not rg):
                return False
        return True

    def pending(self) -> bool:
        for lg in self.layers:
            t = lg.last() if lg.last is not None else None
            if t is not None and not t.done:
                return True
        return False


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lg, x, *params):
        if lg.copy_in:
            lg.x.copy_(x)
        lg.fwd.replay()
        tok = _Token()
        lg.last = weakref.ref(tok)
        ctx.lg, ctx.tok = lg, tok
        return lg.out.detach()

    @staticmethod
    @no_double_backward("graphs (a replayed decoder layer)")
    def backward(ctx, g):
        lg, tok = ctx.lg, ctx.tok
        if tok.done:
            raise RuntimeError(
                "forge graphs: a second backward through a replayed decoder layer (retain_graph=True) "
                "would read activations the first backward's graphs overwrote; patch with graphs=False")
        tok.done = True
        gx, flat = _replay_backward(lg, g)
        return (None, gx, *_param_grads(lg, flat))


def _replay_backward(lg, g):
    """Layer ``lg``'s backward graph for the output gradient ``g``: (dx or None, the trainable
    parameters' gradients flat, in the capture's layout, or None). Clones: the next backward
    replay overwrites the graph's buffers, and autograd may keep a gradient (a leaf's .grad,
    retain_grad)."""
    lg.g.copy_(g)
    lg.bwd.replay()
    return (lg.g.clone() if lg.x_grad else None), (lg.flat[:lg.nflat].clone() if lg.nflat else None)


def _param_grads(lg, flat):
    """Per trainable parameter of ``lg``, its gradient (a view of ``flat``) or None (unused)."""
    if flat is None:
        return [None] * len(lg.params)
    it = iter(torch._utils._unflatten_dense_tensors(flat, [p for p, m in zip(lg.params, lg.grad_mask) if m]))
    return [next(it) if m else None for m in lg.grad_mask]


class Stats:
    """Decoder passes replayed / run uncaptured (with why), layer-set captures, and generate()'s
    decoding steps replayed from their own graphs (``decode_*``, forge.patching.decode)."""

    __slots__ = ("replayed", "uncaptured", "captures", "why", "decode_replayed", "decode_captures", "decode_caches")

    def __init__(self):
        self.replayed = self.uncaptured = self.captures = 0
        self.decode_replayed = self.decode_captures = self.decode_caches = 0
        self.why: dict[str, int] = {}

    def count(self, why: str) -> None:
        self.why[why] = self.why.get(why, 0) + 1

    def as_dict(self):
        return {"replayed": self.replayed, "uncaptured": self.uncaptured, "captures": self.captures,
                "decode_replayed": self.decode_replayed, "decode_captures": self.decode_captures,
                "decode_caches": self.decode_caches, "why_uncaptured": dict(self.why)}

    def __repr__(self):
        return f"GraphStats({self.as_dict()})"


class _KVRecorder:
    """Stands in for an empty KV cache while a prefill is captured: ``update`` keeps the key and
    value states it is given (the graph's static tensors) and returns them, as an empty
    DynamicCache layer returns what it was given."""

    def __init__(self):
        self.kv: dict[int, tuple] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kv[layer_idx] = (key_states, value_states)
        return key_states, value_states


_STREAMS: dict = {}  # device -> the process's capture stream
_EPOCH = [0]  # how many times torch's cuBLAS workspaces were cleared since watch_workspaces()


def workspace_epoch() -> int:
    return _EPOCH[0]


def watch_workspaces() -> None:
    """Count every clear of torch's cuBLAS workspaces (``torch._C._cuda_clearCublasWorkspaces``,
    which torch.compile's CUDA graph trees call before and after each recording). A graph captured
    before a clear points at the workspace it freed, and replaying it would let cuBLAS scribble
    on whatever the allocator put there since; forge's graphs remember the count they were
    captured at and are captured again instead (``workspace_epoch``). Wraps the function once;
    the wrapper only counts and calls it."""
    f = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if f is None or getattr(f, "_forge_counts", False):
        return

    def clear(*args, **kwargs):
        _EPOCH[0] += 1
        return f(*args, **kwargs)

    clear._forge_counts = True
    torch._C._cuda_clearCublasWorkspaces = clear


def capture_stream(dev) -> "torch.cuda.Stream":
    """One capture stream per device for every set of every model. One per set would keep the
    allocator from reusing the memory of the sets before it (a freed block is reused only on
    the stream that freed it); one per model leaked: cuBLAS keeps a workspace per (handle,
    stream) for the life of the process, so every patched-and-deleted model left its workspaces
    behind (~98 MiB per cycle on the H200)."""
    side = _STREAMS.get(dev)
    if side is None:
        side = _STREAMS[dev] = torch.cuda.Stream(device=dev)
    return side


# (torch's default is "global": a CUDA call that may synchronise, made by any thread of the process
# while a capture runs, invalidates it; "thread_local" checks the capturing thread's own calls)
CAPTURE_MODE = "thread_local"


@contextlib.contextmanager
def recording(graph, owner, stream):
    """``torch.cuda.graph(graph, pool=owner.pool, stream=stream)`` (the pool made on first use),
    which leaves the process as it found it when the capture fails (a kernel that cannot be
    captured, a host sync inside). torch then leaves three things behind (torch 2.11, an H100:
    docs/generate.md, "A failed capture"): the capture stream as the current one; the allocator
    recording into the pool, which no later capture into it can begin; the CUDA generators in
    their capture state, so that every later random draw of the process fails. This restores
    the stream, drops the pool for a fresh one (graphs captured into the old one keep theirs)
    and heals the generators with one capture that succeeds: its end takes them out of that
    state."""
    if owner.pool is None:
        owner.pool = torch.cuda.graph_pool_handle()
    pool, dev = owner.pool, stream.device
    cur = torch.cuda.current_stream(dev)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE):
            yield
    except BaseException:
        torch.cuda.set_stream(cur)
        try:
            torch._C._cuda_endAllocateToPool(dev.index, pool)
        except RuntimeError:  # torch ended it ("not currently recording")
            pass
        owner.pool = None
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):  # (a pool of its own)
                torch.empty(1, device=dev).zero_()
        except Exception as e:  # noqa: BLE001 - the capture's own error is the one raised
            log.warning("forge graphs: no capture succeeds after a failed one (%s: %s); random draws on %s may "
                        "fail", type(e).__name__, str(e)[:200], dev)
            torch.cuda.set_stream(cur)
        raise


class Graphs:
    """Per patched model: the captured sets and the state of the pass in flight."""

    def __init__(self, root, layers, forwards):
        self.root, self.layers, self.forwards = root, layers, forwards
        self.sets: dict[tuple, _Set] = {}
        self.pool = None  # one private memory pool for every set
        self.seen: dict[tuple, int] = {}  # keys seen once: captured the second time
        self.failed: dict[tuple, str] = {}  # (grad, cache) -> why its capture failed
        self.stats = Stats()
        self.paused = False  # a decoding step of forge.patching.decode runs: the layers run uncaptured
        self.decode = None  # forge.patching.decode's Decoder, when installed
        self._mods = [list(layer.modules()) for layer in layers]
        self.bound_scale = _bound_scale(root.config, self._mods)
        self._expert_weights = [p for ms in self._mods for m in ms if _is_experts(m) for p in m.parameters()]
        try:
            from transformers.cache_utils import DynamicCache as _DC
        except ImportError:  # pragma: no cover - every supported transformers has it
            _DC = None
        self._dynamic_cache = _DC
        self.cur: _Set | None = None
        self.nxt = 0
        self.last_out = self.pcos = self.psin = self.pcache = None
        self.gid = _register(self)  # how a compiled trace's ops find this object (traced_layer)
        self.op_pending: dict[int, tuple] = {}  # layer -> its op forward, until its backward op

    def __deepcopy__(self, memo):
        return self  # copy.deepcopy(model): the copy's layers call this object and run uncaptured

    # -- one decoder pass --------------------------------------------------------------------
    def call(self, i, layer, x, args, kwargs):
        """The layer's output from its graph, or None: run the uncaptured forward."""
        lg = self._enter(i, layer, x, args, kwargs)
        if lg is None:
            return None
        if lg.grad:
            out = _Replay.apply(lg, x, *lg.params)
        else:  # no autograd: the forward's graph alone
            if lg.copy_in:
                lg.x.copy_(x)
            lg.fwd.replay()
            out = lg.out.detach()
            if lg.kv is not None:  # the prefill's keys and values into the caller's cache
                kwargs.get("cache", kwargs.get("past_key_values")).update(*lg.kv)
        self._advance(i, out)
        return out

    def _enter(self, i, layer, x, args, kwargs, op=None):
        """Layer ``i``'s captured graphs for this call (a ``_Layer``), or None: run uncaptured.
        ``op``: (grad, x_grad) when called from the traced op (:func:`traced_layer`), where grad
        mode is the trace's, the hidden states are copied into the graph's input, and so are
        cos / sin unless they are the tensor the pass began with (the same address, held here);
        None in an eager call (both read off the call)."""
        if self.paused or layer is not self.layers[i]:
            return None  # a decoding step captured whole, or a deep copy of the model
        if i == 0:
            self.cur = None
            grad, x_grad = op if op is not None else (torch.is_grad_enabled(), x.requires_grad)
            why = self._begin(layer, x, args, kwargs, grad, x_grad)
            if why is not None:
                self.stats.uncaptured += 1
                self.stats.why[why] = self.stats.why.get(why, 0) + 1
                return None
        s = self.cur
        if s is None:
            return None
        pe = kwargs.get("position_embeddings")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if op is not None:
            broken = self.nxt != i
            if not broken and (pe[0].data_ptr() != self.pcos.data_ptr() or pe[1].data_ptr() != self.psin.data_ptr()):
                # inductor may hand each op call its own copy of cos / sin: take this call's
                s.cos.copy_(pe[0])
                s.sin.copy_(pe[1])
                self.pcos, self.psin = pe
        else:
            broken = (self.nxt != i or args or (i and x is not self.last_out) or type(pe) is not tuple
                      or pe[0] is not self.pcos or pe[1] is not self.psin
                      or kwargs.get("attention_mask") is not None or cache is not self.pcache)
        if broken:
            self._end()  # out of step with the capture: the rest of this pass runs uncaptured
            self.stats.why["pass broken"] = self.stats.why.get("pass broken", 0) + 1
            return None
        return s.layers[i]

    def _advance(self, i, out):
        if i + 1 == len(self.layers):
            self._end()
            self.stats.replayed += 1
        else:
            self.nxt, self.last_out = i + 1, out

    # -- the same, as ops inside a compiled trace (traced_layer) ------------------------------
    def traceable(self, i, layer, x, args, kwargs) -> bool:
        """Whether a layer call inside a torch.compile trace becomes the op: what the trace
        can know (the call's arguments, the model's settings: :meth:`_unfit`, with no KV cache
        at all); the rest is decided per call at run time, as in eager."""
        if self.paused or layer is not self.layers[i] or x.device.type not in OP_DEVICES:
            return False
        if layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks or layer._backward_pre_hooks:
            return False  # (FSDP2 hooks each layer): traced as it is; a submodule's hooks run it uncaptured
        if len({p.dtype for p in layer.parameters() if p.requires_grad}) > 1:
            return False  # (the backward hands the gradients back in one flat buffer)
        return self._unfit(layer, args, kwargs, torch.is_grad_enabled(), traced=True) is None

    def op_forward(self, i, x, cos, sin, grad, x_grad):
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "forge graphs: a decoder layer replay was called inside another CUDA graph capture (torch.compile "
                "with mode='reduce-overhead'?); forge.patch(graphs=True) already captures the layers: use one of them")
        layer = self.layers[i]
        kwargs = {"attention_mask": None, "position_embeddings": (cos, sin)}
        if i == 0:
            self.op_pending.clear()  # a pass whose backward never ran (its backward op now raises)
        with _autograd_on(), torch.set_grad_enabled(grad):
            lg = self._enter(i, layer, x, (), kwargs, (grad, x_grad))
            if lg is None:
                xi = x.detach().requires_grad_(x_grad)
                out = self.forwards[i](layer, xi, **kwargs)
                if grad:
                    self.op_pending[i] = (None, xi, out)
                return out.detach()
            lg.x.detach().copy_(x)  # (a leaf that requires grad: its storage, outside autograd)
            lg.fwd.replay()
            out = lg.out.clone()
            if grad:
                tok = _Token()
                lg.last = weakref.ref(tok)
                self.op_pending[i] = (lg, tok)
        self._advance(i, out)
        return out

    def op_backward(self, i, g, params):
        """(dx, the parameters' gradients flat in their order): one buffer, which the traced
        backward splits into views (an op's outputs may not alias one another)."""
        e = self.op_pending.pop(i, None)
        if e is None:
            raise RuntimeError(
                f"forge graphs: under torch.compile, decoder layer {i}'s backward found no forward waiting for it: "
                "another forward ran before this backward (it reused the activations this backward needs), or this "
                "is a second backward of one forward. Run each forward's backward before the next forward, or "
                "patch with graphs=False")
        lg = e[0]
        flat = None
        if lg is None:  # the forward ran uncaptured, recorded by autograd inside the op
            _, xi, out = e
            ps = [p for p in self.layers[i].parameters() if p.requires_grad]
            inputs = ([xi] if xi.requires_grad else []) + ps
            with _autograd_on(), torch.enable_grad():
                gs = list(torch.autograd.grad(out, inputs, g, allow_unused=True)) if out.requires_grad else []
            gs += [None] * (len(inputs) - len(gs))
            gx = gs.pop(0) if xi.requires_grad else None
        else:
            e[1].done = True
            ps = lg.params
            gx, flat = _replay_backward(lg, g) if (lg.x_grad or lg.nflat) else (None, None)
            if flat is None or not all(lg.grad_mask):  # (else already the op's layout)
                gs, flat = _param_grads(lg, flat), None
        if len(ps) != len(params):
            raise RuntimeError(f"forge graphs: decoder layer {i} has {len(ps)} trainable parameters, the compiled "
                               f"trace {len(params)}: compile the model again")
        if flat is None:
            flat = torch.cat([(d if d is not None else torch.zeros_like(p)).reshape(-1) for d, p in zip(gs, params)]
                             ) if params else g.new_empty(0)
        return gx if gx is not None else torch.zeros_like(g), flat

    def _end(self):
        self.cur, self.last_out, self.pcos, self.psin, self.pcache = None, None, None, None, None

    def _unfit(self, layer, args, kwargs, grad, traced=False):
        """Why a pass with these arguments and settings cannot replay, or None: the checks an
        eager pass's start and a trace (``traced``: no KV cache at all) share."""
        if args or any(k not in _KWARGS for k in kwargs):
            return "arguments other than HF's decoder loop's"
        if kwargs.get("attention_mask") is not None:
            return "attention mask"
        if kwargs.get("output_router_logits"):
            return "router logits recorded"
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and (traced or grad or type(cache) is not self._dynamic_cache
                                  or cache.get_seq_length() != 0):
            return "KV cache (not an empty DynamicCache in a forward without grad)"
        pe = kwargs.get("position_embeddings")
        if type(pe) is not tuple or len(pe) != 2 or not all(isinstance(t, torch.Tensor) for t in pe):
            return "no position_embeddings (cos, sin)"
        if grad and layer.training and getattr(layer, "gradient_checkpointing", False):
            return "gradient checkpointing"
        if _any_autocast():
            return "autocast"
        if getattr(self.root.config, "_attn_implementation", None) not in ATTN_OK:
            return f"attention implementation not in {ATTN_OK}"
        return None

    def _begin(self, layer, x, args, kwargs, grad, x_grad):
        why = self._unfit(layer, args, kwargs, grad)
        if why is not None:
            return why
        if not isinstance(x, torch.Tensor) or type(x) not in (torch.Tensor, nn.Parameter) or not x.is_cuda:
            return "hidden states not a CUDA tensor"
        bound = DEVICE_BOUND_ELEMENTS * (1 if grad and any(p.requires_grad for p in self._expert_weights)
                                         else self.bound_scale)
        if x.numel() >= bound:
            return f"bound by the device (hidden states of {bound} elements or more)"
        if self._hooked():
            return "module hooks"
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        pe = kwargs.get("position_embeddings")
        kind = (grad, cache is not None)
        if kind in self.failed:
            return self.failed[kind]
        cos, sin = pe
        # (inference mode: a set captured under it holds inference tensors, which a pass outside
        # it could not copy its input into)
        key = (*kind, layer.training, tuple(x.shape), x.dtype, x.device, x_grad, tuple(cos.shape),
               cos.dtype, tuple(sin.shape), sin.dtype, torch.is_inference_mode_enabled())
        s = self.sets.get(key)
        if s is not None and not s.unchanged():
            del self.sets[key]  # parameters replaced, moved or (un)frozen, or cuBLAS workspaces
            # cleared (see watch_workspaces), since the capture:
            self.seen[key] = 1  # captured again now (the shape does come back)
            s = None
        if s is None:
            n = self.seen.get(key, 0) + 1
            if n < 2:  # a shape seen once may never come back: capture it the second time
                if len(self.seen) > 256:
                    self.seen.clear()
                self.seen[key] = n
                return "first call of this shape"
            if len(self.sets) >= MAX_SETS:
                return f"more than {MAX_SETS} shapes captured"
            if self.stats.captures >= MAX_CAPTURES:
                return f"more than {MAX_CAPTURES} captures"
            s = self._capture(key, kind, x, x_grad, cos, sin, "cache" if "cache" in kwargs else "past_key_values")
            if s is None:
                return self.failed[kind]
            self.seen.pop(key, None)
        if any(o.grad and o.pending() for o in self.sets.values()):
            return "an earlier replay's backward has not run"
        s.cos.copy_(cos)
        s.sin.copy_(sin)
        self.cur, self.nxt, self.pcos, self.psin, self.pcache = s, 0, cos, sin, cache
        return None

    def _hooked(self) -> bool:
        if (_module_mod._global_forward_hooks or _module_mod._global_forward_pre_hooks
                or _module_mod._global_backward_hooks or _module_mod._global_backward_pre_hooks):
            return True
        for mods in self._mods:
            for m in mods:
                if m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                    return True
                if m._forward_hooks and not all(map(_inert_recorder, m._forward_hooks.values())):
                    return True
        return False

    # -- capture -----------------------------------------------------------------------------
    def _run(self, i, x, s):
        kw = {s.cache_name: s.recorder, "use_cache": True} if s.recorder is not None else {}
        return self.forwards[i](self.layers[i], x, attention_mask=None, position_embeddings=(s.cos, s.sin), **kw)

    def _capture(self, key, kind, x0, x_grad, cos, sin, cache_name):
        try:
            s = self._capture_set(kind, x0, x_grad, cos, sin, cache_name)
        except Exception as e:  # noqa: BLE001 - never break the call: this kind runs uncaptured from now on
            self.failed[kind] = f"capture failed ({type(e).__name__}: {str(e)[:200]})"
            logging.getLogger("forge").warning("forge graphs: %s; such calls run uncaptured", self.failed[kind])
            torch.cuda.synchronize()
            return None
        self.sets[key] = s
        self.stats.captures += 1
        return s

    def _capture_set(self, kind, x0, x_grad, cos, sin, cache_name):
        watch_workspaces()
        s = _Set(kind[0])
        if kind[1]:
            s.recorder, s.cache_name = _KVRecorder(), cache_name
        dev = x0.device
        for layer in self.layers:
            for mod in layer.modules():
                for name, p in mod._parameters.items():
                    if p is not None:
                        s.checks.append((mod, name, p, p.data_ptr(), p.requires_grad))
                for name, b in mod._buffers.items():
                    if b is not None:
                        s.checks.append((mod, name, b, b.data_ptr(), None))
        trainable = [[p for p in layer.parameters() if p.requires_grad and s.grad] for layer in self.layers]
        if any(len({p.dtype for p in ps}) > 1 for ps in trainable):
            raise ValueError("a layer's trainable parameters are of more than one dtype")
        s.cos, s.sin = cos.detach().clone(), sin.detach().clone()
        s.g = torch.zeros_like(x0)
        nflat = max((sum(p.numel() for p in ps) for ps in trainable), default=0)
        pdtype = next((ps[0].dtype for ps in trainable if ps), x0.dtype)
        s.flat = torch.zeros(max(nflat, 1), dtype=pdtype, device=dev)
        x_in = torch.zeros_like(x0).requires_grad_(x_grad)
        side = capture_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        # The capture differentiates with respect to aliases of the trainable parameters (same
        # storage, new leaves), swapped into the modules for its duration: the parameters' own
        # autograd nodes, which a live graph of the caller's may hold on the default stream,
        # would make autograd synchronise with that stream inside the capture (invalidating it).
        alias = {id(p): nn.Parameter(p.detach(), requires_grad=True) for ps in trainable for p in ps}
        swapped = [(mod, name, p) for mod, name, p, _ptr, rg in s.checks if rg and id(p) in alias]
        leaves = [[alias[id(p)] for p in ps] for ps in trainable]
        gc.collect()  # garbage from earlier captures is freed now, not by a collection mid-capture
        gc_was = gc.isenabled()
        gc.disable()
        CAPTURE.on = True
        try:
            for mod, name, p in swapped:
                mod._parameters[name] = alias[id(p)]
            self._warm_up(x_in, s, leaves, side)
            torch.cuda.current_stream(dev).wait_stream(side)
            if s.recorder is not None:
                s.recorder.kv.clear()
            outs, xs = [], []
            for i in range(len(self.layers)):
                lg = _Layer()
                lg.g, lg.flat, lg.last, lg.grad = s.g, s.flat, None, s.grad
                lg.fwd, lg.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                lg.copy_in = i == 0
                xi = x_in if i == 0 else outs[-1].detach().requires_grad_(outs[-1].requires_grad)
                with recording(lg.fwd, self, side):
                    out = self._run(i, xi, s)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"decoder layer {i} returned {type(out).__name__}, not a tensor")
                lg.x, lg.x_grad, lg.params = xi, xi.requires_grad, trainable[i]
                lg.kv = None
                if s.recorder is not None:  # the keys and values this layer's graph writes
                    (idx, (k, v)), = s.recorder.kv.items()
                    lg.kv = (k, v, idx)
                    s.recorder.kv.clear()
                outs.append(out)
                xs.append(xi)
                s.layers.append(lg)
            for i in reversed(range(len(self.layers))):
                lg, out = s.layers[i], outs[i]
                outs[i] = None
                inputs = ([xs[i]] if lg.x_grad else []) + leaves[i]
                lg.grad_mask, lg.nflat = [False] * len(lg.params), 0
                if out.requires_grad and inputs:
                    with recording(lg.bwd, self, side):
                        self._capture_backward(lg, out, inputs, s)
                lg.out = out.detach()
                del out
            return s
        finally:
            for mod, name, p in swapped:
                mod._parameters[name] = p
            CAPTURE.on = False
            if gc_was:
                gc.enable()

    def _warm_up(self, x_in, s, leaves, side):
        """The capture's per-layer calls, outside it: Triton compiles, cuBLAS and SDPA choose.
        The RNG is restored after them (LoRA dropout draws masks): the replay that ends the
        capturing call then draws what the uncaptured call would have."""
        with torch.random.fork_rng(devices=[x_in.device]), torch.cuda.stream(side):
            for _ in range(WARMUP):
                h = x_in
                for i in range(len(self.layers)):
                    out = self._run(i, h, s)
                    inputs = ([h] if h.requires_grad else []) + leaves[i]
                    if out.requires_grad and inputs:
                        torch.autograd.grad(out, inputs, grad_outputs=s.g, allow_unused=True)
                    h = out.detach().requires_grad_(out.requires_grad)

    @staticmethod
    def _capture_backward(lg, out, inputs, s):
        grads = torch.autograd.grad(out, inputs, grad_outputs=s.g, allow_unused=True)
        if lg.x_grad:
            gx, grads = grads[0], grads[1:]
            s.g.copy_(gx if gx is not None else torch.zeros_like(s.g))
        lg.grad_mask = [g is not None for g in grads]
        used = [g.reshape(-1) for g in grads if g is not None]
        if used:
            lg.nflat = sum(u.numel() for u in used)
            torch.cat(used, out=s.flat[:lg.nflat])


def layer_forward(graphs, i, orig):
    """Decoder layer ``i``'s forward: its graph's replay, or ``orig`` (the layer's forward as
    patched, uncaptured) when the call does not fit the capture. Inside a torch.compile trace a
    call that fits (:meth:`Graphs.traceable`) is one ``forge::graph_layer`` op (see
    :func:`traced_layer`); any other is traced as ``orig``."""
    def forward(self, hidden_states, *args, **kwargs):
        if torch.compiler.is_compiling():
            if graphs.traceable(i, self, hidden_states, args, kwargs):
                return traced_layer(graphs, i, self, hidden_states, kwargs["position_embeddings"])
            return orig(self, hidden_states, *args, **kwargs)
        out = graphs.call(i, self, hidden_states, args, kwargs)
        return out if out is not None else orig(self, hidden_states, *args, **kwargs)

    return forward


# ---------------------------------------------------------------------------------------------
# Under torch.compile: each decoder layer one op
#
# A layer call inside a compiled trace becomes ``torch.ops.forge.graph_layer(x, cos, sin,
# params, gid, i, grad, x_grad)``: opaque to inductor, with a fake (same shape as x) and a
# registered backward, ``forge::graph_layer_backward(g, params, gid, i) -> [dx, *dparams]``. At
# run time the op finds the model's Graphs by ``gid`` and runs the same pass logic as an eager
# call: the layer's captured forward (the hidden states copied into the graph's input, its
# output cloned out of the pool: inductor may write over a buffer an op handed it once it is
# dead, and the next layer's graph reads the previous one's output in place), or, where the
# capture does not fit (its first call, a CPU tensor, hooks, a changed parameter), the layer's
# patched forward, recorded and differentiated by autograd inside the op. The backward op
# replays the layer's backward graph, or differentiates that recording. The pending forwards
# are kept per layer until their backward: a forward that starts a new pass first drops any
# pass whose backward never ran, and that pass's backward, if it comes later, raises.
# Parameters a layer does not use get zero gradients, not None (an op's list output holds
# tensors only).

OP_DEVICES = ("cuda",)  # hidden states on these device types take the op inside a trace
_LIVE: dict = {}  # gid -> weak reference to its Graphs
_NEXT_GID = [0]
_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView))


def _register(g) -> int:
    _NEXT_GID[0] += 1
    gid = _NEXT_GID[0]
    _LIVE[gid] = weakref.ref(g, lambda _r, gid=gid: _LIVE.pop(gid, None))
    return gid


def _live(gid: int) -> "Graphs":
    r = _LIVE.get(gid)
    g = r() if r is not None else None
    if g is None:
        raise RuntimeError("forge graphs: this compiled code calls the decoder layers of a model that was unpatched "
                           "or deleted since it was compiled; compile the model again")
    return g


def _autograd_on():
    """An op's implementation runs below autograd (the dispatcher excludes its keys); the
    uncaptured layer and the capture record and differentiate the layer themselves."""
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS)


def traced_layer(graphs, i, layer, x, pe):
    """Inside a torch.compile trace: layer ``i`` as one ``forge::graph_layer`` op."""
    grad = torch.is_grad_enabled()
    params = [p for p in layer.parameters() if p.requires_grad] if grad else []
    return torch.ops.forge.graph_layer(x, pe[0], pe[1], params, graphs.gid, i, grad, grad and x.requires_grad)


_OPS_LOCK = threading.Lock()


def register_ops() -> None:
    """``forge::graph_layer`` and its backward (once per process; forge.patch(graphs=True) calls it)."""
    with _OPS_LOCK:
        if hasattr(torch.ops.forge, "graph_layer"):
            return
        @torch.library.custom_op("forge::graph_layer", mutates_args=(), schema=(
            "(Tensor x, Tensor cos, Tensor sin, Tensor[] params, int gid, int i, bool grad, bool x_grad) -> Tensor"))
        def graph_layer(x, cos, sin, params, gid, i, grad, x_grad):
            return _live(gid).op_forward(i, x, cos, sin, grad, x_grad)

        @graph_layer.register_fake
        def _(x, cos, sin, params, gid, i, grad, x_grad):
            from torch._inductor import config as inductor_config

            # (inductor's options are in force while it traces: the earliest point that knows)
            if inductor_config.triton.cudagraphs:
                raise RuntimeError(
                    "forge.patch(graphs=True) replays its own CUDA graphs of the decoder layers, and "
                    "torch.compile(mode='reduce-overhead') would capture those replays inside its own graphs: "
                    "compile with the default mode, or patch with graphs=False")
            return torch.empty_like(x)

        @torch.library.custom_op("forge::graph_layer_backward", mutates_args=(),
                                 schema="(Tensor g, Tensor[] params, int gid, int i) -> (Tensor, Tensor)")
        def graph_layer_backward(g, params, gid, i):
            return _live(gid).op_backward(i, g, params)

        @graph_layer_backward.register_fake
        def _(g, params, gid, i):
            n = sum(p.numel() for p in params)
            return torch.empty_like(g), g.new_empty(n, dtype=params[0].dtype if params else g.dtype)

        def setup_context(ctx, inputs, output):
            _x, _cos, _sin, params, gid, i, _grad, x_grad = inputs
            ctx.gid, ctx.i, ctx.x_grad = gid, i, x_grad
            ctx.save_for_backward(*params)

        def backward(ctx, g):
            params = ctx.saved_tensors
            gx, flat = torch.ops.forge.graph_layer_backward(g, list(params), ctx.gid, ctx.i)
            grads = [t.view(p.shape) for t, p in zip(flat.split([p.numel() for p in params]), params)]
            return gx if ctx.x_grad else None, None, None, grads, None, None, None, None

        graph_layer.register_autograd(backward, setup_context=setup_context)
