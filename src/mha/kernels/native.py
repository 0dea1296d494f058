"""The native backend: mha's own compiled CPU kernel (kernels/csrc/native.cpp).

It honours the whole contract (causality in both alignments, windows, ALiBi with slope gradients,
additive and bool masks read tile by tile, key padding, per-sequence positions, GQA/MQA reading
the shared heads without copying them, softcap, sinks, Dv != D, L != S, rows that see nothing),
forward and backward, with float32 accumulation (float64 for float64), and returns the
log-sum-exp like flash. It is compiled on first use with torch's extension tooling (ninja, the
system's C++ compiler), once per user and machine (torch's extension cache), for the instruction
set this CPU has:

    avx512bf16  AVX-512 and its bfloat16 dot products         the CPU has AVX-512F and AVX512-BF16
    avx512      AVX-512 (vectorised exponentials, dot products) the CPU has AVX-512F
    avx2        AVX2 and FMA, the compiler's vectorisation      the CPU has AVX2
    portable    plain C++, the compiler's own vectorisation     any other CPU
The tile products run on torch's brgemm (oneDNN's, which picks its own instructions) in every build,
but bfloat16's on a CPU with AMX tiles, which the avx512bf16 build multiplies on its own tile code
(``_kernel().amx_active()``; docs/native.md, "AMX tiles").

MHA_NATIVE=off turns the backend off; MHA_NATIVE=avx512|avx2|portable forces a build;
MHA_NATIVE_SANITIZE=1 builds (and uses) one with AddressSanitizer and UBSan (docs/testing.md). Where no
compiler is found, native_available() is False, the dispatch says why once in its log
("mha.dispatch") and every call runs on the other backends.

Shapes: q (..., H, L, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv), the leading dims broadcast
together (Hkv divides H); float64, float32, bfloat16 and float16.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
from pathlib import Path

import torch
from torch import Tensor

from . import merge
from ._context import autocast_inputs, autograd_function_refusal
from ._shapes import leads, matched_kv_heads, unflat
from .contract import Contract, check_heads, resolve, undeclared

__all__ = ["TAKES", "native_attention", "native_attention_weights", "native_attention_with_lse", "native_available",
           "paged_attention_native", "ready", "sanitized", "unsupported", "variant"]

log = logging.getLogger("mha.dispatch")

_SOURCE = Path(__file__).parent / "csrc" / "native.cpp"
# -fopenmp: at::parallel_for is compiled into the extension, on torch's OpenMP runtime
_AVX512 = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DMHA_AVX512"]
_FLAGS = {"avx512bf16": [*_AVX512, "-mavx512bf16", "-mavx512vnni", "-DMHA_AVX512_BF16", "-DMHA_AMX"], "avx512": _AVX512,
          "avx2": ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c"], "portable": ["-O3", "-fopenmp"]}
# MHA_NATIVE_SANITIZE=1: a build of its own with AddressSanitizer and UBSan (docs/testing.md)
_SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g", "-O1",
             "-D_GLIBCXX_ASSERTIONS", "-D_GLIBCXX_SANITIZE_VECTOR"]
# every term but the caller's functions (math and flex take them), named: a new field is refused until declared
# here and passed to the C++ kernel (_terms); logit_scale is folded into q first (Contract.fold_logit_scale)
TAKES = frozenset({"band", "positions", "key_valid", "mask", "alibi_slopes", "scale", "logit_scale", "softcap", "sinks"})
PAGED_TAKES = frozenset({"band", "alibi_slopes", "scale", "softcap", "sinks"})  # paged_attention_native's
_UNBOUNDED = 2 ** 63 - 1  # the kernel's "no bound on this side of the band"


def variant() -> str | None:
    """The build this CPU gets ("avx512bf16", "avx512", "avx2" or "portable"), or None when MHA_NATIVE=off."""
    asked = os.environ.get("MHA_NATIVE", "auto").lower()
    if asked == "off":
        return None
    if asked in _FLAGS:
        return asked
    return _best_variant()


@functools.cache
def _best_variant() -> str:
    """The build this CPU's instruction sets call for (asked once per process: it is on every call's path)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        return "avx2" if capability == "AVX2" else "portable"
    # (AVX512-BF16 came with AVX512-VNNI on every CPU that has it; the build uses both)
    return "avx512bf16" if torch.cpu._is_avx512_bf16_supported() and torch.cpu._is_vnni_supported() else "avx512"


@functools.cache
def sanitized() -> bool:
    """Whether MHA_NATIVE_SANITIZE asks for the build with AddressSanitizer and UBSan (run it with the
    sanitizer's runtime preloaded: docs/testing.md); read once, when the process first asks."""
    return os.environ.get("MHA_NATIVE_SANITIZE", "0") not in ("", "0")


loaded = None  # the compiled kernel once this process has loaded it (a read of it costs no call: the fast path's)
_looked = False  # whether load_if_built has looked


def load_if_built():
    """The compiled kernel, loaded now if it was built before (never building it), else None; it looks
    once per process (then ``loaded`` says): the per-call fast path asks it while ``loaded`` is None."""
    global _looked
    if not _looked:
        _looked = True
        ready()
    return loaded


def _kernel():
    """The compiled kernel this process uses (see _extension); None where it cannot be built."""
    global loaded
    loaded = _extension(*_this_process())
    return loaded


@functools.cache
def _this_process() -> tuple[str | None, bool]:
    """(variant(), sanitized()): MHA_NATIVE and MHA_NATIVE_SANITIZE are read once per process (this
    is on every call's path)."""
    return variant(), sanitized()


@functools.cache
def _extension(build: str | None, sanitize: bool = False):
    """The compiled kernel for ``build`` (sanitized or not), compiled on first use (then cached by
    torch per user), or None when it cannot be built; the reason goes to the dispatch log once."""
    if build is None:
        log.info("native backend: off (MHA_NATIVE=off)")
        return None
    if sanitize and "libasan" not in os.environ.get("LD_PRELOAD", ""):  # loading it would abort the process
        raise RuntimeError("MHA_NATIVE_SANITIZE=1 needs AddressSanitizer's runtime loaded first: run with "
                           "LD_PRELOAD=\"$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)\" "
                           "ASAN_OPTIONS=detect_leaks=0, as scripts/sanitize.sh does (docs/testing.md)")
    folder, name = _build_folder(build, sanitize), _module_name(build, sanitize)
    if (built := _import_built(folder, name)) is not None:
        return built
    try:
        from torch.utils.cpp_extension import load
        folder.mkdir(parents=True, exist_ok=True)
        with _one_process_at_a_time(folder):
            module = load(name=name, sources=[str(_SOURCE)], extra_cflags=[*_FLAGS[build], *(_SANITIZE if sanitize else [])],
                          extra_ldflags=["-fopenmp", *(_SANITIZE[:1] if sanitize else [])], build_directory=str(folder),
                          verbose=False)
            (folder / _STAMP).write_text(source_digest())  # what the build in the folder is of
            return module
    except Exception as error:  # no compiler, no ninja, a failed build: the other backends run
        log.info("native backend unavailable (%s: %s); calls run on the other backends",
                 type(error).__name__, str(error).strip().splitlines()[-1] if str(error).strip() else "")
        return None


_STAMP = "mha.source"  # in a build folder: the source digest its build is of, written once torch's load returned it
_LOCK = "mha.lock"  # in a build folder: the kernel's own build lock (flock), _one_process_at_a_time


def _import_built(folder: Path, name: str):
    """The build in ``folder`` imported as it is, when its stamp says it is of this source; else None
    (torch's load then checks and builds). torch's load imports setuptools to check it (0.2 s of a
    process's first native call, most of it); the stamp is written only after torch's load returned
    the build, inside the build lock, and this reads it under a shared hold of that lock (a build of
    another checkout's source may have finished while this one waited)."""
    library = folder / f"{name}.so"
    try:
        import fcntl
        import importlib.util
        with open(folder / _LOCK, "a") as handle:  # (no folder: OSError, None)
            fcntl.flock(handle, fcntl.LOCK_SH)  # waits while a process builds into the folder
            if (folder / _STAMP).read_text() != source_digest() or not library.exists():
                return None
            spec = importlib.util.spec_from_file_location(name, library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    except (OSError, ImportError):  # no stamp, not POSIX, a library that does not load: torch's load decides
        return None


@contextlib.contextmanager
def _one_process_at_a_time(folder: Path):
    """Held while torch loads or builds into ``folder``. torch's own lock is a file named "lock" that
    it creates and deletes; a process killed mid-build leaves it behind, and every later load then
    waits for it forever. This lock is mha's (flock: the OS releases it when its process ends), so while
    it is held no other process is building and a "lock" file found is a stale one: removed."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    with open(folder / _LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process builds
        stale = folder / "lock"
        if stale.exists():
            log.info("native backend: removing %s, left behind by a build that was stopped", stale)
            stale.unlink(missing_ok=True)
        yield  # the lock goes with the file's closing


def native_available() -> bool:
    """Whether the native kernel is built (building it on first use: about 40 s on 2 cores, once per build and environment)."""
    return _kernel() is not None


def ready() -> bool:
    """Whether the native kernel can run without building it now: loaded in this process, or built
    before (torch's extension cache holds it for this user). The dispatch asks this, so that no
    call ever waits for a compiler; native_available(), backend="native" or `mha verify` build it."""
    build, sanitize = _this_process()
    if build is None:
        return False
    if _extension.cache_info().currsize:  # tried in this process: loaded, or failed
        return _kernel() is not None
    return any(_build_folder(build, sanitize).glob(f"{_module_name(build, sanitize)}*.so")) and native_available()


@functools.cache
def source_digest() -> str:
    """The kernel's source, hashed (12 hex digits): what a measurement of it (mha.kernels.tuning) is of."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]


def _module_name(build: str, sanitize: bool = False) -> str:
    return f"mha_native_{build}" + ("_sanitized" if sanitize else "")


def _build_folder(build: str, sanitize: bool = False) -> Path:
    """Where the build lives: torch's extension cache (TORCH_EXTENSIONS_DIR, or ~/.cache/torch_extensions),
    one folder per build and compile environment (_environment_key): two virtual environments with
    the same torch compile with different include paths, and in one folder they rebuilt each other's
    kernel in turn (measured: five 60-80 s rebuilds in 20 minutes)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or _default_build_root()
    version = torch.__version__.replace("+", "_")
    return Path(root) / f"{_module_name(build, sanitize)}_torch{version}_{_environment_key(build, sanitize)}"


def _default_build_root() -> str:
    """torch.utils.cpp_extension.get_default_build_root() (torch's extension cache for this user), read
    without importing cpp_extension, which imports setuptools: a loaded build needs neither."""
    try:
        from torch import _appdirs
    except ImportError:  # a torch that moved it: its own function
        from torch.utils.cpp_extension import get_default_build_root
        return get_default_build_root()
    return os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))


def _environment_key(build: str, sanitize: bool) -> str:
    """8 hex digits of what the compile command depends on besides the source: torch's install (its
    headers and libraries), Python's headers, the flags of the build and the compiler asked for."""
    import sysconfig
    parts = (torch.__version__, str(Path(torch.__file__).resolve().parent), sysconfig.get_paths()["include"],
             *_FLAGS[build], *(_SANITIZE if sanitize else ()), os.environ.get("CXX", ""), os.environ.get("CC", ""))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def unsupported(q: Tensor, k: Tensor, v: Tensor, contract: Contract, dropout_p: float = 0.0) -> str | None:
    """Why the native backend cannot run this call, or None. (The terms it takes: TAKES.)"""
    if reason := undeclared(TAKES, contract):
        return reason
    if not native_available():
        return "the native kernel is not built here (see the mha.dispatch log)"
    if not (q.device.type == k.device.type == v.device.type == "cpu"):
        return f"it runs on CPU tensors only (got {q.device.type})"
    if dropout_p > 0.0:
        return "it has no dropout"
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        return f"q, k and v of one floating dtype (got {q.dtype}, {k.dtype}, {v.dtype})"
    if reason := autograd_function_refusal(q, k, v, contract.mask):
        return reason
    if q.dim() >= 3 and k.dim() >= 3 and v.dim() >= 3 and k.shape[-3] != v.shape[-3]:
        return "keys and values with different head counts"
    try:
        lead, _ = leads(q, k, v)
    except RuntimeError:
        return "q, k and v whose batch dims do not broadcast"
    if len(lead) > 2 and (contract.mask is not None or contract.positions is not None or contract.key_valid is not None):
        return "a mask, padding or positions with more than one batch dim"
    if contract.mask is not None and _mask_view(contract.mask, lead, q.shape[-2], k.shape[-2]) is None:
        return "a mask that does not broadcast to (batch, heads, L, S) as a view"
    return None


def native_attention(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                     dropout_p: float = 0.0) -> Tensor:
    """The backend entry point: output (..., L, Dv)."""
    return _checked_run(q, k, v, contract, dropout_p, with_lse=False)


def native_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None, *,
                              dropout_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """(output (..., L, Dv), log-sum-exp (..., L) in float32, float64 for float64 inputs)."""
    return _checked_run(q, k, v, contract, dropout_p, with_lse=True)


def native_attention_weights(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None = None) -> tuple[Tensor, Tensor]:
    """(output (..., L, Dv), weights (..., L, S)), both in q's dtype, as the math backend returns them:
    for a call that needs no gradient (the weights come from no autograd graph; the dispatch asks
    weights_take first) and no dropout. Every term native takes; a row that sees nothing: zeros."""
    contract = resolve(contract)
    check_heads(contract, q)
    k, v = matched_kv_heads(q, k, v)
    if reason := unsupported(q, k, v, contract):
        raise ValueError(f"the native backend cannot run this call: {reason}")
    return checked_attention_weights(q, k, v, contract)


def checked_attention_weights(q: Tensor, k: Tensor, v: Tensor, contract: Contract) -> tuple[Tensor, Tensor]:
    """native_attention_weights for a call whose checks were made (the dispatch's weights_refusal
    asked ``unsupported`` while choosing, about 10 us on a call with a mask): a resolved contract,
    k and v with one head count (matched_kv_heads)."""
    q, k, v = autocast_inputs(q, k, v)
    q, contract = contract.fold_logit_scale(q)
    inputs = _Inputs(q, k, v, contract, in_place=True)
    out, weights = _kernel().forward_weights(*inputs.tensors(), inputs.terms())
    return inputs.output(out), weights.view(*inputs.lead, *weights.shape[2:]).to(q.dtype)  # (B, H, L, S) -> (..., L, S)


def _checked_run(q: Tensor, k: Tensor, v: Tensor, contract: Contract | None, dropout_p: float, *, with_lse: bool):
    contract = resolve(contract)
    check_heads(contract, q)
    k, v = matched_kv_heads(q, k, v)
    reason = unsupported(q, k, v, contract, dropout_p)
    if reason:
        raise ValueError(f"the native backend cannot run this call: {reason}")
    q, k, v = autocast_inputs(q, k, v)  # as torch's kernel: in the autocast dtype (nothing after is an autocast op)
    q, contract = contract.fold_logit_scale(q)
    learned = (q, k, v, contract.alibi_slopes, contract.sinks)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in learned):
        out, lse = _Native.apply(*learned, contract)
        return (out, lse) if with_lse else out
    inputs = _Inputs(q, k, v, contract, in_place=True)  # nothing to differentiate: no autograd node
    out, kept = _forward(inputs, for_backward=False)
    return (out, _lse(inputs, *kept[1:])) if with_lse else out


def _forward(inputs: _Inputs, *, for_backward: bool) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """(output (..., L, Dv), and what the backward needs: the kernel's own output (B, H, L, Dv) and
    each row's softmax max and sum (B, H, L); csrc/native.cpp: the backward's P = e^(s - max) / sum).
    The backward's forward takes the tiled kernel always (run_forward)."""
    out, row_max, row_sum = _kernel().forward(*inputs.tensors(), inputs.terms(), for_backward)
    return inputs.output(out), (out, row_max, row_sum)


def _lse(inputs: _Inputs, row_max: Tensor, row_sum: Tensor) -> Tensor:
    """The log-sum-exp (..., L): -inf for a row that saw nothing, NaN for a NaN row."""
    return inputs.output(row_max + row_sum.log())



class _Native(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, sinks, contract: Contract):
        inputs = _Inputs(q, k, v, contract)
        output, kept = _forward(inputs, for_backward=True)
        lse = _lse(inputs, *kept[1:])
        ctx.save_for_backward(q, k, v, *kept)
        ctx.contract = contract
        ctx.mark_non_differentiable(lse)
        return output, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        if torch.is_grad_enabled():
            raise RuntimeError("the native backend has no double backward (create_graph=True); "
                               "use backend='math' for higher derivatives")
        q, k, v, out, row_max, row_sum = ctx.saved_tensors
        contract = ctx.contract
        inputs = _Inputs(q, k, v, contract)
        grad4 = _at_least_one_column(inputs.as_rows(grad_out, inputs.lead))  # (B, H, L, Dv)
        delta = (grad4.to(row_max.dtype) * out.to(row_max.dtype)).sum(-1)  # rowsum(dO * O): (B, H, L)
        dq, dk, dv, d_slopes = _kernel().backward(*inputs.tensors(), grad4, row_max, row_sum, delta, inputs.terms())
        grads = [unflat(g.flatten(0, 1)[..., :x.shape[-1]], x, lead) for g, x, lead in  # padded head dims dropped
                 zip((dq, dk, dv), (q, k, v), (inputs.lead, inputs.kv_lead, inputs.kv_lead))]
        d_slopes = None if contract.alibi_slopes is None else d_slopes.to(contract.alibi_slopes.dtype)
        d_sinks = None if contract.sinks is None else merge.sink_gradient(
            contract.sinks, inputs.output(row_max), inputs.output(delta), inputs.output(row_sum))
        return (*grads, d_slopes, d_sinks, None)


def _kernel_shaped(x: Tensor, lead: tuple[int, ...]) -> bool:
    """x (B, H, T, X) with at least one column: the kernel's forward and forward_weights take it as it
    is and copy what their paths cannot read in place (csrc/native.cpp's Layout decides)."""
    return x.dim() == 4 and x.shape[:2] == lead and x.shape[-1] > 0


class _Inputs:
    """q, k, v as the kernel takes them, (B, H, L, D) (contiguous, or as they lie: in_place), and the
    contract as its arguments."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, contract: Contract, *, in_place: bool = False):
        """in_place: q, k and v of the kernel's shape go to it however they lie, and it copies what its
        path cannot read in place (a call with no gradient: the heads of a projection's (B, T, H, D)
        output seen as (B, H, T, D), a KV cache's first S of more slots); else contiguous (the
        autograd function's, saved for the backward)."""
        self.lead, self.kv_lead = leads(q, k, v)  # (..., H), (..., Hkv)
        self.dtype = q.dtype
        self.q, self.k, self.v = (
            _at_least_one_column(x if in_place and _kernel_shaped(x, lead) else self.as_rows(x, lead))
            for x, lead in ((q, self.lead), (k, self.kv_lead), (v, self.kv_lead)))
        self.contract = contract
        self.L, self.S, self.D, self.Dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]

    @staticmethod
    def as_rows(x: Tensor, lead: tuple[int, ...]) -> Tensor:
        """(..., T, X) -> (B, H, T, X) contiguous, the batch dims broadcast and flattened."""
        if x.dim() == 4 and x.shape[:2] == lead and x.is_contiguous():
            return x  # already (B, H, T, X)
        x = x.expand(*lead, *x.shape[-2:])
        return x.reshape(*_batch_heads(lead), *x.shape[-2:]).contiguous()  # (..., H, T, X) -> (B, H, T, X)

    def output(self, x: Tensor) -> Tensor:
        """(B, H, L, Dv) or (B, H, L) -> (..., L, Dv) or (..., L)."""
        if x.dim() == 4 and self.Dv == 0:
            x = x[..., :0]  # the padded column of an empty value head dim
        return x.view(*self.lead, *x.shape[2:])

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.q, self.k, self.v

    def terms(self):
        """The contract as the kernel takes it (_terms), the mask broadcast to (B, H, L, S) as a view."""
        mask = None if self.contract.mask is None else _mask_view(
            self.contract.mask if self.contract.mask.dtype == torch.bool else self.contract.mask.to(_acc(self.dtype)),
            self.lead, self.L, self.S)
        return _terms(self.contract, self.D, self.dtype, mask=mask)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: float64 for float64, float32 for the rest."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _terms(contract: Contract, D: int, dtype: torch.dtype, *, mask: Tensor | None = None):
    """The contract as the kernel's one terms value (csrc/native.cpp's TermArgs), for queries of head dim
    D and ``dtype``: the only place its fields are read for C++. mask: the contract's, as the kernel
    reads it (expanded to (B, H, L, S)); positions and padding as int64 and bool, per-head terms in
    the accumulation dtype, contiguous."""
    c, acc, terms = contract, _acc(dtype), _kernel().Terms()
    terms.scale, terms.softcap = c.scale_for(D), c.softcap or 0.0
    if c.band is not None:
        terms.has_band = True
        terms.left = _UNBOUNDED if c.band.left is None else c.band.left
        terms.right = _UNBOUNDED if c.band.right is None else c.band.right
    terms.offset = c.offset
    if c.positions is not None:
        terms.q_pos, terms.k_pos = (p.to(torch.int64).contiguous() for p in c.positions)
    if c.key_valid is not None:
        terms.key_valid = c.key_valid.contiguous()  # bool (the contract's)
    terms.mask = mask
    if c.alibi_slopes is not None:
        terms.slopes = c.alibi_slopes.detach().to(device="cpu", dtype=acc).contiguous()
    if c.sinks is not None:
        terms.sinks = c.sinks.detach().to(device="cpu", dtype=acc).contiguous()
    return terms


def _at_least_one_column(x: Tensor) -> Tensor:
    """An empty head dim (..., T, 0) as one column of zeros: the kernel's products need one, and a
    zero adds nothing to a score (D = 0: every score 0) or an output (Dv = 0: dropped after)."""
    return x if x.shape[-1] > 0 else x.new_zeros(*x.shape[:-1], 1)


def _mask_view(mask: Tensor, lead: tuple[int, ...], L: int, S: int) -> Tensor | None:
    """The mask broadcast to (B, H, L, S) as a view (strides 0 where it broadcasts), or None when
    that needs a copy."""
    try:
        return mask.expand(*lead, L, S).view(*_batch_heads(lead), L, S)
    except RuntimeError:
        return None


def _batch_heads(lead: tuple[int, ...]) -> tuple[int, int]:
    """(B, H) of the leading dims (..., H): the batch dims flattened; no dims at all: one of each."""
    return (math.prod(lead[:-1]), lead[-1]) if lead else (1, 1)


def paged_attention_native(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                           seqlens_k: Tensor, contract: Contract, *, k_scales: Tensor | None = None,
                           v_scales: Tensor | None = None) -> Tensor:
    """Attention of packed query rows over KV-cache pages read where they lie (forward only).

    q (Tq, H, D): sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (L_b of them);
    k_pages (N, Hkv, P, D), v_pages (N, Hkv, P, Dv): the pool; block_table (B, M) int32/int64: key j
    of sequence b is in page block_table[b, j // P], slot j % P (entries past its used pages may be
    anything, -1); seqlens_k (B,): its S_b >= L_b keys. Query r of sequence b sits at position
    S_b - L_b + r (bottom-right), key j at j. contract: the band, ALiBi slopes, scale, softcap and
    sinks (the positions come from the pages: no positions, padding or mask). Query head h reads kv
    head h // (H / Hkv). Returns (Tq, H, Dv) in q's dtype; a row that sees no key gives zeros. 8-bit
    pools: int8 pages as mha's caches keep them (N, Hkv, P, D + 4), each row's scale after it
    (mha.kernels.storage: the kernel reads the scales where they lie when they sit on whole floats,
    else copies them out, and widens them for float64 queries), or int8 rows with k_scales,
    v_scales (N, Hkv, P) apart, any strides each, each slot's row read and multiplied by its scale as
    it is converted (no dequantized copy).

    The caller validates the arguments' kinds and shapes (mha.kernels.paged); the kernel checks every
    count and index it reads (a page outside the pool, S_b beyond the table's pages, L_b > S_b, a
    sequence of no rows: RuntimeError), which the dispatch names by mha.kernels.paged.check_counts'
    rules (ValueError). No autograd: the output carries no gradient.
    """
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native kernel is not built here (see the mha.dispatch log)")
    k_pages, v_pages = (x if _slots_readable(x) else x.contiguous() for x in (k_pages, v_pages))
    if k_scales is not None:  # apart (int8 pages without scales: kept with each row, which the kernel reads)
        k_scales, v_scales = (x.to(_acc(q.dtype)) for x in (k_scales, v_scales))
    # the kernel reads the tensors' memory and makes its output with no autograd history: nothing to detach
    out, _, _ = kernel.paged_forward(q.contiguous(), k_pages, v_pages, block_table, cu_seqlens_q, seqlens_k,
                                     _terms(contract, q.shape[-1], q.dtype), k_scales, v_scales)
    return out


def _slots_readable(pages: Tensor) -> bool:
    """Whether a pool (N, Hkv, P, X) has contiguous rows that do not overlap (any page and head
    strides): what the paged kernel reads in place."""
    if pages.dim() != 4:
        return True  # the kernel says what is wrong
    X, P = pages.shape[3], pages.shape[2]
    return (X <= 1 or pages.stride(3) == 1) and (P <= 1 or pages.stride(2) >= X)
