"""Which backend runs a call, and why: the one place in mha that decides.

Every attention in mha asks here: the plain call (:func:`attention`, with the per-call fast path
:func:`plain_sdpa` that mha.functional asks too), a call that returns its log-sum-exp
(:func:`attention_with_lse`, :func:`backward_with_lse`: the parts of ring attention, the exact
parts of the efficient variants), and a packed batch (mha.kernels.varlen_attention, one call of
:func:`attention`). For :func:`attention`:

    weights requested              -> native (native_attention_weights) when it takes the call and
                                      nothing is to differentiate or drop out (weights_refusal),
                                      else math, which returns them for every call
    a backend named explicitly     -> that backend, or a ValueError saying why it cannot
    otherwise (auto)               -> native, mha's compiled kernel, when it is built and takes the
                                      call, and the call is one it is measured faster on, on
                                      this machine (native_pays, mha.kernels.tuning; never while
                                      torch.compile traces); else sdpa,
                                      torch's fused kernel, when it takes the whole contract with
                                      no tensor larger than q, k and v together (or the caller's
                                      mask); else native (when built), else flash, ours in torch
                                      ops, both honouring every term tile by tile; else math (under
                                      torch.func transforms, or for a mask that needs its gradient)

For :func:`attention_with_lse`: sdpa (torch's fused CPU kernel and its log-sum-exp) for the
calls it computes as they are (no band, or causality lagging on a square block; no other term),
else native when built and it takes the call, else flash (every term, in torch ops); its
backward: sdpa for the same calls, else flash (given the whole softmax's output and log-sum-exp).

The choice and its reason go to the debug log "mha.dispatch" (in eager mode; under torch.compile
call choose_backend / choose_lse_backend to ask).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad

from .. import _checks
from ..positions import CAUSAL
from . import flash, flex, mods, native, sdpa, tuning
from . import math as math_kernel
from ._context import differentiates, transforms_active
from ._shapes import matched_kv_heads
from .contract import NONE, TOP_LEFT_CAUSAL, Contract, check_heads, resolve, undeclared
from .flash import flash_attention, flash_attention_backward, flash_attention_with_lse
from .flex import flex_attention, flex_attention_with_lse
from .math import math_attention, paged_math_attention
from .native import native_attention, native_attention_with_lse
from .paged import check_counts
from .quantize import dequantize
from .sdpa import sdpa_attention

__all__ = ["BACKENDS", "LSE_BACKENDS", "OBSERVERS", "PAGED_BACKENDS", "attention", "attention_with_lse",
           "backward_with_lse", "choose_backend", "choose_lse_backend", "choose_paged_backend", "native_pays",
           "paged_attention", "plain_call", "plain_paged", "plain_pages", "plain_sdpa", "plain_weights", "share_kv_heads",
           "weights_refusal"]

BACKENDS = {"math": math_attention, "sdpa": sdpa_attention, "flash": flash_attention, "native": native_attention,
            "flex": flex_attention}
TAKES = {"math": math_kernel.TAKES, "sdpa": sdpa.TAKES, "flash": flash.TAKES, "native": native.TAKES, "flex": flex.TAKES}
PAGED_BACKENDS = ("native", "math")  # paged_attention's: native reads the pages in place, math gathers (the reference)
# the backends returning (out, lse): attention_with_lse's choice
LSE_BACKENDS = {"sdpa": sdpa.attention_with_lse, "native": native_attention_with_lse, "flash": flash_attention_with_lse,
                "flex": flex_attention_with_lse}
SMALL_SCORES = 1 << 22  # (B*H*L*S) up to which the math backend's L x S scores are cheap: the caller's functions
#                         on CPU (flex would compile first), the last resort off CPU (past it: flash's tiles)

log = logging.getLogger("mha.dispatch")
_NAMES = ("auto", *BACKENDS)

# Callables observer(q, k, v, contract, out, weights, dropout_p=), called with every call's inputs and results
# while non-empty (mha.explorer.record adds one), at every entry: attention (and varlen, one call of it),
# attention_with_lse and paged_attention (one call per sequence, its keys gathered from the pages).
# The weights come from the math backend (the dense call runs on it; the lse path runs its own backend
# for the output and the log-sum-exp, and math beside it for the weights). q (..., H, L, D), k and v
# (..., Hkv, S, D|Dv), out (..., H, L, Dv), weights (..., H, L, S).
OBSERVERS: list = []


def choose_backend(requested: str, q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                   need_weights: bool = False, dropout_p: float = 0.0) -> tuple[str, str]:
    """(the backend that will run, why). Raises ValueError for an unknown or unfit request. contract:
    an mha.kernels.Contract, or None (no term)."""
    name, reason, _ = _choose(requested, q, k, v, resolve(contract), need_weights=need_weights, dropout_p=dropout_p)
    return name, reason


def attention(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *, dropout_p: float = 0.0,
              need_weights: bool = False, backend: str = "auto") -> tuple[Tensor, Tensor | None]:
    """Run the chosen backend on q (..., L, D), k (..., S, D), v (..., S, Dv): (output, weights or None).

    k and v may have fewer heads than q (GQA/MQA: Hkv at dim -3 dividing H; query head h reads
    key/value head h // (H / Hkv)): torch's fused CPU kernel (measured: with a mask too) and the
    flash kernel read them as they are; the math backend, and every backend off the CPU, get them
    repeated (share_kv_heads) first, as torch's CUDA kernels may fall back to their math path for
    shared heads under a mask.
    """
    contract = resolve(contract)
    if OBSERVERS:
        return _observed(q, k, v, contract, dropout_p=dropout_p, need_weights=need_weights)
    return _run(q, k, v, contract, dropout_p=dropout_p, need_weights=need_weights, backend=backend)


def _observed(q, k, v, contract, *, dropout_p, need_weights):
    """A call while OBSERVERS watch: on the math backend (the reference, which returns the weights),
    its inputs and results handed to each observer."""
    out, weights = _run(q, k, v, contract, dropout_p=dropout_p, need_weights=True, backend="math")
    _notify(q, k, v, contract, out, weights, dropout_p)
    return out, (weights if need_weights else None)


def _run(q, k, v, contract, *, dropout_p, need_weights, backend):
    if backend == "auto" and dropout_p == 0.0 and (plain := _plain_form(contract)) is not None:
        causal, scale, key_valid, mask = plain
        if not need_weights:
            out = plain_sdpa(q, k, v, is_causal=causal, enable_gqa=True, scale=scale, key_valid=key_valid, mask=mask)
            if out is not None:
                return out, None
        elif mask is None and (both := plain_weights(q, k, v, is_causal=causal, scale=scale, key_valid=key_valid)) is not None:
            return both
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(name, x)  # a tensor, not nested (the fast path took the plain ones)
    k, v = matched_kv_heads(q, k, v)  # one head count for k and v (torch's enable_gqa shares them separately)
    check_heads(contract, q)
    if contract.score_mod is not None or contract.mask_mod is not None:
        mods.check_devices(q.device, score_mod=contract.score_mod, mask_mod=contract.mask_mod)  # bad input: named first
    name, _, sdpa_plan = _choose(backend, q, k, v, contract, need_weights=need_weights, dropout_p=dropout_p)
    if name == "sdpa":  # planned once, while choosing
        if q.dim() >= 3 and not q.is_cpu:  # torch's CUDA kernels take no shared heads beside a mask (their math path would)
            k, v = share_kv_heads(k, q.shape[-3]), share_kv_heads(v, q.shape[-3])  # (..., Hkv, S, D) -> (..., H, S, D)
        return sdpa.run_planned(q, k, v, contract, dropout_p=dropout_p, planned=sdpa_plan), None
    if name == "math" and q.dim() >= 3:
        k, v = share_kv_heads(k, q.shape[-3]), share_kv_heads(v, q.shape[-3])  # (..., Hkv, S, D) -> (..., H, S, D)
    if name == "native" and need_weights:
        return native.checked_attention_weights(q, k, v, contract)  # weights_refusal checked it while choosing
    result = BACKENDS[name](q, k, v, contract, dropout_p=dropout_p)
    out, weights = result if name == "math" else (result, None)
    return out, (weights if need_weights else None)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes of the fast path and of native_pays
_PLAIN_TERMS = frozenset({"band", "scale", "key_valid", "mask"})


def _plain_form(contract: Contract) -> tuple[bool, float | None, Tensor | None, Tensor | None] | None:
    """(is_causal, scale, key_valid, mask) of a contract the fast path takes: causality torch's SDPA
    call takes as its own arguments (plain_causality; the shared NONE and TOP_LEFT_CAUSAL known by
    identity), key padding (which only the native kernel's fast path takes) and a mask (which only its
    torch's call takes: plain_sdpa), else None."""
    if contract is NONE or contract is TOP_LEFT_CAUSAL:
        return contract is TOP_LEFT_CAUSAL, None, None, None
    if not contract.terms <= _PLAIN_TERMS or (causal := plain_causality(contract.band, contract.offset, contract.scale)) is None:
        return None
    return causal, contract.scale, contract.key_valid, contract.mask


def plain_causality(band, offset: int, scale) -> bool | None:
    """torch's is_causal for a call of no term but ``band`` (at ``offset``) and ``scale`` that its SDPA
    takes as its own arguments, else None: no band (an offset alone places nothing: transformers'
    decoding steps), or top-left causality; a scale that is None or a positive finite number
    (torch's causal kernel scales after masking: a scale <= 0 goes the full way, sdpa._positive_scale)."""
    if not plain_scale(scale):
        return None
    if band is None:
        return False
    return True if band == CAUSAL and offset == 0 else None


def plain_scale(scale) -> bool:
    """Whether torch's SDPA call takes ``scale`` as its own argument on the fast path: None or a positive
    finite number (a bool is refused by the full path's checks: never a fast path's scale)."""
    return scale is None or (scale.__class__ is not bool and isinstance(scale, (int, float)) and 0 < scale < math.inf)


def plain_attention(q, k, v, *, band, offset: int = 0, scale=None) -> Tensor | None:
    """The fast path for a caller that holds a call's terms apart (a decoding step's band and offset,
    transformers' scaling), before it builds their contract: torch's call where plain_causality and
    plain_sdpa take them, else None (build the contract; the full path). The caller has checked that
    no other term is set, and no dropout, no weights, backend "auto" (as for plain_sdpa)."""
    causal = plain_causality(band, offset, scale)
    return None if causal is None else plain_sdpa(q, k, v, is_causal=causal, enable_gqa=True, scale=scale)


def plain_sdpa(q, k, v, is_causal: bool, enable_gqa: bool, scale: float | None = None,
               key_valid: Tensor | None = None, mask: Tensor | None = None) -> Tensor | None:
    """The per-call fast path: the output of a plain call (:func:`plain_call`'s conditions); None when
    the call needs the full path. The caller has checked that no other option is set (a contract of
    causality at most, no dropout, no weights, backend "auto"). On CPU, once the native kernel is
    loaded, its plain_sdpa checks the shapes and runs the call in one step (a short call's checks
    read in Python cost as much as its attention): on the native kernel itself where that call was
    measured faster and no gradient is needed (the ``plain_`` crossovers: the full path's Python costs
    tens of microseconds), else on torch's kernel, or None where the full path's native is measured
    faster for a call that needs a gradient. torch.compile, a torch function mode (which must see
    torch's call) and CUDA take plain_call. ``key_valid`` (B|1, S) bool, key padding: the native
    kernel's call only (where measured faster, no gradient); None elsewhere (the full path plans
    torch's kernel beside padding: its rows that see nothing). ``mask``, an attn_mask as the full path
    hands it to torch's kernel (bool, or float32: the dtype masks are added in; 2-4 dims, each 1 or the
    call's (B, H, L, S)), neither causality nor padding beside it: torch's kernel with it, where the
    full path's crossovers do not pick native (its native then takes it), the C++ fast path only (None
    elsewhere). Its arguments may come by position (the per-call path of every plain call: keywords
    cost it a little more)."""
    # (the kernel reads the tensors' classes, forward AD's tangents and the crossovers of tuning.resolved_ints
    # itself: those reads in Python cost a short call 0.1-0.2x torch's time with its caches cold)
    if not _compiling() and not OBSERVERS and (kernel := native.loaded or native.load_if_built()) is not None:
        out = kernel.plain_sdpa(q, k, v, is_causal, enable_gqa, NATIVE_DECODE_ROWS, tuning.resolved_ints, scale, key_valid, mask)
        if out.__class__ is int:  # none resolved for this dtype at the thread count in use
            tuning.crossover_ints(q.dtype)
            out = kernel.plain_sdpa(q, k, v, is_causal, enable_gqa, NATIVE_DECODE_ROWS, tuning.resolved_ints, scale,
                                    key_valid, mask)
            if out.__class__ is int:  # (the count changed again meanwhile: another thread's set_num_threads)
                return None
        if out is not Ellipsis and (out is not None or q.is_cpu):  # (CPU tensors only: CUDA's are plain_call's)
            return out
    if key_valid is not None or mask is not None or not plain_call(q, k, v, enable_gqa):
        return None
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa and k.shape[1] != q.shape[1])


def plain_weights(q, k, v, *, is_causal: bool, scale: float | None = None,
                  key_valid: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """The per-call fast path of a plain call that asks for its weights: (output, weights (B, H, L, S)
    in q's dtype) from the native kernel, which checks the call and computes both in one step from
    Python (native_attention_weights' result, without its tens of microseconds of Python), where
    weights_refusal would give them to native: no gradient, no dropout (the caller's), a plain call
    (plain_sdpa's conditions, key padding too); None elsewhere (the full path). Once the kernel is
    loaded only."""
    if _kernel_fast_path_allowed(q, k, v) and (kernel := native.loaded) is not None:
        return kernel.plain_weights(q, k, v, is_causal, True, scale, key_valid)
    return None


# whether torch.compile's Dynamo traces this call: it reads as True there (tensors traced as FakeTensors, as in
# export, fail the plain-Tensor check too). One Python frame where torch.compiler.is_compiling is two (it asks
# torch.jit.is_scripting first): a short call's Python costs its time with its caches cold, 1.5 us a frame.
_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def _kernel_fast_path_allowed(q, k, v) -> bool:
    """What only Python can check before the native kernel's fast path of plain_weights (plain_sdpa's
    kernel reads the tensors' classes and forward AD's tangents itself):
    not while torch.compile traces, plain Tensors (no subclass), no observer, no forward-mode AD. The
    kernel checks the rest itself: no torch.func transform, no torch function mode (a mode sees torch's
    Python call: plain_call's), in one step where these reads in Python cost a short call 2 us with its
    caches cold."""
    return (not _compiling() and q.__class__ is k.__class__ is v.__class__ is Tensor and not OBSERVERS
            and forward_ad._current_level < 0)


def plain_call(q, k, v, enable_gqa: bool) -> bool:
    """Whether a call of q (B, H, L, D), k and v (B, Hkv, S, D) with no contract but top-left
    causality is one auto hands to torch's fused kernel as it is: the per-call fast path (a few
    microseconds of checks where the full path takes tens). Every condition is one the full path
    checks on its way to the same torch call: plain dense CPU (or CUDA) tensors of one floating dtype, no
    autocast, no forward-mode AD or torch.func transform, nothing empty, contiguous rows, Hkv = H
    (or dividing it with enable_gqa), no observer (OBSERVERS) and a call native is not measured
    faster on. On CUDA the same: torch's own call, its result bitwise."""
    if not (q.__class__ is k.__class__ is v.__class__ is Tensor) or q.is_nested or k.is_nested or v.is_nested or OBSERVERS:
        return False  # (a nested tensor has no shape to read)
    dtype = q.dtype  # (each read below is a call into torch: ~0.1-0.4 us; read once, cheapest first)
    if dtype not in _FLOATS or k.dtype != dtype or v.dtype != dtype:
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    if not len(qs) == len(ks) == len(vs) == 4:
        return False
    B, H, L, D = qs
    Bk, Hkv, S, Dk = ks
    if not (B == Bk == vs[0] and Hkv == vs[1] and S == vs[2] and D == Dk == vs[3]
            and B and H and L and D and Hkv and S  # nothing empty
            and (H == Hkv or (enable_gqa and H % Hkv == 0))):
        return False
    # contiguous rows (unit_last_stride); is_contiguous() is the cheaper read, but ignores the stride of
    # a dim of size 1: at D = 1 the strides themselves
    if not ((D != 1 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
            or q.stride()[-1] == k.stride()[-1] == v.stride()[-1] == 1):
        return False
    cpu = q.is_cpu
    if not (k.is_cpu and v.is_cpu if cpu else q.is_cuda and q.device == k.device == v.device):
        return False
    if torch.is_autocast_enabled("cpu" if cpu else "cuda") or forward_ad._current_level >= 0:
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return not cpu or torch.compiler.is_compiling() or not _measured_faster(dtype, L * (H // Hkv), L, S)


def share_kv_heads(x: Tensor, num_heads: int) -> Tensor:
    """GQA/MQA: (..., Hkv, S, D) -> (..., H, S, D), query head h reading kv head h // (H / Hkv)."""
    if x.dim() < 3 or x.shape[-3] == num_heads:
        return x
    return x.repeat_interleave(num_heads // x.shape[-3], dim=-3)


def _choose(requested, q, k, v, contract, *, need_weights, dropout_p):
    """(name, reason, the sdpa plan when sdpa was considered: dispatch runs it without planning again)."""
    _checks.one_of("backend", requested, _NAMES)
    plan = None
    if need_weights:
        choice = _weights_backend(requested, q, k, v, contract, dropout_p)
    elif requested != "auto":
        plan = sdpa.plan(q, k, v, contract, dropout_p) if requested == "sdpa" else None
        if reason := refusal(requested, q, k, v, contract, dropout_p, sdpa_plan=plan):
            raise ValueError(f"backend={requested!r} cannot run this call: {reason}")
        choice = (requested, "requested explicitly")
    else:
        plan = sdpa.plan(q, k, v, contract, dropout_p)
        if contract.score_mod is not None or contract.mask_mod is not None:
            choice = _auto_user_functions(q, k, v, contract, dropout_p)
        elif q.is_cpu:
            choice = _auto_cpu(q, k, v, contract, dropout_p, plan)
        else:
            choice = _auto_off_cpu(q, k, v, contract, dropout_p, plan)
        if choice[0] == "math" and (no_math := undeclared(math_kernel.TAKES, contract, "math, the last resort,")):
            raise ValueError(f"no backend can run this call: {no_math}")
    _log_choice("", *choice)
    return (*choice, plan)


def _weights_backend(requested, q, k, v, contract, dropout_p) -> tuple[str, str]:
    """(name, reason) for a call that asks for its weights: math (the reference, every term, dropout
    and gradients), or native where it takes the call and nothing needs what only math gives
    (weights_refusal): auto picks it there (measured faster at every size tried, 0.32x math's time
    at T = 16 to 0.96x at T = 1024 on 2 Zen 3 cores)."""
    if requested not in ("auto", "math", "native"):
        raise ValueError(f"backend={requested!r} does not return attention weights; "
                         "use backend='math' (or 'native', without gradients or dropout) or need_weights=False")
    on_native = ("native", "attention weights requested, nothing to differentiate: native computes them")
    if requested == "native":
        if reason := weights_refusal(q, k, v, contract, dropout_p):
            raise ValueError(f"backend='native' cannot return this call's weights: {reason}")
        return on_native
    if requested == "auto" and weights_refusal(q, k, v, contract, dropout_p) is None:
        return on_native
    if no_math := undeclared(math_kernel.TAKES, contract, "math, which returns them,"):
        raise ValueError(f"the attention weights of this call cannot be computed: {no_math}")
    return "math", "attention weights requested: the math backend returns them"


def weights_refusal(q: Tensor, k: Tensor, v: Tensor, contract: Contract, dropout_p: float = 0.0) -> str | None:
    """Why native cannot return this call's weights, or None: it computes them outside any autograd
    graph, with no dropout, on CPU tensors, for the calls it takes (never while torch.compile traces,
    nor float64: math is the reference there)."""
    if dropout_p > 0.0:
        return "dropout (math applies it to the weights)"
    if differentiates(q, k, v, contract.mask, *contract.learned):
        return "a gradient or a transform asks for the weights' graph (math's)"
    if torch.compiler.is_compiling():
        return "torch.compile traces it (its graph keeps torch's ops)"
    if q.dtype == torch.float64:
        return "float64 (math is the reference there)"
    if not native.ready():
        return "the native kernel is not built here"
    return native.unsupported(q, k, v, contract, dropout_p)


def refusal(name: str, q: Tensor, k: Tensor, v: Tensor, contract: Contract, dropout_p: float = 0.0, *,
            sdpa_plan=None) -> str | None:
    """Why backend ``name`` cannot run this call, or None: a term it does not declare (its TAKES,
    named), else its own check."""
    if name == "sdpa":
        return (sdpa_plan or sdpa.plan(q, k, v, contract, dropout_p))[1]
    return _UNSUPPORTED[name](q, k, v, contract, dropout_p)


_UNSUPPORTED = {"math": math_kernel.unsupported, "flash": flash.unsupported, "native": native.unsupported,
                "flex": flex.unsupported}


def _auto_cpu(q, k, v, contract, dropout_p, plan) -> tuple[str, str]:
    """auto on CPU: torch's kernel or native (where measured faster), else native, flash, math."""
    no_sdpa = plan[1]
    if not no_sdpa:  # both could run it: native where it is measured faster (asked first: it is cheap)
        if native_pays(q, k) and _native_ready(q, k, v, contract, dropout_p):
            return "native", "mha's compiled kernel is faster than torch's on this call (native_pays)"
        return "sdpa", "torch's fused kernel takes the whole contract"
    if _native_ready(q, k, v, contract, dropout_p):
        return "native", f"not sdpa ({no_sdpa}): native applies every term tile by tile, compiled"
    if not (no_flash := refusal("flash", q, k, v, contract)):
        return "flash", f"not sdpa ({no_sdpa}): flash applies every term tile by tile"
    return "math", f"not sdpa ({no_sdpa}), not flash ({no_flash})"


def _auto_off_cpu(q, k, v, contract, dropout_p, plan) -> tuple[str, str]:
    """auto on CUDA (any device but the CPU): torch's kernel where it takes the call as it is, else
    FlexAttention; where flex cannot, torch's kernel with the terms folded into one mask, else math
    while its scores are small, else flash's tiles (the slowest here: Python tiles)."""
    folded, no_sdpa = plan
    if not no_sdpa and folded is None:
        return "sdpa", "torch's fused kernel takes the whole contract as it is"
    no_flex = refusal("flex", q, k, v, contract, dropout_p)
    if not no_flex:
        why = no_sdpa or "it would need the terms folded into one mask"
        return "flex", f"not sdpa as it is ({why}): FlexAttention compiles every term into one kernel"
    if not no_sdpa:
        return "sdpa", f"not flex ({no_flex}): torch's fused kernel with the terms folded into one mask"
    if _scores(q, k) <= SMALL_SCORES:
        return "math", f"not sdpa ({no_sdpa}), not flex ({no_flex}): math, the scores being small"
    if not (no_flash := refusal("flash", q, k, v, contract)):
        return "flash", f"not sdpa ({no_sdpa}), not flex ({no_flex}): flash's tiles (Python; slow off the CPU)"
    return "math", f"not sdpa ({no_sdpa}), not flex ({no_flex}), not flash ({no_flash})"


def _auto_user_functions(q, k, v, contract, dropout_p) -> tuple[str, str]:
    """auto for the caller's score_mod / mask_mod: flex, which compiles them into its kernel; math
    (which evaluates them eagerly) where flex cannot, and on CPU while the scores are small (flex
    would compile first: seconds)."""
    if q.is_cpu and _scores(q, k) <= SMALL_SCORES:
        return "math", "the caller's score or mask function on CPU at small scores: math evaluates it eagerly"
    if not (no_flex := refusal("flex", q, k, v, contract, dropout_p)):
        return "flex", "the caller's score or mask function: FlexAttention compiles it into its kernel"
    return "math", f"the caller's score or mask function, not flex ({no_flex}): math evaluates it eagerly"


def _scores(q: Tensor, k: Tensor) -> int:
    """The number of scores of the call: (*lead, L, S), the leading dims those of q."""
    return q.numel() // max(q.shape[-1], 1) * k.shape[-2]


def _log_choice(path: str, name: str, why: str) -> None:
    """One line of the "mha.dispatch" log: "backend NAME[ (path)]: why" (eager only: logging breaks a
    compiled graph)."""
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
        log.debug("backend %s%s: %s", name, path, why)


NATIVE_DECODE_ROWS = 16  # a decoding step: at most this many query rows per key/value head
# ... and fewer query rows than this: a call of L >= 16 is a prompt's, which the tuning's prefill grid measured
# (from L = S = 16), its decoding steps having one row a head (the C++ fast path's kPromptRows)
NATIVE_PROMPT_ROWS = tuning.PREFILL_LENGTHS[0]


def native_pays(q: Tensor, k: Tensor) -> bool:
    """Whether the native kernel is faster than torch's on a call both can run, as measured on this
    machine (mha.kernels.tuning: a decoding step from ``decode_keys`` keys, otherwise from
    ``prefill_work`` = T * T, L and S both at least T)."""
    L, S = q.shape[-2], k.shape[-2]
    groups = q.shape[-3] // k.shape[-3] if q.dim() >= 3 and k.dim() >= 3 and k.shape[-3] else 1
    return native_pays_for(q.dtype, L * groups, L, S)


def native_pays_for(dtype: torch.dtype, rows_per_kv_head: int, L: int, S: int) -> bool:
    """native_pays from the numbers alone (the query rows that share a key/value head: L * H / Hkv)."""
    if dtype not in _FLOATS or torch.compiler.is_compiling() or transforms_active():
        return False  # a compiled graph keeps torch's ops; under torch.func native never runs
    return _measured_faster(dtype, rows_per_kv_head, L, S)


def _measured_faster(dtype: torch.dtype, rows_per_kv_head: int, L: int, S: int) -> bool:
    """native_pays_for's rule on the tuning's crossovers, for a dtype of _FLOATS, outside torch.compile
    and torch.func (plain_call asks it directly: it has checked those, and it is on every call's path)."""
    found = tuning.crossovers(dtype)
    if (rows_per_kv_head <= NATIVE_DECODE_ROWS and L < NATIVE_PROMPT_ROWS and found.decode_keys is not None
            and S >= found.decode_keys):
        return True
    # the crossover was measured on square calls: a call counts when it is at least that square on
    # both sides (few rows over many keys, measured: native 1.37x torch's time at L=32, S=8192 fp32)
    return found.prefill_work is not None and min(L, S) ** 2 >= found.prefill_work


def _native_ready(q: Tensor, k: Tensor, v: Tensor, contract: Contract, dropout_p: float) -> bool:
    """Whether auto may pick the native kernel: built (it is never built by a dispatch), not while
    torch.compile traces (the compiled graph keeps torch's ops), and the call is one it takes."""
    if torch.compiler.is_compiling() or q.dtype == torch.float64 or not native.ready():
        return False
    return native.unsupported(q, k, v, contract, dropout_p) is None


# -- with the log-sum-exp -----------------------------------------------------------------------

def choose_lse_backend(requested: str, q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None) -> tuple[str, str]:
    """(the backend :func:`attention_with_lse` runs, why). Raises ValueError for an unknown or unfit request."""
    _checks.one_of("backend", requested, ("auto", *LSE_BACKENDS))
    contract = resolve(contract)
    if requested != "auto":
        if reason := _lse_refusal(requested, q, k, v, contract):
            raise ValueError(f"backend={requested!r} cannot run this call: {reason}")
        choice = (requested, "requested explicitly")
    elif sdpa.lse_form(q, k, v, contract) is not None:
        choice = ("sdpa", "torch's fused CPU kernel computes the call and its log-sum-exp as they are")
    elif _native_ready(q, k, v, contract, 0.0):
        choice = ("native", "not sdpa (a term its fused kernel lacks): native applies every term, compiled")
    elif not q.is_cpu and not _lse_refusal("flex", q, k, v, contract):
        choice = ("flex", "not sdpa (a term its fused kernel lacks): FlexAttention, with its log-sum-exp")
    elif not (no_flash := _lse_refusal("flash", q, k, v, contract)):
        choice = ("flash", "not sdpa (a term its fused kernel lacks), native not built or not taking it")
    else:
        raise ValueError(f"no backend returns the log-sum-exp of this call: flash cannot ({no_flash})")
    _log_choice(" (with lse)", *choice)
    return choice


def _lse_refusal(name: str, q: Tensor, k: Tensor, v: Tensor, contract: Contract) -> str | None:
    """Why backend ``name`` cannot return this call's log-sum-exp, or None."""
    if name == "sdpa":
        return None if sdpa.lse_form(q, k, v, contract) else \
            "torch's fused kernel returns the log-sum-exp of 4-D calls with no term but lagging causality"
    if name == "flex":
        return flex.unsupported(q, k, v, contract, need_lse=True)
    return refusal(name, q, k, v, contract)


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                       backend: str = "auto") -> tuple[Tensor, Tensor]:
    """(out (..., L, Dv), lse (..., L)): attention and each row's log-sum-exp (-inf for a row that
    sees nothing), the step that attention split over parts of the keys is made of (ring attention,
    the efficient variants' exact parts): the parts merge exactly by their log-sum-exps
    (mha.kernels.merge). Sinks are a term of the whole softmax, not of a part: leave them out of a
    part's contract and merge them once (merge.add_sinks). Inputs in float32 or float64 give the
    log-sum-exp in that dtype. Differentiable through out (not through lse) on flash and native."""
    contract = resolve(contract)
    check_heads(contract, q)
    if contract.score_mod is not None or contract.mask_mod is not None:
        mods.check_devices(q.device, score_mod=contract.score_mod, mask_mod=contract.mask_mod)
    name, _ = choose_lse_backend(backend, q, k, v, contract)
    out, lse = LSE_BACKENDS[name](q, k, v, contract)
    if OBSERVERS:
        _notify(q, k, v, contract, out, _run(q, *matched_kv_heads(q, k, v), contract, dropout_p=0.0, need_weights=True,
                                          backend="math")[1])
    return out, lse


def _notify(q, k, v, contract, out, weights, dropout_p: float = 0.0) -> None:
    for observer in OBSERVERS:
        observer(q, k, v, contract, out, weights, dropout_p=dropout_p)


def backward_with_lse(q: Tensor, k: Tensor, v: Tensor, contract: Contract, out: Tensor, lse: Tensor,
                      grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv, d alibi_slopes or None) of one part of the keys, given the WHOLE softmax's
    ``out`` (B, H, L, Dv) and ``lse`` (B, H, L), every part merged: P = e^(s - lse) is then this
    part's share of the true probabilities, and the gradients are its exact contributions, which
    add up over the parts. On torch's fused CPU kernel for the calls it takes (sdpa.lse_form), else
    on flash, which takes every term. Shapes: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)."""
    if sdpa.lse_form(q, k, v, contract) is not None:
        name, why = "sdpa", "torch's fused CPU kernel takes the part as it is"
        grads = sdpa.backward_with_lse(q, k, v, contract, out, lse, grad_out)
    else:
        if no_flash := refusal("flash", q, k, v, contract):
            raise ValueError(f"no backend computes the gradients of this part: flash cannot ({no_flash})")
        name, why = "flash", "a term torch's fused kernel lacks: flash takes every term"
        grads = flash_attention_backward(q, k, v, out, lse, grad_out, contract)[:4]
    _log_choice(" (backward with lse)", name, why)
    return grads


# -- over KV-cache pages ------------------------------------------------------------------------

def choose_paged_backend(requested: str, q: Tensor, k_pages: Tensor, v_pages: Tensor,
                         contract: Contract | None = None) -> tuple[str, str]:
    """(the backend mha.kernels.paged_attention runs, why): native, which reads each page in place,
    when it is built (never built here: native.ready) and takes the call; else math, the reference
    (each sequence's keys gathered, dense). Raises ValueError for an unknown or unfit request, or a
    term neither declares (their PAGED_TAKES)."""
    _checks.one_of("backend", requested, ("auto", *PAGED_BACKENDS))
    contract = resolve(contract)
    if requested in ("auto", "math") and (no_math := undeclared(math_kernel.PAGED_TAKES, contract, "paged math")):
        raise ValueError(f"backend={requested!r} cannot run this paged call: {no_math}")
    refusal = undeclared(native.PAGED_TAKES, contract) or _paged_native_refusal(q, k_pages, v_pages)
    if requested == "native":
        refusal = refusal or (None if native.native_available() else "the native kernel is not built here")
        if refusal:
            raise ValueError(f"backend='native' cannot run this call: {refusal}")
    if requested != "auto":
        choice = (requested, "requested explicitly")
    elif refusal is None and native.ready():
        choice = ("native", "the native kernel reads the pages in place")
    else:
        choice = ("math", f"not native ({refusal or 'not built here'}): each sequence gathered, dense")
    _log_choice(" (paged)", *choice)
    return choice


def plain_paged(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, cu_q: Tensor, lengths_k: Tensor,
                contract: Contract) -> Tensor | None:
    """The per-call fast path of mha.kernels.paged.attend_pages (backend "auto", pages with no scales
    apart: float pages, or 8-bit ones kept with their scales): the native kernel's output (Tq, H, Dv),
    whose call checks every shape, count and index it reads, in one step (the full path's checks in
    Python cost a decoding step over a few pages twice its attention); None where the call takes the
    full path, which checks it and names what is wrong (_pages_taken's conditions, and whatever the
    kernel refuses: q not contiguous, pages it does not read in place, a bad count or page)."""
    if not (q.__class__ is Tensor and q.dim() == 3 and _pages_taken(q, k_pages, v_pages, contract)):
        return None
    return _native_pages(lambda kernel, terms: kernel.paged_forward(q, k_pages, v_pages, block_table, cu_q, lengths_k,
                                                                    terms, None, None)[0], q, contract)


def plain_pages(q: Tensor, k: Tensor, v: Tensor, contract: Contract) -> Tensor | None:
    """The per-call fast path of mha.kernels.paged.batch_paged_attention (backend "auto") over 8-bit
    rows kept as mha's caches keep them, q (B, H, L, D), k (B, Hkv, S, D + 4), v (B, Hkv, S, Dv + 4)
    int8 (an 8-bit KVCache's or an Int8Cache's step): the native kernel's output (B, H, L, Dv), its
    checks and call in one step (the full path's checks in Python cost a decoding step over 1024 keys
    as much as its attention); None where the call takes the full path, which checks it and names what
    is wrong (_pages_taken's conditions, shapes that do not fit, and what the kernel refuses)."""
    if not (q.__class__ is Tensor and q.dim() == 4 and _pages_taken(q, k, v, contract)):
        return None
    return _native_pages(lambda kernel, terms: kernel.plain_pages(q, k, v, terms), q, contract)


def _pages_taken(q: Tensor, k: Tensor, v: Tensor, contract: Contract) -> bool:
    """What only Python checks before the native kernel's paged fast paths: what
    _kernel_fast_path_allowed asks, no torch.func transform or torch function mode (plain_sdpa's kernel
    checks those itself; the paged kernel does not), CPU tensors (a CUDA call goes to math without a try of the kernel,
    which would copy its terms to the CPU), q of a dtype native takes over pages (float64: math), terms
    the pages carry, and no gradient asked for (of q, k, v, learned slopes or sinks: the full path
    refuses them, inference only)."""
    return (_kernel_fast_path_allowed(q, k, v) and not transforms_active() and not torch._C._is_torch_function_mode_enabled()
            and q.is_cpu and k.is_cpu and q.dtype in _FLOATS and contract.terms <= native.PAGED_TAKES
            and not (torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                                     for x in (q, k, v, contract.alibi_slopes, contract.sinks))))


def _native_pages(call, q: Tensor, contract: Contract) -> Tensor | None:
    """call(kernel, terms) on the native kernel (where it is built), the contract as the kernel takes
    it for q's head dim and dtype, or None where it refuses the call
    (its RuntimeError, or pybind's TypeError for an argument of another kind): the full path names it."""
    if (kernel := native.loaded or native.load_if_built()) is None:
        return None
    try:
        out = call(kernel, native._terms(contract, q.shape[-1], q.dtype))
    except (RuntimeError, TypeError):
        return None
    if out is not None:
        _log_choice(" (paged)", "native", "the native kernel reads the pages in place")
    return out


def _paged_native_refusal(q: Tensor, k_pages: Tensor, v_pages: Tensor) -> str | None:
    if torch.compiler.is_compiling():
        return "torch.compile traces the call (the compiled graph keeps torch's ops)"
    if not (q.is_cpu and k_pages.is_cpu):
        return f"it runs on CPU tensors only (got {q.device.type})"
    if q.dtype not in _FLOATS:
        return f"dtype {q.dtype}"
    if q.shape[-1] == 0 or v_pages.shape[-1] == 0:
        return f"a head dim of 0 (q {q.shape[-1]}, values {v_pages.shape[-1]})"
    return None


def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, cu_q: Tensor,
                    lengths_k: Tensor, terms: Contract, *, backend: str = "auto", k_scales: Tensor | None = None,
                    v_scales: Tensor | None = None) -> Tensor:
    """Run mha.kernels.paged_attention's call (q (Tq, H, D), pages, the block table (B, M), the query
    offsets (B + 1,) and key lengths (B,) as int32 or int64 CPU tensors, their kinds and shapes
    checked; terms: the contract's per-sequence terms; int8 pages with their scales) on the chosen
    backend: math dequantizes 8-bit pages first (the reference). The counts' values are checked once:
    by paged.check_counts before math, by the native kernel itself (every index it reads), and when
    the kernel refuses, by check_counts again for a ValueError that names the argument."""
    name, _ = choose_paged_backend("math" if OBSERVERS else backend, q, k_pages, v_pages, terms)  # observed: math
    if name == "math":
        check_counts(q, k_pages, block_table, cu_q, lengths_k)
        lengths_q = cu_q.diff()
        observe = _notify if OBSERVERS else None
        if k_scales is not None:
            wide = torch.float64 if q.dtype == torch.float64 else torch.float32
            pages = (dequantize(k_pages, k_scales, wide), dequantize(v_pages, v_scales, wide))
            return paged_math_attention(q.to(wide), *pages, block_table, lengths_q, lengths_k, terms,
                                        observe=observe).to(q.dtype)
        return paged_math_attention(q, k_pages, v_pages, block_table, lengths_q, lengths_k, terms, observe=observe)
    try:
        return native.paged_attention_native(q, k_pages, v_pages, block_table, cu_q, lengths_k, terms,
                                             k_scales=k_scales, v_scales=v_scales)
    except RuntimeError:
        check_counts(q, k_pages, block_table, cu_q, lengths_k)  # a count the kernel refused, named
        raise
