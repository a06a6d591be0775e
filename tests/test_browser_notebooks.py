"""Every teaching notebook in a real browser: one JupyterLab server (tests/test_browser.py's ``lab`` fixture) gets
a copy of each notebook with its outputs cleared (through the server's contents API), and one headless Chromium
page opens them one after the other, runs each through the UI (Run > Run All Cells) and checks what any view
must show whatever it looks like: every widget output drawn by its ESM (a non-empty ``.ds4-view``), every chart
drawn by JupyterLab's Vega-Lite renderer, no error output, no console error from the widgets, legible text (font
size and contrast), and one control per notebook that changes its view when used. A screenshot of every view and
chart goes to ``$DS4LAB_ARTIFACTS/notebooks/`` (default ``test-artifacts/notebooks/``).

Skips as tests/test_browser.py does when Chromium, JupyterLab or Playwright is missing. Marker ``browser``.
"""

import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests import test_browser as tb

pytestmark = pytest.mark.browser
lab = tb.lab  # the JupyterLab server fixture of tests/test_browser.py (this module gets its own server)

ROOT = Path(__file__).resolve().parent.parent
NAMES = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WIDGET = "application/vnd.jupyter.widget-view+json"
VEGALITE = "application/vnd.vegalite.v5+json"
SHOTS = tb.ARTIFACTS / "notebooks"
# notebooks whose views have no control that changes what they show (05: TierView's one button, refresh)
WITHOUT_CONTROLS = {"05_tiers_and_placement.ipynb"}
MIN_FONT_PX = 10  # the smallest text a view may draw
MIN_CONTRAST = 3.0  # WCAG's floor for large text: text lighter than this on its background is hard to read
# a widget output, once drawn (JupyterLab gives widget outputs no data-mime-type): the count of these must reach
# the count of widget outputs in the saved notebook
WIDGET_OUTPUT = ".jp-OutputArea-output:has(.ds4-view)"
ERROR_OUTPUT = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'

# the text of every element of a view that holds text itself: its font size, and its contrast with the first
# opaque background behind it (WCAG's relative luminance)
TEXT_STYLE_JS = """(root) => {
    const lum = (c) => {
        const [r, g, b] = c.match(/[\\d.]+/g).slice(0, 3).map((v) => {
            v = +v / 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
        return 0.2126 * r + 0.7152 * g + 0.0722 * b;
    };
    const opaque = (c) => !/rgba\\(.*,\\s*0\\)$/.test(c) && c !== 'transparent';
    const out = [];
    for (const el of [root, ...root.querySelectorAll('*')]) {
        const own = [...el.childNodes].filter((n) => n.nodeType === 3).map((n) => n.textContent).join('').trim();
        if (!own || !el.getClientRects().length) continue;
        const s = getComputedStyle(el);
        if (s.visibility === 'hidden' || +s.opacity === 0) continue;
        let bg = 'rgb(255, 255, 255)';
        for (let a = el; a; a = a.parentElement) {
            const c = getComputedStyle(a).backgroundColor;
            if (opaque(c)) { bg = c; break; }
        }
        const [l1, l2] = [lum(s.color), lum(bg)].sort((x, y) => y - x);
        out.push({ text: own.slice(0, 40), font: parseFloat(s.fontSize), contrast: (l1 + 0.05) / (l2 + 0.05),
                   color: s.color, bg });
    }
    return out;
}"""


def _saved_counts(name: str) -> tuple[int, int]:
    """How many widget outputs and Vega-Lite charts the committed notebook ``name`` shows."""
    nb = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))
    bundles = [o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", [])]
    return sum(WIDGET in b for b in bundles), sum(VEGALITE in b for b in bundles)


def _cleared(name: str) -> dict:
    """The notebook ``name`` as a teacher would open it fresh: its cells, no outputs, no saved widget state."""
    nb = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    nb["metadata"].pop("widgets", None)
    return nb


def _api(base: str, token: str, method: str, path: str, body: dict | None = None):
    req = urllib.request.Request(f"{base}/api/{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read()
    return json.loads(text) if text else None


def _open(pg, base: str, token: str, name: str) -> None:
    """Open the server's notebook ``name`` alone (a reset workspace) and wait for its cells and its kernel."""
    pg.goto(f"{base}/lab/tree/{name}?reset&token={token}", wait_until="domcontentloaded", timeout=60_000)
    pg.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=60_000)
    deadline = time.monotonic() + 60
    while "idle" not in (tb._kernel_states(base, token) or []):
        assert time.monotonic() < deadline, f"{name}: its kernel did not start within 60 s"
        time.sleep(0.3)


def _run_all(pg, base: str, token: str, name: str) -> None:
    """Open ``name`` (:func:`_open`), Run All Cells, and wait until every code cell has an execution count."""
    _open(pg, base, token, name)
    n_code = sum(c["cell_type"] == "code" for c in _cleared(name)["cells"])
    assert pg.locator(".jp-Notebook .jp-CodeCell").count() == n_code
    pg.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    pg.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    deadline, idle_since = time.monotonic() + tb.RUN_ALL_S, None
    while True:
        prompts = tb._prompts(pg)
        if len(prompts) == n_code and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
            return
        states = tb._kernel_states(base, token)
        stopped = "[*]:" not in prompts and states is not None and all(s == "idle" for s in states)
        idle_since = (idle_since or time.monotonic()) if stopped else None
        if (idle_since and time.monotonic() - idle_since > 5) or time.monotonic() > deadline:
            pg.screenshot(path=str(SHOTS / f"{name[:2]}-failed.png"))
            pytest.fail(f"{name}: Run All did not run every cell: prompts {prompts}\n"
                        + "\n".join(pg.locator(ERROR_OUTPUT).all_inner_texts())[-3000:])
        time.sleep(0.5)


def _view_html(output) -> str:
    return output.locator(".ds4-view").first.inner_html()


def _controls(pg, outputs):
    """The visible controls of the notebook's views, as (name, index of the output holding it, action): sliders
    first (one step from the keyboard), then dropdowns (another option), then enabled buttons but *refresh*."""
    found = []
    for i in range(outputs.count()):
        for j in range(outputs.nth(i).locator(".widget-hslider").count()):
            slider = outputs.nth(i).locator(".widget-hslider").nth(j)
            if not slider.is_visible():  # a view hides a slider with nothing to choose (one checkpoint)
                continue

            def move(slider=slider):
                value = slider.locator(".widget-readout").inner_text().strip()
                slider.locator(".noUi-handle, .ui-slider-handle, input[type=range]").first.focus()
                pg.keyboard.press("ArrowLeft" if value not in ("0", "") else "ArrowRight")
            found.append(("slider", i, move))
    for i in range(outputs.count()):
        for j in range(outputs.nth(i).locator(".widget-dropdown select").count()):
            select = outputs.nth(i).locator(".widget-dropdown select").nth(j)

            def pick(select=select):
                values = [o.get_attribute("value") for o in select.locator("option").all()]
                select.select_option(next(v for v in values if v != select.input_value()))
            found.append(("dropdown", i, pick))
    for i in range(outputs.count()):
        for button in outputs.nth(i).locator(".widget-button:enabled").all():
            label = button.inner_text().strip()
            if label != "refresh":  # redraws the state on display: a change would be the bug
                found.append((f"button {label!r}", i, button.click))
    return found


def _use_a_control(pg, outputs, name: str):
    """Use the views' controls in turn (``_controls``) until one changes its view's DOM, within 15 s each (the
    kernel hears of the change, updates the model, and the ESM redraws). What was tried, and whether it worked."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    tried = []
    for what, i, act in _controls(pg, outputs):
        before = _view_html(outputs.nth(i))
        act()
        try:
            pg.wait_for_function("([el, html]) => el.querySelector('.ds4-view').innerHTML !== html",
                                 arg=[outputs.nth(i).element_handle(), before], timeout=15_000)
        except PlaywrightTimeout:
            tried.append(f"{what} of view {i + 1}: no change")
            continue
        tried.append(f"{what} of view {i + 1}: changed")
        outputs.nth(i).screenshot(path=str(SHOTS / f"{name[:2]}-view-{i + 1}-after-{what.split()[0]}.png"))
        return dict(tried=tried, changed=True)
    return dict(tried=tried, changed=False)


@pytest.fixture(scope="module")
def runs(lab):
    """Every notebook run through the UI in one Chromium page: per notebook, what the page showed and did."""
    from playwright.sync_api import sync_playwright

    base, token, *_ = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        _api(base, token, "PUT", f"contents/{name}", {"type": "notebook", "format": "json", "content": _cleared(name)})
    results = {}
    with sync_playwright() as pw:
        browser = tb.launch_chromium(pw)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1600})
            console, errors, remote = [], [], []
            pg.on("console", lambda m: console.append(m))
            pg.on("pageerror", lambda e: errors.append(e))
            pg.on("request", lambda r: None if tb.LOCAL.match(r.url) else remote.append(r.url))
            for name in NAMES:
                del console[:], errors[:], remote[:]
                began = time.monotonic()
                _run_all(pg, base, token, name)
                results[name] = _inspect(pg, name)
                results[name].update(
                    seconds=time.monotonic() - began,
                    console=[f"{m.type}: {m.text} @ {m.location.get('url', '')}" for m in console
                             if m.type == "error" and tb.OURS.search(f"{m.text} {m.location.get('url', '')}")]
                    + [f"pageerror: {e}" for e in errors if tb.OURS.search(f"{e} {e.stack or ''}")],
                    remote=list(remote))
                for session in _api(base, token, "GET", "sessions"):  # one kernel at a time
                    _api(base, token, "DELETE", f"sessions/{session['id']}")
        finally:
            browser.close()
            (SHOTS / "summary.json").write_text(json.dumps(  # how long each took, and which control changed what
                {n: dict(seconds=round(r["seconds"], 1), controls=r["used"]["tried"]) for n, r in results.items()},
                indent=1))
    yield results


def _inspect(pg, name: str) -> dict:
    """What notebook ``name`` shows once run: views and charts drawn (screenshots of each), text styles, error
    outputs, and the effect of using one control."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    n_widgets, n_charts = _saved_counts(name)
    outputs = pg.locator(WIDGET_OUTPUT)
    # the views draw when their models arrive, the charts once Vega is loaded
    try:
        pg.wait_for_function(
            f"([n, m]) => document.querySelectorAll('{WIDGET_OUTPUT}').length >= n && "
            f"document.querySelectorAll('{tb.CHART} .vega-embed :is(canvas, svg)').length >= m",
            arg=[n_widgets, n_charts], timeout=30_000)
    except PlaywrightTimeout:  # the checks below say which output is missing; the page shows how it looks
        pg.screenshot(path=str(SHOTS / f"{name[:2]}-not-drawn.png"))
        mimes = pg.evaluate("() => [...document.querySelectorAll('.jp-OutputArea-output')].map((e) => "
                            "e.getAttribute('data-mime-type') + ':' + e.textContent.slice(0, 60))")
        (SHOTS / f"{name[:2]}-outputs.json").write_text(json.dumps(mimes, indent=1))
    pg.wait_for_timeout(500)
    views = []
    for i in range(outputs.count()):
        out = outputs.nth(i)
        out.scroll_into_view_if_needed()
        shot = SHOTS / f"{name[:2]}-view-{i + 1}.png"
        out.screenshot(path=str(shot))
        view = out.locator(".ds4-view")
        drawn = view.count() > 0
        views.append(dict(n_views=view.count(), text=view.first.inner_text().strip() if drawn else "",
                          box=out.bounding_box(), styles=view.first.evaluate(TEXT_STYLE_JS) if drawn else [],
                          shot=shot))
    charts = []
    for i in range(pg.locator(tb.CHART).count()):
        out = pg.locator(tb.CHART).nth(i)
        out.scroll_into_view_if_needed()
        out.screenshot(path=str(SHOTS / f"{name[:2]}-chart-{i + 1}.png"))
        charts.append(out.locator(".vega-embed :is(canvas, svg)").count())
    used = _use_a_control(pg, outputs, name)
    return dict(views=views, charts=charts, n_widgets=n_widgets, n_charts=n_charts, used=used,
                errors=pg.locator(ERROR_OUTPUT).all_inner_texts(),
                widget_errors=pg.get_by_text("Error displaying widget").count())


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_without_errors(runs, name):
    r = runs[name]
    assert not r["errors"], f"{name}: error or stderr outputs: {r['errors']}"
    assert not r["console"], f"{name}: JS errors from the widgets:\n" + "\n".join(r["console"])
    assert r["widget_errors"] == 0
    assert not r["remote"], f"{name}: the page asked other hosts than the server: {r['remote']}"


@pytest.mark.parametrize("name", NAMES)
def test_every_view_and_chart_is_drawn(runs, name):
    """As many views and charts as the saved notebook shows, each drawn: a view has text, a chart marks."""
    r = runs[name]
    assert (len(r["views"]), len(r["charts"])) == (r["n_widgets"], r["n_charts"]), name
    for i, v in enumerate(r["views"], 1):
        assert v["n_views"] >= 1 and len(v["text"]) > 20, f"{name} view {i} is empty: {v['text']!r} ({v['shot']})"
        assert v["box"]["width"] > 100 and v["box"]["height"] > 20, (name, i, v["box"])
    assert all(n >= 1 for n in r["charts"]), (name, r["charts"])


@pytest.mark.parametrize("name", NAMES)
def test_views_are_legible(runs, name):
    """Every text a view draws is at least MIN_FONT_PX tall and MIN_CONTRAST against its background."""
    for i, v in enumerate(runs[name]["views"], 1):
        assert v["styles"], f"{name} view {i}: no text"
        small = [s for s in v["styles"] if s["font"] < MIN_FONT_PX]
        faint = [s for s in v["styles"] if s["contrast"] < MIN_CONTRAST]
        assert not small, f"{name} view {i} ({v['shot'].name}): text under {MIN_FONT_PX}px: {small[:5]}"
        assert not faint, f"{name} view {i} ({v['shot'].name}): contrast under {MIN_CONTRAST}: {faint[:5]}"


@pytest.mark.parametrize("name", NAMES)
def test_a_control_changes_its_view(runs, name):
    """One of the notebook's view controls (slider, dropdown or button) redraws its view when used."""
    used = runs[name]["used"]
    assert bool(used["tried"]) == (runs[name]["n_widgets"] > 0 and name not in WITHOUT_CONTROLS), \
        f"{name}: controls tried {used['tried']}; WITHOUT_CONTROLS says {name in WITHOUT_CONTROLS}"
    assert not used["tried"] or used["changed"], f"{name}: no control changed its view: {used['tried']}"


@pytest.fixture(scope="module")
def opened(lab):
    """Every committed notebook opened as saved, outputs and widget state kept (what a student sees before running
    anything), each alone in one Chromium page: once its kernel is idle, whether its tab is marked modified, how many
    saved views it shows (a notebook JupyterLab has not seen is untrusted, so each view's static fallback, the
    output's text/html), and its outputs' text. Its ``language_info.version`` is this interpreter's first:
    JupyterLab writes the kernel's into the notebook it opens, so a kernel of another Python than the one that
    built it marks it modified whatever the notebook holds."""
    from playwright.sync_api import sync_playwright

    base, token, *_ = lab
    version = ".".join(map(str, sys.version_info[:3]))
    for name in NAMES:
        nb = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))
        nb["metadata"]["language_info"]["version"] = version
        _api(base, token, "PUT", f"contents/saved-{name}", {"type": "notebook", "format": "json", "content": nb})
    results = {}
    with sync_playwright() as pw:
        browser = tb.launch_chromium(pw)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1600})
            for name in NAMES:
                _open(pg, base, token, f"saved-{name}")
                n_saved = _saved_counts(name)[0]
                pg.wait_for_function("(n) => document.querySelectorAll("
                                     "'.jp-OutputArea-output:has(.ds4-view)').length >= n", arg=n_saved,
                                     timeout=30_000)
                time.sleep(1.0)  # the kernel's info is written into the notebook as it connects
                results[name] = dict(dirty=pg.locator(".lm-TabBar-tab.jp-mod-dirty").count(),
                                     drawn=pg.locator(".jp-OutputArea-output:has(.ds4-view)").count(),
                                     n_saved=n_saved,  # the outputs' text: 01's markdown names the error
                                     outputs="\n".join(pg.locator(".jp-OutputArea").all_inner_texts()))
                pg.screenshot(path=str(SHOTS / f"saved-{name[:2]}.png"))
                for s in _api(base, token, "GET", "sessions"):  # one kernel at a time
                    _api(base, token, "DELETE", f"sessions/{s['id']}")
        finally:
            browser.close()
    return results


@pytest.mark.parametrize("name", NAMES)
def test_a_saved_notebook_opens_unmodified_with_its_views(opened, name):
    """Opened as committed, a notebook shows every saved view (no "Error displaying widget") and is not marked
    modified: its kernelspec is ipykernel's own (any other display name was rewritten on open, and every notebook
    showed unsaved changes before anything was run)."""
    r = opened[name]
    assert r["drawn"] == r["n_saved"], f"{name}: {r['drawn']} of {r['n_saved']} saved views drawn"
    assert "Error displaying widget" not in r["outputs"] and "model not found" not in r["outputs"], name
    assert r["dirty"] == 0, f"{name}: marked modified on open (saved-{name[:2]}.png)"
