// ExpertView: one histogram per layer (x: expert id, y: tokens routed), hash-routed layers marked.
const esc = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");

function render({ model, el }) {
  el.classList.add("ds4-view");
  const body = document.createElement("div");
  const tip = document.createElement("div"); tip.className = "ds4-tip";
  el.append(body, tip);
  const draw = () => {
    const n = model.get("n_expert"), show = model.get("show"), common = model.get("common_scale");
    const layers = model.get("layers").filter((L) => show === "all" || (show === "hash") === L.hash);
    const vmaxAll = Math.max(1, ...layers.map((L) => Math.max(...L.counts)));
    const bw = Math.max(2, Math.min(32, Math.floor(640 / Math.max(n, 1)))), H = 40;
    let h = `<div class="ds4-title">${esc(model.get("title"))}</div><div class="ds4-note">` +
      `x: expert 0–${n - 1}, y: tokens routed (${common ? "one scale" : "each layer its own scale"}); ` +
      `<span class="ds4-badge">hash</span> layers route by a fixed table of the token id, the others by the ` +
      `learned router's top ${model.get("k")}</div>`;
    for (const L of layers) {
      const vmax = common ? vmaxAll : Math.max(1, ...L.counts);
      const fill = L.hash ? "#e6550d" : "#3182bd";
      let bars = "";
      L.counts.forEach((c, e) => {
        const bh = Math.round((H * c) / vmax);
        bars += `<rect data-l="${L.layer}" data-e="${e}" x="${e * bw}" y="0" width="${bw}" height="${H}" fill="transparent"/>` +
          (bh ? `<rect x="${e * bw}" y="${H - bh}" width="${Math.max(bw - 1, 1)}" height="${bh}" fill="${fill}" pointer-events="none"/>` : "");
      });
      h += `<div class="ds4-hist"><div class="ds4-label">layer ${L.layer} ${L.hash ? '<span class="ds4-badge">hash</span>' : ""}` +
        `<br><span class="ds4-note">${L.n_tokens} tokens, max ${Math.max(...L.counts)}</span></div>` +
        `<svg width="${n * bw}" height="${H}">${bars}</svg></div>`;
    }
    body.innerHTML = h;
  };
  const hover = (ev) => {
    const d = ev.target.dataset;
    if (!d || d.e === undefined) return;
    const L = model.get("layers").find((x) => x.layer === +d.l), e = +d.e;
    if (!L) return;
    const c = L.counts[e], top = L.top[e] || [];
    tip.innerHTML = `layer ${L.layer}${L.hash ? " (hash)" : ""}, expert ${e}: ${c} of ${L.n_tokens} tokens ` +
      `(${L.n_tokens ? ((100 * c) / L.n_tokens).toFixed(1) : 0}%)` +
      (top.length ? " · most often: " + top.map(([t, k]) => `<code>${esc(JSON.stringify(t))}</code> ×${k}`).join(", ") : "");
  };
  draw();
  const events = ["layers", "show", "common_scale", "title"].map((k) => `change:${k}`);
  for (const e of events) model.on(e, draw);
  body.addEventListener("mouseover", hover);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, draw);
    body.removeEventListener("mouseover", hover);
  };
}
export default { render };
