"""Ulysses attention (DeepSpeed-Ulysses): trade the sequence shards for head shards and back.

    q, k, v (B, H, T, D), T = this rank's slots
      -- all-to-all -->  (B, H / W, W * T, D): heads of this rank, every rank's slots
      -- slots to positions (padding dropped) -->  (B, H / W, length, D)
      -- attention on one process (mha.kernels.attention: torch's kernel or flash) -->
      -- positions to slots, all-to-all back -->  (B, H, T, Dv)

Two all-to-alls each way, and the attention is a single process's on the whole sequence for H / W
heads, with every option of the contract. The heads must divide among the ranks: H by W, and the
key/value heads by W too, after repeating each of them as few times as that needs (GQA, e.g.
H 8, Hkv 2, W 4: each kv head twice, so every rank holds one).

Memory per rank: q, k, v and the output for H / W heads over the whole sequence (the same
amount as 1/W of the sequence for all heads), plus the attention's own.
"""

from __future__ import annotations

from torch import Tensor

from .. import kernels
from ..kernels.contract import contract_of
from . import comm
from .inputs import check
from .layout import SequenceLayout

__all__ = ["ulysses_attention"]


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, *, is_causal: bool = False,
                      scale: float | None = None, enable_gqa: bool = False, window: tuple[int, int] | None = None,
                      alibi_slopes: Tensor | None = None, softcap: float | None = None,
                      sinks: Tensor | None = None, backend: str = "auto") -> Tensor:
    """Exact attention over the whole sequence from this rank's shards, by all-to-all (see the module
    docstring). The arguments, shapes and gradients are ring_attention's; ``backend`` chooses the
    kernel of the local attention (mha.kernels: "auto", "sdpa", "flash", "native", "math")."""
    terms = check(q, k, v, layout, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, window=window,
                  alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks)
    W, H = layout.world_size, q.shape[1]
    repeats = kv_repeats(H, k.shape[1], W)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)  # (B, Hkv, T, D) -> (B, Hkv * r, T, D)
    mine = slice(layout.rank * H // W, (layout.rank + 1) * H // W)  # the heads this rank attends
    slots = layout.slots(q.device)  # (length,): where each position sits among all ranks' slots
    q, k, v = (_to_heads(x, slots, layout) for x in (q, k, v))  # (B, H / W, length, D)
    contract = contract_of(band=terms.band, scale=terms.scale, softcap=terms.softcap,
                           alibi_slopes=None if terms.alibi_slopes is None else terms.alibi_slopes[mine],
                           sinks=None if terms.sinks is None else terms.sinks[mine])
    out, _ = kernels.attention(q, k, v, contract, backend=backend)  # (B, H / W, length, Dv)
    return _to_sequence(out, slots, layout)


def kv_repeats(H: int, Hkv: int, W: int) -> int:
    """How many times each key/value head is repeated so that the key/value heads divide among W
    ranks and each query head's one stays with it: the least r with W | Hkv * r and r | H / Hkv
    (r = H / Hkv, every query head its own, always does once W divides H)."""
    if H % W:
        raise ValueError(f"Ulysses attention splits the heads among the ranks: {H} query heads do not divide "
                         f"among {W} ranks (use ring attention, or a head count divisible by {W})")
    group = H // Hkv
    return next(r for r in range(1, group + 1) if (Hkv * r) % W == 0 and group % r == 0)


def _to_heads(x: Tensor, slots: Tensor, layout: SequenceLayout) -> Tensor:
    """(B, H', T, D) sequence shard -> (B, H' / W, length, D): this rank's heads, in position order."""
    gathered = comm.all_to_all(x, scatter_dim=1, gather_dim=2, group=layout.group)  # (B, H' / W, W * T, D)
    return gathered.index_select(2, slots)  # slots -> positions, padding dropped


def _to_sequence(x: Tensor, slots: Tensor, layout: SequenceLayout) -> Tensor:
    """(B, H / W, length, Dv) -> (B, H, T, Dv) this rank's slots, zeros in the padding."""
    B, heads, _, Dv = x.shape
    in_slots = x.new_zeros(B, heads, layout.world_size * layout.local_length, Dv).index_copy(2, slots, x)
    return comm.all_to_all(in_slots, scatter_dim=2, gather_dim=1, group=layout.group)  # (B, H, T, Dv)
