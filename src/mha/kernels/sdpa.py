"""torch's fused scaled_dot_product_attention as a backend (no weights returned).

Shapes: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv); mask additive, broadcastable to (B, H, L, S).
On CPU its kernels return zeros (not NaN) for a query row whose keys are all masked.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .. import masks


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                   is_causal: bool | masks.Band = False, scale: float | None = None,
                   dropout_p: float = 0.0, *, alibi_slopes: Tensor | None = None) -> Tensor:
    L, S = q.shape[-2], k.shape[-2]
    plain_causal = is_causal is True and mask is None and alibi_slopes is None
    if not plain_causal:  # torch's kernel takes a mask or top-left is_causal, not both: fold into the mask
        alibi = None if alibi_slopes is None else masks.alibi_bias(alibi_slopes, L, S, q.dtype)
        mask = masks.fold(mask, masks.as_band(is_causal, L, S), alibi, L, S, q.dtype, q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=plain_causal, scale=scale
    )
