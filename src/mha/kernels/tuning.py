"""The measured dispatch: where mha's compiled kernel beats torch's fused one, on this machine.

``backend="auto"`` may run either kernel on a call both take. Which is faster depends on the CPU
(AVX2, AVX-512 with BF16, AMX tiles), the thread count and the torch build, so it is measured, not
guessed: :func:`tune` times the native kernel against torch's SDPA on a small grid (prefill lengths
and decoding steps, float32 and bfloat16, at two (batch, heads) shapes; several seconds) and
stores, per dtype, the crossovers:

    prefill_work  T * T for the least T from which native is faster at every measured length L = S = T
                  (causal and not), or None; auto applies it to calls with L and S both at least T
    decode_keys   the least S from which native is faster on a decoding step (<= 16 query rows per
                  key/value head), or None

each twice: native called through the full path (mha.kernels.native: its checks and autograd
function in Python, tens of microseconds a call), which runs a call with terms of its own or one that
needs a gradient, and called by the per-call fast path itself (``plain_prefill_work``,
``plain_decode_keys``: dispatch.plain_sdpa on a plain call that needs no gradient, where a short
call's native time is the kernel's, measured faster than torch's on a decoding step of one key on 2
Zen 3 cores where the full path was 4x slower).

A point counts for native only if native takes at most MARGIN of torch's time in every one of
ROUNDS interleaved rounds over the grid, at both shapes, timed both in back-to-back loops and as
single calls alternated with other work (as a model calls attention between its other layers);
the worst of these ratios is stored. One lucky round cannot move the crossover: where native wins
only sometimes, auto keeps torch's kernel. A point's fast-path call is timed first; where it lost
(above MARGIN), the full path's call of the same kernel, which adds Python's checks to it, is not
timed but takes that ratio, a bound it can only exceed (a table lists those points, "untimed"):
native loses there either way, and a tune on a CPU where prefill is rarely native takes less time
(17 s against 21-24 s on 2 Zen 3 cores). A table says how sure it is: the share of the machine's
CPU time other processes took while it was measured (above LOAD_LIMIT: measured under load, not
sure); a table that is not sure is measured again at the first use of processes started after it
was measured, up to CHECKS measurements in all, each logged (a busy machine at the first `mha
verify` must not decide for good). The tables are stored in a per-user cache
(``$MHA_TUNE_CACHE``, else ``$XDG_CACHE_HOME/mha/tune.json``) keyed by the CPU model, its flags that
matter, the native build and its source (a changed kernel is measured again), the thread count and
the torch and mha versions. ``auto`` reads the
table of this key (:func:`crossovers`). Without one it measures at the first call where the
choice arises (unless ``MHA_TUNE=off``, or in one of several torch.distributed ranks, which would
measure each other's crowding) and, until then or when told not to, picks native only on
the CPU kinds it was measured to win on (AVX-512 with BF16 and no AMX, and AMX: ``KNOWN``), never
elsewhere. ``mha tune`` measures again; ``mha tune --show`` prints the table.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .._version import __version__

__all__ = ["CHECKS", "DECODE_KEYS", "DTYPES", "FLAGS", "KNOWN", "LOAD_LIMIT", "MARGIN", "NEVER", "PATHS",
           "PREFILL_LENGTHS", "ROUNDS", "SHAPES", "SHORT_CALL_SINGLES", "Crossover", "Timer", "alternated_samples",
           "alternated_times", "best_of", "cache_path", "cpu", "cpu_kind", "crossover_ints", "crossovers", "forget",
           "machine_key", "stored", "switched_off", "tune", "unsure_because"]

log = logging.getLogger("mha.dispatch")

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")  # those that matter
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the grid's (batch, query heads, key/value heads): GQA 4:1 for decoding, as in today's models, then a
# second shape whose work splits differently among the threads (native must win at both)
SHAPES = ((1, 8, 2), (2, 4, 1))
HEAD_DIM = 64
PREFILL_LENGTHS = (16, 128, 256, 512, 1024)  # L = S, non-causal and causal (the worse of the two counts)
DECODE_KEYS = (1, 64, 1024, 4096, 16384)  # L = 1
PATHS = ("full", "plain")  # each point's native call: through the full path, and as the per-call fast path calls it
MARGIN = 0.95  # native must take at most this fraction of torch's time to count as faster (timing noise: a few %)
ROUNDS = 3  # interleaved rounds over the whole grid: native must win the point in every one
LOAD_LIMIT = 0.10  # other processes took more than this share of the machine's CPU time while it measured: under load
LOAD_SPAN = 1.0  # seconds: the least span over which the load is read (a real measurement takes several)
CHECKS = 3  # measurements a table that is not sure gets in all: the first, then one at each of two later first uses
# single calls best_of takes the median of for a call far shorter than its sample (one per call that fits in the
# sample, at most this many): a call of microseconds timed alone is mostly the machine's jitter (2 Zen 3 cores, a
# decoding step over one key: the worst of 8 best_of ratios 1.08 with 3 singles against a median of 0.6; 0.89 with 15)
SHORT_CALL_SINGLES = 15


@dataclass(frozen=True)
class Crossover:
    """Where native starts to win, for one dtype (None: it did not win at the largest measured point):
    through the full path (mha.kernels.native's autograd function: a call with terms, or one that
    needs a gradient), and called directly by the per-call fast path (``plain_``: a plain call that
    needs none, dispatch.plain_sdpa; None where not measured: never)."""
    prefill_work: int | None
    decode_keys: int | None
    plain_prefill_work: int | None = None
    plain_decode_keys: int | None = None


# Measured by `mha bench --sections native` on the CPU the kernel was first tuned on (AMD EPYC,
# AVX-512 + AVX512-BF16, no AMX, 2 threads), and by `mha tune` on an Intel Xeon with AMX (2 threads,
# issue 44's AMX stop: the later of two tables, where they differed the more cautious crossover; float32
# prompts never, their lead there under the margin at some point of every table); used on a CPU of
# that kind until the machine has its own table.
KNOWN = {"avx512_bf16": {torch.float32: Crossover(512 * 512, 1024, 512 * 512, 1024),
                         torch.bfloat16: Crossover(128 * 128, 1024, 128 * 128, 1024),
                         torch.float16: Crossover(256 * 256, 1024, 256 * 256, 1024)},
         "amx": {torch.float32: Crossover(None, 4096, None, 1),
                 torch.bfloat16: Crossover(512 * 512, 4096, 128 * 128, 1024),
                 torch.float16: Crossover(512 * 512, 4096, 128 * 128, 1024)}}
NEVER = Crossover(None, None)


@functools.cache
def cpu() -> dict:
    """{"model": the CPU's name, "flags": those of FLAGS it has, "kind": see cpu_kind}."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:  # the first processor's "model name" and "flags" lines
            for line in f:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    if "flags" in fields:
        flags = set(fields["flags"].split())
    else:  # not Linux: what torch can tell
        capability = torch.backends.cpu.get_cpu_capability()
        flags = {"avx2"} if capability in ("AVX2", "AVX512") else set()
        if capability == "AVX512":
            flags |= {"avx512f"} | ({"avx512_bf16"} if torch.cpu._is_avx512_bf16_supported() else set())
    have = [flag for flag in FLAGS if flag in flags]
    return {"model": model, "flags": have, "kind": cpu_kind(have)}


def cpu_kind(flags) -> str:
    """"amx", "avx512_bf16", "avx512", "avx2" or "other": the class of CPU a measurement carries to."""
    for kind, needs in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if needs in flags:
            return kind
    return "other"


def machine_key() -> str:
    return f"{_fixed_key()} | {torch.get_num_threads()} threads"


@functools.cache
def _fixed_key() -> str:
    info = cpu()
    from . import native
    build, sanitized = native._this_process()
    return (f"{info['model']} | {' '.join(info['flags'])} | native {build}{' sanitized' if sanitized else ''} "
            f"{native.source_digest()} | torch {torch.__version__} | mha {__version__}")


def cache_path() -> Path:
    if os.environ.get("MHA_TUNE_CACHE"):
        return Path(os.environ["MHA_TUNE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mha" / "tune.json"


# -- the table auto reads --------------------------------------------------------------------------

_tables: dict[str, dict | None] = {}  # machine key -> stored table (None: looked, none there)
_resolved: dict[tuple[int, torch.dtype], Crossover] = {}  # (threads, dtype) -> what auto uses: the per-call lookup
# dtype -> (threads, (plain_decode_keys, plain_prefill_work), (decode_keys, prefill_work)), -1 for never, at the
# thread count last resolved: what the native fast path takes (dispatch.plain_sdpa reads it directly, the kernel
# checks the thread count, and crossover_ints resolves it on a miss)
resolved_ints: dict[torch.dtype, tuple[int, tuple[int, int], tuple[int, int]]] = {}
_tried: set[str] = set()  # machine keys measured at first use in this process (tried once, even if it failed)
_first_use_lock = threading.Lock()


def stored(key: str | None = None) -> dict | None:
    """The stored table of this machine: {"crossovers": {dtype name: Crossover fields}, "ratios": ...,
    "measured": time, "cpu": ..., "threads": ...}, or None."""
    key = key or machine_key()
    if key not in _tables:
        table = _read().get(key)
        if table is not None and not _well_formed(table):
            log.warning("mha: the dispatch table in %s for this machine is malformed; ignored (mha tune "
                        "measures it again)", cache_path())
            table = None
        if table is not None and not _ratios_well_formed(table.get("ratios", {})):  # shown only: the crossovers stay
            log.warning("mha: the dispatch table in %s holds ratios of another form; its crossovers are kept, the "
                        "ratios left out (mha tune measures them again)", cache_path())
            table = {name: value for name, value in table.items() if name != "ratios"}
        _tables[key] = table
    return _tables[key]


def _ratios_well_formed(ratios) -> bool:
    """{dtype name: {call name: {size: ratio}}}, sizes integral (JSON keeps them as strings), ratios
    numbers; the crossovers alone decide auto, the ratios are what `mha tune --show` prints."""
    if not isinstance(ratios, dict):
        return False
    calls = {call for call, _ in RATIO_FIELDS}
    for by_call in ratios.values():
        if not isinstance(by_call, dict) or not set(by_call) <= calls:
            return False
        for points in by_call.values():
            if not isinstance(points, dict):
                return False
            for size, ratio in points.items():
                if not str(size).isdecimal() or isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
                    return False
    return True


def _well_formed(table) -> bool:
    """Whether a stored table has the form tune() writes: {"crossovers": {dtype name: {each field of
    Crossover: int | None}}, ...} (a file edited by hand must not break a call)."""
    if not isinstance(table, dict) or not isinstance(table.get("crossovers"), dict):
        return False
    for name, found in table["crossovers"].items():
        if name not in DTYPES or not isinstance(found, dict) or set(found) != set(Crossover.__dataclass_fields__):
            return False
        if not all(value is None or (type(value) is int and value >= 0) for value in found.values()):
            return False
    return (isinstance(table.get("sure", True), bool) and type(table.get("checks", 1)) is int
            and all(table.get(name) is None or isinstance(table[name], (int, float)) for name in ("load", "measured_at")))


def crossovers(dtype: torch.dtype) -> Crossover:
    """Where native beats torch for ``dtype`` on this machine: measured (first use measures unless
    MHA_TUNE=off), else KNOWN for this CPU kind, else never. A dict read once known."""
    threads = torch.get_num_threads()
    found = _resolved.get((threads, dtype))
    if found is None:
        found = _resolved[threads, dtype] = _look_up(dtype)
    return found


def crossover_ints(dtype: torch.dtype) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(threads, (plain_decode_keys, plain_prefill_work), (decode_keys, prefill_work)): crossovers(dtype) at the
    thread count in use, -1 for never; kept in resolved_ints."""
    threads = torch.get_num_threads()
    found = crossovers(dtype)
    ints = (threads, *(tuple(-1 if x is None else x for x in pair) for pair in (
        (found.plain_decode_keys, found.plain_prefill_work), (found.decode_keys, found.prefill_work))))
    resolved_ints[dtype] = ints
    return ints


def switched_off() -> bool:
    """MHA_TUNE=off: nothing measures by itself (first use, mha verify); `mha tune` still does."""
    return os.environ.get("MHA_TUNE", "auto").lower() == "off"


def _look_up(dtype: torch.dtype) -> Crossover:
    key = machine_key()
    table = stored(key)
    if (table is None or _to_check(table)) and not switched_off() and not _among_ranks():
        with _first_use_lock, _file_lock(_measuring_lock()):  # one thread, one process measures; the others
            _tables.pop(key, None)                                # wait and read its table
            table = stored(key)
            if (table is None or _to_check(table)) and key not in _tried:
                _tried.add(key)
                table = _first_use(table) or table
    if table is None:
        return KNOWN.get(cpu()["kind"], {}).get(dtype, NEVER)
    measured = table.get("crossovers", {})
    name = next((n for n, d in DTYPES.items() if d == dtype), None)
    if name not in measured and dtype == torch.float16:
        name = "bfloat16"  # not measured: as bfloat16, the kernel's same half-precision paths
    return Crossover(**measured[name]) if name in measured else NEVER


def _among_ranks() -> bool:
    """Whether this process is one of several torch.distributed ranks: they would measure at once,
    on shared cores, and store what the crowding made of it (`mha tune` before the launch does it)."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_STARTED = time.time()  # when this process imported the tuning: a table measured since is a sibling's


def _to_check(table: dict) -> bool:
    """Whether a stored table is to be measured again: it is not sure (measured under load), has had
    fewer than CHECKS measurements, and was measured before this process started (processes that
    start together, a pool's workers, wait for one to measure and take its table: their own start
    was the load, and measuring in turn would add to it)."""
    return (not table.get("sure", True) and table.get("checks", 1) < CHECKS
            and table.get("measured_at", 0.0) < _STARTED)


def unsure_because(table: dict) -> str | None:
    """Why a table is not sure, in words (None: it is): the load while it was measured."""
    if table.get("sure", True):
        return None
    return f"other processes took {table['load']:.0%} of the CPUs while it was measured"


def _first_use(previous: dict | None = None) -> dict | None:
    """Measure when auto first needs the answer and no table is stored, or the stored one is to be
    checked again (``previous``); a failure leaves what was there (else KNOWN applies) and is logged,
    never raised into the caller's attention call."""
    from . import native
    if not native.ready():
        return None
    checks = 1 if previous is None else previous.get("checks", 1) + 1
    if previous is None:
        log.info("mha: measuring where the native kernel beats torch on this CPU (once; MHA_TUNE=off skips it)")
    else:
        log.info("mha: the dispatch table stored %s is not sure (%s); measuring again (measurement %d of %d)",
                 previous.get("measured"), unsure_because(previous), checks, CHECKS)
    try:
        table = tune(checks=checks)
    except Exception as error:  # noqa: BLE001 - a measurement must never break the user's call
        log.warning("mha: measuring the dispatch failed (%s); using %s", error,
                    "the table stored before" if previous else "the defaults of this CPU kind")
        return None
    if not table["sure"]:
        log.warning("mha: the dispatch table just measured is not sure (%s)%s", unsure_because(table),
                    "; kept, measured again no more: `mha tune` on a quiet machine measures it again"
                    if checks >= CHECKS else f"; a later process measures it again ({checks} of {CHECKS})")
    return table


# -- measuring -------------------------------------------------------------------------------------

Timer = Callable[[str, dict, Callable[[], object], Callable[[], object]], tuple[float, float]]


def best_of(point: str, shape: dict, native_call, torch_call, *, repeat: int = 2, singles: int = 3,
            sample_s: float = 2e-3) -> tuple[float, float]:
    """(native seconds, torch seconds) per call, timed two ways, and the way in which native fares
    worse (its higher ratio) returned: back-to-back loops (the best of ``repeat`` runs of each in
    turn, each long enough to last about ``sample_s``: a short call timed alone is mostly the
    timer's noise), and single calls alternated with other work (the median of ``singles`` calls
    of each, a sweep over memory larger than the caches between them, as a model's other layers
    sweep them between its attention calls; more of them for a short call, up to SHORT_CALL_SINGLES:
    one per call that fits in ``sample_s``)."""
    native_call(), torch_call()  # warm-up
    start = time.perf_counter()
    torch_call()
    calls = max(1, min(1000, int(sample_s / max(time.perf_counter() - start, 1e-7))))
    singles = max(singles, min(SHORT_CALL_SINGLES, calls))
    looped = [float("inf"), float("inf")]
    for _ in range(repeat):
        for i, call in enumerate((native_call, torch_call)):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            looped[i] = min(looped[i], (time.perf_counter() - start) / calls)
    alone = alternated_times({"native": native_call, "torch": torch_call}, singles, warm=False)
    alternated = [alone["native"], alone["torch"]]
    return max((looped, alternated), key=lambda pair: pair[0] / pair[1])


def alternated_samples(calls: dict[str, Callable[[], object]], rounds: int, *,
                       warm: bool = True) -> dict[str, list[float]]:
    """Seconds of ``rounds`` single calls of each, taken in turn, each call after a sweep over memory
    larger than the caches (_other_work), as a model's other layers sweep them between its
    attention calls: how calls meet users, where back-to-back loops keep all warm. Every other round
    takes them in the reverse order: the one that went first read 1.13-1.16x slower against
    torch's call here (mha's T16 call over torch's: 1.33 first, 1.15 second; torch's against
    itself 1.01; Xeon with AMX, 2 threads). ``warm``: one untimed call of each first."""
    if warm:
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    ways = list(calls.items())
    for round_ in range(rounds):
        for name, call in (ways if round_ % 2 == 0 else ways[::-1]):
            _other_work()
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def alternated_times(calls: dict[str, Callable[[], object]], rounds: int, *, warm: bool = True) -> dict[str, float]:
    """The median of each one's alternated_samples."""
    return {name: sorted(ts)[len(ts) // 2] for name, ts in alternated_samples(calls, rounds, warm=warm).items()}


@functools.cache
def _sweep() -> torch.Tensor:
    return torch.zeros(8 << 20, dtype=torch.uint8)  # 8 MiB: past the caches a core of this size has


def _other_work() -> None:
    _sweep().add_(1)


def tune(*, timer: Timer | None = None, store: bool = True, checks: int = 1) -> dict:
    """Measure the grid, store the table under this machine's key (unless ``store`` is False) and
    return it. ``timer(point, shape, native_call, torch_call) -> (native s, torch s)`` (tests give
    a fake one; default: best_of), asked ROUNDS times for every point at every shape of SHAPES;
    a point's ratio is the worst of them. The table says how sure it is: "load", the share of the
    machine's CPU time other processes took meanwhile (None where the OS does not say), and "sure"
    (that load at most LOAD_LIMIT); "checks" counts the measurements (a table not sure is measured
    again at later first uses, up to CHECKS). "split" lists the points where native won some rounds
    and lost others: noise near the margin, which the worst round settles (for torch); shown, not
    measured again (a quiet machine splits there too). "untimed" lists the full path's points that
    took their fast-path call's ratio (see the module's docstring)."""
    timer = timer or best_of
    worst: dict[tuple[str, str, str, int], float] = {}
    won: dict[tuple[str, str, str, int], set[bool]] = {}
    untimed: list[str] = []
    before = _cpu_times()
    # run at first use inside a caller's call: none of its context (autocast, grad) may reach the timings
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for round_ in range(ROUNDS):
            fast_path_ratio = None  # the point's fast-path call's, timed just before its full path's
            for point, shape, native_call, torch_call in _grid(round_):
                if shape["path"] == "full" and fast_path_ratio is not None and fast_path_ratio > MARGIN:
                    ratio = fast_path_ratio
                    untimed.append(point)
                else:
                    native_s, torch_s = timer(point, shape, native_call, torch_call)
                    ratio = native_s / torch_s
                fast_path_ratio = ratio if shape["path"] == "plain" else None
                call, size = ("decode S", shape["S"]) if shape["L"] == 1 else ("prefill L*S", shape["L"] * shape["S"])
                key = (shape["dtype"], shape["path"], call, size)
                worst[key] = max(worst.get(key, 0.0), ratio)
                won.setdefault(key, set()).add(ratio <= MARGIN)
    load = _others_share(before, _cpu_times())
    split = [f"{dtype} {_named(path, call.split()[0])} at {size_label(call, size)}"
             for (dtype, path, call, size), sides in sorted(won.items()) if len(sides) > 1]
    found, ratios = {}, {}
    for name in DTYPES:
        ratios[name] = {_named(path, call): {size: r for (d, p, c, size), r in sorted(worst.items())
                                             if d == name and p == path and c == call}
                        for path in PATHS for call in ("prefill L*S", "decode S")}
        wins = {field: _from_where_it_wins(list(ratios[name][call].items())) for call, field in RATIO_FIELDS}
        found[name] = asdict(Crossover(**wins))
    table = {"crossovers": found, "ratios": ratios, "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
             "cpu": cpu(), "threads": torch.get_num_threads(), "rounds": ROUNDS,
             "shapes": [list(shape) for shape in SHAPES],
             "load": load, "split": split, "untimed": untimed, "sure": load is None or load <= LOAD_LIMIT, "checks": checks,
             "measured_at": time.time()}
    if store:
        _write(machine_key(), table)
    return table


# the ratios' names in a table, each with the Crossover field it decides
RATIO_FIELDS = (("prefill L*S", "prefill_work"), ("decode S", "decode_keys"),
                ("plain prefill L*S", "plain_prefill_work"), ("plain decode S", "plain_decode_keys"))


def size_label(call: str, size: int | str) -> str:
    """A point's size in the crossovers' terms: "L = S = 128" for a prefill's L*S of 16384 (a square,
    as the grid measures), "L*S = N" for one that is not; "S = 1024" for a decoding step's."""
    size = int(size)  # a stored table's sizes are JSON keys: strings
    if call.split()[-1] != "L*S":
        return f"S = {size}"
    side = math.isqrt(size)
    return f"L = S = {side}" if side * side == size else f"L*S = {size}"


def _named(path: str, call: str) -> str:
    """A ratio's name in a table: the call ("prefill L*S", "decode S"), "plain " before it for the fast path's."""
    return call if path == "full" else f"plain {call}"


def _cpu_times() -> tuple[float, float, float] | None:
    """(wall seconds, the machine's busy CPU seconds, this process's CPU seconds) now, from Linux's
    /proc (None elsewhere): busy counts every state but idle and waiting on I/O, steal included (a
    virtual machine's host gave the core to another)."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()  # after the command's name: state is field 3, utime 14, stime 15
        tick = os.sysconf("SC_CLK_TCK")
        return time.monotonic(), (sum(values) - values[3] - values[4]) / tick, (int(own[11]) + int(own[12])) / tick
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _others_share(before, after) -> float | None:
    """The share of the machine's CPU time (every core's) that other processes took between two
    _cpu_times() readings, or None where they could not be read or lie under LOAD_SPAN apart (the
    counters tick at 100 Hz: a shorter span is mostly their rounding)."""
    if before is None or after is None or after[0] - before[0] < LOAD_SPAN:
        return None
    others = (after[1] - before[1]) - (after[2] - before[2])
    return min(1.0, max(0.0, others / ((after[0] - before[0]) * (os.cpu_count() or 1))))


_POOL = max([3 * B * H * T * HEAD_DIM for B, H, _ in SHAPES for T in PREFILL_LENGTHS]
            + [(B * H + 2 * B * Hkv * S) * HEAD_DIM for B, H, Hkv in SHAPES for S in DECODE_KEYS])  # a point's q, k, v


def _grid(round_: int):
    """(point, shape, native call, torch call) of every point of one round: each dtype, each
    (batch, heads, kv heads) of SHAPES, the prefill lengths causal and not (native must win both),
    the decoding steps; each with native's call through the full path (shape["path"] "full") and as
    the per-call fast path makes it (``"plain"``: the native kernel's plain_sdpa told that native is
    faster, as auto calls it on a plain call that needs no gradient). Each point's q, k and v are
    consecutive views of one draw per dtype and round (a draw per tensor took 0.8 s of a tune on 2
    Zen 3 cores, whatever the timer)."""
    from .contract import NONE, TOP_LEFT_CAUSAL
    from .native import _kernel, native_attention

    def calls(point, where, q, k, v, contract, causal=False):  # the fast path's call first (see tune)
        torch_call = functools.partial(_torch, q, k, v, causal)
        yield (f"{point} plain", dict(where, path="plain"),
               functools.partial(_kernel().plain_sdpa, q, k, v, causal, True, 0, {q.dtype: (-1, _ALWAYS, _ALWAYS)}, None),
               torch_call)
        yield point, dict(where, path="full"), functools.partial(native_attention, q, k, v, contract), torch_call

    generator = torch.Generator().manual_seed(round_)  # the caller's random stream is left as it was
    for name, dtype in DTYPES.items():
        pool = torch.randn(_POOL, generator=generator).to(dtype)
        for B, H, Hkv in SHAPES:
            where = dict(dtype=name, B=B, H=H, Hkv=Hkv, round=round_)
            for T in PREFILL_LENGTHS:
                q, k, v = _views(pool, *[(B, H, T, HEAD_DIM)] * 3)
                for causal, contract in ((False, NONE), (True, TOP_LEFT_CAUSAL)):
                    yield from calls(f"{name} B{B} H{H} prefill T={T}{' causal' if causal else ''}",
                                     dict(where, L=T, S=T, causal=causal), q, k, v, contract, causal)
            for S in DECODE_KEYS:
                q, k, v = _views(pool, (B, H, 1, HEAD_DIM), *[(B, Hkv, S, HEAD_DIM)] * 2)
                yield from calls(f"{name} B{B} H{H}/{Hkv} decode S={S}", dict(where, L=1, S=S), q, k, v, NONE)


_ALWAYS = (0, 0)  # crossovers (decode keys, prefill work) that give the native kernel every call


def _views(pool: torch.Tensor, *sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Consecutive views of ``pool`` shaped ``sizes``, one after another."""
    ends = itertools.accumulate(math.prod(size) for size in sizes)
    return tuple(pool[end - math.prod(size):end].view(size) for size, end in zip(sizes, ends))


def _torch(q, k, v, causal=False):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            enable_gqa=k.shape[-3] != q.shape[-3])


def _from_where_it_wins(points: list[tuple[int, float]]) -> int | None:
    """The least size from which native is faster (ratio <= MARGIN) at every larger measured size."""
    start = None
    for size, ratio in sorted(points):
        if ratio <= MARGIN:
            start = size if start is None else start
        else:
            start = None
    return start


# -- the cache file --------------------------------------------------------------------------------

def _read() -> dict:
    path = cache_path()
    try:
        data = json.loads(path.read_text())
    except OSError:  # not there (yet), or not readable
        return {}
    except ValueError:
        data = None
    if not isinstance(data, dict):
        log.warning("mha: the dispatch cache %s is not a JSON object; ignored (mha tune writes it anew)", path)
        return {}
    return data


def _write(key: str, table: dict) -> None:
    """Add this machine's table to the cache file (written whole to a temporary file, then renamed:
    two processes tuning at once leave one complete file)."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path.with_suffix(".lock")):  # read, add, write: another process's key is kept
        data = {**_read(), key: table}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            try:
                json.dump(data, f, indent=1)
            except BaseException:
                os.unlink(f.name)
                raise
        os.replace(f.name, path)
    _tables[key] = table
    _resolved.clear()
    resolved_ints.clear()


def _measuring_lock() -> Path:
    """The lock file held while a process measures at first use (beside the cache; not the cache's
    own write lock, which the measuring process takes again to store its table)."""
    return cache_path().with_suffix(".measuring.lock")


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive flock on ``path`` (released when the process ends, however it ends); none off
    POSIX or where the file cannot be made."""
    try:
        import fcntl
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except (ImportError, OSError):  # not POSIX, or a folder it may not write: no lock (a failed write is logged)
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def forget() -> None:
    """Drop what this process read from the cache and decided (the next call reads the file again)."""
    _tables.clear()
    _resolved.clear()
    resolved_ints.clear()
    _tried.clear()
