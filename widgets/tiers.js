// TierView: the layer stack coloured by tier with the last step's switches between units, per-tier memory,
// and bytes moved per step against a full chunk's (batch) and one token's (decode) copy.
const esc = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
const fmt = (n) => (n === null || n === undefined ? "-" : n.toLocaleString());

function render({ model, el }) {
  el.classList.add("ds4-view");
  const body = document.createElement("div");
  const tip = document.createElement("div"); tip.className = "ds4-tip";
  el.append(body, tip);
  const draw = () => {
    const units = model.get("units"), tiers = model.get("tiers"), trace = model.get("trace"), steps = model.get("steps");
    const rb = model.get("row_bytes"), chunk = model.get("chunk"), nb = model.get("boundaries");
    const batch = nb * chunk * rb, decode = nb * rb, nLayer = units.length - 2;
    let h = `<div class="ds4-title">Tiers: ${esc(model.get("rule"))} — ${tiers.length} tier(s), ${nb} copying boundary(ies) per step</div>`;
    h += `<div class="ds4-note">` + tiers.map((d) => `<span class="ds4-unit" style="background:${d.colour}">tier ${d.tier}</span> ${esc(d.device)}`).join(" ") + `</div>`;
    const at = {};
    for (const s of trace) (at[s.layer] = at[s.layer] || []).push(s);
    h += `<div class="ds4-stack">`;
    for (const u of units) {
      for (const s of at[u.layer] || [])
        h += `<span class="ds4-arrow" title="${s.from_tier} → ${s.to_tier}, ${s.mode}, ${fmt(s.bytes)} bytes, ${(s.seconds * 1e6).toFixed(0)} µs">` +
          `→ ${s.mode === "no-copy" ? "no-copy" : fmt(s.bytes) + " B"} →</span>`;
      const label = u.layer === -1 ? "embed" : u.layer === nLayer ? "head" : `L${u.layer}`;
      h += `<span class="ds4-unit" style="background:${u.colour}" title="${esc(u.unit)}: tier ${u.tier} (${esc(u.device)}), ` +
        `weights ${fmt(u.weights)} B, KV ${fmt(u.kv)} B">${label}</span>`;
    }
    h += `</div><table><tr><th>tier</th><th>device</th><th>weights</th><th>KV</th><th>activations</th><th>total</th><th>budget</th></tr>`;
    for (const d of tiers)
      h += `<tr><td><span class="ds4-tok" style="background:${d.colour}">&nbsp;&nbsp;</span> ${d.tier}</td><td>${esc(d.device)}</td>` +
        `<td>${fmt(d.weights)}</td><td>${fmt(d.kv)}</td><td>${fmt(d.activations)}</td><td>${fmt(d.total)}</td><td>${fmt(d.budget)}</td></tr>`;
    h += `</table><div><b>step ${model.get("last_step")}</b>: ` + (trace.length ? trace.map((s) =>
      `before ${esc(s.unit)} ${s.from_tier}→${s.to_tier} ${s.mode} ${fmt(s.bytes)} B`).join("; ") : "no switches") + `</div>`;
    // bytes per step: bars, with the batch (full chunk) and decode bounds as lines
    const W = 640, H = 80, n = Math.max(steps.length, 1), bw = Math.max(1, Math.min(12, Math.floor(W / n)));
    const vmax = Math.max(batch, 1, ...steps.map((d) => d.bytes));
    const y = (b) => H - (H * b) / vmax;
    let svg = "";
    steps.forEach((d, i) => {
      const fill = d.mode === "batch" ? "#3182bd" : d.mode === "decode" ? "#31a354" : "#ccc";
      svg += `<rect data-i="${i}" x="${i * bw}" y="0" width="${bw}" height="${H}" fill="transparent"/>` +
        `<rect x="${i * bw}" y="${y(d.bytes)}" width="${Math.max(bw - 1, 1)}" height="${H - y(d.bytes)}" fill="${fill}" pointer-events="none"/>`;
    });
    if (batch) svg += `<line x1="0" x2="${n * bw}" y1="${y(batch)}" y2="${y(batch)}" stroke="#de2d26" stroke-dasharray="4 2"/>`;
    if (decode) svg += `<line x1="0" x2="${n * bw}" y1="${y(decode)}" y2="${y(decode)}" stroke="#e6550d" stroke-dasharray="2 2"/>`;
    h += `<div class="ds4-note">bytes moved per step (blue batch, green decode, grey none); red: a full chunk of ${chunk} rows × ` +
      `${fmt(rb)} B per boundary = ${fmt(batch)} B; orange: a decode step, ${fmt(decode)} B</div>` +
      `<svg class="ds4-steps" width="${n * bw}" height="${H + 1}">${svg}</svg>`;
    body.innerHTML = h;
  };
  const hover = (ev) => {
    const i = ev.target.dataset ? ev.target.dataset.i : undefined;
    if (i === undefined) return;
    const d = model.get("steps")[+i], rb = model.get("row_bytes");
    if (!d) return;
    tip.textContent = `step ${d.step}: ${d.mode}, ${d.switches} switch(es), ${d.copies} copy(ies), ${fmt(d.bytes)} bytes` +
      (d.copies ? ` = ${d.copies} × ${Math.round(d.bytes / d.copies / rb)} rows × ${fmt(rb)} B` : "") +
      `, ${(d.seconds * 1e6).toFixed(0)} µs`;
  };
  draw();
  const events = ["units", "tiers", "trace", "steps", "last_step"].map((k) => `change:${k}`);
  for (const e of events) model.on(e, draw);
  body.addEventListener("mouseover", hover);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, draw);
    body.removeEventListener("mouseover", hover);
  };
}
export default { render };
