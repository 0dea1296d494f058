"""torch's fused scaled_dot_product_attention as a backend (no weights returned).

Shapes: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv); mask additive, broadcastable to (B, H, L, S).
On CPU its kernels return zeros (not NaN) for a query row whose keys are all masked.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .. import masks


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                   is_causal: bool = False, scale: float | None = None,
                   dropout_p: float = 0.0) -> Tensor:
    if is_causal and mask is not None:  # torch's kernel takes one or the other
        mask = masks.with_causal(mask, q.shape[-2], k.shape[-2], q.dtype, q.device)
        is_causal = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )
