"""How large a context AttentionView stays interactive at, on the embedded model (NumPy backend).

    python benchmarks/attention_view_scaling.py [--ctx 512 1024 2048 4096] [--chunk 512] [--heads 2]
                                                [--text FILE] [--no-browser] [--budget-ms 100] [--budget-mb 2]

For each context T the script prefills T − 1 tokens (one slot stays free to generate) of a text
(tinyshakespeare by default) while capturing ``attn.scores`` of layers 2 (ratio 4, indexer) and 3 (ratio 128)
for every query and ``--heads`` heads, then builds ``AttentionView(cap, layer=2)``: a figure of fixed size whose
cells are max-pooled only past 3 px (at most 160 × 232 cells whatever T is). Columns:

- ``prefill s``: the same prefill without a capture; ``capture s``: with it (the capture materialises every
  chunk's weights next to the fused path);
- ``view ms``: ``AttentionView(...)`` (layer 2's map built, reduced, labelled, the head multiples), wall time;
  then the CPU time of this process (``time.process_time``; on a shared machine the wall time also counts waiting
  for a core): ``first layer ms``, the first switch to layer 3 (its map built from the capture's records);
  ``layer ms``, the median of 5 switches between layers already shown (maps, head multiples and mass splits
  cached; the heatmap reduced again each time); ``head ms``, the first switch to head 1 (its mass split computed);
  ``zoom ms``, zooming into a quarter of the queries and keys (re-reduced from the full weights); ``static ms``:
  the static fallback (PNG figure) of the mimebundle, wall time;
- ``map MB``: the float64 weights of one layer's map, ``[queries, heads, raw + compressed + 1]``;
- ``cells``: the heatmap sent; ``binary KB``: the buffers sent to the browser (colour indices, float32 weights,
  marks, head multiples), ``json KB``: the rest of the widget state (geometry, labels, ticks, mass split),
  ``html KB``: the static fallback saved in the notebook;
- with Chromium (Debian's ``/usr/bin/chromium`` or ``$DS4LAB_CHROMIUM``, and playwright), the front-end
  (``widgets/attention.js``) on a bare page with the same state: ``draw ms`` is ``render()`` (the figure drawn;
  after a warm-up call), ``frame ms`` until the next frame is painted, ``hover ms`` the median / max time the
  view's mousemove handler takes to fill the tooltip (Playwright's ``mouse.move``, 40 positions on the heatmap),
  ``hover frame ms`` the median time from the mouse event to the next painted frame (taken after two animation
  frames, so about 2 frames at 60 Hz is the floor). JupyterLab's own costs (the websocket message, the widget
  manager) are not in these.

The last line names the largest context whose layer and head switches (maps built) take at most ``--budget-ms``
of Python CPU time and whose payload (binary + JSON) is at most ``--budget-mb``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import ds4lab
from ds4lab.viz import AttentionView
from ds4lab.viz.base import STYLESHEET, widgets_dir

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "data" / "tinyshakespeare.txt"  # the repository's own copy (data/README.md)
CHROMIUM = os.environ.get("DS4LAB_CHROMIUM", "/usr/bin/chromium")
VIEWPORT = {"width": 1400, "height": 1200}


def timed(f, *a, **kw):
    began = time.perf_counter()
    out = f(*a, **kw)
    return out, time.perf_counter() - began


def widget_payload(model) -> tuple[int, int, dict]:
    """(bytes of binary buffers, bytes of the JSON state, the state) that the widget sends to the browser."""
    state = {k: getattr(model, k) for k in model.keys if not k.startswith("_") and k not in ("layout", "comm")}
    state = {k: v for k, v in state.items() if isinstance(v, (bytes, str, int, float, list, dict))}
    binary = {k: v for k, v in state.items() if isinstance(v, bytes)}
    rest = {k: v for k, v in state.items() if k not in binary}
    return sum(map(len, binary.values())), len(json.dumps(rest).encode()), state


def cpu_ms(f, *a, **kw) -> float:
    """The process's CPU time for one call, in ms: on a shared machine the wall time also counts waiting for a core."""
    began = time.process_time()
    f(*a, **kw)
    return (time.process_time() - began) * 1e3


def measure(model, ids, T, chunk, heads):
    """One row for a capture of T − 1 tokens, and the state of its view (layer 2, head 0)."""
    sess = model.session(ctx=T, prefill_chunk=chunk)
    _, t_prefill = timed(lambda: sess.prefill(ids[: T - 1]).run(progress=False))
    sess = model.session(ctx=T, prefill_chunk=chunk)
    with sess.capture(["attn.scores"], layers=[2, 3], heads=list(range(heads))) as cap:
        _, t_capture = timed(lambda: sess.prefill(ids[: T - 1]).run(progress=False))
    view, t_view = timed(AttentionView, cap, layer=2, head=0)
    m = view.model
    binary, js, state = widget_payload(m)
    row = dict(T=T, prefill=t_prefill, capture=t_capture, view=t_view * 1e3, map_mb=view.map(2).weights.nbytes / 2**20,
               cells=f"{m.rows}×{m.cols}", binary_kb=binary / 1024, json_kb=js / 1024)
    bundle, t_static = timed(view._repr_mimebundle_)
    row["static"], row["html_kb"] = t_static * 1e3, len(bundle["text/html"].encode()) / 1024
    row["first_layer"] = cpu_ms(view.show, 3, 0)
    row["layer"] = statistics.median(cpu_ms(view.show, L, 0) for L in (2, 3, 2, 3, 2))
    row["head"] = cpu_ms(view.show, 2, 1) if heads > 1 else float("nan")
    view.show(2, 0)
    Q, K = view.weights().shape
    row["zoom"] = cpu_ms(view.zoom, (Q // 4, Q // 2), (K // 4, K // 2))
    view.reset_zoom()  # the state of layer 2, head 0, whole, goes to the browser
    row["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row, state


PAGE_JS = """
async ({state, bin}) => {
  const dec = (s) => { const b = atob(s), a = new Uint8Array(b.length);
                       for (let i = 0; i < b.length; i++) a[i] = b.charCodeAt(i); return new DataView(a.buffer); };
  const st = {...state};
  for (const [k, v] of Object.entries(bin)) st[k] = dec(v);
  const model = {get: (k) => st[k], on: () => {}, off: () => {}, set: () => {}, save_changes: () => {}};
  const el = document.createElement("div");
  document.body.replaceChildren(el);
  const frame = () => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  window.__attention.render({model, el: document.createElement("div")});  // warm up (JIT), off the page
  await frame();
  const t0 = performance.now();
  window.__attention.render({model, el});
  const t1 = performance.now();
  await frame();
  const t2 = performance.now();
  const canvas = el.querySelector(".ds4-att-stage canvas"), tip = el.querySelector(".ds4-tip");
  const box = canvas.getBoundingClientRect(), g = st.geometry;
  window.__hover = [];
  let start = 0;
  canvas.addEventListener("mousemove", () => { start = performance.now(); }, {capture: true});  // before the view's
  canvas.addEventListener("mousemove", (ev) => {   // after the view's own handler (added first)
    const done = performance.now();
    requestAnimationFrame(() => requestAnimationFrame(() =>
      window.__hover.push({handler: done - start, frame: performance.now() - ev.timeStamp, tip: tip.textContent})));
  });
  // the heatmap's box on the page
  return {draw: t1 - t0, frame: t2 - t0, x: box.left + g.left, y: box.top + g.top, w: g.hw, h: g.hh};
}
"""


def browser_times(states, moves: int = 40) -> dict[int, dict] | str:
    """Front-end timings per context, or why there are none."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM}"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "playwright is not installed"
    js = (widgets_dir() / "attention.js").read_text()
    js = js.replace("export default { render };", "window.__attention = { render };")
    css = (widgets_dir() / STYLESHEET).read_text()
    out = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_content(f"<html><head><style>{css}</style></head><body></body></html>")
            page.add_script_tag(content=js)
            for key, state in states.items():
                plain = {k: v for k, v in state.items() if not isinstance(v, bytes)}
                bin_ = {k: base64.b64encode(v).decode() for k, v in state.items() if isinstance(v, bytes)}
                r = page.evaluate(PAGE_JS, dict(state=plain, bin=bin_))
                w, h = r["w"], r["h"]  # positions spread over the heatmap
                for i in range(moves):
                    fx, fy = (0.05 + 0.9 * ((i * 7) % moves) / moves), (0.05 + 0.9 * ((i * 13) % moves) / moves)
                    page.mouse.move(r["x"] + fx * w, r["y"] + fy * h)
                    page.wait_for_function(f"window.__hover.length >= {i + 1}", timeout=30_000)
                hover = page.evaluate("window.__hover")
                assert all("→" in h["tip"] for h in hover), hover[:2]
                handler = [h["handler"] for h in hover]
                out[key] = dict(draw=r["draw"], frame=r["frame"], hover=statistics.median(handler),
                                hover_max=max(handler), hover_frame=statistics.median(h["frame"] for h in hover))
        finally:
            browser.close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--heads", type=int, default=2, help="heads captured (the view switches between them)")
    ap.add_argument("--text", type=Path, default=TEXT, help="text to prefill (default: data/tinyshakespeare.txt)")
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument("--budget-ms", type=float, default=100.0, help="Python CPU time of a layer or head switch")
    ap.add_argument("--budget-mb", type=float, default=2.0, help="what the widget sends to the browser")
    args = ap.parse_args(argv)
    if not args.text.is_file():
        sys.exit(f"{args.text}: no such file (pass --text FILE)")
    model = ds4lab.load(backend="numpy")
    limit = model.config.context_length
    ids = model.tokenizer.encode(args.text.read_text(encoding="utf-8")[: 16 * max(args.ctx)])
    ctxs = [T for T in args.ctx if T <= min(limit or T, len(ids))]
    print(f"{model}; text {args.text.name}: {len(ids)} tokens; contexts {ctxs}; chunk {args.chunk}; "
          f"{args.heads} heads of layers 2 and 3 captured", file=sys.stderr)
    rows, states = [], {}
    for T in ctxs:
        row, states[T] = measure(model, ids, T, args.chunk, args.heads)
        rows.append(row)
        print(f"  {T}: done ({row['capture']:.1f} s capture)", file=sys.stderr)
    web = {} if args.no_browser else browser_times(states)
    if isinstance(web, str):
        print(f"browser: skipped ({web})", file=sys.stderr)
        web = {}
    head = ("ctx", "prefill s", "capture s", "view ms", "first layer ms", "layer ms", "head ms", "zoom ms", "static ms",
            "map MB", "cells", "binary KB", "json KB", "html KB", "draw ms", "frame ms", "hover ms (med/max)",
            "hover frame ms", "max RSS MB")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        w = web.get(r["T"])
        cells = [r["T"], f"{r['prefill']:.2f}", f"{r['capture']:.2f}", f"{r['view']:.0f}", f"{r['first_layer']:.0f}",
                 f"{r['layer']:.0f}", f"{r['head']:.0f}", f"{r['zoom']:.0f}", f"{r['static']:.0f}",
                 f"{r['map_mb']:.0f}", r["cells"], f"{r['binary_kb']:.0f}", f"{r['json_kb']:.0f}",
                 f"{r['html_kb']:.0f}",
                 f"{w['draw']:.1f}" if w else "-", f"{w['frame']:.1f}" if w else "-",
                 f"{w['hover']:.2f} / {w['hover_max']:.2f}" if w else "-", f"{w['hover_frame']:.1f}" if w else "-",
                 f"{r['rss_mb']:.0f}"]
        print("| " + " | ".join(map(str, cells)) + " |")
    ok = [r["T"] for r in rows if max(r["layer"], r["head"]) <= args.budget_ms
          and (r["binary_kb"] + r["json_kb"]) / 1024 <= args.budget_mb]
    print(f"largest context interactive (layer and head switch ≤ {args.budget_ms:g} ms of Python CPU, payload ≤ "
          f"{args.budget_mb:g} MB): {max(ok) if ok else 'none'} of {ctxs}")


if __name__ == "__main__":
    main()
