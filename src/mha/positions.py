"""The one position rule: how far key j is from query i, and which distances are visible.

Every query and every key has a position. The distance that masks, windows and ALiBi read is

    rel = position(key j) - position(query i) = j - (i + offset)

with the default positions (query i at i + offset, key j at j). ``offset`` is the alignment:

    top_left      offset 0:      query 0 faces key 0 (torch's SDPA is_causal)
    bottom_right  offset S - L:  the last query faces the last key (flash-attn; L new tokens after
                                 S - L cached ones)

A KV cache whose sequences have different lengths gives the positions explicitly, per sequence
(B, L) and (B, S), and the same rule applies with offset 0. Nothing else in the package computes
a relative position or a key interval: every consumer asks this module, in the form it needs:

    Band.allowed(rel)                  the rule itself: which distances are visible
    Band.reach / interval / visible    each query's keys [first, stop) (the C++ kernel mirrors reach)
    Band.key_range / covers, needed    a block of queries: the keys any sees, whether all see a tile
    Band.causal_shift(offset)          causality moved: row i sees j <= i + d (torch's causal kernels,
                                       the fused log-sum-exp parts of ring attention)
    Band.strided(stride, shift)        the band on index distances of a striped layout (ring attention)
    offset_between(a, b)               queries placed from a against keys from b (a cache, a ring
                                       block, transformers' q_offset and kv_offset)
    offset_of(alignment, L, S)         top-left 0, bottom-right S - L
    packed(lengths_q, lengths_k, band) sequences packed one after another (varlen) as positions

The tests hold each of these, and the C++ mirror, against Band.allowed on random bands, offsets
and positions (tests/kernels/test_key_rule.py, test_key_interval.py).

The float64 oracle (mha.numpy) keeps its own copy of this rule on purpose: an oracle shares nothing
with what it checks.

    causal                         Band(left=None, right=0)     rel <= 0
    sliding window (w_l, w_r)      Band(w_l, w_r)               -w_l <= rel <= w_r
    causal window of w_l           Band(w_l, 0)

        keys j ->        causal, offset 0     window (2, 0), offset 0     causal, offset 2 (L=3, S=5)
        queries i        x . . . .            x . . . .                   x x x . .
            |            x x . . .            x x . . .                   x x x x .
            v            x x x . .            x x x . .                   x x x x x
                         x x x x .            . x x x .
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import _checks

# what users call; the rest (aligned, check_window, needed) serves the modules and kernels
__all__ = ["Band", "CAUSAL", "alibi_bias", "alibi_slopes", "band", "offset_between", "offset_of", "packed", "relative"]

ALIGNMENTS = ("top_left", "bottom_right")


def offset_of(alignment: str, L: int, S: int) -> int:
    """The offset of an alignment: 0 for "top_left", S - L for "bottom_right"."""
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be 'top_left' or 'bottom_right', got {alignment!r}")
    return 0 if alignment == "top_left" else S - L


def offset_between(query_start: int, key_start: int) -> int:
    """The offset of queries placed from ``query_start`` against keys placed from ``key_start``
    (query i at query_start + i, key j at key_start + j: rel = j - (i + query_start - key_start)).
    A cache's offset, a ring block's, transformers' q_offset against kv_offset: all are this."""
    return query_start - key_start


def relative(query_positions, key_positions):
    """(..., L, S) distances key - query: query_positions (..., L), key_positions (..., S)."""
    return key_positions[..., None, :] - query_positions[..., :, None]


def whole(n) -> slice:
    """Rows or columns 0..n-1 where a range of them is taken (anything with .start and .stop): a
    slice, which keeps n symbolic under torch.export and torch.compile (range(n) would fix it)."""
    return slice(0, n)


def aligned(rows: range, cols: range, offset: int, device=None) -> tuple[Tensor, Tensor]:
    """The default positions of query rows (i + offset) and key columns (j), as int64 tensors."""
    return (torch.arange(rows.start, rows.stop, device=device) + offset,
            torch.arange(cols.start, cols.stop, device=device))


@dataclass(frozen=True)
class Band:
    """The visible distances: -left <= rel <= right (None: unbounded on that side)."""
    left: int | None = None
    right: int | None = 0

    def allowed(self, rel):
        """Bool like ``rel``: True where the distance is inside the band."""
        ok = rel == rel  # all True (rel holds integers), in rel's array type
        if self.left is not None:
            ok = ok & (rel >= -self.left)
        if self.right is not None:
            ok = ok & (rel <= self.right)
        return ok

    def reach(self, query_position):
        """The key-interval rule, the only one in Python (csrc/native.cpp's key_interval mirrors it; a
        test checks the two agree): a query at position p sees the keys at positions [p - left,
        p + right], given as (lowest, stop) = (p - left, p + right + 1), None where unbounded."""
        lowest = None if self.left is None else query_position - self.left
        stop = None if self.right is None else query_position + self.right + 1
        return lowest, stop

    def interval(self, query_position, keys):
        """[first, stop): the indices of the keys a query at ``query_position`` sees (its reach).
        ``keys``: S (keys 0..S-1 at positions 0..S-1) or their positions (S,), never decreasing.
        query_position: an int, or a tensor of them (first and stop then tensors of its shape).
        Every query's visible keys are one interval; first and stop never decrease as the
        query's position grows, so a block of queries sees [first of its first, stop of its last)."""
        lowest, stop_position = self.reach(query_position)
        if isinstance(keys, int):
            first = 0 if lowest is None else _clamp(lowest, 0, keys)
            stop = keys if stop_position is None else _clamp(stop_position, 0, keys)
        else:
            first = 0 if lowest is None else torch.searchsorted(keys, lowest)
            stop = keys.shape[-1] if stop_position is None else torch.searchsorted(keys, stop_position)
        if not isinstance(query_position, Tensor):
            return first, max(first, stop)
        first = torch.as_tensor(first, device=query_position.device).expand_as(query_position)
        stop = torch.as_tensor(stop, device=query_position.device).expand_as(query_position)
        return first, torch.maximum(first, stop)

    def key_range(self, first_query: int, last_query: int, S: int) -> tuple[int, int]:
        """[lo, hi): the keys 0..S-1 that a query at some position in [first_query, last_query]
        may see, with keys at positions 0..S-1 (the flash kernel skips tiles outside)."""
        lo = self.interval(first_query, S)[0]
        return lo, max(lo, self.interval(last_query, S)[1])

    def covers(self, first_query: int, last_query: int, first_key: int, stop_key: int) -> bool:
        """Whether queries at positions first_query..last_query all see every key of first_key..
        stop_key - 1 (keys at positions 0..S-1): the last query's reach starts at or before
        them, the first query's ends at or after them (plain ints: a range would make
        torch.compile specialise a symbolic length)."""
        lowest, _ = self.reach(last_query)
        _, stop = self.reach(first_query)
        return (lowest is None or lowest <= first_key) and (stop is None or stop >= stop_key)

    def visible(self, L: int, S: int, offset: int = 0, device=None) -> Tensor:
        """(L, S) bool, True where query i (at i + offset) sees key j (at j): each row's interval."""
        first, stop = self.interval(torch.arange(L, device=device) + offset, S)  # (L,), (L,)
        keys = torch.arange(S, device=device)
        return (keys >= first[:, None]) & (keys < stop[:, None])  # (L, S)

    def causal_shift(self, offset: int) -> int | None:
        """Causality moved by a shift d: query row i (at i + offset) sees exactly the keys j <= i + d
        (d = offset + right), for a band bounded on the right only; None for any other band. What
        torch's causal kernels take: d = 0 is their is_causal, d < 0 leaves the first -d rows with
        no key, d >= S - 1 lets every row see every key."""
        if self.left is not None or self.right is None:
            return None
        return offset + self.right

    def strided(self, stride: int, shift: int) -> Band:
        """The band on index distances j - i when rel = stride * (j - i) + shift (a striped layout:
        query i at a + stride i, key j at b + stride j, shift = b - a):
        -left <= rel <= right  <=>  ceil((-left - shift) / stride) <= j - i <= floor((right - shift) / stride)."""
        left = None if self.left is None else (self.left + shift) // stride  # -ceil(x) = floor(-x)
        right = None if self.right is None else (self.right - shift) // stride
        return Band(left, right)

    @property
    def is_causal(self) -> bool:
        return self.left is None and self.right == 0


CAUSAL = Band(None, 0)  # keys at distance <= 0: the band of plain causality


def band(is_causal: bool = False, window: tuple[int, int] | None = None) -> Band | None:
    """The Band of causality and/or a sliding window, or None when every key is visible.

    window: flash-attn's window_size (left, right), -1 = unbounded on that side; with is_causal
    the right side is 0.
    """
    _checks.flag("is_causal", is_causal)
    if window is None:
        return CAUSAL if is_causal else None
    left, right = check_window(window)
    if is_causal:
        right = 0
    return None if left is None and right is None else Band(left, right)


def needed(band: Band | None, L: int, S: int, offset: int = 0) -> Band | None:
    """``band``, or None when it hides no key from queries offset..offset+L-1 over keys 0..S-1 (a
    causal decode step sees every cached key: no band is left to apply)."""
    if band is None or (L > 0 and S > 0 and band.covers(offset, offset + L - 1, 0, S)):
        return None
    return band


def packed(lengths_q: Tensor, lengths_k: Tensor, band: Band | None) -> tuple[Tensor, Tensor, Band]:
    """Sequences packed one after another (flash-attn's varlen layout) as positions and one band:
    (query positions (Tq,), key positions (Tk,), the band). Sequence b's queries are bottom-right
    aligned against its keys (query i at i + S_b - L_b); sequences sit far enough apart that the
    band, bounded by the longest sequence, never reaches from one into another."""
    longest_q, longest_k = (int(x.max()) if len(x) else 0 for x in (lengths_q, lengths_k))
    gap = 2 * (longest_q + longest_k) + 1  # between sequences' positions: beyond the band below
    starts = torch.arange(len(lengths_q)) * gap
    q_pos = torch.repeat_interleave(starts + lengths_k - lengths_q, lengths_q) + _ranks(lengths_q)
    k_pos = torch.repeat_interleave(starts, lengths_k) + _ranks(lengths_k)
    left, right = (None, None) if band is None else (band.left, band.right)
    within = Band(longest_k if left is None else min(left, longest_k), longest_q if right is None else min(right, longest_q))
    return q_pos, k_pos, within


def _ranks(lengths: Tensor) -> Tensor:
    """0..n_b-1 for each sequence, concatenated: (sum of lengths,)."""
    total = int(lengths.sum())
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return torch.arange(total) - starts


def check_window(window) -> tuple[int | None, int | None]:
    """A window (left, right) of ints >= -1 as (left, right) with None for unbounded."""
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ValueError(f"window must be a pair (left, right) of ints >= -1 (-1 = unbounded), got {window!r}")
    return tuple(None if w == -1 else w for w in window)


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's per-head slopes (Press et al. 2022): 2^(-8 i / n) for i = 1..n when n is a power of
    two; otherwise the slopes of the largest power of two below n, then every other slope of the
    next power of two for the remaining heads."""
    num_heads = _checks.positive_int("num_heads", num_heads)

    def powers(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(closest)
    if closest < num_heads:
        slopes += powers(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes)


def _clamp(x: int, lo: int, hi: int):
    """x within [lo, hi], for an int or a tensor."""
    return min(max(x, lo), hi) if isinstance(x, int) else x.clamp(lo, hi)


def alibi_bias(slopes, rel):
    """ALiBi's bias -slope_h * |rel|: slopes (H,), rel (..., L, S) -> (..., H, L, S)."""
    return -slopes[:, None, None] * abs(rel[..., None, :, :])
