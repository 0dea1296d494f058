"""Attention over a packed batch of sequences of different lengths (flash-attn's varlen layout).

    varlen_attention(q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), cu_seqlens_q, cu_seqlens_k) -> (Tq, H, Dv)

Sequence b holds the rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b + 1]
of k and v. The packing becomes positions (mha.positions.packed: sequences far enough apart that
the band never reaches from one into another), and the call is one call of the dispatch over
(1, H, Tq, D) against (1, Hkv, Tk, D): the native kernel never computes a tile between two
sequences; where it is not built, the dispatch says which backend runs instead and why.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks, positions
from .contract import from_keywords
from .dispatch import attention

__all__ = ["from_nested", "packed_qkv", "to_nested", "varlen_attention"]


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                     is_causal: bool = False, scale: float | None = None, window: tuple[int, int] | None = None,
                     alibi_slopes: Tensor | None = None, softcap: float | None = None,
                     sinks: Tensor | None = None, logit_scale: Tensor | None = None, score_mod=None, mask_mod=None,
                     backend: str = "auto") -> Tensor:
    """Attention over a packed batch: q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv);
    cu_seqlens_q / cu_seqlens_k: int tensors of B + 1 offsets from 0. Returns (total_q, H, Dv); a
    query sees only its own sequence's keys. Causality and windows are aligned bottom-right within
    each sequence (its last query faces its last key), as flash-attn's; ALiBi, softcap, sinks and
    logit_scale as in scaled_dot_product_attention. score_mod(score, b, h, q_idx, kv_idx) and mask_mod(b, h, q_idx,
    kv_idx), FlexAttention's signatures, as there, with q_idx and kv_idx rows of the packed q and k
    (a vector of each row's document or segment id indexes them as it is) and b = 0. Differentiable.
    backend: "auto" (mha.kernels.choose_backend) or a backend's name.

    On flex (CUDA) the packing is a document mask whose block mask is built once per set of lengths
    (the positions of a set of lengths are cached, so the same lengths reuse it).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.floating(name, x)
        _checks.rank(name, x, (3,), "(total tokens, heads, head dim)")
    lengths_q, lengths_k = (_lengths(name, cu, x.shape[0]) for name, cu, x in (("cu_seqlens_q", cu_seqlens_q, q),
                                                                              ("cu_seqlens_k", cu_seqlens_k, k)))
    if len(lengths_q) != len(lengths_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got {len(lengths_q)} "
                         f"and {len(lengths_k)}")
    _checks.same_dtype_device("q", q, k=k, v=v)
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v must have k's tokens and heads {tuple(k.shape[:2])}, got shape {tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k must have q's head dim ({q.shape[2]}), got shape {tuple(k.shape)}")
    _checks.shared_heads(q.shape[1], "k", k.shape[1], dim=1)
    q_pos, k_pos, band = _packed(tuple(lengths_q.tolist()), tuple(lengths_k.tolist()),
                                 positions.band(is_causal, window), q.device)
    contract = from_keywords(q, q.shape[1], band=band, alibi_slopes=alibi_slopes, scale=scale, softcap=softcap,
                             sinks=sinks, logit_scale=logit_scale, head_dim="1", query="q", positions=(q_pos, k_pos),
                             score_mod=score_mod, mask_mod=mask_mod)  # the packing's band: within each sequence
    rows = [x.transpose(0, 1)[None] for x in (q, k, v)]  # (T, H, D) -> (1, H, T, D)
    out, _ = attention(*rows, contract, backend=backend)
    return out[0].transpose(0, 1)  # (1, H, Tq, Dv) -> (Tq, H, Dv)


@functools.lru_cache(maxsize=16)
def _packed(lengths_q: tuple[int, ...], lengths_k: tuple[int, ...], band, device) -> tuple[Tensor, Tensor, object]:
    """positions.packed for these lengths on ``device``: query positions (1, Tq), key positions (1, Tk)
    and the band; the same tensors for the same lengths (the flex backend's block masks know a
    term's tensors by identity, so a training loop over one packing builds its mask once)."""
    with torch.inference_mode(False):  # cached: plain tensors, whatever mode the first call came in
        q_pos, k_pos, band = positions.packed(torch.tensor(lengths_q, dtype=torch.long),
                                              torch.tensor(lengths_k, dtype=torch.long), band)
        return q_pos[None].to(device), k_pos[None].to(device), band


def _lengths(name: str, cu: Tensor, total: int) -> Tensor:
    """The lengths (int64) of the sequences cumulative offsets ``cu`` (B + 1 ints from 0 to total) describe."""
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.dtype == torch.bool or len(cu) < 1:
        raise TypeError(f"{name} must be a 1-D integer tensor of B + 1 offsets, got "
                        f"{cu.dtype if isinstance(cu, Tensor) else type(cu).__name__}"
                        f"{' of shape ' + str(tuple(cu.shape)) if isinstance(cu, Tensor) else ''}")
    lengths = cu.cpu().diff()
    if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lengths < 0).any()):
        raise ValueError(f"{name} must rise from 0 to the {total} rows of its tensor, got {cu.tolist()}")
    return lengths.to(torch.long)


# -- nested tensors (torch.nested, jagged or strided layout) as the packed layout -----------------

def from_nested(name: str, x: Tensor, *, seq_dim: int) -> tuple[Tensor, Tensor]:
    """(values (T, ...), cu_seqlens (B + 1,) int64) of a nested tensor whose components hold their
    tokens at ``seq_dim`` (0 for (L, E) components, 1 for (H, L, D)): the components' tokens one
    after another (differentiable). A component with a dim other than the tokens' ragged is refused."""
    parts = [part.movedim(seq_dim, 0) for part in x.unbind()]  # (..., L, ...) -> (L, ...)
    if not parts:
        raise ValueError(f"{name} is a nested tensor of no sequences")
    if any(part.shape[1:] != parts[0].shape[1:] for part in parts):
        raise ValueError(f"{name}'s sequences must differ only in their length, got shapes "
                         f"{[tuple(p.shape) for p in x.unbind()]}")
    lengths = torch.tensor([part.shape[0] for part in parts], dtype=torch.int64)
    return torch.cat(parts), F.pad(lengths.cumsum(0), (1, 0))


def packed_qkv(query: Tensor, key: Tensor, value: Tensor, *, seq_dim: int):
    """(q, k, v packed (T, ...), cu_seqlens_q, cu_seqlens_k) of nested query, key and value: as many
    sequences in each, key and value of the same lengths (a ValueError naming them otherwise)."""
    q, cu_q = from_nested("query", query, seq_dim=seq_dim)
    k, cu_k = from_nested("key", key, seq_dim=seq_dim)
    v, cu_v = from_nested("value", value, seq_dim=seq_dim)
    if len(cu_q) != len(cu_k) or not torch.equal(cu_k, cu_v):
        raise ValueError(f"query, key and value must hold as many sequences, key and value of the same lengths: got "
                         f"{cu_q.diff().tolist()}, {cu_k.diff().tolist()} and {cu_v.diff().tolist()}")
    return q, k, v, cu_q, cu_k


def to_nested(values: Tensor, cu_seqlens: Tensor, like: Tensor, *, seq_dim: int) -> Tensor:
    """The nested tensor of ``like``'s layout whose sequence b is values[cu[b]:cu[b + 1]], tokens at
    ``seq_dim`` of each component; a jagged one shares ``like``'s offsets (and so its ragged size)."""
    if like.layout == torch.jagged:
        offsets = like.offsets() if seq_dim == like._ragged_idx - 1 else cu_seqlens.to(values.device)
        nested = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)  # (B, j, ...)
        return nested.transpose(1, seq_dim + 1) if seq_dim else nested
    lengths = cu_seqlens.diff().tolist()
    return torch.nested.as_nested_tensor([part.movedim(0, seq_dim) for part in values.split(lengths)])
