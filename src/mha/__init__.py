"""mha: multi-head attention from the formula to the kernel, proven equal to PyTorch.

    mha.numpy       the float64 NumPy oracle, readable beside the paper
    mha.functional  scaled_dot_product_attention, multi_head_attention_forward (torch's signatures)
    mha.nn          MultiheadAttention, a drop-in for torch.nn.MultiheadAttention
    mha.MultiHeadAttention  the general module: widths cq, ck, cv, dk, dv, do and h heads (seed 002),
                    GQA (num_kv_heads), RoPE, ALiBi, sliding windows, a KV cache
    mha.KVCache, mha.RotaryEmbedding
    mha.kernels     the attention contract, exact attention backends and the dispatch between them
    mha.positions   the one position rule: distances, bands (causal, windows), alignment, ALiBi
    mha.masks       the one place the caller's masks are validated and canonicalised
"""

from . import functional, kernels, masks, nn, numpy, positions
from .cache import KVCache
from .capture import capture_attention
from .nn import MultiHeadAttention
from .rope import RotaryEmbedding

__version__ = "0.1.0"

__all__ = ["KVCache", "MultiHeadAttention", "RotaryEmbedding", "capture_attention", "functional", "kernels",
           "masks", "nn", "numpy", "positions", "__version__"]
