"""Combine attention results computed over disjoint sets of keys, exactly.

If out_a = softmax(s_a) V_a with log-sum-exp lse_a = log sum_j exp(s_a,j), and likewise for b,
then attention over both key sets is

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The flash kernel merges its key tiles with this formula in running form; its results carry the
log-sum-exp so that this helper merges flash results over separate key sets (KV-cache decoding,
sequence-parallel attention) exactly. An empty part (lse = -inf, e.g. a
tile whose keys are all masked) contributes nothing; if both parts are empty the result is zeros.

Shapes: out (..., L, Dv), lse (..., L) (float32 or wider).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _weights(lse_a: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The merged lse and the (..., L, 1) weights of each part."""
    lse = torch.logaddexp(lse_a, lse_b)  # (..., L); -inf only where both are -inf
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # empty rows: avoid -inf - -inf
    return lse, torch.exp(lse_a - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of the union of two key sets. Returns new tensors; the inputs are untouched."""
    lse, weight_a, weight_b = _weights(lse_a, lse_b)
    return out_a * weight_a.to(out_a.dtype) + out_b * weight_b.to(out_b.dtype), lse
