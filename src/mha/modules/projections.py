"""The input projections of the drop-in (torch's weight layout): packed (3E, E) or separate
(E, E), (E, Ek), (E, Ev) weights, validated once, then applied and split into heads.

Shapes: B batch, L query length, S key length, E embed dim, H heads, D head dim (E / H),
Ek / Ev key / value input widths.
"""

from __future__ import annotations

import torch.nn.functional as F

from .. import _checks
from .pipeline import split_heads, split_packed_heads

__all__ = ["ProjectionWeights"]


class ProjectionWeights:
    """The input projections, packed (3E, E) or separate (E, E), (E, Ek), (E, Ev), validated."""

    def __init__(self, packed, w_q, w_k, w_v, bias):
        self.packed, self.w, self.bias = packed, (w_q, w_k, w_v), bias

    @classmethod
    def gather(cls, *, in_proj_weight, in_proj_bias, separate, q_w, k_w, v_w, E, Ek, Ev, like):
        if separate:
            for name, w in (("q_proj_weight", q_w), ("k_proj_weight", k_w), ("v_proj_weight", v_w)):
                if w is None:
                    raise ValueError(f"use_separate_proj_weight=True needs {name}, got None")
                _checks.rank(name, _checks.tensor(name, w), (2,), "(embed_dim, input width)")
                if w.shape[0] != E:
                    raise ValueError(f"{name} must have embed_dim={E} rows, got shape {tuple(w.shape)}")
            _checks.shape("q_proj_weight", q_w, (E, E), "(embed_dim, embed_dim)")
            for name, width, w, dim in (("key", Ek, k_w, "kdim"), ("value", Ev, v_w, "vdim")):
                if width != w.shape[1]:
                    raise ValueError(f"{name}'s last dim must be {dim}={w.shape[1]} (the width of the "
                                     f"module's projection), got {width}")
            packed = None
        else:
            if in_proj_weight is None:
                raise ValueError("use_separate_proj_weight=False needs in_proj_weight, got None")
            packed = _checks.tensor("in_proj_weight", in_proj_weight)
            if (Ek, Ev) != (E, E):
                raise ValueError(
                    f"packed in_proj_weight needs key and value widths equal to embed_dim={E}, got "
                    f"{Ek} and {Ev}; use separate q/k/v_proj_weight for other widths"
                )
            _checks.shape("in_proj_weight", packed, (3 * E, E), "(3*embed_dim, embed_dim)")
        if in_proj_bias is not None:
            _checks.shape("in_proj_bias", _checks.tensor("in_proj_bias", in_proj_bias), (3 * E,))
            if in_proj_bias.device != like.device:
                raise ValueError(f"in_proj_bias is on device {in_proj_bias.device} but query is on {like.device}")
            in_proj_bias = in_proj_bias.to(like.dtype)  # as torch's module (its functional form raises): in the query's dtype
        _checks.same_dtype_device("query", like, in_proj_weight=packed, q_proj_weight=q_w,
                                  k_proj_weight=k_w, v_proj_weight=v_w)
        return cls(packed, q_w, k_w, v_w, in_proj_bias)

    def heads(self, x_q, x_k, x_v, num_heads, is_self_attention):
        """(B, L, E), (B, S, Ek), (B, S, Ev) -> q (B, H, L, D), k (B, H, S, D), v (B, H, S, D)."""
        if self.packed is not None and is_self_attention:  # one (3E, E) matmul
            return split_packed_heads(F.linear(x_q, self.packed, self.bias), num_heads)
        w = self.w if self.packed is None else self.packed.chunk(3)  # (3E, E) -> (E, E) three times
        b = (None, None, None) if self.bias is None else self.bias.chunk(3)
        return tuple(split_heads(F.linear(x, w_, b_), num_heads) for x, w_, b_ in zip((x_q, x_k, x_v), w, b))
