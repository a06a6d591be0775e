// ExpertView: one histogram per layer (x: expert id, y: tokens routed), hash-routed layers marked.

// Round tick values from 0 up to vmax on an axis of px pixels: the smallest step of 1, 2, 2.5 or 5 times a power of
// ten (whole numbers: token counts) whose ticks lie MIN_TICK_GAP px apart or more, so two or three ticks on 40 px (four,
// 10 px apart, crowded each other's labels); then vmax itself at the axis' top where that much clear of the last, so
// the tallest bar's height reads off the axis (on a layer's own scale the round ticks stopped well short of it).
const MIN_TICK_GAP = 16;
const niceTicks = (vmax, px) => {
  if (vmax < 2) return [0, vmax];
  let step = 1;
  for (let p = 1; ; p *= 10) {
    const fits = [1, 2, 2.5, 5].map((m) => m * p).find((st) => Number.isInteger(st) && (px * st) / vmax >= MIN_TICK_GAP);
    if (fits !== undefined) { step = fits; break; }
  }
  const out = [];
  for (let v = 0; v <= vmax; v += step) out.push(v);
  if ((px * (vmax - out.at(-1))) / vmax >= MIN_TICK_GAP) out.push(vmax);
  return out;
};

function render({ model, el }) {
  el.classList.add("ds4-view", "ds4-experts");
  const header = document.createElement("div"), body = document.createElement("div");
  header.className = "ds4-experts-head"; body.className = "ds4-hists";
  const hint = document.createElement("div"); hint.className = "ds4-tip";
  hint.textContent = "hover a bar: how many tokens went to that expert, and which tokens most often";
  el.append(header, hint, body);
  // what a bar's tooltip says, made when it is hovered: its count and share, and the tokens it was sent most often
  const barText = (under) => {
    const bar = under.closest("rect[data-e]");
    const L = bar && model.get("layers").find((x) => x.layer === +bar.dataset.l);
    if (!L) return "";
    const e = +bar.dataset.e, c = L.counts[e], top = L.top[e] || [];
    return `layer ${L.layer}${L.hash ? " (hash)" : ""}, expert ${e}: ${c} of ${L.n_tokens} tokens ` +
      `(${L.n_tokens ? ((100 * c) / L.n_tokens).toFixed(1) : 0}%)` +
      (top.length ? " · most often: " + top.map(([t, k]) => `${JSON.stringify(t)} ×${k}`).join(", ") : "");
  };
  const tips = pointerTip(el, barText);  // beside the pointer (a caption above a tall stack was far from it)
  const draw = () => {
    const n = model.get("n_expert"), show = model.get("show"), common = model.get("common_scale");
    const allLayers = model.get("layers"), layers = allLayers.filter((L) => show === "all" || (show === "hash") === L.hash);
    // one scale for every layer, the hidden ones too: a filter leaves the bars it shows as they were
    const vmaxAll = Math.max(1, ...allLayers.map((L) => Math.max(...L.counts)));
    // bars up to 48 px wide (a few experts: hover targets a student could hit; 32 drew a tiny model's 256 px), 2 at least
    const bw = Math.max(2, Math.min(48, Math.floor(640 / Math.max(n, 1)))), H = 40;
    const AX = 30, PT = 5;  // px left of the bars for the token axis, above them for its top label
    const shown = show === "all" ? "" : ` (${show === "hash" ? "hash" : "learned-router"} layers only)`;
    header.innerHTML = `<div class="ds4-title">router: tokens per expert, ${layers.length} layer${layers.length === 1 ? "" : "s"}` +
      `${shown} × ${n} experts, ${model.get("k")} per token</div><div class="ds4-note">` +
      `x: expert 0–${n - 1}, y: tokens routed to it (${common ? "one scale for every layer" : "each layer its own scale"}); ` +
      // the key of the bars shown only (the learned layers alone: no light grey bars to explain)
      ({ all: `<span class="ds4-badge">hash</span> layers (light grey bars) route by a fixed table of the token id, ` +
              `the others (dark grey) by the learned router's top ${model.get("k")}`,
         hash: `<span class="ds4-badge">hash</span> layers (light grey bars) route by a fixed table of the token id`,
         learned: `the learned router picks each token's top ${model.get("k")} (dark grey bars)` }[show]) + `</div>`;
    let h = "";
    // each histogram's axes: tokens up the left (niceTicks' round values), expert ids along the bottom
    const every = Math.max(1, Math.ceil(14 / bw));  // an expert id every `every` bars: at least 14 px apart
    for (const L of layers) {
      const vmax = common ? vmaxAll : Math.max(1, ...L.counts);
      const fill = L.hash ? "#969696" : "#525252";  // palette.HASH_ROUTED, LEARNED_ROUTED
      let bars = "";
      L.counts.forEach((c, e) => {
        const bh = Math.round((H * c) / vmax), x = AX + e * bw;
        bars += `<rect data-l="${L.layer}" data-e="${e}" x="${x}" y="${PT}" width="${bw}" height="${H}" fill="transparent"/>` +
          (bh ? `<rect x="${x}" y="${PT + H - bh}" width="${Math.max(bw - 1, 1)}" height="${bh}" fill="${fill}" pointer-events="none"/>` : "");
        if (e % every === 0) bars += `<text class="ds4-xtick" x="${x + bw / 2}" y="${PT + H + 12}">${e}</text>`;
      });
      let axis = `<line class="ds4-axis" x1="${AX - 0.5}" y1="${PT}" x2="${AX - 0.5}" y2="${PT + H + 0.5}"/>` +
        `<line class="ds4-axis" x1="${AX - 0.5}" y1="${PT + H + 0.5}" x2="${AX + n * bw}" y2="${PT + H + 0.5}"/>`;
      for (const v of niceTicks(vmax, H)) {
        const y = PT + H - (H * v) / vmax;
        axis += `<line class="ds4-axis" x1="${AX - 4}" y1="${y}" x2="${AX - 1}" y2="${y}"/>` +
          `<text class="ds4-ytick" x="${AX - 6}" y="${y}">${v}</text>`;
      }
      h += `<div class="ds4-hist"><div class="ds4-label">layer ${L.layer} ${L.hash ? '<span class="ds4-badge">hash</span>' : ""}` +
        `<br><span class="ds4-note">${L.n_tokens} tokens, max ${Math.max(...L.counts)}</span></div>` +
        `<svg width="${AX + n * bw + 4}" height="${PT + H + 16}" role="img" aria-label="layer ${L.layer}: tokens per expert">` +
        `${axis}${bars}</svg></div>`;
    }
    body.innerHTML = h;
    // as tall as all the layers whatever the filter shows: what is under the view stays put (it moved a layer's
    // height for each one hidden). A histogram's height and the gap between two (views.css) make the floor; none
    // before the view is attached (no height yet), and a filter that shows no layer keeps the last one
    const first = body.firstElementChild, gap = parseFloat(getComputedStyle(body).rowGap) || 0;
    const tall = first ? first.getBoundingClientRect().height : 0;
    if (tall > 0) body.style.minHeight = `${allLayers.length * (tall + gap) - gap}px`;
  };
  const redraw = () => { draw(); tips.describe(); };  // the tooltip describes what is under the pointer now
  draw();
  // drawn before it is attached (no height to measure): drawn again once it has one, for the floor
  const attached = new ResizeObserver(() => { if (!body.style.minHeight && el.clientWidth) requestAnimationFrame(draw); });
  attached.observe(el);
  const events = ["layers", "show", "common_scale"].map((k) => `change:${k}`);
  for (const e of events) model.on(e, redraw);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, redraw);
    attached.disconnect();
    tips.remove();
  };
}
export default { render };
