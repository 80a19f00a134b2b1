"""The decoding-step runtime: one whole decoding step (every decoder layer, the final norm and the
LM head, the model's forward for one new token per sequence) captured in a CUDA graph on a
static KV cache, and replayed for every further token. ``forge.patching.decode`` installs it
into ``generate()``; this module knows nothing of generate.

A step's graph reads its inputs from static buffers (the token ids, the position ids and the
4-D attention masks transformers builds for a static cache, one per layer type) and writes the
logits to a static buffer; the KV cache's tensors (transformers' ``StaticCache``: keys, values
and each layer's ``cumulative_length`` counter, all updated in place by its ``update``) are read
and written by the graph at fixed addresses. A replay is: copy the inputs in, replay, and do the
bookkeeping the cache keeps in Python, which a replay does not run (a sliding-window layer's
``cumulative_length_int``).

Graphs are kept per call signature (the masks' shapes and dtypes, ``logits_to_keep``): the
first ``WARMUP`` steps of a signature run uncaptured (Triton compiles, cuBLAS and SDPA choose
their kernels), the next one captures and replays. A capture records kernels without running
them, but Python runs: the cache's Python-side counters are put back after it (and its device
counters, which a stand-in graph that does run the step, as the CPU tests use, has advanced).

Masks built in the graph. On a cache of full-attention layers only, transformers' 4-D mask for
one new token at cache position p is, per row b and key j, ``keep[b, j] and j <= p`` (``keep``:
the 2-D padding mask generate holds; bool for SDPA, 0 / the dtype's lowest for eager; one tensor,
or the same one under each key of a dict by layer type). A step whose masks were checked equal to
that (:meth:`CachedSteps.check`, on the uncaptured warm-up steps, against the masks transformers
built) is captured in the *built* form: the graph computes the masks from a static ``keep``
buffer and the cache's own position counter, so a replay needs only the 2-D mask copied in, and
generate need not build 4-D masks at all (``decode.Decoder.prepare``). Otherwise the step is
captured in the *given* form, with the masks at static addresses, copied in per replay.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..spec import row_linear
from .graphs import capture_stream, recording, watch_workspaces, workspace_epoch
from .guard import CAPTURE, STEP, version

WARMUP = 2  # uncaptured steps of a signature before its capture


_ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _packed_sdpa(orig, attention, module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 is_causal=None, **kwargs):
    """transformers' SDPA attention for one new token per sequence, the cache read as it is (no
    ``repeat_kv``: transformers 5.17 repeats the whole static cache per layer and step, 1.4 GB of
    copies per step at batch 32 with a 512-token cache, Qwen2.5-0.5B). With ``attention`` (the
    backend's decoding kernel, ``forge.spec.decode_attention``): that kernel, which splits the
    cache's length over the GPU's SMs. Without it: SDPA with the query heads of a KV head as that
    head's query rows, (B, H, 1, D) -> (B, H_kv, H / H_kv, D). The same products and softmax per
    query head either way. A model without grouped KV heads (OLMoE: 16 heads, 16 KV heads) takes
    the kernel too (G = 1; cuDNN's SDPA took 8 us a layer at OLMoE batch 1, H100), else its own
    SDPA, which reads its cache as it is. Any other call goes to ``orig``."""
    groups = getattr(module, "num_key_value_groups", 1)
    b, h, q, d = query.shape
    mask_ok = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1
                                         and attention_mask.shape[2] == 1)
    if (q != 1 or groups < 1 or (groups == 1 and attention is None) or h != key.shape[1] * groups or not mask_ok or dropout
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or kwargs.get("output_attentions")):
        return orig(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    is_causal=is_causal, **kwargs)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[2]]  # (B, 1, 1, L): shared by the rows
    if (attention is not None and query.dtype in _ATTN_DTYPES and key.dtype is query.dtype
            and value.dtype is query.dtype and value.shape == key.shape):
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, 0, 0]  # (B or 1, L): a mask shared by the batch broadcasts
            if mask.shape[0] != b:
                mask = mask.expand(b, -1)
        out = attention(query[:, :, 0], key, value, mask, scaling)
        return out.view(b, 1, h, d), None
    out = F.scaled_dot_product_attention(query.reshape(b, h // groups, groups, d), key, value,
                                         attn_mask=attention_mask, dropout_p=0.0, scale=scaling)
    return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


class _Swap:
    """The one process-wide swap of transformers' "sdpa" entry that every :func:`packed_gqa` in
    flight shares: installed by the first to enter, put back by the last to leave (in whatever
    order they leave: two threads decoding on two models). Each thread's calls take the kernel
    of its own innermost packed_gqa; a thread with none in flight gets the original."""
    lock = threading.Lock()
    users = 0
    had = before = orig = None
    mine = threading.local()  # .kernels: this thread's stack of decoding kernels (or None)


def _swapped(*args, **kwargs):
    kernels = getattr(_Swap.mine, "kernels", None)
    if not kernels:
        return _Swap.orig(*args, **kwargs)
    return _packed_sdpa(_Swap.orig, kernels[-1], *args, **kwargs)


@contextlib.contextmanager
def packed_gqa(attention=None):
    """While a decoding step runs uncaptured or is captured: transformers' "sdpa" attention of
    this thread through :func:`_packed_sdpa`, with ``attention`` the decoding kernel or None (a
    replay runs the kernels recorded then). The entry is swapped process-wide while any such
    step runs (:class:`_Swap`); other threads' calls go to the original."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns
    except ImportError:
        yield
        return
    local = getattr(fns, "_local_mapping", None)  # (GeneralInterface's per-instance overrides)
    if not isinstance(local, dict):
        yield
        return
    with _Swap.lock:
        if _Swap.users == 0:
            _Swap.had, _Swap.before, _Swap.orig = "sdpa" in local, local.get("sdpa"), fns["sdpa"]
            local["sdpa"] = _swapped
        _Swap.users += 1
    kernels = _Swap.mine.__dict__.setdefault("kernels", [])
    kernels.append(attention)
    try:
        yield
    finally:
        kernels.pop()
        with _Swap.lock:
            _Swap.users -= 1
            if _Swap.users == 0:
                if local.get("sdpa") is _swapped:  # (one registered since by the caller stays)
                    if _Swap.had:
                        local["sdpa"] = _Swap.before
                    else:
                        local.pop("sdpa", None)
                _Swap.had = _Swap.before = None  # (orig stays: a call that took the swapped
                # entry just before it went back still reaches it)


_PLAIN = (torch.Tensor, nn.Parameter)


_ADDS = (torch.Tensor.add, torch.add)


class _RowProducts(torch.overrides.TorchFunctionMode):
    """While a decoding step runs uncaptured or is captured: ``F.linear`` of one row (batch 1:
    q/k/v stored together, o, a router, the LM head; nn.Linear's forward and forge's own calls
    alike) runs ``kernel`` (a backend's ``forge.spec.row_linear``); every other call, and every
    other torch function, runs as it would. A replay runs what the capture recorded, so the mode
    costs host time only in the steps that warm up or capture. Taken: input and weight of one
    float dtype (16 or 32 bits) on one device, plain tensors (no subclass, no FSDP2 shard), a
    contiguous weight, a bias of that dtype or none, no gradient wanted and no autocast (which
    would cast first).

    With ``sums``, the residual additions ride on the products: a decoder layer adds o_proj's
    output (and a dense MLP's down product) to its residual stream right after the product. The
    mode keeps the last one-row tensor of each shape that an addition or the embedding made (the
    stream, as the layers hand it on); a product whose output has that shape and dtype also
    writes the sum with it, in the same launch (the kernel's ``r``), and the next addition of
    exactly those two tensors (the same objects, neither changed since: version counters) returns
    that sum instead of launching its own kernel. Any other addition runs as it would. The sum is
    the one torch's addition makes, bit for bit (forge.spec.row_linear); where the guess is wrong
    (a model that normalises the product first, as gemma2 does) the extra row written is the only
    cost.

    With ``glu`` (a backend's ``row_glu``), :meth:`gated` runs a gated MLP's gate/up product over
    its weights stored together and the activation in one launch (forge's MLP forward asks,
    through ``guard.STEP``)."""

    def __init__(self, kernel, sums=False, glu=None):
        super().__init__()
        self.kernel = kernel
        self.sums = sums
        self.glu = glu
        self.taken = 0  # calls the kernel ran (tests)
        self.summed = 0  # additions served by a product's sum (tests)
        self.glued = 0  # gate/up products the gated kernel ran (tests)
        self.streams: dict[tuple, torch.Tensor] = {}  # (shape, dtype, device) -> the last such row made
        self.pending = None  # (r, its version, y, its version, y + r): the last product's sum

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear and not kwargs and len(args) in (2, 3):
            out = self._one_row(*args)
            if out is not None:
                return out
        elif self.sums and func in _ADDS and not kwargs and len(args) == 2:
            out = self._sum(*args)
            if out is None:
                out = func(*args)
            self._note(out)
            return out
        elif self.sums and func is F.embedding:
            out = func(*args, **(kwargs or {}))
            self._note(out)
            return out
        return func(*args, **(kwargs or {}))

    def _note(self, t):
        if type(t) is torch.Tensor and t.dim() and t.numel() == t.shape[-1] and t.stride(-1) == 1:
            self.streams[(t.shape, t.dtype, t.device)] = t

    def _sum(self, a, b):
        p = self.pending
        if p is None:
            return None
        r, rv, y, yv, s = p
        if ((a is r and b is y) or (a is y and b is r)) and version(r) == rv and version(y) == yv:
            self.pending = None
            self.summed += 1
            return s
        return None

    @staticmethod
    def _fits(x, w, b=None) -> bool:
        if (type(x) is not torch.Tensor or type(w) not in _PLAIN or (b is not None and type(b) not in _PLAIN)
                or x.dtype not in row_linear.DTYPES or w.dtype != x.dtype or w.dim() != 2 or x.numel() != w.shape[1]
                or x.device != w.device or not w.is_contiguous() or x.stride(-1) != 1
                or (b is not None and (b.dtype != x.dtype or b.dim() != 1 or b.device != x.device))):
            return False
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
            return False
        return not torch.is_autocast_enabled(x.device.type)

    def gated(self, x, w, act):
        """``act(x W_g^T) * (x W_u^T)`` for ``w`` the gate's rows then the up's, in one launch of
        the gated kernel, for one row (the conditions of the one-row products); else None."""
        if self.glu is None or w.shape[0] % 2 or not self._fits(x, w):
            return None
        self.glued += 1
        return self.glu(x.reshape(1, -1), w, act).view(*x.shape[:-1], w.shape[0] // 2)

    def _one_row(self, x, w, b=None):
        if not self._fits(x, w, b):
            return None
        self.taken += 1
        shape = torch.Size((*x.shape[:-1], w.shape[0]))
        r = self.streams.get((shape, x.dtype, x.device)) if self.sums else None
        if r is None or (r.requires_grad and torch.is_grad_enabled()):  # (the sum would carry no graph)
            return self.kernel(x.reshape(1, -1), w, b).view(shape)
        y, s = self.kernel(x.reshape(1, -1), w, b, r.view(1, -1))
        y, s = y.view(shape), s.view(shape)
        self.pending = (r, version(r), y, version(y), s)
        return y


@contextlib.contextmanager
def step_kernels(slot):
    """What a decoding step of ``slot`` (a :class:`CachedSteps`) runs under while it warms up or
    is captured: :func:`packed_gqa` with its attention kernel, and its one-row product kernel
    (``slot.linear``, or None: cuBLAS) for ``F.linear`` of one row, with the residual additions
    after them where ``slot.sums`` and the gated MLPs' gate/up products with their activation
    where ``slot.glu`` (:class:`_RowProducts`)."""
    with packed_gqa(slot.attention):
        if slot.linear is None:
            yield
            return
        mode = _RowProducts(slot.linear, slot.sums, slot.glu)
        was, STEP.rows = STEP.rows, mode
        try:
            with mode:
                yield
        finally:
            STEP.rows = was
        slot.row_calls += mode.taken
        slot.row_sums += mode.summed
        slot.row_glus += mode.glued


class CudaGraphs:
    """Real CUDA graphs in the model's graph pool, captured on its capture stream (shared with
    forge.patching.graphs' layer sets: replays never overlap, so captures may reuse each other's
    temporaries). The CPU tests replace this object by one with the same three methods."""

    @staticmethod
    def why_not(device) -> str | None:
        if device.type != "cuda":
            return f"the model is on {device.type}, CUDA graphs need a CUDA device"
        return None

    @staticmethod
    def _streams(dev):
        """(the process's capture stream, the caller's), the former waiting for the latter."""
        side, cur = capture_stream(dev), torch.cuda.current_stream(dev)
        if side != cur:
            side.wait_stream(cur)
        return side, cur

    @staticmethod
    @contextlib.contextmanager
    def serve(dev):
        """A generate() call forge serves runs on the capture stream, the caller's stream waiting
        for it at the end: its uncaptured calls (the prefill, the warm-ups) and its replays then
        use the capture stream's cuBLAS workspace, which the graphs use anyway (torch keeps one
        per stream for the life of the process, 33 MiB on the H200). On the caller's stream they
        would keep a second one in use."""
        if dev.type != "cuda" or torch.cuda.is_current_stream_capturing():
            yield
            return
        side, cur = CudaGraphs._streams(dev)
        if side == cur:
            yield
            return
        try:
            with torch.cuda.stream(side):
                yield
        finally:
            cur.wait_stream(side)

    def warm(self, fn, owner, dev):
        """An uncaptured step on the capture stream (cuBLAS keeps a workspace per stream)."""
        side, cur = self._streams(dev)
        with torch.cuda.stream(side):
            out = fn()
        if side != cur:
            cur.wait_stream(side)
        return out

    def capture(self, fn, owner, dev):
        """(graph, fn's output tensor at its static address); the kernels are recorded, not run."""
        side, cur = self._streams(dev)
        graph = torch.cuda.CUDAGraph()
        with recording(graph, owner, side):
            out = fn()
        if side != cur:
            cur.wait_stream(side)
        return graph, out


BACKEND = CudaGraphs()


LARGE = 1 << 20  # the caching allocator's smallest "large" allocation (bytes): its own segment


@contextlib.contextmanager
def logits_outside_pool(head, batch):
    """While a step is captured: the LM head (a plain ``nn.Linear`` without bias; any other head
    is left alone) writes the step's (batch, 1, vocab) logits into a buffer allocated before the
    capture, outside the graph pool, which it yields (None where left alone). In the pool, logits
    of 1 to 10 MiB (batch 4 to 32 at a 152k vocabulary in bf16) would take a segment of 20 MiB
    there, which no allocation outside the graphs can use; outside it they cost what eager's do.
    Logits under ``LARGE`` stay in the pool: they share the 2 MiB segment the step's small
    temporaries take there anyway. The product is the one ``F.linear`` runs for such an input
    (one matrix product, no bias)."""
    w = getattr(head, "weight", None)
    if (type(head) is not nn.Linear or head.bias is not None or type(w) not in _PLAIN
            or "forward" in head.__dict__ or head._forward_hooks or head._forward_pre_hooks
            or batch * w.shape[0] * w.element_size() < LARGE):
        yield None
        return
    buf = torch.empty(batch, 1, w.shape[0], dtype=w.dtype, device=w.device)

    def forward(x):
        if (x.dtype != w.dtype or x.shape[:-1] != buf.shape[:-1]
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return nn.Linear.forward(head, x)
        torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out=buf.view(-1, w.shape[0]))
        return buf

    head.forward = forward
    try:
        yield buf
    finally:
        del head.forward


def _static(x):
    """A static-address copy of a mask (a tensor, None, or a dict of them by layer type)."""
    if isinstance(x, dict):
        return {k: _static(v) for k, v in x.items()}
    return None if x is None else x.detach().clone()


def _copy_into(dst, src):
    if isinstance(dst, dict):
        for k, v in dst.items():
            _copy_into(v, src[k])
    elif dst is not None:
        dst.copy_(src)


def mask_signature(mask):
    """The masks' structure, shapes and dtypes, or None if they are not tensors (e.g. flex
    attention's BlockMask), which a static buffer cannot hold."""
    if isinstance(mask, dict):
        items = []
        for k in sorted(mask):
            sig = mask_signature(mask[k])
            if sig is None:
                return None
            items.append((k, sig))
        return ("dict", tuple(items))
    if mask is None:
        return ("none",)
    if type(mask) is not torch.Tensor:
        return None
    return (tuple(mask.shape), mask.dtype, mask.device)


class _Step:
    __slots__ = ("graph", "ids", "pos", "mask", "form", "logits", "template")


class MaskForm:
    """How a step's masks follow from the 2-D padding mask and the cache position (see the module
    docstring): their dtype, and the dict keys they sit under (None: one tensor)."""

    __slots__ = ("dtype", "keys", "fill")

    def __init__(self, dtype, keys):
        self.dtype, self.keys = dtype, keys
        self.fill = None  # (0, lowest) as tensors on the device, for a float mask

    def __eq__(self, other):
        return isinstance(other, MaskForm) and (self.dtype, self.keys) == (other.dtype, other.keys)

    def __hash__(self):
        return hash((self.dtype, self.keys))

    @staticmethod
    def of(mask, batch, capacity):
        """The form ``mask`` would have if built from a 2-D mask, or None (not one (B, 1, 1, C)
        tensor of a dtype handled here, nor a dict of such tensors)."""
        if isinstance(mask, dict):
            forms = {MaskForm.of(v, batch, capacity) for v in mask.values()}
            if len(forms) != 1 or None in forms:
                return None
            return MaskForm(forms.pop().dtype, tuple(mask))
        if type(mask) is not torch.Tensor or tuple(mask.shape) != (batch, 1, 1, capacity):
            return None
        if mask.dtype is not torch.bool and not mask.dtype.is_floating_point:
            return None
        return MaskForm(mask.dtype, None)


def one_token_update(self, key_states, value_states, *args, append=None, **kwargs):
    """``StaticLayer.update`` of forge's caches, for one new token per sequence: the token's
    index is the layer's position counter itself (a view), so a step writes the keys and values
    and advances the counter with no ``arange`` and no addition to make the index (two kernels a
    layer and step fewer). With ``append`` (a backend's ``forge.spec.kv_append``) the write and
    the advance are one launch instead of three. Any other call runs the class's own update."""
    n = getattr(self, "cumulative_length", None)
    if (key_states.shape[-2] != 1 or not self.is_initialized or not isinstance(n, torch.Tensor) or n.dim() != 0
            or n.device != self.keys.device):
        return type(self).update(self, key_states, value_states, *args, **kwargs)
    if (append is not None and key_states.dtype == self.keys.dtype == value_states.dtype
            and key_states.shape == value_states.shape and not torch.compiler.is_compiling()):
        append(self.keys, self.values, key_states, value_states, n)
        return self.keys, self.values
    idx = n.view(1)
    self.keys.index_copy_(2, idx, key_states)
    self.values.index_copy_(2, idx, value_states)
    n.add_(1)  # (after the copies, which read the index on the same stream)
    return self.keys, self.values


class CachedSteps:
    """The captured decoding steps on one static cache (one batch size, one capacity)."""

    def __init__(self, cache, batch: int, capacity: int, attention=None, head=None, append=None, linear=None,
                 sums=False, glu=None):
        from transformers.cache_utils import StaticLayer

        update = one_token_update if append is None else functools.partial(one_token_update, append=append)
        for ly in cache.layers:  # (forge's own cache: its full-attention layers take the one-token update)
            if type(ly) is StaticLayer:
                ly.update = types.MethodType(update, ly)
        self.cache, self.batch, self.capacity = cache, batch, capacity
        self.attention = attention  # the decoding attention kernel (forge.spec.decode_attention), or None: SDPA
        self.head = head  # the model's LM head (logits_outside_pool), or None
        self.linear = linear  # the one-row product kernel (forge.spec.row_linear; step_kernels), or None: cuBLAS
        self.row_calls = 0  # F.linear calls it took, in the steps warmed up or captured
        self.sums = sums  # the residual additions written by the products before them (step_kernels)
        self.row_sums = 0  # additions those served, in the same steps
        self.glu = glu  # the gated one-row kernel (forge.spec.row_linear.glu_reference; step_kernels), or None
        self.row_glus = 0  # gate/up products it ran, in the same steps
        self.filled = False  # the prompt is in the cache (decode.Decoder._prefill)
        self.made = None  # the weights and mode it was made and last used under (decode.Decoder._made)
        self.sliding = [ly for ly in cache.layers if hasattr(ly, "cumulative_length_int")]
        # masks can be built in the graph only where every layer attends to the whole cache
        self.buildable = all(type(ly) is StaticLayer for ly in cache.layers)
        self.steps: dict[tuple, _Step] = {}
        self.loop = None  # the device loop's buffers and graphs on this cache (decode_loop.Loop)
        self.seen: dict[tuple, int] = {}
        self.failed: dict[tuple, str] = {}
        self.forms: dict[tuple, MaskForm | None] = {}  # per signature: the checked form; None: it failed
        self.fast: dict[tuple, _Step] = {}  # decode.Decoder.prepare's key -> the step it replays
        self.keep = None  # (B, C) bool: the 2-D padding mask, beyond the current length anything
        self.kv_idx = None  # (C,) long: 0 .. C - 1
        self.keep_ones = False  # keep holds ones throughout (a call with no 2-D mask)
        self.epoch = workspace_epoch()  # cuBLAS workspace clears before the last capture (graphs.watch_workspaces)

    def stale(self) -> bool:
        """Steps captured before torch's cuBLAS workspaces were last cleared (graphs.watch_workspaces)."""
        held = self.steps or (self.loop is not None and self.loop.graphs)
        return bool(held) and self.epoch != workspace_epoch()

    def drop_steps(self):
        """Forget the captured steps (their graphs and static buffers): captured again as they come."""
        self.steps.clear()
        self.loop = None
        self.fast.clear()
        self.seen.clear()

    def reset(self):
        """Empty the cache in place (its tensors keep their addresses: the graphs stay valid)."""
        self.cache.reset()
        self.filled = False

    # -- masks built in the graph ----------------------------------------------------------------
    def _buffers(self, dev):
        if self.keep is None:
            self.keep = torch.ones(self.batch, self.capacity, dtype=torch.bool, device=dev)
            self.kv_idx = torch.arange(self.capacity, device=dev)
            self.keep_ones = True

    def load_keep(self, mask2d):
        """The 2-D padding mask (B, L <= C), or None for no padding, into ``keep``."""
        if mask2d is None:
            if not self.keep_ones:
                self.keep.fill_(True)
                self.keep_ones = True
        else:
            self.keep[:, : mask2d.shape[1]].copy_(mask2d)
            self.keep_ones = False

    def _keep_from(self, mask, form):
        """``keep`` from masks of ``form``: the new token's row attends to every key up to its
        own position that is not padding (the causal part masks the rest anyway)."""
        row = (next(iter(mask.values())) if form.keys is not None else mask)[:, 0, 0, :]
        self.keep.copy_(row if form.dtype is torch.bool else row == 0)
        self.keep_ones = False

    def build(self, form):
        """The masks of ``form`` for the cache's current position (captured: computed at replay)."""
        pos = self.cache.layers[0].cumulative_length  # the new token's index, before update() runs
        allowed = (self.keep & (self.kv_idx <= pos))[:, None, None, :]
        if form.dtype is torch.bool:
            mask = allowed
        else:
            if form.fill is None:
                form.fill = (torch.zeros((), dtype=form.dtype, device=allowed.device),
                             torch.tensor(torch.finfo(form.dtype).min, dtype=form.dtype, device=allowed.device))
            mask = torch.where(allowed, *form.fill)
        return mask if form.keys is None else dict.fromkeys(form.keys, mask)

    def matches(self, form, mask, mask2d):
        """Load ``keep`` from the 2-D mask ``mask2d`` (None: no padding; False: not known, then from
        the masks' own row) and tell whether :meth:`build` gives ``mask``, the masks transformers
        built for this step, at the cache's position. Reads the device (a synchronisation)."""
        if form is None or (isinstance(mask2d, torch.Tensor) and mask2d.shape[1] > self.capacity):
            return False
        self._buffers(mask.device if form.keys is None else next(iter(mask.values())).device)
        if mask2d is False:
            self._keep_from(mask, form)
        else:
            self.load_keep(mask2d)
        built = self.build(form)
        pairs = zip(built.values(), mask.values()) if form.keys is not None else [(built, mask)]
        return all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs)

    def check(self, sig, mask, mask2d):
        """:meth:`matches` for an uncaptured step of signature ``sig``, the verdict kept: a step
        captured with every check passed builds its masks; one mismatch, or one step whose 2-D
        mask is not known (decode's prepare did not see it, nor will it serve such steps, which
        would then pay a check each), and the masks stay given."""
        if not self.buildable or self.forms.get(sig, True) is None:
            return
        form = MaskForm.of(mask, self.batch, self.capacity)
        self.forms[sig] = form if mask2d is not False and self.matches(form, mask, mask2d) else None

    def full_window(self) -> bool:
        """A sliding-window layer holds its whole window: transformers' update then rolls the
        window, which runs uncaptured (it builds an index tensor from a Python list per call)."""
        return any(ly.cumulative_length_int >= ly.max_cache_len for ly in self.sliding)

    def run(self, forward, kw, sig, backend, owner, stats, mask2d=False):
        """(output, why): the replayed step's output (the step's ModelOutput, whose logits are the
        graph's static buffer: the same object every replay) and None; a warm-up step's output
        and why it ran uncaptured; or None and why, for the caller to run the step uncaptured.
        ``mask2d``: the 2-D mask transformers built this step's masks from (a tensor, or None
        for none), checked against them before the capture; False: not known."""
        step = self.steps.get(sig)
        if step is None:
            if sig in self.failed:
                return None, self.failed[sig]
            self.check(sig, kw["attention_mask"], mask2d)
            n = self.seen.get(sig, 0)
            if n < WARMUP:
                self.seen[sig] = n + 1
                CAPTURE.on = True  # the kernels the capture will record (fused at every size)
                try:
                    with step_kernels(self):
                        out = backend.warm(lambda: forward(**kw), owner, kw["input_ids"].device)
                    return out, "warm-up before capture"
                finally:
                    CAPTURE.on = False
            step = self._capture(forward, kw, sig, backend, owner, stats)
            if step is None:
                return None, self.failed[sig]
        else:
            step.ids.copy_(kw["input_ids"])
            step.pos.copy_(kw["position_ids"])
            if step.form is None:
                _copy_into(step.mask, kw["attention_mask"])
            elif not self.matches(step.form, kw["attention_mask"], mask2d):  # (reached without prepare's
                return None, "masks not of the form the captured step builds"  # StepMask: rare, checked)
        return self.replay(step, stats), None

    def replay(self, step, stats):
        ints = [(ly, ly.cumulative_length_int) for ly in self.sliding]
        step.graph.replay()
        for ly, n in ints:  # what update() does in Python for one new token
            ly.cumulative_length_int = n + 1
        stats.decode_replayed += 1
        return step.template

    def _capture(self, forward, kw, sig, backend, owner, stats):
        watch_workspaces()
        self.epoch = workspace_epoch()
        s = _Step()
        s.ids, s.pos = kw["input_ids"].clone(), kw["position_ids"].clone()
        # checked equal to what build() gives (keep loaded by that check): the graph builds them
        s.form = self.forms.get(sig)
        s.mask = _static(kw["attention_mask"]) if s.form is None else None
        held = {}

        def fn():
            mask = s.mask if s.form is None else self.build(s.form)
            out = forward(**{**kw, "input_ids": s.ids, "position_ids": s.pos, "attention_mask": mask})
            held["out"] = out
            return out.logits

        dev = s.ids.device
        saved = [(ly, ly.cumulative_length.clone(), getattr(ly, "cumulative_length_int", None))
                 for ly in self.cache.layers]
        gc.collect()  # garbage freed now, not by a collection mid-capture
        gc_was = gc.isenabled()
        gc.disable()
        CAPTURE.on = True
        try:
            with step_kernels(self), logits_outside_pool(self.head, self.batch):
                s.graph, s.logits = backend.capture(fn, owner, dev)
        except Exception as e:  # noqa: BLE001 - never break generate(): this signature runs uncaptured
            self.failed[sig] = f"capture failed ({type(e).__name__}: {str(e)[:200]})"
            logging.getLogger("forge").warning("forge decode: %s; such steps run uncaptured", self.failed[sig])
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            return None
        finally:
            CAPTURE.on = False
            if gc_was:
                gc.enable()
            for ly, t, n in saved:  # the capture ran update()'s Python: put the counters back
                ly.cumulative_length.copy_(t)
                if n is not None:
                    ly.cumulative_length_int = n
        s.template = held.pop("out")
        self.steps[sig] = s
        self.seen.pop(sig, None)
        stats.decode_captures += 1
        return s
