// TierView: the layer stack coloured by tier with the last step's switches between units, per-tier memory,
// and bytes moved per step (log scale) against a full chunk's (batch) and one token's (decode) copy.
const fmt = (n) => (n === null || n === undefined ? "-" : n.toLocaleString());

// Bytes with a binary unit: 1.5 MiB, 12 KiB, 300 B.
const bytes = (b) => {
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return `${+b.toPrecision(3)} ${units[i]}`;
};
// A log axis of bytes covering every value > 0: from a power of two an octave or more under the smallest (its bar
// keeps a height) to one over the largest, both multiples of k (about four to seven ticks, at 2^(k·i) bytes: 16 KiB,
// 64 KiB, 256 KiB, 1 MiB, …).
const logAxis = (values) => {
  const pos = values.filter((v) => v > 0);
  let e0 = Math.floor(Math.log2(pos.length ? Math.min(...pos) : 1)) - 1;
  let e1 = Math.ceil(Math.log2((pos.length ? Math.max(...pos) : 2) * 1.2));
  const k = Math.max(1, Math.ceil((e1 - e0) / 6));
  e0 = Math.floor(e0 / k) * k; e1 = Math.max(Math.ceil(e1 / k) * k, e0 + k);
  const ticks = [];
  for (let e = e0; e <= e1; e += k) ticks.push(2 ** e);
  return { e0, e1, ticks };
};
const PLOT = { w: 480, h: 140, left: 72, bottom: 34, top: 8, right: 96 };
// batch dark grey, decode grey, none a pale stub; the bounds black, dashed and dotted (tier_view.py)
const FILL = { batch: "#525252", decode: "#969696", none: "#d9d9d9" };
const BOUND = { batch: "#000000", decode: "#000000" };  // both black: dashed, dotted (on the decode bars' tops)

// The bytes-per-step chart: a bar per step on a log y axis of bytes (a decode step copies one row per boundary, a
// prefill step up to a chunk of rows: on a linear axis the decode bars would lie on the x axis) and an x axis of
// step numbers; the full-chunk and decode-step bounds as lines labelled on the right. A step that moved nothing is a
// grey stub on the x axis.
function stepsChart(steps, batch, decode) {
  const { w, h, left, bottom, top, right } = PLOT, n = Math.max(steps.length, 1), bw = w / n;
  const { e0, e1, ticks } = logAxis([batch, decode, ...steps.map((d) => d.bytes)]);
  const y = (b) => top + h - (h * (Math.log2(b) - e0)) / (e1 - e0);
  let svg = `<g transform="translate(${left},0)">`;
  for (const v of ticks) svg += `<line x1="-4" x2="${w}" y1="${y(v)}" y2="${y(v)}" stroke="#eee"/>` +
    `<text x="-6" y="${y(v) + 4}" text-anchor="end">${bytes(v)}</text>`;
  steps.forEach((d, i) => {
    const fill = FILL[d.mode] || FILL.none;
    const y0 = d.bytes > 0 ? y(d.bytes) : top + h - 2;
    svg += `<rect data-i="${i}" x="${i * bw}" y="${top}" width="${bw}" height="${h}" fill="transparent"/>` +
      `<rect data-bar="${i}" x="${i * bw + (bw > 3 ? 1 : 0)}" y="${y0}" width="${Math.max(bw - (bw > 3 ? 2 : 0), 1)}" ` +
      `height="${top + h - y0}" fill="${fill}" pointer-events="none"/>`;
  });
  // the bounds, labelled right of the plot (apart by a line at least, should they be close)
  const yb = batch ? y(batch) : null, yd = decode ? y(decode) : null;
  if (batch) svg += `<line class="ds4-bound-batch" x1="0" x2="${w}" y1="${yb}" y2="${yb}" stroke="${BOUND.batch}" stroke-dasharray="6 3"/>` +
    `<text x="${w + 4}" y="${yb + 4}" style="fill:${BOUND.batch}">chunk ${bytes(batch)}</text>`;
  if (decode) svg += `<line class="ds4-bound-decode" x1="0" x2="${w}" y1="${yd}" y2="${yd}" stroke="${BOUND.decode}" stroke-width="1.5" stroke-dasharray="2 2"/>` +
    `<text x="${w + 4}" y="${(yb !== null ? Math.max(yd, yb + 12) : yd) + 4}" style="fill:${BOUND.decode}">decode ${bytes(decode)}</text>`;
  const every = Math.max(1, Math.ceil(n / 10));
  steps.forEach((d, i) => {
    if (i % every === 0) svg += `<text x="${(i + 0.5) * bw}" y="${top + h + 14}" text-anchor="middle">${d.step}</text>`;
  });
  svg += `<line x1="0" x2="${w}" y1="${top + h}" y2="${top + h}" stroke="#666"/>` +
    `<line x1="0" x2="0" y1="${top}" y2="${top + h}" stroke="#666"/>` +
    `<text x="${w / 2}" y="${top + h + 30}" text-anchor="middle">step</text></g>` +
    `<text transform="translate(12,${top + h / 2}) rotate(-90)" text-anchor="middle">bytes moved (log)</text>`;
  const [W, H] = [left + w + right, top + h + bottom];  // drawn narrower where the output is (views.css)
  return `<svg class="ds4-steps" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}">${svg}</svg>`;
}

function render({ model, el }) {
  el.classList.add("ds4-view", "ds4-tiers");
  const body = document.createElement("div");
  const tip = document.createElement("div"); tip.className = "ds4-tip";
  el.append(body, tip);
  const tips = pointerTip(el);  // a unit's or a switch's text beside the pointer
  const draw = () => {
    const units = model.get("units"), tiers = model.get("tiers"), trace = model.get("trace"), steps = model.get("steps");
    const rb = model.get("row_bytes"), chunk = model.get("chunk"), nb = model.get("boundaries");
    const batch = nb * chunk * rb, decode = nb * rb, nLayer = units.length - 2;
    let h = `<div class="ds4-title">Tiers: ${esc(model.get("rule"))} — ${plural(tiers.length, "tier")}, ${plural(nb, "copying boundary", "copying boundaries")} per step</div>`;
    const part = model.get("part");  // a plan over processes: this rank, whose units are solid
    if (part) h += `<div class="ds4-note">this process: ${esc(part)}; the dashed units run in the other processes, ` +
      `which send the hidden state on at each switch</div>`;
    h += `<div class="ds4-note">` + tiers.map((d) => `<span class="ds4-key"><span class="ds4-unit" style="background:${d.colour}">tier ${d.tier}</span> ` +
      `${esc(d.device)}${part && d.here ? " (this process)" : ""}</span>`).join(" ") + `</div>`;
    const at = {};
    for (const s of trace) (at[s.layer] = at[s.layer] || []).push(s);
    h += `<div class="ds4-stack">`;
    for (const u of units) {
      h += `<span class="ds4-hop">`;  // the switches before a unit and the unit: on one line, whatever the width
      for (const s of at[u.layer] || [])
        h += `<span class="ds4-arrow${s.mode === "no-copy" ? " nocopy" : ""}" ` +
          `data-tip="${s.from_tier} → ${s.to_tier}, ${s.mode}, ${fmt(s.bytes)} bytes, ` +
          `${(s.seconds * 1e6).toFixed(0)} µs">` +
          `→ ${s.mode === "no-copy" ? "no-copy" : bytes(s.bytes)} →</span>`;  // short: the stack fits a laptop's line
      const label = u.layer === -1 ? "embed" : u.layer === nLayer ? "head" : `L${u.layer}`;
      h += `<span class="ds4-unit${u.here ? "" : " ds4-away"}" style="background:${u.colour}" ` +
        `data-tip="${esc(u.unit)}: tier ${u.tier} (${esc(u.device)}${u.here ? "" : ", another process"}), ` +
        `weights ${fmt(u.weights)} B, KV ${fmt(u.kv)} B">${label}</span></span>`;
    }
    h += `</div><table><tr><th>tier</th><th>device</th><th>weights</th><th>KV</th><th>activations</th><th>total</th><th>budget</th></tr>`;
    for (const d of tiers)
      h += `<tr><td><span class="ds4-tok" style="background:${d.colour}">&nbsp;&nbsp;</span> ${d.tier}</td><td>${esc(d.device)}</td>` +
        `<td>${fmt(d.weights)}</td><td>${fmt(d.kv)}</td><td>${fmt(d.activations)}</td><td>${fmt(d.total)}</td><td>${fmt(d.budget)}</td></tr>`;
    h += `</table><div><b>step ${model.get("last_step")}</b>: ` + (trace.length ? trace.map((s) =>  // a switch on one line
      `<span class="ds4-switch">before ${esc(s.unit)} ${s.from_tier}→${s.to_tier} ${s.mode} ${fmt(s.bytes)} B</span>`).join("; ") :
      "no switches") + `</div>`;
    // bytes per step: bars on axes (bytes, step), with the batch (full chunk) and decode bounds as lines
    h += `<div class="ds4-note">bytes moved per step, on a log scale: a dark grey bar a prefill chunk's copies (batch), a grey one a ` +
      `decode step's, a pale stub a step that moved nothing; dashed line: a full ` +
      `chunk, ${plural(chunk, "row")} × ${fmt(rb)} B × ${plural(nb, "boundary", "boundaries")} = ` +
      `${fmt(batch)} B; dotted line: a decode step, ${fmt(decode)} B` +
      (batch && decode ? ` (1/${Math.round(batch / decode)} of it)` : "") + `</div>` + stepsChart(steps, batch, decode);
    body.innerHTML = h;
  };
  let hovered = null;  // the step under the pointer last: outlined, and its breakdown under the chart
  const describe = () => {
    body.querySelectorAll("rect.ds4-hot").forEach((r) => r.classList.remove("ds4-hot"));
    const d = hovered === null ? undefined : model.get("steps")[hovered], rb = model.get("row_bytes");
    if (!d) { tip.textContent = ""; return; }
    const bar = body.querySelector(`rect[data-bar="${hovered}"]`);
    if (bar) bar.classList.add("ds4-hot");
    tip.textContent = `step ${d.step}: ${d.mode}, ${plural(d.switches, "switch", "switches")}, ${plural(d.copies, "copy", "copies")}, ${fmt(d.bytes)} bytes` +
      (d.copies ? ` = ${d.copies} × ${plural(Math.round(d.bytes / d.copies / rb), "row")} × ${fmt(rb)} B` : "") +
      `, ${(d.seconds * 1e6).toFixed(0)} µs`;
  };
  const hover = (ev) => {
    const i = ev.target.dataset ? ev.target.dataset.i : undefined;
    if (i === undefined) return;
    hovered = +i;
    describe();
  };
  // a redraw keeps the hovered step's outline and caption, and the tooltip, current
  const redraw = () => { draw(); describe(); tips.describe(); };
  draw();
  const events = ["units", "tiers", "trace", "steps", "last_step", "part"].map((k) => `change:${k}`);
  for (const e of events) model.on(e, redraw);
  body.addEventListener("mouseover", hover);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, redraw);
    body.removeEventListener("mouseover", hover);
    tips.remove();
  };
}
export default { render };
