"""Modules: drop-ins for torch.nn, and the general multi-head attention of seed 002."""

from .general import MultiHeadAttention
from .multihead import MultiheadAttention
from .transformer import TransformerDecoderLayer, TransformerEncoderLayer

__all__ = ["MultiheadAttention", "MultiHeadAttention", "TransformerEncoderLayer", "TransformerDecoderLayer"]
