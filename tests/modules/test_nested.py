"""Ragged batches as nested tensors (torch.nested, jagged and strided): the drop-in and
scaled_dot_product_attention pack them and run one call of varlen attention (no padding to the
longest); the results equal each sequence alone (padding + masks) and torch's own nested paths."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import mha

warnings.filterwarnings("ignore", message=".*nested tensors is in prototype.*")


def _nested(shapes, layout, *, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(*s, generator=g, requires_grad=grad) for s in shapes]
    return torch.nested.as_nested_tensor(parts, layout=layout), parts


def _pair(**options):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True, **options).eval()
    ours = mha.nn.MultiheadAttention(8, 2, batch_first=True, **options).eval()
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():  # sharpen: attention decides the output
        for w in (ours.in_proj_weight, theirs.in_proj_weight):
            if w is not None:
                w.mul_(4.0)
    return theirs, ours


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_cross_attention_of_ragged_batches_equals_each_sequence_alone(layout):
    """torch's nested-tensor MHA test's shapes: queries of 4 and 6 tokens against keys/values of 7
    and 16 (torch's drop-in refuses nested cross-attention; each sequence alone is the reference)."""
    theirs, ours = _pair()
    q, q_parts = _nested([(4, 8), (6, 8)], layout)
    kv, kv_parts = _nested([(7, 8), (16, 8)], layout, seed=1)
    out, weights = ours(q, kv, kv)
    assert out.is_nested and out.layout == layout and weights.shape == (2, 6, 16)
    for b, (x, y) in enumerate(zip(q_parts, kv_parts)):
        want, want_w = theirs(x[None], y[None], y[None])
        torch.testing.assert_close(out.unbind()[b], want[0])
        torch.testing.assert_close(weights[b, :x.shape[0], :y.shape[0]], want_w[0])
        assert not weights[b, x.shape[0]:].any() and not weights[b, :, y.shape[0]:].any()  # padding: zeros


def test_self_attention_equals_torchs_fast_path_and_takes_gradients():
    theirs, ours = _pair()
    nt, parts = _nested([(4, 8), (6, 8), (1, 8)], torch.strided)
    with torch.no_grad():
        want, want_w = theirs(nt, nt, nt)  # torch's fast path (eval, no grad, self-attention)
        got, got_w = ours(nt, nt, nt)
    for a, b in zip(got.unbind(), want.unbind()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got_w, want_w)
    # with gradients (torch raises "does not support NestedTensor outside of its fast path"): ours computes
    nt, parts = _nested([(4, 8), (6, 8)], torch.jagged, grad=True)
    out, _ = ours(nt, nt, nt, need_weights=False)
    sum(o.sum() for o in out.unbind()).backward()
    grads = [p.grad.clone() for p in parts] + [ours.in_proj_weight.grad.clone()]
    ours.zero_grad()
    for p in parts:
        p.grad = None
        ours(p[None], p[None], p[None], need_weights=False)[0].sum().backward()
    torch.testing.assert_close([p.grad for p in parts], grads[:-1])
    # the weight's gradient sums over every token: one packed call and two calls add them in other orders
    torch.testing.assert_close(ours.in_proj_weight.grad, grads[-1], rtol=1e-5, atol=1e-5)


def test_causal_ragged_self_attention_is_causal_within_each_sequence():
    _, ours = _pair()
    nt, parts = _nested([(5, 8), (3, 8)], torch.jagged)
    out, _ = ours(nt, nt, nt, is_causal=True, need_weights=False)
    for b, p in enumerate(parts):
        mask = torch.ones(p.shape[0], p.shape[0], dtype=torch.bool).triu(1)
        want, _ = ours(p[None], p[None], p[None], attn_mask=mask, need_weights=False)
        torch.testing.assert_close(out.unbind()[b], want[0])


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_takes_jagged_tensors_as_torchs_does(causal):
    H, D = 2, 8
    q, q_parts = _nested([(4, H, D), (6, H, D)], torch.jagged, grad=True)
    kv, kv_parts = _nested([(4, H, D), (6, H, D)] if causal else [(7, H, D), (16, H, D)], torch.jagged, seed=1)
    q, kv = q.transpose(1, 2), kv.transpose(1, 2)  # (B, j, H, D) -> (B, H, j, D), as torch's SDPA takes them
    out = mha.functional.scaled_dot_product_attention(q, kv, kv, is_causal=causal)
    assert out.is_nested and out.shape[:2] == (2, H) and out._ragged_idx == 2
    if not causal:  # torch's nested SDPA has no causal form
        want = F.scaled_dot_product_attention(q, kv, kv)
        for a, b in zip(out.unbind(), want.unbind()):
            torch.testing.assert_close(a, b)
    for b, (x, y) in enumerate(zip(q_parts, kv_parts)):
        alone = F.scaled_dot_product_attention(x.transpose(0, 1), y.transpose(0, 1), y.transpose(0, 1), is_causal=causal)
        torch.testing.assert_close(out.unbind()[b], alone)
    sum(o.sum() for o in out.unbind()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in q_parts)


@pytest.mark.parametrize(("call", "message"), [
    (lambda m, nt, dense: m(nt, nt, dense), "value must be a nested"),
    (lambda m, nt, dense: m(nt, nt, nt, key_padding_mask=torch.zeros(2, 6, dtype=torch.bool)), "key_padding_mask"),
    (lambda m, nt, dense: mha.nn.MultiheadAttention(8, 2)(nt, nt, nt), "batch_first=True"),
    (lambda m, nt, dense: mha.nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)(nt, nt, nt),
     "no add_bias_kv"),
])
def test_what_a_nested_batch_cannot_take_is_refused_clearly(call, message):
    _, ours = _pair()
    nt, _ = _nested([(4, 8), (6, 8)], torch.jagged)
    with pytest.raises(ValueError, match=message):
        call(ours, nt, torch.randn(2, 6, 8))


def test_sdpa_refuses_a_mask_and_top_left_causality_over_unequal_lengths():
    q, _ = _nested([(4, 2, 8), (6, 2, 8)], torch.jagged)
    kv, _ = _nested([(7, 2, 8), (16, 2, 8)], torch.jagged, seed=1)
    q, kv = q.transpose(1, 2), kv.transpose(1, 2)
    with pytest.raises(ValueError, match="attn_mask and dropout_p are not taken"):
        mha.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="pass causal_alignment='bottom_right'"):
        mha.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, causal_alignment="top_left")
