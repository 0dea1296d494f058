"""The multi-head machinery shared by every module: the pipeline, heads, extra keys, masks, merge.

Every module runs one forward, :func:`pipeline`: the caller's layout to batch-first, project and
split into heads, attend, merge the heads, project out, back to the caller's layout. The drop-in
(mha.nn.MultiheadAttention, through mha.functional), the general module (mha.GeneralAttention)
and parallelize's modules differ only in the callables they hand it: how they project (packed
weights, submodules, split ones), and how they attend: :func:`attend` (masks in torch's
conventions, extra keys), :func:`attend_positional` (the general module's RoPE, ALiBi, windows
and KV cache: masks from positions), or ring / Ulysses attention.

Shapes follow the package legend (mha): B batch, H query heads, Hkv key/value heads, L query
length, S key length, D / Dv per-head query-key / value width, E embedding (or output) width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks, kernels, masks, positions
from ..kernels import dispatch, storage
from ..kernels.contract import NONE, Contract, contract_of
from ..kernels.paged import attend_pages, batch_paged_attention

__all__ = ["attend", "attend_positional", "nested_forward", "check_inputs", "finish", "own_tensors",
           "pipeline", "split_heads", "split_packed_heads", "to_batch_first"]

_ABSENT = object()


def pipeline(query: Tensor, key: Tensor, value: Tensor, *, batched: bool, batch_first: bool,
             project: Callable, attend: Callable, out_proj: Callable[[Tensor], Tensor],
             average_attn_weights: bool = True) -> tuple[Tensor, Tensor | None]:
    """The one forward of every multi-head module.

        project(x_q (B, L, Eq), x_k (B, S, Ek), x_v (B, S, Ev)) -> q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)
        attend(q, k, v) -> (o (B, H, L, Dv), weights (B, H, L, S') or None)
        out_proj(merged (..., H*Dv)) -> out

    query, key and value are in the caller's layout: (B, T, .) with batch_first, (T, B, .) without,
    (T, .) unbatched. Self-attention (query is key is value) hands project one tensor three times.
    Returns (out in the caller's layout, weights averaged over heads unless average_attn_weights
    is False, or None)."""
    x_q = to_batch_first(query, batched, batch_first)  # -> (B, L, Eq)
    if query is key and key is value:
        x_k = x_v = x_q
    else:
        x_k, x_v = to_batch_first(key, batched, batch_first), to_batch_first(value, batched, batch_first)
    q, k, v = project(x_q, x_k, x_v)
    o, weights = attend(q, k, v)
    return finish(o, weights, out_proj=out_proj, average_attn_weights=average_attn_weights, batched=batched,
                  seq_first=batched and not batch_first)


def to_batch_first(x: Tensor, batched: bool, batch_first: bool) -> Tensor:
    """The caller's layout -> (B, T, features)."""
    if not batched:
        return x.unsqueeze(0)  # (T, F) -> (1, T, F)
    return x if batch_first else x.transpose(0, 1)  # (T, B, F) -> (B, T, F)


def own_tensors(module, *names: str) -> tuple:
    """``module.<name>`` for each name, read from the module's parameter and buffer dicts when it is
    there (a dict read, not nn.Module.__getattr__: this is on every call's path), through getattr
    otherwise (None, or a pruned or parametrized tensor that lives elsewhere)."""
    params, buffers = module._parameters, module._buffers
    found = []
    for name in names:
        value = params.get(name, _ABSENT)
        if value is _ABSENT:
            value = buffers.get(name, _ABSENT)
        found.append(getattr(module, name) if value is _ABSENT else value)
    return tuple(found)


def check_inputs(query, key, value, *, query_width: tuple[str, int],
                 key_width: tuple[str, int] | None = None, value_width: tuple[str, int] | None = None,
                 batch_first: bool) -> bool:
    """Validate query/key/value of a multi-head module; returns whether the input is batched.

    Each ``*_width`` is (the name of the setting, its value), e.g. ("embed_dim", 512).
    """
    if _look_fine(query, key, value, query_width, key_width, value_width):
        return query.dim() == 3
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.floating(name, x)
    _checks.same_dtype_device("query", query, key=key, value=value)
    layout = "(B, L, E)" if batch_first else "(L, B, E)"
    _checks.rank("query", query, (2, 3), f"({layout} batched, (L, E) unbatched)")
    if key.dim() != query.dim() or value.dim() != query.dim():  # torch's words, and what we got
        raise _checks.ShapeError(
            f"expected `key` and `value` to be {query.dim()}-D but found {key.dim()}-D and {value.dim()}-D tensors "
            f"respectively: they must have query's rank (key {tuple(key.shape)}, value {tuple(value.shape)})")
    for name, x, width in (("query", query, query_width), ("key", key, key_width),
                           ("value", value, value_width)):
        if width is not None and x.shape[-1] != width[1]:
            raise ValueError(f"{name}'s last dim must be {width[0]}={width[1]}, got shape {tuple(x.shape)}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            "key and value must have the same length (and batch size), got shapes "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    batched = query.dim() == 3
    batch_axis = 0 if batch_first else 1
    if batched and key.shape[batch_axis] != query.shape[batch_axis]:
        raise ValueError(
            f"key and query must have the same batch size (dim {batch_axis}), got shapes "
            f"{tuple(key.shape)} and {tuple(query.shape)}"
        )
    return batched


def _look_fine(query, key, value, query_width, key_width, value_width) -> bool:
    """The checks of check_inputs in one expression, true for good self-attention input (the
    common case costs a few attribute reads; anything else takes the checks that explain)."""
    return (query is key and key is value and type(query) is Tensor and not query.is_nested
            and query.is_floating_point() and query.dim() in (2, 3) and query.shape[-1] == query_width[1]
            and (key_width is None or key_width[1] == query_width[1])
            and (value_width is None or value_width[1] == query_width[1]))


def attend(q: Tensor, k: Tensor, v: Tensor, *, bias_k=None, bias_v=None, static_k=None, static_v=None,
           add_zero_attn=False, attn_mask=None, key_padding_mask=None, is_causal=False, terms: Contract = NONE,
           dropout_p=0.0, need_weights=False, batched=True, backend="auto") -> tuple[Tensor, Tensor | None]:
    """Attention over per-head q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), with the module's
    own score terms (a Contract of softcap, sinks, logit_scale: GeneralAttention._terms).

    Masks follow torch.nn.MultiheadAttention (bool True = masked out); the appended keys
    (bias_k/bias_v (1, 1, Hkv*D), zero attention) are visible to every query, causal or not. With
    Hkv < H (GQA), query head h reads key/value head h // (H / Hkv).
    Returns (output (B, H, L, Dv), weights (B, H, L, S + appended) or None).
    """
    k, v, appended = _extra_keys(k, v, bias_k=bias_k, bias_v=bias_v, static_k=static_k, static_v=static_v,
                                 add_zero_attn=add_zero_attn)
    B, H, L, _ = q.shape
    S = k.shape[2] - appended  # the keys the caller's masks describe
    mask, key_valid = masks.from_multihead(attn_mask, key_padding_mask, batch=B, num_heads=H, L=L, S=S,
                                      batched=batched, like=q)
    band = positions.band(is_causal)
    per_sequence = None
    if appended:  # appended keys: attended by every query; causal queries see them at position 0
        mask = None if mask is None else F.pad(mask, (0, appended), value=True if mask.dtype == torch.bool else 0.0)
        key_valid = None if key_valid is None else F.pad(key_valid, (0, appended), value=True)
        if band is not None:
            key_positions = F.pad(torch.arange(S, device=q.device), (0, appended))  # (S + appended,)
            per_sequence = (torch.arange(L, device=q.device)[None], key_positions[None])  # (1, L), (1, S + appended)
    contract = terms.replace(band=band, positions=per_sequence, key_valid=key_valid, mask=mask)
    return kernels.attention(q, k, v, contract, dropout_p=dropout_p, need_weights=need_weights, backend=backend)


def finish(o: Tensor, weights: Tensor | None, *, out_proj: Callable[[Tensor], Tensor],
           average_attn_weights: bool, batched: bool, seq_first: bool) -> tuple[Tensor, Tensor | None]:
    """Merge heads, project out, average weights, drop the batch dim of unbatched input.

    o (B, H, L, Dv) -> (L, B, H*Dv) when seq_first, else (B, L, H*Dv) (unbatched: (L, H*Dv)), then
    ``out_proj``; weights (B, H, L, S) -> (B, L, S) averaged.
    """
    merged = _merge_heads(o, seq_first)
    out = out_proj(merged)
    if weights is not None and average_attn_weights:
        weights = weights.mean(dim=1)  # (B, H, L, S) -> (B, L, S)
    if not batched:
        out = out.squeeze(0)  # (1, L, E) -> (L, E)
        weights = None if weights is None else weights.squeeze(0)
    return out, weights


def attend_positional(q: Tensor, k: Tensor, v: Tensor, *, rope=None, window=None, terms: Contract = NONE, cache=None,
                      key_padding_mask=None, is_causal=False, dropout_p=0.0, need_weights=False, backend="auto"):
    """Attention whose masks come from token positions: RoPE, sliding windows, ALiBi, a cache.

    q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) are the new tokens' heads. Without a
    cache, queries sit at positions 0..L-1 and keys at 0..S-1. With one (a KVCache, float or 8-bit,
    or a PagedKVCache's step: the cache protocol), the new tokens continue each sequence: the cache
    says where they sit (next_positions), stores them and says what the queries see (store: a Seen),
    every sequence's keys, or its pages, read in place. key_padding_mask (B, S), bool True = padding.
    RoPE, the causal band, the window (flash-attn's (left, right)) and ALiBi (in ``terms``, the
    module's score terms: GeneralAttention._terms) all read these positions (mha.positions).
    Returns (output (B, H, L, Dv), weights or None).
    """
    B, L, S = q.shape[0], q.shape[2], k.shape[2]
    key_valid = masks.key_valid(key_padding_mask, B, S)
    band = positions.band(is_causal, window)
    if cache is None:
        if rope is not None:
            q_pos, k_pos = positions.aligned(positions.whole(L), positions.whole(S), 0, q.device)  # (L,), (S,)
            q, k = rope(q, q_pos[..., None, :]), rope(k, k_pos[..., None, :])
        contract = terms.replace(band=positions.needed(band, L, S), key_valid=key_valid)
        return kernels.attention(q, k, v, contract, dropout_p=dropout_p, need_weights=need_weights, backend=backend)
    if L != S:
        raise ValueError(f"with a cache, query and key are the same new tokens: got lengths {L} and {S}")
    if cache.reads_pages and (need_weights or dropout_p):
        raise ValueError("attention over cache pages (a PagedKVCache step, an 8-bit KVCache) serves inference: no "
                         "weights, no dropout (use forward() in eval mode)")
    uniform = cache.uniform and key_valid is None  # an offset places every sequence
    q_pos = None if uniform and rope is None else cache.next_positions(B, L, q.device, key_valid)  # (B|1, L)
    if rope is not None:
        q, k = rope(q, q_pos[..., None, :]), rope(k, q_pos[..., None, :])  # positions (B|1, 1, L) over the heads
    seen = cache.store(k, v, q_pos, key_valid)
    if seen.block_table is not None:
        return _attend_pages(q, seen, terms.replace(band=band), backend=backend), None
    if storage.quantized(seen.keys):  # an 8-bit KVCache's rows: each sequence's one page (its rows bottom-right)
        return batch_paged_attention(q, seen.keys, seen.values, terms.replace(band=band), backend=backend), None
    S_all = seen.keys.shape[2]
    offset = positions.offset_of("bottom_right", L, S_all)  # the new tokens last
    band = band if seen.positions is not None else positions.needed(band, L, S_all, offset)
    if (terms is NONE and seen.positions is None and seen.key_valid is None and backend == "auto" and not need_weights
            and not dropout_p and (out := dispatch.plain_attention(q, seen.keys, seen.values, band=band, offset=offset))
            is not None):
        return out, None  # torch's call as it is (most decoding steps): no contract built
    contract = terms.replace(band=band, offset=offset, positions=seen.positions, key_valid=seen.key_valid)
    return kernels.attention(q, seen.keys, seen.values, contract, dropout_p=dropout_p, need_weights=need_weights,
                             backend=backend)


def _attend_pages(q: Tensor, seen, terms, *, backend: str) -> Tensor:
    """q (B, H, L, D) over the pages a cache's Seen names, its rows that are new tokens packed (the rest
    padding, zeros out): mha.kernels.paged's attention under the contract's per-sequence terms
    (inference). Returns (B, H, L, Dv)."""
    B, H, L, D = q.shape
    rows = q.transpose(1, 2)  # (B, H, L, D) -> (B, L, H, D)
    if seen.rows is None:  # every row a new token (a decoding step, a whole prompt): a reshape, no indexing
        out = attend_pages(rows.reshape(B * L, H, D), seen.keys, seen.values, seen.block_table,
                           torch.arange(0, (B + 1) * L, L), seen.lengths_k, terms, backend=backend)  # (B*L, H, Dv)
        return out.view(B, L, H, -1).transpose(1, 2)  # (B*L, H, Dv) -> (B, L, H, Dv) -> (B, H, L, Dv)
    counts = seen.rows.sum(1).cpu()  # (B,)
    out = attend_pages(rows[seen.rows], seen.keys, seen.values, seen.block_table, F.pad(counts.cumsum(0), (1, 0)),
                       seen.lengths_k, terms, backend=backend)  # (B, L, H, D) -> (T, H, D) -> (T, H, Dv)
    full = out.new_zeros(B, L, *out.shape[1:])  # (B, L, H, Dv), zeros on padding rows
    full[seen.rows] = out
    return full.transpose(1, 2)  # (B, L, H, Dv) -> (B, H, L, Dv)


def nested_forward(query: Tensor, key: Tensor, value: Tensor, *, project: Callable,
                   out_proj: Callable[[Tensor], Tensor], is_causal: bool, need_weights: bool,
                   average_attn_weights: bool, backend: str) -> tuple[Tensor, Tensor | None]:
    """The pipeline for nested (ragged) batches: query (B, j, Eq), key (B, j', Ek), value (B, j', Ev)
    (torch.nested, jagged or strided). The sequences are packed one after another (no padding to the
    longest), projected, attended in one call of varlen attention (causality bottom-right within
    each sequence), projected out, and nested again like query.

        project(x_q (1, Tq, Eq), x_k (1, Tk, Ek), x_v (1, Tk, Ev)) -> q (1, H, Tq, D), k, v (1, Hkv, Tk, D|Dv)

    Returns (output (B, j, E) nested, weights or None): weights as torch's fast path gives them for
    nested input, each sequence's (B, [H,] L, S) padded with zeros to the longest."""
    from ..kernels import varlen

    x_q, x_k, x_v, cu_q, cu_k = varlen.packed_qkv(query, key, value, seq_dim=0)  # (B, j, E) -> (T, E)
    q, k, v = (x[0].transpose(0, 1) for x in project(x_q[None], x_k[None], x_v[None]))  # (1, X, T, D) -> (T, X, D)
    out = varlen.varlen_attention(q, k, v, cu_q, cu_k, is_causal=is_causal, backend=backend)  # (Tq, H, Dv)
    out = out_proj(out.flatten(1))  # (Tq, H, Dv) -> (Tq, H*Dv) -> (Tq, E)
    weights = _nested_weights(q, k, v, cu_q, cu_k, is_causal, average_attn_weights) if need_weights else None
    return varlen.to_nested(out, cu_q, query, seq_dim=0), weights


def _nested_weights(q, k, v, cu_q, cu_k, is_causal, average) -> Tensor:
    """Each sequence's weights on the math backend, (B, [H,] L_max, S_max), zeros past its lengths."""
    H, lengths = q.shape[1], list(zip(cu_q.diff().tolist(), cu_k.diff().tolist()))
    weights = q.new_zeros(len(lengths), H, max(L for L, _ in lengths), max(S for _, S in lengths))
    for b, (L, S) in enumerate(lengths):
        rows, cols = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        heads = [x[part].transpose(0, 1) for x, part in ((q, rows), (k, cols), (v, cols))]  # (T, X, D) -> (X, T, D)
        band = positions.band(is_causal)
        contract = contract_of(band=band, offset=positions.offset_of("bottom_right", L, S))
        _, w = kernels.attention(*heads, contract, need_weights=True, backend="math")  # (H, L, S)
        weights[b, :, :L, :S] = w
    return weights.mean(dim=1) if average else weights


def _extra_keys(k, v, *, bias_k, bias_v, static_k, static_v, add_zero_attn):
    """static_k/static_v in place of k (B, Hkv, S, D), v (B, Hkv, S, Dv), then bias_k/bias_v and a
    zero key appended. Returns (k, v, number of key columns appended after the caller's S keys)."""
    if static_k is None and static_v is None and bias_k is None and not add_zero_attn:
        return k, v, 0
    B, Hkv = k.shape[:2]
    k = _static("static_k", static_k, like=k)
    v = _static("static_v", static_v, like=v)
    if bias_k is not None:
        k = torch.cat([k, bias_k.view(1, Hkv, 1, -1).expand(B, -1, -1, -1)], dim=2)  # (B, Hkv, S+1, D)
        v = torch.cat([v, bias_v.view(1, Hkv, 1, -1).expand(B, -1, -1, -1)], dim=2)  # (B, Hkv, S+1, Dv)
    if add_zero_attn:
        k = _append_zero_key(k)  # (B, Hkv, S, D) -> (B, Hkv, S+1, D)
        v = _append_zero_key(v)
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"keys and values must have the same length, got {k.shape[2]} and "
                         f"{v.shape[2]} (check static_k / static_v)")
    return k, v, int(bias_k is not None) + int(bool(add_zero_attn))


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    B, T, HD = x.shape
    return x.reshape(B, T, num_heads, HD // num_heads).transpose(1, 2)  # (B, T, H*D) -> (B, T, H, D) -> (B, H, T, D)


def split_packed_heads(x: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The packed projection (B, T, 3*H*D) of self-attention -> q, k, v (B, H, T, D) each."""
    B, T, HD3 = x.shape
    return x.reshape(B, T, 3, num_heads, HD3 // (3 * num_heads)).permute(2, 0, 3, 1, 4).unbind(0)  # -> (3, B, H, T, D)


def _merge_heads(o: Tensor, seq_first: bool) -> Tensor:
    if seq_first:
        return o.permute(2, 0, 1, 3).flatten(2)  # (B, H, L, D) -> (L, B, H, D) -> (L, B, H*D)
    return o.transpose(1, 2).flatten(2)  # (B, H, L, D) -> (B, L, H, D) -> (B, L, H*D)


def _append_zero_key(x: Tensor) -> Tensor:
    zeros = x.new_zeros(x.shape[0], x.shape[1], 1, x.shape[3])  # (B, H, 1, D)
    return torch.cat([x, zeros], dim=2)


def _static(name: str, given: Tensor | None, *, like: Tensor) -> Tensor:
    """static_k / static_v (B*H, S, D) in place of the projected keys / values ``like`` (B, H, S', D)."""
    if given is None:
        return like
    _checks.floating(name, given)
    _checks.same_dtype_device("query", like, **{name: given})
    B, H, _, D = like.shape
    _checks.rank(name, given, (3,), "(N*num_heads, S, head_dim)")  # torch's letters, in torch's words
    if given.shape[0] != B * H or given.shape[2] != D:
        raise ValueError(f"{name} must have shape ({B * H}, S, {D}) = (N*num_heads, S, head_dim), "
                         f"got {tuple(given.shape)}")
    return given.unflatten(0, (B, H))  # (B*H, S, D) -> (B, H, S, D)
