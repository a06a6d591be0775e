// KVCacheView: the raw ring buffer (slots in a circle: the position each holds, the raw window, the write
// pointer, what was overwritten) and per layer its compressed rows, indexer rows and the group still pending.
// a strip of n cells in lines of PER, each line led by its first index where there is more than one line (a
// teacher can point at "row 47"; a strip wrapped at the column's edge split the rows anywhere)
const PER = 40;  // 80 rows (a 320-token prompt's ratio-4 layer) in two lines of a laptop's column
function cells(n, cls, tips, max = 600) {
  let h = "";
  for (let i = 0; i < Math.min(n, max); i++) {
    if (i % PER === 0) h += (i ? "</div>" : "") + `<div class="ds4-stripline">` + (n > PER ? `<span class="ds4-stripno">${i}</span>` : "");
    h += `<div class="ds4-cell ${cls(i)}" data-tip="${tips(i)}"></div>`;
  }
  return h + (n ? "</div>" : "") + (n > max ? `<span class="ds4-note">… ${n - max} more</span>` : "");
}
function ring(d) {
  // slot s at angle s/cap of a turn, clockwise from the top
  const cap = d.raw_cap, S = 240, c = S / 2, r1 = 82, r0 = 58, T = d.n_tokens;
  const pt = (s, r) => { const a = (2 * Math.PI * s) / cap - Math.PI / 2; return [c + r * Math.cos(a), c + r * Math.sin(a)]; };
  // slots added on each side of a band of slots the step shown wrote, so it is 3 px wide at least (a slot of a
  // 512-slot ring is 1 px there: one decode step's band was all but invisible)
  const widen = Math.max(0, (3 * cap) / (2 * Math.PI * (r1 + 4)) - 1) / 2;
  let h = `<svg class="ds4-ring" width="${S}" height="${S}" viewBox="0 0 ${S} ${S}">`;
  for (let s = 0; s < cap; s++) {
    const p = d.slots[s];
    const cls = p < 0 ? "empty" : p >= T - d.window ? "live" : "stale";
    const [a, b] = [pt(s, r0), pt(s, r1)], [e, f] = [pt(s + 1, r1), pt(s + 1, r0)];
    const tip = p < 0 ? `slot ${s}: empty` : `slot ${s}: position ${p}` + (p >= T - d.window ? " (in the raw window)" : " (in the ring, outside the window)") +
      (p >= d.new_from ? ", written by this step" : "") + (p >= cap ? `, overwrote position ${p - cap}` : "");
    h += `<path class="ds4-slot ${cls}" d="M${a} L${b} A${r1},${r1} 0 0 1 ${e} L${f} A${r0},${r0} 0 0 0 ${a} Z" ` +
      `data-tip="${tip}"/>`;
    if (p >= 0 && p >= d.new_from) {  // written by the step shown: an orange band just outside the slot (widened)
      const [g, k] = [pt(s - widen, r1 + 2), pt(s + 1 + widen, r1 + 2)];
      const [m, n] = [pt(s + 1 + widen, r1 + 6), pt(s - widen, r1 + 6)];
      h += `<path class="ds4-slot-new" d="M${g} A${r1 + 2},${r1 + 2} 0 0 1 ${k} L${m} ` +
        `A${r1 + 6},${r1 + 6} 0 0 0 ${n} Z" data-tip="${tip}"/>`;
    }
  }
  // positions written on the ring: every cap/8 slots, outside the circle
  for (let s = 0; s < cap; s += cap / 8) {
    const [x, y] = pt(s + 0.5, r1 + 18), p = d.slots[s];
    if (p >= 0) h += `<text x="${x}" y="${y}" class="ds4-ringlabel">${p}</text>`;  // an empty slot has no position
  }
  // the write pointer: through the middle of the next position's slot, ending at the ring's edge (past it, it hid
  // the band of the slot written last, its neighbour); none once the context is full
  if (!d.full) {
    // the ▲ at the line's inner end, clear of the centre's text (10 px, so that "next: slot 192" ends 6 px short of it)
    const m = d.pointer + 0.5, [px, py] = pt(m, r0 - 2), [qx, qy] = pt(m, r1), [tx, ty] = pt(m, r0 - 5);
    const turn = (360 * m) / cap;  // the ▲ turned to point out along the pointer, at the slot it names
    h += `<line x1="${px}" y1="${py}" x2="${qx}" y2="${qy}" class="ds4-pointer"/>` +
      `<text x="${tx}" y="${ty}" transform="rotate(${turn} ${tx} ${ty})" class="ds4-ringlabel ds4-pointer-label">▲</text>`;
  }
  h += `<text x="${c}" y="${c - 14}" class="ds4-ringcentre">${cap} slots</text>` + (d.full
    ? `<text x="${c}" y="${c}" class="ds4-ringcentre">context full:</text>` +
      `<text x="${c}" y="${c + 14}" class="ds4-ringcentre">no next position</text>`
    : `<text x="${c}" y="${c}" class="ds4-ringcentre">next: slot ${d.pointer}</text>` +
      `<text x="${c}" y="${c + 14}" class="ds4-ringcentre">(position ${T})</text>`);
  return h + "</svg>";
}
// the pending bar's tooltip: what its line above does not say, the group's tokens and what becomes of them
const pendTip = (L, R) =>
  `row ${L.n_comp}: tokens ${L.n_comp * R}–${L.n_comp * R + R - 1}, compressed into it when the last one comes`;
function render({ model, el }) {
  el.classList.add("ds4-view", "ds4-kv");
  const body = document.createElement("div");
  el.append(body);
  const tips = pointerTip(el);  // a slot's or a row's text beside the pointer
  const draw = () => {
    const d = model.get("data"), only = model.get("layers"), compact = model.get("compact");
    el.classList.toggle("ds4-compact", compact);  // views.css sizes a compact view's ring apart
    const keyOpen = !!body.querySelector("details.ds4-keybox[open]");  // a compact view's key, unfolded: kept so
    if (!d || !d.layers) { body.innerHTML = "<div class='ds4-note'>empty</div>"; return; }
    const T = d.n_tokens, lo = Math.max(0, T - d.window);
    const bytes = `<div class="ds4-note">the total: the layers below plus ${d.other_bytes.toLocaleString()} bytes for the header, the token ` +
      `ids (4 B each) and the next token's logits (4&nbsp;B&nbsp;×&nbsp;${d.n_vocab.toLocaleString()})</div>`;
    let h = `<div class="ds4-title">KV cache ${d.label ? d.label + ": " : ""}${T} tokens, ${d.total_bytes.toLocaleString()} bytes</div>` +
      // a fresh state's bytes puzzle without this: its compressors' pending state is there before any token
      (T ? "" : `<div class="ds4-note">no token yet: these bytes are what a state holds from the start (the compressors' ` +
        `pending state on the compressed layers, the header, the logits)</div>`);
    let key = `<b>raw ring</b> (every layer holds the same positions): position p goes to slot p mod ${d.raw_cap}; the numbers ` +
      `around it are the positions those slots hold` + (d.raw_cap > d.window ? `. ${d.raw_cap} slots for a window of ${d.window}: ` +
      `a chunk's own rows and the window before them fit at once` : "") + `.<br>` +
      `<span class="ds4-swatch live"></span> in the raw window: positions ${T ? fromTo(lo, T - 1) : "none"} (the last ${d.window})<br>` +
      `<span class="ds4-swatch stale"></span> in the ring, outside the window<br>` +
      (T < d.raw_cap ? `<span class="ds4-swatch empty"></span> empty: no position written there yet<br>` : "") +
      (d.new_from < T ? `<span class="ds4-swatch new"></span> written by the step shown (${d.new_from === T - 1 ? `position ${T - 1}` : `positions ${fromTo(d.new_from, T - 1)}`}): arc, bars under rows<br>` :
        `showing the whole cache after ${T} tokens (no step marked)<br>`) +
      (d.full ? `▲ write pointer: none, the context is full (${T} positions)<br>` :
        `▲ write pointer: slot ${d.pointer} takes position ${T} next<br>`) +
      (d.evicted ? `overwritten (evicted): positions 0–${d.evicted - 1}` : `nothing overwritten yet (the ring wraps at position ${d.raw_cap})`);
    // the compressed rows' colours, once for the layers shown, in the room beside the ring
    const shown = d.layers.filter((L) => !only || only.includes(L.layer)), q = T - 1;
    // an indexer chooses where a query sees more compressed rows than its top k; below that it attends them all
    const chooses = (L) => L.n_index !== null && L.n_index > d.idx_topk;
    const picks = shown.some((L) => L.picked && chooses(L));
    if (shown.some((L) => L.ratio)) {  // each swatch kept on the line of the words it keys (ds4-nowrap)
      key += `<div class="ds4-key-comp"><b>compressed rows</b>: <span class="ds4-nowrap"><span class="ds4-swatch comp"></span> a row</span> pooled from its group of ` +
        `tokens` + (picks ? `; on an indexer's layer, for the last query (position ${q}), those it attends stay green and ` +
        `those the indexer drops are <span class="ds4-nowrap"><span class="ds4-swatch dropped"></span> salmon</span> (as in the attention and mask views)` : "") +
        (shown.some((L) => L.n_index !== null) ? ` · <span class="ds4-nowrap"><span class="ds4-swatch index"></span> the indexer's</span> own rows: keys only, a query's scores of them pick the ` +
          `compressed rows it attends` : "") +
        ` · <span class="ds4-nowrap"><span class="ds4-swatch pending"></span> tokens pending</span>: the next row's new tokens, not yet compressed</div>`;
    }
    // compact (beside another view, as in the PrefillView): the key and the bytes folded under one line, so the
    // ring and the layer's rows keep the height of the view beside them; a reader unfolds it, and it stays so
    h += compact ? `<div class="ds4-ringbox">${ring(d)}<details class="ds4-note ds4-keybox"${keyOpen ? " open" : ""}>` +
      `<summary>key: the colours, the bytes</summary>${bytes}${key}</details></div>` :
      `${bytes}<div class="ds4-ringbox">${ring(d)}<div class="ds4-note">${key}</div></div>`;
    h += `<div class="ds4-layers">`;
    for (const L of shown) {
      const R = L.ratio, grp = (c) => [Math.max(0, c * R - (R === 4 ? 4 : 0)), c * R + R - 1];
      // the indexer's choice for the last query, where known and where it chose (else the rows are drawn as
      // compressed rows): the rows it attends and those it dropped
      const choice = L.picked && chooses(L) ? new Set(L.picked) : null;
      const read = (c) => (!choice ? "" : choice.has(c) ? `, attended by the last query (${q})` : `, dropped by the indexer for the last query (${q})`);
      h += `<div class="ds4-layer"><b>layer ${L.layer}</b> · ${R ? `ratio ${R}${L.n_index !== null ? ", indexer" : ""}` : "raw only"} · ${L.bytes.toLocaleString()} bytes`;
      if (R) {
        // the rows the last query reads (on an indexer's layer: its top k, where the choice was captured)
        const reads = choice ? `<div>the last query (${q}) reads the ${choice.size} the indexer picked</div>` : "";
        // the range's ends and "to" joined by no-break spaces: a line broken inside it read as a cut-off text
        // row c's (a ratio-4 row also takes the group before its own: the pending group's line names its tokens)
        const pools = `tokens ${R === 4 ? "4c−4" : `${R}c`}&nbsp;to&nbsp;${R}c+${R - 1}`;
        h += `<div>${L.n_comp ? `${plural(L.n_comp, "compressed row")}, row c pooling ${pools}` : `no compressed row yet: row c will pool ${pools}`}</div>` +
          reads + `<div class="ds4-strip">` + cells(L.n_comp, (c) => "comp" + (!choice ? "" : choice.has(c) ? " kept" : " dropped") + ((c + 1) * R > d.new_from ? " new" : ""),
                (c) => `row ${c}: pools tokens ${grp(c)[0]}–${grp(c)[1]}${read(c)}`) + `</div>`;
        if (L.n_index !== null) {
          // indexer rows are keys only: a query attends the compressed rows their scores pick
          // one line in a column of the laptop's two (tests/test_browser.py): the cells' tips say the rest
          const scoring = !chooses(L) ? ` (≤ ${d.idx_topk}: all compressed rows attended)` :
            `, scored to pick a query's top ${d.idx_topk}` + (choice ? "" :
              `; to see the last query's (${q}) picks, pass the view indexer=… (see notebook 04)`);
          h += `<div>${plural(L.n_index, "indexer row")}${scoring}</div>` +
            `<div class="ds4-strip">` + cells(L.n_index, (c) => "index" + ((c + 1) * R > d.new_from ? " new" : ""), (c) => `indexer row ${c}: tokens ${grp(c)[0]}–${grp(c)[1]}, the key that scores compressed row ${c}`) + `</div>`;
        }
        // named as the rows above are (row c, the tokens it pools), the new ones counted
        h += `<div>row ${L.n_comp} pending (tokens ${fromTo(...grp(L.n_comp))}): ${L.pending.length}/${R} new tokens` +
          (L.pending.length ? ` in (${fromTo(L.pending[0], L.pending.at(-1))})` : " yet") + `</div>` +
          (R <= 16 ? `<div class="ds4-strip">` + cells(R, (i) => (i < L.pending.length ? "pending" : ""), (i) => (i < L.pending.length ? `position ${L.pending[i]}` : "empty")) + `</div>` :
           `<div class="ds4-bar ds4-pendbar" data-tip="${esc(pendTip(L, R))}">` +
             `<div style="width:${(100 * L.pending.length) / R}%"></div></div>`);
      }
      h += "</div>";
    }
    body.innerHTML = h + "</div>";
    layersBox.hold();
  };
  // compact (one layer beside another view): the layers' box keeps the tallest it has been, so a layer of fewer
  // rows (raw only) moves nothing under the view
  const layersBox = keepTallest(body, () => (model.get("compact") ? body.querySelector(".ds4-layers") : null));
  const redraw = () => { draw(); tips.describe(); };  // the tooltip describes what is under the pointer now
  draw();
  const events = ["data", "layers", "compact"].map((k) => `change:${k}`);
  for (const e of events) model.on(e, redraw);
  // anywidget calls the returned cleanup when the view is removed: it undoes everything render registered
  return () => {
    for (const e of events) model.off(e, redraw);
    layersBox.disconnect();
    tips.remove();
  };
}
export default { render };
