"""The one place where masks are validated and brought to the internal form.

Internal form: an ADDITIVE float mask in the query's accumulation dtype (float32 for float16 and
bfloat16 queries, else the query's dtype; see ``additive_dtype``), broadcastable to (B, H, L, S),
holding 0 where a query may attend and -inf where it may not (or any float the caller added),
plus a separate ``is_causal`` flag that kernels apply themselves (top-left aligned: query i sees
keys j <= i, as torch.nn.functional.scaled_dot_product_attention).

The two bool conventions of torch, each honoured at its own entry point:
    torch.nn.MultiheadAttention / multi_head_attention_forward:  True = masked OUT
    torch.nn.functional.scaled_dot_product_attention:            True = ATTEND

Shape legend: B batch, H heads, L query length, S key length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks

_NEG_INF = float("-inf")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _bool_to_additive(masked_out: Tensor, dtype: torch.dtype) -> Tensor:
    """True (masked out) -> -inf, False -> 0."""
    return torch.zeros(masked_out.shape, dtype=dtype, device=masked_out.device).masked_fill_(
        masked_out, _NEG_INF
    )


def additive_dtype(query_dtype: torch.dtype) -> torch.dtype:
    """The dtype masks are held and added in: float32 for float16/bfloat16 queries (a float16
    mask has no room below -65504, and scores are accumulated in float32), else the query's."""
    return torch.float32 if query_dtype in _LOW_PRECISION else query_dtype


def to_dtype(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """An additive mask in ``dtype``; when narrowing, finite values stay finite (-1e300 from
    float64 becomes float32's lowest value, not -inf, which would zero a row torch averages)."""
    if mask.dtype == dtype:
        return mask
    if torch.finfo(mask.dtype).max > torch.finfo(dtype).max:
        finite = torch.finfo(dtype)
        mask = torch.where(mask.isinf(), mask, mask.clamp(finite.min, finite.max))
    return mask.to(dtype)


def as_additive(mask: Tensor, true_means_attend: bool, dtype: torch.dtype) -> Tensor:
    """A bool mask (in the given convention) as 0 / -inf, or a float mask in ``dtype``."""
    if mask.dtype == torch.bool:
        return _bool_to_additive(~mask if true_means_attend else mask, dtype)
    return to_dtype(mask, dtype)


@dataclass(frozen=True)
class Band:
    """Which keys j query i may see: i + offset - left <= j <= i + offset + right.

    ``left``/``right`` None means unbounded. ``offset`` aligns queries to keys: 0 is top-left
    (query 0 faces key 0: SDPA's is_causal), S - L is bottom-right (the last query faces the last
    key: flash-attn's convention, and what a KV cache needs when L new queries follow S - L
    cached keys).

        causal, top-left:      Band(None, 0, 0)
        causal, bottom-right:  Band(None, 0, S - L)
        window (w_l, w_r):     Band(w_l, w_r, S - L)   (flash-attn's window_size, -1 = unbounded)
    """
    left: int | None = None
    right: int | None = 0
    offset: int = 0

    def allowed(self, rows: Tensor, cols: Tensor) -> Tensor:
        """Bool (..., len(rows), len(cols)): True where query at position rows[a] may see the key at
        cols[b]. rows (..., L) and cols (..., S) may carry batch dims (per-sequence positions)."""
        rel = cols[..., None, :] - rows[..., :, None] - self.offset  # j - (i + offset)
        ok = torch.ones_like(rel, dtype=torch.bool)
        if self.left is not None:
            ok &= rel >= -self.left
        if self.right is not None:
            ok &= rel <= self.right
        return ok

    def key_range(self, i0: int, i1: int, S: int) -> tuple[int, int]:
        """[lo, hi): the keys some query in [i0, i1) may see (tiles outside are skipped)."""
        lo = 0 if self.left is None else max(0, i0 + self.offset - self.left)
        hi = S if self.right is None else min(S, i1 - 1 + self.offset + self.right + 1)
        return lo, max(lo, hi)


def causal_band(L: int, S: int, alignment: str = "top_left") -> Band:
    """The causal Band, aligned "top_left" (SDPA's is_causal) or "bottom_right" (KV caches)."""
    if alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"alignment must be 'top_left' or 'bottom_right', got {alignment!r}")
    return Band(None, 0, 0 if alignment == "top_left" else S - L)


def window_band(L: int, S: int, window: tuple[int, int]) -> Band:
    """flash-attn's window_size=(left, right), bottom-right aligned; -1 means unbounded."""
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and w >= -1 for w in window)):
        raise ValueError(f"window must be a pair (left, right) of ints >= -1 (-1 = unbounded), got {window!r}")
    left, right = (None if w == -1 else w for w in window)
    return Band(left, right, S - L)


def band_for(L: int, S: int, is_causal: bool, window: tuple[int, int] | None = None,
             alignment: str = "top_left") -> Band | None:
    """The Band of causality and/or a sliding window (a window is bottom-right aligned; with
    is_causal its right side is 0), or None when every key is visible."""
    if window is not None:
        band = window_band(L, S, window)
        return Band(band.left, 0, band.offset) if is_causal else band
    return causal_band(L, S, alignment) if is_causal else None


def as_band(is_causal, L: int, S: int) -> Band | None:
    """A kernel's is_causal argument (bool or Band) as a Band or None."""
    if isinstance(is_causal, Band):
        return is_causal
    return Band(None, 0, 0) if is_causal else None


def band_additive(band: Band, L: int, S: int, query_dtype: torch.dtype, device) -> Tensor:
    """(L, S) additive mask of a Band: 0 where visible, -inf elsewhere."""
    allowed = band.allowed(torch.arange(L, device=device), torch.arange(S, device=device))
    return _bool_to_additive(~allowed, additive_dtype(query_dtype))


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's per-head slopes (Press et al. 2022): 2^(-8 i / n) for i = 1..n when n is a power of
    two; otherwise the slopes of the largest power of two below n, then every other slope of the
    next power of two for the remaining heads."""
    def powers(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(closest)
    if closest < num_heads:
        slopes += powers(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes)


def alibi_bias(slopes: Tensor, L: int, S: int, query_dtype: torch.dtype, offset: int | None = None) -> Tensor:
    """(H, L, S) ALiBi bias -slope_h * |j - (i + offset)|, bottom-right aligned by default
    (offset = S - L, as flash-attn): the kernels' reference for what flash adds tile by tile."""
    offset = S - L if offset is None else offset
    distance = (torch.arange(S, device=slopes.device)[None, :] - torch.arange(L, device=slopes.device)[:, None]
                - offset).abs()  # (L, S)
    return (-slopes.to(additive_dtype(query_dtype))[:, None, None] * distance).to(additive_dtype(query_dtype))


def fold(mask: Tensor | None, band: Band | None, alibi: Tensor | None, L: int, S: int,
         query_dtype: torch.dtype, device) -> Tensor | None:
    """One additive mask holding ``mask``, the band's -inf and the ALiBi bias (for kernels that
    only take a mask). alibi (H, L, S) broadcasts against (B, H, L, S)."""
    for extra in (None if band is None else band_additive(band, L, S, query_dtype, device), alibi):
        if extra is not None:
            mask = extra if mask is None else mask + extra
    return mask


def append_attended_keys(mask: Tensor | None, count: int) -> Tensor | None:
    """Extend the key axis by ``count`` columns that every query attends (bias_k, zero attention)."""
    if mask is None or count == 0:
        return mask
    return F.pad(mask, (0, count))


def multihead(attn_mask: Tensor | None, key_padding_mask: Tensor | None, *, batch: int,
              num_heads: int, L: int, S: int, batched: bool, like: Tensor) -> Tensor | None:
    """torch.nn.MultiheadAttention's masks (bool True = masked out) as one additive mask.

    attn_mask:        (L, S), or (B*H, L, S) indexed b*H + h, or (H, L, S) for unbatched input.
    key_padding_mask: (B, S), or (S,) for unbatched input.
    Returns None or a float tensor of shape (B|1, H|1, L, S), the two masks ADDED as torch does.
    """
    merged = None
    if attn_mask is not None:
        _checks.mask_dtype("attn_mask", attn_mask)
        _same_device("attn_mask", attn_mask, like)
        first = batch * num_heads if batched else num_heads
        meaning = "(B*num_heads, L, S)" if batched else "(num_heads, L, S) for unbatched input"
        if attn_mask.dim() == 2:
            _checks.shape("attn_mask", attn_mask, (L, S), "(L, S)")
        elif attn_mask.dim() == 3:
            _checks.shape("attn_mask", attn_mask, (first, L, S), meaning)
        else:
            _checks.rank("attn_mask", attn_mask, (2, 3), f"(L, S) or {meaning}")
        merged = as_additive(attn_mask, False, additive_dtype(like.dtype))
        if merged.dim() == 3:
            merged = merged.reshape(first // num_heads, num_heads, L, S)  # (B*H, L, S) -> (B, H, L, S)
    if key_padding_mask is not None:
        _checks.mask_dtype("key_padding_mask", key_padding_mask)
        _same_device("key_padding_mask", key_padding_mask, like)
        expected = (batch, S) if batched else (S,)
        _checks.shape("key_padding_mask", key_padding_mask, expected, "(B, S)" if batched else "(S,)")
        kpm = as_additive(key_padding_mask, False, additive_dtype(like.dtype))
        kpm = kpm.reshape(batch if batched else 1, 1, 1, S)  # (B, S) -> (B, 1, 1, S)
        merged = kpm if merged is None else merged + kpm
    return merged


def sdpa(attn_mask: Tensor | None, *, L: int, S: int, batch_shape: tuple[int, ...],
         like: Tensor) -> Tensor | None:
    """scaled_dot_product_attention's mask (bool True = attend, float added) as an additive mask.

    attn_mask must broadcast to (*batch_shape, L, S).
    """
    if attn_mask is None:
        return None
    _checks.mask_dtype("attn_mask", attn_mask)
    _same_device("attn_mask", attn_mask, like)
    target = (*batch_shape, L, S)
    try:
        broadcast = torch.broadcast_shapes(attn_mask.shape, target)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(target):
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the attention "
            f"scores' shape {target} (batch..., L, S)"
        )
    while attn_mask.dim() < 2:  # torch's kernel wants (..., L, S): (S,) -> (1, S)
        attn_mask = attn_mask.unsqueeze(0)
    return as_additive(attn_mask, True, additive_dtype(like.dtype))


def _same_device(name: str, mask: Tensor, like: Tensor) -> None:
    if mask.device != like.device:
        raise ValueError(f"{name} is on device {mask.device} but query is on {like.device}")
