"""The NumPy oracle: plain, float64-capable attention to read beside the paper.

See :mod:`mha.numpy.attention` for the formulas and the mask conventions,
:mod:`mha.numpy.contract` for the whole attention contract (bands, positions, ALiBi, softcap,
sinks) with its hand-written gradients, and :mod:`mha.numpy.transformer` for the encoder block.
"""

from . import attention, contract, transformer
from .attention import *  # noqa: F401,F403  (the names in attention.__all__)
from .contract import *  # noqa: F401,F403
from .transformer import *  # noqa: F401,F403

__all__ = attention.__all__ + contract.__all__ + transformer.__all__
