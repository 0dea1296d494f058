"""The fuzz driver (mha.tools.fuzz): child processes that survive crashes and hangs, findings reported
once each with their smallest case, the exit status, and the checker's own rules."""

import json
import math
import os
import random
import signal
import time

import pytest
import torch
from torch import Tensor

from mha.kernels import dispatch, native
from mha.positions import Band
from mha.tools.fuzz import Case, Finding, cases, check, draw, driver, properties
from mha.tools.fuzz.cases import PAGE_SIZES, generator
from mha.tools.fuzz.driver import Crash, Isolated, Report, shrink
from mha.tools.fuzz.reference import Spec, error, reference, tolerance


def _die(how: str):
    if how == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if how == "hang":
        time.sleep(60)
    if how == "raise":
        raise KeyError("inside")
    return os.getpid()


@pytest.mark.slow
def test_a_crash_or_a_hang_in_the_child_is_reported_and_the_next_call_gets_a_fresh_child():
    child = Isolated(timeout=3)
    try:
        first = child(_die, "none")
        with pytest.raises(Crash, match="the child process died: signal SIGSEGV"):
            child(_die, "segv")
        assert child(_die, "none") != first  # a new process
        with pytest.raises(Crash, match="no answer in 3 s"):
            child(_die, "hang")
        with pytest.raises(RuntimeError, match="KeyError: 'inside'"):  # the child's traceback comes back
            child(_die, "raise")
        assert isinstance(child(_die, "none"), int)
    finally:
        child.close()


def _arrive_slowly(seconds: float) -> str:
    time.sleep(seconds)
    return "arrived"


class _SlowToUnpickle:
    """An argument whose unpickling in the child takes ``seconds``, as a call whose module imports torch
    on a busy machine does."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __reduce__(self):
        return _arrive_slowly, (self.seconds,)


@pytest.mark.slow
def test_a_child_slow_to_take_a_call_is_not_a_hang_until_its_startup_time_is_out(monkeypatch):
    """Isolated.timeout bounds the call's run, not the fresh child's start and the unpickling of the
    call (which imports its module); Isolated.STARTUP bounds those."""
    child = Isolated(timeout=1)
    try:
        assert child(str, _SlowToUnpickle(2.0)) == "arrived"
        monkeypatch.setattr(Isolated, "STARTUP", 1.0)
        with pytest.raises(Crash, match="did not take the call in 1 s"):
            child(str, _SlowToUnpickle(30.0))
        monkeypatch.undo()
        assert child(str, "fresh") == "fresh"  # a fresh child after the stuck one
    finally:
        child.close()


def test_a_case_replays_from_its_json():
    case = draw(random.Random(3))
    assert Case.from_json(case.to_json()) == case


class _FakeWorker:
    """Answers like a child running the checker: a finding while L > 3 and softcap is set."""

    def __call__(self, function, case_json, *rest):
        case = Case.from_json(case_json)
        return [("sdpa:native:equal:out:float32", "too far")] if case.L > 3 and case.softcap else []


def test_shrinking_keeps_the_signature_and_finds_the_smallest_case():
    case = Case(L=65, S=257, D=64, Dv=64, q_lead=(2, 4), k_lead=(2, 4), v_lead=(2, 4), softcap=5.0, is_causal=True,
                layouts=("transposed", "contiguous", "mT"), dtype="bfloat16")
    small = shrink(_FakeWorker(), case, "sdpa:native:equal:out:float32", tries=500)
    assert small.L == 4 and small.softcap == 5.0  # what the finding needs, kept
    assert (small.S, small.D, small.Dv, small.is_causal, small.dtype) == (0, 0, 0, False, "float32")
    assert small.layouts == ("contiguous",) * 3 and 0 in small.q_lead


def test_a_report_keeps_each_signature_once_with_its_smallest_case():
    report = Report()
    big, small = Case(L=64, S=64), Case(L=2, S=3)
    assert report.add("x", "first", big) and not report.add("x", "again", small)
    assert report.findings["x"]["case"] == small and report.findings["x"]["seen"] == 2


def test_the_command_exits_1_when_anything_is_found(monkeypatch, capsys, tmp_path):
    found = Report(cases=7)
    found.add("sdpa:native:crash:float32", "the child process died: signal SIGFPE", Case(L=0))
    monkeypatch.setattr(driver, "run", lambda *args, **kwargs: found)
    assert driver.main(["--cases", "7", "--out", str(tmp_path / "f.json")]) == 1
    printed = capsys.readouterr().out
    assert "1 distinct findings" in printed and "python -m mha.tools.fuzz --replay" in printed
    assert json.loads((tmp_path / "f.json").read_text())["findings"]["sdpa:native:crash:float32"]["case"]["L"] == 0
    monkeypatch.setattr(driver, "run", lambda *args, **kwargs: Report(cases=7))
    assert driver.main(["--cases", "7"]) == 0


@pytest.mark.slow
def test_a_short_run_finds_nothing():
    report = driver.run(40, seed=2024, workers=1, shrink_tries=0)
    assert report.cases == 40 and report.findings == {}, report.findings


def test_the_checker_finds_a_wrong_answer():
    """The checker is not a test that cannot fail: a backend that is off by a little is found."""
    case = Case(q_lead=(1, 2), k_lead=(1, 2), v_lead=(1, 2), L=16, S=16)
    original = properties.scaled_dot_product_attention

    def off(*args, backend, **kwargs):
        out = original(*args, backend=backend, **kwargs)
        return out * (1 + 1e-4) if backend == "flash" else out
    try:
        properties.scaled_dot_product_attention = off
        found = check(case, properties=("equal",))
    finally:
        properties.scaled_dot_product_attention = original
    assert [f.signature for f in found] == [f"sdpa:flash:equal:{x}:float32" for x in ("out", "dq", "dk", "dv")]
    assert isinstance(found[0], Finding)


def test_a_packings_torch_error_counts_the_one_torch_makes_over_the_whole_packing():
    """A saturated softmax (scores near 700) over packed sequences, one of them keys alone: torch's
    fused kernel over the packing with its block mask (what the sdpa backend runs) errs 2e-5 in dV on
    AVX-512 CPUs (an AMX Xeon, a Zen 4) where over each sequence alone it errs 4e-9; that error is
    torch's own for the call (found by the property test, which reported the sdpa and auto backends).
    On an AVX2 Zen 3 torch's kernel errs 4e-9 over the packing too: the outcomes over the packing are
    told apart by their label, whichever CPU runs this."""
    case = Case(kind="varlen", seed=0, dtype="float32", q_lead=(2,), k_lead=(1,), v_lead=(1,), L=8, S=8, D=3, Dv=3,
                magnitude=30.0, lengths=(0, 2, 0), k_lengths=(0, 2, 11), grad=True, threads=1)
    assert check(case) == []
    setup = properties.prepare(case)
    cotangent = torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(1))
    per_sequence, *others = setup.torch_own(cotangent)
    reference_dv = setup.reference(cotangent).grads["dv"]
    errors = [error(o.grads["dv"], reference_dv) for o in (per_sequence, *others)]
    assert errors[0] < 1e-7
    # only the backends that hand torch the packing are allowed its error: the others are held to
    # torch's over each sequence (10 000x tighter on the CPUs where torch errs over the packing)
    over_the_packing = properties._over_the_packing(case, *setup.inputs[:3], None, None, cotangent)
    assert len(over_the_packing) >= 1
    labels = [o.backends for o in (per_sequence, *others)]
    assert labels == [None] * (len(labels) - len(over_the_packing)) + [("sdpa", "auto")] * len(over_the_packing)
    assert all(o.backends == ("sdpa", "auto") for e, o in zip(errors, (per_sequence, *others)) if e > 1e-7)
    q, k, v = setup.inputs[:3]
    assert properties._over_the_packing(case.replace(kind="paged"), q, k, v, None, None, None) == []
    poisoned = k.clone()
    poisoned[5, 0, 1] = float("nan")  # a NaN in one sequence spread by torch over all: not an excuse
    assert properties._over_the_packing(case, q, poisoned, v, None, None, None) == []


def test_the_tolerance_is_twice_torchs_error_plus_a_floor():
    assert tolerance(1e-6, (0.0, 0.0), torch.float32, 0) == 2e-6
    assert tolerance(0.0, (1.0, 0.0), torch.float32, 254) == pytest.approx(2 * torch.finfo(torch.float32).eps * 8)
    f32 = torch.finfo(torch.float32)
    assert tolerance(0.0, (0.0, 1.0), torch.bfloat16, 0) == pytest.approx(2 * f32.tiny / f32.eps)  # bf16 runs in f32


def test_the_reference_hides_a_nan_behind_a_mask_and_zeroes_a_row_that_sees_nothing():
    q, k, v = torch.randn(1, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    k[0, 2, 0] = float("nan")  # key 2: seen by row 2 only (causal)
    outcome = reference(q, k, v, Spec(band=(None, 0)), None)
    assert outcome.certain[0, 2].all() and not outcome.certain[0, :2].any()  # where it is seen, for sure
    assert outcome.possible[0].all()  # torch's math path adds the mask: every row may be NaN
    empty = reference(q, k, v, Spec(mask=torch.zeros(3, 3, dtype=torch.bool)), None)
    assert torch.equal(empty.out, torch.zeros(1, 3, 4, dtype=torch.float64))


# -- paged cases: mha.kernels.paged_attention over a pool of pages ------------------------------------------


def _paged_cases(count: int, seed: int) -> list[Case]:
    """``count`` paged cases as the driver draws them (every other kind drawn and skipped)."""
    rng, found = random.Random(seed), []
    while len(found) < count:
        case = draw(rng)
        if case.kind == "paged":
            found.append(case)
    return found


def test_paged_cases_find_nothing():
    """In this process, one thread (two threads share the machine's cores with whatever else runs)."""
    drawn = _paged_cases(300, seed=11)
    assert {c.block_size for c in drawn} == set(PAGE_SIZES) and any(c.poison for c in drawn)
    assert any(L == S for c in drawn for L, S in zip(c.lengths, c.k_lengths))  # whole prompts
    assert any(L == 1 and S > 200 for c in drawn for L, S in zip(c.lengths, c.k_lengths))  # decoding over long caches
    found = {f.signature: f.detail for case in drawn for f in check(case.replace(threads=1))}
    assert found == {}, found


@pytest.mark.slow
def test_a_short_paged_run_finds_nothing():
    report = driver.run(60, seed=7, workers=1, kinds=("paged",), shrink_tries=0)  # in a child, threads as drawn
    assert report.cases == 60 and report.findings == {}, report.findings


def test_a_paged_case_replays_from_its_json():
    case = _paged_cases(1, seed=5)[0]
    again = Case.from_json(case.to_json())
    assert again == case and again.block_size == case.block_size >= 1 and not again.grad
    first, second = (properties.prepare(c) for c in (case, again))
    assert all(torch.equal(a, b) for a, b in zip(first.inputs[:3], second.inputs[:3]))  # the same pool, drawn again


def test_the_pool_holds_each_key_where_the_block_table_says():
    case = Case(kind="paged", q_lead=(4,), k_lead=(2,), v_lead=(2,), D=5, Dv=3, lengths=(1, 7, 2), k_lengths=(9, 7, 1),
                block_size=4, layouts=("contiguous", "transposed", "strided"), poison="pool:nan", grad=False)
    g = generator(case)
    q, k, v = cases.packed(case, g)  # k (Tk, Hkv, D), v (Tk, Hkv, Dv)
    k_pages, v_pages, table = cases.pages(case, k, v, g)
    assert not k_pages.is_contiguous() and not v_pages.is_contiguous()
    start = 0
    for b, S in enumerate(case.k_lengths):
        used = -(-S // 4)
        assert (table[b, used:] == -1).all() and (table[b, :used] >= 0).all()
        for pool, x in ((k_pages, k), (v_pages, v)):
            gathered = pool[table[b, :used].long()].transpose(1, 2).flatten(0, 1)  # (used, Hkv, P, X) -> (used * P, Hkv, X)
            assert torch.equal(gathered[:S], x[start:start + S]) and gathered[S:].isnan().all()  # the rest: NaN
        start += S
    named = table[table >= 0]
    assert named.unique().numel() == named.numel() == 3 + 2 + 1 <= k_pages.shape[0]  # each page once, spare ones left


def _plant(monkeypatch, defect: str, path: str) -> None:
    """A defect in one paged path (math: dispatch.paged_math_attention; native: native.paged_attention_native
    and auto's fast path to the kernel, dispatch.plain_paged):
    the softcap dropped, the window one key wider, or a NaN that leaks out of its sequence (every row
    NaN once one is)."""
    def wrong(band: Band, softcap: float | None) -> tuple[Band, float | None]:
        if defect == "window":
            return Band(band.left + 1, band.right), softcap
        return band, None if defect == "softcap" else softcap

    def leaked(out: Tensor) -> Tensor:
        return torch.full_like(out, math.nan) if defect == "nan" and out.isnan().any() else out

    if path == "math":
        original = dispatch.paged_math_attention

        def planted(*args, **options):
            *pool, terms = args
            band, softcap = wrong(terms.band, terms.softcap)
            return leaked(original(*pool, terms.replace(band=band, softcap=softcap), **options))
        monkeypatch.setattr(dispatch, "paged_math_attention", planted)
    else:  # the kernel's entry and auto's fast path to it
        original, fast = native.paged_attention_native, dispatch.plain_paged

        def planted(*args, **options):
            *pool, terms = args
            band, softcap = wrong(terms.band, terms.softcap)
            return leaked(original(*pool, terms.replace(band=band, softcap=softcap), **options))

        def planted_fast(*args):
            *pool, terms = args
            band, softcap = wrong(terms.band, terms.softcap)
            out = fast(*pool, terms.replace(band=band, softcap=softcap))
            return None if out is None else leaked(out)
        monkeypatch.setattr(native, "paged_attention_native", planted)
        monkeypatch.setattr(dispatch, "plain_paged", planted_fast)


@pytest.mark.parametrize("path", ["math", pytest.param("native", marks=pytest.mark.skipif(
    not native.native_available(), reason="the native kernel is not built here"))])
@pytest.mark.parametrize("defect", ["softcap", "window", "nan"])
def test_the_checker_finds_a_planted_defect_in_paged_attention(monkeypatch, defect, path):
    terms = {"softcap": dict(softcap=1.0), "window": dict(window=(2, 0)), "nan": dict(poison="k:nan")}[defect]
    case = Case(kind="paged", q_lead=(4,), k_lead=(2,), v_lead=(2,), D=8, Dv=8, lengths=(3, 1, 5), k_lengths=(3, 40, 9),
                block_size=3, is_causal=True, grad=False, seed=3, **terms)
    assert check(case) == []  # a NaN key: NaN in the rows of its sequence that see it, and only there
    _plant(monkeypatch, defect, path)
    found = {f.signature for f in check(case)}
    wrong = [path] + (["auto"] if ("native" if native.ready() else "math") == path else [])  # and auto where it runs path
    expected = {"softcap": "equal:out", "window": "equal:out", "nan": "nan:extra"}[defect]
    assert found == {f"paged:{backend}:{expected}:float32" for backend in wrong}, found
