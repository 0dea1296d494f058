"""8-bit keys and values: one int8 row and one float scale per (token, head).

    data, scales = quantize_int8(x)          # x (..., D) float -> data (..., D) int8, scales (...,) float32
    x_hat = dequantize(data, scales, dtype)  # data * scales[..., None], in dtype

Symmetric, per row: scale = max |x| / 127 and data = round(x / scale), so every value keeps 8 bits of
its own row's range and dequantizes within scale / 2 of itself (a row of zeros: scale 0, data 0). A
row holding NaN or an infinity has a NaN scale: it dequantizes to NaN, as attention over such a key
gives NaN. Used by mha.KVCache(quantize="int8") and mha.PagedKVCache(quantize="int8"); the native
paged kernel reads the int8 rows and their scales where they lie (each row converted and scaled as
it is read), the math backend dequantizes, then attends (the reference).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dequantize", "quantize_int8"]

LEVELS = 127  # int8's symmetric range: -127 .. 127


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., D) floating -> (data (..., D) int8, scales (...,) float32), per row of D values. A row
    whose scale is not positive (zeros; NaN; a max too small for a float32 scale) keeps zeros. The
    native kernel's quantize_rows computes the same bytes in one call (mha.kernels.storage.store)."""
    wide = x.detach().float()
    amax = wide.abs().amax(dim=-1)  # (...,): NaN where a row holds NaN, inf where it holds an infinity
    scales = torch.where(torch.isfinite(amax), amax / LEVELS, float("nan"))
    kept = (scales > 0)[..., None]  # (...,) -> (..., 1): False for NaN too
    data = torch.where(kept, wide / torch.where(kept, scales[..., None], 1.0), 0.0).round_()
    return data.clamp_(-LEVELS, LEVELS).to(torch.int8), scales


def dequantize(data: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """data (..., D) int8, scales (...,) -> (..., D) in dtype (computed in float32, or float64 for float64)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (data.to(wide) * scales.to(wide)[..., None]).to(dtype)  # (...,) -> (..., 1)
