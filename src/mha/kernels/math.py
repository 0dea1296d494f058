"""The explicit kernel: scores, softmax, weights @ V. The one backend that returns the weights.

Shapes: q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv); mask additive, broadcastable to (B, H, L, S).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad

from .. import masks

def fully_masked_rows(mask: Tensor | None) -> Tensor | None:
    """(..., L, 1) True where an additive mask blocks every key of a query row, else None.

    Computed on the mask (often (L, S) or (B, 1, 1, S)), not on the scores: with finite q and k a
    score row is all -inf exactly when its mask row is.
    """
    if mask is None or mask.shape[-1] == 0:  # no keys at all: the output is zeros anyway
        return None
    rows = mask.amax(dim=-1, keepdim=True) == float("-inf")
    return rows if bool(rows.any()) else None


def safe_softmax(scores: Tensor, blocked_rows: Tensor | None = None, *, inplace: bool = False) -> Tensor:
    """softmax over the last axis; the rows in ``blocked_rows`` give zeros and zero gradients.

    ``inplace=True`` (inference only: no autograd graph) overwrites ``scores``, which saves
    allocating (and page-faulting) a second L x S buffer: most of a large softmax's time on CPU.
    """
    if blocked_rows is not None:  # finite row -> finite softmax and gradient
        scores = scores.masked_fill_(blocked_rows, 0.0) if inplace else scores.masked_fill(blocked_rows, 0.0)
    weights = (torch.ops.aten._softmax.out(scores, -1, False, out=scores) if inplace
               else torch.softmax(scores, dim=-1))
    if blocked_rows is not None:
        weights = weights.masked_fill_(blocked_rows, 0.0) if inplace else weights.masked_fill(blocked_rows, 0.0)
    return weights


def _may_overwrite(*tensors: Tensor | None) -> bool:
    """True when nothing differentiates through these tensors: no autograd graph, no forward-mode
    tangent, no torch.func transform (vmap, jvp, grad) active. Only then may we work in place."""
    if torch._C._are_functorch_transforms_active():
        return False
    grad_mode = torch.is_grad_enabled()
    return not any(t is not None and ((grad_mode and t.requires_grad)
                                      or forward_ad.unpack_dual(t).tangent is not None)
                   for t in tensors)


def math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                   is_causal: bool | masks.Band = False, scale: float | None = None,
                   dropout_p: float = 0.0, *, alibi_slopes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Returns (output (B, H, L, Dv), weights (B, H, L, S)); weights are taken after dropout.

    is_causal: True (top-left causal) or a mha.masks.Band (causal alignment, sliding window);
    alibi_slopes (H,): ALiBi's bias. float16/bfloat16 scores are masked and normalised in float32,
    the weights cast back.
    """
    L, S = q.shape[-2], k.shape[-2]
    scale = math.sqrt(1.0 / q.shape[-1]) if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1)  # (B, H, L, D) @ (B, H, D, S) -> (B, H, L, S)
    weights_dtype = scores.dtype  # under autocast, not necessarily q's
    inference = _may_overwrite(q, k, v, mask)
    scores = scores.to(masks.additive_dtype(weights_dtype))  # float16/bfloat16 -> a fresh float32 buffer
    alibi = None if alibi_slopes is None else masks.alibi_bias(alibi_slopes, L, S, weights_dtype)
    mask = masks.fold(mask, masks.as_band(is_causal, L, S), alibi, L, S, weights_dtype, scores.device)
    if mask is not None:
        mask = masks.to_dtype(mask, scores.dtype)
        scores = scores.add_(mask) if inference else scores + mask
    weights = safe_softmax(scores, fully_masked_rows(mask), inplace=inference).to(weights_dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights
