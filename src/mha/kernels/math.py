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


def safe_softmax(scores: Tensor) -> Tensor:
    """softmax over the last axis; a row whose scores are all -inf gives zeros and zero gradients.

    Low-precision scores are normalised in float32 and cast back.
    """
    fully_masked = scores.amax(dim=-1, keepdim=True) == float("-inf")  # (..., L, 1)
    any_fully_masked = bool(fully_masked.any())
    if any_fully_masked:
        scores = scores.masked_fill(fully_masked, 0.0)  # finite row -> finite softmax and gradient
    accumulate = torch.float32 if scores.dtype in _LOW_PRECISION else scores.dtype
    weights = torch.softmax(scores, dim=-1, dtype=accumulate).to(scores.dtype)
    if any_fully_masked:
        weights = weights.masked_fill(fully_masked, 0.0)
    return weights


def math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                   is_causal: bool = False, scale: float | None = None,
                   dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Returns (output (B, H, L, Dv), weights (B, H, L, S)); weights are taken after dropout."""
    L, S = q.shape[-2], k.shape[-2]
    scale = math.sqrt(1.0 / q.shape[-1]) if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1)  # (B, H, L, D) @ (B, H, D, S) -> (B, H, L, S)
    if is_causal:
        mask = masks.with_causal(mask, L, S, scores.dtype, scores.device)
    if mask is not None:
        scores = scores + mask
    weights = safe_softmax(scores)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights
