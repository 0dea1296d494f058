"""The version of mha, in one place: a leaf every layer may import (pyproject.toml reads it too)."""

__version__ = "0.1.0"
