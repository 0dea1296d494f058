"""The flash backend (blocked online softmax) and the log-sum-exp merge, against the oracle."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
from helpers.exact import raises_exactly
from helpers.tolerance import assert_close, tolerance
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
    assert_close(out.detach().numpy(), want)
    scores = arrays[0] @ np.swapaxes(arrays[1], -1, -2) / np.sqrt(q_shape[-1])
    scores = scores + (0 if mask is None else mask.numpy())
    if is_causal:
        scores = np.where(oracle.causal_mask(L, S), scores, -np.inf)
    with np.errstate(divide="ignore"):
        want_lse = np.log(np.exp(scores).sum(-1))
    assert_close(lse.numpy(), want_lse)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = mha.kernels.math_attention(q2, k2, v2, contract)
    for a, b in zip(got, torch.autograd.grad((ref * g).sum(), (q2, k2, v2))):
        assert torch.isfinite(a).all()
        assert_close(a, b, chain=True)


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
    assert_close(merged, full)
    assert_close(lse, full_lse)


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
    tol = tolerance(dtype)  # float16 2e-3, bfloat16 2e-2, float32 1e-6
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
    assert_close(got, want)


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
    assert sum(computed) <= T * (width + 64), (sum(computed), T * T)  # blocks of 64 queries: 63 extra keys each


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


def test_a_wide_two_sided_band_in_small_tiles_equals_its_mask():
    """Edge tiles left and right of the diagonal (shifts -20 and +20) have different patterns;
    flash caches each edge pattern by its shape and shift."""
    q, k, v = _inputs((1, 2, 48, 4), (1, 2, 48, 4), 4)
    i, j = torch.arange(48)[:, None], torch.arange(48)[None, :]
    visible = (j - i >= -20) & (j - i <= 20)
    out, _ = flash_attention_with_lse(q, k, v, Contract(band=Band(20, 20)), block_q=4, block_k=4)
    want, _ = oracle.scaled_dot_product_attention(*(t.detach().numpy() for t in (q, k, v)), visible.numpy())
    assert_close(out.detach().numpy(), want)


def test_batch_dims_broadcast_across_queries_keys_and_values():
    """q (2, 3, L, D), k (1, 3, S, D), v (3, S, Dv): the common (2, 3), and gradients summed back."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    out, _ = flash_attention_with_lse(q, k, v, CAUSAL, block_q=4, block_k=4)
    want = F.scaled_dot_product_attention(q, k.expand(2, 3, 7, 4), v.expand(2, 3, 7, 5), is_causal=True)
    assert_close(out, want)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    expected = torch.autograd.grad((want * upstream).sum(), (q, k, v))
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_sinks_alibi_and_softcap_are_computed_in_float32(dtype):
    """Every term of the contract in float32 for float16/bfloat16 inputs, forward and backward:
    within a rounding step of flash on the float32 copies, gradients in the inputs' dtypes."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g).to(dtype).requires_grad_() for n in (40, 60, 60))
    slopes, sinks = torch.tensor([0.5, 0.25]).to(dtype), torch.tensor([0.3, -1.0]).to(dtype).requires_grad_()
    contract = Contract(band=Band(None, 0), offset=20, alibi_slopes=slopes, sinks=sinks, softcap=5.0)
    out, lse = flash_attention_with_lse(q, k, v, contract, block_q=16, block_k=16)
    wide = [t.detach().float().requires_grad_() for t in (q, k, v, sinks)]
    wide_contract = Contract(band=Band(None, 0), offset=20, alibi_slopes=slopes.float(), sinks=wide[3], softcap=5.0)
    ref, ref_lse = flash_attention_with_lse(*wide[:3], wide_contract, block_q=16, block_k=16)
    assert out.dtype == dtype and lse.dtype == torch.float32
    step = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), ref, atol=step, rtol=step)
    assert_close(lse, ref_lse, chain=True)
    upstream = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out.float() * upstream).sum(), (q, k, v, sinks))
    ref_grads = torch.autograd.grad((ref * upstream).sum(), wide)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=4 * step * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("tangent_on", [0, 1, 2])
def test_flash_names_what_it_cannot_run(tangent_on):
    """Each refusal is its own exact message, whichever input carries a forward-mode tangent."""
    import torch.autograd.forward_ad as fwAD

    q, k, v = (t.detach() for t in _inputs((1, 1, 4, 3), (1, 1, 5, 3), 3))
    prefix = "the flash backend cannot run this call: "
    with fwAD.dual_level():
        inputs = [q, k, v]
        inputs[tangent_on] = fwAD.make_dual(inputs[tangent_on], torch.ones_like(inputs[tangent_on]))
        no_jvp = prefix + "it has no forward-mode AD (jvp); use backend='math'"
        with raises_exactly(ValueError, no_jvp):
            flash_attention(*inputs)
    with raises_exactly(ValueError, prefix + "it does not run under torch.func transforms (vmap, "
                                                         "grad, jvp, jacrev); use backend='math'"):
        torch.func.vmap(flash_attention)(q, k, v)
    mask = Contract(mask=torch.zeros(4, 5, dtype=torch.float64, requires_grad=True))
    with raises_exactly(ValueError, prefix + "it does not differentiate through attn_mask; "
                                                         "use backend='math'"):
        flash_attention(q, k, v, mask)
    with torch.no_grad():
        flash_attention(q, k, v, mask)  # no gradient asked: the mask is only read
    q.requires_grad_()
    out = flash_attention(q, k, v)
    with raises_exactly(RuntimeError, "the flash backend has no double backward "
                                                           "(create_graph=True); use backend='math' for higher "
                                                           "derivatives"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_dropout_draws_differ_between_calls_and_between_tiles():
    """A fresh seed per call (130 calls: no two share a draw) and an independent draw per tile
    (the 16 tiles of one call all differ). One-hot values make the output the dropped weights."""
    v = torch.eye(16, dtype=torch.float64).expand(1, 1, 16, 16)
    q, k = torch.zeros(1, 1, 16, 4, dtype=torch.float64), torch.zeros(1, 1, 16, 4, dtype=torch.float64)
    draws = {tuple((flash_attention_with_lse(q, k, v, dropout_p=0.5, block_q=4, block_k=4)[0] != 0).flatten().tolist())
             for _ in range(130)}
    assert len(draws) == 130
    kept = flash_attention_with_lse(q, k, v, dropout_p=0.5, block_q=4, block_k=4)[0][0, 0] != 0  # (16, 16)
    tiles = {tuple(kept[r:r + 4, c:c + 4].flatten().tolist()) for r in range(0, 16, 4) for c in range(0, 16, 4)}
    assert len(tiles) == 16


@pytest.mark.parametrize("implementation", ["flash", "numpy blocked"])
def test_very_negative_scores_after_a_hidden_tile_keep_their_softmax(implementation):
    """A row whose first key tile is all hidden, then sees scores near -900: the running max must
    stay -inf through the hidden tile, so the visible scores are shifted by their own max. (Found
    by mutation testing: the max was stored as 0, and e^(-900 - 0) floored or underflowed to a
    uniform average, or to nothing.)"""
    q = torch.full((1, 1, 2, 1), -30.0, dtype=torch.float64)
    k = torch.tensor([0.0] * 4 + [30.0, 30.1, 30.2, 30.3], dtype=torch.float64).view(1, 1, 8, 1)
    v = torch.arange(8.0, dtype=torch.float64).view(1, 1, 8, 1)
    seen = torch.tensor([[False] * 4 + [True] * 4])  # (1, S): the first tile hidden
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=1.0)
    if implementation == "flash":
        got, lse = flash_attention_with_lse(q, k, v, Contract(mask=seen, scale=1.0), block_q=1, block_k=4)
    else:
        got, lse = (torch.from_numpy(a) for a in oracle.blocked_attention(q.numpy(), k.numpy(), v.numpy(), seen.numpy(),
                                                                           False, 1.0, block_q=1, block_k=4))
    assert_close(got, want)
    torch.testing.assert_close(lse, torch.logsumexp((q @ k.transpose(-1, -2))[..., 4:], dim=-1), atol=1e-9, rtol=0)


@pytest.mark.parametrize("batched", ["q", "k", "v"])
def test_whichever_input_carries_the_batch_it_broadcasts(batched):
    g = torch.Generator().manual_seed(6)
    shapes = {"q": (1, 2, 5, 4), "k": (1, 2, 6, 4), "v": (1, 2, 6, 3)}
    shapes[batched] = (3, *shapes[batched][1:])
    q, k, v = (torch.randn(shapes[n], generator=g, dtype=torch.float64) for n in "qkv")
    out, _ = flash_attention_with_lse(q, k, v, CAUSAL, block_q=2, block_k=4)
    want = F.scaled_dot_product_attention(q.expand(3, 2, 5, 4), k.expand(3, 2, 6, 4), v.expand(3, 2, 6, 3),
                                          is_causal=True)
    assert_close(out, want)


def test_per_head_terms_with_more_than_one_batch_dim():
    """(B, X, H, L, D) inputs: ALiBi slopes and sinks belong to the last batch dim (heads), and
    their gradients sum over the others."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.5, 0.125], dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.2, -0.7], dtype=torch.float64, requires_grad=True)
    contract = Contract(band=Band(None, 0), alibi_slopes=slopes, sinks=sinks)
    out, _ = flash_attention_with_lse(q, k, v, contract, block_q=4, block_k=4)
    want, _ = mha.kernels.math_attention(q, k, v, contract)
    assert_close(out, want)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * upstream).sum(), (q, k, v, slopes, sinks))
    expected = torch.autograd.grad((want * upstream).sum(), (q, k, v, slopes, sinks))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0)


def test_dropout_edges_zero_and_one():
    """p = 0 draws nothing (the caller's random stream is untouched); p = 1 drops every weight."""
    q, k, v = (t.detach() for t in _inputs((1, 2, 5, 4), (1, 2, 7, 4), 3))
    state = torch.get_rng_state()
    assert_close(flash_attention(q, k, v, CAUSAL, dropout_p=0.0),
                 F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(flash_attention(q, k, v, CAUSAL, dropout_p=1.0), torch.zeros(1, 2, 5, 3, dtype=torch.float64))


@pytest.mark.parametrize("band", [Band(2, 0), Band(8, 0)])
def test_per_sequence_positions_in_small_tiles(band):
    """Positions with gaps (padding, a cache): each tile's band pattern comes from its own
    positions, not from another tile of the same shape and shift."""
    pos = torch.tensor([[0, 1, 2, 3, 4, 6, 8, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]])
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 24, 4, generator=g, dtype=torch.float64) for _ in range(3))
    contract = Contract(band=band, positions=(pos, pos))
    out, _ = flash_attention_with_lse(q, k, v, contract, block_q=4, block_k=4)
    rel = pos[0][None, :] - pos[0][:, None]  # key - query, by hand
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=(rel >= -band.left) & (rel <= 0))
    assert_close(out, want)


@pytest.mark.parametrize("backend", ["flash", "math", "sdpa"])
def test_alibi_is_added_in_the_compute_dtype(backend):
    """float32 slopes on float64 inputs: the bias -slope·|i - j| is formed in float64."""
    q, k, v = (t.detach() for t in _inputs((1, 2, 9, 4), (1, 2, 9, 4), 4))
    slopes = torch.tensor([0.3, 0.7])  # not exact in binary: float32 products would differ
    out = mha.kernels.attention(q, k, v, Contract(alibi_slopes=slopes), backend=backend)[0]
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    bias = -slopes.double()[:, None, None] * (j - i).abs()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias), atol=1e-14, rtol=0)


GQA_CONTRACTS = {  # name: contract terms over H = 6 query heads; every term that reads a head or a row
    "plain": {},
    "causal, bottom-right": dict(band=Band(None, 0), offset=9),
    "window, ALiBi, sinks, softcap": dict(band=Band(3, 1), alibi_slopes=torch.rand(6, dtype=torch.float64),
                                          sinks=torch.randn(6, dtype=torch.float64), softcap=2.0),
    "per-head mask, padding": dict(mask=torch.rand(2, 6, 7, 16) > 0.3,
                                   key_valid=torch.arange(16)[None, :] < torch.tensor([[16], [11]])),
    "per-sequence positions": dict(band=Band(None, 0), positions=(torch.tensor([[9, 10, 11, 12, 13, 14, 15]]),
                                                                  torch.arange(16)[None])),
}


@pytest.mark.parametrize("name", GQA_CONTRACTS)
@pytest.mark.parametrize("blocks", [(3, 5), (256, 256)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_gqa_on_flash_equals_repeated_heads_without_repeating_them(name, blocks, dropout_p, monkeypatch):
    """K and V with 2 heads for 6 query heads: the same output, log-sum-exp and gradients (of
    q, k, v, slopes and sinks) as with the heads repeated, and no repeat is made."""
    terms = {key: (value.clone().requires_grad_() if key in ("alibi_slopes", "sinks") else value)
             for key, value in GQA_CONTRACTS[name].items()}
    contract = Contract(**terms)
    q, k, v = _inputs((2, 6, 7, 4), (2, 2, 16, 4), 5)
    grad = torch.randn(2, 6, 7, 5, dtype=torch.float64)
    wanted = [x for x in (q, k, v, terms.get("alibi_slopes"), terms.get("sinks")) if x is not None]
    torch.manual_seed(1)  # the same dropout seed for both runs
    repeated = flash_attention_with_lse(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), contract,
                                        dropout_p=dropout_p, block_q=blocks[0], block_k=blocks[1])
    expected = torch.autograd.grad(repeated[0], wanted, grad)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", None)  # any repeat now fails
    torch.manual_seed(1)
    out, lse = flash_attention_with_lse(q, k, v, contract, dropout_p=dropout_p, block_q=blocks[0], block_k=blocks[1])
    assert_close(out, repeated[0])
    assert_close(lse, repeated[1])
    for mine, theirs in zip(torch.autograd.grad(out, wanted, grad), expected, strict=True):
        assert_close(mine, theirs)


@pytest.mark.parametrize("shapes", [((2, 4, 7, 4), (1, 2, 9, 4), (1, 2, 9, 5)),  # G = 2; the batch from q
                                    ((1, 4, 7, 4), (3, 2, 9, 4), (3, 2, 9, 5)),  # from k and v
                                    ((1, 4, 7, 4), (3, 2, 9, 4), (1, 2, 9, 5)),  # from k alone
                                    ((1, 4, 7, 4), (1, 2, 9, 4), (3, 2, 9, 5)),  # from v alone
                                    ((7, 4), (9, 4), (9, 5)),  # no head dim at all
                                    ((7, 4), (9, 4), (2, 9, 5)),  # v alone with a leading dim
                                    ((2, 7, 4), (9, 4), (9, 5))])  # q alone with a leading dim
def test_gqa_pairs_broadcast_batches_and_bare_matrices(shapes):
    """Two query heads per key/value head, with the batch broadcast from any side, and inputs of
    mixed ranks: output and gradients as with repeated heads on the math backend."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in shapes)
    contract = Contract(band=Band(None, 0), offset=2)
    grouped = q.dim() > 2 and k.dim() > 2 and k.shape[-3] != q.shape[-3]
    repeat = (lambda x: x.repeat_interleave(2, -3)) if grouped else (lambda x: x)  # noqa: E731
    expected_out, _ = mha.kernels.math_attention(q, repeat(k), repeat(v), contract)
    grad = torch.randn_like(expected_out)
    expected = torch.autograd.grad(expected_out, (q, k, v), grad)
    out, _ = flash_attention_with_lse(q, k, v, contract, block_q=3, block_k=4)
    for mine, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), expected, strict=True):
        assert_close(mine, theirs)
