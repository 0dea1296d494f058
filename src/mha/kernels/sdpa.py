"""torch's fused scaled_dot_product_attention as a backend (no weights returned).

It takes a contract when torch's kernel can run it with no tensor larger than the caller's own
(q, k and v together, or the caller's mask):

    no mask, the caller's mask, key padding      passed as they are (padding as a (B, 1, 1, S) mask)
    causality, top-left                          torch's is_causal
    causality shifted by an offset               split where torch can take it (below)
    causality beside the caller's (..., L, S)    folded into one copy of that mask
    anything else but softcap and sinks          folded into one dense mask (the band, padding,
      (windows, ALiBi, padding beside causality, ALiBi, per-sequence positions) when that mask is
      per-sequence positions, dropout on CPU)    no larger than q, k and v together: O(T) memory
                                                 at short T, where torch's kernel is the fastest;
                                                 beyond that it declines (flash takes the call)

Torch's CPU kernel builds the (B, H, L, S) weights when dropout_p > 0: that call, too, is taken
only when those weights are no larger than q, k and v. A causal band shifted by an offset:

    0 < offset <= L (bottom-right, L < S <= 2L): `offset` zero queries put before q make it a
        top-left causal call of offset + L rows, whose first `offset` outputs are dropped (at most
        a third more work; a split of the keys merged by their log-sum-exp would lose |score| x eps
        of precision, the rounding of torch's float32 log-sum-exp: 1e-4 at scores near 1e4).
    offset > L: folded into one dense mask, like a window, when it fits.
    offset < 0 (bottom-right, L > S): queries [0, -offset) see no key (zeros); the rest are a
        top-left causal block.

Inputs with fewer than 4 dims run on torch's math path, as torch's own scaled_dot_product_attention
runs them (its fused CPU kernel takes 4-D only): the same numbers as torch's (NaN where its math
path puts them, gradients without the log-sum-exp's rounding), taken when the (..., L, S) weights
are no larger than q, k and v. A causal call with a scale <= 0 reaches torch with a positive one
(k negated, or q zeroed): torch's causal kernel scales after masking, and -inf times 0 is NaN.
No rows, or no keys, give zeros without a call (torch's answers vary there: see run_planned).

On CPU torch's kernels return zeros (not NaN) for a query row whose keys are all masked. Off the
CPU (CUDA) a mask reaches torch's kernel in the query's dtype, the only one its CUDA kernels read
right, and a row that sees no key is zeroed after the call (they return garbage there in half
precision); ALiBi is not folded into a float16 or bfloat16 mask there (too coarse: flex takes it).
Shapes: q (..., L, D), k (..., S, D), v (..., S, Dv).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import masks, positions
from ._context import forward_mode
from ._shapes import attached_zeros, broadcast, matched_kv_heads, unit_last_stride
from .contract import Contract, resolve, undeclared

__all__ = ["TAKES", "attention_with_lse", "backward_with_lse", "guarded", "lse_form", "plan", "run_planned", "sdpa_attention"]

# as it is, or folded into one mask (logit_scale: into q, Contract.fold_logit_scale)
TAKES = frozenset({"band", "positions", "key_valid", "mask", "alibi_slopes", "scale", "logit_scale"})
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                   dropout_p: float = 0.0) -> Tensor:
    """The backend entry point: output (..., L, Dv) of torch's fused kernel under the contract (as
    it is, or its terms folded into one mask: the module docstring); a ValueError saying why for a
    call it cannot run."""
    contract = resolve(contract)
    k, v = matched_kv_heads(q, k, v)
    return run_planned(q, k, v, contract, dropout_p=dropout_p, planned=plan(q, k, v, contract, dropout_p))


def run_planned(q: Tensor, k: Tensor, v: Tensor, contract: Contract, *, dropout_p: float, planned) -> Tensor:
    """Run a call :func:`plan` has planned (dispatch plans once and runs the plan)."""
    folded, reason = planned
    if reason:
        raise ValueError(f"the sdpa backend cannot run this call: {reason}; use backend='flash' or 'math'")
    q, contract = contract.fold_logit_scale(q)
    if not (q.numel() and k.numel() and v.numel()):
        batch = _batch(q, k, v)
        if 0 in (math.prod(batch), q.shape[-2], k.shape[-2], v.shape[-1]):
            # no output, or rows that see nothing: zeros. torch's own answers vary (measured: L = 0 or Dv = 0
            # keep the query's batch dims, a batch dim of 1 against 0 gives 1, S = 0 with a NaN query gives NaN)
            return attached_zeros((*batch, q.shape[-2], v.shape[-1]), q, k, v)
    if q.dim() == k.dim() == v.dim() == 4:
        return _run(q, k, v, contract, dropout_p=dropout_p, folded=folded)
    batch = _batch(q, k, v)
    with sdpa_kernel(SDPBackend.MATH):  # torch's own choice for fewer dims (its fused kernel takes 4-D only)
        out = _run(*_as_4d(q, k, v), contract, dropout_p=dropout_p, folded=folded)
    return out.view(*batch, *out.shape[-2:])  # (..., L, Dv), the leading dims added as 4-D views dropped


def plan(q: Tensor, k: Tensor, v: Tensor, contract: Contract, dropout_p: float):
    """(the shape of the one mask the contract folds into, or None when torch's kernel takes it as
    it is; why torch's kernel cannot take the call within the memory of q, k and v, or None)."""
    if reason := undeclared(TAKES, contract, "torch's kernel"):
        return None, reason
    if forward_mode(q, k, v):
        return None, "torch's kernel has no forward-mode AD (jvp)"
    why = _builds_weights(q, k, v, dropout_p)
    if not q.dim() == k.dim() == v.dim() == 4:
        q, k, v = _as_4d(q, k, v)
    budget = q.numel() + k.numel() + v.numel()
    if why:
        weights = math.prod(_batch(q, k, v)) * q.shape[-2] * k.shape[-2]
        if weights > budget:
            return None, (f"torch's kernel would build the attention weights ({why}): {weights:,} elements, "
                          f"more than q, k and v hold ({budget:,})")
    if _takes_as_is(q, k, v, contract, builds_weights=why is not None):
        return None, None
    if not q.is_cpu and contract.alibi_slopes is not None and q.dtype in (torch.float16, torch.bfloat16):
        return None, (f"ALiBi would reach torch's kernel in a {q.dtype} mask (off the CPU its kernels take masks "
                      "in the query's dtype only), too coarse for the distances")
    shape = _folded_shape(q, k, v, contract)
    if math.prod(shape) > budget:
        return None, (f"torch's kernel would need the band, ALiBi or padding as a {tuple(shape)} mask, more "
                      f"than q, k and v hold ({budget:,} elements)")
    return shape, None


def _run(q: Tensor, k: Tensor, v: Tensor, contract: Contract, *, dropout_p: float, folded) -> Tensor:
    L, S, scale = q.shape[-2], k.shape[-2], contract.scale
    if folded is not None:  # one dense mask within the memory of q, k and v
        mask = torch.zeros(folded, dtype=_mask_dtype(q), device=q.device)
        mask = contract.shape_scores(mask, positions.whole(L), positions.whole(S), inplace=True)
        return _masked(q, k, v, mask, dropout_p=dropout_p, scale=scale)
    mask = _with_padding(contract.mask, contract.key_valid)
    band = contract.band
    if band is not None and mask is not None:  # causality folded into a copy of the caller's (..., L, S) mask
        hidden = ~band.allowed(contract.distances(positions.whole(L), positions.whole(S), q.device))  # (L, S)
        mask, band = (mask & ~hidden if mask.dtype == torch.bool else mask.masked_fill(hidden, float("-inf"))), None
    if band is None:
        return _masked(q, k, v, mask, dropout_p=dropout_p, scale=scale)
    q, k, scale = _positive_scale(q, k, contract.scale_for(q.shape[-1]))
    shift = band.causal_shift(contract.offset)  # plan took the band: causality, shifted
    if shift == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=_grouped(q, k))
    return _shifted_causal(q, k, v, shift, scale)


def _mask_dtype(q: Tensor) -> torch.dtype:
    """The dtype of an additive mask for torch's kernel: on CPU the contract's (float32 for float16 and
    bfloat16 queries: its CPU kernels add it in float32), elsewhere the query's own (torch's CUDA
    kernels read a float32 mask beside float16 or bfloat16 queries wrongly instead of refusing it:
    errors of 0.6-1.2, NaN, measured on an H100 with torch 2.11)."""
    return masks.additive_dtype(q.dtype) if q.is_cpu else q.dtype


def _masked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, dropout_p: float, scale: float | None) -> Tensor:
    """torch's kernel with a mask (or none). Off the CPU, the mask in the query's dtype, and each row
    that sees no key computed as if it saw them all and then zeroed: torch's CUDA kernels return
    garbage there in half precision (torch's CPU kernels give zeros, as mha promises everywhere)."""
    if mask is None or q.is_cpu:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=_grouped(q, k))
    return guarded(q, k, v, mask, dropout_p=dropout_p, scale=scale)


def guarded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, dropout_p: float = 0.0, scale: float | None = None) -> Tensor:
    """_masked's call off the CPU (any device: the tests run it on CPU tensors): the mask in q's dtype,
    rows that see nothing unmasked for the call and zeroed after it (zero gradients too)."""
    if mask.dtype == torch.bool:
        blind = ~mask.any(-1, keepdim=True)  # (..., L|1, 1): rows that see nothing
        mask = mask | blind
    else:
        mask = masks.to_dtype(mask, q.dtype)
        blind = (mask == float("-inf")).all(-1, keepdim=True)
        mask = mask.masked_fill(blind, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=_grouped(q, k))
    return out.masked_fill(blind, 0.0)


def _positive_scale(q: Tensor, k: Tensor, scale: float) -> tuple[Tensor, Tensor, float]:
    """The same scores with a scale > 0: torch's causal kernel scales after masking, so that a scale
    <= 0 turns the hidden keys' -inf into NaN or +inf (measured, torch 2.13: NaN outputs at scale 0,
    -1 and -0.5). A negative scale moves to k, negated (exact in every dtype); scale 0 makes every
    score 0, as q * 0 does (a NaN in q stays NaN)."""
    if scale > 0:
        return q, k, scale
    if scale < 0:
        return q, -k, -scale
    return q * 0.0, k, 1.0


def _takes_as_is(q: Tensor, k: Tensor, v: Tensor, contract: Contract, *, builds_weights: bool) -> bool:
    """Whether torch's kernel takes the contract as it is (no mask larger than the caller's)."""
    band, mask, key_valid = contract.band, contract.mask, contract.key_valid
    if contract.alibi_slopes is not None or contract.positions is not None:
        return False
    if band is None:
        return mask is None or key_valid is None or not _grows(mask, key_valid)
    shift = band.causal_shift(contract.offset)  # query row i sees keys j <= i + shift
    if shift is None or key_valid is not None:
        return False
    if mask is not None:
        return tuple(mask.shape[-2:]) == (q.shape[-2], k.shape[-2])
    # a shifted band: see _shifted_causal (padded queries cost at most a third more, and build no larger weights)
    return shift <= 0 or shift >= k.shape[-2] - 1 or (shift <= q.shape[-2] and not builds_weights)


def _builds_weights(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> str | None:
    """Why torch's CPU kernel would fall back to its math path, which builds the (B, H, L, S)
    weights, or None. Its fused kernel wants 4-D q, k, v of equal batch and heads, one head dim,
    a float dtype, contiguous rows, no dropout; key/value heads may divide the query's (GQA)."""
    if not q.is_cpu:
        return None
    if dropout_p > 0.0:
        return "dropout"
    if not q.dim() == k.dim() == v.dim() == 4:
        return "q, k and v that are not all 4-D"
    qs, ks, vs = q.shape, k.shape, v.shape  # (B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, Dv)
    if not (qs[0] == ks[0] == vs[0] and ks[1] == vs[1] and (qs[1] % ks[1] == 0 if ks[1] else qs[1] == 0)):
        return "q, k and v of different batch or head counts"
    if not qs[3] == ks[3] == vs[3]:
        return "a value head dim unlike the query's"
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _FUSED_DTYPES):
        return f"dtype {q.dtype}"
    if not unit_last_stride(q, k, v):
        return "rows that are not contiguous"
    return None


def _grouped(q: Tensor, k: Tensor) -> bool:
    """Whether k (and v) have fewer heads than q (GQA): torch's kernel is told to share them."""
    return k.dim() >= 3 and k.shape[-3] != q.shape[-3]


def _as_4d(*tensors: Tensor) -> tuple[Tensor, ...]:
    """(..., T, D) with fewer than 4 dims as (1, ..., T, D) views: one shape for the masks folded in."""
    return tuple(t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t for t in tensors)


def _batch(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, ...]:
    """The output's leading dims: those of q, k, v (..., T, D) broadcast, the heads q's under GQA."""
    shapes = q.shape[:-2], k.shape[:-2], v.shape[:-2]
    if _grouped(q, k) and not shapes[0] == shapes[1] == shapes[2]:
        return (*broadcast(*(shape[:-1] for shape in shapes)), q.shape[-3])
    return broadcast(*shapes)


def _folded_shape(q: Tensor, k: Tensor, v: Tensor, contract: Contract) -> torch.Size:
    """The shape of one mask holding every term of the contract: (..., H|1, L, S)."""
    L, S = q.shape[-2], k.shape[-2]
    shapes = [(L, S)]
    if contract.mask is not None:
        shapes.append(contract.mask.shape)
    if contract.key_valid is not None:
        shapes.append((contract.key_valid.shape[0], 1, 1, S))  # (B, S) -> (B, 1, 1, S)
    if contract.positions is not None:
        batch = max(p.shape[0] for p in contract.positions)  # query (B|1, L) and key (B|1, S) positions
        shapes.append((batch, 1, L, S))  # per sequence: (B, 1, L, S)
    if contract.alibi_slopes is not None:
        shapes.append((contract.alibi_slopes.shape[0], 1, 1))  # per head: (H, 1, 1)
    return torch.Size(broadcast(*shapes))


def _grows(mask: Tensor, key_valid: Tensor) -> bool:
    padding = (key_valid.shape[0], 1, 1, key_valid.shape[-1])  # (B, S) as (B, 1, 1, S)
    return broadcast(mask.shape, padding) != mask.shape


def _with_padding(mask: Tensor | None, key_valid: Tensor | None) -> Tensor | None:
    """The caller's mask with key padding as False / -inf: (B, 1, 1, S) alone."""
    if key_valid is None:
        return mask
    valid = key_valid[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
    if mask is None:
        return valid
    return mask & valid if mask.dtype == torch.bool else mask.masked_fill(~valid, float("-inf"))


def _shifted_causal(q: Tensor, k: Tensor, v: Tensor, shift: int, scale: float) -> Tensor:
    """Causal attention where query i sees keys j <= i + shift (Band.causal_shift), on torch's fused kernels."""
    L, S = q.shape[-2], k.shape[-2]
    if shift >= S - 1:  # every query sees every key
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=_grouped(q, k))
    if shift < 0:  # the first -shift queries see nothing
        empty = min(-shift, L)
        seen = F.scaled_dot_product_attention(q[..., empty:, :], k, v, is_causal=True, scale=scale,
                                              enable_gqa=_grouped(q, k))
        return F.pad(seen, (0, 0, empty, 0))  # (..., L + shift, Dv) -> (..., L, Dv), zeros first
    padded = F.pad(q, (0, 0, shift, 0))  # (..., L, D) -> (..., shift + L, D): row shift + i sees keys <= shift + i
    out = F.scaled_dot_product_attention(padded, k, v, is_causal=True, scale=scale, enable_gqa=_grouped(q, k))
    return out[..., shift:, :]  # (..., shift + L, Dv) -> (..., L, Dv)


# -- with the log-sum-exp: attention over one part of the keys (the dispatch's attention_with_lse) --

_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_LSE_TERMS = frozenset({"band", "scale"})  # all the fused kernel's log-sum-exp form takes (the band: lagging causality)
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def lse_form(q: Tensor, k: Tensor, v: Tensor, contract: Contract) -> tuple[bool, int] | None:
    """(causal, lag) when torch's fused CPU kernel computes this call, and its log-sum-exp, exactly
    as the contract says; else None. Taken: no band, or causality on a square block shifted back by
    lag >= 0 (query i sees keys j <= i - lag: a striped layout's block), no other term, Dv = D,
    4-D q (B, H, L, D), k and v (B, H, S, D), none of them empty (torch's op divides by the heads
    and the query blocks: a process crash, SIGFPE, at 0 of either, measured on torch 2.13; its
    scaled_dot_product_attention returns before calling it, from torch 2.12 or 2.13). The rows lag..
    against keys ..S-lag are then top-left causal, and the first lag rows see nothing."""
    if not (q.is_cpu and contract.terms <= _LSE_TERMS and q.shape[-1] == v.shape[-1] and q.dim() == 4
            and q.numel() and k.numel() and v.numel()):  # (the op dies of SIGFPE at 0 heads or rows: torch 2.13)
        return None
    band = contract.band
    if band is None:
        return False, 0
    shift = band.causal_shift(contract.offset)
    if shift is not None and 0 <= -shift < q.shape[-2] and q.shape[-2] == k.shape[-2]:
        return True, -shift
    return None


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, contract: Contract) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, Dv), lse (B, H, L)) on torch's fused CPU kernel, for a call :func:`lse_form` takes."""
    causal, lag = lse_form(q, k, v, contract)
    if lag == 0:
        return _FUSED(q, k, v, 0.0, causal, scale=contract.scale_for(q.shape[-1]))
    out, lse = _FUSED(q[:, :, lag:], k[:, :, :-lag], v[:, :, :-lag], 0.0, True, scale=contract.scale_for(q.shape[-1]))
    return F.pad(out, (0, 0, lag, 0)), F.pad(lse, (lag, 0), value=float("-inf"))  # the first rows saw nothing


def backward_with_lse(q: Tensor, k: Tensor, v: Tensor, contract: Contract, out: Tensor, lse: Tensor,
                      grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
    """(dq, dk, dv, None) on torch's fused CPU kernel given the whole softmax's ``out`` and ``lse``
    (see mha.kernels.dispatch.backward_with_lse), for a call :func:`lse_form` takes."""
    causal, lag = lse_form(q, k, v, contract)
    rows, cols = slice(lag, None), slice(None, k.shape[2] - lag)  # all of them when lag = 0
    dq, dk, dv = _FUSED_BACKWARD(grad_out[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                 out[:, :, rows], lse[:, :, rows], 0.0, causal, scale=contract.scale_for(q.shape[-1]))
    if lag:  # the rows that saw nothing, the keys no row saw: zero gradients
        dq, dk, dv = F.pad(dq, (0, 0, lag, 0)), F.pad(dk, (0, 0, 0, lag)), F.pad(dv, (0, 0, 0, lag))
    return dq, dk, dv, None
