"""Record what a forward's attention calls did, for the explorer page.

    with mha.explorer.record(model) as recording:
        model(x)
    recording.calls[0].weights      # (B, H, L, S) the first call's weights

Every call of mha's dispatch (mha.kernels.attention) inside the block runs on the math backend and
is recorded whole: q, k, v, the contract's terms for each sequence, the weights and the output,
named after the innermost module of ``model`` that made it. That is what the page needs to break
a query's row down term by term and to check the sum against the real output. The drop-in, the
general module and transformers models with attn_implementation="mha" all go through the dispatch.

Shapes (the package legend): B batch, H query heads, Hkv key/value heads, L queries, S keys,
D / Dv per-head widths.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .. import positions
from ..kernels import dispatch
from ..kernels.contract import Contract, undeclared

__all__ = ["AttentionCall", "Recording", "capture_attention", "record"]


@dataclass(frozen=True)
class AttentionCall:
    """One attention call, batch-first with one batch dim; tensors detached, float32, on the CPU.

    weights:       (B, H, L, S) after the softmax (and dropout, in training)
    q, k, v, out:  (B, H, L, D), (B, Hkv, S, D), (B, Hkv, S, Dv), (B, H, L, Dv); None for weights
                   captured without them (mha.capture_attention)
    scale:         the factor of q . k
    softcap:       logit soft-capping c, or None
    alibi_slopes:  (H,) or None;  sinks: (H,) sink logits, or None
    q_pos, k_pos:  (B, L), (B, S) int64 positions (what ALiBi's distances are taken between)
    placed:        whether the contract places them (a band, ALiBi or per-sequence positions); if
                   not, they are 0..L-1 and 0..S-1, whatever the sequence (a plain decoding step)
    hidden:        {what hides keys: "causal" or "window (left, right)", "padding", "mask"}: each
                   (B, H|1, L, S) bool, True where it hides the key
    dtype:         the dtype the call ran in ("float32", "bfloat16", ...): how closely the page's
                   recomputation can match
    dropout_p:     the call's dropout (training mode): its weights are after dropout
    additive:      (B, H|1, L, S) the caller's float mask, added to the scores, or None
    """
    name: str
    weights: Tensor
    q: Tensor | None = None
    k: Tensor | None = None
    v: Tensor | None = None
    out: Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    alibi_slopes: Tensor | None = None
    sinks: Tensor | None = None
    placed: bool = False
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    hidden: dict[str, Tensor] = field(default_factory=dict)
    additive: Tensor | None = None
    dtype: str = "float32"
    dropout_p: float = 0.0

    @property
    def detailed(self) -> bool:
        """Whether the call holds what a row's breakdown needs (q, k, v and the output)."""
        return self.q is not None


@dataclass
class Recording:
    """The attention calls of one or more forwards, in the order they ran."""
    calls: list[AttentionCall] = field(default_factory=list)

    @classmethod
    def from_weights(cls, maps: dict[str, list[Tensor]]) -> Recording:
        """Weights captured by mha.capture_attention ({module name: [(B, H, L, S) per call]}): the
        page shows the maps; a row's breakdown needs a recording (mha.explorer.record)."""
        if not isinstance(maps, dict) or not maps:
            raise ValueError("expected mha.capture_attention's dict {module name: [weights (B, H, L, S), ...]} "
                             f"with at least one entry, got {type(maps).__name__} {'empty' if not maps else ''}")
        calls = []
        for name, weights in maps.items():
            for index, w in enumerate(weights):
                if not isinstance(w, Tensor) or w.dim() != 4:
                    raise ValueError(f"captured weights of {name!r} must be (B, H, L, S) tensors, got "
                                     f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}")
                label = name if len(weights) == 1 else f"{name} (call {index})"
                calls.append(AttentionCall(label, w.detach().float().cpu()))
        return cls(calls)


class _Watch:
    """Watches the dispatch (mha.kernels.dispatch.OBSERVERS) inside a ``with`` block and names each
    call after the innermost module running it: of ``model`` when given (a call made outside it is
    ``None``), of any module otherwise. The one observation hook: :class:`record` and
    :class:`capture_attention` differ only in what they keep of a call."""

    def __init__(self, model: nn.Module | None = None) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        self.model = model
        self._stack: list[str] = []
        self._hooks: list = []

    def __enter__(self):
        if self.model is not None:
            for name, module in self.model.named_modules():
                self._hooks.append(module.register_forward_pre_hook(
                    lambda _m, _a, name=name: self._stack.append(name or type(self.model).__name__)))
                self._hooks.append(module.register_forward_hook(self._leave, always_call=True))
        else:  # every module: named by its class and identity
            self._hooks.append(nn.modules.module.register_module_forward_pre_hook(
                lambda m, _a: self._stack.append(f"{type(m).__name__}@{id(m):x}")))
            self._hooks.append(nn.modules.module.register_module_forward_hook(self._leave, always_call=True))
        dispatch.OBSERVERS.append(self._observe)
        return self._kept()

    def __exit__(self, *exc) -> None:
        dispatch.OBSERVERS.remove(self._observe)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _leave(self, *_) -> None:  # a forward hook: returns None, which keeps the module's output
        self._stack.pop()

    def _running(self) -> str | None:
        """The innermost module running (the model itself by its class name), or None."""
        return self._stack[-1] if self._stack else None

    def _kept(self):
        raise NotImplementedError

    def _observe(self, q, k, v, contract, out, weights, *, dropout_p=0.0) -> None:
        raise NotImplementedError


class record(_Watch):  # noqa: N801  (used like a function: with record(model) as recording)
    """Record every attention call made inside the block (see the module docstring). ``model``
    names the calls after its modules; a call made outside them is named by its order."""

    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__(model)
        self.recording = Recording()

    def _kept(self) -> Recording:
        return self.recording

    def _observe(self, q: Tensor, k: Tensor, v: Tensor, contract: Contract, out: Tensor, weights: Tensor, *,
                 dropout_p: float = 0.0) -> None:
        name = self._running() if self.model is not None else None
        name = name or f"call {len(self.recording.calls)}"
        self.recording.calls.append(call_of(name, q, k, v, contract, out, weights, dropout_p=dropout_p))


class capture_attention(_Watch):  # noqa: N801  (used like a function: with capture_attention(...))
    """Capture the per-head attention weights of every attention call in a forward (as seed 003
    keeps ``self.attn``):

        with mha.capture_attention(model) as maps:
            model(x)
        maps["layers.0.self_attn"]  # [(B, H, L, S) weights of each call]

    Calls are named after the innermost module of ``model`` that made them (calls outside it are
    not kept); without a model, after any module ("MultiheadAttention@7f..."), and "attention" for
    a call made outside every module (a function, or forward_with_weights called directly). Inside the block
    every call runs on the math backend (the dispatch's observers); outside, nothing changes. An
    unbatched call's weights are (1, H, L, S). For q, k, v, positions and the terms of each call,
    see :class:`record`."""

    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__(model)
        self.maps: dict[str, list[Tensor]] = defaultdict(list)

    def _kept(self) -> dict[str, list[Tensor]]:
        return self.maps

    def _observe(self, q, k, v, contract, out, weights, *, dropout_p=0.0) -> None:
        name = self._running() or (None if self.model is not None else "attention")
        if name is not None:
            heads = weights.detach()
            self.maps[name].append(heads.reshape(-1, *heads.shape[-3:]))  # (..., H, L, S) -> (B, H, L, S)


# the terms a row's breakdown shows (page.js); a call with any other (the caller's functions, logit_scale) is refused
EXPLAINS = frozenset({"band", "positions", "key_valid", "mask", "alibi_slopes", "scale", "softcap", "sinks"})


def call_of(name: str, q: Tensor, k: Tensor, v: Tensor, contract: Contract, out: Tensor,
            weights: Tensor, *, dropout_p: float = 0.0) -> AttentionCall:
    """An AttentionCall of one dispatch call: q (..., H, L, D) with any batch dims (none: one sequence)."""
    if q.dim() < 3:
        raise ValueError(f"the explorer records calls with a head dim: q (..., H, L, D), got shape {tuple(q.shape)}")
    if extra := undeclared(EXPLAINS, contract, "its breakdown"):
        raise ValueError(f"the explorer breaks a score down into the terms it knows, and {extra}: this call cannot "
                         "be recorded (mha.capture_attention records its weights)")
    batch = q.shape[:-3]
    sequences = math.prod(batch)

    def flat(x: Tensor) -> Tensor:  # (*batch, H, T, D) -> (B, H, T, D) in float32 on the CPU
        return x.detach().reshape(sequences, *x.shape[-3:]).float().cpu()

    q4, k4, v4, out4, w4 = (flat(x.expand(*batch, *x.shape[-3:])) for x in (q, k, v, out, weights))
    B, _, L, S = w4.shape
    q_pos, k_pos = _positions(contract, B, L, S)
    return AttentionCall(
        name, w4, q4, k4, v4, out4, scale=contract.scale_for(q.shape[-1]), softcap=contract.softcap,
        alibi_slopes=None if contract.alibi_slopes is None else contract.alibi_slopes.detach().float().cpu(),
        sinks=None if contract.sinks is None else contract.sinks.detach().float().cpu(),
        placed=contract.positions is not None or contract.needs_positions, q_pos=q_pos, k_pos=k_pos,
        hidden=_hidden(contract, batch, B, L, S),
        additive=_additive(contract, batch, B, L, S), dtype=str(q.dtype).removeprefix("torch."),
        dropout_p=float(dropout_p))


def _positions(contract: Contract, B: int, L: int, S: int) -> tuple[Tensor, Tensor]:
    """(B, L), (B, S) positions of the queries and keys, as the contract places them."""
    if contract.positions is not None:
        q_pos, k_pos = contract.positions  # (B|1, L), (B|1, S)
        return q_pos.cpu().expand(B, L).clone(), k_pos.cpu().expand(B, S).clone()
    q_pos, k_pos = positions.aligned(range(L), range(S), contract.offset)  # (L,), (S,)
    return q_pos.expand(B, L).clone(), k_pos.expand(B, S).clone()


def _hidden(contract: Contract, batch, B: int, L: int, S: int) -> dict[str, Tensor]:
    """What hides keys, term by term: {term name: (B, H|1, L, S) bool, True = hidden}, from the
    contract's own rules (its band over the positions, its padding, a bool mask)."""
    rows, cols = positions.whole(L), positions.whole(S)
    terms = {}
    if contract.band is not None:
        _, band_hidden = contract.position_terms(contract.distances(rows, cols, "cpu"), torch.float32)
        terms[_band_name(contract.band)] = band_hidden
    if contract.key_valid is not None:
        terms["padding"] = ~contract.key_valid[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
    if contract.mask is not None and contract.mask.dtype == torch.bool:
        terms["mask"] = ~contract.mask  # True = attend -> True = hidden
    return {name: _per_sequence(hidden.cpu(), batch, B, L, S) for name, hidden in terms.items()}


def _band_name(band) -> str:
    """"causal", or flash-attn's "window (left, right)" (inf: unbounded on that side)."""
    if band.is_causal:
        return "causal"
    left, right = ("inf" if reach is None else str(reach) for reach in (band.left, band.right))
    return f"window ({left}, {right})"


def _additive(contract: Contract, batch, B: int, L: int, S: int) -> Tensor | None:
    mask = contract.mask
    if mask is None or mask.dtype == torch.bool:
        return None
    return _per_sequence(mask.detach().float().cpu(), batch, B, L, S)


def _per_sequence(x: Tensor, batch, B: int, L: int, S: int) -> Tensor:
    """x broadcastable to (*batch, H, L, S) -> (B, heads, L, S), heads 1 when it is the same for all."""
    if x.dim() > len(batch) + 3:  # more leading dims than the call had: they are all 1
        x = x.reshape(x.shape[-(len(batch) + 3):])
    heads = x.shape[-3] if x.dim() >= 3 else 1
    x = x.expand(*batch, heads, L, S)  # (*batch, heads, L, S)
    return x.reshape(B, heads, L, S).clone()  # (*batch, heads, L, S) -> (B, heads, L, S)
