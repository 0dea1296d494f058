"""The measured dispatch (mha.kernels.tuning): crossovers from a timer, the per-machine cache, what
auto reads, and what it does with no measurement. Every test uses a fake timer: the real one is
run by `mha tune` (tests/cli) and measured in `mha bench`, never timed here."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import mha
from mha.kernels import Contract, tuning

pytestmark = pytest.mark.measured_dispatch
# the timer's calls in one tune(): every point of the grid (prefill causal and not, decoding; two
# dtypes; native's full path and the fast path's call) at every shape, in every round
GRID_CALLS = (tuning.ROUNDS * len(tuning.SHAPES) * 2 * len(tuning.PATHS)
              * (2 * len(tuning.PREFILL_LENGTHS) + len(tuning.DECODE_KEYS)))
SMALLEST_T, SMALLEST_S = min(tuning.PREFILL_LENGTHS), min(tuning.DECODE_KEYS)


def timed_calls(native_faster) -> int:
    """The timer's calls in one tune() with fake_timer(native_faster): every point's fast-path call,
    and its full path's where the fast-path call won (tune gives the others its ratio, untimed)."""
    points = ([{"L": T, "S": T, "causal": causal} for T in tuning.PREFILL_LENGTHS for causal in (False, True)]
              + [{"L": 1, "S": S} for S in tuning.DECODE_KEYS])
    per_round = sum(1 + bool(native_faster({**point, "dtype": dtype, "path": "plain"}))
                    for dtype in tuning.DTYPES for _ in tuning.SHAPES for point in points)
    return tuning.ROUNDS * per_round


def both(prefill_work, decode_keys) -> dict:
    """A table's crossovers where the full path and the fast path's call fare alike."""
    return {"prefill_work": prefill_work, "decode_keys": decode_keys,
            "plain_prefill_work": prefill_work, "plain_decode_keys": decode_keys}


def fake_timer(native_faster):
    """A timer that runs nothing and says native takes 0.5x torch's time where
    ``native_faster(shape)`` and 2x elsewhere; it records the points it was asked."""
    asked = []

    def timer(point, shape, native_call, torch_call):
        asked.append(point)
        return (0.5, 1.0) if native_faster(shape) else (2.0, 1.0)
    timer.asked = asked
    return timer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "tune.json"
    monkeypatch.setenv("MHA_TUNE_CACHE", str(path))
    monkeypatch.setattr(tuning, "_cpu_times", lambda: None)  # the load unknown (sure), whatever else runs; load_of sets one
    tuning.forget()
    yield path
    tuning.forget()


def test_the_crossover_is_where_native_wins_from_there_on(cache):
    table = tuning.tune(timer=fake_timer(lambda s: s["L"] >= 512 if s["L"] > 1 else s["S"] >= 4096))
    assert table["crossovers"]["float32"] == both(512 * 512, 4096)


def test_a_win_followed_by_a_loss_is_not_a_crossover(cache):
    """Native faster at 256 but not at 512: only from 1024 on does it win everywhere measured."""
    table = tuning.tune(timer=fake_timer(lambda s: s["L"] in (256, 1024) or s["L"] == 1))
    assert table["crossovers"]["bfloat16"] == both(1024 * 1024, SMALLEST_S)


def test_native_never_winning_gives_none_and_auto_never_picks_it(cache):
    tuning.tune(timer=fake_timer(lambda s: False))
    assert tuning.crossovers(torch.float32) == tuning.NEVER
    q = torch.randn(1, 8, 1, 64)
    kv = torch.randn(1, 2, 16384, 64)
    long = torch.randn(1, 2, 2048, 64)
    assert mha.kernels.choose_backend("auto", q, kv, kv, Contract())[0] == "sdpa"
    assert mha.kernels.choose_backend("auto", long, long, long, Contract())[0] == "sdpa"


def test_auto_follows_the_stored_table(cache):
    tuning.tune(timer=fake_timer(lambda s: s["L"] > 1))  # native wins every prefill measured: from the smallest T
    x = torch.randn(1, 2, SMALLEST_T, 64)
    assert mha.kernels.choose_backend("auto", x, x, x, Contract()) == (
        "native", "mha's compiled kernel is faster than torch's on this call (native_pays)")
    small = torch.randn(1, 2, SMALLEST_T - 1, 64)  # below the smallest point measured: not known to win
    assert mha.kernels.choose_backend("auto", small, small, small, Contract())[0] == "sdpa"


def test_the_table_is_stored_under_this_machines_key_and_read_back(cache):
    table = tuning.tune(timer=fake_timer(lambda s: s["L"] == 1))
    stored = json.loads(cache.read_text())
    key = tuning.machine_key()
    assert list(stored) == [key] and stored[key]["crossovers"] == table["crossovers"]
    assert tuning.cpu()["model"] in key and f"torch {torch.__version__}" in key and f"mha {mha.__version__}" in key
    tuning.forget()
    assert tuning.crossovers(torch.bfloat16) == tuning.Crossover(None, SMALLEST_S, None, SMALLEST_S)
    assert tuning.crossovers(torch.float16) == tuning.crossovers(torch.bfloat16)  # not measured: as bfloat16


def test_another_machines_table_is_not_read(cache):
    cache.write_text(json.dumps({"Some Other CPU | avx2 | 2 threads | torch 0 | mha 0": {
        "crossovers": {"float32": {"prefill_work": 1, "decode_keys": 1}}}}))
    assert tuning.stored() is None


@pytest.mark.parametrize("written", ["not json {", "[1, 2]", ""])
def test_a_damaged_cache_counts_as_no_measurement(cache, written, monkeypatch):
    cache.write_text(written)
    monkeypatch.setenv("MHA_TUNE", "off")
    assert tuning.stored() is None
    tuning.tune(timer=fake_timer(lambda s: True))  # and is replaced whole by the next measurement
    assert tuning.machine_key() in json.loads(cache.read_text())


@pytest.mark.parametrize("flags, kind, prompts, steps", [
    (["avx2", "avx512f", "avx512_bf16"], "avx512_bf16", True, True),  # where it was measured to win
    # measured on an AMX Xeon (issue 44): float32 decoding steps from 4096 keys, its prompts never
    (["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"], "amx", False, True),
    (["avx2"], "avx2", False, False),
    ([], "other", False, False),
])
def test_without_a_measurement_native_only_where_it_is_known_to_win(cache, monkeypatch, flags, kind, prompts, steps):
    monkeypatch.setenv("MHA_TUNE", "off")
    monkeypatch.setattr(tuning, "cpu", lambda: {"model": "test", "flags": flags, "kind": tuning.cpu_kind(flags)})
    assert tuning.cpu()["kind"] == kind
    assert (tuning.crossovers(torch.float32) != tuning.NEVER) == (prompts or steps)
    long = torch.randn(1, 2, 2048, 64)
    step, cache_keys = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 8192, 64)
    ready = mha.kernels.native.ready()
    assert (mha.kernels.choose_backend("auto", long, long, long, Contract())[0] == "native") == (prompts and ready)
    assert (mha.kernels.choose_backend("auto", step, cache_keys, cache_keys, Contract())[0] == "native") == (
        steps and ready)


def test_the_first_call_that_needs_it_measures_once(cache, monkeypatch):
    if not mha.kernels.native.ready():
        pytest.skip("the native kernel is not built here: auto never asks")
    timer = fake_timer(lambda s: s["L"] == 1)
    monkeypatch.setenv("MHA_TUNE", "auto")
    monkeypatch.setattr(tuning, "best_of", timer)
    x = torch.randn(1, 2, 2048, 64)
    assert mha.kernels.choose_backend("auto", x, x, x, Contract())[0] == "sdpa"  # measured: never for prefill
    measured = len(timer.asked)
    assert measured == timed_calls(lambda s: s["L"] == 1)
    mha.kernels.choose_backend("auto", x, x, x, Contract())
    assert len(timer.asked) == measured and tuning.machine_key() in json.loads(cache.read_text())


def test_a_failed_first_measurement_is_logged_and_the_call_goes_on(cache, monkeypatch, caplog):
    if not mha.kernels.native.ready():
        pytest.skip("the native kernel is not built here: auto never asks")

    def broken(*args):
        raise RuntimeError("no timer today")
    monkeypatch.setenv("MHA_TUNE", "auto")
    monkeypatch.setattr(tuning, "best_of", broken)
    x = torch.randn(1, 2, 64, 64)
    with caplog.at_level("WARNING", logger="mha.dispatch"):
        out = mha.kernels.attention(x, x, x, Contract())[0]
    assert "measuring the dispatch failed (no timer today)" in caplog.text
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(x, x, x))
    assert not cache.exists()


@pytest.mark.parametrize("flags, kind", [(["avx2", "avx512f", "avx512_bf16", "amx_bf16"], "amx"),
                                         (["avx2", "avx512f"], "avx512"), (["avx2"], "avx2")])
def test_cpu_kinds(flags, kind):
    assert tuning.cpu_kind(flags) == kind


def test_this_cpu_is_described():
    info = tuning.cpu()
    assert info["model"] and set(info["flags"]) <= set(tuning.FLAGS) and info["kind"] == tuning.cpu_kind(info["flags"])


def test_mha_tune_measures_stores_and_shows(cache, monkeypatch, capsys):
    pytest.importorskip("rich")
    from mha import cli
    if not mha.kernels.native.native_available():
        assert cli.main(["tune"]) == 2
        assert "cannot be built or loaded here" in capsys.readouterr().err
        return
    monkeypatch.setattr(tuning, "best_of", fake_timer(
        lambda s: s["L"] >= 512 or (s["L"] == 1 and s["S"] >= (1 if s["path"] == "plain" else 1024))))
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps at 80 columns otherwise: a long temporary path splits the file's name
    assert cli.main(["tune", "--show"]) == 0
    assert "not measured on this machine yet" in capsys.readouterr().out
    assert cli.main(["tune"]) == 0
    measured = capsys.readouterr().out
    assert tuning.cpu()["model"] in measured and "L, S >= 512" in measured and "S >= 1024" in measured
    assert cli.main(["tune", "--show"]) == 0
    shown = capsys.readouterr().out
    assert "L, S >= 512" in shown and "0.50" in shown and "2.00" in shown and "tune.json" in shown
    assert "plain decode" in shown and "S >= 1 " in shown  # the fast path's own rows and crossover


def test_mha_verify_measures_once_and_says_what_auto_will_do(cache, monkeypatch):
    pytest.importorskip("rich")
    from mha.cli import verify
    monkeypatch.setenv("MHA_TUNE", "off")
    assert verify.dispatch_status().startswith("dispatch: not measured (MHA_TUNE=off)")
    monkeypatch.setenv("MHA_TUNE", "auto")
    timer = fake_timer(lambda s: s["L"] == 1 and s["S"] >= (64 if s["path"] == "plain" else 1024))
    monkeypatch.setattr(tuning, "best_of", timer)
    line = verify.dispatch_status()
    assert "measured now" in line and "float32: prefill never, decoding S >= 1024 (plain calls without gradients: " \
                                      "prefill never, decoding S >= 64)" in line
    assert "measured 20" in verify.dispatch_status()
    assert len(timer.asked) == timed_calls(lambda s: s["L"] == 1 and s["S"] >= 64)  # stored: not measured again


@pytest.mark.parametrize("ratio, wins", [(0.5, True), (0.94, True), (0.95, True), (0.96, False), (0.97, False),
                                          (1.0, False), (1.2, False)])
def test_native_counts_as_faster_only_within_the_margin(cache, ratio, wins):
    """tuning.MARGIN: native must take at most 0.95 of torch's time to count as faster (a 3 % lead
    is timing noise), at every size from the crossover on, in the table tune() stores."""
    assert tuning._from_where_it_wins([(1, 2.0), (4, ratio), (9, ratio)]) == (4 if wins else None)
    assert tuning._from_where_it_wins([(1, ratio), (4, 0.5)]) == (1 if wins else 4)

    def timer(point, shape, native_call, torch_call):
        return (ratio, 1.0) if shape["L"] == 1 else (2.0, 1.0)  # decoding at this ratio, prefill never
    table = tuning.tune(timer=timer)
    assert table["crossovers"]["float32"] == both(None, SMALLEST_S if wins else None)


def test_native_must_win_causal_and_not(cache):
    """Faster without a mask at every length but slower causal at 128: from 256 on."""
    table = tuning.tune(timer=fake_timer(lambda s: s["L"] == 1 or not (s.get("causal") and s["L"] == 128)))
    assert table["crossovers"]["float32"]["prefill_work"] == 256 * 256


def test_the_real_timer_times_both_calls_several_times_per_round():
    calls = {"native": 0, "torch": 0}

    def count(name):
        def call():
            calls[name] += 1
        return call
    native_s, torch_s = tuning.best_of("p", {}, count("native"), count("torch"), repeat=3, sample_s=1e-4)
    assert native_s > 0 and torch_s > 0
    assert calls["torch"] == calls["native"] + 1 and calls["native"] > 3 * 2  # + torch's calibration call


def test_torch_compile_neither_measures_nor_breaks_its_graph(cache, monkeypatch):
    timer = fake_timer(lambda s: True)
    monkeypatch.setenv("MHA_TUNE", "auto")
    monkeypatch.setattr(tuning, "best_of", timer)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def attend(q, k, v):
        return mha.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    x = torch.randn(1, 2, 256, 16)
    torch.testing.assert_close(attend(x, x, x), torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True))
    assert timer.asked == [] and not cache.exists()


def test_under_vmap_nothing_is_measured(cache, monkeypatch):
    timer = fake_timer(lambda s: True)
    monkeypatch.setenv("MHA_TUNE", "auto")
    monkeypatch.setattr(tuning, "best_of", timer)
    x = torch.randn(3, 1, 2, 256, 16)
    got = torch.vmap(lambda t: mha.functional.scaled_dot_product_attention(t, t, t))(x)
    torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(x, x, x))
    assert timer.asked == []


def test_ranks_of_a_distributed_run_do_not_measure_at_first_use(cache, monkeypatch):
    import torch.distributed as dist
    timer = fake_timer(lambda s: True)
    monkeypatch.setenv("MHA_TUNE", "auto")
    monkeypatch.setattr(tuning, "best_of", timer)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    assert tuning.crossovers(torch.float32) == tuning.KNOWN.get(tuning.cpu()["kind"], {}).get(torch.float32, tuning.NEVER)
    assert timer.asked == []


@pytest.mark.parametrize("table", [
    "not a dict",
    {"crossovers": {"float32": {"prefill": 1}}},
    {"crossovers": {"float32": {"prefill_work": "65536", "decode_keys": None}}},
    {"crossovers": {"float64": {"prefill_work": 1, "decode_keys": 1}}},
    {"crossovers": {"float32": {"prefill_work": True, "decode_keys": None}}},
    {"crossovers": ["float32"]},
])
def test_a_malformed_table_is_ignored_and_the_call_goes_on(cache, monkeypatch, table, caplog):
    """Found by review: valid JSON of another shape raised into every attention call."""
    monkeypatch.setenv("MHA_TUNE", "off")
    cache.write_text(json.dumps({tuning.machine_key(): table}))
    q = torch.randn(1, 8, 16, 64)
    with caplog.at_level("WARNING", logger="mha.dispatch"):
        out = mha.functional.scaled_dot_product_attention(q, q, q)
        long = torch.randn(1, 2, 600, 64)
        mha.kernels.attention(long, long, long, Contract())
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert "malformed" in caplog.text and tuning.stored() is None


def test_measuring_at_first_use_leaves_the_callers_random_stream_and_autocast_alone(cache, monkeypatch):
    """Found by review: tune() drew from the global generator, and ran under the caller's autocast."""
    dtypes = []

    def timer(point, shape, native_call, torch_call):
        dtypes.append(native_call().dtype)
        return 1.0, 1.0
    monkeypatch.setenv("MHA_TUNE", "auto")
    monkeypatch.setattr(tuning, "best_of", timer)
    if not mha.kernels.native.ready():
        pytest.skip("the native kernel is not built here: auto never asks")
    torch.manual_seed(0)
    expected = (torch.randn(1, 2, 600, 64), torch.randn(3))
    torch.manual_seed(0)
    x = torch.randn(1, 2, 600, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mha.functional.scaled_dot_product_attention(x, x, x)
    assert dtypes and torch.equal(torch.randn(3), expected[1])
    assert dtypes[:2 * len(tuning.PREFILL_LENGTHS)] == [torch.float32] * (2 * len(tuning.PREFILL_LENGTHS))


def test_the_key_names_the_native_build():
    assert f"native {mha.kernels.native.variant()}" in tuning.machine_key()


def test_the_key_names_the_kernels_source(monkeypatch):
    """A changed kernel is measured again: the key holds a hash of native.cpp (a faster decoding
    path once kept the crossover measured on the slower one)."""
    native = mha.kernels.native
    assert native.source_digest() in tuning.machine_key() and len(native.source_digest()) == 12
    monkeypatch.setattr(native, "source_digest", lambda: "0123456789ab")
    tuning._fixed_key.cache_clear()
    try:
        assert "0123456789ab" in tuning.machine_key()
    finally:
        monkeypatch.undo()
        tuning._fixed_key.cache_clear()


def test_the_source_digest_follows_the_kernels_text_not_its_path(tmp_path, monkeypatch):
    """The same text elsewhere hashes the same; one changed byte hashes differently."""
    native = mha.kernels.native
    before = native.source_digest()
    copy = tmp_path / "elsewhere.cpp"
    copy.write_bytes(native._SOURCE.read_bytes())
    monkeypatch.setattr(native, "_SOURCE", copy)
    digest = native.source_digest.__wrapped__  # (the cached one is read once per process)
    assert digest() == before
    copy.write_bytes(copy.read_bytes() + b"\n")
    assert digest() != before


def test_the_key_and_the_table_are_per_thread_count(cache, monkeypatch):
    """The crossovers depend on the threads (2 threads share the keys' work, 1 does not): the key
    names torch's thread count, and a table measured at 2 threads is not read at 1."""
    monkeypatch.setenv("MHA_TUNE", "off")  # no table: KNOWN, not a measurement
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = tuning.machine_key()
        tuning.tune(timer=fake_timer(lambda s: True))  # stored under the 2-thread key: native from the smallest point
        everywhere = tuning.Crossover(**both(SMALLEST_T ** 2, SMALLEST_S))
        assert tuning.crossovers(torch.float32) == everywhere
        torch.set_num_threads(1)
        one = tuning.machine_key()
        assert one != two and two.endswith("| 2 threads") and one.endswith("| 1 threads")
        assert list(json.loads(cache.read_text())) == [two]
        assert tuning.stored() is None and tuning.stored(two) is not None
        expected = tuning.KNOWN.get(tuning.cpu()["kind"], {}).get(torch.float32, tuning.NEVER)  # MHA_TUNE=off
        assert tuning.crossovers(torch.float32) == expected != everywhere
        tuning.forget()  # and read from the file afresh: the same
        assert tuning.stored() is None and tuning.crossovers(torch.float32) == expected
        torch.set_num_threads(2)
        assert tuning.crossovers(torch.float32) == everywhere
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_processes_starting_together_measure_once(tmp_path):
    """Worker processes (a pool, DataLoader workers) that reach their first call together: one
    measures, the others wait for its table and read it."""
    if not mha.kernels.native.ready():
        pytest.skip("the native kernel is not built here: auto never asks")
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys, time, torch\n"
        "from mha.kernels import tuning\n"
        "def timer(point, shape, native_call, torch_call):\n"
        "    with open(sys.argv[1], 'a') as f: f.write(point + '\\n')\n"
        "    time.sleep(0.02)\n"
        "    return (0.5, 1.0)\n"
        "tuning.best_of = timer\n"
        "print(tuning.crossovers(torch.float32))\n")
    log = tmp_path / "measured.txt"
    env = {**os.environ, "MHA_TUNE": "auto", "MHA_TUNE_CACHE": str(tmp_path / "tune.json")}
    workers = [subprocess.Popen([sys.executable, str(script), str(log)], env=env, stdout=subprocess.PIPE, text=True)
               for _ in range(3)]
    outputs = [w.communicate(timeout=120)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers)
    assert len(log.read_text().splitlines()) == GRID_CALLS
    assert len(set(outputs)) == 1 and f"prefill_work={SMALLEST_T ** 2}" in outputs[0]


def test_a_cache_folder_it_cannot_write_costs_the_measurement_not_the_call(tmp_path, monkeypatch, caplog):
    if not mha.kernels.native.ready():
        pytest.skip("the native kernel is not built here: auto never asks")
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache's folder should be
    monkeypatch.setenv("MHA_TUNE_CACHE", str(blocked / "mha" / "tune.json"))
    monkeypatch.setenv("MHA_TUNE", "auto")
    monkeypatch.setattr(tuning, "best_of", fake_timer(lambda s: True))
    tuning.forget()
    x = torch.randn(1, 2, 600, 64)
    with caplog.at_level("WARNING", logger="mha.dispatch"):
        out = mha.kernels.attention(x, x, x, Contract())[0]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(x, x, x))
    assert "measuring the dispatch failed" in caplog.text
    tuning.forget()


def test_a_point_counts_only_if_native_wins_every_round_at_every_shape(cache):
    """tuning.ROUNDS and SHAPES: native ahead in two rounds of three (or at one shape of two) is noise,
    not a crossover; the stored ratio is the worst one seen."""
    def timer_losing(where):
        def timer(point, shape, native_call, torch_call):
            return (0.99, 1.0) if shape["L"] == 1 and where(shape) else (0.5, 1.0)
        return timer
    lost_once = timer_losing(lambda s: s["round"] == tuning.ROUNDS - 1 and s["S"] == 1024)
    table = tuning.tune(timer=lost_once)
    assert table["crossovers"]["float32"]["decode_keys"] == 4096
    assert table["ratios"]["float32"]["decode S"][1024] == 0.99
    second_shape = timer_losing(lambda s: (s["B"], s["H"], s["Hkv"]) == tuning.SHAPES[1] and s["S"] == 16384)
    assert tuning.tune(timer=second_shape)["crossovers"]["bfloat16"]["decode_keys"] is None
    assert tuning.ROUNDS >= 3 and len(set(tuning.SHAPES)) >= 2


def test_the_real_timer_keeps_the_way_native_fares_worse(monkeypatch):
    """best_of times loops and single calls alternated with other work, and returns the pair of the
    two in which native's ratio is higher: here native is fast in a loop but slow after other work. The
    calls advance a clock of the test's own (sleeps of a millisecond overshot by one or two under CI's
    load: torch's 1 ms read 2.6)."""
    import types
    state = {"cold": False, "now": 0.0}
    monkeypatch.setattr(tuning, "time", types.SimpleNamespace(perf_counter=lambda: state["now"]))
    monkeypatch.setattr(tuning, "_other_work", lambda: state.update(cold=True))

    def native_call():
        state["now"] += 3e-3 if state["cold"] else 1e-4
        state["cold"] = False

    def torch_call():
        state["now"] += 1e-3
        state["cold"] = False
    native_s, torch_s = tuning.best_of("p", {}, native_call, torch_call, repeat=1, singles=3, sample_s=1e-3)
    assert native_s / torch_s > 1.5  # the loops alone would say about 0.1


# -- how sure a table is (issue 44: a first measurement under load stored "native never" for good) --

def load_of(share, monkeypatch, *, span=10.0):
    """_cpu_times readings around a tune(): other processes took ``share`` of the machine's CPU time
    over ``span`` seconds (this process the rest of one core)."""
    cores = os.cpu_count() or 1
    readings = iter([(100.0, 50.0, 20.0), (100.0 + span, 50.0 + span * (share * cores + 1), 20.0 + span)])
    monkeypatch.setattr(tuning, "_cpu_times", lambda: next(readings))


@pytest.mark.parametrize("share, sure", [(0.0, True), (0.05, True), (0.10, True), (0.11, False), (0.6, False)])
def test_a_table_measured_under_load_says_so(cache, monkeypatch, share, sure):
    """tuning.LOAD_LIMIT: others may take at most 10 % of the machine's CPU time while it measures."""
    load_of(share, monkeypatch)
    table = tuning.tune(timer=fake_timer(lambda s: s["L"] == 1))
    assert table["load"] == pytest.approx(share) and table["sure"] is sure and table["checks"] == 1
    assert (tuning.unsure_because(table) is None) is sure
    if not sure:
        assert f"other processes took {share:.0%} of the CPUs" in tuning.unsure_because(table)


def test_a_load_read_over_too_short_a_span_is_unknown_not_a_figure(cache, monkeypatch):
    load_of(0.9, monkeypatch, span=tuning.LOAD_SPAN / 2)
    table = tuning.tune(timer=fake_timer(lambda s: False))
    assert table["load"] is None and table["sure"] is True
    assert tuning._others_share(None, (1.0, 1.0, 1.0)) is None


def test_points_whose_rounds_disagree_are_listed_and_the_worst_round_decides(cache, monkeypatch, capsys):
    """A split point is noise near the margin (a quiet machine has them too): listed and shown, settled
    for torch by the worst round, not a reason to measure again."""
    pytest.importorskip("rich")
    from mha import cli

    def timer(point, shape, native_call, torch_call):  # native wins decoding at S=4096 in the first round only
        return (0.5, 1.0) if shape["L"] == 1 and shape["S"] == 4096 and shape["round"] == 0 else (2.0, 1.0)
    load_of(0.0, monkeypatch)
    table = tuning.tune(timer=timer)
    assert table["split"] == ["bfloat16 decode at S = 4096", "bfloat16 plain decode at S = 4096",
                              "float32 decode at S = 4096", "float32 plain decode at S = 4096"] and table["sure"] is True
    assert table["crossovers"]["float32"]["decode_keys"] is None
    assert cli.main(["tune", "--show"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "rounds disagreed at bfloat16 decode at S = 4096, bfloat16 plain decode at S = 4096" in shown


def test_a_fast_path_call_at_the_margin_won_and_its_full_path_is_timed(cache):
    """At exactly MARGIN the fast path's call counts as faster (ratio <= MARGIN): the full path is
    timed there; one step above it, not."""
    for plain_ratio, timed in ((tuning.MARGIN, True), (tuning.MARGIN + 1e-9, False)):
        asked = []

        def timer(point, shape, native_call, torch_call):
            asked.append(shape["path"])
            return (plain_ratio if shape["path"] == "plain" else 2.0), 1.0
        table = tuning.tune(timer=timer, store=False)
        assert asked.count("full") == (asked.count("plain") if timed else 0)
        assert (table["untimed"] == []) == timed


def test_the_full_path_is_not_timed_where_the_fast_paths_call_lost(cache, monkeypatch, capsys):
    """The full path runs the fast path's kernel after Python's checks: where the fast path's call
    lost (above MARGIN) it cannot win, so it takes that ratio untimed (listed, and said by `mha tune
    --show`); where the fast path's call won, it is timed. A fake timer that lets the full path win
    where the fast path lost shows the rule: those wins are never seen."""
    pytest.importorskip("rich")
    from mha import cli
    timer = fake_timer(lambda s: s["path"] == "full" or (s["L"] == 1 and s["S"] >= 1024))
    load_of(0.0, monkeypatch)
    table = tuning.tune(timer=timer)
    assert not [p for p in timer.asked if " prefill " in p and not p.endswith(" plain")]
    assert len(timer.asked) == timed_calls(lambda s: s["L"] == 1 and s["S"] >= 1024)
    assert table["crossovers"]["float32"] == both(None, 1024)  # full: prefill never, decoding timed from 1024
    assert table["ratios"]["float32"]["prefill L*S"] == table["ratios"]["float32"]["plain prefill L*S"]
    assert len(table["untimed"]) == tuning.ROUNDS * len(tuning.DTYPES) * len(tuning.SHAPES) * (
        2 * len(tuning.PREFILL_LENGTHS) + 2)  # every prefill point, decoding over 1 and 64 keys
    assert cli.main(["tune", "--show"]) == 0
    assert f"{len(table['untimed'])} full-path points not timed" in " ".join(capsys.readouterr().out.split())


def test_the_load_of_another_process_is_read(monkeypatch):
    """A real reading: a busy process beside this one shows in the share (Linux only)."""
    if tuning._cpu_times() is None:
        pytest.skip("no /proc here: the load is not read")
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        before = tuning._cpu_times()
        time.sleep(1.5)
        share = tuning._others_share(before, tuning._cpu_times())
    finally:
        busy.kill()
        busy.wait()
    assert share >= 0.8 / (os.cpu_count() or 1)


@pytest.fixture
def measured_under_load(cache, monkeypatch):
    """A table stored by a measurement under load (others took 50 %) that found native never faster;
    later measurements (the timer returned) find it faster on decoding steps."""
    if not mha.kernels.native.ready():
        pytest.skip("the native kernel is not built here: auto never asks")
    monkeypatch.setenv("MHA_TUNE", "auto")
    timer = fake_timer(lambda s: s["L"] == 1)
    monkeypatch.setattr(tuning, "best_of", timer)
    load_of(0.5, monkeypatch)
    tuning.tune(timer=fake_timer(lambda s: False))
    monkeypatch.setattr(tuning, "_STARTED", time.time() + 3600)  # what follows is a process started later
    return timer


def test_a_table_a_sibling_measured_since_this_process_started_is_taken_as_it_is(cache, monkeypatch, caplog):
    """Processes started together (a pool's workers) wait while one measures; its table, measured
    under the load of their own start, is not measured again by each of them in turn (found by the
    slow test of three workers: 3 measurements)."""
    if not mha.kernels.native.ready():
        pytest.skip("the native kernel is not built here: auto never asks")
    monkeypatch.setenv("MHA_TUNE", "auto")
    timer = fake_timer(lambda s: s["L"] == 1)
    monkeypatch.setattr(tuning, "best_of", timer)
    monkeypatch.setattr(tuning, "_STARTED", time.time() - 1)  # this process started before the measurement
    load_of(0.5, monkeypatch)
    tuning.tune(timer=fake_timer(lambda s: False))
    tuning.forget()
    x, kv = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 2048, 64)
    assert mha.kernels.choose_backend("auto", x, kv, kv, Contract())[0] == "sdpa"  # the sibling's table: never
    assert timer.asked == [] and tuning.stored()["checks"] == 1


def test_an_unsure_table_is_measured_again_by_later_processes_up_to_checks(measured_under_load, monkeypatch, caplog):
    timer = measured_under_load
    x = torch.randn(1, 2, 1, 64)
    kv = torch.randn(1, 2, 2048, 64)
    for check in range(2, tuning.CHECKS + 1):
        tuning.forget()  # a later process
        load_of(0.5, monkeypatch)
        with caplog.at_level("INFO", logger="mha.dispatch"):
            mha.kernels.choose_backend("auto", x, kv, kv, Contract())
        assert len(timer.asked) == (check - 1) * timed_calls(lambda s: s["L"] == 1)
        assert f"is not sure (other processes took 50% of the CPUs while it was measured); measuring again " \
               f"(measurement {check} of {tuning.CHECKS})" in caplog.text
        assert tuning.stored()["checks"] == check
    assert "kept, measured again no more" in caplog.text
    tuning.forget()
    assert mha.kernels.choose_backend("auto", x, kv, kv, Contract())[0] == "native"  # the last table decides
    assert len(timer.asked) == (tuning.CHECKS - 1) * timed_calls(lambda s: s["L"] == 1)  # no fourth measurement


def test_a_sure_remeasurement_ends_the_checks(measured_under_load, monkeypatch):
    timer = measured_under_load
    tuning.forget()
    load_of(0.0, monkeypatch)
    x, kv = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 2048, 64)
    assert mha.kernels.choose_backend("auto", x, kv, kv, Contract())[0] == "native"
    assert tuning.stored()["sure"] and tuning.stored()["checks"] == 2
    tuning.forget()
    mha.kernels.choose_backend("auto", x, kv, kv, Contract())
    assert len(timer.asked) == timed_calls(lambda s: s["L"] == 1)  # sure now: never again


def test_mha_tune_and_verify_say_how_sure_the_table_is(cache, monkeypatch, capsys):
    pytest.importorskip("rich")
    from mha import cli
    from mha.cli import verify
    load_of(0.3, monkeypatch)
    tuning.tune(timer=fake_timer(lambda s: s["L"] == 1))
    assert cli.main(["tune", "--show"]) == 0
    assert "not sure: other processes took 30% of the CPUs while it was measured (1 measurement(s)); a later " \
           "process measures it again" in " ".join(capsys.readouterr().out.split())
    monkeypatch.setenv("MHA_TUNE", "off")
    assert "(not sure: other processes took 30% of the CPUs" in verify.dispatch_status()
    load_of(0.0, monkeypatch)
    tuning.tune(timer=fake_timer(lambda s: s["L"] == 1))
    assert cli.main(["tune", "--show"]) == 0
    assert "sure: other processes took 0% of the CPUs meanwhile, every round agreed" in capsys.readouterr().out


@pytest.mark.parametrize("ratios", [{"float32": {"decode S": {"1024": "fast"}}}, {"float32": {"decode": {"1024": 0.5}}},
                                    {"float32": {"decode S": {"²": 0.5}}}, ["float32"]])
def test_ratios_of_another_form_are_left_out_and_the_crossovers_kept(cache, ratios, caplog, capsys, monkeypatch):
    """Found by a new user: --show raised on a hand-edited ratio; by review: a bad ratio (shown only)
    threw away good crossovers, and "²" passed str.isdigit and raised in int()."""
    pytest.importorskip("rich")
    from mha import cli
    table = tuning.tune(timer=fake_timer(lambda s: s["L"] == 1), store=False)
    cache.write_text(json.dumps({tuning.machine_key(): {**table, "ratios": ratios}}))
    with caplog.at_level("WARNING", logger="mha.dispatch"):
        kept = tuning.stored()
    assert kept["crossovers"] == table["crossovers"] and "ratios" not in kept
    assert "holds ratios of another form; its crossovers are kept" in caplog.text
    monkeypatch.setenv("COLUMNS", "400")
    assert cli.main(["tune", "--show"]) == 0 and "S >= 1 " in capsys.readouterr().out


@pytest.mark.parametrize("text", ["not json{", "[1, 2]"])
def test_a_cache_file_that_is_not_a_json_object_is_named_in_a_warning(cache, text, caplog):
    """Found by a new user: a corrupt cache file was ignored in silence (--show said "not measured")."""
    cache.write_text(text)
    with caplog.at_level("WARNING", logger="mha.dispatch"):
        assert tuning.stored() is None
    assert f"the dispatch cache {cache} is not a JSON object; ignored" in caplog.text


def test_mha_tune_show_prints_a_table_of_crossovers_alone_and_sizes_in_the_crossovers_terms(cache, capsys, monkeypatch):
    """A hand-written table may hold crossovers without ratios (--show raised KeyError); the sizes
    read as the crossovers do (a prefill's L*S as its side: the grid's points are squares)."""
    pytest.importorskip("rich")
    from mha import cli
    monkeypatch.setenv("COLUMNS", "400")
    fields = ("prefill_work", "decode_keys", "plain_prefill_work", "plain_decode_keys")
    cache.write_text(json.dumps({tuning.machine_key(): {"crossovers": {"float32": dict(zip(fields, (65536, 4096, None, 1)))}}}))
    assert cli.main(["tune", "--show"]) == 0
    shown = capsys.readouterr().out
    assert "L, S >= 256" in shown and "S >= 4096" in shown and "never" in shown
    assert [tuning.size_label(call, size) for call, size in
            (("prefill L*S", 16384), ("plain prefill L*S", "65536"), ("prefill L*S", 512), ("decode S", 1024))] == \
        ["L = S = 128", "L = S = 256", "L*S = 512", "S = 1024"]


def test_mha_tune_show_prints_ratios_to_three_places(cache, capsys, monkeypatch):
    """A ratio of 0.9506 lost to the margin of 0.95 (MARGIN): at two places it read 0.95, a win."""
    pytest.importorskip("rich")
    from mha import cli
    monkeypatch.setenv("COLUMNS", "400")
    table = tuning.tune(timer=fake_timer(lambda s: False), store=False)
    table["ratios"]["float32"]["decode S"] = {"1024": 0.9506, "4096": 0.5, "16384": tuning.MARGIN}
    cache.write_text(json.dumps({tuning.machine_key(): table}))
    assert cli.main(["tune", "--show"]) == 0
    shown = " ".join(capsys.readouterr().out.split())  # (the title wraps at the table's width)
    assert "0.951" in shown and f"a win at <= {tuning.MARGIN}" in shown
    # by review: 0.9504 prints 0.950 at three places; the win column settles it
    assert "S = 1024 │ 0.951 │ no" in shown and "S = 4096 │ 0.500 │ yes" in shown
    assert f"S = 16384 │ {tuning.MARGIN:.3f} │ yes" in shown  # at the margin: a win (ratio <= MARGIN)


@pytest.mark.parametrize("field, value", [("sure", "yes"), ("checks", 1.5), ("load", "high"), ("measured_at", "now")])
def test_a_table_with_a_malformed_confidence_is_ignored(cache, monkeypatch, field, value):
    monkeypatch.setenv("MHA_TUNE", "off")
    table = tuning.tune(timer=fake_timer(lambda s: False), store=False)
    cache.write_text(json.dumps({tuning.machine_key(): {**table, field: value}}))
    assert tuning.stored() is None


def test_each_points_inputs_are_its_own_shapes_in_one_draw_without_overlap():
    """tuning._grid: q, k and v of every point are views of one draw per dtype and round (0.8 s of
    draws a tune before), shaped as the point says, none overlapping another of the point."""
    for point, shape, native_call, torch_call in tuning._grid(0):
        q, k, v = native_call.args[:3]
        assert all(a is b for a, b in zip(torch_call.args, (q, k, v)))
        assert q.dtype == k.dtype == v.dtype == tuning.DTYPES[shape["dtype"]]
        kv_heads = shape["Hkv"] if shape["L"] == 1 else shape["H"]
        assert q.shape == (shape["B"], shape["H"], shape["L"], tuning.HEAD_DIM), point
        assert k.shape == v.shape == (shape["B"], kv_heads, shape["S"], tuning.HEAD_DIM), point
        spans = sorted((x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()) for x in (q, k, v))
        assert spans[0][1] <= spans[1][0] and spans[1][1] <= spans[2][0], point
        assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


def test_a_short_call_is_timed_alone_more_times(monkeypatch):
    """SHORT_CALL_SINGLES: the single calls alternated with other work are one per call that fits in
    the sample (at least ``singles``, at most SHORT_CALL_SINGLES): a call of microseconds timed alone
    is mostly jitter, and its median needs more of them; a long one keeps ``singles``."""
    import time
    rounds = []
    real = tuning.alternated_times
    monkeypatch.setattr(tuning, "alternated_times", lambda calls, n, **kw: rounds.append(n) or real(calls, n, **kw))
    monkeypatch.setattr(tuning, "_other_work", lambda: None)
    tuning.best_of("short", {}, lambda: None, lambda: None, repeat=1, singles=3, sample_s=2e-3)
    tuning.best_of("long", {}, lambda: time.sleep(2e-3), lambda: time.sleep(2e-3), repeat=1, singles=3, sample_s=2e-3)
    assert rounds == [tuning.SHORT_CALL_SINGLES, 3] and tuning.SHORT_CALL_SINGLES == 15  # (the value measured, note above)
