"""Attention over one part of the keys, and its backward given the whole softmax: the two steps
that attention split over key blocks (sequence-parallel attention, mha.distributed) is made of.

    forward(q, k, v, contract)                      -> (out, lse) of these keys alone
    backward(q, k, v, contract, out, lse, grad_out) -> (dq, dk, dv, d alibi_slopes or None)

The parts' results merge exactly by their log-sum-exps (mha.kernels.merge). In the backward,
``out`` and ``lse`` are those of the whole softmax, every part merged: P = e^(S - lse) is then
this part's share of the true probabilities, and the gradients are this part's exact
contributions, which add up over the parts. Sinks are not a term of a part (they are merged once,
mha.kernels.merge.add_sinks); dropout is not taken.

Each part runs on torch's fused CPU kernel when the contract is no band or causality on a square
block (what a block of a ring is, or its diagonal; also lagging by some rows, j <= i - lag, as a
striped layout's blocks do), with no ALiBi, softcap or positions and Dv = D; otherwise on the
flash kernel, which takes every term. The inputs are float32 or float64 (the
caller casts half precision up, so that every part is computed and accumulated in float32).

Shapes: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), Hkv dividing H; out (B, H, L, Dv),
lse (B, H, L).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .contract import Contract
from .flash import flash_attention_backward, flash_attention_with_lse

__all__ = ["backward", "forward"]

_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def forward(q: Tensor, k: Tensor, v: Tensor, contract: Contract) -> tuple[Tensor, Tensor]:
    """(out (B, H, L, Dv), lse (B, H, L)) of attention over these keys alone."""
    fused = _fused(q, k, v, contract)
    if fused is None:
        return flash_attention_with_lse(q, k, v, contract)
    causal, lag = fused
    if lag == 0:
        return _FUSED(q, k, v, 0.0, causal, scale=contract.scale_for(q.shape[-1]))
    out, lse = _FUSED(q[:, :, lag:], k[:, :, :-lag], v[:, :, :-lag], 0.0, True, scale=contract.scale_for(q.shape[-1]))
    return F.pad(out, (0, 0, lag, 0)), F.pad(lse, (lag, 0), value=float("-inf"))  # the first rows saw nothing


def backward(q: Tensor, k: Tensor, v: Tensor, contract: Contract, out: Tensor, lse: Tensor,
             grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, d alibi_slopes or None): this part's contributions, given the whole softmax's
    ``out`` (B, H, L, Dv) and ``lse`` (B, H, L)."""
    fused = _fused(q, k, v, contract)
    if fused is None:
        dq, dk, dv, d_slopes, _ = flash_attention_backward(q, k, v, out, lse, grad_out, contract)
        return dq, dk, dv, d_slopes
    causal, lag = fused
    rows, cols = slice(lag, None), slice(None, k.shape[2] - lag)  # all of them when lag = 0
    dq, dk, dv = _FUSED_BACKWARD(grad_out[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                 out[:, :, rows], lse[:, :, rows], 0.0, causal, scale=contract.scale_for(q.shape[-1]))
    if lag:  # the rows that saw nothing, the keys no row saw: zero gradients
        dq, dk, dv = F.pad(dq, (0, 0, lag, 0)), F.pad(dk, (0, 0, 0, lag)), F.pad(dv, (0, 0, 0, lag))
    return dq, dk, dv, None


def _fused(q: Tensor, k: Tensor, v: Tensor, contract: Contract) -> tuple[bool, int] | None:
    """(causal, lag) when torch's fused CPU kernel computes this part exactly as the contract says,
    else None. lag > 0: query i sees keys j <= i - lag (a striped layout's block); its rows lag..
    against keys ..S-lag are then top-left causal, and the first lag rows see nothing."""
    if not (q.is_cpu and contract.alibi_slopes is None and contract.softcap is None and contract.positions is None
            and contract.mask is None and contract.key_valid is None and contract.sinks is None
            and q.shape[-1] == v.shape[-1] and q.dim() == 4):
        return None
    band = contract.band
    if band is None:
        return False, 0
    lag = -(contract.offset + (band.right or 0))  # visible: j <= i + offset + right = i - lag
    if band.left is None and band.right is not None and 0 <= lag < q.shape[-2] and q.shape[-2] == k.shape[-2]:
        return True, lag
    return None
