"""8-bit keys and values in transformers' generate: ``past_key_values=Int8Cache()`` with a model loaded
with ``attn_implementation="mha"``. Each layer keeps its keys and values as every mha cache keeps
8-bit rows (mha.kernels.storage: int8 rows, each followed by its float32 (token, head) scale, in one
tensor: :class:`Int8Layer`), and the attention function reads them in place through the paged
kernel (mha.kernels.paged_attention), never dequantized as a whole. Sequences of one length (no
padding), bottom-right causal or sliding-window masks.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ... import _checks
from ...kernels import storage
from ...kernels.contract import from_keywords
from ...kernels.paged import batch_paged_attention
from ...positions import CAUSAL, Band
from .buffered_cache import BufferedLayer
from .masks import KeyMask

__all__ = ["Int8Cache", "Int8Layer", "int8_attention"]


class Int8Layer(BufferedLayer):
    """One layer of :class:`Int8Cache`: keys (B, Hkv, S, D + 4) and values (B, Hkv, S, Dv + 4) int8,
    each row's D values quantized (mha.kernels.quantize.quantize_int8) followed by the bytes of its
    float32 scale (mha.kernels.storage), in buffers with room as a BufferedLayer's. Rows and scales in
    one tensor, so every operation transformers' DynamicLayer does on its keys (appending, cropping,
    selecting or repeating the batch, offloading) keeps them together."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = torch.int8
        self.keys, self.values = self.keys.to(torch.int8), self.values.to(torch.int8)

    def kept(self, name: str, states: Tensor) -> Tensor:
        """The new (B, Hkv, L, X) floating states quantized: (B, Hkv, L, X + 4) int8, rows then scales,
        which only mha's attention function reads."""
        _checks.rank(name, _checks.floating(name, states), (4,), "(batch, kv heads, length, head_dim)")
        return storage.store(states, True)


class Int8Cache(Cache):
    """transformers' Cache with 8-bit keys and values, for models with ``attn_implementation="mha"``:
    ``model.generate(ids, past_key_values=Int8Cache())``. About 0.52x a bfloat16 cache's bytes at a
    head dim of 128 (0.27x float32's), plus a BufferedLayer's room (at most as many slots again, and 256);
    attention reads the int8 rows in place (module docstring)."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=Int8Layer)


def int8_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *, scaling, softcap, s_aux,
                    dropout, position_bias, output_attentions) -> tuple[Tensor, None]:
    """attention_forward over an Int8Cache: each sequence's rows attend bottom-right over its keys, read
    in place as one page of mha.kernels.paged_attention."""
    _checks.rank("query", _checks.floating("query", query), (4,), "(batch, heads, length, head_dim)")
    if value.dtype != torch.int8:
        raise TypeError(f"key is int8 (an Int8Cache's) but value is {value.dtype}: both come from the same cache")
    B, H, L, S = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    if (module.training and dropout) or output_attentions or position_bias is not None:
        raise ValueError("an Int8Cache serves inference: no dropout, no output_attentions, no position_bias")
    if (key.dim() != 4 or value.dim() != 4 or key.shape[0] != B or key.shape[-1] != query.shape[-1] + storage.SCALE_BYTES
            or value.shape[:3] != key.shape[:3] or value.shape[-1] <= storage.SCALE_BYTES):
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} int8 do not fit query "
                         f"{tuple(query.shape)}: an Int8Cache keeps (batch, kv heads, length, head_dim + "
                         f"{storage.SCALE_BYTES}), each row then its scale (mha.kernels.storage)")
    contract = from_keywords(query, H, band=_int8_band(attention_mask, module, L=L, S=S), scale=scaling, softcap=softcap,
                             sinks=s_aux, head_dim="1", names={"scale": "scaling", "sinks": "s_aux"})
    out = batch_paged_attention(query, key, value, contract)  # the rows and their scales read where they lie
    return out.transpose(1, 2).contiguous(), None  # (B, H, L, Dv) -> (B, L, H, Dv)


def _int8_band(attention_mask, module, *, L: int, S: int) -> Band | None:
    """The band of an Int8Cache's attention: its queries are the last L of S positions (bottom-right)."""
    if attention_mask is None:
        causal = getattr(module, "is_causal", True)
        return CAUSAL if causal else None
    if not isinstance(attention_mask, KeyMask):
        raise ValueError("an Int8Cache reads mha's compact masks only (register() with compact_masks=True, the "
                         f"default), got a {type(attention_mask).__name__} mask")
    if attention_mask.key_valid is not None:
        raise ValueError("an Int8Cache serves sequences of one length: this batch has padding keys (attention_mask); "
                         "generate them one at a time, or use transformers' continuous batching (generate_batch)")
    if (attention_mask.L, attention_mask.S) != (L, S) or attention_mask.offset != S - L:
        raise ValueError(f"an Int8Cache's queries are the last of its keys, but the mask puts {attention_mask.L} "
                         f"queries at offset {attention_mask.offset} over {attention_mask.S} keys (the layer has "
                         f"{L} over {S})")
    return attention_mask.band
