// AttentionView: a figure of fixed layout (geometry from Python): the heatmap in three key groups (raw | compressed |
// sink) with axes, each query's mass as a stacked bar, a colour bar and a legend; small multiples of every captured
// head beside it, in a column as tall as the figure (scrolled where there are more), the figure shrunk for them down
// to MIN_SCALE; with less room under it, in one row scrolled sideways (so the figure, its key and the heads fit a
// laptop's screen). Without the heads beside, the figure is drawn at the output's width (never wider than its
// layout, never narrower than MIN_SCALE of it; narrower outputs scroll it sideways): nothing is cut off.
// Drag on the heatmap to zoom (Python re-reduces the region), double-click to reset; click a head to show it.
// a weight's ramp in each key group, white -> the group's colour -> its darkest (reduce.RAMPS): blue raw, green
// compressed, grey the sink, as the mass bars and the KV view colour them
const STOPS = { raw: [[255, 255, 255], [49, 130, 189], [8, 48, 107]], comp: [[255, 255, 255], [49, 163, 84], [0, 68, 27]],
  sink: [[255, 255, 255], [82, 82, 82], [0, 0, 0]] };
function ramp(v, [lo, mid, hi]) {
  const t = v / 255;
  const [a, b, u] = t < 0.5 ? [lo, mid, t * 2] : [mid, hi, t * 2 - 1];
  return [0, 1, 2].map((i) => Math.round(a[i] + (b[i] - a[i]) * u));
}
const RAMP = Object.fromEntries(Object.entries(STOPS).map(([g, s]) => [g, Array.from({ length: 256 }, (_, v) => ramp(v, s))]));
// weight 0, by why: attention_figure.MASKED, NOT_YET, DROPPED (the MaskView's colours of the same categories)
const MASKED = [217, 217, 217], NOT_YET = [255, 255, 204], DROPPED = [252, 187, 161];
// [colour, mark, text]: the legend lists those of the figure shown (a layer without an indexer drops none)
const ZERO_KEY = [[MASKED, 2, "weight 0 (masked)"], [NOT_YET, 3, "not yet compressed"], [DROPPED, 1, "dropped by the indexer"]];
// an opaque colour as one pixel of a Uint32Array over ImageData (bytes R, G, B, A in memory: little-endian)
const rgba = ([r, g, b]) => ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;
const RAMP32 = Object.fromEntries(Object.entries(RAMP).map(([g, r]) => [g, Uint32Array.from(r, rgba)]));
const MARK32 = [null, rgba(DROPPED), rgba(MASKED), rgba(NOT_YET)];  // by mark: attention_figure.MARK_*
const GROUP = { raw: "rgb(49,130,189)", comp: "rgb(49,163,84)", sink: "rgb(82,82,82)" };  // attention_figure.GROUP_COLOURS
const MASS_KEY = [["raw", "raw window"], ["comp", "compressed"], ["sink", "sink"]];  // attention_figure.MASS_KEY
const STRIPE_NAMES = { raw: "raw", comp: "compressed", sink: "sink" };  // attention_figure.STRIPE_NAMES
const SHORT_NAMES = { raw: "raw", comp: "comp", sink: "sink" };  // attention_figure.SHORT
const STRIPE_NAME_GAP = 8;  // attention_figure.STRIPE_NAME_GAP
// the smallest scale of the figure: its text stays legible and a cell (MIN_CELL = 3 px) keeps at least 2 px
const MIN_SCALE = 0.8;
// the heads beside the figure: one column at least (a thumbnail, its padding and border, a scroll bar), BODY_GAP px
// from the figure (views.css), which shrinks for them to MIN_SCALE at most (at 1400 px beside the file browser an
// output of 955-970 px: 0.85-0.86; at 1280 px, 850 px, the heads go under)
const HEADS_COL = 136, BODY_GAP = 16;
const bytes = (dv) => (dv ? new Uint8Array(dv.buffer, dv.byteOffset, dv.byteLength) : new Uint8Array());
const floats = (dv) => (dv ? new Float32Array(dv.buffer.slice(dv.byteOffset, dv.byteOffset + dv.byteLength)) : new Float32Array());
const fmt = (v) => (v === 0 ? "0" : v < 1e-3 ? v.toExponential(2) : v.toPrecision(3));
// the index i with edges[i] <= p < edges[i + 1], or -1
function find(edges, p) {
  let lo = 0, hi = edges.length - 2;
  if (hi < 0 || p < edges[0] || p >= edges[hi + 1]) return -1;
  while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (edges[mid] <= p) lo = mid; else hi = mid - 1; }
  return lo;
}

function render({ model, el }) {
  el.classList.add("ds4-view", "ds4-att");
  const title = document.createElement("div"); title.className = "ds4-title";
  const body = document.createElement("div"); body.className = "ds4-att-body";
  const heads = document.createElement("div"); heads.className = "ds4-att-heads";
  const caption = document.createElement("div"); caption.className = "ds4-att-caption";
  caption.textContent = "heads captured: click to show";
  const strip = document.createElement("div"); strip.className = "ds4-att-strip";
  heads.append(caption, strip);
  const stage = document.createElement("div"); stage.className = "ds4-att-stage";
  const canvas = document.createElement("canvas"), off = document.createElement("canvas");
  const sel = document.createElement("div"); sel.className = "ds4-att-sel";
  const tip = document.createElement("div"); tip.className = "ds4-hovertip";  // beside the pointer (placeTip)
  stage.append(canvas, sel, tip);
  // the note (cells, pooling, how to zoom) under the figure it is about, wherever the heads go
  const note = document.createElement("div"); note.className = "ds4-note";
  const fig = document.createElement("div"); fig.className = "ds4-att-fig";
  fig.append(stage, note);
  body.append(fig, heads);
  el.append(title, body);
  let pointer = null, drag = null;  // the last pointer position on the canvas (figure px); a drag's first cell
  let scale = 1, beside = true;  // CSS px per figure px; whether the heads are beside the figure
  // the figure's scale and the heads' place at the view's width (the output's): beside where the figure keeps
  // MIN_SCALE, else under it with the figure filling the width, within [MIN_SCALE, 1]
  const fit = () => {
    const w = el.clientWidth, g = model.get("geometry");
    if (!(w > 0 && g.width)) return { scale, beside };
    const s = Math.min(1, (w - BODY_GAP - HEADS_COL) / g.width);
    return s >= MIN_SCALE ? { scale: s, beside: true } : { scale: Math.max(MIN_SCALE, Math.min(1, w / g.width)), beside: false };
  };

  const drawHeads = () => {
    const [tr, tc] = model.get("thumb_shape"), hs = model.get("thumb_heads"), buf = bytes(model.get("thumbs"));
    strip.replaceChildren();
    hs.forEach((h, k) => {
      const box = document.createElement("div"); box.className = "ds4-att-head" + (h === model.get("head") ? " ds4-sel" : "");
      box.dataset.head = h; box.title = `show head ${h}`;
      const c = document.createElement("canvas"); c.width = tc; c.height = tr;
      const img = c.getContext("2d").createImageData(tc, tr);
      const o = k * tr * tc * 3;  // RGB from Python, masked cells grey as in the heatmap
      for (let i = 0; i < tr * tc; i++) img.data.set([buf[o + 3 * i], buf[o + 3 * i + 1], buf[o + 3 * i + 2], 255], i * 4);
      c.getContext("2d").putImageData(img, 0, 0);
      const label = document.createElement("div"); label.textContent = `head ${h}`;
      box.append(c, label);
      strip.append(box);
    });
  };

  const draw = () => {
    const g = model.get("geometry"), rows = model.get("rows"), cols = model.get("cols");
    const buf = bytes(model.get("buf")), marks = bytes(model.get("marks"));
    const ye = model.get("row_edges"), xe = model.get("col_edges");
    title.textContent = model.get("title");
    note.textContent = model.get("note");
    // the backing store at the size shown (× the device's pixel ratio): crisp at any scale
    ({ scale, beside } = fit());
    body.classList.toggle("ds4-att-under", !beside);
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(g.width * scale * dpr); canvas.height = Math.round(g.height * scale * dpr);
    canvas.style.width = `${g.width * scale}px`; canvas.style.height = `${g.height * scale}px`;
    fig.style.width = canvas.style.width;  // a long note wraps under the figure rather than widen it
    heads.style.maxHeight = beside ? canvas.style.height : "";  // a column no taller than the figure
    const ctx = canvas.getContext("2d");
    const k = canvas.width / g.width;
    ctx.setTransform(k, 0, 0, k, 0, 0);
    // a rectangle (figure px) with its edges on device pixels: at any scale adjacent ones tile without seams, and a
    // line stays sharp (a 1 px line drawn at 0.86 was a blur of two light columns), its thickness (2 px or less)
    // rounded by itself, at least one device pixel, so that every line of a kind is as thick wherever it falls
    const span = (p, s, line) => {
      const a = Math.round(p * k);
      return [a, line && s <= 2 ? Math.max(1, Math.round(s * k)) : Math.round((p + s) * k) - a];
    };
    const rect = (x, y, w, h, line = false) => {
      const [a, wd] = span(x, w, line), [b, ht] = span(y, h, line);
      ctx.save(); ctx.setTransform(1, 0, 0, 1, 0, 0); ctx.fillRect(a, b, wd, ht); ctx.restore();
    };
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, g.width, g.height);
    const L = g.left, T = g.top;
    // the heatmap pixel by pixel: the cell under each column and row of pixels, its colour from a table
    const colOf = new Int32Array(g.hw).fill(-1);
    xe.forEach(([a, b], c) => colOf.fill(c, a, b));
    const heat = new ImageData(g.hw, g.hh), px = new Uint32Array(heat.data.buffer);
    const white = rgba([255, 255, 255]), colours = new Uint32Array(rows * cols);
    const groups = model.get("groups"), ramps = new Array(cols).fill(RAMP32.raw);  // each column's group's ramp
    for (const grp of groups) ramps.fill(RAMP32[grp.name], grp.start, grp.stop);
    for (let i = 0; i < rows * cols; i++) colours[i] = marks[i] ? MARK32[marks[i]] : ramps[i % cols][buf[i]];
    for (let r = 0; r < rows; r++) {
      for (let y = ye[r]; y < ye[r + 1]; y++) {
        const o = y * g.hw, base = r * cols;
        for (let x = 0; x < g.hw; x++) px[o + x] = colOf[x] < 0 ? white : colours[base + colOf[x]];
      }
    }
    off.width = g.hw; off.height = g.hh;
    off.getContext("2d").putImageData(heat, 0, 0);
    ctx.imageSmoothingEnabled = false;
    // the heatmap's edges on device pixels too, as its frame's
    const [hx, hw] = span(L, g.hw, false), [hy, hh] = span(T, g.hh, false);
    ctx.save(); ctx.setTransform(1, 0, 0, 1, 0, 0); ctx.drawImage(off, hx, hy, hw, hh); ctx.restore();
    ctx.font = "11px ui-monospace, Menlo, Consolas, monospace";
    ctx.textBaseline = "middle";
    const headed = groups.filter((grp) => grp.label);
    for (const grp of groups) {
      const [x0, w] = [L + grp.x0 - 1, grp.x1 - grp.x0 + 2];  // its frame, one pixel outside its cells
      ctx.fillStyle = "#888";
      rect(x0, T - 1, w, 1, true); rect(x0, T + g.hh, w, 1, true);
      rect(x0, T - 1, 1, g.hh + 2, true); rect(x0 + w - 1, T - 1, 1, g.hh + 2, true);
      ctx.fillStyle = GROUP[grp.name]; rect(L + grp.x0, T - 6, grp.x1 - grp.x0, 2, true);
      // the header where Python put it (attention_figure.place_headers): one line, none overlapping
      ctx.fillStyle = "#222"; ctx.textAlign = "center"; ctx.fillText(grp.label, L + grp.label_x, 22);
    }
    // a thin line in the middle of the gap between two close headers (attention_figure.separators, at this font's
    // width): two labels, not one phrase ("comp sink")
    const half = (grp) => ctx.measureText(grp.label).width / 2, [s0, s1] = g.sep_y;
    ctx.fillStyle = "#888";
    headed.forEach((a, i) => {
      const b = headed[i + 1];
      if (a.sep && b) rect(L + Math.round((a.label_x + half(a) + b.label_x - half(b)) / 2), s0, 1, s1 - s0, true);
    });
    ctx.fillStyle = "#222";
    for (const [x, text] of model.get("xticks")) {
      rect(L + x, T + g.hh + 1, 1, 3, true);
      ctx.save(); ctx.translate(L + x, T + g.hh + 6); ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "right"; ctx.fillText(text, 0, 0); ctx.restore();
    }
    ctx.textAlign = "right";
    for (const [y, text] of model.get("yticks")) { rect(L - 4, T + y, 3, 1, true); ctx.fillText(text, L - 6, T + y); }
    ctx.textAlign = "left"; ctx.fillStyle = "#777"; ctx.fillText(model.get("y_title"), 4, T - 9);
    // each query's mass, raw | compressed | sink (their colours in the legend); its title grey as the query axis'
    // one, apart from the group headers on its line
    ctx.fillText("mass of query", g.mass_x, 9); ctx.fillText("by key group", g.mass_x, 22);
    model.get("mass").forEach((m, r) => {
      const total = m[0] + m[1] + m[2] || 1;
      let x = g.mass_x;
      ["raw", "comp", "sink"].forEach((name, k) => {
        const w = (m[k] / total) * g.mass_w;
        ctx.fillStyle = GROUP[name]; rect(x, T + ye[r], w, ye[r + 1] - ye[r]); x += w;
      });
    });
    // the colour bar and the legend
    const ly = g.legend_y + 4, mid = ly + 10;
    // the raw and compressed ramps one above the other where both are shown, 4 px apart and each named on its left
    // (touching, they read as one ramp): attention_figure.ramp_stripes, BAR_H 20
    const shown = ["raw", "comp"].filter((n) => groups.some((grp) => grp.name === n));
    const stripes = shown.length === 2 ? [["raw", 0, 8], ["comp", 12, 20]] : [[shown[0] || (groups.length ? "sink" : "raw"), 0, 20]];
    for (const [name, y0, y1] of stripes) {
      for (let v = 0; v < 256; v++) { const [R, G, B] = RAMP[name][v]; ctx.fillStyle = `rgb(${R},${G},${B})`; rect(L + v, ly + y0, 1, y1 - y0); }
    }
    ctx.fillStyle = "#222"; ctx.textAlign = "right"; ctx.fillText(model.get("lo_text"), L - 6, mid);
    if (stripes.length === 2) {  // each named left of the scale's low end, short where the full name has no room
      const right = L - 6 - ctx.measureText(model.get("lo_text")).width - STRIPE_NAME_GAP;  // attention_figure.stripe_name
      const name = (n) => (ctx.measureText(STRIPE_NAMES[n]).width <= right - 4 ? STRIPE_NAMES[n] : SHORT_NAMES[n]);
      for (const [n, y0, y1] of stripes) ctx.fillText(name(n), right, ly + (y0 + y1) / 2);
    }
    ctx.textAlign = "left"; ctx.fillText(model.get("hi_text"), L + 262, mid);
    ctx.fillText(model.get("scale_text"), L + 262 + ctx.measureText(model.get("hi_text")).width + 12, mid);
    let x = L;
    const present = new Set(bytes(model.get("marks")));
    for (const [c, mark, text] of ZERO_KEY) {
      if (!present.has(mark)) continue;
      ctx.fillStyle = `rgb(${c})`; ctx.fillRect(x, ly + 26, 12, 8);
      ctx.fillStyle = "#222"; ctx.fillText(text, x + 16, ly + 30); x += 16 + ctx.measureText(text).width + 18;
    }
    // the key of the groups' colours: a cell's ramp and each query's mass bar (attention_figure.GROUPS_KEY)
    ctx.fillStyle = "#222"; ctx.fillText("cells, bars:", x, ly + 30); x += ctx.measureText("cells, bars:").width + 8;
    const mass = model.get("mass");  // keyed only where some query's bar has it (a layer without compressed rows)
    MASS_KEY.forEach(([name, text], i) => {
      if (!mass.some((m) => m[i] > 0)) return;
      ctx.fillStyle = GROUP[name]; ctx.fillRect(x, ly + 26, 12, 8);
      ctx.fillStyle = "#222"; ctx.fillText(text, x + 16, ly + 30); x += 16 + ctx.measureText(text).width + 14;
    });
    drawHeads();
    describe();  // the tooltip follows the figure: what is under the pointer now
  };

  // what is under a figure position: {r, c} in the heatmap, {r, mass: true} on a mass bar, or null
  const cellAt = (p) => {
    const g = model.get("geometry"), ye = model.get("row_edges");
    const r = find(ye, p.y - g.top);
    if (r < 0) return null;
    if (p.x >= g.mass_x && p.x < g.mass_x + g.mass_w) return { r, mass: true };
    const x = p.x - g.left, c = model.get("col_edges").findIndex(([a, b]) => a <= x && x < b);
    return c < 0 ? null : { r, c };
  };
  const describe = () => {
    const at = !drag && pointer && cellAt(pointer);  // none while a zoom is dragged: it covered the region
    tip.style.display = at ? "block" : "none";
    if (!at) return;
    const m = model.get("mass")[at.r], rl = model.get("row_labels")[at.r];
    const split = `mass raw ${fmt(m[0])} | compressed ${fmt(m[1])} | sink ${fmt(m[2])}`;
    const where = `layer ${model.get("layer")} head ${model.get("head")} · ${rl}`;
    if (at.mass) tip.textContent = `${where}: ${split}`;
    else {
      const i = at.r * model.get("cols") + at.c, marks = bytes(model.get("marks"));
      const v = floats(model.get("values"))[i];
      const state = ["", " (dropped by the indexer)", " (masked)", " (not yet compressed)"][marks[i]] ?? "";
      tip.textContent = `${where} → ${model.get("col_labels")[at.c]}: weight ${fmt(v)}${state} · ${split}`;
    }
    const c = canvas.getBoundingClientRect();
    placeTip(tip, c.left + pointer.x * scale, c.top + pointer.y * scale);
  };
  const pos = (ev) => {
    const rect = canvas.getBoundingClientRect(), g = model.get("geometry");
    return { x: ((ev.clientX - rect.left) / rect.width) * g.width, y: ((ev.clientY - rect.top) / rect.height) * g.height };
  };
  const move = (ev) => {
    pointer = pos(ev);
    describe();
    if (drag) {
      const g = model.get("geometry"), rect = canvas.getBoundingClientRect(), k = rect.width / g.width;
      const [x0, x1] = [Math.min(drag.p.x, pointer.x), Math.max(drag.p.x, pointer.x)];
      const [y0, y1] = [Math.min(drag.p.y, pointer.y), Math.max(drag.p.y, pointer.y)];
      Object.assign(sel.style, { display: "block", left: `${x0 * k}px`, top: `${y0 * k}px`, width: `${(x1 - x0) * k}px`,
                                 height: `${(y1 - y0) * k}px` });
    }
  };
  const leave = () => { pointer = null; describe(); };
  const down = (ev) => {
    const p = pos(ev), at = cellAt(p);
    if (at && !at.mass) { drag = { p, at }; ev.preventDefault(); }
  };
  const up = (ev) => {
    if (!drag) return;
    const at = cellAt(pos(ev)), first = drag.at;
    drag = null; sel.style.display = "none";
    describe();  // the tooltip again, where the pointer is
    if (!at || at.mass || (at.r === first.r && at.c === first.c)) return;  // a click, not a region
    model.set("zoom_request", [Math.min(first.r, at.r), Math.max(first.r, at.r), Math.min(first.c, at.c), Math.max(first.c, at.c)]);
    model.save_changes();
  };
  const reset = () => { model.set("zoom_request", [-1]); model.save_changes(); };
  // one listener for the head pictures, whichever are drawn: a click picks the head of the box it lands in
  const pick = (ev) => {
    const box = ev.target.closest(".ds4-att-head");
    if (box) { model.set("pick_head", +box.dataset.head); model.save_changes(); }
  };
  // a change of state arrives as several trait changes: draw once, at the next frame
  let frame = null;
  const schedule = () => { if (frame === null) frame = requestAnimationFrame(() => { frame = null; draw(); }); };
  // the view is rendered before it is attached (no width yet), and the output's width changes with the window and
  // the side panels: redraw at the scale that fits
  const resized = new ResizeObserver(() => {
    const f = fit();
    if (f.scale !== scale || f.beside !== beside) schedule();
  });
  resized.observe(el);
  draw();
  const events = ["buf", "marks", "values", "rows", "cols", "groups", "title", "note", "mass", "thumbs", "head", "layer"]
    .map((k) => `change:${k}`);
  for (const e of events) model.on(e, schedule);
  canvas.addEventListener("mousemove", move);
  canvas.addEventListener("mouseleave", leave);
  canvas.addEventListener("mousedown", down);
  window.addEventListener("mouseup", up);
  canvas.addEventListener("dblclick", reset);
  heads.addEventListener("click", pick);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, schedule);
    canvas.removeEventListener("mousemove", move);
    canvas.removeEventListener("mouseleave", leave);
    canvas.removeEventListener("mousedown", down);
    window.removeEventListener("mouseup", up);
    canvas.removeEventListener("dblclick", reset);
    heads.removeEventListener("click", pick);
    resized.disconnect();
    if (frame !== null) cancelAnimationFrame(frame);
  };
}
export default { render };
