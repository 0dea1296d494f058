"""The NumPy oracle: plain, float64-capable attention to read beside the paper.

See :mod:`mha.numpy.attention` for the formulas and the mask conventions.
"""

from . import attention
from .attention import *  # noqa: F401,F403  (the names in attention.__all__)

__all__ = attention.__all__
