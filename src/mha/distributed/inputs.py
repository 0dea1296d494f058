"""The arguments ring_attention and ulysses_attention share, validated, and the score terms they
carry: an mha.kernels.Contract (built as every other caller builds one) holding the band, ALiBi,
scale, softcap and sinks; the positions come from the layout.

Shapes: q (B, H, T, D), k (B, Hkv, T, D), v (B, Hkv, T, Dv) with T = layout.local_length.
"""

from __future__ import annotations

from torch import Tensor

from .. import _checks
from ..kernels.contract import Contract, from_keywords
from .layout import SequenceLayout

__all__ = ["check"]


def check(q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, *, is_causal, scale, enable_gqa, window,
          alibi_slopes, softcap, sinks) -> Contract:
    if not isinstance(layout, SequenceLayout):
        raise TypeError(f"layout must be an mha.distributed.SequenceLayout, got {type(layout).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.floating(name, x)
        _checks.rank(name, x, (4,), "(batch, heads, local length, head dim)")
        if x.shape[2] != layout.local_length:
            raise ValueError(f"{name} must hold this rank's {layout.local_length} slots of the sequence "
                             f"(layout.local_length, dim 2), got shape {tuple(x.shape)}")
    _checks.same_dtype_device("q", q, k=k, v=v)
    if not (q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1]):
        raise ValueError(f"q, k and v must have the same batch size and k, v the same heads, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k's head dim must equal q's ({q.shape[3]}), got shape {tuple(k.shape)}")
    _checks.flag("enable_gqa", enable_gqa)
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv != H and not enable_gqa:
        raise ValueError(f"k and v have {Hkv} heads and q has {H}: pass enable_gqa=True with key/value heads "
                         f"that divide the query heads")
    _checks.shared_heads(H, "k", Hkv, dim=1, option="enable_gqa")
    return from_keywords(q, H, is_causal=is_causal, window=window, alibi_slopes=alibi_slopes, scale=scale,
                         softcap=softcap, sinks=sinks)
