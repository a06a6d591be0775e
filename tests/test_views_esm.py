"""Each view's ESM (widgets/*.js) in headless Chromium, without JupyterLab: imported as anywidget imports it (a
blob: URL), its ``render`` given a stand-in model that holds the state of a real view (made here on the nano
model) and an element in the page. The ESM must draw, survive a change of every trait it listens to, and return
its cleanup, which anywidget calls when the view is removed: after it, nothing that render registered is left
(model listeners, DOM listeners anywhere, intervals, pending timeouts and animation frames, observers).

Needs Debian's ``chromium`` (or ``$DS4LAB_CHROMIUM``) and playwright, as tests/test_browser.py does; skips,
saying what is missing, without them.
"""

import base64
import json
import os

import numpy as np
import pytest

pytest.importorskip("anywidget")
import ds4lab  # noqa: E402
from ds4lab.tiers import Placement  # noqa: E402
from ds4lab.viz import AttentionView, ExpertView, GenerationView, KVCacheView, PrefillView, TierView  # noqa: E402
from ds4lab.viz.base import STYLESHEET, ViewModel, widgets_dir  # noqa: E402

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("DS4LAB_CHROMIUM", "/usr/bin/chromium")

# Instruments the page before the ESM is imported: every registration render can make is counted until undone.
INSTRUMENT = """
() => {
  const live = { dom: new Map(), intervals: new Set(), timeouts: new Set(), frames: new Set(), observers: new Set() };
  window.__live = live;
  const key = (t, type, fn, opts) => [t, type, fn, !!(typeof opts === "boolean" ? opts : opts && opts.capture)];
  const domKeys = [];
  const find = (k) => domKeys.findIndex((x) => x.every((v, i) => v === k[i]));
  const add = EventTarget.prototype.addEventListener, remove = EventTarget.prototype.removeEventListener;
  EventTarget.prototype.addEventListener = function (type, fn, opts) {
    const k = key(this, type, fn, opts);
    if (window.__recording && find(k) < 0) domKeys.push(k);
    return add.call(this, type, fn, opts);
  };
  EventTarget.prototype.removeEventListener = function (type, fn, opts) {
    const i = find(key(this, type, fn, opts));
    if (i >= 0) domKeys.splice(i, 1);
    return remove.call(this, type, fn, opts);
  };
  live.domCount = () => domKeys.length;
  live.domList = () => domKeys.map(([t, type]) => `${t.constructor.name}.${type}`);
  const [si, ci, st, ct, raf, caf] = [setInterval, clearInterval, setTimeout, clearTimeout,
                                      requestAnimationFrame, cancelAnimationFrame];
  window.setInterval = (...a) => { const id = si(...a); if (window.__recording) live.intervals.add(id); return id; };
  window.clearInterval = (id) => { live.intervals.delete(id); ci(id); };
  window.setTimeout = (fn, ...a) => {
    const run = (...b) => { live.timeouts.delete(id); return typeof fn === "function" ? fn(...b) : undefined; };
    const id = st(run, ...a);
    if (window.__recording) live.timeouts.add(id);
    return id;
  };
  window.clearTimeout = (id) => { live.timeouts.delete(id); ct(id); };
  window.requestAnimationFrame = (fn) => {
    const id = raf((t) => { live.frames.delete(id); fn(t); });
    if (window.__recording) live.frames.add(id);
    return id;
  };
  window.cancelAnimationFrame = (id) => { live.frames.delete(id); caf(id); };
  for (const name of ["ResizeObserver", "MutationObserver", "IntersectionObserver"]) {
    const Base = window[name];
    window[name] = class extends Base {
      observe(...a) { if (window.__recording) live.observers.add(this); return super.observe(...a); }
      disconnect() { live.observers.delete(this); return super.disconnect(); }
    };
  }
}
"""

# A stand-in for anywidget's model holding a view's state (bytes as {"__bytes__": base64}), and the listeners
# render registers on it, by event name.
STAND_IN = """
const standIn = (state) => {
  const decode = (v) => (v && v.__bytes__ !== undefined)
    ? new DataView(Uint8Array.from(atob(v.__bytes__), (c) => c.charCodeAt(0)).buffer) : v;
  const values = Object.fromEntries(Object.entries(state).map(([k, v]) => [k, decode(v)]));
  const handlers = new Map();
  const model = {
    get: (k) => values[k],
    set: (k, v) => { values[k] = v; },
    save_changes: () => {},
    send: () => {},
    on: (name, fn) => { if (!handlers.has(name)) handlers.set(name, new Set()); handlers.get(name).add(fn); },
    off: (name, fn) => {
      if (name === undefined || name === null) { handlers.clear(); return; }
      if (fn === undefined) { handlers.delete(name); return; }
      if (handlers.has(name)) handlers.get(name).delete(fn);
    },
  };
  return { model, handlers };
};
"""

# Imports the ESM, renders it into a fresh element with a stand-in model, fires every event it listens to, calls
# its cleanup; reports what was registered before and what is left after.
RENDER = "async ([src, state]) => {" + STAND_IN + """
  const { model, handlers } = standIn(state);
  const count = () => [...handlers.values()].reduce((n, s) => n + s.size, 0);
  const live = window.__live;
  const snapshot = () => ({ model: count(), dom: live.domCount(), domList: live.domList(),
    intervals: live.intervals.size, timeouts: live.timeouts.size, frames: live.frames.size,
    observers: live.observers.size });
  const url = URL.createObjectURL(new Blob([src], { type: "text/javascript" }));
  const mod = await import(url);
  const el = document.createElement("div");
  document.body.append(el);
  window.__recording = true;
  const cleanup = await mod.default.render({ model, el });
  const events = [...handlers.keys()];
  for (const [, fns] of handlers) for (const fn of [...fns]) fn();  // as a change of that trait does
  const drawn = el.innerHTML.length;
  const during = snapshot();
  if (typeof cleanup === "function") await cleanup();
  window.__recording = false;
  return { cleanup: typeof cleanup, drawn, events, during, after: snapshot(), rootClass: el.className };
}
"""

# Renders the ESM with the stylesheet into an element of a given width and leaves it drawn: for layout checks.
SHOW = "async ([src, state, css, width]) => {" + STAND_IN + """
  const style = document.createElement("style"); style.textContent = css; document.head.append(style);
  const el = document.createElement("div"); el.style.width = `${width}px`; document.body.append(el);
  const mod = await import(URL.createObjectURL(new Blob([src], { type: "text/javascript" })));
  await mod.default.render({ model: standIn(state).model, el });
}
"""


def _view_traits(widget) -> list[str]:
    """The synced traits a view's model adds to every widget's."""
    return sorted(set(widget.traits(sync=True)) - set(ViewModel.class_traits(sync=True)) - {"_esm", "_css"})


def _json_state(widget) -> dict:
    """The view's traits of an anywidget model, bytes as {"__bytes__": base64}."""
    out = {}
    for name in _view_traits(widget):
        v = getattr(widget, name)
        out[name] = {"__bytes__": base64.b64encode(bytes(v)).decode()} if isinstance(v, bytes) else v
    return json.loads(json.dumps(out))


@pytest.fixture(scope="module")
def models(model_paths):
    """One real view of each kind, on the nano model: {esm file: its anywidget model}."""
    model = ds4lab.load(model_paths["nano"], backend="numpy")
    ids = ((np.arange(80) * 7 + 3) % (model.config.n_vocab - 10) + 5).tolist()
    sess = model.session(ctx=256, prefill_chunk=32)
    kv = KVCacheView(sess)
    prefill = PrefillView(sess, ids, kv_view=kv)
    prefill.run()
    att = model.session(ctx=256, prefill_chunk=32)
    with att.capture(["attn.scores"], layers=[2], heads=[0]) as cap:
        att.prefill(ids).run(progress=False)
    tiered = model.session(ctx=256, prefill_chunk=32, placement=Placement.even(2))
    generation = GenerationView(tiered, ids[:40], max_tokens=4, seed=3)
    generation.run()
    views = [prefill, kv, AttentionView(cap, layer=2), ExpertView.from_prompt(model.session(ctx=256), ids),
             generation, TierView(tiered)]
    names = ["prefill.js", "kvcache.js", "attention.js", "experts.js", "generation.js", "tiers.js"]
    return {name: v.model for name, v in zip(names, views)}


@pytest.fixture
def page():
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium binary at {CHROMIUM} (apt-get install chromium, or set DS4LAB_CHROMIUM)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[browser]')")
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        except PlaywrightError as e:
            pytest.skip(f"Chromium at {CHROMIUM} did not start under Playwright: {str(e)[:500]}")
        try:
            pg = browser.new_page()
            errors = []
            pg.on("pageerror", lambda e: errors.append(e))
            pg.set_content("<!doctype html><html><body></body></html>")
            pg.evaluate(INSTRUMENT)
            yield pg, errors
        finally:
            browser.close()


@pytest.mark.parametrize("name", ["prefill.js", "kvcache.js", "attention.js", "experts.js", "generation.js",
                                  "tiers.js"])
def test_render_returns_a_cleanup_that_undoes_it(page, models, name):
    pg, errors = page
    widget = models[name]
    r = pg.evaluate(RENDER, [widget._esm, _json_state(widget)])
    assert not errors, errors
    assert r["cleanup"] == "function", f"{name}: render returns {r['cleanup']}, not its cleanup"
    assert r["drawn"] > 0 and "ds4-view" in r["rootClass"]
    # render listened to the model (the instrumentation sees it), and to its traits only
    assert r["during"]["model"] > 0
    assert all(e.startswith("change:") and e[len("change:"):] in _view_traits(widget) for e in r["events"]), r
    left = {k: v for k, v in r["after"].items() if k != "domList" and v}
    assert not left, f"{name}: left behind after its cleanup: {left} {r['after']['domList']}"


# Of a TierView drawn: the stack's switches whose unit starts another line, the step line's switches split over two
# lines, and how much wider than the view its content is.
TIER_LAYOUT = """(el) => {
  const stranded = [...el.querySelectorAll(".ds4-stack .ds4-arrow")].filter((a) => {
    let u = a.nextElementSibling;
    while (!u.classList.contains("ds4-unit")) u = u.nextElementSibling;
    const [ra, ru] = [a.getBoundingClientRect(), u.getBoundingClientRect()];
    return ra.top + ra.height / 2 < ru.top || ra.top + ra.height / 2 > ru.bottom;
  }).map((a) => a.textContent);
  const split = [...el.querySelectorAll(".ds4-switch")].filter((s) => s.getClientRects().length > 1)
    .map((s) => s.textContent);
  const tops = new Set([...el.querySelectorAll(".ds4-stack .ds4-unit")].map((u) => u.getBoundingClientRect().top));
  return { stranded, split, switches: el.querySelectorAll(".ds4-switch").length, lines: tops.size,
           overflow: el.scrollWidth - el.clientWidth };
}"""


@pytest.mark.parametrize("width", [740, 850, 1200])
def test_tier_view_lays_out_at_a_laptop_width(page, model_paths, width):
    """A TierView of 5 copying boundaries (notebook 05's alternating plan) at 740 px, at 850 (a notebook's width beside
    JupyterLab's file browser on a 1280 px laptop), and at 1200: no switch of the stack ends a line apart from the
    unit it feeds, no switch of the step line splits over two lines, nothing is wider than the view; from 850 px the
    stack is one line."""
    from tests.test_browser import ARTIFACTS

    pg, errors = page
    model = ds4lab.load(model_paths["nano"], backend="numpy")
    sess = model.session(ctx=256, prefill_chunk=32, placement=Placement([0, 1, 0, 1, 0, 1]))
    view = TierView(sess, follow=True)
    sess.prefill(((np.arange(80) * 7 + 3) % (model.config.n_vocab - 10) + 5).tolist()).run(progress=False)
    css = (widgets_dir() / STYLESHEET).read_text()
    # a prefill chunk's switches last: the longest labels (a chunk's bytes)
    pg.evaluate(SHOW, [view.model._esm, _json_state(view.model), css, width])
    chunk = pg.locator(".ds4-view.ds4-tiers").evaluate(TIER_LAYOUT)
    assert not chunk["stranded"] and chunk["overflow"] <= 0 and (width < 850 or chunk["lines"] == 1), chunk
    sess.decoder(seed=3).step()
    pg.evaluate(SHOW, [view.model._esm, _json_state(view.model), css, width])
    got = pg.locator(".ds4-view.ds4-tiers").last.evaluate(TIER_LAYOUT)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    pg.locator(".ds4-view.ds4-tiers").first.screenshot(path=str(ARTIFACTS / f"tier_view_{width}.png"))
    assert not errors, errors
    assert not got["stranded"] and not got["split"] and got["overflow"] <= 0, got
    # beside the file browser of a 1280 px laptop (an output of about 850 px) the stack is one line too: a switch
    # starting a line read as a new flow
    assert got["switches"] == len(view.model.trace) == 6 and (width < 850 or got["lines"] == 1), got


def test_kv_view_of_a_full_context_names_no_next_position_and_the_bytes_outside_the_layers(page, model_paths):
    """A session whose context is full has no next position: the ring's centre and legend say so (they named slot 0
    and position ctx "next"); the title's total is the layers' bytes plus those the view names: the payload's
    header, token ids and logits (a student added the layers up and found 8,652 bytes missing)."""
    from ds4lab.kv.payload import HEADER_BYTES

    pg, errors = page
    model = ds4lab.load(model_paths["nano"], backend="numpy")
    cfg, T = model.config, 64
    sess = model.session(ctx=T, prefill_chunk=32)
    sess.prefill(((np.arange(T - 1) * 7 + 3) % (cfg.n_vocab - 10) + 5).tolist()).run(progress=False)
    sess.decoder(temperature=0, exclude=(model.tokenizer.eos_id,)).step(more=False)  # the last position
    view = KVCacheView(sess)
    d = view.model.data
    assert d["full"] and d["other_bytes"] == HEADER_BYTES + 4 * T + 4 * cfg.n_vocab + 8 * cfg.n_layer
    assert d["other_bytes"] + sum(L["bytes"] for L in d["layers"]) == d["total_bytes"] == sess.kv.nbytes
    fallback = view.static_html()
    assert "the context is full" in fallback and f"plus {d['other_bytes']:,} bytes for the header" in fallback
    pg.evaluate(SHOW, [view.model._esm, _json_state(view.model), (widgets_dir() / STYLESHEET).read_text(), 900])
    text = pg.locator(".ds4-kv").inner_text()
    assert not errors, errors
    assert "context full" in text and "no next position" in text and "takes position" not in text, text[:400]
    # and the ring draws no write pointer (its line and ▲ stood at slot 0 under "no next position")
    assert pg.locator(".ds4-kv .ds4-pointer").count() == 0 and pg.locator(".ds4-kv .ds4-pointer-label").count() == 0
    assert ("empty: no position written there yet" in text) == (T < d["raw_cap"]), text[:400]  # grey slots keyed
    early = model.session(ctx=256, prefill_chunk=32)  # 40 positions in a ring of more slots: empty ones, keyed
    early.prefill(list(range(5, 45))).run(progress=False)
    pg.evaluate("() => { document.body.innerHTML = ''; }")
    shown = KVCacheView(early).model
    assert shown.data["raw_cap"] > 40
    pg.evaluate(SHOW, [shown._esm, _json_state(shown), (widgets_dir() / STYLESHEET).read_text(), 900])
    assert "empty: no position written there yet" in pg.locator(".ds4-kv").inner_text()
    assert pg.locator(".ds4-kv .ds4-pointer").count() == 1  # a context with a next position: its pointer drawn
    # one decode step's slot, outlined outside the ring 3 px wide at least (a slot of a ring of 256 slots or more is
    # 1-2 px there: the band was all but invisible beside the pointer)
    watching = KVCacheView(early, follow=True)
    early.decoder(temperature=0, exclude=(model.tokenizer.eos_id,)).step(more=False)
    assert watching.model.data["new_from"] == 40 and watching.model.data["raw_cap"] >= 256
    pg.evaluate("() => { document.body.innerHTML = ''; }")
    pg.evaluate(SHOW, [watching.model._esm, _json_state(watching.model), (widgets_dir() / STYLESHEET).read_text(), 900])
    band = pg.locator(".ds4-kv .ds4-slot-new")
    assert band.count() == 1
    arc = (band.evaluate("(p) => p.getTotalLength()") - 2 * 4) / 2  # its perimeter: two arcs and two 4 px sides
    assert arc >= 2.9, arc
    watching.detach()
    assert f"plus {d['other_bytes']:,} bytes for the header, the token ids" in text, text[:400]


def test_generation_panel_names_a_token_sampled_from_outside_the_top(page, model_paths):
    """A token sampled from outside its top alternatives gets a row of its own under them, said so (a walk-through
    hovered a token of p 2.2% whose list of five ran from 8.3% to 4.2% and never named it)."""
    pg, errors = page
    model = ds4lab.load(model_paths["nano"], backend="numpy")
    view = GenerationView(model.session(ctx=256), list(range(5, 45)), max_tokens=2, seed=3, top=3)
    view.run()
    state = _json_state(view.model)
    last = state["records"][-1]
    last["top"] = [a for a in last["top"] if a["token"] != last["token"]][:2]  # as if sampled from below the top 2
    pg.evaluate(SHOW, [view.model._esm, state, (widgets_dir() / STYLESHEET).read_text(), 900])
    rows = pg.locator(".ds4-alts tr").all_inner_texts()
    assert not errors, errors
    assert len(rows) == 3 and "◀ sampled, not in the top 2" in rows[-1], rows
    assert "◀ sampled" not in "".join(rows[:-1]) and json.dumps(last["piece"], ensure_ascii=False) in rows[-1], rows


def test_generation_panel_keeps_room_for_the_decoders_own_top_before_any_token(page, model_paths):
    """Before any token the alternatives' panel keeps the height a token's list will take: the heading, the note, the
    decoder's ``top`` rows and one for a token sampled outside them (it assumed the default 5, so a view with top=2
    kept three blank lines, and one with top=8 grew under the page when its first token came)."""
    pg, errors = page
    model = ds4lab.load(model_paths["nano"], backend="numpy")
    heights = {}
    for top in (2, 8):
        view = GenerationView(model.session(ctx=256), list(range(5, 45)), max_tokens=2, seed=3, top=top)
        assert view.model.top == top
        pg.evaluate("() => { document.body.innerHTML = ''; }")
        pg.evaluate(SHOW, [view.model._esm, _json_state(view.model), (widgets_dir() / STYLESHEET).read_text(), 900])
        heights[top] = pg.locator(".ds4-alts").evaluate(
            "(el) => [el.getBoundingClientRect().height, parseFloat(getComputedStyle(el).fontSize)]")
    assert not errors, errors
    (h2, px), (h8, _) = heights[2], heights[8]
    assert abs((h8 - h2) - 6 * 1.6 * px) < 1, heights
    # filled with its last token's list at its longest (the note, the token, the heading, the top rows and a token
    # sampled outside them) the panel takes the room it kept: nothing under it moves (it grew 15 px)
    view = GenerationView(model.session(ctx=256), list(range(5, 45)), max_tokens=2, seed=3, top=5)
    empty = _json_state(view.model)
    view.run()
    state = _json_state(view.model)
    last = state["records"][-1]
    last["top"] = [a for a in last["top"] if a["token"] != last["token"]][:5]
    for shown in (empty, state):
        pg.evaluate("() => { document.body.innerHTML = ''; }")
        pg.evaluate(SHOW, [view.model._esm, shown, (widgets_dir() / STYLESHEET).read_text(), 900])
        heights[len(shown["records"])] = pg.locator(".ds4-alts").evaluate("(el) => el.getBoundingClientRect().height")
    assert len(pg.locator(".ds4-alts tr").all()) == 6 and abs(heights[2] - heights[0]) <= 2, heights
