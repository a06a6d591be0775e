// PrefillView: the chunks (run and planned), the prompt coloured by chunk with the chunk shown highlighted and
// scrolled into the box (once the box is laid out), a progress bar and the chunk table (a run chunk's row clicked
// shows it). State comes from Python.

function render({ model, el }) {
  el.classList.add("ds4-view", "ds4-prefill");
  const body = document.createElement("div");
  el.append(body);
  const tips = pointerTip(el);  // a token's position and chunk beside the pointer (a native title waited a second)
  const draw = () => {
    const toks = model.get("tokens"), bounds = model.get("bounds"), chunks = model.get("chunks");
    const done = model.get("done"), total = model.get("total"), sel = model.get("selected");
    const first = model.get("first"), note = model.get("note"), PALETTE = model.get("chunk_colours");
    // the prefill's progress, then the chunk whose state is shown (the two read as one: "after chunk 1: 320/320 tokens")
    const shown = sel >= 0 && chunks[sel] ? ` · shown: after chunk ${sel} (tokens ${chunks[sel].start}–${chunks[sel].end - 1})` : "";
    let html = `<div class="ds4-title">Prefill: ${done}/${total} tokens, ${chunks.length}/${bounds.length} chunks of ≤${model.get("chunk")} run${shown}</div>`;
    html += `<div class="ds4-bar"><div style="width:${total ? (100 * done) / total : 0}%"></div></div>`;
    if (note) html += `<div class="ds4-note ds4-warn">${esc(note)}</div>`;
    html += "<div class='ds4-chunks'><div class='ds4-prompt'>";
    let ci = 0;
    toks.forEach((t, p) => {
      if (p < first) { html += `<span class="ds4-tok" data-tip="position ${p}: reused">${esc(t)}</span>`; return; }
      while (ci < bounds.length && p >= bounds[ci][1]) ci++;
      const ran = p < done, cur = ci === sel;
      const bg = ran ? PALETTE[ci % PALETTE.length] : "transparent";
      const start = cur && p === bounds[ci][0] ? ` data-start="1"` : "";
      html += `<span class="ds4-tok${ran ? "" : " ds4-todo"}${cur ? " ds4-cur" : ""}"${start} style="background:${bg}" data-tip="position ${p}, chunk ${ci}">${esc(t)}</span>`;
    });
    html += "</div><table><tr><th>chunk</th><th>tokens</th><th>n</th><th>ms</th><th>tok/s</th><th>KV bytes</th></tr>";
    bounds.forEach(([s, e], i) => {
      const c = chunks[i];
      const sw = `<span class="ds4-tok" style="background:${PALETTE[i % PALETTE.length]}">&nbsp;&nbsp;</span>`;
      const pick = c ? ` data-pick="${i}" data-tip="chunk ${i}: click to show the state after it"` : "";  // a run chunk's row
      html += `<tr class="${i === sel ? "ds4-sel" : ""}${c ? " ds4-pick" : ""}"${pick}><td>${sw} ${i}</td><td>${s}–${e - 1}</td><td>${e - s}</td>` +
        (c ? `<td>${(c.seconds * 1000).toFixed(1)}</td><td>${c.tokens_per_s.toFixed(0)}</td><td>${c.kv_bytes.toLocaleString()}</td>` :
             `<td colspan="3" class="ds4-note">not run</td>`) + "</tr>";
    });
    body.innerHTML = html + "</table></div>";
    pending = true;
    scroll();
  };
  // Scroll the prompt box (not the page) so that the chunk shown starts near its top. That needs the box laid
  // out: anywidget renders a view before JupyterLab attaches it to the page (and an output can be hidden), where
  // every offset is 0. Until the box has a size the scroll stays pending; the observer below does it once the
  // view is laid out, and again when a new width reflows the prompt.
  let pending = false, width = -1;
  const scroll = () => {
    const box = el.querySelector(".ds4-prompt"), at = el.querySelector(".ds4-tok[data-start]");
    if (!box || !at) { pending = false; return; }
    if (!box.isConnected || !box.clientHeight) return;
    // the chunk's first line where the prompt's first line is unscrolled (both move with the scroll, so their
    // difference is the same however the box is scrolled: a resize scrolled it again by as much)
    box.scrollTop = Math.max(0, at.getBoundingClientRect().top - box.firstElementChild.getBoundingClientRect().top);
    pending = false;
  };
  const resized = new ResizeObserver(() => {
    const w = el.clientWidth;
    if (pending || w !== width) scroll();
    width = w;
  });
  resized.observe(el);
  // a run chunk's row shows its state, as the slider does (Python moves the slider and everything with it)
  const pick = (ev) => {
    const row = ev.target.closest("tr[data-pick]");
    if (row) { model.set("pick_request", +row.dataset.pick); model.save_changes(); }
  };
  body.addEventListener("click", pick);
  const redraw = () => { draw(); tips.describe(); };  // the tooltip describes what is under the pointer now
  draw();
  const events = ["tokens", "bounds", "chunks", "done", "selected", "note"].map((k) => `change:${k}`);
  for (const e of events) model.on(e, redraw);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, redraw);
    resized.disconnect();
    body.removeEventListener("click", pick);
    tips.remove();
  };
}
export default { render };
