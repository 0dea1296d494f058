"""The leading dims of a kernel's inputs: how q, k and v broadcast, and gradients back to them.

q (..., H, L, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv); the batch dims broadcast together, and k
and v may have fewer heads than q (GQA: Hkv divides H).
"""

from __future__ import annotations

import torch
from torch import Tensor


def leads(q: Tensor, k: Tensor, v: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The common leading dims of the queries' side and of the keys' and values': (..., H) for
    both, or (..., H) and (..., Hkv) when k and v have fewer heads (GQA: Hkv divides H)."""
    if (q.dim() >= 3 and k.dim() >= 3 and v.dim() >= 3 and k.shape[-3] == v.shape[-3] != q.shape[-3]
            and q.shape[-3] % k.shape[-3] == 0):
        batch = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
        return (*batch, q.shape[-3]), (*batch, k.shape[-3])
    lead = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    return lead, lead


def unflat(grad: Tensor, like: Tensor, lead: tuple[int, ...]) -> Tensor:
    """(B*H, T, D) -> the input's shape, summed over the dims the input was broadcast along."""
    grad = grad.view(*lead, *grad.shape[-2:]).to(like.dtype)  # (B*H, T, D) -> (..., T, D)
    return grad.sum_to_size(like.shape) if grad.shape != like.shape else grad
