"""The expert block of a mixture-of-experts layer (transformers 5.x ``*Experts.forward`` of
qwen3_moe, mixtral and olmoe: 3-D weights ``gate_up_proj`` (E, 2I, H), the first I rows the gate
and the next I rows the up projection, and ``down_proj`` (E, H, I)), equivalent torch::

    out = zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = top_k_index[t, k]
            if not 0 <= e < E:
                continue                               # skipped: contributes nothing
            g, u = (hidden[t] @ gate_up_proj[e].T).chunk(2)
            out[t] += top_k_weights[t, k] * (act(g) * u) @ down_proj[e].T

``act`` is silu for all three architectures. Every routed (token, expert) pair is computed: no
capacity, nothing dropped. An expert id outside [0, E) (transformers' eager loop skips id == E,
its expert-parallel sentinel) contributes zero and gets a zero score gradient; it is not checked
on the host (that would be a device sync).

The fused op, and the contract its backend pieces implement (the Triton and Pallas backends
both provide exactly these; S = T * K routed rows, the rows sorted by expert)::

    routing (on the device, no host sync: ``route`` below in torch, or for at most ROUTE_ROWS
    routed rows a backend's optional ``route(top_k_index, E) -> (row_token, offsets, slot_rows)``
    piece, equal to it bit for bit):
      ids       = top_k_index.reshape(S), ids outside [0, E) replaced by E (a sentinel)
      order     = stable argsort of ids                        # (S,) sorted row -> flat slot
      row_token = (order // K).int32                           # (S,) token of each sorted row
      offsets   = #(ids < e + 1) for each e, int32                   # (E,) end row of expert e
      slot_rows = inverse of order, reshape (T, K), -1 where the id was invalid   # int32
    A backend provides ``experts_pieces() -> dict`` of the pieces below plus ``device_type``
    (forge.ops.experts builds the autograd node from them). Outputs are in the dtype of the
    activation input (hidden's), d_weights in the scores' dtype, weight grads in the weights'.
    Group e is rows [offsets[e-1] (0 for e = 0), offsets[e]); rows from offsets[E-1] on (the
    sentinels) are never computed or read: a piece may leave them unwritten.

    glu_fwd(x (T,H), row_token (S,), offsets (E,), gate_up_proj (E,2I,H), act)
        -> h (S,I), gu (S,2I)        gu[s] = x[row_token[s]] @ gate_up_proj[e].T ;
                                      h[s] = act(gu[s,:I]) * gu[s,I:]   (epilogue)
    grouped_mm(a (S,Ka), w (E,N,Ka), offsets) -> (S,N)
                                      out[s] = a[s] @ w[e].T     (down: a = h, w = down_proj)
    unpermute(y (S,H), slot_rows (T,K), weights (T,K) or None) -> (T,H)
                                      out[t] = sum_k weights[t,k] * y[slot_rows[t,k]] over the
                                      valid slots, in k order, fp32 sum (no atomics); weights
                                      None means all ones (the dx gather in backward)
  backward, dout (T,H):
    unpermute_bwd(dout, y, slot_rows, weights)
        -> dy (S,H), d_weights (T,K)  dy[slot_rows[t,k]] = weights[t,k] * dout[t];
                                      d_weights[t,k] = dout[t] . y[slot_rows[t,k]] (0 if invalid)
    glu_bwd(dy (S,H), gu (S,2I), offsets, down_proj (E,H,I), act)
        -> dgu (S,2I), h (S,I)        dh[s] = dy[s] @ down_proj[e] ; epilogue:
                                      dgu = [dh * u * act'(g), dh * act(g)], h recomputed
    grouped_mm_t(a (S,Na), w (E,Na,Kw), offsets) -> (S,Kw)
                                      out[s] = a[s] @ w[e]      (dx rows: a = dgu, w = gate_up_proj)
    grouped_wgrad(a (S,M), b (R,N), offsets, b_rows (S,) or None) -> (E,M,N)
                                      dW[e] = sum_{s in group e} a[s]^T b[b_rows[s] or s]
                                      (d_down = wgrad(dy, h); d_gate_up = wgrad(dgu, x, row_token));
                                      an expert with no rows gets zeros
    dx = unpermute(dxs, slot_rows, None)
  low-rank adapters (LoRA on the expert weights): glu_fwd, grouped_mm, glu_bwd and grouped_mm_t
  take ``low=(a2 (S,r), w2, scale)`` (default None), a second operand pair whose product joins
  the weight's before any rounding or epilogue:  out[s] += (scale * a2[s]) @ w2[e].T  with w2
  (E,N,r) for glu_fwd (gate rows, then up rows) and grouped_mm, and  out[s] += (scale * a2[s]) @
  w2[e]  with w2 (E,r,N) for glu_bwd (into dh) and grouped_mm_t; scale * a2 is rounded to the
  operands' dtype as the product's operands are.

Grads flow to hidden, gate_up_proj, down_proj and top_k_weights; top_k_index is integer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _check

ACTS = ("silu",)
INDEX_DTYPES = (torch.int32, torch.int64)


def check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act: str = "silu") -> None:
    for name, t in (("hidden", hidden), ("top_k_weights", top_k_weights),
                    ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        _check.tensor(name, t)
    if not isinstance(top_k_index, torch.Tensor):
        raise TypeError(f"top_k_index must be a torch.Tensor, got {type(top_k_index).__name__}")
    if top_k_index.dtype not in INDEX_DTYPES:
        raise TypeError(f"top_k_index must be int32 or int64, got {top_k_index.dtype}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D (tokens, H), got shape {tuple(hidden.shape)}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj "
                         f"{tuple(down_proj.shape)} must be 3-D (E, 2I, H) and (E, H, I)")
    t, h = hidden.shape
    e, two_i, hw = gate_up_proj.shape
    _check.no_empty_dims("gate_up_proj", gate_up_proj, "the experts' weights")
    if hw != h or two_i % 2:
        raise ValueError(f"gate_up_proj {tuple(gate_up_proj.shape)} must be (E, 2I, {h}) for hidden "
                         f"of width {h}")
    if tuple(down_proj.shape) != (e, h, two_i // 2):
        raise ValueError(f"down_proj {tuple(down_proj.shape)} must be ({e}, {h}, {two_i // 2})")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != t:
        raise ValueError(f"top_k_index {tuple(top_k_index.shape)} must be ({t}, K)")
    _check.same_shape("top_k_index", top_k_index, "top_k_weights", top_k_weights)
    if not 1 <= top_k_index.shape[1] <= e:
        raise ValueError(f"top-k {top_k_index.shape[1]} must be between 1 and the {e} experts")
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        _check.same_dtype("hidden", hidden, name, w)
    _check.same_device(hidden=hidden, top_k_index=top_k_index, top_k_weights=top_k_weights,
                       gate_up_proj=gate_up_proj, down_proj=down_proj)
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")


def _act(g, act):
    return F.silu(g)


def reference(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *, act: str = "silu"):
    """transformers' eager loop over the experts hit (out-of-range ids skipped), differentiable
    in every float input. Scores may be float32 while hidden is bf16 (as the routers hand them
    over): each expert's output is scaled in the product's dtype and summed in hidden's dtype."""
    check(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
    n_exp = gate_up_proj.shape[0]
    out = torch.zeros_like(hidden)
    for e in range(n_exp):
        tok, pos = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        g, u = F.linear(hidden[tok], gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(_act(g, act) * u, down_proj[e]) * top_k_weights[tok, pos, None]
        out = out.index_add(0, tok, y.to(out.dtype))
    return out


def elements(hidden, top_k_index, top_k_weights, gate_up_proj, *_a, **_k) -> int:
    """Activation elements per call: routed rows x intermediate width."""
    return top_k_index.numel() * (gate_up_proj.shape[1] // 2)


def reductions(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *_a, **_k) -> dict:
    """Reduction lengths per output (tolerance scaling): a weight gradient sums over the rows of
    one expert, at most T of them."""
    t, k = top_k_index.shape
    i = gate_up_proj.shape[1] // 2
    h = hidden.shape[1]
    return {"out": max(h, i) * k, "hidden": 2 * i * k, "top_k_weights": h,
            "gate_up_proj": t, "down_proj": t}


def route(top_k_index, n_experts: int):
    """The routing of the contract above, on the device with no host sync: returns
    (row_token (S,), offsets (E,), slot_rows (T, K)), all int32."""
    t, k = top_k_index.shape
    # ids outside [0, E) become E (sorted last, in no group): clamp to [-1, E], then -1 -> E
    ids = top_k_index.reshape(-1).long().clamp(-1, n_experts).remainder_(n_experts + 1)
    sorted_ids, order = torch.sort(ids, stable=True)
    row_token = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    # expert e's end row is the number of sorted ids below e + 1: a search over the sorted ids
    # (torch.bincount would read the ids' maximum back to the host on CUDA, a sync that also
    # rules out capturing the step in a CUDA graph)
    bounds = torch.arange(1, n_experts + 1, device=ids.device, dtype=ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    s = order.numel()
    rows = torch.empty(s, dtype=torch.int32, device=ids.device).scatter_(
        0, order, torch.arange(s, dtype=torch.int32, device=ids.device))
    # (a decoding step runs this per layer: few launches, each of them a cost at one token)
    slot_rows = rows.masked_fill_(rows >= offsets[-1:], -1).reshape(t, k)
    return row_token, offsets, slot_rows


# A backend's route piece (one program comparing every pair of routed rows, see
# forge_triton.experts) takes up to ROUTE_ROWS rows (a decoding step: batch x top-k); the op layer
# routes more in torch.
ROUTE_ROWS = 256
ROUTE_PAIRS = 4096  # (rows x rows) comparisons one step of that program holds


def route_blocks(s: int, n_experts: int) -> tuple:
    """(rows, compared rows per step, experts per step) blocks of a route piece's program for
    ``s`` routed rows, powers of two of at least 16."""
    bs = max(16, 1 << max(s - 1, 0).bit_length())
    pair = max(16, ROUTE_PAIRS // bs)
    return bs, min(bs, pair), min(max(16, 1 << max(n_experts - 1, 0).bit_length()), pair)


# The router's choice (transformers 5.x ``*TopKRouter.forward`` of qwen3_moe, mixtral and olmoe,
# after its product): a backend's optional ``top_k(logits (T, E), k, renorm, dtype) -> (scores
# (T, k) in dtype, index (T, k) int64)`` piece computes it in one launch; the op layer calls it for
# calls without gradients of at most TOP_K_ROWS tokens (a decoding step, where torch's softmax,
# topk, renormalisation and cast are ~6 launches a layer) and TOP_K_EXPERTS experts, torch's
# below otherwise. The piece picks by the logits (softmax keeps their order), equal logits in the
# order of their expert ids (torch.topk leaves that order open), and computes only the chosen
# probabilities, in fp32 as torch's softmax with dtype=float, cast once when stored.
TOP_K_ROWS = 256
TOP_K_EXPERTS = 1024
TOP_K_TILE = 4096  # (rows x experts) one program of the piece holds


def top_k(logits, k: int, renorm: bool, dtype=torch.float32):
    """(scores (T, k) in ``dtype``, index (T, k) int64): the router's top-k of softmax(logits) in
    float32 (float64 logits stay float64: the oracle), descending, optionally renormalised to sum
    to one."""
    p = torch.softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    scores, index = torch.topk(p, k, dim=-1)
    if renorm:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(dtype), index


def top_k_blocks(rows: int, n_experts: int, k: int) -> tuple:
    """(rows, experts, chosen) blocks of a top_k piece's program for ``rows`` rows: powers of
    two, the experts padded to at least 16, the rows filling TOP_K_TILE (at most 64, no more than
    the call has)."""
    be = max(16, 1 << max(n_experts - 1, 0).bit_length())
    bt = min(64, max(1, TOP_K_TILE // be), 1 << max(rows - 1, 0).bit_length())
    return bt, be, max(2, 1 << max(k - 1, 0).bit_length())


def top_k_warps(bt: int, be: int) -> int:
    """Warps of a top_k program: one per 1,024 elements of its tile, at most 4. The k picks are
    2k reductions over each row in a row; within one warp they need no shared memory or barrier
    (a decoding step's 1 x 64 tile on 4 warps took 4.4 us on an H100)."""
    return max(1, min(4, bt * be // 1024))


def _groups(offsets):
    """(expert, start, end) of every group, on the host: the reference pieces' loop."""
    ends = offsets.tolist()
    return [(e, ends[e - 1] if e else 0, end) for e, end in enumerate(ends)]


def glu(gu, act):
    """h = act(g) * u from gu = [g, u] (rows, 2I), in gu's dtype."""
    g, u = gu.chunk(2, dim=-1)
    return _act(g, act) * u


def glu_bwd(dh, gu, act):
    """(dgu = [dh u act'(g), dh act(g)], h = act(g) u) from dh (rows, I) and gu, in their dtype
    (the GLU's backward: the reference pieces' epilogue)."""
    g, u = gu.chunk(2, dim=-1)
    with torch.enable_grad():
        g2 = g.detach().requires_grad_()
        a = _act(g2, act)
        (da,) = torch.autograd.grad(a, g2, dh * u)
    return torch.cat([da, dh * a.detach()], -1), a.detach() * u


def _ref_glu_fwd(x, row_token, offsets, gate_up_proj, act):
    s, two_i = row_token.numel(), gate_up_proj.shape[1]
    gu = x.new_zeros(s, two_i)
    for e, a, b in _groups(offsets):
        gu[a:b] = x[row_token[a:b].long()] @ gate_up_proj[e].T
    return glu(gu, act), gu


def _ref_grouped_mm(a, w, offsets, transpose=True):
    out = a.new_zeros(a.shape[0], w.shape[1] if transpose else w.shape[2])
    for e, lo, hi in _groups(offsets):
        out[lo:hi] = a[lo:hi] @ (w[e].T if transpose else w[e])
    return out


def _ref_unpermute(y, slot_rows, weights):
    rows = slot_rows.long()
    valid = (rows >= 0).to(y.dtype)
    w = valid if weights is None else weights.to(y.dtype) * valid
    return (y[rows.clamp(min=0)] * w[..., None]).sum(1)


def _ref_unpermute_bwd(dout, y, slot_rows, weights):
    rows = slot_rows.long()
    valid = rows >= 0
    dy = y.new_zeros(y.shape)
    t_idx = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)
    dy[rows[valid]] = dout[t_idx[valid]] * weights[valid].to(dout.dtype)[:, None]
    dw = (dout[:, None, :] * y[rows.clamp(min=0)]).sum(-1) * valid
    return dy, dw.to(weights.dtype)


def _ref_glu_bwd(dy, gu, offsets, down_proj, act):
    return glu_bwd(_ref_grouped_mm(dy, down_proj, offsets, transpose=False), gu, act)


def _ref_grouped_wgrad(a, b, offsets, b_rows):
    rows = b if b_rows is None else b[b_rows.long()]
    out = a.new_zeros(offsets.numel(), a.shape[1], b.shape[1])
    for e, lo, hi in _groups(offsets):
        out[e] = a[lo:hi].T @ rows[lo:hi]
    return out


def reference_pieces(device_type: str = "cpu") -> dict:
    """The pieces of the contract above in plain torch (a loop over the groups, host-synced: a
    reference, not a backend): what each backend's pieces are tested against, piece by piece."""
    return {"glu_fwd": _ref_glu_fwd, "grouped_mm": _ref_grouped_mm, "unpermute": _ref_unpermute,
            "unpermute_bwd": _ref_unpermute_bwd, "glu_bwd": _ref_glu_bwd,
            "grouped_mm_t": lambda a, w, offsets: _ref_grouped_mm(a, w, offsets, transpose=False),
            "grouped_wgrad": _ref_grouped_wgrad, "device_type": device_type}
