"""transformers' continuous batching (``model.generate_batch``, ``init_continuous_batching``) on mha's
paged attention: :func:`enable_continuous_batching` registers :func:`continuous_batching_forward`
under a name transformers takes for a flash implementation (its continuous batching accepts only
"paged|eager", "sdpa" and flash ones), and each step attends over transformers' paged cache,
read in place where the cache allows it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ...kernels.contract import from_keywords
from ...kernels.paged import attend_pages
from . import compat

__all__ = ["CONTINUOUS_BATCHING_NAME", "ContinuousBatching", "continuous_batching_forward", "enable_continuous_batching"]

CONTINUOUS_BATCHING_NAME = "mha_flash"


class ContinuousBatching:
    """What :func:`enable_continuous_batching` changed, and :meth:`undo` to change it back (also a
    context manager: ``with enable_continuous_batching(model): model.generate_batch(...)``)."""

    def __init__(self, model, name: str, original: str | None, previous_loaded, registered: bool, listed: bool):
        self.model, self.name = model, name
        self._original, self._previous_loaded, self._registered, self._listed = original, previous_loaded, registered, listed

    def undo(self) -> None:
        """The model's attention implementation, transformers' flash state and its registries as before."""
        if compat.attn_implementation(self.model.config) == self.name and self._original is not None:
            self.model.set_attn_implementation(self._original)
        if self._listed:
            compat.unlist_flash(self.model)  # the class's own list again
        if compat.loaded_flash() == self.name:
            compat.set_loaded_flash(self._previous_loaded)
        if self._registered:
            compat.unregister(self.name)

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
    (compat.set_loaded_flash), so that switching to it
    does not look for a flash kernel on the model hub; and where the model's class lists the flash
    implementations it accepts (compat.compatible_flash, GPT-OSS), lists ``name`` on this model.
    Refused on a transformers whose continuous batching it does not know."""
    from transformers.masking_utils import flash_attention_mask

    if not isinstance(name, str) or "flash" not in name or "/" in name:
        raise ValueError(f"name must be a str containing 'flash' (transformers' continuous batching takes only flash "
                         f"implementations besides sdpa and paged|eager) and no '/', got {name!r}")
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    previous_loaded = compat.loaded_flash()  # (a transformers that renamed it: a RuntimeError saying so, first)
    registered = compat.registered(name) is None
    AttentionInterface.register(name, continuous_batching_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    compatible = compat.compatible_flash(model)
    listed = compatible is not None and name not in compatible
    if listed:
        compat.list_flash(model, [*compatible, name])
    handle = ContinuousBatching(model, name, compat.attn_implementation(model.config), previous_loaded, registered, listed)
    compat.set_loaded_flash(name)
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
    q = query[0].transpose(0, 1)  # (1, H, T, D) -> (T, H, D)
    contract = from_keywords(q, q.shape[1], is_causal=True, softcap=softcap, scale=scaling, head_dim="1",
                             window=None if sliding_window is None else (sliding_window - 1, 0),
                             sinks=None if s_aux is None else s_aux.to(query.dtype), names={"scale": "scaling", "sinks": "s_aux"})
    out = attend_pages(q, k_pages, v_pages, table, kwargs["cu_seq_lens_q"], lengths_k, contract)
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
        k_cache, v_cache = compat.token_views(allocator, layer_idx)  # (tokens, Hkv, D): token i of v is key i's value
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
            and compat.has_token_views(allocator) and "read_index" in kwargs and "write_index" in kwargs)


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
