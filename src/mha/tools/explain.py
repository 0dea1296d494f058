"""One forward of torch.nn.MultiheadAttention, step by step, checked against torch's own.

Seed 000 walks torch's functional forward line by line; ``trace`` does it for any size: it
recomputes every step with plain tensor operations and compares each intermediate with the tensor
torch itself produced at that step. torch's intermediates are recorded by wrapping the functions
its forward calls (``linear``, ``torch.bmm``/``torch.baddbmm``, ``softmax``) for the duration of
one call, so what is compared is torch's actual computation, not a re-derivation.

Shapes follow torch's seq-first layout: L target length, N batch, E embed dim, h heads, d = E / h.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import layouts

__all__ = ["Step", "trace", "render_markdown", "render_rich"]


@dataclass
class Step:
    title: str
    code: str  # the line of computation, as one would write it
    value: Tensor
    torch_value: Tensor | None = None  # what torch computed at this step, if it has such a step
    note: str = ""

    @property
    def error(self) -> float | None:
        if self.torch_value is None:
            return None
        a, b = self.value.double(), self.torch_value.double()
        diff = torch.where(a == b, torch.zeros_like(a), (a - b).abs())  # equal infinities (masks) count as 0
        return float(diff.max())

    @property
    def matches(self) -> bool:
        return self.torch_value is None or (self.value.shape == self.torch_value.shape and self.error <= 1e-4 *
                                            max(1.0, float(self.torch_value.abs().max())))


@contextlib.contextmanager
def _record_torch_calls():
    """Record the outputs of torch's linear, bmm/baddbmm and softmax calls, in call order."""
    calls = {"linear": [], "bmm": [], "softmax": []}
    originals = {"linear": F.linear, "softmax": F.softmax, "bmm": torch.bmm, "baddbmm": torch.baddbmm}

    def wrap(kind, fn):
        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls[kind].append(out.detach().clone())
            return out
        return recorded

    F.linear, F.softmax = wrap("linear", originals["linear"]), wrap("softmax", originals["softmax"])
    torch.bmm, torch.baddbmm = wrap("bmm", originals["bmm"]), wrap("bmm", originals["baddbmm"])
    try:
        yield calls
    finally:
        F.linear, F.softmax = originals["linear"], originals["softmax"]
        torch.bmm, torch.baddbmm = originals["bmm"], originals["baddbmm"]


def _readable_module(E: int, h: int) -> torch.nn.MultiheadAttention:
    """Seed 000's readable weights: in_proj_weight = 1, 2, ..., 3E*E; out_proj = identity; no bias."""
    module = torch.nn.MultiheadAttention(E, h, bias=False)
    with torch.no_grad():
        module.in_proj_weight.copy_(torch.arange(1, 1 + 3 * E * E, dtype=torch.float32).view(3 * E, E))
        module.out_proj.weight.copy_(torch.eye(E))
    return module


def trace(*, embed_dim: int = 4, num_heads: int = 2, length: int = 2, batch: int = 0,
          readable: bool = False, causal: bool = False, seed: int = 0) -> list[Step]:
    """The steps of one self-attention forward (batch=0: unbatched input (L, E))."""
    E, h, L = embed_dim, num_heads, length
    if E % h:
        raise ValueError(f"embed_dim must be divisible by num_heads, got {E} and {h}")
    torch.manual_seed(seed)
    module = _readable_module(E, h) if readable else torch.nn.MultiheadAttention(E, h)
    module.train()  # with dropout 0: torch's explicit (bmm, softmax) path, not its fused eval kernel
    shape = (L, E) if batch == 0 else (L, batch, E)
    x = (torch.arange(51, 51 + math.prod(shape), dtype=torch.float32).view(shape) if readable
         else torch.randn(shape))
    mask = torch.ones(L, L, dtype=torch.bool).triu(1) if causal else None  # True = masked out
    with torch.no_grad(), _record_torch_calls() as calls:
        torch_out, torch_weights = module(x, x, x, attn_mask=mask, average_attn_weights=False)
    return _steps(module, x, mask=mask, calls=calls, torch_out=torch_out, torch_weights=torch_weights)


def _steps(module, x, *, mask, calls, torch_out, torch_weights) -> list[Step]:
    E, h = module.embed_dim, module.num_heads
    d, L, N = E // h, x.shape[0], (x.shape[1] if x.dim() == 3 else 1)  # x: (L, B, E) or unbatched (L, E)
    W, b = module.in_proj_weight.detach(), module.in_proj_bias
    b = None if b is None else b.detach()
    heads = layouts.per_head(module.state_dict(), h, layout="torch")
    steps = []
    X = x if x.dim() == 3 else x.unsqueeze(1)
    steps.append(Step("input, as (L, N, E)", "X = x.unsqueeze(1)  # unbatched (L, E) -> (L, 1, E)"
                      if x.dim() == 2 else "X = x  # (L, N, E)", X))
    proj = F.linear(X, W, b)
    steps.append(Step("in-projection: X W^T + b, all of q, k, v at once",
                      "proj = X @ in_proj_weight.T + in_proj_bias  # (L, N, 3E)",
                      proj, _torch_in_projection(calls["linear"], E),
                      note=f"in_proj_weight packs W_q, W_k, W_v along dim 0; torch applies linear(), which "
                           f"multiplies by the TRANSPOSE. Head 0's W_0^Q (E x d) =\n{heads.W_q[0]}"))
    per_head_matrices = torch.stack([torch.stack(ws) for ws in (heads.W_q, heads.W_k, heads.W_v)])
    steps.append(Step("the per-head matrices this corresponds to",
                      "W_i^Q, W_i^K, W_i^V = in_proj_weight.chunk(3)[0|1|2].T.split(d, dim=1)[i]",
                      per_head_matrices, note="[0] W_i^Q, [1] W_i^K, [2] W_i^V for head i = 0.. along dim 1; "
                                              "each (E, d): column block i of the transposed weight"))
    q, k, v = proj.chunk(3, dim=-1)
    steps.append(Step("split into q, k, v", "q, k, v = proj.chunk(3, dim=-1)  # each (L, N, E)", q))
    q_h, k_h, v_h = (t.reshape(L, N * h, d).transpose(0, 1) for t in (q, k, v))
    steps.append(Step("per-head split", "q = q.view(L, N*h, d).transpose(0, 1)  # (N*h, L, d): heads join the batch",
                      q_h, note="row n*h + i holds head i of batch item n"))
    q_scaled = q_h * math.sqrt(1.0 / d)
    steps.append(Step("scale the queries", f"q = q * (1 / sqrt(d))  # d = {d}", q_scaled))
    scores = q_scaled @ k_h.transpose(1, 2)
    if mask is not None:
        additive = torch.zeros(L, L).masked_fill(mask, float("-inf"))
        steps.append(Step("causal mask (additive)", "mask = zeros(L, L).masked_fill(triu(ones, 1), -inf)", additive))
        scores = scores + additive
    steps.append(Step("scores by batched matmul" + (" (plus the mask)" if mask is not None else ""),
                      "scores = torch.bmm(q, k.transpose(1, 2))" + (" + mask" if mask is not None else "")
                      + "  # (N*h, L, S)", scores, calls["bmm"][0]))
    weights = torch.softmax(scores, dim=-1)
    steps.append(Step("softmax over the keys", "weights = softmax(scores, dim=-1)  # rows sum to 1", weights,
                      calls["softmax"][0]))
    o = weights @ v_h
    steps.append(Step("weighted sum of the values", "o = torch.bmm(weights, v)  # (N*h, L, d)", o, calls["bmm"][1]))
    merged = o.transpose(0, 1).reshape(L * N, E)
    steps.append(Step("merge the heads", "o = o.transpose(0, 1).reshape(L * N, E)  # concat(head_1..head_h)", merged))
    out = F.linear(merged, module.out_proj.weight.detach(), _detached(module.out_proj.bias))
    steps.append(Step("out-projection", "out = o @ out_proj.weight.T + out_proj.bias  # (L*N, E)", out,
                      calls["linear"][-1]))
    final = out.view(L, N, E) if x.dim() == 3 else out.view(L, E)
    steps.append(Step("the output torch returns", "out.view(L, N, E)  # unbatched: (L, E)", final, torch_out))
    steps.append(Step("per-head weights torch returns", "weights.view(N, h, L, S)", weights.view(N, h, L, L).squeeze(0)
                      if x.dim() == 2 else weights.view(N, h, L, L), torch_weights))
    per_head = layouts.per_head_attention(x, x, x, heads, attn_mask=mask, batch_first=False)  # x: (L, B, E) or (L, E)
    steps.append(Step("the paper's per-head formula, a loop over heads",
                      "concat_i softmax(X W_i^Q (X W_i^K)^T / sqrt(d)) X W_i^V  W^O", per_head, torch_out,
                      note="the same output from the per-head matrices W_i^Q, W_i^K, W_i^V"))
    return steps


def _torch_in_projection(linear_calls: list[Tensor], E: int) -> Tensor:
    """torch projects packed (one (L, B, 3E) call) when query, key and value are one tensor; after
    unsqueezing unbatched input they are three tensors, so it makes three (L, B, E) calls."""
    first = linear_calls[0]
    return first if first.shape[-1] == 3 * E else torch.cat(linear_calls[:3], dim=-1)


def _detached(t):
    return None if t is None else t.detach()


def _values(t: Tensor, limit: int = 64) -> str:
    if t.numel() > limit:
        return f"({t.numel()} values, too many to show: min {t.min().item():.4g}, max {t.max().item():.4g})"
    return str(t.detach())


def render_markdown(steps: list[Step]) -> str:
    lines = ["# One forward of torch.nn.MultiheadAttention, step by step", ""]
    for i, step in enumerate(steps, 1):
        lines += [f"## {i}. {step.title}", "", "```python", step.code, "```", "",
                  f"shape: `{tuple(step.value.shape)}`", ""]
        if step.note:
            lines += [step.note, ""]
        lines += ["```text", _values(step.value), "```", ""]
        if step.torch_value is not None:
            verdict = "matches" if step.matches else "DIFFERS from"
            lines += [f"{verdict} torch's own result at this step (max |diff| = {step.error:.2e})", ""]
    return "\n".join(lines)


def render_rich(steps: list[Step], console) -> None:
    from rich.console import Group
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.text import Text

    for i, step in enumerate(steps, 1):
        parts = [Syntax(step.code, "python", theme="ansi_dark", background_color="default"),
                 Text(f"shape {tuple(step.value.shape)}", style="bold")]
        if step.note:
            parts.append(Text(step.note, style="dim"))
        parts.append(Text(_values(step.value)))
        if step.torch_value is not None:
            style = "green" if step.matches else "red"
            parts.append(Text(f"{'✓ equals' if step.matches else '✗ differs from'} torch's own result "
                              f"(max |diff| {step.error:.2e})", style=style))
        console.print(Panel(Group(*parts), title=f"{i}. {step.title}", title_align="left"))
