"""attn_implementation="mha": mha's exact attention inside HuggingFace transformers models.

    import mha.integrations.transformers
    mha.integrations.transformers.register()          # once per process
    model = AutoModel.from_pretrained(path, attn_implementation="mha")
    model.set_attn_implementation("mha")              # or switch a loaded model

transformers (5.x) asks two functions of an attention implementation, both registered here:

* a mask function, called once per forward (per mask type), that says which keys each query may
  see. Ours describes the common patterns without building them: a :class:`KeyMask` holds the
  band (causal, a sliding window, or none), where queries sit against keys (the cache's offset) and
  which keys are padding, O(B * S) memory. A pattern other than transformers' plain causal or
  bidirectional one is checked pair by pair first (in blocks of rows: the work of building the
  mask, not its memory). Any other pattern (packed sequences, chunked attention, a model's own mask
  functions), and any model that wants its mask materialised, gets transformers' dense
  (B, 1, L, S) bool mask, so that nothing is ever computed under a mask other than the model's.
* an attention function, called by every attention layer with q (B, H, L, D), k and v
  (B, Hkv, S, D|Dv): it runs mha's dispatch (mha.kernels.attention) under one attention contract
  built from the mask and the layer's arguments, and returns (B, L, H, Dv) as transformers expects.

Honoured: the mask (ours, a dense 4-D bool or float mask, or none with ``is_causal``), scaling,
dropout (in training mode only, as eager attention), GQA (num_key_value_groups), sliding windows
and chunk-free causal or bidirectional patterns, logit soft-capping (``softcap``, Gemma 2),
attention sinks (``s_aux``, GPT-OSS), a position bias (``position_bias``, added to the scores) and
``output_attentions`` (the weights, from the math backend). Continuous batching (generate_batch)
runs under its own name, "mha_flash": :func:`enable_continuous_batching` (below). A model that
reads or extends its mask itself (rare: a KeyMask then says so) runs with
``register(name, compact_masks=False)``: transformers' eager masks, mha's attention.

8-bit keys and values in ``generate``: pass ``past_key_values=Int8Cache()`` to a model loaded with
``attn_implementation="mha"``. Each layer keeps its keys and values as int8 rows with their float32
(token, head) scales beside them in the same tensor (:class:`Int8Layer`), and the attention function
reads them in place through the native paged kernel (mha.kernels.paged_attention), never dequantized
as a whole. Sequences of one length (no padding), bottom-right causal or sliding-window masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _checks, kernels, masks, positions
from ..kernels.contract import contract_of
from ..kernels.paged import batch_paged_attention
from ..kernels.quantize import quantize_int8
from ..positions import CAUSAL, Band

try:
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, DynamicLayer
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        eager_mask,
        prepare_padding_mask,
        sdpa_mask,
    )
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("mha.integrations.transformers needs transformers: "
                      "python -m pip install -c constraints.txt -e '.[hf]'") from error

__all__ = ["ContinuousBatching", "Int8Cache", "Int8Layer", "KeyMask", "attention_forward", "continuous_batching_forward",
           "eager_mask_forward", "enable_continuous_batching", "mask_forward", "register"]

_VERIFY_ELEMENTS = 1 << 22  # the mask pattern is checked in blocks of at most this many (b, q, kv)


@dataclass(frozen=True, eq=False)
class KeyMask:
    """Which keys each query sees, in O(B * S): what :func:`mask_forward` hands the layers.

    band:       mha.positions.Band of visible distances (key position - query position), or None
    offset:     query i sits at position i + offset, key j at j (transformers' q_offset - kv_offset)
    key_valid:  (B, S) bool, False where a key is padding, or None
    L, S:       the query and key lengths it describes (the attention function checks them)

    It is not a tensor: it goes only where transformers' sdpa may pass no mask at all (the model
    allows the mask to be skipped), so only the attention function reads it. A model that reads
    or extends its mask anyway is told so (AttributeError / TypeError naming the way out:
    ``register(name, compact_masks=False)``).
    """
    band: Band | None
    offset: int
    key_valid: Tensor | None
    L: int
    S: int

    # generate() builds the masks of a static (compileable) cache ahead of the forward, calls
    # .contiguous() on them and hands them back to the model, which passes on a prepared 4-D mask
    # as it is (transformers reads .ndim to tell): a KeyMask does the same, unchanged.
    ndim = 4

    def contiguous(self) -> KeyMask:
        return self

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and friends probe for these
            raise AttributeError(name)
        raise AttributeError(_NOT_A_TENSOR.format(f".{name}"))

    def __getitem__(self, index):
        raise TypeError(_NOT_A_TENSOR.format("indexing"))

    def __repr__(self) -> str:
        valid = None if self.key_valid is None else f"<{tuple(self.key_valid.shape)} bool>"
        return f"KeyMask(band={self.band}, offset={self.offset}, key_valid={valid}, L={self.L}, S={self.S})"


_DENSE_ADVICE = "register mha with dense masks for it: mha.integrations.transformers.register(name, compact_masks=False)"
_NOT_A_TENSOR = "this model uses its attention mask itself ({}), but mha's compact mask (KeyMask) is not a tensor; " \
    + _DENSE_ADVICE


def register(name: str = "mha", *, compact_masks: bool = True) -> None:
    """Register mha's attention and mask functions with transformers under ``name``; afterwards
    ``from_pretrained(..., attn_implementation=name)`` and ``model.set_attn_implementation(name)``
    use them. Registering again under the same name replaces the choice of masks.

    compact_masks: True, masks as :class:`KeyMask` (O(B * S)) wherever the model lets them be
    skipped; False, always transformers' eager mask (dense (B, 1, L, S) float), for a model that
    reads or extends its mask itself.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    _checks.flag("compact_masks", compact_masks)
    registered = AttentionInterface._global_mapping.get(name)
    if registered is not None and registered is not attention_forward:
        raise ValueError(f"name {name!r} is already an attn_implementation of transformers "
                         f"({getattr(registered, '__name__', registered)}); choose another name")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward if compact_masks else eager_mask_forward)


# ---------------------------------------------------------------------------------------------
# the mask function
# ---------------------------------------------------------------------------------------------


def mask_forward(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                 mask_function=causal_mask_function, attention_mask: Tensor | None = None,
                 local_size: int | None = None, use_vmap: bool = False, allow_is_causal_skip: bool = True,
                 allow_is_bidirectional_skip: bool = False, device="cpu", **kwargs):
    """transformers' mask interface: a :class:`KeyMask` when the model lets its mask be skipped
    and the pattern is causal, bidirectional or a sliding window (recognised, or checked exactly
    on every (query, key) pair), else transformers' dense (B, 1, L, S) bool mask (True = attend).
    ``attention_mask`` is the 2-D padding mask (B, past + L), True/1 = a real token."""
    if isinstance(attention_mask, KeyMask):  # built ahead by generate() (see KeyMask.ndim)
        return attention_mask
    # Not compact: a model that wants its mask materialised (to read or extend it), a model's own
    # or/and mask functions (use_vmap: not index-broadcastable), offsets as tensors (compiled code).
    if ((allow_is_causal_skip or allow_is_bidirectional_skip) and not use_vmap
            and not isinstance(q_offset, Tensor) and not isinstance(kv_offset, Tensor)):
        band = _band_of(mask_function, local_size, batch_size, q_length, kv_length, q_offset, kv_offset, device)
        if band is not _NO_BAND:
            offset = positions.offset_between(q_offset, kv_offset)
            return KeyMask(positions.needed(band, q_length, kv_length, offset), offset,
                           _key_valid(attention_mask, kv_length, kv_offset), q_length, kv_length)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, use_vmap=use_vmap, allow_is_causal_skip=False,
                     allow_is_bidirectional_skip=False, device=device, **kwargs)


def eager_mask_forward(**arguments) -> Tensor:
    """transformers' eager mask, always materialised: (B, 1, L, S) float, 0 = attend, the dtype's
    minimum = not (the mask function of register(compact_masks=False): the form models that
    extend their masks with biases of their own expect)."""
    return eager_mask(**{**arguments, "allow_is_bidirectional_skip": False})


_NO_BAND = object()  # the pattern is not a band: build the dense mask


def _band_of(mask_function, local_size, batch_size, q_length, kv_length, q_offset, kv_offset, device):
    """The Band (or None: every key) that ``mask_function`` draws, or _NO_BAND. transformers'
    two plain patterns are known by identity; anything else is compared, pair by pair, with the
    bands it could be: causal or none, or with ``local_size`` W a causal window of W keys
    (transformers' sliding_window_causal_mask_function) or |distance| <= W (its bidirectional one)."""
    if mask_function is causal_mask_function:
        return CAUSAL
    if mask_function is bidirectional_mask_function:
        return None
    candidates = [CAUSAL, None] if local_size is None else [Band(local_size - 1, 0), Band(local_size, local_size)]
    kv = torch.arange(kv_length, device=device) + kv_offset  # (S,) key positions
    batch = torch.arange(batch_size, device=device)[:, None, None, None]  # (B, 1, 1, 1)
    head = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    rows = max(1, _VERIFY_ELEMENTS // max(1, batch_size * kv_length))
    for start in range(0, q_length, rows):
        q = torch.arange(start, min(start + rows, q_length), device=device) + q_offset  # (r,) query positions
        drawn = torch.as_tensor(mask_function(batch, head, q[None, None, :, None], kv[None, None, None, :]))
        drawn = drawn.expand(batch_size, 1, len(q), kv_length)  # (B, 1, r, S)
        offset = positions.offset_between(start + q_offset, kv_offset)  # of this block's first query
        candidates = [band for band in candidates if _draws(drawn, band, offset)]
        if not candidates:
            return _NO_BAND
    return candidates[0]


def _draws(drawn: Tensor, band: Band | None, offset: int) -> bool:
    """Whether the (B, 1, r, S) bool ``drawn`` is the band's pattern (None: every key)."""
    if band is None:
        return bool(drawn.all())
    return torch.equal(drawn, band.visible(*drawn.shape[-2:], offset, drawn.device).expand(drawn.shape))


def _key_valid(attention_mask: Tensor | None, kv_length: int, kv_offset: int) -> Tensor | None:
    """The 2-D padding mask's part for these keys as bool (B, S), or None when no key is padding."""
    if attention_mask is None:
        return None
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)  # (B, >= kv_offset + S)
    valid = padding[:, kv_offset:kv_offset + kv_length].bool()  # (B, S)
    return None if bool(valid.all()) else valid


# ---------------------------------------------------------------------------------------------
# the attention function
# ---------------------------------------------------------------------------------------------


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: KeyMask | Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, *,
                      softcap: float | None = None, s_aux: Tensor | None = None,
                      position_bias: Tensor | None = None, output_attentions: bool = False,
                      cache=None, **kwargs) -> tuple[Tensor, Tensor | None]:
    """transformers' attention interface: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) ->
    (output (B, L, H, Dv), weights (B, H, L, S) with output_attentions, else None).

    The mask decides which keys each query sees (a sliding_window argument is already in it, as
    for transformers' sdpa and eager); without a mask, ``is_causal`` (else ``module.is_causal``,
    default True) makes it causal, top-left aligned as in transformers' sdpa. Other keyword
    arguments (position_ids, cache_position, ...) carry nothing the attention needs.
    """
    if cache is not None:
        raise ValueError("attn_implementation 'mha' takes no paged cache: for continuous batching (generate_batch) "
                         "call mha.integrations.transformers.enable_continuous_batching(model)")
    if key.dtype == torch.int8:  # an Int8Cache's rows and scales
        return _int8_attention(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, s_aux=s_aux,
                               dropout=dropout, position_bias=position_bias, output_attentions=output_attentions)
    _check_qkv(query, key, value)
    B, H, L, S = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    contract = contract_of(
        **_mask_terms(attention_mask, position_bias, module, is_causal, B=B, H=H, L=L, S=S, like=query),
        scale=_checks.optional_finite_real("scaling", scaling), softcap=_checks.optional_positive_real("softcap", softcap),
        sinks=_checks.per_head("s_aux", s_aux, H, query, "(num_heads,): one sink logit per query head"))
    dropout_p = _checks.probability("dropout", dropout) if module.training else 0.0
    out, weights = kernels.attention(query, key, value, contract, dropout_p=dropout_p,
                                     need_weights=bool(output_attentions))
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


# ---------------------------------------------------------------------------------------------
# 8-bit keys and values (Int8Cache)
# ---------------------------------------------------------------------------------------------

_SCALE_BYTES = 4  # a float32 scale, stored as four int8 after its row


class Int8Layer(DynamicLayer):
    """One layer of :class:`Int8Cache`: keys (B, Hkv, S, D + 4) and values (B, Hkv, S, Dv + 4) int8,
    each row's D values quantized (mha.kernels.quantize.quantize_int8) followed by the bytes of its
    float32 scale. Rows and scales in one tensor, so every operation transformers' DynamicLayer
    does on its keys (appending, cropping, selecting or repeating the batch, offloading) keeps them
    together."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = torch.int8
        self.keys, self.values = self.keys.to(torch.int8), self.values.to(torch.int8)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Quantize the new (B, Hkv, L, D|Dv) keys and values and append them; returns the whole cache
        (int8, rows then scales), which only mha's attention function reads."""
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            _checks.rank(name, _checks.floating(name, x), (4,), "(batch, kv heads, length, head_dim)")
        return super().update(_with_scales(key_states), _with_scales(value_states))


class Int8Cache(Cache):
    """transformers' Cache with 8-bit keys and values, for models with ``attn_implementation="mha"``:
    ``model.generate(ids, past_key_values=Int8Cache())``. About 0.52x a bfloat16 cache's bytes at a
    head dim of 128 (0.27x float32's); attention reads the int8 rows in place (module docstring)."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=Int8Layer)


def _with_scales(x: Tensor) -> Tensor:
    """x (B, Hkv, L, D) floating -> (B, Hkv, L, D + 4) int8: each row's int8 values, then its scale's bytes."""
    data, scales = quantize_int8(x)  # (B, Hkv, L, D) int8, (B, Hkv, L) float32
    return torch.cat([data, scales[..., None].view(torch.int8)], dim=-1)  # (B, Hkv, L, 1) float32 -> (B, Hkv, L, 4) int8


def _rows_and_scales(name: str, x: Tensor) -> tuple[Tensor, Tensor]:
    """An Int8Layer's (B, Hkv, S, X + 4) int8 -> its rows (B, Hkv, S, X) int8 (a view) and scales (B, Hkv, S) float32."""
    if x.dim() != 4 or x.shape[-1] <= _SCALE_BYTES:
        raise ValueError(f"{name} is int8 {tuple(x.shape)}: mha reads int8 keys and values only as an Int8Cache "
                         f"stores them, (batch, kv heads, length, head_dim + {_SCALE_BYTES})")
    width = x.shape[-1] - _SCALE_BYTES
    scale_bytes = x[..., width:]  # (B, Hkv, S, 4)
    if width % _SCALE_BYTES or x.stride(-1) != 1 or x.storage_offset() % _SCALE_BYTES:
        scale_bytes = scale_bytes.contiguous()  # (a view as float32 needs its strides in whole floats)
    return x[..., :width], scale_bytes.view(torch.float32)[..., 0]  # (B, Hkv, S, 1) float32 -> (B, Hkv, S)


def _int8_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *, scaling, softcap, s_aux,
                    dropout, position_bias, output_attentions) -> tuple[Tensor, None]:
    """attention_forward over an Int8Cache: each sequence's rows attend bottom-right over its keys, read
    in place as one page of mha.kernels.paged_attention."""
    _checks.rank("query", _checks.floating("query", query), (4,), "(batch, heads, length, head_dim)")
    if value.dtype != torch.int8:
        raise TypeError(f"key is int8 (an Int8Cache's) but value is {value.dtype}: both come from the same cache")
    (k8, k_scales), (v8, v_scales) = _rows_and_scales("key", key), _rows_and_scales("value", value)
    B, H, L, S = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    if (module.training and dropout) or output_attentions or position_bias is not None:
        raise ValueError("an Int8Cache serves inference: no dropout, no output_attentions, no position_bias")
    if k8.shape[0] != B or k8.shape[-1] != query.shape[-1] or v8.shape[:3] != k8.shape[:3]:
        raise ValueError(f"key {tuple(k8.shape)} and value {tuple(v8.shape)} (without their scales) do not fit "
                         f"query {tuple(query.shape)}")
    band = _int8_band(attention_mask, module, L=L, S=S)
    window = None if band is None else tuple(-1 if side is None else side for side in (band.left, band.right))
    out = batch_paged_attention(
        query, k8, v8, is_causal=False, window=window, scale=_checks.optional_finite_real("scaling", scaling),
        softcap=_checks.optional_positive_real("softcap", softcap), k_scales=k_scales, v_scales=v_scales,
        sinks=_checks.per_head("s_aux", s_aux, H, query, "(num_heads,): one sink logit per query head"))
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


# ---------------------------------------------------------------------------------------------
# continuous batching (generate_batch, ContinuousBatchingManager)
# ---------------------------------------------------------------------------------------------

CONTINUOUS_BATCHING_NAME = "mha_flash"
_KNOWN_CONTINUOUS_BATCHING = ("5.",)  # transformers versions whose continuous batching this follows


class ContinuousBatching:
    """What :func:`enable_continuous_batching` changed, and :meth:`undo` to change it back (also a
    context manager: ``with enable_continuous_batching(model): model.generate_batch(...)``)."""

    def __init__(self, model, name: str, original: str | None, previous_loaded, registered: bool, listed: bool):
        self.model, self.name = model, name
        self._original, self._previous_loaded, self._registered, self._listed = original, previous_loaded, registered, listed

    def undo(self) -> None:
        """The model's attention implementation, transformers' flash state and its registries as before."""
        from transformers import modeling_flash_attention_utils as flash_utils

        if self.model.config._attn_implementation == self.name and self._original is not None:
            self.model.set_attn_implementation(self._original)
        if self._listed:
            del self.model._compatible_flash_implementations  # the class's own list again
        if flash_utils._loaded_implementation == self.name:
            flash_utils._loaded_implementation = self._previous_loaded
        if self._registered:
            for mapping in (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping):
                mapping.pop(self.name, None)

    def __enter__(self) -> ContinuousBatching:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def enable_continuous_batching(model, name: str = CONTINUOUS_BATCHING_NAME) -> ContinuousBatching:
    """Let transformers' continuous batching (``model.generate_batch``, ``init_continuous_batching``)
    run ``model``'s attention on mha. It switches the model to the implementation ``name`` (which
    must contain "flash": continuous batching takes only "paged|eager", "sdpa" and flash ones).

    An explicit, reversible call (:meth:`ContinuousBatching.undo`, or a ``with`` block): it registers
    :func:`continuous_batching_forward` and transformers' flash mask function under ``name``; marks
    ``name`` as the flash implementation transformers has loaded
    (``transformers.modeling_flash_attention_utils._loaded_implementation``), so that switching to it
    does not look for a flash kernel on the model hub; and where the model's class lists the flash
    implementations it accepts (``_compatible_flash_implementations``, GPT-OSS), lists ``name`` on
    this model. Refused on a transformers whose continuous batching it does not know."""
    import transformers
    from transformers import modeling_flash_attention_utils as flash_utils
    from transformers.masking_utils import flash_attention_mask

    if not isinstance(name, str) or "flash" not in name or "/" in name:
        raise ValueError(f"name must be a str containing 'flash' (transformers' continuous batching takes only flash "
                         f"implementations besides sdpa and paged|eager) and no '/', got {name!r}")
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if (not transformers.__version__.startswith(_KNOWN_CONTINUOUS_BATCHING)
            or not hasattr(flash_utils, "_loaded_implementation")):
        raise RuntimeError(f"mha's continuous batching follows transformers {', '.join(_KNOWN_CONTINUOUS_BATCHING)}x "
                           f"(its flash-implementation state), not {transformers.__version__}: use "
                           "attn_implementation='sdpa' with generate_batch there")
    registered = name not in AttentionInterface._global_mapping
    AttentionInterface.register(name, continuous_batching_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    compatible = getattr(model, "_compatible_flash_implementations", None)
    listed = compatible is not None and name not in compatible
    if listed:
        model._compatible_flash_implementations = [*compatible, name]
    handle = ContinuousBatching(model, name, model.config._attn_implementation, flash_utils._loaded_implementation,
                                registered, listed)
    flash_utils._loaded_implementation = name
    try:
        model.set_attn_implementation(name)
    except Exception:
        handle.undo()
        raise
    return handle


def continuous_batching_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                attention_mask=None, dropout: float = 0.0, scaling: float | None = None,
                                sliding_window: int | None = None, softcap: float | None = None,
                                is_causal: bool | None = None, s_aux: Tensor | None = None, cache=None,
                                **kwargs) -> tuple[Tensor, None]:
    """The attention of one continuous-batching step: q (1, H, T, D) holds every scheduled
    sequence's new rows packed (transformers' cu_seq_lens_q), k and v (1, Hkv, T, D) their new keys,
    which go into transformers' paged cache beside each sequence's cached keys (cu_seq_lens_k). One
    call of mha.kernels.paged_attention over them (:func:`_sequence_keys`: read in place where the
    cache allows it): causal bottom-right within each sequence, the layer's sliding window
    (flash-attn's: the last ``sliding_window`` keys), softcap (Gemma 2), sinks (``s_aux``, GPT-OSS),
    GQA and scaling. Returns (1, T, H, Dv)."""
    from transformers.generation.continuous_batching import PagedAttentionCache

    if not isinstance(cache, PagedAttentionCache):
        raise ValueError(f"attn_implementation {CONTINUOUS_BATCHING_NAME!r} serves continuous batching "
                         "(generate_batch) only; use attn_implementation='mha' for other calls")
    if kwargs.get("output_attentions"):
        raise ValueError("continuous batching returns no attention weights (output_attentions)")
    k_pages, v_pages, table, lengths_k = _sequence_keys(cache, module.layer_idx, key, value, kwargs)
    window = None if sliding_window is None else (sliding_window - 1, 0)
    sinks = None if s_aux is None else s_aux.to(query.dtype)
    q = query[0].transpose(0, 1)  # (1, H, T, D) -> (T, H, D)
    out = kernels.paged_attention(q, k_pages, v_pages, table, kwargs["cu_seq_lens_q"], lengths_k,
                                  window=window, alibi_slopes=None, softcap=softcap, sinks=sinks, scale=scaling)
    return out[None], None  # (T, H, Dv) -> (1, T, H, Dv)


def _sequence_keys(cache, layer_idx: int, key: Tensor, value: Tensor, kwargs: dict):
    """The step's new keys stored, and each sequence's keys as pages of one slot: (k_pages (N, Hkv, 1, D),
    v_pages, block_table (B, longest) of slots, -1 past a sequence's keys, lengths_k (B,)).

    A full-attention layer's cache is read where it lies: the new keys written through the step's
    write_index (as ``cache.update`` does), then each sequence's keys named by its read_index: tokens
    of the cache, consecutive within a transformers page (read by the kernel as one run). A sliding
    layer's cache is a ring whose new keys may overwrite old ones the step still reads, so there the
    keys come gathered by ``cache.update`` (a copy: measured in docs/serving.md)."""
    allocator = getattr(cache, "layer_to_allocator", {}).get(layer_idx)
    if _reads_in_place(allocator, kwargs):
        k_cache, v_cache = allocator._kv_token_views[layer_idx]  # (tokens, Hkv, D): token i of v is key i's value
        tokens = min(len(k_cache), len(v_cache))  # v's view starts a page later
        k_cache, v_cache = k_cache[:tokens], v_cache[:tokens]
        write, read = kwargs["write_index"][allocator.index], kwargs["read_index"][allocator.index]
        cu_k = kwargs["cu_seq_lens_k"][allocator.layer_type]
        new_k, new_v = (x[0].transpose(0, 1) for x in (key, value))  # (1, Hkv, T, D) -> (T, Hkv, D)
        k_cache.index_copy_(0, write, new_k)
        v_cache.index_copy_(0, write, new_v)
        if read.numel():  # else every sequence is a whole prefill: its keys are the new ones
            return _one_slot_pages(k_cache, v_cache, cu_k, read)
        return _one_slot_pages(new_k, new_v, cu_k)
    key, value = cache.update(key_states=key, value_states=value, layer_idx=layer_idx, kwargs=kwargs)
    k, v = (x[0].transpose(0, 1) for x in (key, value))  # (1, Hkv, S, D) -> (S, Hkv, D)
    return _one_slot_pages(k, v, kwargs["cu_seq_lens_k"])


def _reads_in_place(allocator, kwargs: dict) -> bool:
    """Whether transformers' cache of this layer is one whose keys mha reads in place (its full-attention
    allocator, index-based steps: the block-table path is CUDA flash's)."""
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    return (type(allocator) is FullAttentionCacheAllocator and kwargs.get("block_table") is None
            and hasattr(allocator, "_kv_token_views") and "read_index" in kwargs and "write_index" in kwargs)


def _one_slot_pages(k: Tensor, v: Tensor, cu_k: Tensor, tokens: Tensor | None = None):
    """k, v (N, Hkv, D) as pages of one slot, and the block table of sequence b's keys: the rows
    tokens[cu_k[b]:cu_k[b + 1]] of k (tokens None: the rows themselves)."""
    cu_k = cu_k.to(device="cpu", dtype=torch.int64)
    lengths_k = cu_k.diff()
    slots = torch.arange(int(lengths_k.max()) if len(lengths_k) else 0)
    at = slots[None] + cu_k[:-1, None]  # (B, longest): the packed position of each sequence's key j
    valid = slots[None] < lengths_k[:, None]
    rows = at if tokens is None else tokens.to(device="cpu", dtype=torch.int64)[at.clamp(max=max(len(tokens) - 1, 0))]
    table = torch.where(valid, rows, -1)
    return k[:, :, None], v[:, :, None], table, lengths_k  # (N, Hkv, D) -> (N, Hkv, 1, D)
