"""Exact attention backends sharing one signature, and the choice between them.

    backend(q, k, v, contract=None, *, dropout_p=0.0)
    q (..., L, D), k (..., S, D), v (..., S, Dv); contract: mha.kernels.Contract (the band,
    positions, masks, ALiBi, scale, softcap and sinks: everything that shapes the scores)

`math` returns (output, weights); the others return the output. `native` is the project's own
compiled CPU kernel (csrc/native.cpp, built on first use: every term of the contract, forward and
backward, fp32 accumulation, decoding and a packed variable-length layout, varlen_attention);
`flash` is the same algorithm in readable torch ops (the reference); `sdpa` is torch's fused
kernel, for the contracts it can express. :func:`choose_backend` picks one and says why.
"""

from __future__ import annotations

from .contract import Contract
from .dispatch import BACKENDS, attention, choose_backend
from .flash import flash_attention, flash_attention_with_lse
from .math import math_attention, safe_softmax
from .merge import merge_attention
from .native import native_attention, native_attention_with_lse, native_available, varlen_attention
from .sdpa import sdpa_attention

__all__ = ["BACKENDS", "Contract", "attention", "choose_backend", "flash_attention", "flash_attention_with_lse",
           "math_attention", "merge_attention", "native_attention", "native_attention_with_lse", "native_available",
           "safe_softmax", "sdpa_attention", "varlen_attention"]
