"""The NumPy oracle: plain, float64-capable attention to read beside the paper.

See :mod:`mha.numpy.attention` for the formulas and the mask conventions, and
:mod:`mha.numpy.transformer` for the encoder block.
"""

from . import attention, transformer
from .attention import *  # noqa: F401,F403  (the names in attention.__all__)
from .transformer import *  # noqa: F401,F403

__all__ = attention.__all__ + transformer.__all__
