"""mha.PagedKVCache: the keys and values of many sequences in fixed-size pages (serving many
generations at once, vLLM's layout).

    cache = mha.PagedKVCache(num_blocks=1024, block_size=16, num_kv_heads=2, head_dim=64, num_layers=4)
    a, cached = cache.add(prompt_tokens)   # cached: how many prompt tokens share blocks already filled
    b, _ = cache.add()                     # no token ids: nothing to share
    slots = cache.reserve([a, b], [len(prompt_tokens) - cached, 1], tokens=[prompt_tokens[cached:], None])
    for layer in range(4):                 # each layer: write the new keys, attend over the pages
        cache.write(layer, slots, k_new, v_new)                        # (T, Hkv, D), (T, Hkv, Dv)
        out = mha.kernels.paged_attention(q_new, *cache.pages(layer), cache.block_table([a, b]),
                                          cu_seqlens_q, cache.lengths([a, b]))
    cache.free(a)                          # its blocks return to the pool (shared ones when unshared)

Layout, per layer: keys (num_blocks, Hkv, block_size, D) and values (num_blocks, Hkv, block_size, Dv),
one preallocated tensor each; a page holds block_size consecutive keys of one sequence, each kv
head's contiguous. A sequence's block table lists its pages in order (key j: page table[j //
block_size], slot j % block_size); a slot number is page * block_size + slot. The table is shared
by the layers: reserve() once per step, then write() each layer.

Memory per sequence: ceil(S / block_size) pages x num_layers x Hkv x block_size x (D + Dv) x the
dtype's bytes (fp32, 2 kv heads, D = Dv = 64, block_size 16: 16 KiB per page and layer; 4 layers:
4 KiB per token). quantize="int8" keeps int8 rows each followed by its float32 scale (one per
(slot, kv head): mha.kernels.storage's one layout, as KVCache and transformers' Int8Cache keep
them): D + 4 bytes per key row, pages (N, Hkv, P, D + 4) int8, read in place by the native kernel;
paged_attention takes them as they are.

Sharing. A full block of a sequence whose token ids are known is registered under a hash of its
tokens and of every token before it (the prefix); add(tokens) gives a new sequence the registered
blocks of its longest such prefix (reference-counted: freed when the last sequence using it is),
so its prompt is computed from the first token past them. fork() gives a copy of a sequence (all
its blocks shared); a shared partial last block is copied (every layer) before it is written: copy
on write. A block becomes shareable at the next add() or reserve(), once the step that filled it
has written it.
"""

from __future__ import annotations

import hashlib
import itertools
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .. import _checks
from ..kernels import storage
from .cache import Seen

__all__ = ["PagedKVCache", "PagedStep"]


@dataclass
class _Sequence:
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    tokens: list[int] | None = None  # the token ids so far, when known (for sharing)
    chain: list[bytes] = field(default_factory=list)  # the prefix hash of each full block


class PagedKVCache:
    """Pages of keys and values for many sequences (see the module docstring)."""

    def __init__(self, *, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 value_dim: int | None = None, num_layers: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", quantize: str | None = None) -> None:
        self.num_blocks = _checks.positive_int("num_blocks", num_blocks)
        self.block_size = _checks.positive_int("block_size", block_size)
        self.num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = _checks.positive_int("head_dim", head_dim)
        self.value_dim = self.head_dim if value_dim is None else _checks.positive_int("value_dim", value_dim)
        self.num_layers = _checks.positive_int("num_layers", num_layers)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.quantize = _checks.one_of("quantize", quantize, (None, "int8"))
        shape = (self.num_blocks, self.num_kv_heads, self.block_size)
        stored, extra = (torch.int8, storage.SCALE_BYTES) if self.quantize else (dtype, 0)  # an 8-bit row's scale after it
        self.keys = [torch.zeros(*shape, self.head_dim + extra, dtype=stored, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(*shape, self.value_dim + extra, dtype=stored, device=device) for _ in range(num_layers)]
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self._refs = [0] * self.num_blocks
        self._sequences: dict[int, _Sequence] = {}
        self._ids = itertools.count()
        self._by_hash: dict[bytes, int] = {}  # prefix hash -> a full, written block
        self._hash_of: dict[int, bytes] = {}
        self._unregistered: list[tuple[int, bytes]] = []  # (block, hash) filled by the last reserve
        self._layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its layer

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, value_dim={self.value_dim}, "
                f"num_layers={self.num_layers}, dtype={self.keys[0].dtype}"
                f"{f', quantize={self.quantize!r}' if self.quantize else ''}; {len(self._sequences)} sequences, "
                f"{self.free_blocks} free blocks)")

    # -- sequences ---------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def add(self, tokens=None) -> tuple[int, int]:
        """A new sequence: (its id, how many of ``tokens`` (its prompt's ids, optional) are already
        cached in shared blocks; the caller computes the prompt from that token on). At least the
        last token is always left to compute (its query gives the next token's logits)."""
        self._register()
        sequence = _Sequence(tokens=None if tokens is None else _token_list(tokens))
        if sequence.tokens is not None:
            for start in range(0, len(sequence.tokens) - 1 - self.block_size + 1, self.block_size):
                h = _chain_hash(sequence.chain[-1] if sequence.chain else None,
                                sequence.tokens[start:start + self.block_size])
                block = self._by_hash.get(h)
                if block is None:
                    break
                self._refs[block] += 1
                sequence.blocks.append(block)
                sequence.chain.append(h)
                sequence.length += self.block_size
            sequence.tokens = sequence.tokens[:sequence.length]
        seq_id = next(self._ids)
        self._sequences[seq_id] = sequence
        return seq_id, sequence.length

    def fork(self, seq_id: int) -> int:
        """A new sequence holding what ``seq_id`` holds, every block shared (beam search, parallel
        sampling); either one's next write into a shared partial block copies it first."""
        parent = self._sequence(seq_id)
        for block in parent.blocks:
            self._refs[block] += 1
        child = _Sequence(list(parent.blocks), parent.length, None if parent.tokens is None else list(parent.tokens),
                          list(parent.chain))
        new_id = next(self._ids)
        self._sequences[new_id] = child
        return new_id

    def free(self, seq_id: int) -> None:
        """Forget a sequence: its blocks return to the pool (a shared one when no sequence uses it)."""
        self._register()
        for block in self._sequences.pop(self._check_id(seq_id)).blocks:
            self._release(block)

    def crop(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of a sequence (speculative decoding's rollback): the blocks
        past them return to the pool; a block it shares is copied at its next write (copy on write),
        one of its own stops being shared (its later slots are written anew)."""
        self._register()
        sequence = self._sequence(seq_id)
        length = _checks.integer("length", length)
        if not 0 <= length <= sequence.length:
            raise ValueError(f"length must be between 0 and the sequence's {sequence.length} tokens, got {length}")
        keep = -(-length // self.block_size)
        for block in sequence.blocks[keep:]:
            self._release(block)
        del sequence.blocks[keep:], sequence.chain[length // self.block_size:]
        if length % self.block_size and self._refs[sequence.blocks[-1]] == 1:
            self._unshare(sequence.blocks[-1])
        sequence.length = length
        if sequence.tokens is not None:
            del sequence.tokens[length:]

    def lengths(self, seq_ids) -> Tensor:
        """(B,) int64: each sequence's key count."""
        return torch.tensor([self._sequence(i).length for i in seq_ids], dtype=torch.int64)

    def block_table(self, seq_ids) -> Tensor:
        """(B, M) int32: each sequence's pages in order, -1 past its last (M: the longest's count)."""
        rows = [self._sequence(i).blocks for i in seq_ids]
        table = torch.full((len(rows), max((len(r) for r in rows), default=0)), -1, dtype=torch.int32)
        for b, row in enumerate(rows):
            table[b, :len(row)] = torch.tensor(row, dtype=torch.int32)
        return table

    # -- a step: reserve slots once, write each layer ------------------------------------------

    def step(self, seq_ids, counts, *, tokens=None) -> PagedStep:
        """One step of a batch of sequences for attention modules (``cache=`` of mha.GeneralAttention):
        :meth:`reserve` once, then each module (each layer) writes its new keys and attends."""
        seq_ids = list(seq_ids)
        starts = self.lengths(seq_ids)
        slots = self.reserve(seq_ids, counts, tokens=tokens)
        return PagedStep(self, seq_ids, self.lengths(seq_ids) - starts, starts, slots)

    def layer_of(self, module) -> int:
        """The layer whose pages ``module`` fills: layers are given to modules in the order they first
        attend (a ValueError past num_layers)."""
        if module not in self._layers:
            if len(self._layers) >= self.num_layers:
                raise ValueError(f"this PagedKVCache has {self.num_layers} layers, all taken by other attention "
                                 "modules: make it with num_layers = the model's attention layers")
            self._layers[module] = len(self._layers)
        return self._layers[module]

    def reserve(self, seq_ids, counts, *, tokens=None) -> Tensor:
        """Room for ``counts[b]`` new tokens at the end of each sequence (new blocks from the pool,
        a shared partial last block copied first); returns their slots (sum(counts),) int64, sequence
        by sequence, for :meth:`write`. ``tokens``: the new tokens' ids per sequence (or None), kept
        for sharing. All or nothing: a RuntimeError, and no change, when the pool runs out."""
        self._register()
        seq_ids, counts = list(seq_ids), [_checks.integer("counts", c) for c in counts]
        if len(counts) != len(seq_ids) or any(c < 0 for c in counts) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"counts must give one count >= 0 per distinct sequence: got {len(seq_ids)} sequences "
                             f"{seq_ids} and counts {counts}")
        tokens = [None] * len(seq_ids) if tokens is None else list(tokens)
        if len(tokens) != len(seq_ids):
            raise ValueError(f"tokens must give the new ids per sequence (or None): got {len(tokens)} for "
                             f"{len(seq_ids)} sequences")
        sequences = [self._sequence(i) for i in seq_ids]
        needed = sum(self._blocks_needed(s, c) for s, c in zip(sequences, counts))
        if needed > len(self._free):
            raise RuntimeError(f"PagedKVCache is full: this step needs {needed} free blocks, {len(self._free)} are "
                               "left (free finished sequences, or make the cache larger)")
        slots = []
        for sequence, count, new in zip(sequences, counts, tokens):
            slots.extend(self._extend(sequence, count, None if new is None else _token_list(new)))
        return torch.tensor(slots, dtype=torch.int64)

    def write(self, layer: int, slots: Tensor, keys: Tensor, values: Tensor) -> None:
        """Store the new tokens' keys (T, Hkv, D) and values (T, Hkv, Dv) of ``layer`` at ``slots`` (T,)."""
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in 0..{self.num_layers - 1}, got {layer!r}")
        pool_k, pool_v = self.keys[layer], self.values[layer]
        for name, x, width in (("keys", keys, self.head_dim), ("values", values, self.value_dim)):
            _checks.tensor(name, x)
            if x.shape != (len(slots), self.num_kv_heads, width):
                raise ValueError(f"{name} must be ({len(slots)}, {self.num_kv_heads}, {width}) for {len(slots)} slots, "
                                 f"got shape {tuple(x.shape)}")
        slots = slots.to(pool_k.device)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        keys, values = (storage.store(x, self.quantize is not None) for x in (keys, values))  # an 8-bit row's scale after it
        pool_k[blocks, :, offsets] = keys.to(pool_k.dtype)  # (T, Hkv, D) into pages (N, Hkv, P, D)
        pool_v[blocks, :, offsets] = values.to(pool_v.dtype)

    def pages(self, layer: int) -> tuple[Tensor, Tensor]:
        """(keys (N, Hkv, P, D), values (N, Hkv, P, Dv)) of ``layer``, as kept (8-bit: (N, Hkv, P, D + 4)
        int8, each row's scale after it): what paged_attention reads."""
        return self.keys[layer], self.values[layer]

    def page_scales(self, layer: int) -> dict[str, Tensor]:
        """Deprecated: {} (the scales are kept after each row, in the pages: paged_attention reads them
        there). It gave paged_attention's k_scales and v_scales."""
        warnings.warn("PagedKVCache.page_scales is deprecated (it goes in the next release): the scales are kept in "
                      "the pages after each row, and paged_attention reads them there", DeprecationWarning, stacklevel=2)
        return {}

    @property
    def key_scales(self) -> list[Tensor]:
        """Deprecated: each layer's key scales (N, Hkv, P) of an 8-bit cache (mha.kernels.storage.split)."""
        return self._scales("key_scales", self.keys)

    @property
    def value_scales(self) -> list[Tensor]:
        """Deprecated: each layer's value scales (N, Hkv, P) of an 8-bit cache (mha.kernels.storage.split)."""
        return self._scales("value_scales", self.values)

    def _scales(self, name: str, pools: list[Tensor]) -> list[Tensor]:
        warnings.warn(f"PagedKVCache.{name} is deprecated (it goes in the next release): the scales are kept after "
                      "each row, mha.kernels.storage.split(pages) gives them", DeprecationWarning, stacklevel=3)
        return [storage.split(pool)[1] for pool in pools] if self.quantize else []

    # -- inside --------------------------------------------------------------------------------

    def _blocks_needed(self, sequence: _Sequence, count: int) -> int:
        """New blocks for ``count`` tokens, and one for the copy of a shared partial last block."""
        room = -sequence.length % self.block_size
        fresh = max(0, -(-(count - room) // self.block_size))
        copy = 1 if count and room and self._refs[sequence.blocks[-1]] > 1 else 0
        return fresh + copy

    def _extend(self, sequence: _Sequence, count: int, new: list[int] | None) -> list[int]:
        if count and sequence.length % self.block_size and self._refs[sequence.blocks[-1]] > 1:
            sequence.blocks[-1] = self._copied(sequence.blocks[-1])  # copy on write
        if new is not None and len(new) != count:
            raise ValueError(f"tokens must give {count} ids for {count} new tokens, got {len(new)}")
        if sequence.tokens is not None and new is None and count:
            sequence.tokens = None  # ids no longer known: its later blocks are not shared
        slots = []
        for _ in range(count):
            offset = sequence.length % self.block_size
            if offset == 0:
                sequence.blocks.append(self._allocate())
            slots.append(sequence.blocks[-1] * self.block_size + offset)
            sequence.length += 1
        if sequence.tokens is not None and new is not None:
            sequence.tokens.extend(new)
            while len(sequence.chain) < sequence.length // self.block_size:  # blocks just filled
                i = len(sequence.chain)
                sequence.chain.append(_chain_hash(sequence.chain[-1] if i else None,
                                                  sequence.tokens[i * self.block_size:(i + 1) * self.block_size]))
                self._unregistered.append((sequence.blocks[i], sequence.chain[-1]))
        return slots

    def _register(self) -> None:
        """Make the blocks filled by the last step shareable (written by now)."""
        for block, h in self._unregistered:
            if self._refs[block] and h not in self._by_hash:
                self._by_hash[h], self._hash_of[block] = block, h
        self._unregistered.clear()

    def _allocate(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _copied(self, block: int) -> int:
        new = self._allocate()
        for pool in (*self.keys, *self.values):  # (an 8-bit row's scale comes with it)
            pool[new] = pool[block]
        self._release(block)
        return new

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._unshare(block)
            self._free.append(block)

    def _unshare(self, block: int) -> None:
        """No later sequence gets ``block`` for a prefix (it is freed, or about to be written anew)."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._by_hash[h]

    def _check_id(self, seq_id) -> int:
        if seq_id not in self._sequences:
            raise ValueError(f"seq_id {seq_id!r} is not a sequence of this cache (added and not freed)")
        return seq_id

    def _sequence(self, seq_id) -> _Sequence:
        return self._sequences[self._check_id(seq_id)]


def _token_list(tokens) -> list[int]:
    ids = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise TypeError(f"tokens must be token ids (ints, or an integer tensor), got {ids[:4]!r}...")
    return ids


def _chain_hash(previous: bytes | None, block_tokens: list[int]) -> bytes:
    """The hash of a full block: its tokens and its prefix's hash (every token before it); a
    cryptographic digest, so that two different prefixes never share a block by collision."""
    digest = hashlib.blake2b(previous or b"", digest_size=16)
    digest.update(torch.tensor(block_tokens, dtype=torch.int64).numpy().tobytes())
    return digest.digest()


class PagedStep:
    """One step of a batch over a PagedKVCache (made by :meth:`PagedKVCache.step`): sequence b adds
    counts[b] new tokens, given right-padded as rows 0..counts[b]-1 of the module's (B, L, .) input,
    at positions starts[b]... Each module that attends with it writes its layer's new keys and values
    at the reserved slots and reads its sequences' pages in place (mha.kernels.paged_attention)."""

    def __init__(self, cache: PagedKVCache, seq_ids: list[int], counts: Tensor, starts: Tensor, slots: Tensor,
                 layer: int | None = None):
        self.cache, self.seq_ids, self.counts, self.starts, self.slots = cache, seq_ids, counts, starts, slots
        self.layer = layer

    def for_module(self, module) -> PagedStep:
        """The step for the layer whose pages ``module`` fills (PagedKVCache.layer_of)."""
        return PagedStep(self.cache, self.seq_ids, self.counts, self.starts, self.slots, self.cache.layer_of(module))

    def __repr__(self) -> str:
        return f"PagedStep(sequences={self.seq_ids}, new tokens={self.counts.tolist()})"

    def valid(self, L: int, device) -> Tensor:
        """(B, L) bool: the rows that are new tokens (the rest is right padding)."""
        if len(self.counts) and L < int(self.counts.max()):
            raise ValueError(f"the step adds up to {int(self.counts.max())} tokens to a sequence, but the input has "
                             f"{L} rows per sequence")
        return torch.arange(L, device=device)[None, :] < self.counts.to(device)[:, None]

    def positions(self, L: int, device) -> Tensor:
        """(B, L) int64: each new token's position (its sequence's length before the step, onward)."""
        return self.starts.to(device)[:, None] + torch.arange(L, device=device)[None, :]

    # -- the cache protocol (mha.modules.cache): what an attention module asks of its cache ------------

    reads_pages = True  # attention reads the step's pages (inference: no weights)
    uniform = False  # its sequences have lengths of their own: positions place them

    def next_positions(self, batch: int, new: int, device, valid: Tensor | None = None) -> Tensor:
        """Where the step's tokens sit: (B, L) (positions); ``valid`` must mark exactly its new tokens."""
        if self.layer is None:
            raise ValueError("a PagedStep attends for one layer: bind it with step.for_module(module) "
                             "(mha.GeneralAttention does it)")
        if batch != len(self.seq_ids):
            raise ValueError(f"with a PagedKVCache step, query and key are the new tokens of its {len(self.seq_ids)} "
                             f"sequences: got batch {batch}")
        if valid is not None and not torch.equal(valid, self.valid(new, valid.device)):
            raise ValueError("key_padding_mask must mark exactly the rows past each sequence's new tokens (the step's "
                             "counts) as padding, or be None")
        return self.positions(new, device)

    def store(self, keys: Tensor, values: Tensor, positions: Tensor | None = None, valid: Tensor | None = None) -> Seen:
        """Write the step's new keys (B, Hkv, L, D) and values (B, Hkv, L, Dv) (rows past each
        sequence's count are padding) at the reserved slots of its layer; returns what the step's
        queries see: every sequence's pages, read in place."""
        B, _, L, _ = keys.shape
        rows = self.valid(L, keys.device)  # (B, L)
        if every := bool(rows.all()):  # no padding (a decoding step of every sequence): a reshape, not indexing
            packed = [x.transpose(1, 2).reshape(B * L, x.shape[1], x.shape[3]) for x in (keys, values)]
        else:
            packed = [x.transpose(1, 2)[rows] for x in (keys, values)]  # (B, X, L, D) -> (B, L, X, D) -> (T, X, D)
        self.cache.write(self.layer, self.slots, *packed)
        return Seen(*self.cache.pages(self.layer), block_table=self.cache.block_table(self.seq_ids),
                    lengths_k=self.cache.lengths(self.seq_ids), rows=None if every else rows)
