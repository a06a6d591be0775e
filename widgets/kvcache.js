// KVCacheView: per layer the raw ring (slot -> position), compressed and indexer rows, pending state, bytes.
function cells(n, cls, titles, max = 600) {
  let h = "";
  for (let i = 0; i < Math.min(n, max); i++) h += `<div class="ds4-cell ${cls(i)}" title="${titles(i)}"></div>`;
  return h + (n > max ? `<span class="ds4-note">… ${n - max} more</span>` : "");
}
function render({ model, el }) {
  el.classList.add("ds4-view");
  const draw = () => {
    const d = model.get("data");
    if (!d || !d.layers) { el.innerHTML = "<div class='ds4-note'>empty</div>"; return; }
    let h = `<div class="ds4-title">KV cache: ${d.n_tokens} tokens, ${d.total_bytes.toLocaleString()} bytes` +
      (d.label ? ` — ${d.label}` : "") + `</div>`;
    h += `<div class="ds4-note">raw ring ${d.raw_cap} slots (position p → slot p mod ${d.raw_cap}); window ${d.window}; ` +
      `<span class="ds4-cell live" style="display:inline-block"></span> in window <span class="ds4-cell stale" style="display:inline-block"></span> evicted from the window ` +
      `<span class="ds4-cell comp" style="display:inline-block"></span> compressed <span class="ds4-cell index" style="display:inline-block"></span> indexer ` +
      `<span class="ds4-cell pending" style="display:inline-block"></span> pending; outlined: written by the last step</div>`;
    for (const L of d.layers) {
      h += `<div class="ds4-layer"><b>layer ${L.layer}</b> ratio ${L.ratio || "— (raw only)"} · ${L.bytes.toLocaleString()} bytes`;
      h += `<div>raw ring: live ${L.live[0]}–${L.live[1]}${L.evicted ? `, ${L.evicted} positions evicted` : ""}</div>`;
      h += `<div class="ds4-strip">` + cells(L.slots.length, (i) => {
        const p = L.slots[i];
        if (p < 0) return "";
        return (p >= L.live[0] ? "live" : "stale") + (p >= d.new_from ? " new" : "");
      }, (i) => `slot ${i}: ${L.slots[i] < 0 ? "empty" : "position " + L.slots[i]}`) + `</div>`;
      if (L.ratio) {
        const win = (c) => [Math.max(0, c * L.ratio - (L.ratio === 4 ? 4 : 0)), c * L.ratio + L.ratio - 1];
        h += `<div>compressed rows: ${L.n_comp} (one per ${L.ratio} tokens)</div><div class="ds4-strip">` +
          cells(L.n_comp, (c) => "comp" + ((c + 1) * L.ratio > d.new_from ? " new" : ""),
                (c) => `row ${c}: pools tokens ${win(c)[0]}–${win(c)[1]}`) + `</div>`;
        if (L.n_index !== null) {
          h += `<div>indexer rows: ${L.n_index}${L.n_index > d.idx_topk ? ` — each query attends its top ${d.idx_topk}` : ` (≤ top-k ${d.idx_topk}: all visible)`}</div>` +
            `<div class="ds4-strip">` + cells(L.n_index, () => "index", (c) => `indexer row ${c}: tokens ${win(c)[0]}–${win(c)[1]}`) + `</div>`;
        }
        h += `<div>pending: ${L.pending.length} of ${L.ratio} tokens of window ${L.n_comp}` +
          (L.pending.length ? ` (positions ${L.pending[0]}–${L.pending[L.pending.length - 1]})` : "") + `</div><div class="ds4-strip">` +
          cells(L.ratio, (i) => (i < L.pending.length ? "pending" : ""), (i) => (i < L.pending.length ? `position ${L.pending[i]}` : "empty")) + `</div>`;
      }
      h += "</div>";
    }
    el.innerHTML = h;
  };
  draw();
  model.on("change:data", draw);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => model.off("change:data", draw);
}
export default { render };
