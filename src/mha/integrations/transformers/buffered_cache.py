"""Caches for transformers' generate whose layers grow in buffers with room:
``model.generate(ids, past_key_values=BufferedCache())``. transformers' DynamicLayer concatenates its
keys and values with each step's, a copy of the whole cache every step; a :class:`BufferedLayer`'s
keys and values are the filled slots of buffers with room for up to 256 more
(mha.kernels.storage.append): a step writes its rows, and the filled slots are copied once each time
the room is used up. The same values as DynamicCache's, in any attention implementation; the keys and
values a layer returns are views of its buffers (strided along the heads), which mha's attention and
torch's SDPA read in place.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from ...kernels import storage

__all__ = ["BufferedCache", "BufferedLayer"]


class BufferedLayer(DynamicLayer):
    """A DynamicLayer whose keys (B, Hkv, S, D) and values (B, Hkv, S, Dv) are the first S slots of
    buffers with room (mha.kernels.storage.append). What DynamicLayer does to its keys still holds: a
    crop keeps the buffers (the next rows continue after it); selecting or repeating the batch (beam
    search) or offloading makes new tensors, which the next update copies once into buffers of their
    own. Where autograd is to follow the cache (grad enabled and a tensor that requires it), an update
    concatenates as DynamicLayer does."""

    def kept(self, name: str, states: Tensor) -> Tensor:
        """The new (B, Hkv, L, X) states (``name``: key_states or value_states) as the layer keeps them:
        as they are (Int8Layer: 8-bit rows)."""
        return states

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append the new keys and values; returns the layer's whole keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.kept("key_states", key_states), self.kept("value_states", value_states)
        if torch.is_grad_enabled() and any(x.requires_grad for x in (keys, values, self.keys, self.values)):
            return super().update(keys, values)  # (a concatenation, which autograd follows)
        self.keys, self.values = storage.append(self.keys, keys), storage.append(self.values, values)
        return self.keys, self.values


class BufferedCache(Cache):
    """transformers' DynamicCache with :class:`BufferedLayer` layers: ``model.generate(ids,
    past_key_values=BufferedCache())``, any attention implementation. Up to 256 slots a layer more than
    the filled ones."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=BufferedLayer)
