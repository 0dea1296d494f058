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


def causal(L: int, S: int, query_dtype: torch.dtype, device: torch.device) -> Tensor:
    """(L, S) additive top-left causal mask: -inf where key j > query i."""
    future = torch.ones(L, S, dtype=torch.bool, device=device).triu_(1)
    return _bool_to_additive(future, additive_dtype(query_dtype))


def with_causal(mask: Tensor | None, L: int, S: int, query_dtype: torch.dtype, device) -> Tensor:
    """``mask`` with the causal mask folded in (for kernels that take one or the other)."""
    c = causal(L, S, query_dtype, device)
    return c if mask is None else mask + c


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
