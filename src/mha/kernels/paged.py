"""Ragged attention over KV-cache pages in one call: many sequences, each with its own new query
rows (a prefill chunk, or one decoding token) and its own keys, read from a pool of pages.

    paged_attention(q (Tq, H, D), k_pages (N, Hkv, P, D), v_pages (N, Hkv, P, Dv), block_table (B, M),
                    cu_seqlens_q (B + 1,), seqlens_k (B,)) -> (Tq, H, Dv)

The pool (mha.PagedKVCache keeps one per layer) holds N pages of P key slots each; sequence b's
key j lies in page block_table[b, j // P], slot j % P; it has S_b = seqlens_k[b] keys and owns
the query rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (L_b >= 1 of them, L_b <= S_b: the new tokens
are its last keys). Positions per sequence (mha.positions): query r sits at S_b - L_b + r, key j
at j, so causality is bottom-right (a chunk's rows see the earlier chunks and the cache), and a
window, ALiBi, softcap, sinks, GQA and the scale apply to each sequence as to one call of
scaled_dot_product_attention.

Backends (mha.kernels.dispatch.choose_paged_backend): native reads each page where it lies (no
gather copy of the cache); math is the reference, each sequence alone and dense (its keys
gathered from the pages). Inference only: a call that needs gradients is refused.

8-bit pools: int8 pages as every mha cache keeps them (mha.kernels.storage: (N, Hkv, P, D + 4), each
row's int8 values then its float32 scale, one per (slot, head)), or int8 rows (N, Hkv, P, D) with
their scales apart, k_scales and v_scales (N, Hkv, P); native reads the int8 rows in place and
scales each as it converts it, math dequantizes the pool and attends (the reference).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks
from . import storage
from .contract import Contract, from_keywords

__all__ = ["attend_pages", "batch_paged_attention", "paged_attention"]


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                    seqlens_k: Tensor, *, is_causal: bool = True, window: tuple[int, int] | None = None,
                    alibi_slopes: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None,
                    scale: float | None = None, k_scales: Tensor | None = None, v_scales: Tensor | None = None,
                    backend: str = "auto") -> Tensor:
    """Attention of packed query rows over their sequences' keys in the pages (module docstring).

    q (Tq, H, D); k_pages (N, Hkv, P, D), v_pages (N, Hkv, P, Dv); block_table (B, M) int, the page
    of each sequence's j-th block of keys (entries past a sequence's blocks may be -1);
    cu_seqlens_q (B + 1,) int offsets from 0 to Tq; seqlens_k (B,) int key counts. is_causal and
    window (flash-attn's (left, right), -1 unbounded) are aligned bottom-right per sequence.
    Returns (Tq, H, Dv) in q's dtype. backend: "auto", "native" or "math". int8 pages: as mha's
    caches keep them, (N, Hkv, P, D + 4) and (N, Hkv, P, Dv + 4), each row's scale after it
    (mha.kernels.storage; PagedKVCache.pages()), or (N, Hkv, P, D|Dv) with their scales apart,
    k_scales and v_scales (N, Hkv, P) floating (mha.kernels.quantize.quantize_int8's).
    """
    _checks.rank("q", _checks.floating("q", q), (3,), "(total query rows, heads, head dim)")  # (its heads: below)
    contract = from_keywords(q, q.shape[1], is_causal=is_causal, window=window, alibi_slopes=alibi_slopes, scale=scale,
                             softcap=softcap, sinks=sinks, head_dim="1", query="q")
    return attend_pages(q, k_pages, v_pages, block_table, cu_seqlens_q, seqlens_k, contract, k_scales=k_scales,
                        v_scales=v_scales, backend=backend)


def attend_pages(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                 seqlens_k: Tensor, contract: Contract, *, k_scales: Tensor | None = None, v_scales: Tensor | None = None,
                 backend: str = "auto") -> Tensor:
    """paged_attention under a contract (the band, ALiBi, scale, softcap and sinks: its per-sequence
    terms; the positions come from the pages), every other argument as paged_attention's. What the
    entry points that hold a contract already call (the caches, the integrations)."""
    from . import dispatch  # the dispatch imports the backends; this module only checks and asks it

    if (k_scales is None and v_scales is None and backend == "auto"
            and (out := dispatch.plain_paged(q, k_pages, v_pages, block_table, cu_seqlens_q, seqlens_k, contract))
            is not None):
        return out  # the native kernel's call, its checks in one step (most serving steps)
    k_pages, v_pages, k_scales, v_scales = _rows_and_scales(q, k_pages, v_pages, k_scales, v_scales)
    _check_scales(q, k_pages, v_pages, k_scales, v_scales)
    table, cu, lengths_k = _check(q, k_pages, v_pages, block_table, cu_seqlens_q, seqlens_k)
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("alibi_slopes", contract.alibi_slopes),
                    ("sinks", contract.sinks)):
        if torch.is_grad_enabled() and x is not None and x.requires_grad:
            raise ValueError(f"paged_attention is for inference: {name} requires grad; call it under "
                             "torch.no_grad() or torch.inference_mode() (training runs on the other paths)")
    q, contract = contract.fold_logit_scale(q, heads_dim=-2)  # each head's factor into its rows of q (Tq, H, D)
    return dispatch.paged_attention(q, k_pages, v_pages, table, cu, lengths_k, contract, backend=backend,
                                    k_scales=k_scales, v_scales=v_scales)


def batch_paged_attention(q: Tensor, k: Tensor, v: Tensor, contract: Contract, *, k_scales: Tensor | None = None,
                          v_scales: Tensor | None = None, backend: str = "auto") -> Tensor:
    """attend_pages over a batch whose sequences share one length: q (B, H, L, D), k (B, Hkv, S, D)
    and v (B, Hkv, S, Dv) (or int8 as attend_pages takes them), each sequence's keys one page of S
    slots, read in place; its rows bottom-right. Returns (B, H, L, Dv). 8-bit rows kept with their
    scales take the native kernel's per-call fast path where it runs them (dispatch.plain_pages)."""
    from . import dispatch

    if k_scales is None and backend == "auto" and (out := dispatch.plain_pages(q, k, v, contract)) is not None:
        return out
    B, H, L = q.shape[:3]
    S = k.shape[2]
    rows = q.transpose(1, 2).reshape(B * L, H, q.shape[3])  # (B, H, L, D) -> (B, L, H, D) -> (B*L, H, D)
    pages = torch.arange(B)[:, None]  # (B, 1): sequence b's keys are page b
    out = attend_pages(rows, k, v, pages, torch.arange(B + 1) * L, torch.full((B,), S), contract, k_scales=k_scales,
                       v_scales=v_scales, backend=backend)
    return out.view(B, L, H, -1).transpose(1, 2)  # (B*L, H, Dv) -> (B, L, H, Dv) -> (B, H, L, Dv)


def _rows_and_scales(q, k_pages, v_pages, k_scales, v_scales) -> tuple:
    """int8 pages without scales are kept as mha.kernels.storage keeps them: their rows and scales
    (views). Anything else as given (checked next)."""
    if not all(isinstance(x, Tensor) and x.dtype == torch.int8 for x in (k_pages, v_pages)) or (
            k_scales is not None or v_scales is not None):
        return k_pages, v_pages, k_scales, v_scales
    D = q.shape[-1] if isinstance(q, Tensor) and q.dim() == 3 else None
    for name, pages, width in (("k_pages", k_pages, D), ("v_pages", v_pages, None)):
        if pages.dim() != 4 or pages.shape[3] <= storage.SCALE_BYTES or width not in (None, storage.width(pages)):
            raise ValueError(f"{name} is int8 {tuple(pages.shape)} without its scales: 8-bit pages are kept as "
                             f"(num_blocks, kv heads, block_size, {width or 'head dim'} + {storage.SCALE_BYTES}), each "
                             "row then its float32 scale (mha.kernels.storage), or come with k_scales and v_scales")
    (k_rows, k_scales), (v_rows, v_scales) = storage.split(k_pages), storage.split(v_pages)
    return k_rows, v_rows, k_scales, v_scales


def _check_scales(q, k_pages, v_pages, k_scales, v_scales) -> None:
    """int8 pools come with their scales (N, Hkv, P), float pools without."""
    quantized = isinstance(k_pages, Tensor) and k_pages.dtype == torch.int8
    if not quantized:
        if k_scales is not None or v_scales is not None:
            raise ValueError("k_scales and v_scales go with int8 pages (mha.kernels.quantize); k_pages is "
                             f"{getattr(k_pages, 'dtype', type(k_pages).__name__)}")
        return
    if not isinstance(v_pages, Tensor) or v_pages.dtype != torch.int8:
        raise TypeError(f"v_pages must be int8 like k_pages, got {getattr(v_pages, 'dtype', type(v_pages).__name__)}")
    for name, scales, pages in (("k_scales", k_scales, k_pages), ("v_scales", v_scales, v_pages)):
        if scales is None:
            raise ValueError(f"int8 pages need {name}: one float per (page, kv head, slot), shape {tuple(pages.shape[:3])}")
        _checks.floating(name, scales)
        if tuple(scales.shape) != tuple(pages.shape[:3]) or scales.device != pages.device:
            raise ValueError(f"{name} must be (num_blocks, kv heads, block_size) = {tuple(pages.shape[:3])} on "
                             f"{pages.device}, got {tuple(scales.shape)} on {scales.device}")
    _checks.floating("q", q)


def _check(q, k_pages, v_pages, block_table, cu_seqlens_q, seqlens_k) -> tuple[Tensor, Tensor, Tensor]:
    """Validate every argument's kind, rank and shape (attribute reads, no tensor op: this is a
    decoding step's path); returns the block table (B, M), the query offsets (B + 1,) and the key
    lengths (B,) as int32 or int64 CPU tensors. Their values are check_counts' to validate."""
    _checks.rank("q", _checks.floating("q", q), (3,), "(total query rows, heads, head dim)")
    quantized = isinstance(k_pages, Tensor) and k_pages.dtype == torch.int8  # (with its scales: _check_scales)
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        _checks.rank(name, x if quantized else _checks.floating(name, x), (4,), "(num_blocks, kv heads, block_size, head dim)")
    if quantized:
        _checks.same_dtype_device("k_pages", k_pages, v_pages=v_pages)
        if q.device != k_pages.device:
            raise ValueError(f"q is on {q.device}, the pages on {k_pages.device}")
    else:
        _checks.same_dtype_device("q", q, k_pages=k_pages, v_pages=v_pages)
    if v_pages.shape[:3] != k_pages.shape[:3]:
        raise ValueError(f"v_pages must have k_pages' blocks, heads and block size {tuple(k_pages.shape[:3])}, "
                         f"got shape {tuple(v_pages.shape)}")
    if k_pages.shape[3] != q.shape[2]:
        raise ValueError(f"k_pages must have q's head dim ({q.shape[2]}), got shape {tuple(k_pages.shape)}")
    if k_pages.shape[2] < 1:
        raise ValueError(f"k_pages must have a block size of at least 1, got shape {tuple(k_pages.shape)}")
    _checks.shared_heads(q.shape[1], "k_pages", k_pages.shape[1], dim=1)
    table = _integers("block_table", block_table, 2, "(sequences, blocks per sequence)")
    cu = _integers("cu_seqlens_q", cu_seqlens_q, 1, "(sequences + 1,) offsets")
    lengths_k = _integers("seqlens_k", seqlens_k, 1, "(sequences,) key counts")
    B = table.shape[0]
    if cu.shape[0] != B + 1 or lengths_k.shape[0] != B:
        raise ValueError(f"block_table describes {B} sequences: cu_seqlens_q needs {B + 1} offsets and seqlens_k "
                         f"{B} counts, got {cu.shape[0]} and {lengths_k.shape[0]}")
    return table, cu, lengths_k


def check_counts(q: Tensor, k_pages: Tensor, table: Tensor, cu: Tensor, lengths_k: Tensor) -> None:
    """The counts' rules, each broken one a ValueError naming its argument: the query offsets rise from
    0 to q's rows, each sequence at least one row and no more rows than keys, its keys within the
    table's blocks, and the pages its used blocks name within the pool. Arguments as _check returns
    them. The native kernel enforces the same rules on every index it reads (its RuntimeError); the
    dispatch calls this before the math reference, and after the kernel refuses, for the message."""
    offsets, keys = cu.tolist(), lengths_k.tolist()  # a few per sequence: each check a loop over B
    rows = [end - start for start, end in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or offsets[-1] != q.shape[0] or min(rows, default=1) < 1:
        raise ValueError(f"cu_seqlens_q must rise from 0 to the {q.shape[0]} rows of q, each sequence at least one "
                         f"row, got {offsets}")
    if any(S < L for S, L in zip(keys, rows)):
        raise ValueError(f"seqlens_k must count at least each sequence's query rows (its new tokens are its last "
                         f"keys): got seqlens_k {keys} for query rows {rows}")
    P, N, M = k_pages.shape[2], k_pages.shape[0], table.shape[1]
    used = [(S + P - 1) // P for S in keys]  # the blocks each sequence's keys fill
    if max(used, default=0) > M:
        raise ValueError(f"seqlens_k {keys} need up to {max(used)} blocks of {P} keys, but block_table has {M} per "
                         "sequence")
    _check_pages(table, used, N)


def _check_pages(table: Tensor, used: list[int], N: int) -> None:
    """Every page a sequence's used blocks name lies in the pool (0..N-1); entries past them may be
    anything. One pass over the table's used columns (its unused entries there set to page 0)."""
    width = max(used, default=0)
    if width == 0:
        return
    head = table[:, :width]
    unused = None
    if min(used) < width:
        unused = torch.arange(width)[None, :] >= torch.tensor(used)[:, None]  # (B, width)
        head = head.masked_fill(unused, 0)
    low, high = torch.aminmax(head)
    if N > 0 and int(low) >= 0 and int(high) < N:
        return
    bad = (head < 0) | (head >= N)
    if unused is not None:
        bad &= ~unused
    raise ValueError(f"block_table names page {int(head[bad][0])} among a sequence's used blocks; the pool has pages "
                     f"0..{N - 1}")


def _integers(name: str, x, dims: int, meaning: str) -> Tensor:
    """x as an int32 or int64 CPU tensor of ``dims`` dims (as given when it is one: what the kernel
    reads), or a TypeError/ValueError naming it."""
    if not isinstance(x, Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{name} must be an integer tensor {meaning}, got {got}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {meaning}, got shape {tuple(x.shape)}")
    return x if x.dtype in (torch.int32, torch.int64) and x.device.type == "cpu" else x.to("cpu", torch.int64)
