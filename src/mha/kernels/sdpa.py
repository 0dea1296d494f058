"""torch's fused scaled_dot_product_attention as a backend (no weights returned).

It takes the contracts torch's kernel expresses without an L x S tensor: no mask, the caller's
mask, key padding (a (B, 1, 1, S) mask), causality in any alignment, and causality beside the
caller's (..., L, S) mask (folded into one copy of it). Top-left causality is
torch's ``is_causal``; a causal band shifted by an offset is split where torch can take it:

    offset > 0 (bottom-right, L < S): keys [0, offset) are seen by every query (no mask), keys
        [offset, S) form a top-left causal block; the two parts merge by their log-sum-exp
        (mha.kernels.merge), and the backward runs torch's backward on each part with the merged
        output and log-sum-exp, which gives the exact gradients.
    offset < 0 (bottom-right, L > S): queries [0, -offset) see no key (zeros); the rest are a
        top-left causal block.

Everything else (windows, ALiBi, softcap, sinks, per-sequence positions, a mask beside
causality, dropout on CPU, where torch's kernel builds the L x S weights) it declines: see
:func:`unsupported`. On CPU torch's kernels return zeros (not NaN) for a query row whose keys are
all masked. Shapes: q (..., L, D), k (..., S, D), v (..., S, Dv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._amp import autocast_inputs
from .contract import Contract, resolve
from .merge import merge_attention

_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def unsupported(q: Tensor, k: Tensor, contract: Contract, dropout_p: float = 0.0) -> str | None:
    """Why torch's fused kernel cannot take this call without an L x S tensor, or None."""
    terms = {"softcap": contract.softcap, "attention sinks": contract.sinks,
             "ALiBi": contract.alibi_slopes, "per-sequence positions": contract.positions}
    named = [name for name, value in terms.items() if value is not None]
    if named:
        return f"torch's kernel has no {named[0]}"
    band = contract.band
    if band is not None and not band.is_causal:
        return "torch's kernel has no sliding window"
    if band is not None and contract.key_valid is not None:
        return "torch's kernel takes a mask or causality, not both, and the key padding is no L x S mask"
    if band is not None and contract.mask is not None and tuple(contract.mask.shape[-2:]) != (q.shape[-2], k.shape[-2]):
        return "torch's kernel takes a mask or causality, not both, and the caller's mask is not L x S"
    if contract.mask is not None and contract.key_valid is not None and _grows(contract.mask, contract.key_valid):
        return "the key padding would widen the caller's mask"
    if dropout_p > 0.0 and q.device.type == "cpu":
        return "with dropout torch's CPU kernel builds the L x S weights"
    if band is not None and contract.mask is None and contract.offset and (dropout_p > 0.0 or not _fused_dtype(q, k)):
        return "a shifted causal band needs torch's CPU flash kernel (no dropout, float dtypes on CPU)"
    return None


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                   dropout_p: float = 0.0) -> Tensor:
    contract = resolve(contract)
    reason = unsupported(q, k, contract, dropout_p)
    if reason:
        raise ValueError(f"the sdpa backend cannot run this call: {reason}; use backend='flash' or 'math'")
    mask = _with_padding(contract.mask, contract.key_valid)
    band, scale = contract.band, contract.scale
    if band is not None and mask is not None:  # causality folded into a copy of the caller's (..., L, S) mask
        mask, band = _with_band(mask, contract, q.shape[-2], k.shape[-2]), None
    if band is None or contract.offset == 0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              is_causal=band is not None, scale=scale)
    return _shifted_causal(q, k, v, contract.offset, contract.scale_for(q.shape[-1]))


def _grows(mask: Tensor, key_valid: Tensor) -> bool:
    padding = (key_valid.shape[0], 1, 1, key_valid.shape[-1])  # (B, S) as (B, 1, 1, S)
    return torch.broadcast_shapes(mask.shape, padding) != mask.shape


def _with_padding(mask: Tensor | None, key_valid: Tensor | None) -> Tensor | None:
    """The caller's mask with key padding as False / -inf: (B, 1, 1, S) alone."""
    if key_valid is None:
        return mask
    valid = key_valid[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
    if mask is None:
        return valid
    return mask & valid if mask.dtype == torch.bool else mask.masked_fill(~valid, float("-inf"))


def _with_band(mask: Tensor, contract: Contract, L: int, S: int) -> Tensor:
    """The caller's (..., L, S) mask with the band's hidden keys as False / -inf."""
    hidden = ~contract.band.allowed(contract.distances(range(L), range(S), mask.device))  # (L, S)
    return mask & ~hidden if mask.dtype == torch.bool else mask.masked_fill(hidden, float("-inf"))


def _fused_dtype(q: Tensor, k: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == k.dtype and q.dtype in (
        torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _shifted_causal(q: Tensor, k: Tensor, v: Tensor, offset: int, scale: float) -> Tensor:
    """Causal attention where query i sees keys j <= i + offset, on torch's fused kernels."""
    L, S = q.shape[-2], k.shape[-2]
    if offset >= S - 1:  # every query sees every key
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if offset < 0:  # the first -offset queries see nothing
        empty = min(-offset, L)
        seen = F.scaled_dot_product_attention(q[..., empty:, :], k, v, is_causal=True, scale=scale)
        return F.pad(seen, (0, 0, empty, 0))  # (..., L + offset, Dv) -> (..., L, Dv), zeros first
    q, k, v = autocast_inputs(q, k, v)
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q4, k4, v4 = (x.expand(*lead, *x.shape[-2:]).reshape(-1, 1, *x.shape[-2:]) for x in (q, k, v))  # (N, 1, T, D)
    out = _PrefixThenCausal.apply(q4, k4, v4, offset, scale)
    return out.view(*lead, L, v.shape[-1])  # (N, 1, L, Dv) -> (..., L, Dv)


class _PrefixThenCausal(torch.autograd.Function):
    """Keys [0, prefix) seen by every query, keys [prefix, S) top-left causal; q, k, v (N, 1, T, D)."""

    @staticmethod
    def forward(ctx, q, k, v, prefix, scale):
        parts = [_FUSED(q, k[..., :prefix, :], v[..., :prefix, :], 0.0, False, scale=scale),
                 _FUSED(q, k[..., prefix:, :], v[..., prefix:, :], 0.0, True, scale=scale)]
        (out_a, lse_a), (out_b, lse_b) = parts
        out, lse = merge_attention(out_a.to(lse_a.dtype), lse_a, out_b.to(lse_b.dtype), lse_b)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prefix, ctx.scale = prefix, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        p, scale = ctx.prefix, ctx.scale
        grad_out = grad_out.contiguous()
        dq_a, dk_a, dv_a = _FUSED_BACKWARD(grad_out, q, k[..., :p, :], v[..., :p, :], out, lse, 0.0, False, scale=scale)
        dq_b, dk_b, dv_b = _FUSED_BACKWARD(grad_out, q, k[..., p:, :], v[..., p:, :], out, lse, 0.0, True, scale=scale)
        return dq_a + dq_b, torch.cat([dk_a, dk_b], dim=-2), torch.cat([dv_a, dv_b], dim=-2), None, None
