"""What every backend must do with a fuzz case, checked: ``check(case)`` lists what is wrong.

Properties (each finding's signature names one: kind:backend:property:dtype):

    equal       the output and every gradient within tolerance of the float64 reference
                (fuzz.reference: 2x torch's own error in the dtype, plus a rounding floor)
    nan         NaN exactly where the inputs' NaN and infinities reach (fuzz.reference), no
                infinity or NaN anywhere else
    repeat      bit-identical when the same call runs again (forward and backward)
    shape       the output's shape and dtype: the broadcast rule's
    raises      no exception but a ValueError saying the backend cannot run the call (named
                backends only; auto runs everything)
    refuse      bad arguments: every backend refuses with the same exception type, ValueError or
                TypeError (no crash deep in torch, no silent acceptance)

MHA_FUZZ_DEVICE (the driver's --device; default cpu): the device the calls run on. The cases are
drawn on the CPU and every tensor a call takes (inputs, masks, positions, pages) moves to the device
inside the call, so the gradients come back to the CPU leaves; the reference and torch's own
outcomes stay the CPU's (float64 NumPy-free reference; torch's CPU kernels as the yardstick). On
CUDA, repeat is not checked (torch's and FlexAttention's CUDA backward accumulate with atomics).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ...functional import scaled_dot_product_attention
from ...kernels import Contract, attention, native, paged_attention, varlen_attention
from ...kernels.dispatch import PAGED_BACKENDS
from ...positions import Band
from . import cases
from .cases import Case, attn_mask, band_of, generator, offset_of, per_head, qkv, sequence_positions, tensor
from .reference import Outcome, Spec, error, output_shape, reference, tolerance, torch_own

DEVICE = torch.device(os.environ.get("MHA_FUZZ_DEVICE", "cpu"))
# flex on CUDA only: on CPU it compiles each case anew (seconds) and has no backward
BACKENDS = ("math", "sdpa", "flash", "native", *(("flex",) if DEVICE.type == "cuda" else ()), "auto")
GRADIENTS = ("dq", "dk", "dv", "d_alibi", "d_sinks")


@dataclass(frozen=True)
class Finding:
    signature: str  # kind:backend:property:dtype, the same for every case that shows the same defect
    detail: str


def backends(*, kind: str = "sdpa") -> tuple[str, ...]:
    """The backends this machine has for a kind of case (native where its kernel is built): paged
    cases run mha.kernels.paged_attention's (PAGED_BACKENDS and auto), the others the dispatch's."""
    names = (*PAGED_BACKENDS, "auto") if kind == "paged" else BACKENDS
    return names if native.native_available() else tuple(b for b in names if b != "native")


def _dev(x):
    """A tensor a call captures, on the fuzz's device (the CPU's own when that is the CPU)."""
    return x if x is None else x.to(DEVICE)


def prepare(case: Case) -> Setup:
    """The case made ready to run on a backend (every kind but bad)."""
    return {"varlen": _varlen, "paged": _paged}.get(case.kind, _call)(case)


def check(case: Case, *, properties: tuple[str, ...] = ("equal", "nan", "repeat", "shape", "raises", "refuse")) -> list[Finding]:
    """What is wrong with the case on every backend (an empty list: nothing)."""
    if DEVICE.type == "cuda":
        properties = tuple(p for p in properties if p != "repeat")
    threads = torch.get_num_threads()
    torch.set_num_threads(case.threads)  # the kernels split their work by the threads they have
    try:
        return _check(case, properties)
    finally:
        torch.set_num_threads(threads)


def _check(case: Case, properties: tuple[str, ...]) -> list[Finding]:
    if case.kind == "bad":
        return _refusals(case) if "refuse" in properties else []
    ready = prepare(case)
    cotangent = None
    if case.grad and case.poison is None and case.kind != "paged":  # paged attention is inference only
        cotangent = tensor(ready.out_shape, "contiguous", ready.inputs[0].dtype, generator(case, 4))
    ref, own = ready.reference(cotangent), ready.torch_own(cotangent)
    findings = []
    for backend in backends(kind=case.kind):  # varlen and paged too: one call of the dispatch, on each backend
        findings += _one_backend(case, backend, ready, cotangent, ref, own, properties)
    return findings


class Setup(NamedTuple):
    """A case made ready: call(backend, q, k, v, slopes, sinks) -> output; its inputs; the output's
    shape; and the reference's and torch's own outcomes for a cotangent (or None: no gradients)."""
    call: Callable[..., Tensor]
    inputs: tuple
    out_shape: tuple[int, ...]
    reference: Callable[[Tensor | None], Outcome]
    torch_own: Callable[[Tensor | None], list[Outcome]]


def _sig(case: Case, backend: str, what: str) -> str:
    return f"{case.kind}:{backend}:{what}:{case.dtype}"


def _one_backend(case, backend, setup: Setup, cotangent, ref: Outcome, own: list[Outcome], properties) -> list[Finding]:
    call, inputs = setup.call, setup.inputs
    try:
        first = _run(call, backend, inputs, cotangent)
    except ValueError as refusal:
        if backend != "auto" and "cannot run this call" in str(refusal):
            return []  # a named backend that does not take the call says so (dispatch routes around it)
        return [Finding(_sig(case, backend, "raises:ValueError"), str(refusal))] if "raises" in properties else []
    except Exception as crash:  # anything else is a defect: a crash deep in torch, a ZeroDivisionError ...
        found = Finding(_sig(case, backend, f"raises:{type(crash).__name__}"), str(crash)[:300])
        return [found] if "raises" in properties else []
    found = []
    out, grads = first
    own = [o for o in own if o.backends is None or backend in o.backends]
    if "shape" in properties and (out.shape != ref.out.shape or out.dtype != inputs[0].dtype):
        return [Finding(_sig(case, backend, "shape"), f"got {tuple(out.shape)} {out.dtype}, expected "
                                                     f"{tuple(ref.out.shape)} {inputs[0].dtype}")]
    if "nan" in properties:
        found += _nan(case, backend, out, ref, [o.out for o in own])
    if "equal" in properties:
        found += _equal(case, backend, "out", out, ref.out, [o.out for o in own], ref.bounds.get("out", (0.0, 0.0)))
        for name in GRADIENTS:
            if name in ref.grads and name in grads:
                owns = [o.grads[name] for o in own if name in o.grads]
                found += _equal(case, backend, name, grads[name], ref.grads[name], owns, ref.bounds.get(name, (0.0, 0.0)))
    if "repeat" in properties:
        second = _run(call, backend, inputs, cotangent)
        if not all(_identical(a, b) for a, b in zip((out, *grads.values()), (second[0], *second[1].values()))):
            found.append(Finding(_sig(case, backend, "repeat"), "the same call gave different bits the second time"))
    return found


def _run(call, backend: str, inputs, cotangent) -> tuple[Tensor, dict[str, Tensor]]:
    """(output, gradients by name) of one call, the inputs taken as leaves in their own layouts."""
    leaves = [None if x is None else x.detach().requires_grad_(cotangent is not None) for x in inputs]
    out = call(backend, *(_dev(x) for x in leaves)).to("cpu")
    grads = {}
    if cotangent is not None and out.requires_grad:
        named = [(name, x) for name, x in zip(GRADIENTS, leaves) if x is not None]
        values = torch.autograd.grad(out, [x for _, x in named], cotangent, allow_unused=True)
        grads = {name: torch.zeros_like(x) if g is None else g for (name, x), g in zip(named, values)}
    return out.detach(), grads


def _equal(case, backend, name, ours: Tensor, ref: Tensor, owns: list[Tensor], bound: tuple[float, float]) -> list[Finding]:
    if ours.shape != ref.shape:
        return [Finding(_sig(case, backend, f"shape:{name}"), f"{name} {tuple(ours.shape)}, expected {tuple(ref.shape)}")]
    torch_error = max((error(own, ref) for own in owns), default=0.0)
    terms = max(case.L, case.S, *case.lengths, *case.k_lengths)  # the longest sum
    ours_error, allowed = error(ours, ref), tolerance(torch_error, bound, ours.dtype, terms)
    if ours_error > allowed or math.isnan(ours_error):
        return [Finding(_sig(case, backend, f"equal:{name}"), f"{name} error {ours_error:.3g} > {allowed:.3g} "
                                                              f"(torch's {torch_error:.3g}, size {bound[0]:.3g})")]
    unexpected = ~ours.isfinite() & ref.isfinite()
    if unexpected.any() and name != "out" and not any(_same_nan(ours, own) for own in owns):  # out: see _nan
        return [Finding(_sig(case, backend, f"nan:{name}"), f"{int(unexpected.sum())} non-finite values in {name} "
                                                            "where the reference is finite")]
    return []


def _same_nan(ours: Tensor, theirs: Tensor) -> bool:
    """Whether two results are non-finite at the same places (torch's kernel's own NaN, met again)."""
    return ours.shape == theirs.shape and torch.equal(~ours.isfinite(), ~theirs.isfinite())


def _nan(case, backend, out: Tensor, ref: Outcome, owns: list[Tensor]) -> list[Finding]:
    """NaN where an input's NaN reaches through visible keys, nowhere it cannot reach (fuzz.reference);
    or exactly where one of torch's own kernels puts them (the sdpa backend is torch's kernel)."""
    nan = ~out.isfinite()
    missing = ref.certain & ~nan
    fused = backend == "sdpa" or backend == "auto" and case.kind != "paged"  # paged's auto: native or math
    if fused:  # torch's fused kernel drops some (a query's NaN against 2 keys, float16 inf)
        missing = missing & False
    extra = nan & ~ref.possible & ref.out.isfinite()
    if (missing.any() or extra.any()) and any(_same_nan(out, own) for own in owns):
        return []
    found = []
    if missing.any():
        found.append(Finding(_sig(case, backend, "nan:missing"), f"{int(missing.sum())} outputs finite where a NaN "
                                                                 "input reaches them through visible keys"))
    if extra.any():
        found.append(Finding(_sig(case, backend, "nan:extra"), f"{int(extra.sum())} outputs NaN or infinite that "
                                                               "no NaN or infinite input reaches"))
    return found


def _identical(a: Tensor, b: Tensor) -> bool:
    """Bit for bit, NaN where NaN."""
    finite = (lambda x: x.nan_to_num(nan=0.0, posinf=1.0, neginf=-1.0))  # noqa: E731
    return a.shape == b.shape and torch.equal(finite(a), finite(b)) and torch.equal(a.isnan(), b.isnan())


# -- the calls ------------------------------------------------------------------------------------------


def _call(case: Case) -> Setup:
    """An sdpa case (mha.functional.scaled_dot_product_attention) or a positions case (mha.kernels.attention
    with per-sequence positions and key padding)."""
    q, k, v = qkv(case)
    slopes = per_head(case, 1) if case.alibi else None
    sinks = per_head(case, 2) if case.sinks else None
    band = band_of(case)
    if case.kind == "positions":
        q_pos, k_pos, key_valid = sequence_positions(case)
        terms = Spec(enable_gqa=True, scale=case.scale, band=band, q_pos=q_pos, k_pos=k_pos, key_valid=key_valid,
                      slopes=slopes, softcap=case.softcap, sinks=sinks)

        def call(backend, q, k, v, slopes, sinks):
            contract = Contract(band=Band(*band) if band else None, positions=(_dev(q_pos), _dev(k_pos)),
                                key_valid=_dev(key_valid),
                                alibi_slopes=slopes, scale=case.scale, softcap=case.softcap, sinks=sinks)
            return attention(q, k, v, contract, backend=backend)[0]
        expressible = False
    else:
        mask = attn_mask(case)
        offset = offset_of(case, case.L, case.S)
        terms = Spec(enable_gqa=case.enable_gqa, scale=case.scale, band=band, q_pos=torch.arange(case.L) + offset,
                      k_pos=torch.arange(case.S), mask=mask, slopes=slopes, softcap=case.softcap, sinks=sinks)

        def call(backend, q, k, v, slopes, sinks):
            return scaled_dot_product_attention(q, k, v, attn_mask=_dev(mask), is_causal=case.is_causal, scale=case.scale,
                                                enable_gqa=case.enable_gqa, backend=backend, causal_alignment=case.alignment,
                                                window=case.window, alibi_slopes=slopes, softcap=case.softcap, sinks=sinks)
        expressible = not (case.window or case.alibi or case.softcap or case.sinks) and (not case.is_causal or offset == 0)
    return Setup(call, (q, k, v, slopes, sinks), output_shape(q, k, v, terms.enable_gqa),
                 lambda cotangent: reference(q, k, v, terms, cotangent),
                 lambda cotangent: torch_own(q, k, v, terms, cotangent, expressible=expressible, is_causal=case.is_causal))


def _varlen(case: Case) -> Setup:
    """A varlen case: packed q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv); the reference and torch's
    own run per sequence (bottom-right aligned) and are packed again."""
    q, k, v = cases.packed(case, generator(case))
    slopes = per_head(case, 1) if case.alibi else None
    sinks = per_head(case, 2) if case.sinks else None
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)]) for n in (case.lengths, case.k_lengths))

    def call(backend, q, k, v, slopes, sinks):
        return varlen_attention(q, k, v, cu_q, cu_k, is_causal=case.is_causal, scale=case.scale, window=case.window,
                                alibi_slopes=slopes, softcap=case.softcap, sinks=sinks, backend=backend)

    ref, own = _per_sequence(case, q, k, v, slopes, sinks)
    return Setup(call, (q, k, v, slopes, sinks), (q.shape[0], q.shape[1], case.Dv), ref, own)


def _paged(case: Case) -> Setup:
    """A paged case: packed q (Tq, H, D) over the keys and values in the pool's pages (cases.pages);
    the reference and torch's own run per sequence on its keys as drawn (packed as varlen's), so a
    page read from the wrong place, or a slot past a sequence's keys, is seen."""
    g = generator(case)
    q, k, v = cases.poisoned(case, *cases.packed(case, g), g)
    k_pages, v_pages, table = cases.pages(case, k, v, g)
    slopes = per_head(case, 1) if case.alibi else None
    sinks = per_head(case, 2) if case.sinks else None
    cu_q = torch.tensor([0, *itertools.accumulate(case.lengths)])
    seqlens_k = torch.tensor(case.k_lengths)

    def call(backend, q, k_pages, v_pages, slopes, sinks):
        return paged_attention(q, k_pages, v_pages, table, cu_q, seqlens_k, is_causal=case.is_causal,
                               window=case.window, alibi_slopes=slopes, softcap=case.softcap, sinks=sinks,
                               scale=case.scale, backend=backend)

    ref, own = _per_sequence(case, q, k, v, slopes, sinks)
    return Setup(call, (q, k_pages, v_pages, slopes, sinks), (q.shape[0], q.shape[1], case.Dv), ref, own)


def _per_sequence(case: Case, q: Tensor, k: Tensor, v: Tensor, slopes, sinks) -> tuple[Callable, Callable]:
    """(reference, torch's own) of packed q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) whose sequences
    have case.lengths query rows and case.k_lengths keys: each sequence alone, bottom-right aligned,
    the outcomes packed again (_packed)."""
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)]) for n in (case.lengths, case.k_lengths))

    def per_sequence(runner, cotangent, **options):
        outcomes = []
        for b, (L, S) in enumerate(zip(case.lengths, case.k_lengths)):
            spans = ((q, cu_q), (k, cu_k), (v, cu_k))
            rows = [x[int(cu[b]):int(cu[b + 1])].transpose(0, 1) for x, cu in spans]  # (T, H, X) -> (H, T, X)
            terms = Spec(enable_gqa=True, scale=case.scale, band=band_of(case), q_pos=torch.arange(L) + S - L,
                          k_pos=torch.arange(S), slopes=slopes, softcap=case.softcap, sinks=sinks)
            part = None if cotangent is None else cotangent[int(cu_q[b]):int(cu_q[b + 1])].transpose(0, 1)  # (H, L, Dv)
            outcomes.append(runner(*rows, terms, part, **options))
        return outcomes

    def own(cotangent):  # torch's formula packed, and its fused kernel where every sequence has it
        parts = per_sequence(torch_own, cotangent, expressible=False, is_causal=case.is_causal)
        packed_own = [_packed([o[0] for o in parts], q, k, v)]
        if parts and all(len(o) > 1 for o in parts):
            packed_own.append(_packed([o[-1] for o in parts], q, k, v))
        for whole in _over_the_packing(case, q, k, v, slopes, sinks, cotangent):
            packed_own.append(dataclasses.replace(_packed([whole], q, k, v), backends=("sdpa", "auto")))
        return packed_own

    return (lambda cotangent: _packed(per_sequence(reference, cotangent), q, k, v)), own


def _over_the_packing(case: Case, q: Tensor, k: Tensor, v: Tensor, slopes, sinks, cotangent) -> list[Outcome]:
    """torch's own over a varlen call's whole packing in one call, as the sdpa backend (and auto where it
    takes it) gives it to torch: each sequence's keys apart by a block-diagonal mask, its positions
    bottom-right; (H, T, X) outcomes, which only those backends are allowed (Outcome.backends). Its fused
    kernel's dV at large logits is not the one over each sequence alone (a saturated softmax, scores
    near 700: 2.0e-5 against 3.7e-9 of float64's). None for paged calls (no backend hands torch their
    packing), inputs with a NaN or an infinity (torch's call over the packing spreads it to every
    sequence: a leak between sequences must stay visible), ALiBi, a softcap or sinks (no mask folds them)."""
    if (case.kind != "varlen" or slopes is not None or sinks is not None or case.softcap is not None
            or not all(x.isfinite().all() for x in (q, k, v))):
        return []
    sequence = torch.arange(len(case.lengths))
    q_seq, k_seq = (sequence.repeat_interleave(torch.tensor(n, dtype=torch.long)) for n in (case.lengths, case.k_lengths))
    q_pos = torch.cat([torch.arange(L) + S - L for L, S in zip(case.lengths, case.k_lengths)] or [torch.zeros(0)]).long()
    k_pos = torch.cat([torch.arange(S) for S in case.k_lengths] or [torch.zeros(0)]).long()
    terms = Spec(enable_gqa=True, scale=case.scale, band=band_of(case), q_pos=q_pos, k_pos=k_pos,
                 mask=q_seq[:, None] == k_seq[None, :])
    part = None if cotangent is None else cotangent.transpose(0, 1)  # (T, H, Dv) -> (H, T, Dv)
    return torch_own(*(x.transpose(0, 1) for x in (q, k, v)), terms, part, expressible=False, is_causal=case.is_causal)


def _packed(outcomes: list[Outcome], q: Tensor, k: Tensor, v: Tensor) -> Outcome:
    """Per-sequence outcomes (H, T, X) packed as (T, H, X), their NaN zones too; per-head gradients summed."""
    def cat(tensors, like):
        parts = [t.transpose(0, 1) for t in tensors]  # (H, T, X) -> (T, H, X)
        return torch.cat(parts) if parts else like.new_zeros(0, *like.shape[1:])
    out = cat([o.out for o in outcomes], q.new_zeros(0, q.shape[1], v.shape[-1], dtype=torch.float64))
    zones = [cat([torch.zeros(o.out.shape, dtype=torch.bool) if getattr(o, name) is None else getattr(o, name)
                  for o in outcomes], out.bool()) for name in ("certain", "possible")]  # torch's own have none
    packed = Outcome(out=out, certain=zones[0], possible=zones[1])
    if outcomes and outcomes[0].grads:
        for name, like in (("dq", q), ("dk", k), ("dv", v)):
            packed.grads[name] = cat([o.grads[name] for o in outcomes], like.new_zeros(0, *like.shape[1:]))
        for name in ("d_alibi", "d_sinks"):
            if name in outcomes[0].grads:
                packed.grads[name] = sum(o.grads[name] for o in outcomes)
    for name in ("out", "dq", "dk", "dv"):
        packed.bounds[name] = tuple(max((o.bounds.get(name, (0.0, 0.0))[i] for o in outcomes), default=0.0) for i in (0, 1))
    for name in ("d_alibi", "d_sinks"):
        packed.bounds[name] = tuple(sum(o.bounds.get(name, (0.0, 0.0))[i] for o in outcomes) for i in (0, 1))
    return packed


# -- bad arguments ------------------------------------------------------------------------------------


def _refusals(case: Case) -> list[Finding]:
    """Every backend refuses the bad argument the same way (ValueError or TypeError)."""
    arguments = _bad_arguments(case)
    outcomes = {}
    for backend in backends():
        try:
            scaled_dot_product_attention(**arguments, backend=backend)
            outcomes[backend] = None
        except Exception as error:  # what we look at is which type
            outcomes[backend] = type(error)
    found = []
    accepted = [b for b, kind in outcomes.items() if kind is None]
    if accepted:
        found.append(Finding(f"bad:{'+'.join(accepted)}:accepted:{case.bad}", f"{case.bad} accepted by {accepted}"))
    families = {_family(kind) for kind in outcomes.values() if kind is not None}
    if len(families) > 1:
        names = {b: kind and kind.__name__ for b, kind in outcomes.items()}
        found.append(Finding(f"bad:all:different:{case.bad}", f"{case.bad}: {names}"))
    for family in families - {"ValueError", "TypeError"}:
        found.append(Finding(f"bad:all:{family}:{case.bad}", f"{case.bad} raised {family}"))
    return found


def _family(kind: type) -> str:
    """ValueError or TypeError for those and their subclasses (mha's ShapeError is a ValueError), else the name."""
    return next((base.__name__ for base in (ValueError, TypeError) if issubclass(kind, base)), kind.__name__)


def _bad_arguments(case: Case) -> dict:
    """A valid call with one argument made bad, as case.bad says."""
    g, dtype = generator(case), case.torch_dtype
    q, k, v = (torch.randn(2, 4, n, 8, generator=g).to(device=DEVICE, dtype=dtype) for n in (case.L, case.S, case.S))
    call = dict(query=q, key=k, value=v)
    what, _, how = case.bad.partition(":")
    H = q.shape[1]
    bad = {
        "scale": {"nan": dict(scale=math.nan), "inf": dict(scale=-math.inf), "str": dict(scale="0.5")},
        "is_causal": {"str": dict(is_causal="no"), "int": dict(is_causal=1)},
        "enable_gqa": {"str": dict(enable_gqa="yes")},
        "window": {"short": dict(window=(4,)), "negative": dict(window=(-2, 0)), "float": dict(window=(1.5, 0))},
        "softcap": {"zero": dict(softcap=0.0), "negative": dict(softcap=-1.0), "nan": dict(softcap=math.nan),
                    "inf": dict(softcap=math.inf)},
        "alibi": {"shape": dict(alibi_slopes=torch.ones(H + 1)), "int": dict(alibi_slopes=torch.ones(H, dtype=torch.long))},
        "sinks": {"shape": dict(sinks=torch.ones(H, 2))},
        "mask": {"shape": dict(attn_mask=torch.ones(case.L + 1, case.S, dtype=torch.bool)),
                 "int": dict(attn_mask=torch.ones(case.L, case.S, dtype=torch.long))},
        "dtype": {"int": dict(query=q.to(torch.int32)), "mixed": dict(key=k.to(torch.float64))},
        "head_dim": {"": dict(key=torch.randn(2, 4, case.S, 9).to(dtype))},
        "key_length": {"": dict(value=torch.randn(2, 4, case.S + 1, 8).to(dtype))},
        "heads": {"indivisible": dict(key=k[:, :3], value=v[:, :3], enable_gqa=True),
                  "zero_kv": dict(key=k[:, :0], value=v[:, :0], enable_gqa=True)},
        "dropout": {"negative": dict(dropout_p=-0.1), "big": dict(dropout_p=1.5), "str": dict(dropout_p="0.1")},
        "alignment": {"": dict(causal_alignment="center", is_causal=True)},
        "rank": {"1": dict(query=q[0, 0, 0])},
        "not_a_tensor": {"": dict(query=q.tolist())},
    }[what][how]
    return {**call, **bad}
