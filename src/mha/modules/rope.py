"""Rotary position embeddings (RoPE, Su et al. 2021), in both conventions.

A pair of features (a, b) of a query or key at position p is rotated by the angle p * theta_i,
theta_i = base^(-2i / rotary_dim):

    (a, b) -> (a cos(p theta_i) - b sin(p theta_i),  a sin(p theta_i) + b cos(p theta_i))

so that q_m . k_n depends on m - n only. The conventions differ in which features pair up:

    rotate-half (GPT-NeoX, Llama):  feature i with feature i + rotary_dim / 2
    interleaved (GPT-J):            feature 2i with feature 2i + 1

Only the first ``rotary_dim`` features rotate (partial rotary); the rest pass through.
Shapes: x (..., L, D); positions (L,) or (..., L) broadcastable against x's leading dims.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _checks

__all__ = ["apply_rope", "RotaryEmbedding"]


def _angles(positions: Tensor, rotary_dim: int, base: float) -> Tensor:
    """(..., L, rotary_dim / 2): positions times the inverse frequencies, in float64 then float32."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device) / rotary_dim)
    return (positions.to(torch.float64)[..., None] * inv_freq).to(torch.float32)


def apply_rope(x: Tensor, positions: Tensor, *, base: float = 10000.0, rotary_dim: int | None = None,
               interleaved: bool = False) -> Tensor:
    """x rotated by its positions (computed in float32, returned in x's dtype)."""
    D = x.shape[-1]
    base = _check_base(base)
    rotary_dim = D if rotary_dim is None else rotary_dim
    if not (0 < rotary_dim <= D and rotary_dim % 2 == 0):
        raise ValueError(f"rotary_dim must be even and in (0, {D}], got {rotary_dim}")
    angles = _angles(positions, rotary_dim, base)  # (..., L, r/2)
    cos, sin = angles.cos(), angles.sin()
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]  # pairs (2i, 2i + 1)
        rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)  # (..., r/2, 2) -> (..., r)
    else:
        a, b = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]  # pairs (i, i + r/2)
        rotated = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)


def _check_base(base) -> float:
    base = _checks.real("base", base)
    if not base > 0.0 or base == float("inf"):
        raise ValueError(f"base must be a finite number greater than 0 (RoPE's frequencies are base^(-2i/d)), got {base}")
    return base


class RotaryEmbedding(nn.Module):
    """RoPE as a module: ``rope(x, positions)``; holds no parameters, only its settings."""

    def __init__(self, rotary_dim: int, base: float = 10000.0, interleaved: bool = False) -> None:
        super().__init__()
        self.rotary_dim = _checks.positive_int("rotary_dim", rotary_dim)
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        self.base = _check_base(base)
        self.interleaved = _checks.flag("interleaved", interleaved)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, base={self.base}, interleaved={self.interleaved}"

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        return apply_rope(x, positions, base=self.base, rotary_dim=self.rotary_dim, interleaved=self.interleaved)
