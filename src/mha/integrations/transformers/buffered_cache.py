"""Caches for transformers' generate whose layers grow in buffers with room:
``model.generate(ids, past_key_values=BufferedCache())``. transformers' DynamicLayer concatenates its
keys and values with each step's, a copy of the whole cache every step; a :class:`BufferedLayer`'s
keys and values are the filled slots of buffers with room for as many again, at most 256 more
(mha.kernels.storage.Room): a step writes its rows, and the filled slots are copied once each time
the room is used up. The same values as DynamicCache's, in any attention implementation; the keys and
values a layer returns are views of its buffers (strided along the heads), which mha's attention and
torch's SDPA read in place.
"""

from __future__ import annotations

from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from ...kernels import storage

__all__ = ["BufferedCache", "BufferedLayer"]


class BufferedLayer(DynamicLayer):
    """A DynamicLayer whose keys (B, Hkv, S, D) and values (B, Hkv, S, Dv) are the first S slots of
    buffers with room (mha.kernels.storage.Room: one for the keys, one for the values). What
    DynamicLayer does to its keys still holds; whatever replaces them (a crop, selecting or repeating
    the batch, offloading, another layer's tensors) is copied once into new buffers at the next
    update, never written into. Where autograd or torch.compile follows the cache (grad enabled, or
    compiling), an update concatenates as DynamicLayer's does (the buffers' in-place writes would
    change what autograd saved)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rooms = (storage.Room(), storage.Room())

    def kept(self, name: str, states: Tensor) -> Tensor:
        """The new (B, Hkv, L, X) states (``name``: key_states or value_states) as the layer keeps them:
        as they are (Int8Layer: 8-bit rows)."""
        return states

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append the new keys and values; returns the layer's whole keys and values."""
        keys, values = self.kept("key_states", key_states), self.kept("value_states", value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not storage.in_place_allowed():
            return super().update(keys, values)  # (a concatenation, which autograd and torch.compile follow)
        rooms = self.rooms
        self.keys, self.values = rooms[0].append(self.keys, keys), rooms[1].append(self.values, values)
        return self.keys, self.values

    def reset(self) -> None:
        """DynamicLayer's reset, the buffers let go too."""
        super().reset()
        self.rooms = (storage.Room(), storage.Room())


class BufferedCache(Cache):
    """A transformers Cache of :class:`BufferedLayer` layers, DynamicCache's results without its copy of
    the whole cache every step: ``model.generate(ids, past_key_values=BufferedCache())``, any attention
    implementation. Not a DynamicCache (no config: every layer keeps all its keys, a sliding one too;
    no linear-attention layers). At most twice the filled slots a layer, at most 256 more."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=BufferedLayer)
