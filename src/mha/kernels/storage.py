"""What a cache keeps of keys and values: one layout, whoever keeps them.

    kept (..., T, X) floating     the rows as they came
    kept (..., T, X + 4) int8     8-bit: each row's X values quantized (mha.kernels.quantize: one float32
                                  scale per row), then the 4 bytes of that scale

mha.KVCache, mha.PagedKVCache and transformers' Int8Cache (mha.integrations.transformers) keep their
keys and values so, as plain tensors: whatever a cache does along its slots (append, crop, select a
batch, copy a page, offload) keeps each row with its scale. Attention reads them where they lie:
``split`` gives the rows and their scales as views (a copy of the scales only where the bytes of a
float are not where a float view can read them: X not a multiple of 4), which mha.kernels.paged_attention
and its kernels take (the native kernel converts and scales each row as it reads it).

    store(x, quantized)  -> kept           x (..., T, X) floating
    split(kept)          -> (rows (..., T, X), scales (..., T) float32, or None for floating rows)
    load(kept, dtype)    -> (..., T, X) in dtype: dequantized where 8-bit (the reference's way)
    width(kept)          -> X
    Room().append(kept, new) -> kept and new along T, in a buffer with room for more (a growing
                            cache's step writes its rows, not a copy of all it holds)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .quantize import dequantize, quantize_int8

__all__ = ["RESERVE", "SCALE_BYTES", "Room", "capacity", "in_place_allowed", "load", "quantized", "split", "store", "width"]

SCALE_BYTES = 4  # a float32 scale, kept as four int8 after its row
RESERVE = 256  # the most slots a growing buffer keeps beyond those it holds (Room, capacity)


def quantized(kept: Tensor) -> bool:
    """Whether ``kept`` holds 8-bit rows (int8, each with its scale)."""
    return kept.dtype == torch.int8


def store(x: Tensor, quantized: bool) -> Tensor:
    """x (..., T, X) floating as a cache keeps it: as it is, or (quantized) (..., T, X + 4) int8 (on
    the CPU in one call of the native kernel where it is built: the same bytes as quantize_int8's)."""
    if not quantized:
        return x
    from . import native  # (which reads pages as this module keeps them)

    kernel = native.load_if_built()
    if kernel is not None and x.device.type == "cpu" and x.dim() >= 1 and x.is_floating_point():
        return kernel.quantize_rows(x.detach().contiguous())
    data, scales = quantize_int8(x)  # (..., T, X) int8, (..., T) float32
    return torch.cat([data, scales[..., None].view(torch.int8)], dim=-1)  # (..., T, 1) float32 -> (..., T, 4) int8


def width(kept: Tensor) -> int:
    """X, the width of the rows kept."""
    return kept.shape[-1] - SCALE_BYTES if quantized(kept) else kept.shape[-1]


def split(kept: Tensor, name: str = "kept") -> tuple[Tensor, Tensor | None]:
    """(rows (..., T, X), scales (..., T) float32 or None): views of what is kept (the scales copied
    out where a float view cannot read them: X, the row stride or the offset not in whole floats)."""
    if not quantized(kept):
        return kept, None
    if kept.dim() < 1 or kept.shape[-1] <= SCALE_BYTES:
        raise ValueError(f"{name} is int8 {tuple(kept.shape)}: 8-bit rows are kept as (..., length, width + "
                         f"{SCALE_BYTES}), each row's values then its float32 scale (mha.kernels.storage)")
    X = kept.shape[-1] - SCALE_BYTES
    scale_bytes = kept[..., X:]  # (..., T, 4)
    floats = X % SCALE_BYTES == 0 and kept.stride(-1) == 1 and kept.storage_offset() % SCALE_BYTES == 0 and all(
        stride % SCALE_BYTES == 0 for stride in kept.stride()[:-1])
    if not floats:
        scale_bytes = scale_bytes.contiguous()
    return kept[..., :X], scale_bytes.view(torch.float32)[..., 0]  # (..., T, 1) float32 -> (..., T)


def load(kept: Tensor, dtype: torch.dtype) -> Tensor:
    """The rows in ``dtype`` (float32 or float64 arithmetic for 8-bit ones: mha.kernels.quantize.dequantize)."""
    rows, scales = split(kept)
    return rows.to(dtype) if scales is None else dequantize(rows, scales, dtype)


def in_place_allowed() -> bool:
    """Whether a growing float cache may append into a Room now: nothing follows it but inference (no
    autograd, whose saved tensors an in-place write would change, and no torch.compile tracing it);
    else it concatenates."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def capacity(slots: int) -> int:
    """The slots a Room's new buffer has for ``slots`` filled ones: twice as many, at most RESERVE more."""
    return slots + min(slots, RESERVE)


class Room:
    """A growing cache's buffer (B, H, capacity, W) and how many of its slots are filled: ``append``
    writes a step's rows into it where a concatenation would copy the whole cache.

        room = Room()
        keys = room.append(keys, new_keys)   # keys then new_keys along the length (a view of the buffer)

    The rows go in place where ``kept`` is the room's filled slots as append last returned them (the
    whole buffer's batch and heads, its strides, ending at the filled count), with room left; anything
    else (a crop, a batch selected, another room's tensor, a caller's own) is copied with the new rows
    into a new buffer (``capacity``: twice the S + L slots, at most RESERVE more), never written into. So
    a step writes L rows and the whole cache is copied once every RESERVE slots (doubling up to them:
    a short prompt's buffers hold at most twice its bytes), and a shallow copy of a cache sharing its
    room stays right: the first to append writes in place, the other then copies. For inference: the
    views append returned before are the buffer, so they stay valid as its filled slots only (later
    rows go past them)."""

    __slots__ = ("buffer", "filled")

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.filled = 0

    def append(self, kept: Tensor | None, new: Tensor) -> Tensor:
        """kept (B, H, S, W) then new (B, H, L, W) along the length, as the buffer's first S + L slots.
        kept None, or an empty tensor of another rank (transformers' layers start with one), is no slots."""
        if new.dim() != 4:
            raise ValueError(f"new rows must be (batch, heads, length, width), got shape {tuple(new.shape)}")
        if kept is None or kept.dim() != 4 and kept.numel() == 0:
            kept = new[:, :, :0]
        if kept.dim() != 4:
            raise ValueError(f"the kept rows must be (batch, heads, length, width), got shape {tuple(kept.shape)}")
        (B, H, S, W), L = kept.shape, new.shape[2]
        if (B, H, W) != (new.shape[0], new.shape[1], new.shape[3]) or kept.dtype != new.dtype or kept.device != new.device:
            raise ValueError(f"new rows {tuple(new.shape)} {new.dtype} on {new.device} do not follow the kept "
                             f"{tuple(kept.shape)} {kept.dtype} on {kept.device}: (batch, heads, width), dtype and "
                             "device must be the same")
        if not self._holds(kept, L):
            self.buffer = new.new_empty((B, H, capacity(S + L), W))
            self.buffer.narrow(2, 0, S).copy_(kept)
        self.buffer.narrow(2, S, L).copy_(new)
        self.filled = S + L
        return self.buffer.narrow(2, 0, S + L)

    def _holds(self, kept: Tensor, L: int) -> bool:
        """Whether ``kept`` is this room's filled slots, with room for L more that may be written here."""
        buffer = self.buffer
        return (buffer is not None and kept.data_ptr() == buffer.data_ptr() and kept.dtype == buffer.dtype
                and kept.device == buffer.device and kept.shape[2] == self.filled
                and (kept.shape[0], kept.shape[1], kept.shape[3]) == (buffer.shape[0], buffer.shape[1], buffer.shape[3])
                and kept.stride() == buffer.stride() and self.filled + L <= buffer.shape[2]
                and (torch.is_inference_mode_enabled() or not buffer.is_inference()))  # (torch refuses that write)
