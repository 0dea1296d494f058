"""Causal alignment, sliding windows and ALiBi in every backend, against masks built by hand."""

import numpy as np
import pytest
import torch

from helpers.tolerance import assert_close
from mha import numpy as oracle
from mha import positions
from mha.kernels import BACKENDS, Contract, flash_attention_with_lse, math_attention
from mha.positions import Band

BACKEND_NAMES = ["math", "sdpa", "flash"]


def _run(backend, *args, **kwargs):
    result = BACKENDS[backend](*args, **kwargs)
    return result[0] if backend == "math" else result  # math also returns the weights


def _visible(L, S, left, right, offset):
    """The formula, by hand: query i sees key j iff i + offset - left <= j <= i + offset + right."""
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    ok = np.ones((L, S), dtype=bool)
    if left is not None:
        ok &= j >= i + offset - left
    if right is not None:
        ok &= j <= i + offset + right
    return ok


def _inputs(L, S, H=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, H, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in (L, S, S)]


CASES = [  # (L, S, band, offset)
    (9, 9, Band(None, 0), 0),
    (5, 12, Band(None, 0), 7),
    (12, 5, Band(None, 0), -7),
    (5, 12, Band(None, 0), 3),
    (40, 40, Band(6, 0), 0),
    (40, 40, Band(3, 5), 0),
    (17, 45, Band(4, None), 28),
    (33, 33, Band(None, None), 0),
]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("L, S, band, offset", CASES, ids=str)
def test_band_equals_its_explicit_mask(backend, L, S, band, offset):
    q, k, v = _inputs(L, S)
    visible = _visible(L, S, band.left, band.right, offset)
    out = _run(backend, q, k, v, Contract(band=band, offset=offset))  # sdpa: a window folds into one mask
    want, _ = oracle.scaled_dot_product_attention(*(t.detach().numpy() for t in (q, k, v)), visible)
    assert_close(out.detach().numpy(), want)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = math_attention(q2, k2, v2, Contract(mask=torch.from_numpy(visible)))
    for a, b in zip(got, torch.autograd.grad((ref * g).sum(), (q2, k2, v2))):
        assert_close(a, b, chain=True)


@pytest.mark.parametrize("L, S, band, offset", CASES + [(6, 9, Band(2, 2), -4), (3, 8, Band(1, 0), 20)], ids=str)
def test_band_visible_draws_the_formula(L, S, band, offset):
    np.testing.assert_array_equal(band.visible(L, S, offset).numpy(), _visible(L, S, band.left, band.right, offset))


@pytest.mark.parametrize("blocks", [(4, 4), (7, 3), (64, 128)])
def test_flash_window_with_small_blocks(blocks):
    L = S = 50
    q, k, v = _inputs(L, S, seed=3)
    out, _ = flash_attention_with_lse(q, k, v, Contract(band=positions.band(window=(5, 2))),
                                      block_q=blocks[0], block_k=blocks[1])
    want, _ = oracle.scaled_dot_product_attention(*(t.detach().numpy() for t in (q, k, v)),
                                                  _visible(L, S, 5, 2, 0))
    assert_close(out.detach().numpy(), want)


def test_alibi_slopes_are_the_papers():
    np.testing.assert_allclose(positions.alibi_slopes(8).numpy(), [2.0 ** -(i + 1) for i in range(8)])
    # 12 heads: the 8-head slopes, then every other slope of 16 heads for the remaining 4
    sixteen = [2.0 ** (-(i + 1) / 2) for i in range(16)]
    np.testing.assert_allclose(positions.alibi_slopes(12).numpy(),
                               [2.0 ** -(i + 1) for i in range(8)] + sixteen[0::2][:4], rtol=1e-6)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("L, S, causal", [(10, 10, True), (6, 14, False), (20, 20, False)])
def test_alibi_equals_its_explicit_bias(backend, L, S, causal):
    H = 3
    q, k, v = _inputs(L, S, H, seed=5)
    slopes = positions.alibi_slopes(H).double()
    contract = Contract(band=Band(None, 0) if causal else None, offset=S - L, alibi_slopes=slopes)
    out = _run(backend, q, k, v, contract)
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    bias = -slopes.numpy()[:, None, None] * np.abs(j - i - (S - L))  # (H, L, S)
    if causal:
        bias = np.where(_visible(L, S, None, 0, S - L), bias, -np.inf)
    want, _ = oracle.scaled_dot_product_attention(*(t.detach().numpy() for t in (q, k, v)), bias)
    assert_close(out.detach().numpy(), want)


def test_window_argument_errors():
    for window in [(2,), (-2, 0), (True, 0), (1.5, 0), "10"]:
        with pytest.raises(ValueError, match="window"):
            positions.band(window=window)
    with pytest.raises(ValueError, match="alignment"):
        positions.offset_of("middle", 4, 4)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_functional_sdpa_alignment_window_and_alibi(backend):
    from mha.functional import scaled_dot_product_attention as sdpa

    q, k, v = (t.detach() for t in _inputs(4, 9))
    got = sdpa(q, k, v, is_causal=True, causal_alignment="bottom_right", backend=backend)
    want, _ = oracle.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), _visible(4, 9, None, 0, 5))
    assert_close(got.numpy(), want)
    got = sdpa(q, k, v, window=(2, 1), backend=backend)
    want, _ = oracle.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), _visible(4, 9, 2, 1, 5))
    assert_close(got.numpy(), want)
    slopes = positions.alibi_slopes(3).double()
    got = sdpa(q, k, v, alibi_slopes=slopes, backend=backend)
    i, j = np.arange(4)[:, None], np.arange(9)[None, :]
    want, _ = oracle.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(),
                                                  -slopes.numpy()[:, None, None] * np.abs(j - i - 5))
    assert_close(got.numpy(), want)
    with pytest.raises(ValueError, match="alibi_slopes"):
        sdpa(q, k, v, alibi_slopes=torch.ones(5, dtype=torch.float64))


def test_a_band_that_hides_nothing_is_not_needed():
    from mha.positions import CAUSAL, needed

    assert needed(CAUSAL, 1, 9, offset=8) is None  # a decode step: the new query sees every key
    assert needed(CAUSAL, 2, 9, offset=7) is CAUSAL  # the first of two queries may not see the last key
    assert needed(CAUSAL, 4, 4) is CAUSAL
    assert needed(Band(3, 0), 1, 9, offset=8) == Band(3, 0)  # a window hides the oldest keys
    assert needed(Band(8, 0), 1, 9, offset=8) is None
    assert needed(None, 3, 3) is None


def test_position_helpers_pin_their_edges():
    """The edges mutation testing found unpinned: -1 means unbounded, no band when nothing is
    bounded, positions on the caller's device, the default offset, the messages."""
    from mha.positions import alibi_slopes, aligned, band, check_window, needed

    assert check_window((-1, 0)) == (None, 0) and check_window((3, -1)) == (3, None)
    assert band(False, (-1, -1)) is None and band(False, (3, -1)) == Band(3, None)
    assert band(True, (-1, 5)) == Band(None, 0)
    q_pos, k_pos = aligned(range(2, 5), range(0, 3), 1, torch.device("meta"))
    assert q_pos.device.type == k_pos.device.type == "meta"
    assert needed(Band(3, None), 4, 4) is None  # offset 0: query 3 reaches key 0 at distance -3
    assert needed(Band(3, None), 4, 4, offset=1) == Band(3, None)
    with pytest.raises(TypeError, match="is_causal must be a bool, got int"):
        band(1)
    with pytest.raises(ValueError, match=r"^num_heads must"):
        alibi_slopes(0)
