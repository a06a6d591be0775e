// AttentionView: a max-pooled uint8 heatmap [rows x cols] drawn on a canvas; groups raw | compressed | sink.
function ramp(v) {
  const t = v / 255, lo = [255, 255, 255], mid = [49, 130, 189], hi = [40, 10, 80];
  const [a, b, u] = t < 0.5 ? [lo, mid, t * 2] : [mid, hi, t * 2 - 1];
  return [0, 1, 2].map((i) => Math.round(a[i] + (b[i] - a[i]) * u));
}
const bytes = (dv) => (dv ? new Uint8Array(dv.buffer, dv.byteOffset, dv.byteLength) : new Uint8Array());
function render({ model, el }) {
  el.classList.add("ds4-view");
  const title = document.createElement("div"); title.className = "ds4-title";
  const canvas = document.createElement("canvas");
  const tip = document.createElement("div"); tip.className = "ds4-tip";
  const note = document.createElement("div"); note.className = "ds4-note";
  el.append(title, canvas, tip, note);
  const draw = () => {
    const rows = model.get("rows"), cols = model.get("cols"), buf = bytes(model.get("buf")), marks = bytes(model.get("marks"));
    title.textContent = model.get("title");
    canvas.width = Math.max(cols, 1); canvas.height = Math.max(rows, 1);
    const scale = Math.max(1, Math.min(6, Math.floor(720 / Math.max(cols, rows, 1))));
    canvas.style.width = `${cols * scale}px`; canvas.style.height = `${rows * scale}px`;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(canvas.width, canvas.height);
    for (let i = 0; i < rows * cols; i++) {
      let [r, g, b] = ramp(buf[i] || 0);
      if (marks[i] === 1 && buf[i] === 0) [r, g, b] = [252, 187, 161];  // dropped by the indexer
      if (marks[i] === 2 && buf[i] === 0) [r, g, b] = [255, 247, 188];  // selected, weight ~0
      img.data.set([r, g, b, 255], i * 4);
    }
    ctx.putImageData(img, 0, 0);
    ctx.fillStyle = "#000";
    for (const g of model.get("groups")) if (g.start > 0 && g.stop > g.start) ctx.fillRect(g.start, 0, 1 / scale, rows);
    const fr = model.get("row_factor"), fc = model.get("col_factor");
    note.textContent = `${rows}×${cols} cells` + (fr > 1 || fc > 1 ? `, max-pooled ×${fr} queries, ×${fc} keys` : "") +
      ` · colour: weight 0…${model.get("vmax").toPrecision(3)} · groups: ` +
      model.get("groups").map((g) => `${g.name} ${g.stop - g.start}`).join(" | ") + " · peach: compressed row dropped by the indexer";
  };
  const hover = (ev) => {
    const rect = canvas.getBoundingClientRect();
    const c = Math.floor(((ev.clientX - rect.left) / rect.width) * model.get("cols"));
    const r = Math.floor(((ev.clientY - rect.top) / rect.height) * model.get("rows"));
    const buf = bytes(model.get("buf")), i = r * model.get("cols") + c;
    const rl = model.get("row_labels")[r] ?? "", cl = model.get("col_labels")[c] ?? "";
    tip.textContent = `${rl} → ${cl}: ${(((buf[i] || 0) / 255) * model.get("vmax")).toPrecision(3)}`;
  };
  draw();
  const events = ["buf", "marks", "rows", "cols", "groups", "title"].map((k) => `change:${k}`);
  for (const e of events) model.on(e, draw);
  canvas.addEventListener("mousemove", hover);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, draw);
    canvas.removeEventListener("mousemove", hover);
  };
}
export default { render };
