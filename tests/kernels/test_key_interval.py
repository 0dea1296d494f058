"""The key-interval rule is written once in Python (mha.positions.Band.interval) and once in C++
(native.cpp's key_interval, from the band's reach): the two agree on every query of a grid of shapes,
bands, alignments and given positions and on random ones, and the band's masks, block ranges and tile
covers all follow from it."""

import itertools
import random

import pytest
import torch

from mha.kernels import Contract, native
from mha.positions import Band

BANDS = [Band(None, 0), Band(3, 0), Band(2, 1), Band(0, 0), Band(4, None), Band(None, 2), Band(1, -1), Band(-1, 3)]
SHAPES = [(1, 1), (5, 5), (3, 8), (8, 3), (16, 17), (17, 16), (1, 64), (65, 64)]


def _python(band: Band, L: int, S: int, offset: int, positions=None):
    if positions is None:
        return band.interval(torch.arange(L) + offset, S)
    q_pos, k_pos = positions
    return band.interval(q_pos, k_pos)


def _cpp(band: Band, offset: int, L: int, S: int, positions=None):
    """The kernel's (first, stop, visible) of each query, the band handed over as every call hands it
    (native._terms of a Contract)."""
    terms = native._terms(Contract(band=band, offset=offset, positions=positions), 1, torch.float32)
    return native._kernel().key_intervals(terms, L, S)


@pytest.mark.skipif(not native.native_available(), reason="the compiled kernel is not available here")
@pytest.mark.parametrize("band", BANDS, ids=repr)
def test_python_and_cpp_give_every_query_the_same_keys(band):
    for (L, S), alignment in itertools.product(SHAPES, ("top_left", "bottom_right")):
        offset = 0 if alignment == "top_left" else S - L
        want = _python(band, L, S, offset)
        got = _cpp(band, offset, L, S)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, torch.as_tensor(b).expand(L).long(), atol=0, rtol=0)
        g = torch.Generator().manual_seed(L * 100 + S)  # given positions: a cache after padded prompts
        k_pos = torch.randint(0, 3, (S,), generator=g).cumsum(0)  # non-decreasing, repeats and gaps
        q_pos = torch.randint(-2, int(k_pos[-1]) + 3, (L,), generator=g).sort().values
        want = _python(band, L, S, 0, (q_pos, k_pos))
        got = _cpp(band, 0, L, S, (q_pos[None].contiguous(), k_pos[None].contiguous()))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, torch.as_tensor(b).expand(L).long(), atol=0, rtol=0)


@pytest.mark.parametrize("band", BANDS, ids=repr)
def test_the_interval_is_the_band_on_distances(band):
    """[first, stop) holds exactly the keys whose distance the band allows."""
    for L, S in SHAPES:
        for offset in (0, S - L, 3):
            rel = torch.arange(S)[None, :] - (torch.arange(L)[:, None] + offset)
            assert torch.equal(band.visible(L, S, offset), band.allowed(rel))
            lo, hi = band.key_range(offset, offset + L - 1, S)
            seen = band.allowed(rel).any(0).nonzero()
            if len(seen):
                assert lo <= int(seen.min()) and int(seen.max()) < hi
            for start in range(0, S, 4):
                cols = range(start, min(S, start + 4))
                covered = bool(band.allowed(rel)[:, start:cols.stop].all())
                assert band.covers(offset, offset + L - 1, cols.start, cols.stop) == covered


def _random_side(rng, S: int):
    """One side of a band: unbounded, negative, 0, positive (within or past the keys), or far."""
    kind = rng.choice(("none", "negative", "zero", "positive", "far"))
    if kind == "none":
        return None
    if kind == "negative":
        return -rng.randint(1, S + 3)
    if kind == "zero":
        return 0
    if kind == "positive":
        return rng.randint(1, 2 * S + 3)
    return rng.choice((2 ** 62, -(2 ** 62), 2 ** 63 - 2))  # 2^63 - 2: one below the kernel's "unbounded"


def _random_positions(rng, g, L: int, S: int):
    """(offset, q_pos, k_pos, given): default positions (query i at i + offset, offset negative, within or
    past S; key j at j) or given ones, keys non-decreasing with repeats and gaps, queries anywhere."""
    if rng.random() < 0.5:
        offset = rng.randint(-2 * S - 5, 2 * S + 5)
        return offset, torch.arange(L) + offset, torch.arange(S), False
    k_pos = rng.randint(-20, 20) + torch.randint(0, 4, (S,), generator=g).cumsum(0)  # (S,)
    top = int(k_pos[-1]) if S else 0
    q_pos = torch.randint(rng.randint(-30, 0) + (int(k_pos[0]) if S else 0), top + rng.randint(1, 30), (L,), generator=g)
    return 0, q_pos, k_pos, True


@pytest.mark.skipif(not native.native_available(), reason="the compiled kernel is not available here")
def test_cpp_band_rule_is_band_allowed_on_random_bands_and_positions():
    """On random bands (sides None, negative, 0, positive, near int64's end), offsets (negative, past S)
    and given positions (non-decreasing keys with gaps), every query's C++ key interval is exactly the
    set of keys whose distance Band.allowed accepts, and equals Band.interval; the kernel's per-key
    test (what a tile of keys out of order or with ALiBi reads) is Band.allowed too, keys in any order."""
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    for _ in range(1500):
        L, S = rng.randint(0, 12), rng.randint(0, 40)
        band = Band(_random_side(rng, S), _random_side(rng, S))
        offset, q_pos, k_pos, given = _random_positions(rng, g, L, S)
        if given and S and rng.random() < 0.3:  # keys out of order: the per-key test alone applies
            k_pos = k_pos[torch.randperm(S, generator=g)]
            sorted_keys = False
        else:
            sorted_keys = True
        positions = (q_pos[None].contiguous(), k_pos[None].contiguous()) if given else None
        first, stop, visible = _cpp(band, offset, L, S, positions)
        allowed = band.allowed(k_pos[None, :] - q_pos[:, None])  # (L, S): the rule in Python
        case = f"{band}, offset {offset}, L {L}, S {S}, q_pos {q_pos.tolist()}, k_pos {k_pos.tolist()}"
        assert torch.equal(visible, allowed), case
        if not sorted_keys:
            continue
        keys = torch.arange(S)
        interval = (keys >= first[:, None]) & (keys < stop[:, None])  # (L, S)
        assert torch.equal(interval, allowed), case
        if max(abs(s) for s in (band.left or 0, band.right or 0)) < 2 ** 63 - 2 - 100:  # Python's int64 reach wraps past it
            want = band.interval(q_pos, k_pos if given else S)
            assert first.tolist() == torch.as_tensor(want[0]).expand(L).tolist(), case
            assert stop.tolist() == torch.as_tensor(want[1]).expand(L).tolist(), case
