// GenerationView: context (greyed), then each generated token coloured by its log-probability; hovering a
// token lists its top-k alternatives with probabilities. Controls are ipywidgets; state comes from Python.
const colour = (scale, lp) => {
  for (const [lowest, c] of scale) if (lowest === null || lp >= lowest) return c;
  return scale.length ? scale[scale.length - 1][1] : "transparent";
};
const BAR_PX = 160;  // the bar of the most likely alternative shown
const pct = (lp) => (Math.exp(lp) * 100).toFixed(lp > Math.log(0.001) ? 1 : 3) + "%";

function render({ model, el }) {
  el.classList.add("ds4-view");
  const head = document.createElement("div"); head.className = "ds4-title";
  const legend = document.createElement("div"); legend.className = "ds4-note";
  const text = document.createElement("div"); text.className = "ds4-prompt ds4-gen";
  const tip = document.createElement("div"); tip.className = "ds4-alts";
  el.append(head, legend, text, tip);
  // Out of a generated token the panel says what it is for, at the height it takes with a token's alternatives, so
  // that nothing under the view moves when it fills (or empties): it never shrinks below the tallest it has been
  const panel = keepTallest(tip);
  // Out of a generated token: the last one's alternatives (the panel shows what it is for, and the room it keeps
  // is not left blank), or before any token what hovering one shows
  const placeholder = () => {
    const recs = model.get("records");
    // the room a token's alternatives take, from the start (views.css: every line 1.6em): the panel's first line,
    // the token's, the heading, the decoder's top alternatives and a sampled token from outside them (that last
    // row, first shown on hover, moved what follows down a line)
    if (!tip.style.minHeight) tip.style.minHeight = `${(4 + model.get("top")) * 1.6}em`;
    if (recs.length) { showTip(recs.length - 1, true); return; }
    tip.innerHTML = `<div class="ds4-note">hover a generated token: the model's most likely tokens at its ` +
      `position show here</div>`;
  };
  const showTip = (i, last = false) => {
    const r = model.get("records")[i];
    if (!r) { placeholder(); return; }
    const scale = model.get("scale");
    // the bars: each alternative's probability over the largest shown, so that small ones compare
    const top = Math.max(...r.top.map((a) => a.logprob));
    // a first line in either case, so that the token's line does not move up a line when one is hovered
    let h = `<div class="ds4-note">${last ? "the last token generated (hover another for its alternatives)" :
      "the token under the pointer (off the text: the last one generated)"}</div>` +
      `<div><b>position ${r.position}</b>: token ${r.token} <code>${esc(JSON.stringify(r.piece))}</code> · ` +
      `p ${pct(r.logprob)} (logprob ${r.logprob.toFixed(3)})${r.eos ? " · end of sequence" : ""}</div>` +
      (r.top.length ? `<div class="ds4-note">top ${r.top.length} alternatives; bars: p relative to the most likely ` +
        `(${pct(top)} = full bar)</div>` : "") + "<table>";
    const row = (text, logprob, mark, cls) => {
      const w = Math.max(1, Math.round(BAR_PX * Math.exp(logprob - top)));
      return `<tr class="${cls}"><td><code>${esc(JSON.stringify(text))}</code></td>` +
        `<td>${pct(logprob)}</td><td style="text-align:left"><span class="ds4-pbar" style="width:${w}px;` +
        `background:${colour(scale, logprob)}"></span></td><td>${mark}</td></tr>`;
    };
    for (const a of r.top) {
      const mine = a.token === r.token;
      h += row(a.text, a.logprob, mine ? "◀ sampled" : "", mine ? "ds4-sampled" : "");
    }
    // a token sampled from outside the top: its own row under them, said so (else the list never names it)
    if (r.top.length && !r.top.some((a) => a.token === r.token))
      h += row(r.piece, r.logprob, `◀ sampled, not in the top ${r.top.length}`, "ds4-sampled");
    tip.innerHTML = h + "</table>";
    panel.hold();
  };
  const draw = () => {
    const recs = model.get("records"), scale = model.get("scale");
    head.textContent = `Generation: ${recs.length} tokens — ${model.get("status")}`;
    // the chips stay on one line together (ds4-scale): the line breaks before them, never between them
    // generation.LEGEND_TITLE: the model's own softmax (ds4's logprobs), not the sampler's temperature and top-p
    legend.innerHTML = "colour: the probability the model gave each sampled token (its softmax, before temperature " +
      "and top-p; hover: its alternatives) " +
      `<span class="ds4-scale">` + scale.map(([, c, label]) =>
        `<span class="ds4-tok ds4-key" style="background:${c}">&nbsp;${esc(label)}&nbsp;</span>`).join(" ") + "</span>";
    const skipped = model.get("context_skipped");
    let h = `<span class="ds4-ctx">${skipped ? `… ${skipped} tokens … ` : ""}${esc(model.get("context").join(""))}</span>`;
    recs.forEach((r, i) => {
      const t = r.eos ? "⟨eos⟩" : r.text || "·";
      h += `<span class="ds4-tok${r.text || r.eos ? "" : " ds4-partial"}" data-i="${i}" ` +
        `style="background:${colour(scale, r.logprob)}">${esc(t)}</span>`;
    });
    text.innerHTML = h;
    text.scrollTop = text.scrollHeight;
  };
  let hovered = false;  // a generated token under the pointer: its alternatives stay shown as tokens arrive
  const hover = (ev) => {
    const i = ev.target.dataset ? ev.target.dataset.i : undefined;
    hovered = i !== undefined;
    if (hovered) showTip(+i);
    else placeholder();  // the prompt's text, or between tokens: the last token's alternatives
  };
  const leave = () => { hovered = false; placeholder(); };
  const redraw = () => { draw(); if (!hovered) placeholder(); };
  draw();
  placeholder();
  const events = ["records", "context", "status", "scale"].map((k) => `change:${k}`);
  for (const e of events) model.on(e, redraw);
  text.addEventListener("mouseover", hover);
  text.addEventListener("mouseleave", leave);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, redraw);
    text.removeEventListener("mouseover", hover);
    text.removeEventListener("mouseleave", leave);
    panel.disconnect();
  };
}
export default { render };
