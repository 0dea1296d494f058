"""mha.KVCache: the keys and values of past tokens, for decoding one token (or chunk) at a time.

    cache = mha.KVCache()                   # grows as tokens arrive
    cache = mha.KVCache(max_length=4096)    # preallocated: no copy per step
    cache = mha.KVCache(window=256)         # rolling: keeps the last 256 positions (sliding windows)
    cache = mha.KVCache(max_length=4096, quantize="int8")   # 8-bit keys and values (inference)
    out = attention(prompt, prompt, prompt, is_causal=True, cache=cache)   # prefill
    out = attention(token, token, token, is_causal=True, cache=cache)      # decode, step by step

It stores, per layer, keys (B, Hkv, S, D) and values (B, Hkv, S, Dv) after projection and RoPE.
While every sequence has the same length (no key_padding_mask so far) that is all: a key's
position is its slot (plus the slots a rolling cache dropped). Once padding arrives it also keeps
each key's position (B, S) and validity (B, S). Sequences of a batch may have different lengths:
prefill right-padded prompts with a key_padding_mask; each sequence then continues at its own
position. Attention masks are derived from positions, so a new query at position p sees the
cached keys at positions <= p (bottom-right causal alignment).

Decode under torch.no_grad (or inference_mode): a preallocated cache writes each step into the
same buffers, which autograd cannot differentiate through across steps; a growing one then writes
into buffers with room (mha.kernels.storage.Room: as many slots again, at most 256 more; the whole
cache copied once each time the room is used up), and concatenates where autograd or torch.compile
follows it.

quantize="int8" keeps keys and values as int8 rows, each followed by its float32 scale (one per
(token, head)): mha.kernels.storage's one layout, as PagedKVCache and transformers' Int8Cache keep
them, a quarter of float32's bytes plus 4 per row. Attention then reads them in place through the
paged kernel, one page per sequence (mha.kernels.paged_attention); it serves decoding and chunked
prefill of sequences of one length (no key_padding_mask), under no_grad, on a growing or
preallocated cache.

Every cache an attention module takes (this one, and a PagedKVCache's step) is the same to the
module (mha.modules.pipeline.attend_positional, the one path): where the new tokens sit
(next_positions), whether an offset places them all (uniform), whether attention reads it as pages
(reads_pages: inference), and, once it stored them, what the new queries see (store: a Seen).

The filled length is read from the stored tensors' shapes, never kept as a Python int, so a
decode step compiled with torch.compile traces the length as a symbol (one graph for every
step after the first recompile) instead of recompiling at each new length.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _checks, positions
from ..kernels import storage

__all__ = ["KVCache", "Seen"]


@dataclass(frozen=True)
class Seen:
    """What a step's queries see once a cache stored the step's tokens (a cache's store()).

    keys, values:  kept as mha.kernels.storage keeps them: (B, Hkv, S, D|Dv) rows of every sequence
                   (8-bit ones, int8 (B, Hkv, S, D|Dv + 4), attended as one page per sequence), or, with a
                   block_table, a pool of pages (N, Hkv, P, D|Dv), read in place
    positions:     (query positions (B|1, L), key positions (B|1, S)) where the sequences differ; None:
                   the queries are the last L of the S keys of every sequence (bottom-right)
    key_valid:     (B|1, S) bool, False where a key is padding, or None
    block_table:   (B, M) the pages of each sequence's keys (pages only), with lengths_k (B,) its key
                   count and rows (B, L) bool, the query rows that are new tokens (None: all)
    """
    keys: Tensor
    values: Tensor
    positions: tuple[Tensor, Tensor] | None = None
    key_valid: Tensor | None = None
    block_table: Tensor | None = None
    lengths_k: Tensor | None = None
    rows: Tensor | None = None


class KVCache:
    """The keys and values of past tokens of one attention module (one layer), for decoding.

        KVCache()                        grows as tokens arrive (under no_grad, in buffers with room)
        KVCache(max_length=4096)         preallocated: each step writes into the same buffers
        KVCache(window=256)              rolling: keeps the last 256 positions (sliding windows)
        KVCache(quantize="int8")         8-bit keys and values (inference; growing or preallocated)

    Pass it as ``cache=`` to mha.GeneralAttention's forward: the prompt first (prefill), then one token
    (or chunk) at a time; each new query sees the cached keys at positions up to its own. Sequences
    of a batch may differ in length (prefill right-padded prompts with a key_padding_mask). crop(n)
    forgets all but the first n slots (rejected draft tokens); ``size``, ``lengths`` and
    ``next_positions`` say where the sequences are. The module docstring (mha.modules.cache) says
    what is stored.
    """

    def __init__(self, max_length: int | None = None, window: int | None = None, *, quantize: str | None = None) -> None:
        self.max_length = None if max_length is None else _checks.positive_int("max_length", max_length)
        self.window = None if window is None else _checks.positive_int("window", window)
        if self.max_length is not None and self.window is not None:
            raise ValueError("a rolling cache (window) needs no max_length; pass one or the other")
        self.quantize = _checks.one_of("quantize", quantize, (None, "int8"))
        if self.quantize and self.window is not None:
            raise ValueError("an 8-bit cache (quantize='int8') grows or is preallocated (max_length); it does not roll "
                             "(window)")
        self.keys = self.values = None  # the filled slots, as mha.kernels.storage keeps them: (B, Hkv, S, D|Dv)
        self._dtype = None  # quantized: the dtype of the keys and values it was given
        # once a key_padding_mask arrives, sequences differ: per-slot positions and validity (B, S), lengths (B,)
        self.positions = self.valid = self._lengths = None
        self._buffers = None  # preallocated: (keys, values[, positions, valid]) with max_length slots
        self._rooms = (storage.Room(), storage.Room())  # growing: the keys' and values' buffers with room
        self._dropped = None  # rolling: (,) int64, the slots dropped so far (a tensor: no Python int to guard on)
        self._owner = None  # a weak reference to the module whose keys this cache holds

    def attach(self, module, window: tuple[int, int] | None) -> None:
        """Bind the cache to the attention module that fills it (one cache per module), and check
        that a rolling cache keeps every key the module's sliding ``window`` (left, right) sees."""
        owner = None if self._owner is None else self._owner()
        if owner is not None and owner is not module:
            raise ValueError("this KVCache holds the keys of another attention module; give each module "
                             "(each layer) its own KVCache")
        if self.window is not None:
            left = None if window is None else positions.check_window(window)[0]  # None: unbounded
            if left is None or left > self.window:
                seen = "no sliding window (it sees every past key)" if left is None else f"window={tuple(window)}"
                raise ValueError(f"KVCache(window={self.window}) keeps the last {self.window} positions, but the "
                                 f"module has {seen}: decoding would miss keys the cache dropped; use a growing "
                                 f"cache or KVCache(window >= the module's left window)")
        self._owner = weakref.ref(module)

    def __repr__(self) -> str:
        kind = (f"window={self.window}" if self.window else
                f"max_length={self.max_length}" if self.max_length else "growing")
        quantized = f", quantize={self.quantize!r}" if self.quantize else ""
        return f"KVCache({kind}{quantized}, size={self.size})"

    @property
    def size(self) -> int:
        """The filled slots along S."""
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def uniform(self) -> bool:
        """Every sequence at the same length with every key valid, so masks reduce to an offset band:
        true until a key_padding_mask arrives. Kept in Python, so no step reads tensor values."""
        return self.valid is None

    @property
    def lengths(self) -> Tensor | None:
        """(B,) tokens seen per sequence (padding excluded), or None while empty."""
        if self._lengths is not None or self.keys is None:
            return self._lengths
        return self._seen() + torch.zeros(self.keys.shape[0], dtype=torch.long, device=self.keys.device)

    def _seen(self):
        """Tokens each sequence has seen while the cache is uniform: the filled slots, plus the ones a
        rolling cache dropped (an int, or a (,) tensor for a rolling cache)."""
        return self.size if self._dropped is None else self._dropped + self.size

    def next_positions(self, batch: int, new: int, device, valid: Tensor | None = None) -> Tensor:
        """Positions of the next tokens, (1, new) while the cache is uniform and no padding comes, else
        (B, new): each sequence continues where it stopped, and a token's position counts the valid
        tokens before it (padding, left or right, takes none)."""
        if self.keys is not None and self.keys.shape[0] != batch:
            raise ValueError(f"the cache holds a batch of {self.keys.shape[0]} sequences, got {batch}")
        if valid is None and self.uniform:
            return (torch.arange(new, device=device) + self._seen())[None]  # (1, new)
        start = 0 if self.keys is None else self.lengths[:, None]  # (B, 1)
        if valid is None:
            return start + torch.arange(new, device=device).expand(batch, new)
        return start + valid.cumsum(dim=1) - valid.long()  # valid tokens before each one

    @property
    def reads_pages(self) -> bool:
        """Whether attention reads this cache as pages (an 8-bit one: inference, no weights)."""
        return self.quantize is not None

    def store(self, keys: Tensor, values: Tensor, positions: Tensor | None, valid: Tensor | None = None) -> Seen:
        """Store a step's keys (B, Hkv, L, D) and values (B, Hkv, L, Dv) at ``positions`` (B|1, L), with
        ``valid`` (B, L) (None: all valid); returns what the step's queries see (a Seen): every
        sequence's keys, placed by their positions where the sequences differ (an 8-bit cache's: its
        rows and their scales, which attention reads in place as one page per sequence)."""
        if self.quantize:
            if valid is not None:
                raise ValueError("an 8-bit KVCache (quantize='int8') serves inference over sequences of one length: "
                                 "no key_padding_mask")
            return Seen(*self._append(*self._quantized(keys, values)))
        uniform = self.uniform and valid is None
        kept_k, kept_v, k_pos, key_valid = self.update(keys, values, positions, valid)
        if uniform:
            return Seen(kept_k, kept_v)
        return Seen(kept_k, kept_v, positions=(positions.expand(keys.shape[0], -1), k_pos), key_valid=key_valid)

    def _quantized(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """New keys and values as an 8-bit cache keeps them (mha.kernels.storage), checked against the
        stored ones."""
        if keys.requires_grad or values.requires_grad:
            raise ValueError("an 8-bit cache (quantize='int8') is for inference: call the module under "
                             "torch.no_grad() or torch.inference_mode()")
        if self._dtype is not None and (keys.dtype, values.dtype) != (self._dtype, self._dtype):
            raise ValueError(f"the cache was given keys and values of dtype {self._dtype}, now {keys.dtype} and "
                             f"{values.dtype}")
        self._check_room(keys.shape[2])
        kept = storage.store(keys, True), storage.store(values, True)
        if self.keys is not None:
            self._check_like_stored(*kept)
        self._dtype = keys.dtype
        return kept

    def update_quantized(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Deprecated: store() (the scales are kept after each row now, mha.kernels.storage). Returns
        (keys, values) int8 (B, Hkv, S, D|Dv) and their scales (B, Hkv, S), as before."""
        warnings.warn("KVCache.update_quantized is deprecated (it goes in the next release): the module calls "
                      "store(), which keeps each row's scale after it (mha.kernels.storage)", DeprecationWarning,
                      stacklevel=2)
        kept_k, kept_v = self._append(*self._quantized(keys, values))
        (k8, k_scales), (v8, v_scales) = storage.split(kept_k), storage.split(kept_v)
        return k8, v8, k_scales, v_scales

    @property
    def key_scales(self) -> Tensor | None:
        """Deprecated: an 8-bit cache's key scales (B, Hkv, S), kept after each row (mha.kernels.storage.split)."""
        return self._scales("key_scales", self.keys)

    @property
    def value_scales(self) -> Tensor | None:
        """Deprecated: an 8-bit cache's value scales (B, Hkv, S) (mha.kernels.storage.split)."""
        return self._scales("value_scales", self.values)

    def _scales(self, name: str, kept: Tensor | None) -> Tensor | None:
        warnings.warn(f"KVCache.{name} is deprecated (it goes in the next release): the scales are kept after "
                      "each row, mha.kernels.storage.split(cache.keys) gives them", DeprecationWarning, stacklevel=3)
        return None if kept is None or not self.quantize else storage.split(kept)[1]

    def _check_room(self, L: int) -> None:
        if self.max_length is not None and self.size + L > self.max_length:
            raise ValueError(f"the cache holds max_length={self.max_length} tokens; {self.size} are stored "
                             f"and {L} more came")

    def update(self, keys: Tensor, values: Tensor, positions: Tensor | None,
               valid: Tensor | None = None) -> tuple[Tensor, ...]:
        """Store new keys (B, Hkv, L, D), values (B, Hkv, L, Dv) with their positions (B|1, L) and
        validity (B, L) (None: all valid; positions may be None while the cache is uniform); returns
        everything attention sees now: (keys, values, positions, valid) over the cached and the new
        tokens, positions and valid None while uniform."""
        L = keys.shape[2]
        if self.quantize:
            raise ValueError("an 8-bit cache (quantize='int8') keeps its rows by store() (the module calls it), not "
                             "update")
        if self.keys is not None:
            self._check_like_stored(keys, values)
        self._check_room(L)
        if valid is not None:
            if self.window is not None:
                raise ValueError("a rolling cache (window) takes no key_padding_mask: give each sequence its own cache")
            self._track_each_sequence(keys.shape[0], keys.device)
        if self.uniform:
            return (*self._append(keys, values), None, None)
        if valid is None:
            valid = torch.ones(keys.shape[0], L, dtype=torch.bool, device=keys.device)
        seen = self._append(keys, values, positions.expand(keys.shape[0], L), valid)
        self._lengths = self._lengths + valid.sum(dim=1)
        return seen

    def crop(self, length: int) -> None:
        """Keep the first ``length`` slots and forget the rest (rejected draft tokens of speculative
        decoding, a rewound prompt): the next tokens continue from there."""
        if self.window is not None:
            raise ValueError("a rolling cache (window) cannot be cropped: it has dropped its oldest keys")
        length = _checks.integer("length", length)
        if not 0 <= length <= self.size:
            raise ValueError(f"length must be in [0, {self.size}] (the filled slots), got {length}")
        if self.keys is None:
            return
        fields = self._fields()
        for name in fields:
            stored = getattr(self, name)
            setattr(self, name, stored.narrow(_slots(stored), 0, length))
        if not self.uniform:
            self._lengths = self.valid.sum(dim=1)

    def select(self, indices) -> None:
        """Keep these sequences of the batch, in this order (beam search's reordering, a batch that
        lost a finished sequence): ``indices`` (B',) into the batch, repeats allowed."""
        if self.keys is None:
            return
        index = torch.as_tensor(indices, device=self.keys.device)
        index = index.long() if index.numel() == 0 else index  # ([] is read as floats)
        B = self.keys.shape[0]
        if (index.dim() != 1 or index.is_floating_point() or index.dtype == torch.bool
                or (index.numel() and not (0 <= int(index.min()) and int(index.max()) < B))):
            raise ValueError(f"indices must be a 1-D list of sequences of the batch (0..{B - 1}), got {indices!r}")
        if self._buffers is not None:  # the filled slots stay views of the (selected) buffers
            size = self.size
            self._buffers = tuple(buffer.index_select(0, index) for buffer in self._buffers)
            for name, buffer in zip(self._fields(), self._buffers):
                setattr(self, name, buffer.narrow(_slots(buffer), 0, size))
        else:
            for name in self._fields():
                setattr(self, name, getattr(self, name).index_select(0, index))
            self._rooms = (storage.Room(), storage.Room())  # (the selection is copied at the next step)
        if self._lengths is not None:
            self._lengths = self._lengths.index_select(0, index)

    def _fields(self) -> tuple[str, ...]:
        """The names of what the cache stores per slot now, in _append's order."""
        every = self._slot_fields()
        return every[:2] if self.uniform else every

    @staticmethod
    def _slot_fields() -> tuple[str, ...]:
        """What the cache can store per slot: keys and values (mha.kernels.storage's rows, an 8-bit
        row's scale after it), then each slot's position and validity (tracked once padding came)."""
        return ("keys", "values", "positions", "valid")

    def _track_each_sequence(self, batch: int, device) -> None:
        """From uniform to per-sequence bookkeeping: the stored slots get positions 0..size-1, all valid."""
        if not self.uniform:
            return
        size = self.size
        self.positions = torch.arange(size, device=device).expand(batch, size)  # (B, S)
        self.valid = torch.ones(batch, size, dtype=torch.bool, device=device)  # (B, S)
        self._lengths = torch.full((batch,), size, dtype=torch.long, device=device)
        if self._buffers is not None:  # preallocated: per-slot buffers beside the keys' and values'
            slots = self.max_length
            self._buffers = (*self._buffers[:2], torch.zeros(batch, slots, dtype=torch.long, device=device),
                             torch.zeros(batch, slots, dtype=torch.bool, device=device))
            self._buffers[2][:, :size] = self.positions
            self._buffers[3][:, :size] = True

    def _check_like_stored(self, keys: Tensor, values: Tensor) -> None:
        stored_k, stored_v = self.keys, self.values
        if (keys.dtype == stored_k.dtype and values.dtype == stored_v.dtype and keys.device == stored_k.device
                and keys.shape[:2] == stored_k.shape[:2] and values.shape[:2] == stored_v.shape[:2]
                and keys.shape[3] == stored_k.shape[3] and values.shape[3] == stored_v.shape[3]):
            return  # like the stored ones: the common case in one expression
        for name, new, stored in (("keys", keys, self.keys), ("values", values, self.values)):
            (B, Hkv), D, new_D = stored.shape[:2], storage.width(stored), storage.width(new)  # (an 8-bit row's width)
            if (new.shape[0], new.shape[1], new_D) != (B, Hkv, D):
                raise ValueError(f"the cache holds {name} of shape (B, Hkv, S, D) = ({B}, {Hkv}, S, {D}), got new "
                                 f"{name} of shape {(*new.shape[:3], new_D)}: a cache serves one module and one batch")
            if new.dtype != stored.dtype or new.device != stored.device:
                raise ValueError(f"the cache holds {name} of dtype {stored.dtype} on {stored.device}, got "
                                 f"{new.dtype} on {new.device}")

    def _append(self, *new: Tensor) -> tuple[Tensor, ...]:
        """Add the new slots to keys, values (and positions, valid once tracked; scales when quantized);
        returns the filled parts."""
        fields = self._slot_fields()
        size, L = self.size, new[0].shape[2]
        if self.max_length is not None:
            if self._buffers is None:
                self._buffers = tuple(_preallocate(t, self.max_length) for t in new)
            seen = []
            for buffer, t in zip(self._buffers, new):  # narrow + copy_: a slice assignment costs several times more
                slots = _slots(t)  # keys, values (B, Hkv, slots, D): 2; positions, valid (B, slots): 1
                buffer.narrow(slots, size, L).copy_(t)
                seen.append(buffer.narrow(slots, 0, size + L))
            kept = seen = tuple(seen)
        else:
            stored = (getattr(self, name) for name in fields[:len(new)])
            if self._in_buffers(new):  # buffers with room, each step's rows written into them
                seen = tuple(room.append(old, t) for room, old, t in zip(self._rooms, stored, new))
            else:  # (a concatenation: autograd and torch.compile follow it)
                seen = new if self.keys is None else tuple(_concat(old, t) for old, t in zip(stored, new))
            kept = seen
            if self.window is not None and size + L > self.window:  # a rolling cache keeps the last `window` slots
                drop = size + L - self.window
                kept = tuple(t.narrow(_slots(t), drop, self.window) for t in seen)
                dropped = new[0].new_zeros((), dtype=torch.long) if self._dropped is None else self._dropped
                self._dropped = dropped + drop
        for name, t in zip(fields, kept):
            setattr(self, name, t)
        return seen

    def _in_buffers(self, new: tuple[Tensor, ...]) -> bool:
        """Whether a growing cache appends its keys and values into buffers with room (self._rooms):
        an 8-bit one always (inference only), a float one where nothing follows the cache but
        inference (no autograd, no torch.compile tracing it) and it keeps only keys and values
        (uniform; not rolling, whose kept slots move along)."""
        if self.quantize:
            return True
        return len(new) == 2 and self.window is None and storage.in_place_allowed()


def _preallocate(t: Tensor, slots: int) -> Tensor:
    axis = _slots(t)
    return t.new_zeros(*t.shape[:axis], slots, *t.shape[axis + 1:])


def _slots(t: Tensor) -> int:
    """The slot (sequence) axis: 2 for keys/values (B, H, S, D), 1 for positions/validity (B, S)."""
    return 2 if t.dim() >= 3 else 1


def _concat(old: Tensor, new: Tensor) -> Tensor:
    return torch.cat([old, new], dim=_slots(new))
