"""Functions mirroring torch.nn.functional: same names, signatures, defaults and shapes.

    scaled_dot_product_attention   torch's SDPA (bool mask: True = ATTEND)
    multi_head_attention_forward   torch's functional MHA (bool masks: True = MASKED OUT)

Both run on the backends of :mod:`mha.kernels`, chosen by :func:`mha.kernels.choose_backend`
(``backend="auto"``) or named with ``backend=``.

Shape legend (the package's): B batch, H heads, L query length, S key length, E embed dim, D head dim (E / H),
Ek / Ev key / value input widths.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks, kernels, masks, positions
from .kernels import varlen
from .kernels._context import autocast_inputs
from .kernels._shapes import broadcast
from .kernels.contract import from_keywords
from .modules.pipeline import attend, check_inputs, pipeline
from .modules.projections import ProjectionWeights

__all__ = ["scaled_dot_product_attention", "multi_head_attention_forward"]


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False, *, backend: str = "auto",
                                 causal_alignment: str | None = None, window: tuple[int, int] | None = None,
                                 alibi_slopes: Tensor | None = None, softcap: float | None = None,
                                 sinks: Tensor | None = None, logit_scale: Tensor | None = None, score_mod=None,
                                 mask_mod=None) -> Tensor:
    """softmax(query key^T * scale + mask) value, as torch.nn.functional.scaled_dot_product_attention.

    query (..., L, D), key (..., S, D), value (..., S, Dv) -> (..., L, Dv).
    attn_mask: bool (True = attend) or float (added), broadcastable to (..., L, S).
    is_causal: causal mask (query i sees keys j <= i + offset), combined with attn_mask if both.
    enable_gqa: key/value may have fewer heads (dim -3) than query; query head h reads kv head
    h // (H / Hkv). Dropout is applied whenever dropout_p > 0, as in torch.
    A query row with every key masked gives zeros. backend: "auto", "sdpa", "flash", "native" or "math".

    Beyond torch's signature (keyword-only; see mha.positions for the position rule):
      causal_alignment  "top_left" (offset 0, torch's) or "bottom_right" (offset S - L: the last
                        query faces the last key, as after a KV cache): the alignment of is_causal,
                        window and ALiBi alike. Default: "bottom_right" when a window bounds what
                        is_causal alone does not, or alibi_slopes is given (flash-attn's convention),
                        else "top_left" (window=(-1, -1) bounds nothing: is_causal keeps torch's).
      window            (left, right), flash-attn's window_size: query i sees keys with
                        -left <= j - (i + offset) <= right; -1 = unbounded; with is_causal right = 0.
      alibi_slopes      (H,): ALiBi adds -slope_h * |j - (i + offset)| (mha.positions.alibi_slopes).
      softcap           c > 0: scores become c * tanh(scores / c) before ALiBi and masks (Gemma 2).
      sinks             (H,): one logit per head that joins every row's softmax and is then dropped
                        (GPT-OSS); differentiable.
      logit_scale       (H,): each head's factor of its scaled scores q.k * scale (an inverse
                        temperature, applied first); differentiable. On math, flash and flex.
      score_mod         score_mod(score, b, h, q_idx, kv_idx) -> score, FlexAttention's signature: a
                        term of your own, applied to the scaled score q.k * scale (before softcap,
                        ALiBi and attn_mask); b indexes the leading dims before the heads (flattened),
                        h the query head. Differentiable, also through the tensors it closes over.
      mask_mod          mask_mod(b, h, q_idx, kv_idx) -> bool (True = attend), FlexAttention's
                        signature: which keys each query sees, beside is_causal, window and attn_mask.
    None of them builds an L x S tensor: the dispatch runs them on a backend that applies them tile
    by tile (native, or flash where native is not built; FlexAttention on CUDA), or, at short T,
    folds windows and ALiBi into one mask for torch's kernel when that mask is no larger than
    query, key and value together (see mha.kernels.dispatch). score_mod and mask_mod run on flex
    (torch's FlexAttention, compiled; on CPU forward only) and math (eager, any device: the
    reference, which builds the L x S scores); the other backends refuse them.
    """
    # a plain call (an attn_mask beside it at most): the dispatch's per-call fast path (torch's kernel, when
    # that is what auto would run)
    # (its arguments positional and no call where scale is None: a call's Python costs a short call's time
    # when its caches are cold, as between a model's other layers)
    if (dropout_p.__class__ is float and dropout_p == 0.0
            and (scale is None or kernels.dispatch.plain_scale(scale))  # (torch's own argument)
            and backend == "auto" and causal_alignment is None and window is None and alibi_slopes is None
            and softcap is None and sinks is None and logit_scale is None and score_mod is None and mask_mod is None
            and (is_causal is False or is_causal is True)
            and (enable_gqa is False or enable_gqa is True)):
        out = kernels.dispatch.plain_sdpa(query, key, value, is_causal, enable_gqa, scale, None, attn_mask)
        if out is not None:
            return out
    if _checks.nested(query) or _checks.nested(key) or _checks.nested(value):
        return _nested_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, backend=backend, causal_alignment=causal_alignment,
                            window=window, alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks,
                            logit_scale=logit_scale, score_mod=score_mod, mask_mod=mask_mod)
    query, key, value, unbatched = _at_least_3d(query, key, value)
    query, key, value = autocast_inputs(query, key, value)  # under torch.autocast, as torch's SDPA
    batch_shape = _check_sdpa_inputs(query, key, value, enable_gqa)
    dropout_p = _checks.probability("dropout_p", dropout_p)
    L, S, H = query.shape[-2], key.shape[-2], query.shape[-3]
    band = positions.band(is_causal, window)
    if causal_alignment is None:  # bottom-right where a window bounds something is_causal alone does not, or ALiBi
        windowed = window is not None and band != positions.band(is_causal)
        causal_alignment = "bottom_right" if windowed or alibi_slopes is not None else "top_left"
    contract = from_keywords(
        query, H, is_causal=is_causal, window=window, alibi_slopes=alibi_slopes, scale=scale, softcap=softcap, sinks=sinks,
        logit_scale=logit_scale,
        offset=positions.offset_of(causal_alignment, L, S),
        mask=masks.from_sdpa(attn_mask, L=L, S=S, batch_shape=batch_shape, like=query), score_mod=score_mod,
        mask_mod=mask_mod)
    out, _ = kernels.attention(query, key, value, contract, dropout_p=dropout_p, backend=backend)
    return out[0] if unbatched else out


def _nested_sdpa(query, key, value, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend, causal_alignment,
                 window, alibi_slopes, softcap, sinks, logit_scale, score_mod, mask_mod) -> Tensor:
    """Nested query (B, H, j, D), key (B, Hkv, j', D), value (B, Hkv, j', Dv) (torch.nested, jagged
    as torch's SDPA takes them, or strided): packed, one call of varlen attention (no padding to the
    longest), the output nested like the query. Causality and windows align bottom-right within each
    sequence (the same as top-left where a sequence's query and key lengths are equal); score_mod and
    mask_mod index the packed rows (see varlen_attention)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not x.is_nested:
            raise ValueError(f"{name} must be nested too: a nested query, key and value, or none")
        if x.dim() != 4:
            raise ValueError(f"nested {name} must be (B, heads, ragged length, head dim), got {x.dim()}-D")
    if attn_mask is not None or dropout_p:
        raise ValueError("with nested tensors, attn_mask and dropout_p are not taken: each sequence's length is its "
                         "mask (window, is_causal and the other terms apply per sequence)")
    q, k, v, cu_q, cu_k = varlen.packed_qkv(query, key, value, seq_dim=1)  # (B, X, j, D) -> (T, X, D)
    if (is_causal or window is not None) and causal_alignment == "top_left" and not torch.equal(cu_q, cu_k):
        raise ValueError("nested causality and windows align bottom-right within each sequence; with query and key "
                         "lengths that differ pass causal_alignment='bottom_right' (or None)")
    if not _checks.flag("enable_gqa", enable_gqa) and k.shape[1] != q.shape[1]:
        raise ValueError(f"key has {k.shape[1]} heads and query {q.shape[1]}: pass enable_gqa=True to share them")
    out = varlen.varlen_attention(q, k, v, cu_q, cu_k, is_causal=is_causal, scale=scale, window=window,
                                  alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks, logit_scale=logit_scale,
                                  score_mod=score_mod,
                                  mask_mod=mask_mod, backend=backend)
    return varlen.to_nested(out, cu_q, query, seq_dim=1)  # (Tq, H, Dv) -> (B, H, j, Dv)


def _at_least_3d(query, key, value):
    """(L, D) inputs as (1, L, D): dim -3 is the heads ALiBi and sinks index. Returns a flag to undo it."""
    tensors = [_checks.tensor(name, x) for name, x in (("query", query), ("key", key), ("value", value))]
    unbatched = all(x.dim() == 2 for x in tensors)
    lifted = (x[None] if x.dim() == 2 else x for x in tensors)  # (T, D) -> (1, T, D)
    return (*lifted, unbatched)


def _check_sdpa_inputs(query, key, value, enable_gqa) -> tuple[int, ...]:
    """Validate; returns the output's batch shape (the inputs' batch dims broadcast together)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.floating(name, x)
        if x.dim() < 2:
            raise ValueError(f"{name} must be at least 2-D (..., length, features), got {x.dim()}-D "
                             f"with shape {tuple(x.shape)}")
    _checks.same_dtype_device("query", query, key=key, value=value)
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key's last dim must equal query's ({query.shape[-1]}), got shape {tuple(key.shape)}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(
            f"value must have as many positions as key ({key.shape[-2]}), got shape {tuple(value.shape)}"
        )
    batches = [tuple(x.shape[:-2]) for x in (query, key, value)]
    heads = ()
    _checks.flag("enable_gqa", enable_gqa)
    if enable_gqa and min(x.dim() for x in (query, key, value)) >= 3:
        heads = (query.shape[-3],)
        for name, x in (("key", key), ("value", value)):
            _checks.shared_heads(query.shape[-3], name, x.shape[-3], dim=-3, option="enable_gqa")
        batches = [b[:-1] for b in batches]  # heads checked: the rest must broadcast
    try:
        return (*broadcast(*batches), *heads)
    except RuntimeError:
        hint = "" if enable_gqa else " (pass enable_gqa=True for fewer key/value heads)"
        raise ValueError(f"the batch dims of query {batches[0]}, key {batches[1]} and value {batches[2]} "
                         f"do not broadcast together{hint}") from None


# ---------------------------------------------------------------------------------------------
# multi_head_attention_forward
# ---------------------------------------------------------------------------------------------


def multi_head_attention_forward(
    query: Tensor, key: Tensor, value: Tensor, embed_dim_to_check: int, num_heads: int,
    in_proj_weight: Tensor | None, in_proj_bias: Tensor | None,
    bias_k: Tensor | None, bias_v: Tensor | None, add_zero_attn: bool, dropout_p: float,
    out_proj_weight: Tensor, out_proj_bias: Tensor | None, training: bool = True,
    key_padding_mask: Tensor | None = None, need_weights: bool = True,
    attn_mask: Tensor | None = None, use_separate_proj_weight: bool = False,
    q_proj_weight: Tensor | None = None, k_proj_weight: Tensor | None = None,
    v_proj_weight: Tensor | None = None, static_k: Tensor | None = None,
    static_v: Tensor | None = None, average_attn_weights: bool = True, is_causal: bool = False,
    *, batch_first: bool = False, backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """torch.nn.functional.multi_head_attention_forward, with torch's arguments and shapes.

    query (L, B, E), key (S, B, Ek), value (S, B, Ev); unbatched (L, E), (S, Ek), (S, Ev);
    with the keyword-only ``batch_first=True``: (B, L, E), (B, S, Ek), (B, S, Ev).
    Masks: bool True = masked OUT, float added; attn_mask (L, S) or (B*H, L, S) (unbatched:
    (H, L, S)); key_padding_mask (B, S) (unbatched: (S,)).
    Differences from torch: ``is_causal`` applies the causal mask (with attn_mask or without it,
    combined with it when both are given); a query row whose keys are all masked gives zeros;
    no weights are computed when need_weights=False.
    Returns (output like query, weights (B, L, S) averaged or (B, H, L, S), or None).
    """
    batched = _check_mha_inputs(query, key, value, embed_dim=embed_dim_to_check, num_heads=num_heads,
                                batch_first=batch_first)
    dropout_p = _checks.probability("dropout_p", dropout_p) if training else 0.0
    proj = ProjectionWeights.gather(
        in_proj_weight=in_proj_weight, in_proj_bias=in_proj_bias, separate=use_separate_proj_weight,
        q_w=q_proj_weight, k_w=k_proj_weight, v_w=v_proj_weight, E=embed_dim_to_check, Ek=key.shape[-1],
        Ev=value.shape[-1], like=query)
    _check_output_and_kv_bias(out_proj_weight=out_proj_weight, out_proj_bias=out_proj_bias, bias_k=bias_k,
                              bias_v=bias_v, static_kv=static_k is not None or static_v is not None,
                              E=embed_dim_to_check, like=query)
    return projected_attention(
        query, key, value, proj, num_heads, bias_k=bias_k, bias_v=bias_v, static_k=static_k, static_v=static_v,
        add_zero_attn=add_zero_attn, dropout_p=dropout_p, out_proj_weight=out_proj_weight,
        out_proj_bias=out_proj_bias, key_padding_mask=key_padding_mask, need_weights=need_weights,
        attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal,
        batched=batched, batch_first=batch_first, backend=backend)


def projected_attention(query, key, value, proj: ProjectionWeights, num_heads: int, *, bias_k, bias_v,
                        add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, key_padding_mask, need_weights,
                        attn_mask, average_attn_weights, is_causal, batched, batch_first, backend,
                        static_k=None, static_v=None) -> tuple[Tensor, Tensor | None]:
    """The body of multi_head_attention_forward once its arguments are validated (the drop-in
    module calls it directly: its parameters were shaped by its constructor)."""
    is_self_attention = query is key and key is value
    return pipeline(
        query, key, value, batched=batched, batch_first=batch_first, average_attn_weights=average_attn_weights,
        project=lambda x_q, x_k, x_v: proj.heads(x_q, x_k, x_v, num_heads, is_self_attention),  # (B, H, T, D) each
        attend=functools.partial(attend, bias_k=bias_k, bias_v=bias_v, static_k=static_k, static_v=static_v,
                                 add_zero_attn=add_zero_attn, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                 is_causal=is_causal, dropout_p=dropout_p, need_weights=need_weights, batched=batched,
                                 backend=backend),
        out_proj=functools.partial(F.linear, weight=out_proj_weight, bias=out_proj_bias))


def _check_mha_inputs(query, key, value, *, embed_dim, num_heads, batch_first) -> bool:
    """Validate query/key/value; returns whether the input is batched."""
    _checks.positive_int("num_heads", num_heads)
    _checks.positive_int("embed_dim", embed_dim)
    _checks.divisible(embed_dim, num_heads)
    return check_inputs(query, key, value, query_width=("embed_dim", embed_dim),
                                  batch_first=batch_first)


def _check_output_and_kv_bias(*, out_proj_weight, out_proj_bias, bias_k, bias_v, static_kv, E, like):
    _checks.tensor("out_proj_weight", out_proj_weight)
    _checks.shape("out_proj_weight", out_proj_weight, (E, E), "(embed_dim, embed_dim)")
    if out_proj_bias is not None:
        _checks.shape("out_proj_bias", _checks.tensor("out_proj_bias", out_proj_bias), (E,))
    if (bias_k is None) != (bias_v is None):
        raise ValueError("bias_k and bias_v must be given together, got only "
                         + ("bias_k" if bias_v is None else "bias_v"))
    if bias_k is not None:
        if static_kv:
            raise _checks.ShapeError("bias cannot be added to static key (or value): bias_k/bias_v cannot be added "
                                     "to static_k/static_v; pass one or the other")
        for name, b in (("bias_k", bias_k), ("bias_v", bias_v)):
            _checks.shape(name, _checks.tensor(name, b), (1, 1, E), "(1, 1, embed_dim)")
    _checks.same_dtype_device("query", like, out_proj_weight=out_proj_weight,
                              out_proj_bias=out_proj_bias, bias_k=bias_k, bias_v=bias_v)
