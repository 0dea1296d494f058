"""transformers' attention interface: each attention layer's call, run by mha's dispatch under
one contract built from the mask and the layer's arguments.

Honoured: the mask (a KeyMask, a dense 4-D bool or float mask, or none with ``is_causal``),
scaling, dropout (in training mode only, as eager attention), GQA (num_key_value_groups), sliding
windows, logit soft-capping (``softcap``, Gemma 2), attention sinks (``s_aux``, GPT-OSS), a
position bias (``position_bias``, added to the scores) and the attention weights (from the math
backend) when transformers asks for them: ``output_attentions`` passed on, or recorded by the
model's hooks (GPT-2 takes the flag itself). An Int8Cache's keys go to int8_cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _checks, kernels, masks
from ...kernels import dispatch
from ...kernels.contract import from_keywords
from ...positions import CAUSAL
from . import compat
from .int8_cache import int8_attention
from .masks import _DENSE_ADVICE, KeyMask

__all__ = ["attention_forward"]


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: KeyMask | Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, *,
                      softcap: float | None = None, s_aux: Tensor | None = None,
                      position_bias: Tensor | None = None, output_attentions: bool = False,
                      cache=None, **kwargs) -> tuple[Tensor, Tensor | None]:
    """transformers' attention interface: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) ->
    (output (B, L, H, Dv), weights (B, H, L, S) when transformers asks for them, else None).

    The mask decides which keys each query sees (a sliding_window argument is already in it, as
    for transformers' sdpa and eager); without a mask, ``is_causal`` (else ``module.is_causal``,
    default True) makes it causal, top-left aligned as in transformers' sdpa. Other keyword
    arguments (position_ids, cache_position, ...) carry nothing the attention needs.
    """
    if cache is not None:
        raise ValueError("attn_implementation 'mha' takes no paged cache: for continuous batching (generate_batch) "
                         "call mha.integrations.transformers.enable_continuous_batching(model)")
    need_weights = bool(output_attentions) or compat.attentions_recorded()  # (GPT-2 takes the flag itself)
    if key.dtype == torch.int8:  # an Int8Cache's rows and scales
        return int8_attention(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, s_aux=s_aux,
                              dropout=dropout, position_bias=position_bias, output_attentions=need_weights)
    plain = query.__class__ is key.__class__ is value.__class__ is Tensor and query.dim() == key.dim() == value.dim() == 4
    if not plain:
        _check_qkv(query, key, value)  # (before their shapes are read)
    B, H, L, S = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    terms = _mask_terms(attention_mask, position_bias, module, is_causal, B=B, H=H, L=L, S=S, like=query)
    if (plain and not need_weights and softcap is None and s_aux is None and not (module.training and dropout)
            and terms.get("key_valid") is None and terms.get("mask") is None
            and (out := dispatch.plain_attention(query, key, value, band=terms.get("band"),
                                                 offset=terms.get("offset", 0), scale=scaling)) is not None):
        # torch's call takes it as it is (most decoding steps and unpadded prompts): the per-call fast path,
        # where the contract's construction and dispatch cost a decoding step's attention as much again;
        # torch's call takes only what _check_qkv passes (one floating dtype and device, shapes that fit)
        return out.transpose(1, 2).contiguous(), None  # (B, H, L, Dv) -> (B, L, H, Dv)
    if plain:
        _check_qkv(query, key, value)
    contract = from_keywords(query, H, scale=scaling, softcap=softcap, sinks=s_aux, head_dim="1",
                             names={"scale": "scaling", "sinks": "s_aux"},
                             **terms)
    dropout_p = _checks.probability("dropout", dropout) if module.training else 0.0
    out, weights = kernels.attention(query, key, value, contract, dropout_p=dropout_p, need_weights=need_weights)
    return out.transpose(1, 2).contiguous(), weights  # (B, H, L, Dv) -> (B, L, H, Dv)


def _check_qkv(query: Tensor, key: Tensor, value: Tensor) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.floating(name, x)
        _checks.rank(name, x, (4,), "(batch, heads, length, head_dim)")
    _checks.same_dtype_device("query", query, key=key, value=value)
    if key.shape[:3] != value.shape[:3] or key.shape[0] != query.shape[0] or key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} do not fit query "
                         f"{tuple(query.shape)}: expected key (B, Hkv, S, D) and value (B, Hkv, S, Dv)")
    _checks.shared_heads(query.shape[1], "key", key.shape[1], dim=1)


def _mask_terms(attention_mask, position_bias, module, is_causal, *, B, H, L, S, like) -> dict:
    """The contract's band, offset, key_valid and mask from transformers' mask and position bias."""
    if isinstance(attention_mask, KeyMask):
        if (attention_mask.L, attention_mask.S) != (L, S):
            raise ValueError(f"the mask describes {attention_mask.L} queries and {attention_mask.S} keys, the layer "
                             f"has {L} and {S}: the model changed them after building its mask, which mha's compact "
                             f"mask (KeyMask) cannot follow; {_DENSE_ADVICE}")
        terms = {"band": attention_mask.band, "offset": attention_mask.offset, "key_valid": attention_mask.key_valid}
    elif attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        terms = {"band": CAUSAL if causal and L > 1 else None}
    elif isinstance(attention_mask, Tensor):
        terms = {"mask": masks.from_sdpa(attention_mask, L=L, S=S, batch_shape=(B, H), like=like)}
    else:
        raise TypeError(f"attention_mask must be an mha KeyMask, a tensor or None, got {type(attention_mask).__name__}")
    if position_bias is not None:
        bias = masks.from_sdpa(_checks.floating("position_bias", position_bias), L=L, S=S, batch_shape=(B, H), like=like)
        terms["mask"] = bias if terms.get("mask") is None else masks.as_additive(terms["mask"], True, bias.dtype) + bias
    return terms
