"""mha bench: the measurements run and report what they claim (speed itself is not tested)."""

import json

import pytest
import torch

from mha import cli
from mha.cli import bench as bench_cli
from mha.kernels import native, tuning
from mha.tools import bench, bench_memory, bench_native, bench_peaks


def test_best_times_keeps_the_minimum_of_each():
    calls = []
    times = bench.best_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeat=3)
    assert calls == ["a", "b"] * 4  # one warm-up, then rounds in turn
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())


def test_module_and_training_rows_report_ratios():
    (row,) = bench.module_rows([(1, 16, 32)], repeat=1)
    assert set(row.times_ms) == {"ours", "torch-train", "torch-eval"}
    assert row.ratios["ours/torch-train"] == pytest.approx(row.times_ms["ours"] / row.times_ms["torch-train"])
    (causal,) = bench.module_rows([(1, 16, 32)], repeat=1, causal=True)
    assert causal.section == "causal"
    (train,) = bench.training_rows([(1, 16, 32)], repeat=1)
    assert "ours/torch" in train.ratios


def test_backend_rows_report_gflops_beside_matmul():
    rows = list(bench.backend_rows([64], repeat=1))
    assert [r.point for r in rows] == ["T64", "T64 causal"]
    assert {"sdpa", "flash", "math", "numpy-blocked"} == set(rows[0].times_ms)
    assert rows[0].extra["matmul GFLOP/s"] > 0 and rows[1].extra["flash GFLOP/s"] > 0


def test_contract_rows_time_ours_against_torch():
    rows = list(bench.contract_rows(128, repeat=1))
    assert len(rows) == 6 and all(r.ratios["ours/torch"] > 0 for r in rows)


@pytest.mark.slow
def test_cli_writes_json_csv_and_plot(tmp_path, monkeypatch, capsys):
    tiny = dict(module=[(1, 16, 32)], causal=[(1, 16, 32)], backends=[32, 64], training=[(1, 16, 32)], contract=64,
                memory=512, decode=8, window=(256, 16), overhead_decode=[16], auto=([1, 16], [64]), peers=[32], matmul=64,
                native=dict(forward=[32], one_head=32, training=32, decode=64, window=(128, 8), accuracy=16, short=[16],
                            matmul=128, cache_decode=[64], paged_prompt=32))
    monkeypatch.setattr(bench_cli, "QUICK", tiny)
    # one memory case (its three fresh processes, at T and T/2 and torch's, are most of this test's time)
    few = {name: bench_memory.MEMORY_CASES[name] for name in ("torch causal SDPA", "causal")}
    monkeypatch.setattr(bench_memory, "MEMORY_CASES", few)
    assert cli.main(["bench", "--quick", "--repeat", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    default = [s for s in bench_cli.SECTIONS if s not in bench_cli.OPT_IN]  # variants and hf: on request
    assert all(section in out for section in default) and "results.json" in out
    data = json.loads((tmp_path / "results.json").read_text())
    ratios = {k for r in data["rows"] for k in r["ratios"]}
    assert {"ours/torch-train", "ours/torch-eval", "ours/torch-train+hint", "flash speed/sdpa speed"} <= ratios
    assert data["machine"]["torch"] and {r["section"] for r in data["rows"]} == set(default)
    (memory,) = [r for r in data["rows"] if r["section"] == "memory"]
    assert memory["point"] == "T512 causal" and memory["extra"]["peak RSS growth MiB"] >= 0
    assert memory["extra"]["torch MiB"] >= 0 and memory["extra"]["at T256 MiB"] >= 0
    assert memory["ratios"]["growth / torch"] > 0 and memory["ratios"]["growth T / growth T/2"] > 0
    assert (tmp_path / "results.csv").read_text().startswith("section,point,measure,value")
    assert (tmp_path / "backends.png").stat().st_size > 10_000


@pytest.mark.slow
def test_hf_rows_time_and_measure_each_implementation():
    pytest.importorskip("transformers")
    (row,) = bench.hf_rows("gpt-oss", 64, repeat=1)
    assert row.point == "gpt-oss B1 T64" and set(row.times_ms) == {"mha", "eager"}
    assert row.ratios["mha/eager time"] == pytest.approx(row.times_ms["mha"] / row.times_ms["eager"])
    assert row.extra["mha peak MiB"] >= 0 and row.extra["eager peak MiB"] > 0 and "mha/eager peak" in row.ratios


def test_an_extra_that_is_missing_is_named():
    from mha.cli import _common
    with pytest.raises(SystemExit, match=r"mha bench --sections hf: needs no_such_module, which comes with the hf "
                                         r"extra: pip install 'mha\[hf\]'"):
        _common.require("no_such_module", command="bench --sections hf", extra="hf")


def test_cli_rejects_bad_repeat():
    assert cli.main(["bench", "--repeat", "0"]) == 2


def test_modern_rows():
    row = bench.decode_row(16, E=32)
    assert row.ratios["recompute/cache"] > 0 and row.extra["late token ms"] > 0
    assert "dense causal/window" in bench.window_row(256, 16, repeat=1).ratios


def test_overhead_rows_time_the_drop_in_and_a_decode_step_against_torch():
    rows = list(bench.overhead_rows(repeat=1, points=[(1, 1, 32, 4)], decode_lengths=[16]))
    assert [r.point for r in rows] == ["drop-in B1 T1 E32 H4", "decode step S=16 of 17 slots E512 H8",
                                       "decode step S=16 of 4096 slots E512 H8", "decode step S=16 E512 H8, cache formats"]
    assert rows[0].ratios["ours/torch-eval"] > 0 and rows[1].ratios["ours/torch step"] > 0
    assert rows[2].ratios["ours/torch step"] > 0
    formats = rows[3]
    assert formats.ratios == {"bf16/fp32": formats.times_ms["bf16"] / formats.times_ms["fp32"],
                              "int8/bf16": formats.times_ms["int8"] / formats.times_ms["bf16"]}


@pytest.mark.slow
def test_distributed_rows_measure_every_run_against_one_process(tmp_path, monkeypatch):
    """The distributed section: the one-process baseline, then ring with each balance and Ulysses,
    each from fresh spawned ranks; and its figure."""
    rows = list(bench.distributed_rows(384, 2))
    assert [r.point for r in rows] == ["T384 one process, flash", "T384 W2 ring zigzag", "T384 W2 ring contiguous",
                                       "T384 W2 ring striped", "T384 W2 ulysses zigzag"]
    baseline = rows[0].extra["peak growth MiB"]
    for row in rows[1:]:
        assert row.ratios["peak per rank / one process"] == pytest.approx(row.extra["peak per rank MiB"] / baseline)
        assert row.ratios["slowest / fastest rank CPU"] >= 1 and row.extra["check error"] < 1e-5
        assert [r["rank"] for r in row.detail["ranks"]] == [0, 1]
    assert rows[1].extra["scores slowest / fastest"] == 1.0  # zigzag: the same causal work on both ranks
    assert rows[2].extra["scores slowest / fastest"] == pytest.approx((384 * 385 // 2 - 192 * 193 // 2) / (192 * 193 // 2))
    paths = bench.write(rows, bench.machine(matmul_n=64), str(tmp_path))
    assert (tmp_path / "distributed.png").stat().st_size > 10_000 and str(tmp_path / "distributed.png") in paths


def test_native_rows_time_it_against_torch_beside_a_matmul(tmp_path):
    from helpers.backends import NATIVE
    if not NATIVE:
        pytest.skip("the native kernel does not build here")
    grid = dict(forward=[64], one_head=96, training=64, decode=256, window=(256, 16), accuracy=32, short=[16], matmul=128,
                cache_decode=[300], paged_prompt=64)
    rows = list(bench.native_rows(grid, repeat=1))
    assert [r.point for r in rows] == [
        "forward fp32 T64", "forward fp32 T64 causal", "forward fp32 T96 causal H1", "forward+backward fp32 T64 causal",
        "decode fp32 L1 S256 Hq32/Hkv8 D128",
        "forward bf16 T64", "forward bf16 T64 causal", "forward bf16 T96 causal H1", "forward+backward bf16 T64 causal",
        "decode bf16 L1 S256 Hq32/Hkv8 D128",
        *(f"decode {where}, {name}" for where in ("B1 S300 paged", "B8 S300 paged", "B1 S300 paged Hq8/Hkv8")
          for name in ("float32 cache", "bfloat16 cache", "int8 cache", "int8 cache, bfloat16 queries", "int8, scales apart")),
        "prompt fp32 T64 causal Hq8/Hkv2 over pages of 16", "prompt bf16 T64 causal Hq8/Hkv2 over pages of 16",
        "short forward fp32 T16", "short forward bf16 T16",
        "window (16, 0) fp32 T256", "accuracy fp32 T32 causal", "accuracy bf16 T32 causal"]
    assert rows[0].ratios["native/sdpa"] == pytest.approx(rows[0].times_ms["native"] / rows[0].times_ms["sdpa"])
    # named apart from the header's matmul figures, a measurement of their own minutes earlier (a new user saw two)
    assert rows[0].extra["fp32 matmul GFLOP/s (section's own)"] > 0 and rows[5].extra["bf16 matmul GFLOP/s (section's own)"] > 0
    assert rows[2].extra["native GFLOP/s"] == pytest.approx(4 * 96 * 96 * 64 / 2 / rows[2].times_ms["native"] / 1e6)
    peaks = bench_peaks.current()  # measured once per thread count: the same figures the rows were judged by
    assert rows[0].detail["limit"] == "fp32 FMA GFLOP/s"
    assert rows[0].extra["native of limit"] == pytest.approx(rows[0].extra["native GFLOP/s"] / peaks["fp32 FMA GFLOP/s"])
    assert rows[5].detail["limit"] == bench_peaks.limit_of("bf16", peaks)[0]
    assert rows[4].extra["native GB/s (K, V read)"] > 0 and rows[4].extra["memory read GB/s (sum)"] == peaks["read GB/s"]
    # "of read": against a read of the same K and V timed in the same rounds, not the peaks' figure
    assert rows[4].extra["native of read"] == pytest.approx(rows[4].times_ms["read"] / rows[4].times_ms["native"])
    assert rows[4].extra["read GB/s (same bytes, same rounds)"] == pytest.approx(
        2 * 8 * 256 * 128 * 4 / rows[4].times_ms["read"] / 1e6)
    fp32, bf16, int8, int8_bf16, apart = rows[10:15]  # int8 holds (128 + 4) bytes per row where bfloat16 holds 256
    assert int8.extra["bytes / bf16's"] == pytest.approx(132 / 256) and fp32.extra["bytes / bf16's"] == 2
    assert 0 < int8.extra["error"] < 4 * bf16.extra["error"] and fp32.extra["error"] < 1e-5
    assert int8_bf16.extra["bytes / bf16's"] == int8.extra["bytes / bf16's"]
    assert 0 < int8_bf16.extra["error"] < 8 * bf16.extra["error"]
    assert int8.ratios["/ bf16 cache"] == pytest.approx(int8.times_ms["step"] / bf16.times_ms["step"])
    assert bf16.ratios["/ fp32 cache"] == pytest.approx(bf16.times_ms["step"] / fp32.times_ms["step"])
    assert apart.extra["of read"] == pytest.approx(apart.times_ms["read"] / apart.times_ms["step"])
    assert bf16.extra["read GB/s (same bytes, same rounds)"] == pytest.approx(2 * 8 * 300 * 128 * 2 / bf16.times_ms["read"] / 1e6)
    mha_int8 = next(r for r in rows if r.point == "decode B1 S300 paged Hq8/Hkv8, int8 cache")  # a key a row
    assert mha_int8.extra["bytes / bf16's"] == pytest.approx(132 / 256) and 0 < mha_int8.extra["error"] < 1e-2
    prompt = rows[25]  # a prompt over pages: its time beside the dense forward's and torch's, in one run
    assert prompt.ratios["paged/native"] == pytest.approx(prompt.times_ms["paged"] / prompt.times_ms["native"])
    assert prompt.extra["paged GFLOP/s"] == pytest.approx(4 * 8 * 64 * 64 * 64 / 2 / prompt.times_ms["paged"] / 1e6)
    assert rows[29].ratios["dense causal/window"] > 0
    assert 0 < rows[30].extra["native error"] < 1e-5 and 0 < rows[31].extra["native error"] < 1e-1
    bench.write(rows, bench.machine(matmul_n=64), str(tmp_path))
    assert (tmp_path / "native.png").stat().st_size > 10_000


def test_a_decoding_rows_read_slower_than_its_step_is_noted_as_disturbed_and_the_cache_size_beside_it(monkeypatch):
    """Found by a new user: "of read 1.99" printed without a word (a read can't take that much longer
    than a step that reads the same bytes and more, as a few streams at once); and points that fit in
    the last-level cache read from it."""
    monkeypatch.setattr(bench_native, "last_level_cache_bytes", lambda: 32 * 2 ** 20)
    extra, detail = bench._read_beside(2.0, 1.0, 64 * 2 ** 20)
    assert extra == {"of read": 0.5, "read GB/s (same bytes, same rounds)": 64 * 2 ** 20 / 1e6, "bytes / last-level cache": 2.0}
    assert detail == {}
    # a step reading its tiles as streams reads up to ~1.3x the one-stream sum (1.31 measured): not flagged
    assert bench._read_beside(1.0, 1.31, 1)[1] == {} and bench._read_beside(1.0, 1.49, 1)[1] == {}
    assert "note" in bench._read_beside(1.0, 1.51, 1)[1]  # past DISTURBED (1.5): flagged
    assert "native of read" in bench._read_beside(1.0, 1.0, 1, who="native ")[0]
    extra, detail = bench._read_beside(1.0, 2.0, 16 * 2 ** 20)
    assert extra["of read"] == 2.0 and extra["bytes / last-level cache"] == 0.5 and "disturbed round" in detail["note"]
    rows = [bench.Row("native", "decode x", {"step": 1.0, "read": 2.0}, {}, extra, detail)]
    caption = bench_cli._table("native", rows, "here").caption
    assert caption.startswith("measured on here") and "decode x: its read took 2.00x the step's time" in caption
    monkeypatch.setattr(bench_native, "last_level_cache_bytes", lambda: None)  # where Linux does not say
    assert "bytes / last-level cache" not in bench._read_beside(2.0, 1.0, 1)[0]


def test_a_tables_headers_wrap_before_its_figures_are_cut():
    """Found by a new user: at 140 columns every error of the decoding rows read "1.42…"."""
    import io

    from rich.console import Console
    extra = {"GB/s": 45.1, "of read": 0.88, "error": 1.4234e-6, "read GB/s (same bytes, same rounds)": 31.2,
             "bytes / last-level cache": 64.0, "bytes / bf16's": 0.516, "memory read GB/s (sum)": 40.1}
    rows = [bench.Row("native", f"decode B8 S65536 paged, int8, scales apart {i}", {"step": 1.234, "read": 2.0},
                      {"/ fp32 cache": 0.5, "/ bf16 cache": 0.9}, extra) for i in range(2)]
    console = Console(width=140, record=True, file=io.StringIO())
    console.print(bench_cli._table("native", rows, "here"))
    figures = [line for line in console.export_text().splitlines() if line.startswith("│")]  # the rows, not the headers
    assert len(figures) == 2 and not any("…" in line for line in figures)
    assert all(figure in figures[0] for figure in ("1.23", "1.42e-06", "0.516", "31.2", "40.1"))


def test_the_last_level_cache_is_the_highest_level_linux_reports(tmp_path):
    for index, (level, size) in enumerate([(1, "48K"), (2, "1M"), (3, "32768K"), (3, "junk")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "size").write_text(f"{size}\n")
    assert bench_native.last_level_cache_bytes(str(tmp_path)) == 32 * 2 ** 20  # the malformed one left out
    (tmp_path / "index2" / "size").write_text("0K\n")  # a level without a size is no cache
    assert bench_native.last_level_cache_bytes.__wrapped__(str(tmp_path)) == 2 ** 20
    assert bench_native.last_level_cache_bytes(str(tmp_path / "absent")) is None


def test_a_table_wider_than_the_terminal_says_figures_may_be_left_out():
    """Found by review: at 80 columns rich leaves out a wide table's last columns without a mark."""
    import io

    from rich.console import Console
    rows = [bench.Row("native", "decode B8 S65536 paged, int8, scales apart", {"step": 1.0, "read": 2.0},
                      {"/ fp32 cache": 0.5}, {"read GB/s (same bytes, same rounds)": 31.2, "memory read GB/s (sum)": 40.1,
                                              "bytes / last-level cache": 64.0, "error": 1.4234e-6})]
    for width, said in ((80, True), (400, False)):
        console = Console(width=width, record=True, file=io.StringIO())
        bench_cli._print(console, bench_cli._table("native", rows, "here"))
        shown = " ".join(console.export_text().split())
        assert ("some of its figures may be cut or left out above; results.csv has every figure" in shown) is said


def test_peer_rows_time_onnxruntime_beside_torch_and_agree_with_it():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    (row,) = bench.peer_rows([64], repeat=1)
    assert row.point == "fp32 T64" and set(row.times_ms) == {"mha", "torch", "onnxruntime"}
    assert row.ratios["mha/onnxruntime"] > 0
    assert row.extra["mha error"] < 1e-5 and row.extra["onnxruntime error"] < 1e-5


def test_serving_step_rows_time_paged_beside_contiguous_and_torch():
    (row,) = [r for r in bench.serving_rows([64], 1, decode_rows=3, chunk=8, chunk_keys=40) if "float32" in r.point]
    assert set(row.ratios) == {"paged/contiguous", "paged/varlen", "paged/sdpa mask"}
    assert all(ratio > 0 for ratio in row.ratios.values())


def test_serving_ways_and_a_sized_cache(monkeypatch):
    """Every way of bench_serving is measured where it fits; generate_batch's cache holds every prompt
    and its answer (the pages a server would size it to); an unknown way is refused."""
    pytest.importorskip("transformers")
    from mha.tools import bench_serving

    assert bench_serving.ways_of("16 x 64-512 x 32", "float32") == bench_serving.WAYS
    assert "paged|eager" not in bench_serving.ways_of("64 x 256-2048 x 128", "float32")
    seen = {}
    monkeypatch.setattr(type(bench_serving._model(torch.float32)), "generate_batch",
                        lambda self, prompts, **kw: seen.update(kw), raising=True)
    prompts = [[1] * 300, [2] * 10]
    bench_serving._run(bench_serving._model(torch.float32), "sdpa", prompts, None, 40)
    assert seen["continuous_batching_config"].num_blocks == 2 + 1  # 340 tokens: 2 pages of 256, 50: 1
    with pytest.raises(ValueError, match="way must be one of"):
        bench_serving.measure_way("16 x 64-512 x 32", torch.float32, "eager")


@pytest.mark.measured_dispatch
def test_the_auto_section_says_which_dispatch_table_it_runs_on_and_measures_it_first(tmp_path, monkeypatch, capsys):
    """Found by a new user: auto's first point measured and stored the table inside its timing, in
    silence. The section's first job measures it where auto's first call would, and says so."""
    monkeypatch.setenv("MHA_TUNE_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setenv("MHA_TUNE", "auto")
    monkeypatch.setattr(tuning, "best_of", lambda point, shape, native_call, torch_call: (0.5, 1.0))
    tuning.forget()
    try:
        assert bench_cli._auto_table() == []
        first = capsys.readouterr().out
        bench_cli._auto_table()
        second = capsys.readouterr().out
    finally:
        tuning.forget()
    threads = torch.get_num_threads()
    assert f"auto's dispatch table at {threads} thread" in first
    if not native.ready():
        assert "none stored" in first
        return
    assert f"measured now, as auto's first call measures it; stored in {tmp_path / 'tune.json'}" in first
    assert "stored, measured 20" in second
    # found by review: a table to be measured again, whose measuring fails, is read anew (another object): not "now"
    table = tuning.stored()
    (tmp_path / "tune.json").write_text(json.dumps({tuning.machine_key(): {**table, "sure": False, "measured_at": 1.0}}))
    monkeypatch.setattr(tuning, "_first_use", lambda previous=None: None)
    tuning.forget()
    try:
        bench_cli._auto_table()
    finally:
        tuning.forget()
    assert "stored, measured 20" in capsys.readouterr().out


def test_auto_rows_time_loops_and_single_calls_alternated_with_other_work(monkeypatch):
    rows = list(bench.auto_rows([16], [64], 1))
    assert [r.point for r in rows] == ["fp32 T16 causal", "fp32 decode S64", "bf16 T16 causal", "bf16 decode S64"]
    for row in rows:
        assert set(row.ratios) == {"auto/torch", "auto/torch alternated"} and all(v > 0 for v in row.ratios.values())
        assert {"auto", "torch", "auto alternated", "torch alternated"} <= set(row.times_ms)
    seen = []  # the projection's points: q, k, v (B, T, H, D) seen as (B, H, T, D), rows H * D apart
    monkeypatch.setattr(bench, "scaled_dot_product_attention", lambda q, k, v, m, **kw: seen.append(q.stride(2) + k.stride(2)))
    rows = list(bench.auto_rows([16], [64], 1, projection=True))
    assert [r.point for r in rows] == ["fp32 T16 causal, heads of a projection", "bf16 T16 causal, heads of a projection"]
    assert seen and set(seen) == {2 * bench.HEADS * bench.HEAD_DIM}
    masks = []  # the masked points: a bool (L, S) mask, not causal, beside the same call of torch's
    monkeypatch.setattr(bench, "scaled_dot_product_attention", lambda q, k, v, m, **kw: masks.append((m, kw["is_causal"])))
    rows = list(bench.auto_rows([16], [64], 1, mask=True))
    assert [r.point for r in rows] == ["fp32 T16, a bool mask (L, S)", "bf16 T16, a bool mask (L, S)"]
    assert masks and all(m.dtype == torch.bool and m.shape == (16, 16) and not m.all() and not causal for m, causal in masks)
    monkeypatch.undo()
    from mha.kernels import tuning

    calls = []
    times = tuning.alternated_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    # a warm-up each, then in turn, every other round reversed (the first of a round runs slower)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"] and set(times) == {"a", "b"}
    # the alternated ratio: the median of each round's pair, not the ratio of the medians (3 here)
    monkeypatch.setattr(tuning, "alternated_samples", lambda fns, rounds: {"auto": [1.0, 10.0, 3.0], "torch": [1.0, 1.0, 3.0]})
    row = next(bench.auto_rows([1], [], 1))
    assert row.ratios["auto/torch alternated"] == 1.0 and row.times_ms["auto alternated"] == 3000.0
    # single calls alternated: one per loop call, 3 to SHORT_CALL_SINGLES (15), times the repeats
    assert [bench.alternated_rounds(c, r) for c, r in ((1, 1), (4, 1), (200, 1), (200, 2), (15, 1), (16, 1))] == [
        3, 4, 15, 30, 15, 15]


def test_a_section_of_rows_with_different_columns_prints_one_table_per_kind_of_row():
    """The native section's rows (forward, decode, cache decode, window, accuracy) each have columns
    of their own: in one table they made 30 columns, blank cells at a terminal of 140."""
    from rich.console import Console

    from mha.cli import bench as cli_bench
    rows = [bench.Row("native", "forward", {"native": 1.0, "sdpa": 2.0}, {"native/sdpa": 0.5}, {"GFLOP/s": 3.0}),
            bench.Row("native", "forward 2", {"native": 1.5, "sdpa": 2.5}, {"native/sdpa": 0.6}, {"GFLOP/s": 3.5}),
            bench.Row("native", "decode", {"native": 4.0, "sdpa": 5.0}, {"native/sdpa": 0.8}, {"GB/s": 9.0}),
            bench.Row("native", "accuracy", {}, {"native/sdpa error": 1.1}, {"native error": 1e-7})]
    parts = cli_bench._parts("native", rows)
    assert [(title, [r.point for r in part]) for title, part in parts] == [
        ("native (1 of 3)", ["forward", "forward 2"]), ("native (2 of 3)", ["decode"]), ("native (3 of 3)", ["accuracy"])]
    console = Console(width=140, record=True)
    for title, part in parts:
        console.print(cli_bench._table(title, part, "here"))
    assert " - " not in console.export_text()  # no blank cell: each table has its rows' columns only
    assert cli_bench._parts("module", rows[:2]) == [("module", rows[:2])]
    absent = bench.Row("peaks", "bf16 dot GFLOP/s: not on this CPU / build", {})
    assert cli_bench._parts("native", [*rows[:2], absent]) == [("native", [*rows[:2], absent])]  # no table of its own


def test_the_limits_are_this_cpus_own_and_each_dtype_is_judged_against_the_fastest_it_has():
    from helpers.backends import NATIVE
    if not NATIVE:
        pytest.skip("the native kernel does not build here")
    peaks = bench_peaks.current()
    assert set(peaks) == set(bench_peaks.LIMITS)
    flags = tuning.cpu()["flags"]
    assert (peaks["AMX bf16 matmul GFLOP/s"] is None) == ("amx_bf16" not in flags)
    assert (peaks["AMX tiles GFLOP/s"] is None) == (not native._kernel().amx_active())
    if peaks["AMX tiles GFLOP/s"] is not None:  # the nominal rate: no data to move, above a large matmul's
        assert peaks["AMX tiles GFLOP/s"] > peaks["AMX bf16 matmul GFLOP/s"]
    assert (peaks["bf16 dot GFLOP/s"] is None) == (native._kernel().build_info() != "avx512bf16")
    assert peaks["fp32 FMA GFLOP/s"] > 1 and peaks["read GB/s"] > 0.5
    rows = list(bench.peak_rows())
    assert [r.point for r in rows if r.extra][-2:] == [
        f"{dtype} products judged against: {bench_peaks.limit_of(dtype, peaks)[0]}" for dtype in ("fp32", "bf16")]
    absent = {f"{name}: not on this CPU / build" for name, value in peaks.items() if value is None}
    assert {r.point for r in rows if not r.extra} == absent


def test_a_dtype_is_judged_against_amx_then_its_dot_product_then_the_fma_peak():
    every = {"fp32 FMA GFLOP/s": 100.0, "bf16 dot GFLOP/s": 200.0, "AMX tiles GFLOP/s": 3000.0,
             "AMX bf16 matmul GFLOP/s": 900.0, "read GB/s": 30.0}
    assert bench_peaks.limit_of("fp32", every) == ("fp32 FMA GFLOP/s", 100.0)
    assert bench_peaks.limit_of("bf16", every) == ("AMX tiles GFLOP/s", 3000.0)
    assert bench_peaks.limit_of("bf16", {**every, "AMX tiles GFLOP/s": None}) == ("bf16 dot GFLOP/s", 200.0)
    assert bench_peaks.limit_of("bf16", {**every, "AMX tiles GFLOP/s": None, "bf16 dot GFLOP/s": None}) == (
        "fp32 FMA GFLOP/s", 100.0)
    assert bench_peaks.limit_of("fp32", {**every, "fp32 FMA GFLOP/s": None}) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_the_peak_chains_count_the_work_every_thread_did(threads):
    """fma_peak_work: 12 chains of one FMA (2 flops a lane) per step on every thread; a count that
    left out a thread, or a chain, would report a rate off by that much."""
    from helpers.backends import NATIVE
    if not NATIVE:
        pytest.skip("the native kernel does not build here")
    kernel = native._kernel()
    lanes = 16 if kernel.build_info().startswith("avx512") else 8
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert kernel.fma_peak_work(1000) == 2 * lanes * 12 * 1000 * threads
        dot = kernel.bf16_dot_peak_work(1000)
        assert dot == (4 * 16 * 12 * 1000 * threads if kernel.build_info() == "avx512bf16" else -1)
    finally:
        torch.set_num_threads(before)


def test_scaling_rows_put_each_point_at_every_thread_count_side_by_side():
    rows = [bench.Row("native", "forward", {"native": 8.0, "sdpa": 6.0}, {"native/sdpa": 8 / 6}, threads=1),
            bench.Row("native", "forward", {"native": 2.0, "sdpa": 3.0}, {"native/sdpa": 2 / 3}, threads=4),
            bench.Row("native", "only at one count", {"native": 1.0}, threads=4),
            bench.Row("peaks", "read GB/s", {}, extra={"figure": 30.0}, detail={"limit": "read GB/s"}, threads=1),
            bench.Row("peaks", "read GB/s", {}, extra={"figure": 60.0}, detail={"limit": "read GB/s"}, threads=4),
            bench.Row("peaks", "AMX: not on this CPU", {}, detail={"limit": "AMX"}, threads=1),  # absent: no figure
            bench.Row("peaks", "AMX: not on this CPU", {}, detail={"limit": "AMX"}, threads=4),
            bench.Row("peaks", "fp32 judged against: read", {}, extra={"figure": 60.0}, threads=1),  # not a limit
            bench.Row("peaks", "fp32 judged against: read", {}, extra={"figure": 60.0}, threads=4)]
    native, sdpa, read, ratio = bench.scaling_rows(rows)
    assert [r.section for r in (native, sdpa, read, ratio)] == ["scaling"] * 4
    assert native.point == "native: forward (native)" and sdpa.point == "native: forward (sdpa)"
    assert native.times_ms == {"1 thread": 8.0, "4 threads": 2.0} and native.ratios == {"speedup 1 to 4": 4.0}
    assert sdpa.times_ms == {"1 thread": 6.0, "4 threads": 3.0} and sdpa.ratios == {"speedup 1 to 4": 2.0}
    # found by a new user: --sections peaks --threads 1 2 printed no scaling at all
    assert read.point == "peaks: read GB/s" and read.extra == {"at 1 thread": 30.0, "at 4 threads": 60.0}
    assert read.ratios == {"speedup 1 to 4": 2.0} and not read.times_ms
    assert ratio.point == "native: forward: native/sdpa" and ratio.extra == {"at 1 thread": 8 / 6, "at 4 threads": 2 / 3}
    assert list(bench.scaling_rows(rows[:1])) == []  # one count: nothing to scale


def test_cli_runs_every_section_at_each_thread_count_and_adds_the_scaling(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_cli, "QUICK", {**bench_cli.QUICK, "contract": 32, "matmul": 32})
    before = torch.get_num_threads()
    try:
        assert cli.main(["bench", "--quick", "--sections", "contract", "--threads", "2", "1", "--repeat", "1",
                         "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "contract, 1 thread" in out and "contract, 2 threads" in out and "scaling" in out
    assert "…" not in out  # not a terminal: every table whole (rich cut figures to fit 140 columns)
    data = json.loads((tmp_path / "results.json").read_text())
    # the scaling table's caption and the JSON carry each count's own matmul rates (the last count's once stood for
    # both), fewest threads first as the scaling's columns, whatever order the counts were given in
    assert len(data["machine"]["fp32 matmul GFLOP/s"]) == 2 and data["machine"]["threads"] == [1, 2]
    assert "1 / 2 threads, matmul GFLOP/s fp32 " in " ".join(out.split())
    runs = [r for r in data["rows"] if r["section"] == "contract"]
    assert {r["threads"] for r in runs} == {1, 2} and data["machine"]["thread counts"] == [2, 1]
    scaling = [r for r in data["rows"] if r["section"] == "scaling"]
    timed = [r for r in scaling if r["times_ms"]]
    assert len(timed) == sum(len(r["times_ms"]) for r in runs) // 2 and all("speedup 1 to 2" in r["ratios"] for r in timed)
    assert cli.main(["bench", "--threads", "2", "0"]) == 2
    assert "--threads must be positive, got 2 0" in capsys.readouterr().err


def test_paired_times_swap_the_order_and_take_the_mean_of_a_samples_calls(monkeypatch):
    """Each sample is ``calls`` calls in a row, its mean kept; pairs alternate which goes first."""
    clock, order = [0.0], []

    def step(name: str, seconds: float):
        def call():
            order.append(name)
            clock[0] += seconds
        return call

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    taken = bench.paired_times({"a": step("a", 2.0), "b": step("b", 5.0)}, 2, calls=3)
    assert order == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3
    assert taken == {"a": [2.0, 2.0], "b": [5.0, 5.0]}


def test_hf_generate_rows_time_mha_against_sdpa_on_the_same_weights(monkeypatch):
    pytest.importorskip("transformers")
    (row,) = bench.hf_generate_rows([8], ["float32"], 2, 1)
    assert row.point == "llama generate float32 prompt 8 + 2" and set(row.times_ms) == {"mha", "sdpa"}
    assert row.ratios["mha/sdpa time"] > 0 and row.extra["tokens alike"] == row.extra["new tokens"] == 2.0
    assert bench._leading_alike(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 5, 4])) == 2
    assert bench._leading_alike(torch.tensor([7]), torch.tensor([8])) == 0
    order = []
    taken = bench.paired_times({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, 3)
    assert order == ["a", "b", "b", "a", "a", "b"] and [len(ts) for ts in taken.values()] == [3, 3]
    monkeypatch.setattr(bench, "paired_times", lambda fns, pairs: {"mha": [1.0, 10.0, 3.0], "sdpa": [1.0, 1.0, 3.0]})
    (row,) = bench.hf_generate_rows([8], ["float32"], 2, 1)
    assert row.ratios["mha/sdpa time"] == 1.0 and row.times_ms == {"mha": 1000.0, "sdpa": 1000.0}  # pairs' median, bests
    monkeypatch.setattr(bench_native, "matmul_gflops", lambda dtype, n: 0.5)  # a dtype too slow here
    (skipped,) = bench.hf_generate_rows([8], ["bfloat16"], 2, 1)
    assert skipped.point == "llama generate bfloat16: not timed (torch's bfloat16 matmul runs at 0.5 GFLOP/s here)"
    assert not skipped.times_ms and bench.GENERATE_MATMUL_GFLOPS == 5.0


def test_a_read_of_a_caches_bytes_sums_them_as_64_bit_words_whatever_the_dtype():
    """torch's fastest read: an int64 sum (a float one took 1.2-1.5x over the same bytes in cache)."""
    from mha.tools.bench_native import read_call
    floats = torch.randn(3, 5)  # 60 bytes: seven words read, 4 bytes left out
    row = torch.randn(2, 7)[1]  # starts 28 bytes in, between words: read from its first whole one (raised once)
    assert read_call(row)()[0] == row.view(torch.uint8)[4:].view(torch.int64).sum()
    assert read_call(floats)()[0] == floats.reshape(-1).view(torch.uint8)[:56].view(torch.int64).sum()
    pool = torch.arange(-10, 10, dtype=torch.int8).reshape(4, 5)  # 20 bytes: two words read, 4 bytes left out
    (words,) = read_call(pool)()
    assert words.dtype == torch.int64 and words == pool.reshape(-1).view(torch.uint8)[:16].view(torch.int64).sum()
    assert [x.dtype for x in read_call(floats, pool, floats.bfloat16())()] == [torch.int64] * 3
    with pytest.raises(ValueError, match="contiguous"):  # a view's sum would time its copy
        read_call(torch.zeros(4, 132, dtype=torch.int8)[:, :128])
