"use strict";
// mha view: the attention explorer. Everything it shows comes from the manifest and the data
// embedded in this page (mha/explorer/page.py writes them); nothing is fetched. window.mhaView is
// its interface for scripts and tests: ready, error, state, weight(), breakdown(), open(),
// select(), showRun(), exportPng() (and lastExport: the exported PNG's size and caption lines).

(function () {
  const api = (window.mhaView = { ready: false, error: null });
  const $ = (id) => document.getElementById(id);
  const VIRIDIS = [[68, 1, 84], [71, 45, 123], [59, 82, 139], [44, 114, 142], [33, 145, 140],
                   [40, 174, 128], [94, 201, 98], [173, 220, 48], [253, 231, 37]];
  const RED_BLUE = [[5, 48, 97], [42, 113, 178], [107, 172, 209], [194, 221, 236], [247, 246, 246],
                    [251, 204, 180], [228, 128, 102], [186, 40, 50], [103, 0, 31]];
  const THUMB = 64; // the grid's maps are at most THUMB x THUMB pixels
  const KEY_ROWS = 512; // a row's breakdown lists at most this many keys (of the largest weights)
  // the head view: cells of up to CELL px, square, while the map fits in FIT px a side; a longer side
  // keeps cells of MIN_CELL px (one can point at a row: the view scrolls) up to MAX_SIDE px, and is
  // shrunk to MAX_SIDE px past it (MAX_SIDE / MIN_CELL = 512 positions, the text models' usual limit)
  const CELL = 28, FIT = 640, MIN_CELL = 8, MAX_SIDE = 4096;

  // ---- data ------------------------------------------------------------------------------------

  async function inflate(base64) {
    const started = performance.now();
    const text = atob(base64.trim());
    const bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    if (typeof DecompressionStream === "undefined") throw new Error("this browser has no DecompressionStream: use a current Chrome, Firefox or Safari");
    timings.base64 = performance.now() - started;
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    const inflated = new Uint8Array(await new Response(stream).arrayBuffer());
    timings.inflate = performance.now() - started - timings.base64;
    return inflated;
  }

  function half(bits) { // an IEEE float16 as a number
    const sign = bits & 0x8000 ? -1 : 1, exponent = (bits >> 10) & 0x1f, fraction = bits & 0x3ff;
    if (exponent === 0) return sign * fraction * 2 ** -24;
    if (exponent === 31) return fraction ? NaN : sign * Infinity;
    return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
  }

  function array(buffer, entry) {
    if (!entry) return null;
    switch (entry.kind) {
      case "u8": case "bits": return new Uint8Array(buffer, entry.offset, entry.length);
      case "f32": return new Float32Array(buffer, entry.offset, entry.length);
      case "f16": {
        const raw = new Uint16Array(buffer, entry.offset, entry.length), out = new Float32Array(entry.length);
        for (let i = 0; i < raw.length; i++) out[i] = half(raw[i]);
        return out;
      }
      default: throw new Error("unknown array kind " + entry.kind);
    }
  }

  function layerOf(entry, buffer) {
    const layer = Object.assign({}, entry);
    layer.codes = array(buffer, entry.weights);
    for (const name of ["q", "k", "v", "out", "additive"]) layer[name] = array(buffer, entry[name]);
    layer.hidden = (entry.hidden || []).map((term) => Object.assign({}, term, { bits: array(buffer, term.bits) }));
    layer.detailed = !!entry.q;
    return layer;
  }

  // ---- maps: a head, or an average ---------------------------------------------------------------

  // The values of grid cell (l, head) of run `run`: head `head` of layer l; head = H: the mean of
  // the layer's heads; l = the number of layers: the mean over the layers of head `head` (of every
  // head when head = H). Float32Array (L * S), straight from the 8-bit codes.
  function mapValues(run, l, head) {
    const layers = state.runs[run].layers, parts = [];
    for (const layer of l < layers.length ? [layers[l]] : layers) {
      if (head < layer.H) parts.push([layer, head]);
      else for (let h = 0; h < layer.H; h++) parts.push([layer, h]);
    }
    const n = parts[0][0].L * parts[0][0].S, out = new Float32Array(n);
    for (const [layer, h] of parts) {
      const codes = layer.codes, base = h * n, step = layer.scales[h] / 255 / parts.length;
      for (let i = 0; i < n; i++) out[i] += codes[base + i] * step;
    }
    return out;
  }

  function diffValues(l, head) {
    const a = mapValues(0, l, head), b = mapValues(1, l, head);
    return a.map((x, i) => x - b[i]);
  }

  // the open map's values in the run shown (or the difference), and each run's: hovering reads them
  // again and again
  function openValues() {
    const { layer: l, head } = state.open, key = state.show + ":" + l + ":" + head;
    if (state.cached.key !== key) {
      const runs = state.runs.map((_, r) => mapValues(r, l, head));
      const values = state.show === "diff" ? runs[0].map((x, i) => x - runs[1][i]) : runs[state.show];
      state.cached = { key, values, runs };
    }
    return state.cached;
  }

  function largestOf(list) { // Math.max of a long list (a spread overflows the stack past ~100k)
    let m = -Infinity;
    for (let i = 0; i < list.length; i++) if (list[i] > m) m = list[i];
    return m;
  }

  function extent(values) { // the largest |value|
    let m = 0;
    for (let i = 0; i < values.length; i++) { const x = values[i] < 0 ? -values[i] : values[i]; if (x > m) m = x; }
    return m;
  }

  // ---- colours -------------------------------------------------------------------------------------

  function colour(t, stops) { // t in [0, 1] -> [r, g, b]
    const x = Math.min(1, Math.max(0, t)) * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(x)), f = x - i;
    return stops[i].map((c, k) => Math.round(c + (stops[i + 1][k] - c) * f));
  }

  function colourOf(value, range) {
    if (state.show === "diff") return colour(range > 0 ? 0.5 + value / (2 * range) : 0.5, RED_BLUE);
    return colour(range > 0 ? value / range : 0, VIRIDIS);
  }

  function drawLegend(range, shared = false) { // range null: each map on its own scale; shared: every map's
    const bar = $("legend-bar"), ctx = bar.getContext("2d");
    for (let x = 0; x < bar.width; x++) {
      const [r, g, b] = colour(x / (bar.width - 1), state.show === "diff" ? RED_BLUE : VIRIDIS);
      ctx.fillStyle = `rgb(${r},${g},${b})`;
      ctx.fillRect(x, 0, 1, bar.height);
    }
    const diff = state.show === "diff", runs = diff ? `${state.runs[0].label} − ${state.runs[1].label}` : "";
    if (range === null) {
      $("legend-low").textContent = diff ? "−largest" : "0";
      $("legend-high").textContent = diff ? `+largest |${runs}| of each map` : "largest weight of each map";
      return;
    }
    $("legend-low").textContent = diff ? "−" + range.toPrecision(3) : "0";
    $("legend-high").textContent = diff ? `+${range.toPrecision(3)} (${runs}${shared ? ", every map's largest" : ""})`
      : range.toPrecision(3) + (shared ? " (every map's largest weight)" : " (largest weight)");
  }

  // ---- the grid ------------------------------------------------------------------------------------

  // values (L x S) painted on w x h pixels: each pixel the largest |value| of the cells under it
  // (a cell per pixel block when w >= S, a block of cells per pixel when the map is longer)
  function paint(ctx, x0, y0, w, h, L, S, values, range) {
    if (!w || !h) return;
    const image = ctx.createImageData(w, h), data = image.data;
    for (let y = 0; y < h; y++) {
      const i0 = Math.floor(y * L / h), i1 = Math.max(i0 + 1, Math.floor((y + 1) * L / h));
      for (let x = 0; x < w; x++) {
        const j0 = Math.floor(x * S / w), j1 = Math.max(j0 + 1, Math.floor((x + 1) * S / w));
        let best = 0, size = -1;
        for (let i = i0; i < i1; i++) for (let j = i * S + j0, stop = i * S + j1; j < stop; j++) {
          const v = values[j], a = v < 0 ? -v : v;
          if (a > size) { size = a; best = v; }
        }
        const [r, g, b] = colourOf(best, range), p = 4 * (y * w + x);
        data[p] = r; data[p + 1] = g; data[p + 2] = b; data[p + 3] = 255;
      }
    }
    ctx.putImageData(image, x0, y0);
  }

  function thumbnail(canvas, L, S, values, range) {
    const h = Math.min(L, THUMB), w = Math.min(S, THUMB);
    canvas.width = w; canvas.height = h;
    canvas.style.height = Math.max(8, Math.round(THUMB * L / Math.max(L, S))) + "px"; // the map's aspect
    canvas.style.width = Math.max(8, Math.round(THUMB * S / Math.max(L, S))) + "px";
    paint(canvas.getContext("2d"), 0, 0, w, h, L, S, values, range);
  }

  function gridShape() {
    const layers = state.runs[0].layers, heads = largestOf(layers.map((l) => l.H));
    const uniform = layers.every((l) => l.L === layers[0].L && l.S === layers[0].S && l.H === heads);
    return { layers: layers.length, heads, layerMean: uniform && layers.length > 1 };
  }

  function buildGrid() {
    const grid = $("grid"), shape = gridShape(), layers = state.runs[0].layers;
    grid.replaceChildren();
    grid.style.gridTemplateColumns = `auto repeat(${shape.heads + 1}, auto)`;
    const header = [Object.assign(document.createElement("div"), { className: "label" })];
    for (let h = 0; h < shape.heads; h++) header.push(Object.assign(document.createElement("div"), { className: "label", textContent: "head " + h }));
    header.push(Object.assign(document.createElement("div"), { className: "label", textContent: "mean" }));
    grid.append(...header);
    const rows = layers.length + (shape.layerMean ? 1 : 0);
    state.cells = [];
    for (let l = 0; l < rows; l++) {
      const name = l < layers.length ? layers[l].name : "mean over layers";
      grid.append(Object.assign(document.createElement("div"), { className: "label row-label", textContent: name, title: name }));
      const row = [];
      for (let h = 0; h <= shape.heads; h++) {
        const layer = layers[Math.min(l, layers.length - 1)];
        if (l < layers.length && h < shape.heads && h >= layer.H) { grid.append(document.createElement("div")); row.push(null); continue; }
        const button = document.createElement("button");
        const headIndex = h === shape.heads ? layer.H : h;
        button.type = "button";
        button.className = "cell" + (h === shape.heads || l === layers.length ? " mean" : "");
        button.tabIndex = -1;
        button.dataset.layer = l; button.dataset.head = headIndex;
        button.setAttribute("aria-label", describe(l, headIndex));
        button.append(document.createElement("canvas"));
        button.addEventListener("click", () => open(l, headIndex));
        button.addEventListener("keydown", (event) => moveInGrid(event, l, h));
        grid.append(button);
        row.push(button);
      }
      state.cells.push(row);
    }
    const first = state.cells[0].find((b) => b);
    if (first) first.tabIndex = 0;
    drawGrid();
  }

  // Each map coloured from 0 to its own largest |value| (the legend says so), or all on one scale
  // (the "same scale" box: the largest over the grid)
  function drawGrid() {
    const maps = [];
    let largest = 0;
    for (const row of state.cells) for (const button of row) {
      if (!button) continue;
      const l = +button.dataset.layer, h = +button.dataset.head, layer = state.runs[0].layers[Math.min(l, state.runs[0].layers.length - 1)];
      const values = state.show === "diff" ? diffValues(l, h) : mapValues(state.show, l, h), range = extent(values);
      largest = Math.max(largest, range);
      maps.push([button, layer, values, range]);
    }
    state.shared[String(state.show)] = largest;
    for (const [button, layer, values, range] of maps) thumbnail(button.firstChild, layer.L, layer.S, values, state.sameScale ? largest : range);
    drawLegend(state.sameScale ? largest : null, true);
  }

  // the "same colour scale" range: the largest |value| of every map of the grid in the run shown
  // (or the difference), the grid's and the open head's alike
  function sharedRange() {
    const key = String(state.show);
    if (!(key in state.shared)) {
      let largest = 0;
      for (const row of state.cells) for (const button of row) {
        if (!button) continue;
        const l = +button.dataset.layer, h = +button.dataset.head;
        largest = Math.max(largest, extent(state.show === "diff" ? diffValues(l, h) : mapValues(state.show, l, h)));
      }
      state.shared[key] = largest;
    }
    return state.shared[key];
  }

  function describe(l, h) {
    const layers = state.runs[0].layers;
    const where = l < layers.length ? layers[l].name : "mean over layers";
    return `${where}, ${h < (layers[Math.min(l, layers.length - 1)].H) ? "head " + h : "mean over heads"}`;
  }

  function moveInGrid(event, l, h) {
    const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1], Home: [0, -99], End: [0, 99] };
    const move = moves[event.key];
    if (!move) return;
    event.preventDefault();
    let row = Math.max(0, Math.min(state.cells.length - 1, l + move[0]));
    let col = Math.max(0, Math.min(state.cells[row].length - 1, h + move[1]));
    while (col > 0 && !state.cells[row][col]) col--;
    const target = state.cells[row][col];
    if (!target) return;
    for (const r of state.cells) for (const b of r) if (b) b.tabIndex = -1;
    target.tabIndex = 0;
    target.focus();
    setStatus(describe(+target.dataset.layer, +target.dataset.head) + ": press Enter to open");
  }

  // ---- one head, large ------------------------------------------------------------------------------

  function layout(layer) {
    const ctx = $("map").getContext("2d");
    ctx.font = "12px system-ui, sans-serif";
    // each side on its own (CELL, FIT, MIN_CELL, MAX_SIDE above): a few queries over many keys keep
    // rows of CELL px; square cells while neither side is shrunk
    const fits = (n) => n * MIN_CELL <= MAX_SIDE;
    const fit = (n) => (fits(n) ? Math.max(MIN_CELL, Math.min(CELL, Math.floor(FIT / n))) : MAX_SIDE / n);
    let sizeW = fit(layer.S), sizeH = fit(layer.L);
    if (fits(layer.S) && fits(layer.L)) sizeW = sizeH = Math.min(sizeW, sizeH);
    const width = Math.max(1, Math.round(layer.S * sizeW)), height = Math.max(1, Math.round(layer.L * sizeH));
    const cellW = width / layer.S, cellH = height / layer.L;
    // a label every `rowEvery` rows and `colEvery` columns: 12 px apart at least, no overlap
    const rowEvery = Math.max(1, Math.ceil(12 / cellH)), colEvery = Math.max(1, Math.ceil(12 / cellW));
    const widest = (labels, every) => { // of the labels drawn, clipped
      let w = 20;
      for (let i = 0; i < labels.length; i += every) w = Math.max(w, ctx.measureText(clip(labels[i])).width);
      return Math.min(160, w);
    };
    return { width, height, cellW, cellH, rowEvery, colEvery, left: Math.ceil(widest(layer.queries, rowEvery)) + 10,
             top: Math.ceil(widest(layer.keys, colEvery)) + 10 }; // whole pixels: crisp cells and outlines
  }

  function open(l, h) {
    const layers = state.runs[0].layers, layer = layers[Math.min(l, layers.length - 1)];
    state.open = { layer: l, head: h, cursor: [0, 0], row: null };
    $("grid-view").hidden = true;
    $("head-view").hidden = false;
    $("back").hidden = false;
    const queries = layer.L === 1 ? "1 query" : `${layer.L} queries`, keys = layer.S === 1 ? "1 key" : `${layer.S} keys`;
    $("head-title").textContent = `${describe(l, h)} — ${queries} × ${keys}`;
    drawHead();
    $("breakdown").replaceChildren(Object.assign(document.createElement("p"), { className: "hint",
      textContent: l < layers.length && h < layer.H ? "Select a query row to see its breakdown." : "An average has no breakdown: open one head for it." }));
    $("map").focus();
    setStatus(describe(l, h) + " opened");
  }

  // The open map, with its labels, on the canvas; the selected row's outline and the keyboard
  // cursor's box lie over it (marks(): moving them redraws nothing, and an exported PNG, a copy of
  // the canvas, has neither). Its colour scale: its own largest |value|, or the grid's with "same
  // colour scale".
  function drawHead() {
    const { layer: l } = state.open, canvas = $("map");
    const layers = state.runs[0].layers, layer = layers[Math.min(l, layers.length - 1)];
    const values = openValues().values, range = state.sameScale ? sharedRange() : extent(values), g = layout(layer);
    canvas.width = g.left + g.width + 4;
    canvas.height = g.top + g.height + 4;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "white"; ctx.fillRect(0, 0, canvas.width, canvas.height);
    // one pixel per cell (a block of cells per pixel on a shrunk side), then scaled up unsmoothed
    const w = Math.min(layer.S, g.width), hgt = Math.min(layer.L, g.height);
    const cells = Object.assign(document.createElement("canvas"), { width: w, height: hgt });
    paint(cells.getContext("2d"), 0, 0, w, hgt, layer.L, layer.S, values, range);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(cells, g.left, g.top, g.width, g.height);
    ctx.fillStyle = "#1d1d1f"; ctx.font = "12px system-ui, sans-serif"; ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (let i = 0; i < layer.L; i += g.rowEvery) ctx.fillText(clip(layer.queries[i]), g.left - 6, g.top + (i + 0.5) * g.cellH);
    ctx.save(); ctx.textAlign = "left";
    for (let j = 0; j < layer.S; j += g.colEvery) {
      ctx.save(); ctx.translate(g.left + (j + 0.5) * g.cellW, g.top - 6); ctx.rotate(-Math.PI / 2);
      ctx.fillText(clip(layer.keys[j]), 0, 0); ctx.restore();
    }
    ctx.restore();
    g.range = range;
    state.geometry = g;
    drawLegend(range, state.sameScale);
    marks();
  }

  // the selected row's outline, and the cursor's box while the map has the focus: 2 px frames over
  // the canvas, centred on the cells' edges
  function marks() {
    const g = state.geometry, open = state.open;
    const place = (mark, i, j, w, hgt, shown) => {
      mark.hidden = !shown;
      if (!shown) return;
      Object.assign(mark.style, { left: (g.left + j * g.cellW - 1) + "px", top: (g.top + i * g.cellH - 1) + "px",
                                  width: (Math.max(w, 2) + 2) + "px", height: (Math.max(hgt, 2) + 2) + "px" });
    };
    place($("row-mark"), open ? open.row : 0, 0, g ? g.width : 0, g ? g.cellH : 0, !!(open && g && open.row !== null));
    const [ci, cj] = open ? open.cursor : [0, 0];
    place($("cursor-mark"), ci, cj, g ? g.cellW : 0, g ? g.cellH : 0, !!(open && g && document.activeElement === $("map")));
  }

  // scroll the head view (it scrolls past FIT px) so that cell (i, j) shows
  function reveal(i, j) {
    const wrap = $("map-wrap"), g = state.geometry;
    const x = g.left + j * g.cellW, y = g.top + i * g.cellH, margin = 24;
    if (x < wrap.scrollLeft + g.left) wrap.scrollLeft = Math.max(0, x - g.left);
    else if (x + g.cellW + margin > wrap.scrollLeft + wrap.clientWidth) wrap.scrollLeft = x + g.cellW + margin - wrap.clientWidth;
    if (y < wrap.scrollTop + g.top) wrap.scrollTop = Math.max(0, y - g.top);
    else if (y + g.cellH + margin > wrap.scrollTop + wrap.clientHeight) wrap.scrollTop = y + g.cellH + margin - wrap.clientHeight;
  }

  function clip(text, most = 18) { return text.length > most ? text.slice(0, most - 1) + "…" : text; }

  // A cell's text (the tooltip, and the status line from the keyboard). The map is coloured from the
  // stored 8-bit weights; where q and k were recorded, the text gives the exact weight as the
  // breakdown computes it (its "softmax weight", the same digits) and the stored one beside it, named
  // so; an average, or weights captured without q and k, has only the stored ones, and says so.
  function cellText(i, j) {
    const { layer: l, head: h } = state.open, layers = state.runs[0].layers, layer = layers[Math.min(l, layers.length - 1)];
    const where = `query ${i} “${layer.queries[i]}” → key ${j} “${layer.keys[j]}”`;
    const { runs } = openValues(), n = i * layer.S + j;
    const exact = runs.map((_, r) => exactWeight(r, l, h, i, j)), stored = runs.map((values) => values[n]);
    const average = l >= layers.length || h >= layer.H ? "mean of the " : "";
    if (state.runs.length === 2) {
      const [la, lb] = state.runs.map((run) => run.label);
      if (exact.every((x) => x !== null)) {
        return `${where}: weight ${la} ${fmt(exact[0], 5)}, ${lb} ${fmt(exact[1], 5)}, difference ${fmt(exact[0] - exact[1], 5)}` +
          ` (stored 8-bit weights, as coloured: ${la} ${stored[0].toFixed(5)}, ${lb} ${stored[1].toFixed(5)})`;
      }
      return `${where}: ${average}stored 8-bit weights ${la} ${stored[0].toFixed(5)}, ${lb} ${stored[1].toFixed(5)}, ` +
        `difference ${(stored[0] - stored[1]).toFixed(5)}`;
    }
    if (exact[0] !== null) return `${where}: weight ${fmt(exact[0], 5)} (stored 8-bit weight, as coloured: ${stored[0].toFixed(5)})`;
    return `${where}: ${average}stored 8-bit weight${average ? "s" : ""} ${stored[0].toFixed(5)}` +
      (average ? "" : " (captured without q and k: no exact weight)");
  }

  // the weight of (i, j) as the breakdown computes it from the stored q and k, or null (an average,
  // or weights captured without q and k); a row's weights are kept while the pointer stays on it
  function exactWeight(run, l, h, i, j) {
    const layer = state.runs[run].layers[l];
    if (!layer || h >= layer.H || !layer.detailed) return null;
    const key = [run, l, h, i].join(":");
    if (state.exactRow.key !== key) state.exactRow = { key, weights: breakdown(l, h, i, run).weights };
    return state.exactRow.weights[j];
  }

  function cellAt(event) {
    const g = state.geometry, layer = currentLayer(), rect = $("map").getBoundingClientRect();
    const x = event.clientX - rect.left - g.left, y = event.clientY - rect.top - g.top;
    const i = Math.floor(y / g.cellH), j = Math.floor(x / g.cellW);
    return i >= 0 && j >= 0 && i < layer.L && j < layer.S ? [i, j] : null;
  }

  function currentLayer() { const layers = state.runs[0].layers; return layers[Math.min(state.open.layer, layers.length - 1)]; }

  function showTooltip(i, j) {
    const tip = $("tooltip"), g = state.geometry;
    tip.textContent = cellText(i, j);
    tip.hidden = false;
    // right of the cell, or left of it where the right would pass the view's visible edge
    const wrap = $("map-wrap"), right = g.left + (j + 1) * g.cellW + 8, left = g.left + j * g.cellW - 8 - tip.offsetWidth;
    tip.style.left = (right + tip.offsetWidth > wrap.scrollLeft + wrap.clientWidth && left >= wrap.scrollLeft ? left : right) + "px";
    tip.style.top = (g.top + i * g.cellH) + "px";
  }

  function select(row) {
    const layers = state.runs[0].layers;
    if (!state.open) throw new Error("open a head first");
    const { layer: l, head: h } = state.open;
    if (l >= layers.length || h >= layers[l].H) return null;
    state.open.row = row;
    marks();
    return renderBreakdown(l, h, row);
  }

  // ---- a row's breakdown: the contract's terms, in the contract's order ---------------------------------

  function breakdown(l, h, i, run) {
    const layer = state.runs[run].layers[l];
    if (!layer || h >= layer.H || i >= layer.L) throw new Error(`no head ${h} / row ${i} in layer ${l}`);
    const S = layer.S, stored = Array.from({ length: S }, (_, j) => layer.codes[(h * layer.L + i) * S + j] * layer.scales[h] / 255);
    if (!layer.detailed) return { detailed: false, stored };
    const D = layer.D, Dv = layer.Dv, kvHead = Math.floor(h / (layer.H / layer.Hkv));
    const raw = [], capped = [], alibi = [], additive = [], hidden = [], scores = [];
    for (let j = 0; j < S; j++) {
      let dot = 0;
      for (let d = 0; d < D; d++) dot += layer.q[(h * layer.L + i) * D + d] * layer.k[(kvHead * S + j) * D + d];
      const s0 = dot * Number(layer.scale);
      raw.push(s0);
      const cap = layer.softcap === null ? null : Number(layer.softcap);
      let s = cap !== null ? cap * Math.tanh(s0 / cap) : s0;
      capped.push(s);
      const bias = layer.alibi_slopes ? -Number(layer.alibi_slopes[h]) * Math.abs(layer.k_pos[j] - layer.q_pos[i]) : 0;
      alibi.push(bias);
      s += bias;
      const added = layer.additive ? layer.additive[((layer.additive_heads > 1 ? h : 0) * layer.L + i) * S + j] : 0;
      additive.push(added);
      s += added;
      const by = layer.hidden.filter((term) => {
        const bit = ((term.heads > 1 ? h : 0) * layer.L + i) * S + j;
        return ((term.bits[bit >> 3] >> (bit & 7)) & 1) === 1;
      }).map((term) => term.term);
      hidden.push(by);
      scores.push(by.length ? -Infinity : s);
    }
    const sink = layer.sinks ? Number(layer.sinks[h]) : null;
    // the softmax as mha's math backend takes it: a NaN score makes the row NaN; a row whose every
    // score (and sink) is -inf gets zeros
    let top = largestOf(scores);
    if (sink !== null && sink > top) top = sink;
    const nan = scores.some(Number.isNaN) || Number.isNaN(sink);
    const exps = scores.map((s) => (s === -Infinity ? 0 : Math.exp(s - top)));
    const sinkExp = sink !== null && sink !== -Infinity ? Math.exp(sink - top) : 0;
    let total = sinkExp;
    for (const e of exps) total += e;
    const weights = exps.map((e) => (nan ? NaN : total > 0 && top !== -Infinity ? e / total : 0));
    const sinkWeight = nan ? NaN : sink !== null && total > 0 && top !== -Infinity ? sinkExp / total : 0;
    const sum = new Float64Array(Dv), mass = new Float64Array(Dv), contributions = [];
    for (let j = 0; j < S; j++) {
      let norm = 0;
      for (let d = 0; d < Dv; d++) {
        const c = weights[j] * layer.v[(kvHead * S + j) * Dv + d];
        sum[d] += c; mass[d] += Math.abs(c); norm += c * c;
      }
      contributions.push(Math.sqrt(norm));
    }
    const out = Array.from({ length: Dv }, (_, d) => layer.out[(h * layer.L + i) * Dv + d]);
    // Each output value may differ from the sum here by what rounding explains (rowBound); the row
    // adds up when every one is within its bound
    const bounds = rowBound(layer, h, i, kvHead, hidden, mass, out);
    let maxError = 0, tolerance = 0, addsUp = true;
    for (let d = 0; d < Dv; d++) {
      const error = Math.abs(sum[d] - out[d]);
      maxError = Number.isNaN(error) || Number.isNaN(maxError) ? NaN : Math.max(maxError, error);
      tolerance = Math.max(tolerance, bounds[d]);
      if (!(error <= bounds[d])) addsUp = false;
    }
    return { detailed: true, raw, capped, alibi, additive, hidden, scores, weights, stored, sink, sinkWeight,
             contributions, sum: Array.from(sum), out, maxError, tolerance,
             addsUp: addsUp || (nan && out.some(Number.isNaN)) };
  }

  // How far the real output value d may lie from the sum here, from rounding alone: a score's error
  // (q and k as stored, the products as computed: e x scale x sum |q_d k_d|) moves a weight by twice
  // it relatively; v's storage and the sum's own arithmetic move each term; the output was rounded
  // to the call's dtype. mass[d] = sum over keys of |weight x v_d|.
  function rowBound(layer, h, i, kvHead, hidden, mass, out) {
    const { computed, stored, out: rounding } = layer.eps, D = layer.D, S = layer.S;
    const inputs = Math.max(computed, stored);
    let scoreError = 0;
    for (let j = 0; j < S; j++) {
      if (hidden[j].length) continue;
      let size = 0;
      for (let d = 0; d < D; d++) size += Math.abs(layer.q[(h * layer.L + i) * D + d] * layer.k[(kvHead * S + j) * D + d]);
      scoreError = Math.max(scoreError, 4 * inputs * Math.abs(Number(layer.scale)) * size);
    }
    const relative = 2 * scoreError + 2 * stored + 4 * computed * Math.sqrt(Math.max(S, 1));
    return mass.map((m, d) => relative * m + 2 * rounding * Math.abs(out[d]) + 1e-300);
  }

  function renderBreakdown(l, h, i) { // the row's breakdown, drawn; returns it
    const run = state.show === "diff" ? 0 : state.show, layer = state.runs[run].layers[l], b = breakdown(l, h, i, run);
    const box = $("breakdown");
    box.replaceChildren();
    const title = document.createElement("h3");
    title.textContent = `Query ${i} “${layer.queries[i]}”, ${describe(l, h)}` + (state.runs.length === 2 ? ` — run ${state.runs[run].label}` : "");
    box.append(title);
    if (!b.detailed) {
      box.append(Object.assign(document.createElement("p"), { textContent: "These weights were captured without q, k and v (mha.capture_attention): record the forward with mha.view(model, ...) or mha.explorer.record for the breakdown." }));
    }
    const columns = [["key", (j) => `${j} ${layer.keys[j]}`]];
    if (b.detailed) {
      columns.push(["q·k × scale", (j) => fmt(b.raw[j])]);
      if (layer.softcap !== null) columns.push([`softcap ${layer.softcap}`, (j) => fmt(b.capped[j])]);
      if (layer.alibi_slopes) columns.push(["+ ALiBi", (j) => fmt(b.alibi[j])]);
      if (layer.additive) columns.push(["+ mask", (j) => fmt(b.additive[j])]);
      if (layer.hidden.length) columns.push(["hidden by", (j) => b.hidden[j].join(", ")]);
      columns.push(["score", (j) => fmt(b.scores[j])], ["softmax weight", (j) => fmt(b.weights[j], 5)]);
    }
    columns.push(["stored (8-bit)", (j) => b.stored[j].toFixed(5)]);
    const largest = b.detailed ? largestOf(b.contributions) : 0;
    if (b.detailed) columns.push(["‖weight × v‖", (j) => b.contributions[j].toFixed(4)], ["", (j) => bar(b.contributions[j], largest)]);
    const table = document.createElement("table"), head = table.createTHead().insertRow();
    for (const [name] of columns) head.append(Object.assign(document.createElement("th"), { textContent: name, scope: "col" }));
    const body = table.createTBody();
    for (const j of keysShown(b, layer.S)) {
      const row = body.insertRow();
      for (const [, value] of columns) {
        const cell = row.insertCell(), shown = value(j);
        if (shown instanceof Node) cell.append(shown); else cell.textContent = shown;
        if (b.detailed && b.hidden[j].length) cell.className = "hidden-key";
      }
    }
    if (b.detailed && b.sink !== null) {
      const row = body.insertRow();
      row.insertCell().textContent = "sink (no value)";
      for (let c = 1; c < columns.length; c++) row.insertCell();
      const at = columns.findIndex(([name]) => name === "score");
      row.cells[at].textContent = fmt(b.sink);
      row.cells[at + 1].textContent = fmt(b.sinkWeight, 5);
    }
    if (b.detailed) {
      const check = document.createElement("p");
      check.className = "check" + (b.addsUp ? "" : " bad");
      check.textContent = `Σ weight × v over the keys, computed here, against the head's real output (${layer.Dv} values): ` +
        `largest difference ${b.maxError.toExponential(2)}` + (b.addsUp ? " — the row adds up." : ` — more than rounding explains (up to ${b.tolerance.toExponential(1)}).`) +
        (layer.dropout_p > 0 ? ` Recorded in training mode with dropout ${layer.dropout_p}: the real output used the weights after dropout.` : "") +
        ` First values: ${b.sum.slice(0, 4).map((x) => x.toFixed(4)).join(", ")} (here) and ${b.out.slice(0, 4).map((x) => x.toFixed(4)).join(", ")} (real).`;
      box.append(check);
    }
    if (layer.S > KEY_ROWS) {
      box.append(Object.assign(document.createElement("p"), { className: "hint",
        textContent: `The ${KEY_ROWS} keys of largest weight of ${layer.S}, in key order; the sums above take every key.` }));
    }
    box.append(table);
    return b;
  }

  function keysShown(b, S) { // every key, or the KEY_ROWS of largest weight in key order
    const all = Array.from({ length: S }, (_, j) => j);
    if (S <= KEY_ROWS) return all;
    const weight = b.detailed ? b.weights : b.stored;
    return all.sort((x, y) => (weight[y] || 0) - (weight[x] || 0)).slice(0, KEY_ROWS).sort((x, y) => x - y);
  }

  function fmt(x, digits = 4) { return x === -Infinity ? "−∞" : Number.isNaN(x) ? "NaN" : x.toFixed(digits); }

  function bar(x, largest) {
    const span = document.createElement("span");
    span.className = "bar";
    span.style.width = (largest > 0 ? Math.round(80 * x / largest) : 0) + "px";
    return span;
  }

  // ---- controls ------------------------------------------------------------------------------------

  function showRun(which) {
    state.show = which;
    for (const input of document.querySelectorAll("#runs input")) input.checked = input.value === String(which);
    if (state.open) { drawHead(); if (state.open.row !== null) renderBreakdown(state.open.layer, state.open.head, state.open.row); } else drawGrid();
  }

  function buildRunToggle() {
    if (state.runs.length < 2) return;
    const box = $("runs");
    box.hidden = false;
    const options = [[0, state.runs[0].label], [1, state.runs[1].label], ["diff", `${state.runs[0].label} − ${state.runs[1].label}`]];
    for (const [value, text] of options) {
      const label = document.createElement("label"), input = document.createElement("input");
      input.type = "radio"; input.name = "run"; input.value = String(value); input.checked = value === 0;
      input.addEventListener("change", () => showRun(value));
      label.append(input, " " + text);
      box.append(label);
    }
  }

  function back() {
    if (!state.open) return;
    const { layer, head } = state.open;
    state.open = null;
    $("head-view").hidden = true; $("grid-view").hidden = false; $("back").hidden = true; $("tooltip").hidden = true;
    drawGrid();
    const cell = document.querySelector(`#grid button[data-layer="${layer}"][data-head="${head}"]`);
    if (cell) { for (const b of document.querySelectorAll("#grid button")) b.tabIndex = -1; cell.tabIndex = 0; cell.focus(); }
    setStatus("all heads");
  }

  // The current view as a PNG: a caption (the page's title and notes, what is shown: the call (its
  // module) and head, or all heads; the run; the colour scale), wrapped to the image's width, over
  // the open head's map (the canvas: the cursor's box and the row's outline are not on it), or over
  // the grid with its row and column labels.
  function exportPng() {
    const view = state.open ? $("map") : gridImage();
    const width = Math.max(view.width, 520), pad = 8, lineHeight = 18, font = "13px system-ui, sans-serif";
    const measure = document.createElement("canvas").getContext("2d");
    measure.font = font;
    const shown = state.show === "diff" ? `${state.runs[0].label} − ${state.runs[1].label}` : state.runs[state.show].label;
    const what = state.open ? $("head-title").textContent : "all heads";
    const legend = `colour scale: ${$("legend-low").textContent} … ${$("legend-high").textContent}`;
    const bar = $("legend-bar"), text = width - 2 * pad;
    const lines = [...wrap(measure, $("title").textContent, text), ...state.notes.flatMap((note) => wrap(measure, note, text)),
                   ...wrap(measure, what + (state.runs.length > 1 ? ` — run shown: ${shown}` : ""), text)];
    const legendLines = wrap(measure, legend, text - bar.width - pad);
    const caption = pad + lineHeight * (lines.length + legendLines.length) + pad;
    const canvas = Object.assign(document.createElement("canvas"), { width, height: caption + view.height });
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "white"; ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.fillStyle = "#1d1d1f"; ctx.font = font; ctx.textBaseline = "middle";
    lines.forEach((line, n) => ctx.fillText(line, pad, pad + (n + 0.5) * lineHeight));
    const legendTop = pad + lines.length * lineHeight;
    ctx.drawImage(bar, pad, legendTop + (lineHeight - bar.height) / 2);
    legendLines.forEach((line, n) => ctx.fillText(line, 2 * pad + bar.width, legendTop + (n + 0.5) * lineHeight));
    ctx.drawImage(view, 0, caption);
    const url = canvas.toDataURL("image/png");
    api.lastExport = { width, height: canvas.height, caption: [...lines, ...legendLines], captionHeight: caption, textWidth: text,
                       widths: [...lines, ...legendLines].map((line) => measure.measureText(line).width) };
    const link = Object.assign(document.createElement("a"), { href: url, download: state.open ? `call${state.open.layer}-head${state.open.head}.png` : "attention-grid.png" });
    document.body.append(link); link.click(); link.remove();
    return url;
  }

  // `text` in lines of at most `width` pixels (ctx's font), broken between words (within a word
  // longer than a line)
  function wrap(ctx, text, width) {
    const lines = [];
    let line = "";
    for (const word of text.split(/\s+/).filter(Boolean)) {
      const joined = line ? line + " " + word : word;
      if (ctx.measureText(joined).width <= width) { line = joined; continue; }
      if (line) lines.push(line);
      line = word;
      while (ctx.measureText(line).width > width && line.length > 1) {
        let cut = line.length - 1;
        while (cut > 1 && ctx.measureText(line.slice(0, cut)).width > width) cut--;
        lines.push(line.slice(0, cut));
        line = line.slice(cut);
      }
    }
    if (line) lines.push(line);
    return lines;
  }

  function gridImage() { // the grid's maps, with its row and column labels
    const cells = state.cells, labelWidth = 190, size = THUMB + 6, top = 18;
    const canvas = Object.assign(document.createElement("canvas"), { width: labelWidth + size * cells[0].length, height: top + size * cells.length });
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "white"; ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.fillStyle = "#1d1d1f"; ctx.font = "11px system-ui, sans-serif"; ctx.textBaseline = "middle"; ctx.textAlign = "center";
    document.querySelectorAll("#grid > .label:not(.row-label)").forEach((label, c) => {
      if (c > 0) ctx.fillText(label.textContent, labelWidth + (c - 1) * size + THUMB / 2, top / 2);
    });
    ctx.textAlign = "left"; ctx.imageSmoothingEnabled = false;
    cells.forEach((row, r) => row.forEach((button, c) => {
      if (!button) return;
      const thumb = button.firstChild;
      ctx.drawImage(thumb, labelWidth + c * size, top + r * size, parseInt(thumb.style.width), parseInt(thumb.style.height));
    }));
    document.querySelectorAll("#grid .row-label").forEach((label, r) => ctx.fillText(clip(label.textContent, 30), 4, top + r * size + THUMB / 2));
    return canvas;
  }

  function setStatus(text) { $("status").textContent = text; }

  function wireHeadView() {
    const canvas = $("map");
    canvas.addEventListener("mousemove", (event) => { const at = cellAt(event); if (at) showTooltip(...at); else $("tooltip").hidden = true; });
    canvas.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
    canvas.addEventListener("click", (event) => { const at = cellAt(event); if (at) { state.open.cursor = at; select(at[0]); } });
    canvas.addEventListener("focus", marks);
    canvas.addEventListener("blur", marks);
    canvas.addEventListener("keydown", (event) => {
      if (!state.open) return;
      const layer = currentLayer(), page = Math.max(1, Math.round(layer.L / 10));
      const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1], PageUp: [-page, 0],
                      PageDown: [page, 0], Home: [0, -layer.S], End: [0, layer.S] };
      if (moves[event.key]) {
        event.preventDefault();
        const [i, j] = state.open.cursor, [di, dj] = moves[event.key];
        state.open.cursor = [Math.max(0, Math.min(layer.L - 1, i + di)), Math.max(0, Math.min(layer.S - 1, j + dj))];
        marks(); reveal(...state.open.cursor); showTooltip(...state.open.cursor); setStatus(cellText(...state.open.cursor));
      } else if (event.key === "Enter" || event.key === " ") { event.preventDefault(); select(state.open.cursor[0]); }
    });
    document.addEventListener("keydown", (event) => { if (event.key === "Escape") back(); });
    $("back").addEventListener("click", back);
    $("export").addEventListener("click", exportPng);
    $("same-scale").addEventListener("change", (event) => { state.sameScale = event.target.checked; if (state.open) drawHead(); else drawGrid(); });
  }

  const timings = {}; // ms per loading step, for mhaView.timings
  const state = { runs: [], show: 0, open: null, cached: {}, cells: [], geometry: null, precision: "float32", sameScale: false,
                  shared: {}, exactRow: {}, notes: [] };

  async function start() {
    const started = performance.now();
    try {
      const manifest = JSON.parse($("mha-manifest").textContent);
      const bytes = await inflate($("mha-data").textContent);
      state.precision = manifest.precision;
      state.notes = manifest.notes || [];
      for (const note of state.notes) $("notes").append(Object.assign(document.createElement("p"), { className: "note", textContent: note }));
      $("notes").hidden = state.notes.length === 0;
      state.runs = manifest.runs.map((run) => ({ label: run.label, layers: run.layers.map((entry) => layerOf(entry, bytes.buffer)) }));
      buildRunToggle();
      let mark = performance.now();
      buildGrid();
      timings.grid = performance.now() - mark;
      wireHeadView();
      const layers = state.runs[0].layers, skipped = layers.reduce((n, l) => n + l.nonfinite, 0);
      setStatus(`${layers.length} attention call${layers.length > 1 ? "s" : ""} × up to ${gridShape().heads} heads` +
        (state.runs.length > 1 ? `, two runs (${state.runs.map((r) => r.label).join(", ")})` : "") +
        (skipped ? `; ${skipped} non-finite weights shown as 0` : "") +
        (layers.some((l) => l.dropout_p > 0) ? "; recorded in training mode: weights after dropout" : "") + `. Ready in ${Math.round(performance.now() - started)} ms.`);
      Object.assign(api, {
        state, timings, ready: true, readyMs: performance.now() - started, layers: layers.length, heads: gridShape().heads,
        weight: (run, l, h, i, j) => { const layer = state.runs[run].layers[l]; return layer.codes[(h * layer.L + i) * layer.S + j] * layer.scales[h] / 255; },
        breakdown: (l, h, i, run = 0) => breakdown(l, h, i, run),
        open, select, showRun, back, exportPng,
      });
      document.body.dataset.ready = "true";
    } catch (error) {
      api.error = String(error && error.stack || error);
      $("status").textContent = "The page could not load its data: " + error;
      $("status").className = "error";
      console.error(error);
    }
  }

  start();
})();
