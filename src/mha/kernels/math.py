"""The explicit kernel: scores, softmax, weights @ V. The reference, and the backend that returns the
weights wherever native does not (a gradient, dropout, float64, off the CPU: dispatch.weights_refusal).

It honours the whole contract (mha.kernels.Contract) by building the (B, H, L, S) scores, which
it must hold anyway to return the weights. Shapes: q (..., L, D), k (..., S, D), v (..., S, Dv).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import masks, positions
from ._context import autocast_enabled, autocast_inputs, differentiates, may_branch_on_values
from ._shapes import matched_kv_heads
from .contract import Contract, resolve, undeclared

__all__ = ["TAKES", "math_attention", "paged_math_attention", "safe_softmax", "unsupported"]

# every term of the contract, named (a field added to the Contract is refused until declared here): the reference
TAKES = frozenset({"band", "positions", "key_valid", "mask", "alibi_slopes", "scale", "logit_scale", "softcap", "sinks",
                   "score_mod", "mask_mod"})
PAGED_TAKES = frozenset({"band", "alibi_slopes", "scale", "softcap", "sinks"})  # paged_math_attention's: per sequence

_OUT_OF_PLACE_BELOW = 1 << 15  # scores (elements) below which the in-place softmax allocates anyway


def safe_softmax(scores: Tensor, *, inplace: bool = False) -> Tensor:
    """softmax over the last axis; a row whose scores are all -inf gives zeros and zero gradients
    (a mask, the band or padding hid every key, or the scores themselves are -inf: an infinite q).

    ``inplace=True`` (inference only: no autograd graph) overwrites ``scores``, which saves
    allocating (and page-faulting) a second L x S buffer: most of a large softmax's time on CPU.
    """
    blocked = None  # (..., L, 1): rows whose every score is -inf
    if scores.shape[-1] > 0:
        row_max = scores.amax(dim=-1, keepdim=True)  # (..., L, 1)
        # eager: one read of the least row maximum skips the mask in the common case (no blocked row);
        # a NaN there (NaN scores, which min() propagates) may hide a blocked row: build the mask then
        if (scores.is_meta or not may_branch_on_values()
                or (row_max.numel() > 0 and not float(row_max.detach().min()) > float("-inf"))):
            blocked = row_max.isneginf()
    if blocked is not None:  # finite row -> finite softmax and gradient
        scores = scores.masked_fill_(blocked, 0.0) if inplace else scores.masked_fill(blocked, 0.0)
    if inplace and scores.numel() >= _OUT_OF_PLACE_BELOW and not torch.compiler.is_compiling():  # (no out= in a graph)
        weights = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    else:  # small: torch.ops' Python dispatch costs more than the second buffer
        weights = torch.softmax(scores, dim=-1)
    if blocked is not None:
        weights = weights.masked_fill_(blocked, 0.0) if inplace else weights.masked_fill(blocked, 0.0)
    return weights


def _softmax_with_sinks(scores: Tensor, sinks: Tensor) -> Tensor:
    """softmax over the keys and one sink logit per head (..., H, L, S) -> weights of the keys."""
    sink_column = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)  # (H,) -> (..., H, L, 1)
    return torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]


def math_attention(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                   dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """Returns (output (..., L, Dv), weights (..., L, S)); weights are taken after dropout.

    float16/bfloat16 inputs are computed in float32 from the start (q k^T, the score shaping, the
    softmax and the weights' product with v), as torch's math path does on CPU; the output and the
    weights are rounded back once. Under torch.autocast the inputs are in the autocast dtype first.
    """
    contract = resolve(contract)
    if reason := unsupported(q, k, v, contract):
        raise ValueError(f"the math backend cannot run this call: {reason}")
    k, v = matched_kv_heads(q, k, v)
    q, k, v = autocast_inputs(q, k, v)  # as torch's SDPA; no op below is autocast's to change
    with _autocast_off(q.device.type):
        return _math(q, k, v, contract, dropout_p)


def unsupported(q: Tensor, k: Tensor, v: Tensor, contract: Contract, dropout_p: float = 0.0) -> str | None:
    """Why the math backend cannot run this call, or None: only a term it does not know."""
    return undeclared(TAKES, contract)


def _math(q: Tensor, k: Tensor, v: Tensor, contract: Contract, dropout_p: float) -> tuple[Tensor, Tensor]:
    L, S, out_dtype = q.shape[-2], k.shape[-2], q.dtype
    work = masks.additive_dtype(out_dtype)  # float32 for float16/bfloat16
    inference = not differentiates(q, k, v, contract.mask, *contract.learned) and not (
        contract.score_mod is not None and torch.is_grad_enabled())  # (a score_mod may close over a learned table)
    if out_dtype != work:
        q, k, v = q.to(work), k.to(work), v.to(work)
    scores = (q * contract.query_scale(q.shape[-1], work)) @ k.transpose(-2, -1)  # (..., L, D) @ (..., D, S) -> (..., L, S)
    scores = contract.modified(scores, positions.whole(L), positions.whole(S))
    scores, _ = contract.cap(scores, inplace=inference)
    scores = contract.shape_scores(scores, positions.whole(L), positions.whole(S), inplace=inference)
    if contract.sinks is None:
        weights = safe_softmax(scores, inplace=inference)
    else:
        weights = _softmax_with_sinks(scores, contract.sinks)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    output = weights @ v  # (..., L, S) @ (..., S, Dv) -> (..., L, Dv)
    if out_dtype != work:
        output, weights = output.to(out_dtype), weights.to(out_dtype)
    return output, weights


def _autocast_off(device_type: str):
    """A context with autocast off on the device when it is on (the float32 products must stay so)."""
    if autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def paged_math_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, lengths_q: Tensor,
                         lengths_k: Tensor, terms: Contract, *, observe=None) -> Tensor:
    """The reference of mha.kernels.paged_attention: each sequence alone, its keys gathered from the
    pages, dense, bottom-right (query r at S_b - L_b + r). q (Tq, H, D), pages (N, Hkv, P, D|Dv),
    block_table (B, M), lengths (B,) -> (Tq, H, Dv). observe(q, k, v, contract, out, weights): called
    for each sequence with its rows (H, L_b, D), keys (H, S_b, D|Dv) and weights (H, L_b, S_b)."""
    H, P = q.shape[1], k_pages.shape[2]
    out = q.new_empty(q.shape[0], H, v_pages.shape[3])
    start = 0
    for row, L, S in zip(block_table, lengths_q.tolist(), lengths_k.tolist()):
        blocks = row[: (S + P - 1) // P].to(k_pages.device)
        k, v = (pages.index_select(0, blocks).transpose(0, 1).flatten(1, 2)[:, :S]  # (n, Hkv, P, X) -> (Hkv, S, X)
                for pages in (k_pages, v_pages))
        k, v = (x.repeat_interleave(H // x.shape[0], dim=0) for x in (k, v))  # (Hkv, S, X) -> (H, S, X)
        rows = q[start:start + L].transpose(0, 1)  # (L, H, D) -> (H, L, D)
        placed = terms.replace(offset=positions.offset_of("bottom_right", L, S))
        o, w = math_attention(rows, k, v, placed)
        if observe is not None:
            observe(rows, k, v, placed, o, w)
        out[start:start + L] = o.transpose(0, 1)  # (H, L, Dv) -> (L, H, Dv)
        start += L
    return out
