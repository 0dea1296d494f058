"""The NumPy oracle: plain, float64-capable attention to read beside the paper.

See :mod:`mha.numpy.attention` for the formulas and the mask conventions.
"""

from .attention import (
    causal_mask,
    multi_head_attention,
    multi_head_attention_vjp,
    scaled_dot_product_attention,
    softmax,
)

__all__ = [
    "softmax",
    "causal_mask",
    "scaled_dot_product_attention",
    "multi_head_attention",
    "multi_head_attention_vjp",
]
