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
    append(kept, new)    -> kept and new along T, in a buffer with room for more (a growing cache's
                            step writes its rows, not a copy of all it holds)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .quantize import dequantize, quantize_int8

__all__ = ["RESERVE", "SCALE_BYTES", "append", "load", "quantized", "split", "store", "width"]

SCALE_BYTES = 4  # a float32 scale, kept as four int8 after its row
RESERVE = 256  # slots a growing buffer keeps beyond those it holds (append)


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


def append(kept: Tensor | None, new: Tensor) -> Tensor:
    """kept (B, H, S, W) then new (B, H, L, W) along the length, as the first S + L slots of a buffer
    (B, H, capacity, W): new's rows written in place where kept is such a view with room for them (what
    append returned, or a crop of it), else kept and new copied into a buffer of the S + L slots and up
    to RESERVE more (a step then writes its L rows, and a growing cache copies all it holds once every
    RESERVE slots, not at every step as a concatenation does). For inference: the rows past S are
    overwritten, and tensors taken of them before (by a view of the buffer from before a crop) see the
    new rows. ``kept`` is what append returned (or a crop, a selection, a copy of it): a tensor of
    someone else's with room past its rows would be written into. kept None (or empty, as
    transformers' layers start) holds nothing yet: a new buffer, never new itself."""
    if new.dim() != 4:
        raise ValueError(f"new rows must be (batch, heads, length, width), got shape {tuple(new.shape)}")
    empty = kept is None or kept.numel() == 0
    if empty:
        kept = new[:, :, :0]
    B, H, S, W = kept.shape if kept.dim() == 4 else (None,) * 4
    L = new.shape[2]
    if (B, H, W) != (new.shape[0], new.shape[1], new.shape[3]) or kept.dtype != new.dtype or kept.device != new.device:
        raise ValueError(f"new rows {tuple(new.shape)} {new.dtype} on {new.device} do not follow the kept "
                         f"{tuple(kept.shape)} {kept.dtype} on {kept.device}: (batch, heads, width), dtype and "
                         "device must be the same")
    buffer = None if empty else _room(kept, L)
    if buffer is None:
        capacity = ((S + L) // RESERVE + 1) * RESERVE
        buffer = new.new_empty((B, H, capacity, W))
        buffer.narrow(2, 0, S).copy_(kept)
    buffer.narrow(2, S, L).copy_(new)
    return buffer.narrow(2, 0, S + L)


def _room(kept: Tensor, L: int) -> Tensor | None:
    """The buffer (B, H, capacity, W) whose first S slots ``kept`` (B, H, S, W) is, where it has room for L
    more: kept's strides those of a contiguous buffer of ``capacity`` slots, its storage holding them all;
    else None."""
    B, H, S, W = kept.shape
    capacity = kept.stride(1) // W if W else 0
    if S + L > capacity or kept.stride() != (H * capacity * W, capacity * W, W, 1):
        return None
    if kept.is_inference() and not torch.is_inference_mode_enabled():
        return None  # (made under inference_mode, written outside it: torch refuses the write)
    if kept.untyped_storage().nbytes() < (kept.storage_offset() + B * H * capacity * W) * kept.element_size():
        return None
    return kept.as_strided((B, H, capacity, W), kept.stride(), kept.storage_offset())
