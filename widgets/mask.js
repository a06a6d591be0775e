// MaskView: which keys each query of one step sees. Queries down (positions), keys across in four groups:
// raw rows cached by earlier steps | the step's own rows | compressed rows | sink; a cell's colour is its category.
const bytes = (dv) => (dv ? new Uint8Array(dv.buffer, dv.byteOffset, dv.byteLength) : new Uint8Array());
const L = 44, T = 30, B = 34, GAP = 4;  // margins: query labels, group headers, key labels; gap between groups
function layout(model) {
  const nr = model.get("raw_positions").length, nc = model.get("n_comp"), own = model.get("n_own");
  const Q = model.get("n_queries"), N = nr + nc + 1;
  // the masks planned for (a stepper's, as [cached, own, compressed, queries]): cells sized for the most columns
  // and the most queries, so every mask of the plan is drawn at one scale (a decode step's row: 28 px)
  const plan = model.get("plan"), P = Math.max(N, ...plan.map(([c, o, k]) => c + o + k + 1));
  const PQ = Math.max(Q, ...plan.map((p) => p[3]));
  const [keysPx, queriesPx] = model.get("size_px");  // the cells' room (mask_view.SIZE_PX, or a PrefillView's)
  const cw = Math.max(2, Math.min(8, Math.floor(keysPx / P)));
  const rh = Math.max(3, Math.min(PQ <= 2 ? 28 : 14, Math.floor(queriesPx / Math.max(PQ, 1))));
  // a few compressed rows, or a step's few own rows (a decode step's one), get columns few_px wide at least
  // (mask_view.FEW_MAX_PX, as the fallback's image): they can be found, told apart and hovered
  const few = model.get("few_px"), widen = (n) => (n * few <= model.get("few_max_px") ? Math.max(cw, few) : cw);
  // a compressed column's width, an own row's, the sink's (as wide as the AttentionView's, so it can be found)
  const ccw = widen(nc), ocw = widen(own), scw = Math.max(cw, model.get("sink_px"));
  // header of each group: its names, longest first (draw() takes the longest that fits)
  const groups = [[["cached by earlier steps", "cached"], 0, nr - own], [["this step's own rows", "own"], nr - own, nr],
                  [["compressed", "comp"], nr, nr + nc], [["sink"], nr + nc, N]];
  // x and width of column c: groups separated by a gap
  const gi = (c) => (c < nr - own ? 0 : c < nr ? 1 : c < nr + nc ? 2 : 3);
  const clamp = (v, hi) => Math.max(0, Math.min(v, hi));
  const x = (c) => L + gi(c) * GAP + Math.min(c, nr - own) * cw + clamp(c - (nr - own), own) * ocw +
    clamp(c - nr, nc) * ccw;
  const w = (c) => [cw, ocw, ccw, scw][gi(c)];
  // the image as wide as the widest mask planned (with its widened columns): a smaller one blank on its right
  const span = ([c, o, k]) => L + 3 * GAP + c * cw + o * widen(o) + k * widen(k) + scw;
  const drawn = x(N - 1) + scw, W = Math.max(drawn, ...plan.map(span)) + 24;
  return { nr, nc, own, Q, N, cw, ccw, rh, groups, gi, x, w, drawn, W, H: T + PQ * rh + B };
}
function reason(model, q, c, cat, g) {
  const pos = model.get("raw_positions"), w = model.get("window"), R = model.get("ratio"), k = model.get("top_k");
  const qp = model.get("pos0") + q;
  if (c < g.nr) {
    const p = pos[c], slot = model.get("raw_slots")[c];
    const what = `key position ${p} (ring slot ${slot}, ${p < model.get("pos0") ? "cached by an earlier step" : "written by this step"})`;
    // the raw window of query qp: positions qp − w + 1 … qp, none below 0
    const lo = Math.max(0, qp - w + 1), win = lo > 0 ? `positions ${lo}–${qp}, the last ${w}` : `positions 0–${qp}, all so far`;
    const why = [`not seen: ${p} comes after ${qp} (future)`, `not seen: outside the raw window (${win}; ${p} < ${lo})`,
                 `seen: in the raw window (${win})`, `seen: in the raw window (${win})`][cat];
    return `query ${qp} × ${what}: ${why}`;
  }
  if (c < g.nr + g.nc) {
    const r = c - g.nr, a = Math.max(0, r * R - (R === 4 ? 4 : 0)), b = r * R + R - 1;
    const what = `compressed row ${r} (pools tokens ${a}–${b}; made when token ${b} arrives)`;
    // how many compressed rows this query sees: the indexer chooses only among more than its top k
    const row = bytes(model.get("cells")).subarray(q * g.N + g.nr, q * g.N + g.nr + g.nc);
    const seen = row.filter((v) => v >= 5 && v <= 7).length;
    const kept = !k ? "seen (no indexer on this layer: every closed group's row)" : seen > k ? "seen: kept by the indexer" :
      `seen: ${plural(seen, "visible row")}, no more than the indexer's top ${k}, so it keeps them all`;
    const why = { 4: `not yet compressed: its group ends at ${b} > ${qp}`, 5: kept,
                  6: `dropped by the indexer (it keeps its top ${k})`, 7: `visible; the indexer keeps ${k} of them (capture indexer.topk to see which)` }[cat];
    return `query ${qp} × ${what}: ${why}`;
  }
  return `query ${qp} × sink: a per-head logit that takes attention mass and carries no value`;
}
function render({ model, el }) {
  el.classList.add("ds4-view", "ds4-mask");
  const title = document.createElement("div"); title.className = "ds4-title";
  // drawn off-page and shown as an image: the page's only canvases stay the AttentionView's
  const canvas = document.createElement("canvas"), img = document.createElement("img");
  img.className = "ds4-maskimg"; img.alt = "mask";
  const hint = document.createElement("div"); hint.className = "ds4-tip";
  hint.textContent = "hover a cell: query, key, and why it is seen or not";
  const legend = document.createElement("div"); legend.className = "ds4-legend";
  el.append(title, img, hint, legend);
  let size = [0, 0];  // the image's layout px (its pixels are these times the device's pixel ratio)
  const draw = () => {
    const g = layout(model), cells = bytes(model.get("cells")), col = model.get("colours"), cats = model.get("categories");
    const p0 = model.get("pos0");
    title.textContent = `What each query sees — layer ${model.get("layer")}` + (model.get("label") ? `, ${model.get("label")}` : "") +
      ` · raw window ${model.get("window")}` + (g.nc || model.get("ratio") ? `, ratio ${model.get("ratio")}` : ", raw only") +
      (model.get("top_k") ? `, indexer top ${model.get("top_k")}` : "");
    // the key axis' title under the columns drawn (from the left margin where they are narrower than it): the image
    // is wide enough for it
    const ctx = canvas.getContext("2d");
    ctx.font = "11px sans-serif";
    const tw = ctx.measureText(model.get("x_title")).width, titleX = Math.max(L + tw / 2, (L + g.drawn) / 2);
    const W = Math.max(g.W, Math.ceil(titleX + tw / 2) + 4);
    // the image at the screen's pixel density, shown at W x H px (at 1 px a CSS px it was soft on a 2x screen)
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(W * dpr); canvas.height = Math.round(g.H * dpr);  // (resizing resets the context)
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, W, g.H);
    size = [W, g.H];
    const counts = new Array(cats.length).fill(0);
    for (let q = 0; q < g.Q; q++) for (let c = 0; c < g.N; c++) {
      const cat = cells[q * g.N + c]; counts[cat]++;
      // a widened column (compressed, or a step's own) ends in a white hairline: two of one colour stay apart
      ctx.fillStyle = col[cat]; ctx.fillRect(g.x(c), T + q * g.rh, g.w(c) - (g.w(c) > g.cw), g.rh);
    }
    ctx.fillStyle = "#333"; ctx.font = "11px sans-serif"; ctx.textBaseline = "middle";
    // group headers: the longest name that fits before the next group's column (the sink's to the image's edge); a
    // group too narrow for any (one compressed row) gets its shortest on a second line, running past its column
    // a header ending close to the next group's column: the next header starts 12 px past it, a thin line in the
    // middle (a decode step's "own" and "compressed" read as one phrase), as the AttentionView separates its own
    let from = 0, sep = null;  // where the next header on the first line may start; the line before it
    for (const [names, a, b] of g.groups) if (b > a) {
      const x = Math.max(g.x(a), from);
      const room = b === g.N ? W - x : g.x(b) - 2 - x, name = names.find((s) => ctx.measureText(s).width <= room);
      if (sep !== null && name !== undefined) {  // only between two headers of the first line
        ctx.fillStyle = "#999"; ctx.fillRect(sep, 2, 1, 13); ctx.fillStyle = "#333";
      }
      ctx.fillText(name ?? names.at(-1), name === undefined ? g.x(a) : x, name === undefined ? 18 : 8);
      const end = x + ctx.measureText(name ?? "").width;
      [from, sep] = name !== undefined && b < g.N && g.x(b) - end < 12 ? [end + 12, Math.round(end + 6)] : [0, null];
      // the rows this step wrote under a bar of the accent, as the KV view marks them (a rule over the others)
      const own = names.at(-1) === "own", width = g.x(b - 1) + g.w(b - 1) - g.x(a);
      ctx.fillStyle = own ? model.get("written") : "#333";
      ctx.fillRect(g.x(a), own ? T - 6 : T - 4, width, own ? 3 : 1);
      ctx.fillStyle = "#333";
    }
    ctx.textAlign = "right";  // query positions down the left
    // every 8th position (rows are 3 px at least: labels 24 px apart), 128, 136, … read as steps; then the last row's,
    // unless it would touch the label before it
    const label = (q) => ctx.fillText(String(p0 + q), L - 4, T + q * g.rh + g.rh / 2);
    for (let q = 0; q < g.Q; q += 8) label(q);
    const last = g.Q - 1;
    if (last % 8 && (last % 8) * g.rh >= 12) label(last);
    if (g.Q * g.rh >= 100) {  // the axis title fits beside the rows (a decode step's one row has its position)
      ctx.save(); ctx.translate(8, T + (g.Q * g.rh) / 2); ctx.rotate(-Math.PI / 2); ctx.textAlign = "center"; ctx.fillText("query position", 0, 0); ctx.restore();
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";  // key positions (raw), row numbers (compressed) along the bottom
    const pos = model.get("raw_positions"), y = T + g.Q * g.rh + 3;
    const every = Math.max(1, Math.ceil(34 / g.cw));
    // a tick is drawn where its label keeps 6 px clear of every label drawn before it: first the step's own first
    // position (the query itself in a decode step), then raw positions every `stride`, then compressed rows c0, c…
    const placed = [];
    // (`align` "left": starting at the tick, as c0's, which centred ran into the label of the own rows before it;
    // "right": ending at it, as a decode step's one own row's, leaving c0 room on its right)
    const tick = (c, s, align = "centre") => {
      const mid = g.x(c) + g.w(c) / 2, width = ctx.measureText(s).width;
      const l0 = align === "left" ? mid - 1 : align === "right" ? mid + 1 - width : mid - width / 2;
      if (placed.some(([l, r]) => l0 + width + 6 > l && l0 - 6 < r)) return false;
      placed.push([l0, l0 + width, g.gi(c)]);
      ctx.fillRect(mid, y - 3, 1, 3); ctx.fillText(s, l0 + width / 2, y);
      return true;
    };
    if (g.own) tick(g.nr - g.own, String(pos[g.nr - g.own]), g.own === 1 && g.nc ? "right" : "centre");
    if (g.nr > g.own) tick(0, String(pos[0]), "left");  // where the cached rows start: the window's first position
    const stride = 16 * Math.ceil(every / 16);
    for (let c = 0; c < g.nr; c++) if (pos[c] % stride === 0) tick(c, String(pos[c]));
    const cstep = Math.ceil((ctx.measureText(`c${g.nc}`).width + 6) / g.ccw);  // the widest label and 6 px apart
    for (let c = 0; c < g.nc; c += cstep) if (!tick(g.nr + c, `c${c}`) && c === 0) tick(g.nr, "c0", "left");
    // two labels of different groups under 12 px apart (a decode step's position and c0): a thin grey line between
    // them, as between two close headers, so that "320 c0" reads as two labels
    ctx.fillStyle = "#999";
    placed.sort((a, b) => a[0] - b[0]).forEach(([, r, grp], i) => {
      const next = placed[i + 1];
      if (next && next[2] !== grp && next[0] - r < 12) ctx.fillRect(Math.round((r + next[0]) / 2), y, 1, 11);
    });
    ctx.fillStyle = "#333";
    ctx.fillText(model.get("x_title"), titleX, y + 14);
    legend.innerHTML = cats.map((name, i) => counts[i] ? `<span class="ds4-key"><span class="ds4-swatch" style="background:${col[i]}"></span>${name}</span>` : "").join("");
    img.alt = `mask: query position (down) × ${model.get("x_title")} (across)`;  // the axes, also for a screen reader
    img.src = canvas.toDataURL("image/png");
    img.width = W; img.height = g.H;
  };
  // the cell under the pointer (client px), described beside it (hovertip.js, as the other views': a line under the
  // image was far from the rows at the top)
  const cellAt = (under, x, y) => {
    if (under !== img) return "";
    const g = layout(model), rect = img.getBoundingClientRect();
    const px = ((x - rect.left) / rect.width) * size[0], py = ((y - rect.top) / rect.height) * size[1];
    const q = Math.floor((py - T) / g.rh);
    let c = -1;
    for (let i = 0; i < g.N; i++) if (px >= g.x(i) && px < g.x(i) + g.w(i)) { c = i; break; }
    return q >= 0 && q < g.Q && c >= 0 ? reason(model, q, c, bytes(model.get("cells"))[q * g.N + c], g) : "";
  };
  const tips = pointerTip(el, cellAt);
  const redraw = () => { draw(); tips.describe(); };  // another step shown under a still pointer: its cell's text
  draw();
  const events = ["cells", "raw_positions", "n_comp", "label", "layer", "x_title", "plan", "size_px"].map((k) => `change:${k}`);
  for (const e of events) model.on(e, redraw);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, redraw);
    tips.remove();
  };
}
export default { render };
