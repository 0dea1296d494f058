"""The fuzz driver (mha.tools.fuzz): child processes that survive crashes and hangs, findings reported
once each with their smallest case, the exit status, and the checker's own rules."""

import json
import os
import random
import signal
import time

import pytest
import torch

from mha.tools.fuzz import Case, Finding, check, draw, driver, properties
from mha.tools.fuzz.driver import Crash, Isolated, Report, shrink
from mha.tools.fuzz.reference import Spec, reference, tolerance


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
