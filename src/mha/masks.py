"""The caller's masks, validated and brought to the form of the attention contract.

Contract form (see mha.kernels.Contract): a ``mask`` that is either bool with True = ATTEND or an
additive float mask in the accumulation dtype (float32 for float16/bfloat16 queries, else the
query's; see ``additive_dtype``), broadcastable to (B, H, L, S); and ``key_valid`` (B, S), bool,
False where a key is padding. Causality, windows and ALiBi are not masks: they are positions
(mha.positions), applied by the kernels without building an L x S tensor.

The two bool conventions of torch, each honoured at its own entry point:
    torch.nn.MultiheadAttention / multi_head_attention_forward:  True = masked OUT
    torch.nn.functional.scaled_dot_product_attention:            True = ATTEND

Shape legend: B batch, H heads, L query length, S key length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks

# what users call: torch.nn.MultiheadAttention's masks and SDPA's in contract form; the rest serves the kernels
__all__ = ["from_multihead", "from_sdpa", "key_valid"]

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


def from_multihead(attn_mask: Tensor | None, key_padding_mask: Tensor | None, *, batch: int,
                   num_heads: int, L: int, S: int, batched: bool, like: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """torch.nn.MultiheadAttention's masks (bool True = masked out) in the contract's form.

    attn_mask:        (L, S), or (B*H, L, S) indexed b*H + h, or (H, L, S) for unbatched input.
    key_padding_mask: (B, S), or (S,) for unbatched input.
    Returns (mask, key_valid): mask (L, S) or (B|1, H, L, S), bool True = attend or additive
    float; key_valid (B, S) bool for a bool key_padding_mask. A float key_padding_mask is added
    to the mask, as torch adds the two.
    """
    mask = key_valid = None
    if attn_mask is not None:
        _checks.mask_dtype("attn_mask", attn_mask)
        _same_device("attn_mask", attn_mask, like)
        first = batch * num_heads if batched else num_heads
        meaning = "(B*num_heads, L, S)" if batched else "(num_heads, L, S) for unbatched input"
        if attn_mask.dim() not in (2, 3):  # torch's words, then ours
            raise _checks.ShapeError(f"expected `attn_mask` to be `None`, 2-D or 3-D but found {attn_mask.dim()}-D "
                                     f"tensor instead: (L, S) or {meaning}, got shape {tuple(attn_mask.shape)}")
        expected = (L, S) if attn_mask.dim() == 2 else (first, L, S)
        if tuple(attn_mask.shape) != expected:
            raise _checks.ShapeError(f"Expected `attn_mask` shape to be {expected} "
                                     f"{'(L, S)' if attn_mask.dim() == 2 else meaning} but got {tuple(attn_mask.shape)}")
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.reshape(first // num_heads, num_heads, L, S)  # (B*H, L, S) -> (B, H, L, S)
        mask = ~attn_mask if attn_mask.dtype == torch.bool else to_dtype(attn_mask, additive_dtype(like.dtype))
    if key_padding_mask is not None:
        _checks.mask_dtype("key_padding_mask", key_padding_mask)
        _same_device("key_padding_mask", key_padding_mask, like)
        expected = (batch, S) if batched else (S,)
        if key_padding_mask.dim() != len(expected):  # torch's words, then ours
            raise _checks.ShapeError(
                f"expected `key_padding_mask` to be `None` or {len(expected)}-D but found {key_padding_mask.dim()}-D "
                f"tensor instead: it must have shape {expected} {'(B, S)' if batched else '(S,)'}, "
                f"got {tuple(key_padding_mask.shape)}")
        _checks.shape("key_padding_mask", key_padding_mask, expected, "(B, S)" if batched else "(S,)")
        padding = key_padding_mask.reshape(batch if batched else 1, S)  # (S,) -> (1, S) unbatched
        if padding.dtype == torch.bool:
            key_valid = ~padding
        else:
            added = to_dtype(padding, additive_dtype(like.dtype))[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
            mask = added if mask is None else as_additive(mask, True, added.dtype) + added
    return mask, key_valid


def key_valid(key_padding_mask: Tensor | None, batch: int, S: int) -> Tensor | None:
    """A bool key_padding_mask (B, S), True = padding, as the contract's key_valid (B, S), or None
    (the positional path: RoPE, windows, ALiBi, a cache, where padding is per key only)."""
    if key_padding_mask is None:
        return None
    _checks.mask_dtype("key_padding_mask", key_padding_mask)
    if key_padding_mask.dtype != torch.bool:
        raise TypeError("with RoPE, windows, ALiBi or a cache, key_padding_mask must be bool (True = padding)")
    _checks.shape("key_padding_mask", key_padding_mask, (batch, S), "(N, S)")
    return ~key_padding_mask


def combined_additive(mask: Tensor | None, key_valid: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """mask and key_valid as one additive (B|1, H|1, L|1, S) mask (for torch's layers' fused path)."""
    if key_valid is not None:
        padding = _bool_to_additive(~key_valid, dtype)[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
        mask = padding if mask is None else as_additive(mask, True, dtype) + padding
    return None if mask is None else as_additive(mask, True, dtype)


def from_sdpa(attn_mask: Tensor | None, *, L: int, S: int, batch_shape: tuple[int, ...],
              like: Tensor) -> Tensor | None:
    """scaled_dot_product_attention's mask (bool True = attend, float added) in the contract's form
    (bool kept as it is, float in the accumulation dtype). attn_mask must broadcast to
    (*batch_shape, L, S)."""
    if attn_mask is None:
        return None
    _checks.mask_dtype("attn_mask", attn_mask)
    _same_device("attn_mask", attn_mask, like)
    target = (*batch_shape, L, S)
    shape = tuple(attn_mask.shape)  # broadcasts to target: no more dims than it, each 1 or target's
    if len(shape) > len(target) or any(n not in (1, t) for n, t in zip(reversed(shape), reversed(target))):
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the attention "
            f"scores' shape {target} (batch..., L, S)"
        )
    while attn_mask.dim() < 2:  # (S,) -> (1, S): kernels slice (..., L, S)
        attn_mask = attn_mask.unsqueeze(0)
    return attn_mask if attn_mask.dtype == torch.bool else to_dtype(attn_mask, additive_dtype(like.dtype))


def _same_device(name: str, mask: Tensor, like: Tensor) -> None:
    if mask.device != like.device:
        raise ValueError(f"{name} is on device {mask.device} but query is on {like.device}")
