"""mha.KVCache: the keys and values of past tokens, for decoding one token (or chunk) at a time.

    cache = mha.KVCache()                   # grows as tokens arrive
    cache = mha.KVCache(max_length=4096)    # preallocated: no copy per step
    cache = mha.KVCache(window=256)         # rolling: keeps the last 256 positions (sliding windows)
    out = attention(prompt, prompt, prompt, is_causal=True, cache=cache)   # prefill
    out = attention(token, token, token, is_causal=True, cache=cache)      # decode, step by step

It stores, per layer, keys (N, H_kv, S, Dk) and values (N, H_kv, S, Dv) after projection and
RoPE, with each key's position (N, S) and validity (N, S). Sequences of a batch may have
different lengths: prefill right-padded prompts with a key_padding_mask; each sequence then
continues at its own position. Attention masks are derived from positions, so a new query at
position p sees the cached keys at positions <= p (bottom-right causal alignment).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from . import _checks

__all__ = ["KVCache"]


class KVCache:
    def __init__(self, max_length: int | None = None, window: int | None = None) -> None:
        self.max_length = None if max_length is None else _checks.positive_int("max_length", max_length)
        self.window = None if window is None else _checks.positive_int("window", window)
        if self.max_length is not None and self.window is not None:
            raise ValueError("a rolling cache (window) needs no max_length; pass one or the other")
        self.keys = self.values = self.positions = self.valid = None
        self.size = 0  # filled slots along S
        self.padded = False  # whether any step came with a key_padding_mask
        self.lengths: Tensor | None = None  # (N,) tokens seen per sequence
        self._owner = None  # a weak reference to the module whose keys this cache holds

    def attach(self, module, window: tuple[int, int] | None) -> None:
        """Bind the cache to the attention module that fills it (one cache per module), and check
        that a rolling cache keeps every key the module's sliding ``window`` (left, right) sees."""
        owner = None if self._owner is None else self._owner()
        if owner is not None and owner is not module:
            raise ValueError("this KVCache holds the keys of another attention module; give each module "
                             "(each layer) its own KVCache")
        if self.window is not None:
            left = None if window is None or window[0] == -1 else window[0]
            if left is None or left > self.window:
                seen = "no sliding window (it sees every past key)" if left is None else f"window={tuple(window)}"
                raise ValueError(f"KVCache(window={self.window}) keeps the last {self.window} positions, but the "
                                 f"module has {seen}: decoding would miss keys the cache dropped; use a growing "
                                 f"cache or KVCache(window >= the module's left window)")
        self._owner = weakref.ref(module)

    def __repr__(self) -> str:
        kind = (f"window={self.window}" if self.window else
                f"max_length={self.max_length}" if self.max_length else "growing")
        return f"KVCache({kind}, size={self.size})"

    def next_positions(self, batch: int, new: int, device, valid: Tensor | None = None) -> Tensor:
        """(N, new) positions of the next tokens: each sequence continues where it stopped, and a
        token's position counts the valid tokens before it (padding, left or right, takes none)."""
        if self.lengths is not None and self.lengths.shape[0] != batch:
            raise ValueError(f"the cache holds a batch of {self.lengths.shape[0]} sequences, got {batch}")
        start = 0 if self.lengths is None else self.lengths[:, None]  # (N, 1)
        if valid is None:
            return start + torch.arange(new, device=device).expand(batch, new)
        return start + valid.cumsum(dim=1) - valid.long()  # valid tokens before each one

    @property
    def uniform(self) -> bool:
        """Every sequence at the same length with every key valid (masks reduce to an offset band):
        true until a key_padding_mask arrives. Kept in Python, so no step reads tensor values."""
        return not self.padded

    def update(self, keys: Tensor, values: Tensor, positions: Tensor,
               valid: Tensor | None = None) -> tuple[Tensor, ...]:
        """Store new keys (N, H_kv, L, Dk), values (N, H_kv, L, Dv) with their positions and
        validity (N, L) (None: all valid); returns everything attention sees now: (keys, values,
        positions, valid) over the cached and the new tokens."""
        if self.keys is not None:
            self._check_like_stored(keys, values)
        if valid is not None and self.window is not None:
            raise ValueError("a rolling cache (window) takes no key_padding_mask: give each sequence its own cache")
        self.padded = self.padded or valid is not None
        if valid is None:
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        new = (keys, values, positions, valid)
        if self.max_length is not None:
            seen = self._write_preallocated(new)
        else:
            stored = (self.keys, self.values, self.positions, self.valid)
            seen = new if self.keys is None else tuple(_concat(old, t, self.size) for old, t in zip(stored, new))
            self._store(seen)
        added = valid.sum(dim=1)
        self.lengths = added if self.lengths is None else self.lengths + added
        return seen

    def _check_like_stored(self, keys: Tensor, values: Tensor) -> None:
        for name, new, stored in (("keys", keys, self.keys), ("values", values, self.values)):
            N, H, _, D = stored.shape
            if (new.shape[0], new.shape[1], new.shape[3]) != (N, H, D):
                raise ValueError(f"the cache holds {name} of shape (N, H_kv, S, D) = ({N}, {H}, S, {D}), got new "
                                 f"{name} of shape {tuple(new.shape)}: a cache serves one module and one batch")
            if new.dtype != stored.dtype or new.device != stored.device:
                raise ValueError(f"the cache holds {name} of dtype {stored.dtype} on {stored.device}, got "
                                 f"{new.dtype} on {new.device}")

    def _store(self, seen) -> None:
        """Keep what a growing or rolling cache retains (a rolling one: the last ``window`` slots)."""
        if self.window is not None:
            seen = tuple(t.narrow(_slots(t), max(0, t.shape[_slots(t)] - self.window),
                                  min(self.window, t.shape[_slots(t)])) for t in seen)
        self.keys, self.values, self.positions, self.valid = seen
        self.size = self.keys.shape[2]

    def _write_preallocated(self, new) -> tuple[Tensor, ...]:
        keys, values, positions, valid = new
        L = keys.shape[2]
        if self.keys is None:
            N, H = keys.shape[:2]
            self.keys = keys.new_empty(N, H, self.max_length, keys.shape[-1])
            self.values = values.new_empty(N, H, self.max_length, values.shape[-1])
            self.positions = positions.new_empty(N, self.max_length)
            self.valid = valid.new_zeros(N, self.max_length)
        if self.size + L > self.max_length:
            raise ValueError(f"the cache holds max_length={self.max_length} tokens; {self.size} are stored "
                             f"and {L} more came")
        end = self.size + L
        self.keys[:, :, self.size:end] = keys  # (N, H_kv, L, Dk) into its slots
        self.values[:, :, self.size:end] = values
        self.positions[:, self.size:end] = positions
        self.valid[:, self.size:end] = valid
        self.size = end
        return (self.keys[:, :, :end], self.values[:, :, :end], self.positions[:, :end], self.valid[:, :end])


def _slots(t: Tensor) -> int:
    """The slot (sequence) axis: 2 for keys/values (N, H, S, D), 1 for positions/validity (N, S)."""
    return 2 if t.dim() == 4 else 1


def _concat(old: Tensor, new: Tensor, size: int) -> Tensor:
    axis = _slots(new)
    return torch.cat([old.narrow(axis, 0, size), new], dim=axis)
