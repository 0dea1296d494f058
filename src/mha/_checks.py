"""Argument checks shared by every entry point.

Each raises TypeError (wrong kind or dtype) or ValueError (wrong value or shape) with a message
that names the argument, says what it got and what was expected.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch
from torch import Tensor


class DivisibilityError(ValueError, AssertionError):
    """embed_dim not divisible by num_heads: a ValueError, and an AssertionError as torch raises."""


class ShapeError(ValueError, AssertionError):
    """A tensor of the wrong rank or shape: a ValueError, and an AssertionError as torch's
    MultiheadAttention raises (so code and tests written against torch catch it)."""


def tensor(name: str, x) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_nested:
        raise TypeError(f"{name} is a nested tensor; mha expects dense tensors (pad and pass a mask)")
    return x


def nested(x) -> bool:
    """Whether x is a nested tensor (torch.nested, any layout); False for anything else."""
    return getattr(x, "is_nested", False) is True


def floating(name: str, x) -> Tensor:
    tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating point dtype, got {x.dtype}")
    return x


def rank(name: str, x: Tensor, allowed: Sequence[int], meaning: str = "") -> Tensor:
    if x.dim() not in allowed:
        want = " or ".join(f"{r}-D" for r in allowed)
        extra = f" {meaning}" if meaning else ""
        raise ShapeError(f"{name} must be {want}{extra}, got {x.dim()}-D with shape {tuple(x.shape)}")
    return x


def shape(name: str, x: Tensor, expected: Sequence[int], meaning: str = "") -> Tensor:
    if tuple(x.shape) != tuple(expected):
        extra = f" {meaning}" if meaning else ""
        raise ShapeError(f"{name} must have shape {tuple(expected)}{extra}, got {tuple(x.shape)}")
    return x


def per_head(name: str, x: Tensor | None, num_heads: int, like: Tensor,
             meaning: str = "(num_heads,): one value per query head (dim -3 of query)") -> Tensor | None:
    """ALiBi slopes, sinks: a floating (num_heads,) tensor on the query's (``like``'s) device, or None."""
    if x is None:
        return None
    floating(name, x)
    shape(name, x, (num_heads,), meaning)
    if x.device != like.device:
        raise ValueError(f"{name} is on device {x.device} but query is on {like.device}")
    return x


def shared_heads(query_heads: int, name: str, heads: int, *, dim: int, option: str = "") -> None:
    """Key/value heads shared by groups of query heads (GQA/MQA): ``heads`` (of ``name``) divides the
    query heads (dim ``dim`` of the query); ``option`` names the argument that asked for sharing."""
    if heads == 0 or query_heads % heads:
        asked = f"with {option} " if option else ""
        raise ValueError(f"{asked}the query heads (dim {dim}: {query_heads}) must be a multiple of {name}'s heads ({heads})")


def same_dtype_device(reference_name: str, reference: Tensor, **others: Tensor | None) -> None:
    """Every tensor in ``others`` has the dtype and device of ``reference``."""
    for name, x in others.items():
        if x is None:
            continue
        if x.dtype != reference.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but {reference_name} has dtype {reference.dtype}; "
                "they must match (convert one with .to(dtype))"
            )
        if x.device != reference.device:
            raise ValueError(
                f"{name} is on device {x.device} but {reference_name} is on {reference.device}; "
                "they must be on the same device"
            )


def integer(name: str, value) -> int:
    """``value`` as an int (Python or NumPy integers); TypeError for anything else, bool included."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})") from None


def positive_int(name: str, value) -> int:
    value = integer(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be greater than 0, got {value}")
    return value


def real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    return float(value)


def optional_real(name: str, value) -> float | None:
    return None if value is None else real(name, value)


def optional_finite_real(name: str, value) -> float | None:
    """A real number that is not NaN or infinite (zero and negative are valid: attention's scale), or None."""
    if value is None:
        return None
    value = real(name, value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def flag(name: str, value) -> bool:
    """A bool, and only a bool: a truthy string such as "no" is refused."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def one_of(name: str, value, choices: Sequence):
    """``value`` if it is one of ``choices``; the one wording of a choice among names."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def optional_positive_real(name: str, value) -> float | None:
    if value is None:
        return None
    value = real(name, value)
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number greater than 0, got {value}")
    return value


def probability(name: str, p) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(p).__name__} ({p!r})")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {p}")
    return float(p)


def divisible(embed_dim: int, num_heads: int) -> int:
    """The head dim embed_dim // num_heads; raises when num_heads does not divide embed_dim."""
    if embed_dim % num_heads:
        raise DivisibilityError(
            f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} and num_heads={num_heads}"
        )
    return embed_dim // num_heads


def mask_dtype(name: str, mask: Tensor) -> Tensor:
    tensor(name, mask)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be a bool or floating point tensor, got dtype {mask.dtype}")
    return mask
