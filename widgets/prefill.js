// PrefillView: chunk table, prompt coloured by chunk, live progress bar. State comes from Python.
const PALETTE = ["#c6dbef", "#c7e9c0", "#fdd0a2", "#dadaeb", "#fcbba1", "#d9d9d9", "#9ecae1", "#a1d99b"];
const esc = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");

function render({ model, el }) {
  el.classList.add("ds4-view");
  const draw = () => {
    const toks = model.get("tokens"), bounds = model.get("bounds"), chunks = model.get("chunks");
    const done = model.get("done"), total = model.get("total"), sel = model.get("selected");
    const first = model.get("first");
    let html = `<div class="ds4-title">Prefill: ${done}/${total} tokens, ${chunks.length}/${bounds.length} chunks of ≤${model.get("chunk")}</div>`;
    html += `<div class="ds4-bar"><div style="width:${total ? (100 * done) / total : 0}%"></div></div>`;
    html += "<table><tr><th>chunk</th><th>tokens</th><th>n</th><th>ms</th><th>tok/s</th><th>KV bytes</th></tr>";
    bounds.forEach(([s, e], i) => {
      const c = chunks[i];
      const sw = `<span class="ds4-tok" style="background:${PALETTE[i % PALETTE.length]}">&nbsp;&nbsp;</span>`;
      html += `<tr class="${i === sel ? "ds4-sel" : ""}"><td>${sw} ${i}</td><td>${s}–${e - 1}</td><td>${e - s}</td>` +
        (c ? `<td>${(c.seconds * 1000).toFixed(1)}</td><td>${c.tokens_per_s.toFixed(0)}</td><td>${c.kv_bytes.toLocaleString()}</td>` :
             `<td colspan="3" style="color:#999">pending</td>`) + "</tr>";
    });
    html += "</table><div class='ds4-prompt'>";
    let ci = 0;
    toks.forEach((t, p) => {
      if (p < first) { html += `<span class="ds4-tok" title="${p}: reused">${esc(t)}</span>`; return; }
      while (ci < bounds.length && p >= bounds[ci][1]) ci++;
      const ran = p < done;
      const bg = ran ? PALETTE[ci % PALETTE.length] : "transparent";
      const border = ci === sel ? "box-shadow:0 0 0 1px #e6550d inset;" : "";
      html += `<span class="ds4-tok${ran ? "" : " ds4-todo"}" style="background:${bg};${border}" title="position ${p}, chunk ${ci}">${esc(t)}</span>`;
    });
    el.innerHTML = html + "</div>";
  };
  draw();
  const events = ["tokens", "bounds", "chunks", "done", "selected"].map((k) => `change:${k}`);
  for (const e of events) model.on(e, draw);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, draw);
  };
}
export default { render };
