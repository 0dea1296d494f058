"""The explicit kernel: scores, softmax, weights @ V. The one backend that returns the weights.

Shapes: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv); mask additive, broadcastable to (B, H, L, S).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import masks

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def fully_masked_rows(mask: Tensor | None) -> Tensor | None:
    """(..., L, 1) True where an additive mask blocks every key of a query row, else None.

    Computed on the mask (often (L, S) or (B, 1, 1, S)), not on the scores: with finite q and k a
    score row is all -inf exactly when its mask row is.
    """
    if mask is None:
        return None
    rows = mask.amax(dim=-1, keepdim=True) == float("-inf")
    return rows if bool(rows.any()) else None


def safe_softmax(scores: Tensor, blocked_rows: Tensor | None = None, *, inplace: bool = False) -> Tensor:
    """softmax over the last axis; the rows in ``blocked_rows`` give zeros and zero gradients.

    Low-precision scores are normalised in float32 and cast back. ``inplace=True`` (inference
    only: no autograd graph) overwrites ``scores``, which saves allocating (and page-faulting)
    a second L x S buffer; that is most of the time of a large softmax on CPU.
    """
    inplace = inplace and scores.dtype not in _LOW_PRECISION
    if blocked_rows is not None:  # finite row -> finite softmax and gradient
        scores = scores.masked_fill_(blocked_rows, 0.0) if inplace else scores.masked_fill(blocked_rows, 0.0)
    if inplace:
        weights = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    else:
        accumulate = torch.float32 if scores.dtype in _LOW_PRECISION else scores.dtype
        weights = torch.softmax(scores, dim=-1, dtype=accumulate).to(scores.dtype)
    if blocked_rows is not None:
        weights = weights.masked_fill_(blocked_rows, 0.0) if inplace else weights.masked_fill(blocked_rows, 0.0)
    return weights


def _records_graph(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                   is_causal: bool = False, scale: float | None = None,
                   dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Returns (output (B, H, L, Dv), weights (B, H, L, S)); weights are taken after dropout."""
    L, S = q.shape[-2], k.shape[-2]
    scale = math.sqrt(1.0 / q.shape[-1]) if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1)  # (B, H, L, D) @ (B, H, D, S) -> (B, H, L, S)
    if is_causal:
        mask = masks.with_causal(mask, L, S, scores.dtype, scores.device)
    inference = not _records_graph(q, k, v, mask)
    if mask is not None:
        scores = scores.add_(mask) if inference else scores + mask
    weights = safe_softmax(scores, fully_masked_rows(mask), inplace=inference)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights
