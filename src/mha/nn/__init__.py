"""Drop-ins for torch.nn: the same constructors, forwards, defaults, state_dict keys and shapes.

    MultiheadAttention          torch.nn.MultiheadAttention
    TransformerEncoderLayer     torch.nn.TransformerEncoderLayer
    TransformerDecoderLayer     torch.nn.TransformerDecoderLayer

The general module (free widths, GQA, RoPE, a KV cache) is mha.GeneralAttention.
"""

from .multihead_attention import MultiheadAttention
from .transformer import TransformerDecoderLayer, TransformerEncoderLayer

__all__ = ["MultiheadAttention", "TransformerDecoderLayer", "TransformerEncoderLayer"]
