"""Capture the attention weights of mha modules during a forward (as seed 003 keeps ``self.attn``).

    with mha.capture_attention(model) as maps:
        model(x)
    maps["layers.0.self_attn"]  # [ (B, H, L, S) weights of each call, per head ]

Any mha.nn.MultiheadAttention or mha.GeneralAttention inside ``model`` (transformer layers
included) records its per-head weights while the block is active. Outside it the cost is one
check of an empty list per forward; inside, the modules run their weights path (math backend).
"""

from __future__ import annotations

from collections import defaultdict

from torch import Tensor, nn

__all__ = ["capture_attention"]

_ACTIVE: list[capture_attention] = []


class capture_attention:  # noqa: N801  (used like a function: with capture_attention(...))
    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model
        self.maps: dict[str, list[Tensor]] = defaultdict(list)
        self._names: dict[int, str] = {}

    def __enter__(self) -> dict[str, list[Tensor]]:
        if self.model is not None:
            self._names = {id(m): name or type(m).__name__ for name, m in self.model.named_modules()}
        _ACTIVE.append(self)
        return self.maps

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def _record(self, module: nn.Module, weights: Tensor) -> None:
        if self.model is not None and id(module) not in self._names:
            return  # a module outside the model being watched
        self.maps[self._names.get(id(module), f"{type(module).__name__}@{id(module):x}")].append(weights)


def recording() -> bool:
    return bool(_ACTIVE)


def record(module: nn.Module, weights: Tensor, batched: bool) -> None:
    """Hand per-head weights (B, H, L, S) (unbatched: (H, L, S)) to every active capture."""
    weights = (weights if batched else weights.unsqueeze(0)).detach()
    for capture in _ACTIVE:
        capture._record(module, weights)


def returned_weights(weights: Tensor, need_weights: bool, average: bool, batched: bool) -> Tensor | None:
    """What the caller asked for, from the per-head weights computed for the capture."""
    if not need_weights:
        return None
    return weights.mean(dim=1 if batched else 0) if average else weights  # (B, L, S) / (L, S)
