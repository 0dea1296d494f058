"""transformers' mask interface, answered compactly: which keys each query sees, as a KeyMask.

A mask function, called once per forward (per mask type), says which keys each query may see.
Ours describes the common patterns without building them: a :class:`KeyMask` holds the band
(causal, a sliding window, or none), where queries sit against keys (the cache's offset) and which
keys are padding, O(B * S) memory. A pattern other than transformers' plain causal or bidirectional
one is checked pair by pair first (in blocks of rows: the work of building the mask, not its
memory). Any other pattern (packed sequences, chunked attention, a model's own mask functions), and
any model that wants its mask materialised, gets transformers' dense (B, 1, L, S) bool mask, so
that nothing is ever computed under a mask other than the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    eager_mask,
    prepare_padding_mask,
    sdpa_mask,
)

from ... import positions
from ...positions import CAUSAL, Band

__all__ = ["KeyMask", "eager_mask_forward", "mask_forward"]

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
