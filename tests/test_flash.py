"""The flash backend (blocked online softmax) and the log-sum-exp merge, against the oracle."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
from mha import numpy as oracle
from mha.kernels import Contract, flash_attention, flash_attention_with_lse, merge_attention
from mha.positions import Band

CAUSAL = Contract(band=Band(None, 0))
CAUSAL_BOTTOM_RIGHT = Contract(band=Band(None, 0), offset=236)  # 64 queries, 300 keys

SHAPES = [((2, 3, 37, 8), (2, 3, 53, 8), 5), ((1, 2, 64, 4), (1, 2, 64, 4), 4), ((3, 19, 6), (3, 7, 6), 6),
          ((2, 4, 70, 8), (1, 4, 30, 8), 3)]  # odd sizes, L != S, L > S, 3-D, key batch broadcast


def _inputs(q_shape, k_shape, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(k_shape, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn((*k_shape[:-1], dv), generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


def _mask(kind, L, S, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    mask = torch.randn(L, S, generator=g, dtype=torch.float64)
    if kind == "blocked":
        mask = mask.masked_fill(torch.rand(L, S, generator=g) < 0.3, float("-inf"))
        mask[min(2, L - 1)] = float("-inf")  # one query row sees nothing
    return mask


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "float", "blocked"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("blocks", [(16, 16), (7, 20), (256, 256)])
def test_flash_equals_the_oracle_forward_lse_and_gradients(shapes, mask_kind, is_causal, blocks):
    q_shape, k_shape, dv = shapes
    q, k, v = _inputs(q_shape, k_shape, dv)
    L, S = q_shape[-2], k_shape[-2]
    mask = _mask(mask_kind, L, S)
    contract = Contract(mask=mask, band=Band(None, 0) if is_causal else None)
    out, lse = flash_attention_with_lse(q, k, v, contract, block_q=blocks[0], block_k=blocks[1])
    arrays = [t.detach().expand(*q_shape[:-2], *t.shape[-2:]).numpy() for t in (q, k, v)]
    want, weights = oracle.scaled_dot_product_attention(*arrays, None if mask is None else mask.numpy(), is_causal)
    np.testing.assert_allclose(out.detach().numpy(), want, atol=1e-12, rtol=0)
    scores = arrays[0] @ np.swapaxes(arrays[1], -1, -2) / np.sqrt(q_shape[-1])
    scores = scores + (0 if mask is None else mask.numpy())
    if is_causal:
        scores = np.where(oracle.causal_mask(L, S), scores, -np.inf)
    with np.errstate(divide="ignore"):
        want_lse = np.log(np.exp(scores).sum(-1))
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=1e-12, rtol=0)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = mha.kernels.math_attention(q2, k2, v2, contract)
    for a, b in zip(got, torch.autograd.grad((ref * g).sum(), (q2, k2, v2))):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_fully_masked_row_is_zero_with_infinite_lse():
    q, k, v = _inputs((1, 1, 4, 3), (1, 1, 5, 3), 3)
    mask = torch.zeros(4, 5)
    mask[1] = float("-inf")
    out, lse = flash_attention_with_lse(q, k, v, Contract(mask=mask), block_q=2, block_k=2)
    assert torch.all(out[0, 0, 1] == 0) and lse[0, 0, 1] == float("-inf")


@pytest.mark.parametrize("split", [1, 17, 40])
def test_merging_flash_results_over_two_key_sets_equals_attention_over_all(split):
    q, k, v = _inputs((2, 3, 11, 8), (2, 3, 41, 8), 5)
    with torch.no_grad():
        full, full_lse = flash_attention_with_lse(q, k, v)
        a, lse_a = flash_attention_with_lse(q, k[..., :split, :], v[..., :split, :])
        b, lse_b = flash_attention_with_lse(q, k[..., split:, :], v[..., split:, :])
    merged, lse = merge_attention(a, lse_a, b, lse_b)
    torch.testing.assert_close(merged, full, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=0)


def test_merge_of_empty_parts_is_zero():
    out = torch.randn(2, 3)
    empty = torch.full((2,), float("-inf"))
    merged, lse = merge_attention(out, empty, out, empty)
    assert torch.all(merged == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_is_computed_in_float32(dtype):
    q, k, v = (t.detach().to(dtype) for t in _inputs((1, 2, 40, 16), (1, 2, 50, 16), 16, torch.float32))
    out = flash_attention(q, k, v, CAUSAL)
    assert out.dtype == dtype
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_flash_refuses_mask_gradients():
    q, k, v = _inputs((1, 1, 4, 3), (1, 1, 4, 3), 3)
    with pytest.raises(ValueError, match="attn_mask"):
        mha.functional.scaled_dot_product_attention(q, k, v, torch.zeros(4, 4, requires_grad=True,
                                                                         dtype=torch.float64), backend="flash")


@pytest.mark.parametrize("need_weights", [False])
@pytest.mark.parametrize("options", [dict(), dict(add_bias_kv=True, add_zero_attn=True)], ids=str)
def test_multi_head_attention_on_the_flash_backend_equals_torch(need_weights, options):
    E, H = 12, 3
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(E, H, dtype=torch.float64, **options)
    x = torch.randn(9, 2, E, dtype=torch.float64)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 7:] = True
    causal = torch.ones(9, 9, dtype=torch.bool).triu(1)
    want, _ = m(x, x, x, key_padding_mask=padding, attn_mask=causal, need_weights=False)
    params = (m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v, m.add_zero_attn, 0.0, m.out_proj.weight,
              m.out_proj.bias)
    got, _ = mha.functional.multi_head_attention_forward(x, x, x, E, H, *params, key_padding_mask=padding,
                                                         is_causal=True, need_weights=need_weights,
                                                         backend="flash")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_every_block_size_gives_the_same_answer():
    q, k, v = _inputs((1, 2, 33, 4), (1, 2, 33, 4), 4)
    with torch.no_grad():
        results = [flash_attention_with_lse(q, k, v, CAUSAL, block_q=bq, block_k=bk)[0]
                   for bq, bk in itertools.product([1, 5, 33, 64], [1, 8, 40])]
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], atol=1e-13, rtol=0)


def test_the_drop_in_module_takes_a_backend_attribute():
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    ours = mha.nn.MultiheadAttention(8, 2, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 7, 8)
    assert ours.backend == "auto"
    ours.backend = "flash"
    torch.testing.assert_close(ours(x, x, x, need_weights=False)[0], theirs(x, x, x, need_weights=False)[0])
    ours.backend = "warp"
    with pytest.raises(ValueError, match="backend"):
        ours(x, x, x, need_weights=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_rounds_once_at_the_end(dtype):
    """Computed in float32, rounded to the input dtype once: within one rounding step (half an ulp,
    plus float32 noise) of the float32 result on the same rounded inputs. Computing the softmax
    and the sums in float16/bfloat16 misses this by several ulps over 300 keys."""
    q, k, v = (t.detach().to(dtype) for t in _inputs((1, 2, 64, 16), (1, 2, 300, 16), 16, torch.float32))
    out = flash_attention(q, k, v, CAUSAL_BOTTOM_RIGHT)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                         attn_mask=torch.ones(64, 300, dtype=torch.bool).tril(236))
    ulp = torch.finfo(dtype).eps * ref.abs().clamp_min(torch.finfo(dtype).tiny)  # one step at each value
    assert ((out.float() - ref).abs() <= 0.5 * ulp + 1e-6).float().mean() > 0.99
    assert ((out.float() - ref).abs() <= ulp + 1e-6).all()


@pytest.mark.parametrize("window", [(64, 0), (32, 32)])
def test_a_window_computes_o_t_w_scores(monkeypatch, window):
    """The promise of windows is work, not only values: flash computes scores only in the tiles
    the band reaches, about T·(w + tile) of them, not T²."""
    from mha.kernels import flash

    computed = []
    scores = flash._Tiles.scores

    def counting(self, rows, cols):
        computed.append(len(rows) * len(cols))
        return scores(self, rows, cols)

    monkeypatch.setattr(flash._Tiles, "scores", counting)
    T = 2048
    q, k, v = (torch.randn(1, 1, T, 8) for _ in range(3))
    contract = Contract(band=Band(window[0], window[1]))
    flash_attention(q, k, v, contract)
    width = window[0] + window[1] + 1
    assert sum(computed) <= T * (width + 2 * 128), (sum(computed), T * T)  # tiles of up to 128 columns


def test_merge_keeps_the_outputs_dtype():
    """Low-precision outputs merged with float32 log-sum-exps stay in their dtype (the weights are
    cast to it), so a merged result can be merged again or returned as the caller's dtype."""
    g = torch.Generator().manual_seed(0)
    out_a, out_b = (torch.randn(2, 3, 4, generator=g).to(torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(2, 3, generator=g) for _ in range(2))
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    w_a = torch.exp(lse_a - torch.logaddexp(lse_a, lse_b))[..., None]
    want = out_a.float() * w_a + out_b.float() * (1 - w_a)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
