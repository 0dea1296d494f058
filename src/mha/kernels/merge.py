"""Combine attention results computed over disjoint sets of keys, exactly.

If out_a = softmax(s_a) V_a with log-sum-exp lse_a = log sum_j exp(s_a,j), and likewise for b,
then attention over both key sets is

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

The flash kernel merges its key tiles with this formula in running form; its results carry the
log-sum-exp so that this helper merges flash results over separate key sets (KV-cache decoding,
sequence-parallel attention) exactly. An empty part (lse = -inf, e.g. a
tile whose keys are all masked) contributes nothing; if both parts are empty the result is zeros.

Attention sinks are such a part too: one key per head with logit sink_h and a zero value
(out = 0, lse = sink_h), whose gradient is d sink_h = -sum_rows e^(sink_h - lse) rowsum(dO * O).

Shapes: out (..., L, Dv), lse (..., L) (float32 or wider); sinks (H,) with H at dim -2 of lse.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["add_sinks", "merge_attention", "merge_into", "sink_gradient"]


def _weights(lse_a: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The merged lse and the (..., L, 1) weights of each part."""
    lse = torch.logaddexp(lse_a, lse_b)  # (..., L); -inf only where both are -inf
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # empty rows: avoid -inf - -inf
    return lse, torch.exp(lse_a - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of the union of two key sets. Returns new tensors; the inputs are untouched."""
    lse, weight_a, weight_b = _weights(lse_a, lse_b)
    return out_a * weight_a.to(out_a.dtype) + out_b * weight_b.to(out_b.dtype), lse


def merge_into(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """In place: (out, lse) becomes the merge of itself and (out_b, lse_b). ``out`` and ``lse`` may
    be views (rows of a larger result); no temporary the size of ``out`` is made."""
    merged, weight_a, weight_b = _weights(lse, lse_b)
    out.mul_(weight_a).addcmul_(out_b, weight_b)
    lse.copy_(merged)


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> None:
    """In place: the sinks (H,) join every row's softmax; out (..., H, L, Dv), lse (..., H, L)."""
    merged, weight_a, _ = _weights(lse, sinks[:, None].expand_as(lse))  # (H,) -> (..., H, L)
    out.mul_(weight_a)  # the sink's value is zero: only the weight of the rest changes
    lse.copy_(merged)


def sink_gradient(sinks: Tensor, shift: Tensor, delta: Tensor, row_sum: Tensor | None = None) -> Tensor:
    """d sinks (H,) in sinks' dtype: -sum over rows (and batch) of p_sink * delta, where delta
    (..., H, L) = rowsum(dO * O) and p_sink = e^(sink_h - shift) / row_sum: ``shift`` (..., H, L) the
    whole softmax's log-sum-exp (sinks included) and no row_sum, or each row's max m and its sum
    (exact at large logits, where the log-sum-exp's rounding is |m| eps). A row that saw nothing
    (shift -inf, or sum 0) contributes nothing."""
    empty = shift == float("-inf") if row_sum is None else row_sum == 0
    shift = torch.where(empty, torch.full_like(shift, float("inf")), shift)  # e^(sink - inf) = 0
    p_sink = (sinks[:, None] - shift).exp()  # (..., H, L)
    if row_sum is not None:
        p_sink = p_sink / torch.where(empty, torch.ones_like(row_sum), row_sum)
    per_head = -(p_sink * delta).sum(-1)  # (..., H)
    per_head = per_head.reshape(math.prod(per_head.shape[:-1]), per_head.shape[-1])  # (..., H) -> (B, H)
    return per_head.sum(0).to(sinks.dtype)  # (B, H) -> (H,)
