"""The explicit kernel: scores, softmax, weights @ V. The one backend that returns the weights.

It honours the whole contract (mha.kernels.Contract) by building the (B, H, L, S) scores, which
it must hold anyway to return the weights. Shapes: q (..., L, D), k (..., S, D), v (..., S, Dv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import masks, positions
from ._context import forward_mode, may_branch_on_values, transforms_active
from .contract import Contract, resolve


def safe_softmax(scores: Tensor, *, inplace: bool = False, rows_may_be_empty: bool = True) -> Tensor:
    """softmax over the last axis; a row whose scores are all -inf gives zeros and zero gradients.

    ``rows_may_be_empty=False`` (no mask, band or padding hides a key) skips looking for such rows.

    ``inplace=True`` (inference only: no autograd graph) overwrites ``scores``, which saves
    allocating (and page-faulting) a second L x S buffer: most of a large softmax's time on CPU.
    """
    empty_possible = rows_may_be_empty and scores.shape[-1] > 0
    blocked = scores.amax(dim=-1, keepdim=True) == float("-inf") if empty_possible else None  # (..., L, 1)
    if blocked is not None and may_branch_on_values() and not bool(blocked.any()):
        blocked = None  # the common case, skipped (in eager mode only: a branch on values)
    if blocked is not None:  # finite row -> finite softmax and gradient
        scores = scores.masked_fill_(blocked, 0.0) if inplace else scores.masked_fill(blocked, 0.0)
    weights = (torch.ops.aten._softmax.out(scores, -1, False, out=scores) if inplace
               else torch.softmax(scores, dim=-1))
    if blocked is not None:
        weights = weights.masked_fill_(blocked, 0.0) if inplace else weights.masked_fill(blocked, 0.0)
    return weights


def _softmax_with_sinks(scores: Tensor, sinks: Tensor) -> Tensor:
    """softmax over the keys and one sink logit per head (..., H, L, S) -> weights of the keys."""
    sink_column = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)  # (H,) -> (..., H, L, 1)
    return torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]


def _may_overwrite(*tensors: Tensor | None) -> bool:
    """True when nothing differentiates through these tensors: no autograd graph, no forward-mode
    tangent, no torch.func transform (vmap, jvp, grad) active. Only then may we work in place."""
    if transforms_active():
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return not forward_mode(*tensors)


def math_attention(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                   dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Returns (output (..., L, Dv), weights (..., L, S)); weights are taken after dropout.

    float16/bfloat16 scores are shaped and normalised in float32, the weights cast back.
    """
    contract = resolve(contract)
    L, S = q.shape[-2], k.shape[-2]
    scores = (q * contract.scale_for(q.shape[-1])) @ k.transpose(-2, -1)  # (..., L, D) @ (..., D, S) -> (..., L, S)
    weights_dtype = scores.dtype  # under autocast, not necessarily q's
    inference = _may_overwrite(q, k, v, contract.mask, contract.alibi_slopes, contract.sinks)
    scores = scores.to(masks.additive_dtype(weights_dtype))  # float16/bfloat16 -> a fresh float32 buffer
    scores, _ = contract.cap(scores, inplace=inference)
    scores = contract.shape(scores, positions.whole(L), positions.whole(S), inplace=inference)
    if contract.sinks is None:
        weights = safe_softmax(scores, inplace=inference, rows_may_be_empty=contract.hides_keys)
    else:
        weights = _softmax_with_sinks(scores, contract.sinks)
    weights = weights.to(weights_dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v, weights
