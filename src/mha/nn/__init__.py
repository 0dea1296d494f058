"""Drop-in modules for torch.nn."""

from .multihead import MultiheadAttention

__all__ = ["MultiheadAttention"]
