"""The key rule ("which keys a query sees") is Band.allowed(rel), rel = key position - query
position. Every Python translation of it (intervals, key ranges, covers, the causal shift torch's
kernels take, a striped layout's band, the packed layout, placed offsets, the contract's tile
rules, the fused log-sum-exp form) must agree with Band.allowed on random bands, offsets and
positions. The C++ mirror is checked against the same rule in test_key_interval.py."""

import random

import pytest
import torch

from mha import positions
from mha.kernels import Contract, sdpa
from mha.positions import Band

SEEDS = range(300)


def _random_band(rng: random.Random) -> Band:
    side = lambda: rng.choice([None, *range(-3, 7)])  # noqa: E731
    return Band(side(), side())


def _truth(band: Band, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    return band.allowed(positions.relative(q_pos, k_pos))  # (L, S)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_python_translation_agrees_with_band_allowed(seed):
    rng = random.Random(seed)
    band, L, S, offset = _random_band(rng), rng.randint(0, 9), rng.randint(0, 9), rng.randint(-10, 10)
    q_pos, k_pos = positions.aligned(range(L), range(S), offset)
    truth = _truth(band, q_pos, k_pos)  # (L, S)
    assert torch.equal(band.visible(L, S, offset), truth)  # interval of each query
    contract = Contract(band=band, offset=offset)
    for rows in (range(0, L), range(L // 3, L)):
        if len(rows) == 0 or S == 0:
            continue
        seen = truth[rows.start:rows.stop].any(0).nonzero().flatten()
        lo, hi = contract.key_range(rows, S)
        if len(seen):  # the tightest range: the first and last key some query of the rows sees
            assert (lo, hi) == (int(seen[0]), int(seen[-1]) + 1), (band, offset, rows)
        # (a band that hides every distance, left < -right, may leave a range over keys none sees:
        # a tile skipped less, never a key lost)
        cols = range(rng.randint(0, S - 1), S)
        assert contract.band_covers(rows, cols) == bool(truth[rows.start:rows.stop, cols.start:cols.stop].all())
    if L and S:
        assert (positions.needed(band, L, S, offset) is None) == bool(truth.all())
    shift = band.causal_shift(offset)
    if shift is not None:  # plain causality moved: query row i sees keys j <= i + shift
        assert torch.equal(truth, torch.arange(S)[None, :] <= torch.arange(L)[:, None] + shift)
    else:
        assert band.left is not None or band.right is None


@pytest.mark.parametrize("seed", SEEDS)
def test_a_placed_offset_and_a_striped_band_see_the_same_keys(seed):
    rng = random.Random(seed)
    band, L, S = _random_band(rng), rng.randint(1, 8), rng.randint(1, 8)
    a, b, stride = rng.randint(-20, 20), rng.randint(-20, 20), rng.randint(1, 4)
    placed = _truth(band, torch.arange(L) + a, torch.arange(S) + b)  # query i at a + i, key j at b + j
    assert torch.equal(band.visible(L, S, positions.offset_between(a, b)), placed)
    striped = _truth(band, a + stride * torch.arange(L), b + stride * torch.arange(S))  # a ring's striped pieces
    index = torch.arange(S)[None, :] - torch.arange(L)[:, None]  # j - i
    assert torch.equal(band.strided(stride, b - a).allowed(index), striped)


@pytest.mark.parametrize("seed", SEEDS[:100])
def test_the_packed_layout_is_each_sequence_bottom_right_and_nothing_across(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    lengths_q = torch.tensor([rng.randint(0, 6) for _ in range(n)])
    lengths_k = torch.tensor([rng.randint(0, 6) for _ in range(n)])
    band = rng.choice([None, positions.CAUSAL, *(_random_band(rng) for _ in range(3))])
    if band is not None and band.left is None and band.right is None:
        band = None
    q_pos, k_pos, within = positions.packed(lengths_q, lengths_k, band)
    got = _truth(within, q_pos, k_pos)  # (Tq, Tk)
    want = torch.zeros(int(lengths_q.sum()), int(lengths_k.sum()), dtype=torch.bool)
    r = c = 0
    for L, S in zip(lengths_q.tolist(), lengths_k.tolist()):
        alone = torch.ones(L, S, dtype=torch.bool) if band is None else band.visible(L, S, S - L)  # bottom-right
        want[r:r + L, c:c + S] = alone
        r, c = r + L, c + S
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", SEEDS[:100])
def test_the_fused_lse_form_is_the_band(seed):
    """sdpa.lse_form's (causal, lag): query i sees keys j <= i - lag (every key without causality)."""
    rng = random.Random(seed)
    T = rng.randint(1, 8)
    band, offset = rng.choice([None, positions.CAUSAL, _random_band(rng)]), rng.randint(-9, 3)
    x = torch.zeros(1, 1, T, 4)
    form = sdpa.lse_form(x, x, x, Contract(band=band, offset=offset))
    if form is None:
        return
    causal, lag = form
    truth = torch.ones(T, T, dtype=torch.bool) if band is None else band.visible(T, T, offset)
    want = torch.arange(T)[None, :] <= torch.arange(T)[:, None] - lag if causal else torch.ones(T, T, dtype=torch.bool)
    assert torch.equal(truth, want)
