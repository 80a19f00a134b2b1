"""The experts spec: its checks, its routing (the backend contract's first step) and its
reference against a plain per-token loop."""
import pytest
import torch

from forge.spec import experts as X


def _inputs(t=5, h=8, i=6, e=4, k=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=g, dtype=dtype), torch.randint(0, e, (t, k), generator=g),
            torch.rand(t, k, generator=g, dtype=dtype), torch.randn(e, 2 * i, h, generator=g, dtype=dtype),
            torch.randn(e, h, i, generator=g, dtype=dtype))


def _per_token(x, idx, w, gu, dn):
    out = torch.zeros_like(x)
    e_n, two_i, _ = gu.shape
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if 0 <= e < e_n:
                g, u = (gu[e] @ x[t]).split(two_i // 2)
                out[t] += w[t, k] * (dn[e] @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize("k", [1, 2, 4])
def test_reference_is_the_per_token_loop(k):
    x, idx, w, gu, dn = _inputs(k=k)
    idx[0, 0] = 4       # transformers' sentinel id E: skipped
    idx[1, -1] = -1     # any id outside [0, E): skipped
    torch.testing.assert_close(X.reference(x, idx, w, gu, dn), _per_token(x, idx, w, gu, dn))


def test_route_groups_every_valid_slot_once():
    x, idx, w, gu, dn = _inputs(t=7, e=5, k=3, seed=1)
    idx[2, 1] = 5
    idx[3, 0] = -2
    row_token, offsets, slot_rows = X.route(idx, 5)
    assert row_token.dtype == offsets.dtype == slot_rows.dtype == torch.int32
    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < 5)
    assert int(offsets[-1]) == int(valid.sum())
    starts = torch.cat([offsets.new_zeros(1), offsets[:-1]])
    for t in range(7):
        for k in range(3):
            r = int(slot_rows[t, k])
            if not 0 <= int(idx[t, k]) < 5:
                assert r == -1
                continue
            e = int(idx[t, k])
            assert starts[e] <= r < offsets[e] and int(row_token[r]) == t
    assert sorted(slot_rows[slot_rows >= 0].tolist()) == list(range(int(offsets[-1])))


@pytest.mark.parametrize("t, e, k", [(1, 1, 1), (9, 4, 2), (33, 8, 8), (64, 128, 8), (0, 4, 2)])
def test_route_offsets_count_each_experts_rows(t, e, k):
    # the end rows are the running count of each expert's valid ids (as a bincount would give;
    # route searches the sorted ids instead, with no host sync), sentinels and negatives excluded
    g = torch.Generator().manual_seed(t * 131 + e)
    idx = torch.randint(-1, e + 1, (t, k), generator=g)
    _, offsets, _ = X.route(idx, e)
    flat = idx.reshape(-1)
    want = torch.cumsum(torch.bincount(flat[(flat >= 0) & (flat < e)], minlength=e), 0)
    assert offsets.dtype == torch.int32 and offsets.tolist() == want.tolist()


@pytest.mark.parametrize("mutate, err, match", [
    (lambda a: a.__setitem__(0, a[0].float()), TypeError, "hidden is torch.float32"),
    (lambda a: a.__setitem__(1, a[1].float()), TypeError, "int32 or int64"),
    (lambda a: a.__setitem__(1, a[1][:-1]), ValueError, "top_k_index"),
    (lambda a: a.__setitem__(3, a[3][:, :-1]), ValueError, "gate_up_proj"),
    (lambda a: a.__setitem__(4, a[4][:, :, :-1]), ValueError, "down_proj"),
    (lambda a: a.__setitem__(0, a[0][None]), ValueError, "2-D"),
    (lambda a: (a.__setitem__(1, torch.zeros(5, 5, dtype=torch.long)),
                a.__setitem__(2, torch.zeros(5, 5, dtype=torch.float64))), ValueError, "between 1 and"),
])
def test_checks(mutate, err, match):
    args = list(_inputs())
    mutate(args)
    with pytest.raises(err, match=match):
        X.check(*args)


def test_unknown_act():
    with pytest.raises(ValueError, match="act must be one of"):
        X.check(*_inputs(), act="relu")


def test_reference_pieces_through_the_node_match_the_reference():
    """The op layer's node over the spec's reference pieces equals the reference, values and
    every gradient: the pieces' contract composes to the op (what a backend's pieces then only
    have to match piece by piece)."""
    from forge.ops import _nodes

    x, idx, w, gu, dn = _inputs(t=6, e=4, k=2, seed=3)
    idx[1, 0] = 4
    fn = _nodes.experts("reference", X.reference_pieces(), None)
    leaves = [t.requires_grad_() for t in (x, w, gu, dn)]
    out = fn(x, idx, w, gu, dn)
    ref = X.reference(x, idx, w, gu, dn)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout)
    for name, a, b in zip(("hidden", "top_k_weights", "gate_up_proj", "down_proj"), got, want):
        torch.testing.assert_close(a, b, msg=name)
    assert got[1][1, 0] == 0  # the skipped slot's score gradient
