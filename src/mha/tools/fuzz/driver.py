"""The fuzz driver: cases run in child processes, each finding reported once with its smallest case.

    python -m mha.tools.fuzz --cases 20000 --seed 1 [--workers 2] [--kinds sdpa,paged] [--out findings.json]
    python -m mha.tools.fuzz --replay '<case json>'     one case, with the traceback of what it raises
    python -m mha.tools.fuzz --device cuda ...           the calls on a CUDA device (fuzz.properties)

A child process runs the cases (spawned: no state of this one), so that a crash (a signal, as a
SIGFPE or SIGSEGV in a compiled kernel) or a hang is a finding of its own, and the run goes on in a
fresh child. Findings are grouped by signature (kind:backend:property:dtype); the first case of a
signature is shrunk (smaller sizes, fewer terms, plain layouts) while it keeps the signature, and
the smallest case seen is kept. Exit status: 0 when nothing was found, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator

from .cases import Case, draw


class Crash(Exception):
    """The child process died (a signal) or did not answer in time."""


class Isolated:
    """A child process that runs calls sent to it (picklable functions and arguments); a crash or a
    hang raises Crash here and the next call starts a fresh child. ``timeout`` bounds a call's run;
    a fresh child's start and the imports its call's unpickling needs (torch: seconds on a busy
    machine) have ``STARTUP`` seconds of their own, so that a slow start is not reported as a hang."""

    STARTUP = 300.0

    def __init__(self, timeout: float = 300.0):
        self.timeout, self.process, self.connection = timeout, None, None

    def __call__(self, function: Callable, *args):
        if self.process is None or not self.process.is_alive():
            self._start()
        self.connection.send((function, args))
        self._receive(self.STARTUP, "did not take the call")  # ("started", None): the run begins
        status, value = self._receive(self.timeout, "no answer")
        if status == "raised":
            raise RuntimeError(f"the child process raised:\n{value}")
        return value

    def _receive(self, timeout: float, silence: str) -> tuple[str, object]:
        if not self.connection.poll(timeout):
            self.close()
            raise Crash(f"{silence} in {timeout:.0f} s (a hang)")
        try:
            return self.connection.recv()
        except (EOFError, ConnectionError):
            self.process.join(5)
            code = self.process.exitcode
            self.close()
            raise Crash(f"the child process died: {_death(code)}") from None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), daemon=True)
        self.process.start()
        theirs.close()

    def close(self) -> None:
        if self.process is not None:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(5)
        if self.connection is not None:
            self.connection.close()
        self.process = self.connection = None


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _serve(connection) -> None:
    """The child's loop: run each call, send back its value or the traceback of what it raised."""
    while True:
        try:
            function, args = connection.recv()  # (unpickling imports the function's module)
        except EOFError:
            return
        connection.send(("started", None))
        try:
            connection.send(("ok", function(*args)))
        except BaseException:  # noqa: BLE001  (the parent reports it)
            connection.send(("raised", traceback.format_exc()))


# -- one case, in the child ----------------------------------------------------------------------------


def signatures(case_json: str, properties: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """(signature, detail) of every finding of the case (runs in the child); all properties, or these."""
    from .properties import check
    chosen = {} if properties is None else {"properties": tuple(properties)}
    return [(f.signature, f.detail) for f in check(Case.from_json(case_json), **chosen)]


def _checked(worker: Isolated, case: Case) -> list[tuple[str, str]]:
    try:
        return worker(signatures, case.to_json())
    except Crash as crash:
        return [(f"{case.kind}:*:crash:{case.dtype}", str(crash))]
    except RuntimeError as error:  # the checker itself failed: a finding too (with its traceback)
        return [(f"{case.kind}:*:checker:{case.dtype}", str(error)[-600:])]


# -- shrinking -----------------------------------------------------------------------------------------


def simpler(case: Case) -> Iterator[Case]:
    """Cases one step simpler than ``case``: a size smaller, a term fewer, a plainer layout."""
    def smaller(n: int) -> list[int]:
        return sorted({x for x in (0, 1, 2, n // 2, n - 1) if 0 <= x < n}, reverse=True)[::-1]

    for name in ("L", "S", "D", "Dv"):
        for n in smaller(getattr(case, name)):
            yield case.replace(**{name: n})
    for name in ("q_lead", "k_lead", "v_lead"):
        lead = getattr(case, name)
        for i, n in enumerate(lead):
            for m in smaller(n):
                yield case.replace(**{name: (*lead[:i], m, *lead[i + 1:])})
    if case.q_lead and case.q_lead == case.k_lead == case.v_lead and len(case.q_lead) > 1:
        yield case.replace(q_lead=case.q_lead[1:], k_lead=case.k_lead[1:], v_lead=case.v_lead[1:])
    for name, plain in (("is_causal", False), ("window", None), ("alibi", False), ("softcap", None), ("sinks", False),
                        ("mask", None), ("scale", None), ("magnitude", 1.0), ("poison", None), ("alignment", None),
                        ("grad", False), ("threads", 1), ("dtype", "float32")):
        if getattr(case, name) != plain:
            yield case.replace(**{name: plain})
    if case.layouts != ("contiguous",) * 3:
        for i in range(3):
            if case.layouts[i] != "contiguous":
                yield case.replace(layouts=tuple("contiguous" if j == i else x for j, x in enumerate(case.layouts)))
    if case.kind == "paged":  # k's and v's heads together (the pool's pages hold both), smaller pages
        for m in smaller(case.k_lead[-1] if case.k_lead else 0):
            yield case.replace(k_lead=(m,), v_lead=(m,))
        for n in smaller(case.block_size):
            yield case.replace(block_size=n)
    for name in ("lengths", "k_lengths"):
        values = getattr(case, name)
        for i in range(len(values)):
            if case.kind in ("varlen", "paged") and len(values) > 1:
                yield case.replace(lengths=case.lengths[:i] + case.lengths[i + 1:],
                                   k_lengths=case.k_lengths[:i] + case.k_lengths[i + 1:])
            for m in smaller(values[i]):
                yield case.replace(**{name: (*values[:i], m, *values[i + 1:])})


def shrink(worker: Isolated, case: Case, signature: str, tries: int = 80) -> Case:
    """The smallest case reachable by simpler() steps that still shows ``signature``."""
    best, steps = case, 0
    progress = True
    while progress and steps < tries:
        progress = False
        for candidate in simpler(best):
            if steps >= tries:
                break
            if not _valid(candidate):
                continue
            steps += 1
            if any(s == signature for s, _ in _checked(worker, candidate)):
                best, progress = candidate, True
                break
    return best


def _valid(case: Case) -> bool:
    """Whether a shrunk case still describes a call the checker can make (shapes that broadcast)."""
    if case.kind == "varlen":
        return len(case.lengths) == len(case.k_lengths) >= 1
    if case.kind == "paged":
        return _valid_paged(case)
    if case.kind == "positions":
        return case.L <= case.S and all(n <= case.S for n in case.lengths) and len(case.lengths) == case.q_lead[0]
    if case.kind != "sdpa":
        return True
    if not (len(case.q_lead) == len(case.k_lead) == len(case.v_lead)):
        return False
    for i, (a, b, c) in enumerate(zip(case.q_lead, case.k_lead, case.v_lead)):
        last = i == len(case.q_lead) - 1
        if case.enable_gqa and last:
            if (b and a % b) or (c and a % c) or (not b and a) or (not c and a):
                return False
        elif len({x for x in (a, b, c) if x != 1}) > 1:
            return False
    if case.alibi or case.sinks:
        return bool(case.q_lead)
    return True


def _valid_paged(case: Case) -> bool:
    """One head dim each, kv heads dividing the query heads, 1 <= L_b <= S_b, pages of a slot or more."""
    heads = len(case.q_lead) == len(case.k_lead) == 1 and case.k_lead == case.v_lead
    heads = heads and case.q_lead[0] >= 1 and case.k_lead[0] >= 1 and case.q_lead[0] % case.k_lead[0] == 0
    rows = len(case.lengths) == len(case.k_lengths) >= 1 and all(1 <= L <= S for L, S in zip(case.lengths, case.k_lengths))
    return heads and rows and case.block_size >= 1


# -- the run ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    cases: int = 0
    findings: dict[str, dict] = dataclasses.field(default_factory=dict)  # signature -> {case, detail, seen}

    def add(self, signature: str, detail: str, case: Case) -> bool:
        """Record a finding; True when its signature is new."""
        known = self.findings.get(signature)
        if known is None:
            self.findings[signature] = {"case": case, "detail": detail, "seen": 1}
            return True
        known["seen"] += 1
        if case.size() < known["case"].size():
            known.update(case=case, detail=detail)
        return False


def run(cases: int, seed: int, *, workers: int = 1, kinds: tuple[str, ...] | None = None, shrink_tries: int = 80,
        timeout: float = 300.0, log=print) -> Report:
    rng = random.Random(seed)
    report = Report()
    pool = [Isolated(timeout) for _ in range(max(1, workers))]
    started = time.time()
    try:
        batch: list[Case] = []
        for _ in range(cases):
            case = draw(rng)
            while kinds and case.kind not in kinds:
                case = draw(rng)
            batch.append(case)
            if len(batch) == len(pool):
                _run_batch(pool, batch, report, shrink_tries, log)
                batch = []
            if batch == [] and report.cases % 500 < len(pool):
                log(f"{report.cases} cases, {len(report.findings)} findings, {time.time() - started:.0f} s")
        if batch:
            _run_batch(pool, batch, report, shrink_tries, log)
    finally:
        for worker in pool:
            worker.close()
    return report


def _run_batch(pool: list[Isolated], batch: list[Case], report: Report, shrink_tries: int, log) -> None:
    """The cases of a batch, one per worker, side by side (each worker is a process of its own)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(len(pool)) as threads:
        results = list(threads.map(_checked, pool[:len(batch)], batch))
    for case, found in zip(batch, results):
        report.cases += 1
        for signature, detail in found:
            if report.add(signature, detail, case):
                smallest = shrink(pool[0], case, signature, shrink_tries) if shrink_tries else case
                report.add(signature, detail, smallest)
                log(f"new: {signature}: {detail.splitlines()[0][:200]}\n     {report.findings[signature]['case'].to_json()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha.tools.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--kinds", default="", help="comma-separated: sdpa, positions, varlen, paged, bad (default: all)")
    parser.add_argument("--shrink-tries", type=int, default=80)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one case may take before it is a hang")
    parser.add_argument("--out", help="write the findings as JSON here")
    parser.add_argument("--replay", help="one case (its JSON): print what is wrong with it, tracebacks included")
    parser.add_argument("--device", default="cpu", help="where the calls run: cpu (default) or cuda")
    args = parser.parse_args(argv)
    os.environ["MHA_FUZZ_DEVICE"] = args.device  # read by fuzz.properties in the children (and in a replay)
    if args.replay:
        return _replay(Case.from_json(args.replay))
    kinds = tuple(k for k in args.kinds.split(",") if k) or None
    started = time.time()
    report = run(args.cases, args.seed, workers=args.workers, kinds=kinds, shrink_tries=args.shrink_tries,
                 timeout=args.timeout, log=lambda line: print(line, flush=True))
    print(f"\n{report.cases} cases (seed {args.seed}) in {time.time() - started:.0f} s: "
          f"{len(report.findings)} distinct findings")
    for signature, found in sorted(report.findings.items()):
        print(f"\n{signature} (seen {found['seen']} times)\n  {found['detail'].splitlines()[0][:300]}\n"
              f"  python -m mha.tools.fuzz --replay '{found['case'].to_json()}'")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"cases": report.cases, "seed": args.seed,
                       "findings": {s: {**f, "case": dataclasses.asdict(f["case"])} for s, f in report.findings.items()}},
                      handle, indent=1)
    return 1 if report.findings else 0


def _replay(case: Case) -> int:
    """Run one case here (not in a child): what is wrong with it, and the traceback of any exception."""
    from .properties import check
    print(case.to_json())
    try:
        found = check(case)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    for finding in found:
        print(f"{finding.signature}: {finding.detail}")
    if any(":raises:" in f.signature for f in found):
        _traceback_of(case)
    print("nothing wrong" if not found else f"{len(found)} findings")
    return 1 if found else 0


def _traceback_of(case: Case) -> None:
    from .cases import generator, tensor
    from .properties import _run, backends, prepare
    setup = prepare(case)
    grad = case.grad and case.kind != "paged"
    cotangent = tensor(setup.out_shape, "contiguous", setup.inputs[0].dtype, generator(case, 4)) if grad else None
    for backend in backends(kind=case.kind):
        try:
            _run(setup.call, backend, setup.inputs, cotangent)
        except Exception:  # noqa: BLE001
            print(f"--- {backend}:")
            traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
