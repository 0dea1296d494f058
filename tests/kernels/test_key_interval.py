"""The key-interval rule is written once in Python (mha.positions.Band.interval) and once in C++
(native.cpp's key_interval): the two agree on every query of a grid of shapes, bands, alignments
and given positions, and the band's masks, block ranges and tile covers all follow from it."""

import itertools

import pytest
import torch

from mha.kernels import native
from mha.positions import Band

BANDS = [Band(None, 0), Band(3, 0), Band(2, 1), Band(0, 0), Band(4, None), Band(None, 2), Band(1, -1), Band(-1, 3)]
SHAPES = [(1, 1), (5, 5), (3, 8), (8, 3), (16, 17), (17, 16), (1, 64), (65, 64)]


def _python(band: Band, L: int, S: int, offset: int, positions=None):
    if positions is None:
        return band.interval(torch.arange(L) + offset, S)
    q_pos, k_pos = positions
    return band.interval(q_pos, k_pos)


@pytest.mark.skipif(not native.native_available(), reason="the compiled kernel is not available here")
@pytest.mark.parametrize("band", BANDS, ids=repr)
def test_python_and_cpp_give_every_query_the_same_keys(band):
    kernel = native._kernel()
    unbounded = native._UNBOUNDED
    for (L, S), alignment in itertools.product(SHAPES, ("top_left", "bottom_right")):
        offset = 0 if alignment == "top_left" else S - L
        left = unbounded if band.left is None else band.left
        right = unbounded if band.right is None else band.right
        want = _python(band, L, S, offset)
        got = kernel.key_intervals(left, right, offset, L, S, None, None)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, torch.as_tensor(b).expand(L).long(), atol=0, rtol=0)
        g = torch.Generator().manual_seed(L * 100 + S)  # given positions: a cache after padded prompts
        k_pos = torch.randint(0, 3, (S,), generator=g).cumsum(0)  # non-decreasing, repeats and gaps
        q_pos = torch.randint(-2, int(k_pos[-1]) + 3, (L,), generator=g).sort().values
        want = _python(band, L, S, 0, (q_pos, k_pos))
        got = kernel.key_intervals(left, right, 0, L, S, q_pos[None].contiguous(), k_pos[None].contiguous())
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
