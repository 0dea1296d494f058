"""The parity matrix: mha.nn.MultiheadAttention against torch and the float64 NumPy oracle.

One :class:`Case` is one configuration of the module, its inputs and masks. :func:`run_case`
runs it in float64 and float32 and measures the max abs error of the output, the returned
weights and the gradients (inputs and every parameter) against the oracle:

    float64: ours vs oracle <= 1e-10 (and torch vs oracle too, which checks the oracle)
    float32: ours vs oracle <= 2 * (torch float32 vs oracle) + 1e-6 * max(1, max |oracle|)

The float32 slack scales with the size of the quantity: a gradient summed over a batch can be
~30, where one float32 rounding step is already ~3e-6.

The tests and ``mha verify`` both run cases through here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import _checks
from .. import numpy as oracle
from .._version import __version__
from ..nn import MultiheadAttention

FP64_TOL = 1e-10
FP32_FACTOR, FP32_SLACK = 2.0, 1e-6
MASK_KINDS = ("none", "bool2d", "float2d", "bool3d", "float3d")
PADDING_KINDS = ("none", "bool", "float")
QUANTITIES = ("output", "weights", "grads")


@dataclass(frozen=True)
class Case:
    group: str = "any"
    num_heads: int = 2
    head_dim: int = 4
    kdim: int | None = None
    vdim: int | None = None
    bias: bool = True
    add_bias_kv: bool = False
    add_zero_attn: bool = False
    batch_first: bool = False
    batched: bool = True
    batch: int = 2
    L: int = 3
    S: int = 5
    self_attention: bool = False
    attn_mask: str = "none"
    key_padding_mask: str = "none"
    is_causal: bool = False
    need_weights: bool = True
    average_attn_weights: bool = True
    training: bool = False
    grad: bool = True
    backend: str = "auto"  # our module's backend attribute (mha.kernels)
    seed: int = 0

    def __post_init__(self):
        _checks.one_of("attn_mask", self.attn_mask, MASK_KINDS)
        _checks.one_of("key_padding_mask", self.key_padding_mask, PADDING_KINDS)

    @property
    def embed_dim(self) -> int:
        return self.num_heads * self.head_dim

    def consistent(self) -> Case:
        """The nearest valid case: self-attention needs S == L and kdim == vdim == embed_dim."""
        fixes = {}
        if self.self_attention:
            fixes.update(S=self.L, kdim=None, vdim=None)
        if not self.batched:
            fixes.update(batch=1)
        return dataclasses.replace(self, **fixes)

    def describe(self) -> str:
        on = [name for name in ("bias", "add_bias_kv", "add_zero_attn", "batch_first", "batched",
                                "self_attention", "is_causal", "need_weights",
                                "average_attn_weights", "training", "grad") if getattr(self, name)]
        on += [f"backend={self.backend}"] if self.backend != "auto" else []
        return (f"E={self.embed_dim} H={self.num_heads} kdim={self.kdim} vdim={self.vdim} N={self.batch} "
                f"L={self.L} S={self.S} attn_mask={self.attn_mask} key_padding_mask={self.key_padding_mask} "
                f"seed={self.seed} on={','.join(on)}")


@dataclass
class Result:
    case: Case
    errors: dict[str, float] = field(default_factory=dict)  # "fp64/output", "fp32/grads", ...
    limits: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


# ---------------------------------------------------------------------------------------------
# Building a case's module, inputs and masks (all in float64, from the case's seed)
# ---------------------------------------------------------------------------------------------


def randomize_biases(module: torch.nn.Module) -> torch.nn.Module:
    """Draw every bias from N(0, 1): attention modules start with zero biases, which would let a
    bias bug pass unseen."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return module


def numpy_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """A module's state_dict as NumPy arrays: the oracle's ``params``."""
    return {name: t.detach().cpu().numpy() for name, t in module.state_dict().items()}


def _modules(case: Case):
    """torch's module with random biases, and ours loaded from its state_dict."""
    options = dict(bias=case.bias, add_bias_kv=case.add_bias_kv, add_zero_attn=case.add_zero_attn,
                   kdim=case.kdim, vdim=case.vdim, batch_first=case.batch_first, dtype=torch.float64)
    theirs = randomize_biases(torch.nn.MultiheadAttention(case.embed_dim, case.num_heads, **options))
    ours = MultiheadAttention(case.embed_dim, case.num_heads, **options)
    ours.load_state_dict(theirs.state_dict())
    ours.backend = case.backend
    for m in (theirs, ours):
        m.train(case.training)
    return theirs, ours


def _shape(case: Case, length: int, width: int) -> tuple[int, ...]:
    if not case.batched:
        return (length, width)
    return (case.batch, length, width) if case.batch_first else (length, case.batch, width)


def _random_mask(kind: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Bool (True = masked out) or float (some -inf); the first key is never masked."""
    blocked = torch.rand(shape, generator=g, dtype=torch.float64) < 0.3
    blocked[..., 0] = False
    if kind.startswith("bool"):
        return blocked
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    return values.masked_fill(blocked, float("-inf"))


def _inputs(case: Case):
    g = torch.Generator().manual_seed(case.seed)
    E = case.embed_dim
    query = torch.randn(_shape(case, case.L, E), generator=g, dtype=torch.float64)
    if case.self_attention:
        key = value = query
    else:
        key = torch.randn(_shape(case, case.S, case.kdim or E), generator=g, dtype=torch.float64)
        value = torch.randn(_shape(case, case.S, case.vdim or E), generator=g, dtype=torch.float64)
    attn_mask = None
    if case.attn_mask != "none":
        first = (case.batch * case.num_heads,) if case.batched else (case.num_heads,)
        shape = (case.L, case.S) if case.attn_mask.endswith("2d") else (*first, case.L, case.S)
        attn_mask = _random_mask(case.attn_mask, shape, g)
    padding = None
    if case.key_padding_mask != "none":
        shape = (case.batch, case.S) if case.batched else (case.S,)
        padding = _random_mask(case.key_padding_mask, shape, g)
    return (query, key, value), attn_mask, padding


def _mask_for_torch(attn_mask, padding, case: Case):
    """torch ignores is_causal (or raises): hand it the causal mask explicitly, in attn_mask's form."""
    if not case.is_causal:
        return attn_mask
    future = torch.ones(case.L, case.S, dtype=torch.bool).triu_(1)  # True = masked out
    kind = attn_mask if attn_mask is not None else padding
    if kind is not None and kind.is_floating_point():
        causal = torch.zeros(case.L, case.S, dtype=torch.float64).masked_fill(future, float("-inf"))
        return causal if attn_mask is None else attn_mask + causal
    return future if attn_mask is None else attn_mask | future


# ---------------------------------------------------------------------------------------------
# Running a case
# ---------------------------------------------------------------------------------------------


def _run_module(module, inputs, *, attn_mask, padding, cotangents, case: Case, is_causal: bool, dtype):
    """Forward (and backward) in ``dtype``; returns (output, weights, grads by name) in float64."""
    module = module.to(dtype)
    module.zero_grad(set_to_none=True)
    leaves = {}
    if case.self_attention:
        x = inputs[0].to(dtype, copy=True).requires_grad_(case.grad)
        q = k = v = x
        leaves["query"] = x
    else:
        q, k, v = (t.to(dtype, copy=True).requires_grad_(case.grad) for t in inputs)
        leaves.update(query=q, key=k, value=v)
    masks = {"attn_mask": _float_to(dtype, attn_mask), "key_padding_mask": _float_to(dtype, padding)}
    with torch.set_grad_enabled(case.grad), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about mixed bool/float masks
        out, weights = module(q, k, v, need_weights=case.need_weights,
                              average_attn_weights=case.average_attn_weights, is_causal=is_causal,
                              **masks)
        grads = {}
        if case.grad:
            g_out, g_w = cotangents
            loss = (out * g_out.to(dtype)).sum()
            if weights is not None:
                loss = loss + (weights * g_w.to(dtype)).sum()
            loss.backward()
            grads = {name: t.grad for name, t in leaves.items()}
            grads.update({name: p.grad for name, p in module.named_parameters()})
    as64 = lambda t: None if t is None else t.detach().to(torch.float64)  # noqa: E731
    return as64(out), as64(weights), {n: as64(t) for n, t in grads.items()}


def _float_to(dtype, mask):
    """Float masks follow the run's dtype; bool masks stay bool."""
    return mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)


def _oracle(theirs, inputs, *, attn_mask, padding, cotangents, case: Case):
    params = numpy_state(theirs)
    arrays = [t.numpy() for t in inputs]
    options = dict(key_padding_mask=None if padding is None else padding.numpy(),
                   attn_mask=None if attn_mask is None else attn_mask.numpy(),
                   is_causal=case.is_causal, add_zero_attn=case.add_zero_attn,
                   batch_first=case.batch_first)
    out, weights = oracle.multi_head_attention(*arrays, params, case.num_heads,
                                               need_weights=case.need_weights,
                                               average_attn_weights=case.average_attn_weights,
                                               **options)
    grads = {}
    if case.grad:
        g_out, g_w = (t.numpy() for t in cotangents)
        grads = oracle.multi_head_attention_vjp(*arrays, params, case.num_heads, g_out,
                                                g_w if case.need_weights else None,
                                                average_attn_weights=case.average_attn_weights,
                                                **options)
        if case.self_attention:  # one tensor fed as query, key and value
            grads["query"] = grads["query"] + grads.pop("key") + grads.pop("value")
    return out, weights, grads


def _max_error(got, want) -> dict[str, float]:
    """Max abs error per quantity of (output, weights, grads) against the oracle's arrays."""
    out, weights, grads = got
    o_out, o_weights, o_grads = want
    errors = {"output": float(np.max(np.abs(out.numpy() - o_out)))}
    if o_weights is not None:
        errors["weights"] = float(np.max(np.abs(weights.numpy() - o_weights)))
    if o_grads:
        missing = set(o_grads) ^ set(grads)
        if missing:
            raise AssertionError(f"gradients missing for {sorted(missing)}")
        errors["grads"] = float(np.max([np.max(np.abs(grads[n].numpy() - o_grads[n])) for n in o_grads]))  # NaN wins
    return errors


def _magnitudes(want) -> dict[str, float]:
    """max(1, max |value|) of each oracle quantity: the scale of the float32 slack."""
    out, weights, grads = want
    arrays = {"output": [out], "weights": [] if weights is None else [weights], "grads": list(grads.values())}
    return {q: max([1.0] + [float(np.max(np.abs(a))) for a in arrays[q]]) for q in arrays if arrays[q]}


def run_case(case: Case) -> Result:
    """Run one case in float64 and float32 against torch and the oracle."""
    case = case.consistent()
    torch.manual_seed(case.seed)
    theirs, ours = _modules(case)
    inputs, attn_mask, padding = _inputs(case)
    torch_mask = _mask_for_torch(attn_mask, padding, case)
    cotangents = _cotangents(case, inputs)
    want = _oracle(theirs, inputs, attn_mask=attn_mask, padding=padding, cotangents=cotangents, case=case)
    magnitude = _magnitudes(want)
    result = Result(case)
    for dtype, tag in ((torch.float64, "fp64"), (torch.float32, "fp32")):
        common = dict(padding=padding, cotangents=cotangents, case=case, dtype=dtype)
        ours_err = _max_error(_run_module(ours, inputs, attn_mask=attn_mask, is_causal=case.is_causal, **common), want)
        torch_err = _max_error(_run_module(theirs, inputs, attn_mask=torch_mask, is_causal=False, **common), want)
        for quantity, err in ours_err.items():
            key = f"{tag}/{quantity}"
            limit = (FP64_TOL if tag == "fp64"
                     else FP32_FACTOR * torch_err[quantity] + FP32_SLACK * magnitude[quantity])
            result.errors[key], result.limits[key] = err, limit
            result.errors[f"torch-{key}"] = torch_err[quantity]
            if not err <= limit:
                result.failures.append(f"{key}: error {err:.3g} > limit {limit:.3g}")
            if tag == "fp64" and not torch_err[quantity] <= FP64_TOL:
                result.failures.append(f"torch-{key} (oracle check): {torch_err[quantity]:.3g} > {FP64_TOL}")
    return result


def _cotangents(case: Case, inputs):
    """Random upstream gradients for the output and the weights (fixed by the case's seed)."""
    g = torch.Generator().manual_seed(case.seed + 1)
    out_shape = inputs[0].shape
    n_first = () if not case.batched else (case.batch,)
    heads = () if case.average_attn_weights else (case.num_heads,)
    S = case.S + int(case.add_bias_kv) + int(case.add_zero_attn)
    w_shape = (*n_first, *heads, case.L, S)
    return (torch.randn(out_shape, generator=g, dtype=torch.float64),
            torch.randn(w_shape, generator=g, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# The default grid
# ---------------------------------------------------------------------------------------------

GROUPS: dict[str, dict] = {
    "self-attention (packed)": dict(self_attention=True),
    "cross-attention L!=S": dict(self_attention=False),
    "kdim != vdim != embed_dim": dict(self_attention=False, kdim="odd", vdim="odd"),
    "no bias": dict(bias=False),
    "add_bias_kv / add_zero_attn": dict(add_bias_kv="any", add_zero_attn="any"),
    "bool attn_mask (2-D, 3-D)": dict(attn_mask=("bool2d", "bool3d")),
    "float attn_mask (2-D, 3-D)": dict(attn_mask=("float2d", "float3d")),
    "key_padding_mask": dict(key_padding_mask=("bool", "float")),
    "is_causal": dict(is_causal=True),
    "unbatched": dict(batched=False),
    "batch_first": dict(batch_first=True),
    "per-head weights": dict(need_weights=True, average_attn_weights=False),
    "need_weights=False (fused)": dict(need_weights=False),
    "train mode": dict(training=True),
    "no_grad": dict(grad=False),
    "batch 1 / length 1": dict(batch=1, L=1),
    "native backend": dict(backend="native", need_weights=False),  # run where the native kernel is built
}


def groups() -> list[str]:
    """The groups this machine runs: all of GROUPS, the native backend's only where its kernel is
    built (building it on first use)."""
    from ..kernels import native
    return [g for g in GROUPS if GROUPS[g].get("backend") != "native" or native.native_available()]


def sample_case(rng: random.Random, group: str, seed: int) -> Case:
    """A random case of ``group``: the group's settings fixed, everything else drawn."""
    def pick(options):
        return options[rng.randrange(len(options))]

    drawn = dict(
        num_heads=pick((1, 2, 3, 4, 5, 8)), head_dim=pick((1, 2, 3, 4, 8)),
        kdim=pick((None, None, 3, 7)), vdim=pick((None, None, 5, 6)),
        bias=rng.random() < 0.8, add_bias_kv=rng.random() < 0.25, add_zero_attn=rng.random() < 0.25,
        batch_first=rng.random() < 0.5, batched=rng.random() < 0.85, batch=pick((1, 2, 3)),
        L=pick((1, 2, 3, 5, 8)), S=pick((1, 2, 4, 6, 9)), self_attention=rng.random() < 0.3,
        attn_mask=pick(MASK_KINDS), key_padding_mask=pick(PADDING_KINDS),
        is_causal=rng.random() < 0.25, need_weights=rng.random() < 0.7,
        average_attn_weights=rng.random() < 0.6, training=rng.random() < 0.5,
        grad=rng.random() < 0.8,
    )
    for name, setting in GROUPS[group].items():
        if setting == "any" or name == "backend":
            continue  # already drawn; the backend is set below
        if setting == "odd":
            drawn[name] = pick((1, 3, 5, 7, 11))
        elif isinstance(setting, tuple):
            drawn[name] = pick(setting)
        else:
            drawn[name] = setting
    if group == "cross-attention L!=S" and drawn["L"] == drawn["S"]:
        drawn["S"] += 1
    return Case(group=group, seed=seed, backend=GROUPS[group].get("backend", "auto"), **drawn).consistent()


def default_grid(per_group: int = 14, seed: int = 0) -> list[Case]:
    """The fixed, seeded grid of ``mha verify``: per_group cases in each of GROUPS."""
    rng = random.Random(seed)
    return [sample_case(rng, group, seed * 100_000 + i * 100 + j)
            for j, group in enumerate(groups()) for i in range(per_group)]


def run_grid(cases: list[Case]) -> Iterator[Result]:
    for case in cases:
        yield run_case(case)


def write_report(path: str, results: list[Result]) -> None:
    """Write {"summary": counts and versions, "cases": every case's errors, limits and verdict} as JSON."""
    rows = [{"case": r.case.__dict__, "errors": _json_numbers(r.errors), "limits": _json_numbers(r.limits),
             "passed": r.passed, "failures": r.failures} for r in results]
    summary = {"cases": len(results), "failed": sum(not r.passed for r in results),
               "versions": {"mha": __version__, "torch": torch.__version__, "numpy": np.__version__,
                            "python": platform.python_version()}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"summary": summary, "cases": rows}, f, indent=1, allow_nan=False)


def _json_numbers(values: dict[str, float]) -> dict[str, float | str]:
    """Errors as JSON allows them: a NaN or infinite error (a failure) is written as a string."""
    return {k: v if math.isfinite(v) else str(v) for k, v in values.items()}
