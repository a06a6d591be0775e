"""The views in a real browser: JupyterLab (started here, on a free port with a token, rooted in a temp dir)
runs a small notebook written by this test that shows every view (PrefillView, twice: stepped while shown and run
before it is shown, KVCacheView, AttentionView, ExpertView, GenerationView, TierView) and two Vega-Lite charts,
through its own UI (Run > Run All Cells) in headless Chromium, driven by Playwright. Then the DOM our ESM built is
checked view by view, the attention canvas and the charts are read back for painted pixels, hovers fill the
tooltips, the charts are drawn by JupyterLab's own Vega-Lite renderer (``ds4lab.viz.vegalite``, no CDN), the page
asks nothing of any host but the server (no other host name resolves; a request to one fails the test), the
console holds no errors from the widgets, and at a laptop's width nothing of a view is cut off.
Screenshots of each view go to ``$DS4LAB_ARTIFACTS`` (default ``test-artifacts/``).

Needs Debian's ``chromium`` (``/usr/bin/chromium``, or ``$DS4LAB_CHROMIUM``) and the ``browser`` extra
(jupyterlab, playwright); Playwright's own browser downloads are not used. Skips, saying what is missing,
when it cannot run. Deselect with ``-m "not browser"``.
"""

import json
import math
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ds4lab.viz.attention_figure import FEW_PX, FIG_H, FIG_W, HEADER_CHAR, LEFT, LEGEND, SEP_Y, TOP, WIDTH

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("DS4LAB_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("DS4LAB_ARTIFACTS") or ROOT / "test-artifacts")
SERVER_START_S = 60  # JupyterLab answering /api/status
RUN_ALL_S = 150  # every cell of the notebook run (about 10 s of kernel time here)
NOTEBOOK = "views.ipynb"
# console errors that come from the widgets: our ESM is imported from a blob: URL by anywidget
OURS = re.compile(r"blob:|anywidget|ds4|jupyter-widgets|Error displaying widget", re.I)
CHART = ".jp-OutputArea-output.jp-RenderedVegaLite"  # an output drawn by JupyterLab's Vega-Lite renderer
# what the page may ask for: the server, and in-page data
LOCAL = re.compile(r"^(?:https?|wss?)://127\.0\.0\.1[:/]|^(?:data|blob|about):")


def notebook_cells() -> list[str]:
    """The test's notebook: every view and two charts, on the embedded model and Coriolanus' first 320 tokens
    (the prompt cell of notebooks 02 and 04)."""
    return [
        "import ds4lab\n"
        "from ds4lab import Placement\n"
        "from ds4lab.viz import (AttentionView, ExpertView, GenerationView, KVCacheView, MaskView, PrefillView,\n"
        "                        TierView)\n"
        "from ds4lab.viz.charts import expert_load_chart, kv_bytes_chart, prefill_chunks_chart\n\n"
        'model = ds4lab.load(backend="numpy")\n'
        "print(ds4lab.__file__)",
        "from ds4lab.texts import coriolanus\n\n"  # notebook 02's and 04's prompt
        "prompt = coriolanus(1000)\n"
        "ids = model.tokenizer.encode(prompt)",
        "sess = model.session(ctx=512, prefill_chunk=64)\n"
        "prefill = PrefillView(sess, ids)  # the stepper, the KV cache and the mask of layer 2 beside it\n"
        "prefill.step()\n"
        "prefill",
        'with sess.capture(["indexer.topk"]) as picks:  # the indexer\'s choices, for the KV view to mark\n'
        "    prefill.run()\n"
        "kv = KVCacheView(sess, checkpoints=prefill.chunks, indexer=picks)  # the state now: after the last chunk\n"
        "kv",
        "late = PrefillView(model.session(ctx=512, prefill_chunk=64), ids)  # run, then shown on a middle chunk\n"
        "late.run()\n"
        "late.select(2)\n"
        "late",
        'with sess.capture(["indexer.topk"], layers=[2]) as cap:\n'
        "    sess.decoder(temperature=0).step()\n"
        'MaskView.of_step(sess, 2, len(sess.tokens) - 1, 1, cap["blk.2.indexer.topk"], label="a decode step")',
        "kv_bytes_chart(sess, prefill.chunks) | prefill_chunks_chart(prefill.chunks)",
        "att = model.session(ctx=512, prefill_chunk=64)\n"
        'with att.capture(["attn.scores"], layers=[2, 3], heads=[0, 1, 2, 3]) as cap:\n'
        "    att.prefill(ids).run(progress=False)\n"
        "AttentionView(cap, layer=2, head=0)",
        "experts = ExpertView.from_prompt(model.session(ctx=512, prefill_chunk=64), ids)\n"
        "experts",
        "expert_load_chart(experts)",
        "tiered = model.session(ctx=512, prefill_chunk=64, placement=Placement.even(2))\n"
        "generation = GenerationView(tiered, ids[:100], max_tokens=12, temperature=0.8, seed=3)\n"
        "steps = generation.run()\n"
        "generation",
        "TierView(tiered)",
    ]


def write_notebook(path: Path) -> int:
    """The test's notebook, without outputs; its number of code cells."""
    cells = [dict(cell_type="code", execution_count=None, metadata={}, outputs=[], source=src)
             for src in notebook_cells()]
    nb = dict(cells=cells, nbformat=4, nbformat_minor=4,
              metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    path.write_text(json.dumps(nb, indent=1), encoding="utf-8")
    return len(cells)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(dir_: Path) -> None:
    """Lab settings for the test: every cell in the DOM (no windowing), no news or update toasts."""
    for name, value in {
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        path = dir_ / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def _get(url: str, token: str):
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def _kernel_states(base: str, token: str) -> list[str] | None:
    """The execution states of the server's kernels, or None while the listing fails with a server error: jupyter_server
    lists a kernel whose start is still pending before it has `last_activity`, and answers 500 for that moment."""
    try:
        return [k["execution_state"] for k in _get(f"{base}/api/kernels", token)]
    except urllib.error.HTTPError as e:
        if e.code >= 500:
            return None
        raise


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server rooted in a temp dir holding the test's notebook: (base url, token, notebook name, its
    number of code cells, the server's log file)."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium binary at {CHROMIUM} (apt-get install chromium, or set DS4LAB_CHROMIUM)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[browser]')")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (pip install -e '.[browser]')")
    pytest.importorskip("anywidget", reason="anywidget is not installed")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed")

    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"
    root.mkdir()
    n_code = write_notebook(root / NOTEBOOK)
    _settings(tmp / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    # the kernel imports this checkout's ds4lab (it runs in the temp root, where an installed ds4lab, maybe of
    # another checkout, would come first otherwise)
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               IPYTHONDIR=str(tmp / "ipython"), JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    log_path = tmp / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.allow_root=True", f"--LabApp.user_settings_dir={tmp / 'settings'}",
         f"--LabApp.workspaces_dir={tmp / 'workspaces'}"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.skip(f"JupyterLab exited with {proc.returncode} on start: "
                            + log_path.read_text()[-1500:])
            try:
                _get(f"{base}/api/status", token)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.skip(f"JupyterLab did not answer on {base} within {SERVER_START_S} s: "
                                + log_path.read_text()[-1500:])
                time.sleep(0.3)
        yield base, token, NOTEBOOK, n_code, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _prompts(page) -> list[str]:
    return page.evaluate(
        "() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputArea-prompt')]"
        ".map((e) => e.textContent.trim())"
    )


def launch_chromium(pw):
    """Debian's Chromium under Playwright (``pw``), headless, resolving no host name but the server's, so that the
    page is as offline as it can be; the test skips, saying why, when it does not start."""
    from playwright.sync_api import Error as PlaywrightError

    try:
        return pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                  args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                                        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
    except PlaywrightError as e:
        pytest.skip(f"Chromium at {CHROMIUM} did not start under Playwright: {str(e)[:500]}")


@pytest.fixture(scope="module")
def page(lab):
    """The notebook opened in headless Chromium and run through Run > Run All Cells: the page, its console
    messages, page errors and the requests it made to other hosts than the server (which fail)."""
    from playwright.sync_api import sync_playwright

    base, token, name, n_code, server_log = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    console, errors, remote = [], [], []
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 2000})
            pg.on("console", lambda m: console.append(m))
            pg.on("pageerror", lambda e: errors.append(e))
            pg.on("request", lambda r: None if LOCAL.match(r.url) else remote.append(r.url))
            pg.goto(f"{base}/lab/tree/{name}?token={token}", wait_until="domcontentloaded", timeout=60_000)
            pg.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=60_000)
            # the kernel started by opening the notebook
            deadline = time.monotonic() + 60
            while "idle" not in (_kernel_states(base, token) or []):
                assert time.monotonic() < deadline, ("the notebook's kernel did not start within 60 s; the server's "
                                                     "log ends:\n" + server_log.read_text()[-3000:])
                time.sleep(0.3)
            # every cell is in the DOM (windowingMode none), so the prompts below cover the whole notebook
            assert pg.locator(".jp-Notebook .jp-CodeCell").count() == n_code

            pg.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            pg.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

            deadline = time.monotonic() + RUN_ALL_S
            idle_since = None
            while True:
                prompts = _prompts(pg)
                if len(prompts) == n_code and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
                    break
                states = _kernel_states(base, token)
                busy = states is None or any(state != "idle" for state in states)
                stopped = "[*]:" not in prompts and not busy
                idle_since = (idle_since or time.monotonic()) if stopped else None
                if (idle_since and time.monotonic() - idle_since > 5) or time.monotonic() > deadline:
                    pg.screenshot(path=str(ARTIFACTS / "notebook-failed.png"), full_page=True)
                    stderr = pg.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
                    text = "\n".join(stderr.all_inner_texts())[-3000:]
                    pytest.fail(f"Run All did not run every cell: prompts {prompts}\n{text}")
                time.sleep(0.5)
            # the views draw once their models arrive, the charts once Vega is loaded: wait for every kind
            for selector in (".ds4-view .ds4-prompt", ".ds4-view .ds4-layer", ".ds4-view canvas", ".ds4-view .ds4-hist",
                             ".ds4-view .ds4-gen .ds4-tok", ".ds4-view .ds4-stack"):
                pg.wait_for_selector(selector, timeout=20_000)
            pg.wait_for_function(
                f"() => document.querySelectorAll('{CHART} .vega-embed :is(canvas, svg)').length >= 2", timeout=20_000)
            pg.wait_for_timeout(500)
            pg.screenshot(path=str(ARTIFACTS / "notebook.png"))
            yield pg, console, errors, remote
        finally:
            (ARTIFACTS / "browser-console.log").write_text(
                "\n".join(f"{m.type}: {m.text} @ {m.location.get('url', '')}" for m in console)
                + "\n" + "\n".join(f"pageerror: {e}" for e in errors)
                + "\n" + "\n".join(f"request elsewhere: {u}" for u in remote) + "\n"
            )
            browser.close()


def _output_of(view):
    """The whole cell output holding a view: the ipywidgets controls and our ESM's element."""
    return view.locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea-output')][1]")


def _view(pg, title: str):
    """The one view whose title (``.ds4-title``) starts with ``title``."""
    views = pg.locator(".ds4-view").filter(has=pg.locator(".ds4-title", has_text=re.compile("^" + re.escape(title))))
    assert views.count() == 1, f"{views.count()} views titled {title!r}"
    return views.first


def _hover_fills(pg, target, tip, position=None, until="el.textContent.trim().length > 0") -> str:
    """Hover ``target`` (at ``position`` within it) and wait for ``tip`` to satisfy ``until``; its text."""
    target.scroll_into_view_if_needed()
    if position is None:
        target.hover()
    else:
        box = target.bounding_box()
        target.hover(position={"x": box["width"] * position[0], "y": box["height"] * position[1]})
    pg.wait_for_function(f"(el) => {until}", arg=tip.element_handle(), timeout=5_000)
    return tip.inner_text()


def _tip_near(pg, tip, x: float, y: float, frame: dict) -> None:
    """The tooltip shown for the pointer at page px (x, y): within 40 px of it, not under it, inside the window and
    inside ``frame``'s box (nothing of it cut off)."""
    t = tip.bounding_box()
    dx, dy = max(t["x"] - x, 0, x - t["x"] - t["width"]), max(t["y"] - y, 0, y - t["y"] - t["height"])
    assert 0 < max(dx, dy) and math.hypot(dx, dy) <= 40, (t, x, y)
    for outer in (dict(x=0, y=0, **pg.viewport_size), frame):  # with a pixel's slack
        assert (outer["x"] - 1 <= t["x"] and t["x"] + t["width"] <= outer["x"] + outer["width"] + 1
                and outer["y"] - 1 <= t["y"] and t["y"] + t["height"] <= outer["y"] + outer["height"] + 1), (t, outer)


def _tip_beside(pg, target, tip, frame) -> None:
    """The tooltip shown for the pointer on the middle of ``target``: :func:`_tip_near` it, inside ``frame`` (the
    view), in the attention figure's style."""
    box = target.bounding_box()
    _tip_near(pg, tip, box["x"] + box["width"] / 2, box["y"] + box["height"] / 2, frame.bounding_box())
    assert tip.evaluate("(el) => getComputedStyle(el).boxShadow") != "none"  # the attention figure's style


def _painted(canvas) -> dict:
    """Pixels of a canvas that are not blank (transparent or near-white), and its distinct colours."""
    return canvas.evaluate(
        """(c) => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let painted = 0; const colours = new Set();
            for (let i = 0; i < d.length; i += 4) {
                if (d[i + 3] && (d[i] < 250 || d[i + 1] < 250 || d[i + 2] < 250)) painted++;
                colours.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
            }
            return { w: c.width, h: c.height, painted, colours: colours.size,
                     cssW: c.getBoundingClientRect().width };
        }"""
    )


def test_the_kernel_runs_this_checkout(page):
    """The notebook's kernel imported the ds4lab of the checkout under test (so the views' front-end is its own)."""
    pg, *_ = page
    first = pg.locator(".jp-Notebook .jp-CodeCell").first.locator(".jp-OutputArea-output").inner_text().strip()
    assert Path(first) == ROOT / "ds4lab" / "__init__.py"


def _mask_of(out):
    return out.locator(".ds4-mask")


def test_prefill_view_renders(page):
    """The stepper after Run All: every chunk run, the KV cache and the mask beside (not below) the prompt, the
    prompt box scrolled to the chunk shown; scrubbing changes the mask, the ring and the scroll; a step click
    after the last chunk says so in the view."""
    pg, *_ = page
    view = pg.locator(".ds4-view.ds4-prefill").first  # the first of the two, stepped while shown (titles change)
    title = view.locator(".ds4-title").inner_text()
    m = re.match(r"Prefill: (\d+)/(\d+) tokens, 5/5 chunks of ≤64 run · shown: after chunk 4 \(tokens 256–(\d+)\)$",
                 title)
    assert m and m[1] == m[2] and int(m[3]) == int(m[1]) - 1, title
    assert view.locator("tr").count() == 1 + 5  # header + one row per chunk
    toks = view.locator(".ds4-prompt .ds4-tok")
    assert toks.count() == int(m[1]) and view.locator(".ds4-prompt .ds4-todo").count() == 0
    assert view.locator(".ds4-prompt .ds4-cur").count() == int(m[2]) - 256  # the chunk shown
    box = view.locator(".ds4-prompt")
    cur = view.locator(".ds4-prompt .ds4-tok[data-start]")
    assert box.evaluate("(b) => b.scrollTop") > 0 and cur.get_attribute("data-tip") == "position 256, chunk 4"
    assert 0 <= _prompt_offset(box) < box.evaluate("(b) => b.clientHeight") - 10  # the chunk's first line is shown
    # a new width (the file browser opened or closed) reflows the prompt and scrolls to the same chunk again: each
    # resize added the chunk's offset to the scroll already made (a walk-through saw chunk 4's end for chunk 2's)
    # (chunk 2: the last one's scroll is the box's end, which no second scroll passes)
    handle = _output_of(view).locator(".widget-hslider .noUi-handle").first
    handle.focus()
    for key in ("ArrowLeft", "ArrowLeft"):
        handle.press(key)
    from playwright.sync_api import expect

    title = view.locator(".ds4-title")  # found anew at each try: a redraw replaces the element
    expect(title).to_contain_text("shown: after chunk 2 (tokens 128–191)", timeout=10_000)
    size = pg.viewport_size
    for width in (1200, 1400):
        pg.set_viewport_size({"width": width, "height": size["height"]})
        pg.wait_for_timeout(300)
        assert 0 <= _prompt_offset(box) < box.evaluate("(b) => b.clientHeight") - 10, width
    pg.set_viewport_size(size)
    for key in ("ArrowRight", "ArrowRight"):
        handle.press(key)
    expect(title).to_contain_text("shown: after chunk 4", timeout=10_000)
    # a token's position and chunk beside the pointer, at once (a native title waited a second)
    assert _hover_fills(pg, cur, view.locator(".ds4-hovertip")) == "position 256, chunk 4"
    _tip_beside(pg, cur, view.locator(".ds4-hovertip"), view)
    out = _output_of(view)
    assert out.locator(".widget-button").count() == 2 and out.locator(".widget-dropdown").count() == 1
    assert [s.locator(".widget-label").first.inner_text() for s in _visible_sliders(out)] == ["show"]
    kv, mask = out.locator(".ds4-kv"), _mask_of(out)
    assert kv.count() == 1 and mask.count() == 1
    kb, mb = kv.bounding_box(), mask.bounding_box()
    assert kb["x"] + kb["width"] <= mb["x"] + 1 and mb["y"] < kb["y"] + kb["height"]  # side by side
    assert kv.locator(".ds4-title").inner_text().startswith("KV cache after chunk 4 (tokens 256–")
    assert kv.locator(".ds4-layer").count() == 1  # the layer picked (2)
    assert kv.locator(".ds4-slot").count() == 256 and kv.locator(".ds4-slot-new").count() == int(m[2]) - 256
    # beside the mask the ring's key is folded under one line (unfolded it took 25 lines of the narrow column): a
    # click unfolds it, and it stays unfolded when the slider shows another chunk
    key = kv.locator("details.ds4-keybox")
    assert key.count() == 1 and not key.evaluate("(d) => d.open")
    # the ring at its 240 px beside the mask, whatever the screen's height (alone it grows with it: 330 px here)
    assert kv.locator(".ds4-ring").bounding_box()["height"] == pytest.approx(240, abs=1)
    assert kv.locator(".ds4-ring").bounding_box()["height"] > key.bounding_box()["height"] * 5
    key.locator("summary").click()
    assert "overwritten (evicted): positions 0–" in kv.inner_text()  # 320 positions in 256 slots
    assert mask.locator(".ds4-title").inner_text().startswith("What each query sees — layer 2, chunk 4")
    img = mask.locator("img.ds4-maskimg")
    assert img.evaluate("(i) => i.naturalWidth > 300 && i.naturalHeight > 200")
    assert mask.locator(".ds4-tip").inner_text().startswith("hover a cell")
    tip = mask.locator(".ds4-hovertip")  # beside the pointer, as the other views' tooltips
    # (a fifth of the way across: a cell in every chunk's mask, the first chunk's having the fewest columns)
    text = _hover_fills(pg, img, tip, (0.2, 0.5), until="/query \\d+/.test(el.textContent)")
    assert re.match(r"query \d+ × ", text), text
    at = img.bounding_box()
    _tip_near(pg, tip, at["x"] + at["width"] * 0.2, at["y"] + at["height"] / 2, mask.bounding_box())
    out.screenshot(path=str(ARTIFACTS / "prefill_view.png"))
    width_at_chunk4 = img.evaluate("(i) => i.naturalWidth")
    # scrub back to chunk 0 with the keyboard on the slider
    handle = out.locator(".widget-hslider .noUi-handle").first
    handle.focus()
    for _ in range(4):
        handle.press("ArrowLeft")
    pg.wait_for_function("(el) => el.textContent.includes('chunk 0')", arg=mask.locator(".ds4-title").element_handle(),
                         timeout=10_000)
    assert view.locator(".ds4-title").inner_text().endswith("shown: after chunk 0 (tokens 0–63)")
    # the pointer still on the mask: its tooltip names chunk 0's cell now (a caption reset until the pointer moved)
    pg.wait_for_function("(el) => { const m = /^query (\\d+) ×/.exec(el.textContent); return m && +m[1] < 64; }",
                         arg=tip.element_handle(), timeout=5_000)
    assert kv.locator(".ds4-title").inner_text().startswith("KV cache after chunk 0 (tokens 0–63): 64 tokens")
    assert kv.locator(".ds4-slot-new").count() == 64 and box.evaluate("(b) => b.scrollTop") == 0
    assert "nothing overwritten yet" in kv.inner_text()  # the key still unfolded
    key.locator("summary").click()  # folded again, as the view began
    # the mask keeps its scale while scrubbing: its cells are sized for the chunk with the most keys (a narrower
    # image for chunk 0 moved every cell under a still pointer)
    assert img.evaluate("(i) => i.naturalWidth") == width_at_chunk4
    # chunk 0's last query sees 16 compressed rows, fewer than the indexer's top 32: seen, and the tooltip says why
    # (the last row, y 284 of 320 in the mask's layout, where its compressed columns are drawn kept)
    x = _colour_x(img, (49, 163, 84), 0.8875)
    text = _hover_fills(pg, img, tip, (x, 0.8875), until="/compressed row/.test(el.textContent)")
    assert text.startswith("query 63 × compressed row") and "no more than the indexer's top 32" in text, text
    # a query early in the prompt: its raw window starts at position 0, not at a negative one
    text = _hover_fills(pg, img, tip, (0.15, 0.8), until="el.textContent.includes('all so far')")
    m = re.fullmatch(r"query (\d+) × key position (\d+) \(ring slot \d+, written by this step\): seen: in the raw "
                     r"window \(positions 0–(\d+), all so far\)", text)
    assert m and m[1] == m[3] and int(m[2]) <= int(m[1]) < 64 and not re.search(r"\(-\d", text), text
    # the key axis names what the columns are (its title drawn on the canvas, and the image's alt)
    assert img.get_attribute("alt") == "mask: query position (down) × key position (raw rows) · compressed row (across)"
    out.screenshot(path=str(ARTIFACTS / "prefill_view_chunk0.png"))
    # another layer: ratio 128
    out.locator(".widget-dropdown select").select_option(label="3: ratio 128")
    pg.wait_for_function("(el) => el.textContent.includes('layer 3')", arg=mask.locator(".ds4-title").element_handle(),
                         timeout=10_000)
    assert kv.locator(".ds4-layer b").first.inner_text() == "layer 3"
    # every chunk is run: the buttons only scrub now (prefill.step() in a cell returns the last chunk, noted)
    assert out.locator(".widget-button", has_text="step").is_disabled()
    assert out.locator(".widget-button", has_text="run").is_disabled()
    # ratio 128 at chunk 0 (tokens 0–63) has no compressed row yet, a raw-only layer none ever: the key axis names
    # raw rows only
    assert img.get_attribute("alt") == "mask: query position (down) × key position (raw rows) (across)"
    # and the KV view says so (it read "0 compressed rows, row c pooling tokens 128c to 128c+127")
    layer3 = kv.locator(".ds4-layer").first.inner_text()
    assert "no compressed row yet: row c will pool tokens 128c\xa0to\xa0128c+127" in layer3, layer3
    # a range of positions (the pending group's, "0–63") stays on one line in the stepper's narrow KV column
    ranges = kv.locator(".ds4-nowrap")
    assert ranges.count() > 0 and all(r.evaluate("(e) => e.getClientRects().length") == 1 for r in ranges.all())
    out.screenshot(path=str(ARTIFACTS / "prefill_view_layer3.png"))
    width_at_chunk0 = img.evaluate("(i) => i.naturalWidth")
    # one scale for every layer and chunk: layer 3's image as wide as layer 2's (its triangles jumped in size)
    assert width_at_chunk0 == width_at_chunk4
    # at chunk 4 its 2 compressed rows are columns FEW_PX wide (a 1 px hairline apart), not 3 px as a raw row's
    handle.focus()
    for _ in range(4):
        handle.press("ArrowRight")
    pg.wait_for_function("(el) => el.textContent.includes('layer 3, chunk 4')",
                         arg=mask.locator(".ds4-title").element_handle(), timeout=10_000)
    img.evaluate("(i) => i.decode()")
    assert _longest_run(img, (49, 163, 84)) == FEW_PX - 1  # the compressed rows' colour: seen (no indexer)
    # as wide as at chunk 0, which has none: the width is planned with the widened columns of every chunk
    assert img.evaluate("(i) => i.naturalWidth") == width_at_chunk0
    out.screenshot(path=str(ARTIFACTS / "prefill_view_layer3_chunk4.png"))
    # a run chunk's row in the table shows it, as the slider does (which moves with it); the row says so
    row = view.locator("tr[data-pick='2']")
    assert row.evaluate("(r) => getComputedStyle(r).cursor") == "pointer"
    row.click()
    pg.wait_for_function("(el) => el.textContent.includes('layer 3, chunk 2')",
                         arg=mask.locator(".ds4-title").element_handle(), timeout=10_000)
    assert view.locator(".ds4-title").inner_text().endswith("shown: after chunk 2 (tokens 128–191)")
    assert view.locator("tr.ds4-sel").get_attribute("data-pick") == "2"
    out.screenshot(path=str(ARTIFACTS / "prefill_view_row_clicked.png"))
    handle.focus()  # back to chunk 0: the page as the tests after this one expect it
    for _ in range(4):
        handle.press("ArrowLeft")
    pg.wait_for_function("(el) => el.textContent.includes('layer 3, chunk 0')",
                         arg=mask.locator(".ds4-title").element_handle(), timeout=10_000)
    layers_height = kv.locator(".ds4-layers").bounding_box()["height"]
    out.locator(".widget-dropdown select").select_option(label="0: raw only")
    pg.wait_for_function("(el) => el.textContent.includes('layer 0')", arg=mask.locator(".ds4-title").element_handle(),
                         timeout=10_000)
    # a raw-only layer has one line where layer 3 had four: its box keeps the room, so nothing under it moves
    assert kv.locator(".ds4-layers").bounding_box()["height"] == pytest.approx(layers_height, abs=1)
    assert img.get_attribute("alt") == "mask: query position (down) × key position (raw rows) (across)"
    out.screenshot(path=str(ARTIFACTS / "prefill_view_layer0.png"))
    # on a 2x screen the mask's image has twice the pixels of its box (at 1x it was soft there), and the pointer
    # still finds its cells
    cdp, size = pg.context.new_cdp_session(pg), pg.viewport_size
    cdp.send("Emulation.setDeviceMetricsOverride", dict(size, deviceScaleFactor=2, mobile=False))
    try:
        out.locator(".widget-dropdown select").select_option(label="2: ratio 4, indexer")
        pg.wait_for_function("(el) => el.textContent.includes('layer 2')",
                             arg=mask.locator(".ds4-title").element_handle(), timeout=10_000)
        img.evaluate("(i) => i.decode()")
        assert img.evaluate("(i) => [i.naturalWidth, i.naturalHeight]") == [2 * img.evaluate("(i) => i.width"),
                                                                           2 * img.evaluate("(i) => i.height")]
        assert _hover_fills(pg, img, tip, (0.15, 0.8), until="el.textContent.includes('all so far')")
        mask.screenshot(path=str(ARTIFACTS / "prefill_view_mask_2x.png"))
    finally:
        cdp.send("Emulation.clearDeviceMetricsOverride")
        out.locator(".widget-dropdown select").select_option(label="0: raw only")


def _visible_sliders(out) -> list:
    return [s for s in out.locator(".widget-hslider").all() if s.is_visible()]


def _prompt_offset(box) -> float:
    """px from the top of the prompt box's visible part to the first token of the chunk shown."""
    return box.evaluate("(b) => b.querySelector('[data-start]').getBoundingClientRect().top - "
                        "b.getBoundingClientRect().top - b.clientTop")


def test_prefill_view_shown_after_its_run_has_one_control(page):
    """A PrefillView run before it is shown, on a middle chunk: its first drawing scrolls the prompt box to that chunk
    (the view is drawn before JupyterLab lays it out); one slider, "show", and moving it moves the title, the table,
    the prompt, the KV cache and the mask together (the KV view inside has no slider of its own)."""
    pg, *_ = page
    view = pg.locator(".ds4-view.ds4-prefill").nth(1)  # the second of the two (its title changes)
    assert view.locator(".ds4-title").inner_text() == (
        "Prefill: 320/320 tokens, 5/5 chunks of ≤64 run · shown: after chunk 2 (tokens 128–191)")
    out = _output_of(view)
    box, kv, mask = view.locator(".ds4-prompt"), out.locator(".ds4-kv"), _mask_of(out)
    assert box.evaluate("(b) => b.scrollTop") > 0
    assert 0 <= _prompt_offset(box) <= 8, _prompt_offset(box)  # the chunk starts at the box's top
    assert view.locator(".ds4-prompt .ds4-tok[data-start]").get_attribute("data-tip") == "position 128, chunk 2"
    sliders = _visible_sliders(out)
    assert [s.locator(".widget-label").first.inner_text() for s in sliders] == ["show"]
    assert kv.locator(".ds4-title").inner_text().startswith("KV cache after chunk 2 (tokens 128–191): 192 tokens")
    out.screenshot(path=str(ARTIFACTS / "prefill_view_late.png"))
    handle = sliders[0].locator(".noUi-handle").first
    handle.focus()
    handle.press("ArrowLeft")
    pg.wait_for_function("(el) => el.textContent.includes('chunk 1')", arg=mask.locator(".ds4-title").element_handle(),
                         timeout=10_000)
    pg.wait_for_function("(el) => el.textContent.includes('chunk 1')", arg=kv.locator(".ds4-title").element_handle(),
                         timeout=10_000)
    assert view.locator(".ds4-title").inner_text().endswith("shown: after chunk 1 (tokens 64–127)")
    assert kv.locator(".ds4-title").inner_text().startswith("KV cache after chunk 1 (tokens 64–127): 128 tokens")
    assert mask.locator(".ds4-title").inner_text().startswith("What each query sees — layer 2, chunk 1 (tokens 64–127)")
    assert view.locator("tr.ds4-sel td").first.inner_text().strip() == "1"
    assert view.locator(".ds4-prompt .ds4-tok[data-start]").get_attribute("data-tip") == "position 64, chunk 1"
    assert 0 <= _prompt_offset(box) <= 8, _prompt_offset(box)
    assert len(_visible_sliders(out)) == 1
    out.screenshot(path=str(ARTIFACTS / "prefill_view_late_chunk1.png"))


def test_kvcache_view_renders(page):
    pg, *_ = page
    views = pg.locator(".ds4-kv").filter(has=pg.locator(".ds4-title", has_text=re.compile(r"^KV cache after chunk 4")))
    standalone = [v for v in views.all() if v.locator(".ds4-layer").count() > 1]
    assert len(standalone) == 1
    view = standalone[0]
    title = view.locator(".ds4-title").inner_text()
    assert re.match(r"KV cache after chunk 4 \(tokens 256–\d+\): [1-9]\d* tokens, [\d,]+ bytes", title), title
    assert view.locator(".ds4-layer").count() == 6
    # a fresh view outlines what its slider's chunk wrote, as the slider does: chunk 4's 64 slots
    assert view.locator(".ds4-slot-new").count() == 64
    note = view.locator(".ds4-ringbox .ds4-note")
    assert "written by the step shown (positions 256–319)" in note.inner_text()
    assert note.bounding_box()["width"] >= 450  # the legend takes the room the output has
    # on a tall screen the ring is drawn larger (30% of its height, at most 330 px; it was 240 on every screen)
    ring = view.locator(".ds4-ring").bounding_box()
    assert ring["width"] == ring["height"] == pytest.approx(min(330, 0.3 * pg.viewport_size["height"]), abs=1)
    # the indexer's layers mark what the last query reads: the captured top 32 of 80 rows, the others dropped; the
    # colours' key once, above the layers (a key in each indexer's layer made the view 880 px tall at a laptop's width)
    key = view.locator(".ds4-key-comp")
    assert key.count() == 1 and key.bounding_box()["y"] < view.locator(".ds4-layer").first.bounding_box()["y"]
    key_text = " ".join(key.inner_text().split())  # a swatch between two words leaves two spaces
    assert "those the indexer drops are salmon (as in the attention and mask views)" in key_text
    # each swatch on the line of the words it keys (one ended a line, "tokens pending" starting the next)
    for swatch in key.locator(".ds4-swatch").all():
        words = swatch.locator("xpath=..")
        assert words.evaluate("(w) => w.classList.contains('ds4-nowrap') && w.getClientRects().length === 1")
    for layer in (2, 4):
        box = view.locator(".ds4-layer").nth(layer)
        assert "the last query (319) reads the 32 the indexer picked" in box.inner_text()
        assert box.locator(".ds4-cell.comp").count() == 80 and box.locator(".ds4-cell.comp.dropped").count() == 48
        # kept: the compressed rows' green, dropped: salmon, as the MaskView and the AttentionView give them (below)
        colour = "el => getComputedStyle(el).backgroundColor"
        assert box.locator(".ds4-cell.comp.kept").count() == 32
        assert box.locator(".ds4-cell.comp.kept").first.evaluate(colour) == "rgb(49, 163, 84)"
        assert box.locator(".ds4-cell.comp.dropped").first.evaluate(colour) == "rgb(252, 187, 161)"
        dropped = box.locator(".ds4-cell.comp.dropped").first.get_attribute("data-tip")
        assert dropped.endswith("dropped by the indexer for the last query (319)"), dropped
    for kind in ("comp", "index"):
        assert view.locator(f".ds4-layer .ds4-cell.{kind}").count() > 0, f"no .ds4-cell.{kind} cells"
    slot = view.locator(".ds4-slot.live").first
    assert re.fullmatch(r"slot \d+: position \d+ \(in the raw window\)(, written by this step)?"
                        r"(, overwrote position \d+)?", slot.get_attribute("data-tip"))
    # hovered, a cell or a slot shows its text at once in the styled tooltip beside the pointer, as the attention
    # figure's (no native title: it waits a second and is unstyled)
    assert view.locator("[title], title").count() == 0
    tip = view.locator(".ds4-hovertip")
    cell = view.locator(".ds4-layer").nth(2).locator(".ds4-cell.comp.dropped").first
    # a ratio-128 layer's pending group is a bar: hovered it says which group and how full (it showed nothing)
    bar = view.locator(".ds4-layer").nth(3).locator(".ds4-pendbar")
    assert bar.get_attribute("data-tip") == "row 2: tokens 256–383, compressed into it when the last one comes"
    for target in (cell, slot, bar):
        want = json.dumps(target.get_attribute("data-tip"))
        _hover_fills(pg, target, tip, until=f"el.checkVisibility() && el.textContent === {want}")
        _tip_beside(pg, target, tip, view)
    out = _output_of(view)
    cell.scroll_into_view_if_needed()
    cell.hover()
    out.screenshot(path=str(ARTIFACTS / "kvcache_view_tooltip.png"))
    view.locator(".ds4-title").hover()  # off every cell: no tooltip
    pg.wait_for_function("(el) => !el.checkVisibility()", arg=tip.element_handle(), timeout=5_000)
    assert "window" not in view.locator(".ds4-layer").first.inner_text()  # per layer: groups, not windows
    # the write pointer's ▲ turned to point out along its line, through the middle of the slot it names (it pointed
    # up wherever it was; on the slot's edge the line hid the band of the slot written last)
    centre = view.locator(".ds4-ringcentre")
    cap, ptr = int(centre.nth(0).text_content().split()[0]), int(centre.nth(1).text_content().split()[-1])
    transform = view.locator(".ds4-pointer-label").get_attribute("transform") or ""
    turn = re.fullmatch(r"rotate\(([-\d.e]+) [-\d.e]+ [-\d.e]+\)", transform)
    assert turn and float(turn[1]) == pytest.approx(360 * (ptr + 0.5) / cap), (turn, ptr, cap)
    slider = out.locator(".widget-hslider")
    assert slider.count() == 1 and slider.locator(".widget-label").first.inner_text() == "chunk"
    assert slider.locator(".widget-readout").first.inner_text() == "4"  # the title's "after chunk 4"
    out.screenshot(path=str(ARTIFACTS / "kvcache_view.png"))
    # after chunk 1 the last query sees 32 rows, no more than the top 32: attended all, no choice, so they keep the
    # colour the key gives compressed rows (they were the key's unlisted "kept" blue). Handles, not locators: the
    # view's locator finds it by its title, which the slider changes (and the title is drawn anew)
    handle, body = slider.locator(".noUi-handle").first.element_handle(), view.element_handle()
    title = "(el) => el.querySelector('.ds4-title').textContent.startsWith('KV cache after chunk %d')"
    handle.focus()
    for _ in range(3):
        handle.press("ArrowLeft")
    pg.wait_for_function(title % 1, arg=body, timeout=10_000)
    layer2 = body.query_selector_all(".ds4-layer")[2]
    assert len(layer2.query_selector_all(".ds4-cell.comp")) == 32, layer2.inner_text()
    assert "all compressed rows attended" in layer2.inner_text()
    assert layer2.query_selector_all(".ds4-cell.comp.kept, .ds4-cell.comp.dropped") == []
    assert "kept" not in body.query_selector(".ds4-key-comp").inner_text()
    # after chunk 2 the pointer is at slot 192, its ▲ left of the ring's centre: clear of the centre's text (it
    # read "◀next: slot 192")
    handle.press("ArrowRight")
    pg.wait_for_function(title % 2, arg=body, timeout=10_000)
    clear = body.evaluate("""(el) => {
        const a = el.querySelector('.ds4-pointer-label').getBoundingClientRect();
        return [...el.querySelectorAll('.ds4-ringcentre')].every((t) => { const b = t.getBoundingClientRect();
            return a.right <= b.left || b.right <= a.left || a.bottom <= b.top || b.bottom <= a.top; }); }""")
    assert clear and "next: slot 192" in body.inner_text()
    body.query_selector(".ds4-ring").screenshot(path=str(ARTIFACTS / "kvcache_ring_slot192.png"))
    for _ in range(2):  # back to chunk 4, as the view began
        handle.press("ArrowRight")
    pg.wait_for_function(title % 4, arg=body, timeout=10_000)


def test_mask_of_a_decode_step_renders(page):
    pg, *_ = page
    view = _view(pg, "What each query sees — layer 2, a decode step")
    assert view.locator("img.ds4-maskimg").count() == 1
    legend = view.locator(".ds4-legend").inner_text()
    assert "dropped by the indexer" in legend and "kept" in legend and "future" not in legend

    def swatch(name):
        key = view.locator(".ds4-key").filter(has_text=re.compile(f"^{name}$"))
        return key.locator(".ds4-swatch").evaluate("(s) => getComputedStyle(s).backgroundColor")

    # kept: the compressed rows' green (raw rows are blues); dropped: the AttentionView's salmon
    assert swatch("kept") == "rgb(49, 163, 84)" and swatch("dropped by the indexer") == "rgb(252, 187, 161)"
    # the step's own row (the query itself) a column FEW_PX wide, as a few compressed rows: at a raw row's 2-3 px
    # with no header a walk-through could not find the "own" the legend names
    img = view.locator("img.ds4-maskimg")
    img.evaluate("(i) => i.decode()")
    # a mask of its own takes the output's room (mask_view.SIZE_PX: 720 px of keys; under half of it when it had the
    # PrefillView's 480): the 145 keys 4 px each
    assert img.evaluate("(i) => i.naturalWidth") >= 600
    assert _longest_run(img, (8, 81, 156)) == FEW_PX - 1
    # under a bar of the accent, as the KV view marks what the step wrote (a teacher saw orange there, blue here)
    from ds4lab.viz import palette

    assert _longest_run(img, palette.rgb(palette.ACCENT)) == FEW_PX
    # the sink a column as wide as the AttentionView's: at a raw row's 2-3 px a walk-through could hardly find it
    from ds4lab.viz.attention_figure import SINK_PX

    assert _longest_run(img, palette.rgb(palette.SINK)) == SINK_PX - 1
    # and its position ticked under it: the label was dropped for c0's beside it (c0's gave way, then was missing
    # where every other mask has it: now it starts at its tick, clear of the position's)
    assert _ink_below(img, (8, 81, 156)) >= 20  # 49 with "320" drawn, 4 (its tick mark) without
    assert _ink_below(img, (8, 81, 156), right_of=(8, 24)) >= 20  # "c0"
    # "own" and "compressed" on the headers' line, a thin grey line between them (they read as one phrase): one
    # column grey over the line's height, right of the own column's start
    lines = img.evaluate("""(el) => {
        const c = document.createElement('canvas'); c.width = el.naturalWidth; c.height = el.naturalHeight;
        const ctx = c.getContext('2d'); ctx.drawImage(el, 0, 0);
        const d = ctx.getImageData(0, 0, c.width, 16).data, found = [];
        for (let x = 0; x < c.width; x++) {
            let n = 0;
            for (let y = 2; y < 15; y++) { const i = (y * c.width + x) * 4; n += d[i] === 153 && d[i + 3] === 255; }
            if (n === 13) found.push(x);
        }
        return found; }""")
    assert len(lines) == 1, lines
    # and under them "320" and "c0" (10 px apart) a line between them too: one grey column over the labels' height,
    # between the own column's middle (where its label ends) and the compressed rows' start (where c0's starts)
    axis = img.evaluate("""(el) => {
        const c = document.createElement('canvas'); c.width = el.naturalWidth; c.height = el.naturalHeight;
        const ctx = c.getContext('2d'); ctx.drawImage(el, 0, 0);
        const d = ctx.getImageData(0, 0, c.width, c.height).data, found = [], own = [];
        for (let x = 0; x < c.width; x++) {
            let run = 0, best = 0;
            for (let y = 0; y < c.height; y++) {
                const i = (y * c.width + x) * 4;
                if (d[i] === 8 && d[i + 1] === 81 && d[i + 2] === 156) { own.push(x); break; }
            }
            for (let y = 0; y < c.height; y++) {
                const i = (y * c.width + x) * 4;
                run = d[i] === 153 && d[i + 1] === 153 && d[i + 3] === 255 ? run + 1 : 0; best = Math.max(best, run);
            }
            if (best === 11) found.push(x);
        }
        return [found, own[0], own.at(-1)]; }""")
    axis, own = axis[0], axis[1:]
    assert len(axis) == 1 and (own[0] + own[1]) / 2 < axis[0] < own[1] + 8, (axis, own)
    _output_of(view).screenshot(path=str(ARTIFACTS / "mask_decode.png"))


def _ink_below(img, rgb, right_of: tuple[int, int] | None = None) -> int:
    """Dark opaque (text) pixels of an image in the 12 px under its columns of exactly the colour ``rgb`` (and 2 px
    either side); with ``right_of`` = (a, b), under the columns a to b px right of them instead."""
    return img.evaluate(
        """(el, [[r, g, b], right]) => {
            const c = document.createElement('canvas'); c.width = el.naturalWidth; c.height = el.naturalHeight;
            const ctx = c.getContext('2d'); ctx.drawImage(el, 0, 0);
            const d = ctx.getImageData(0, 0, c.width, c.height).data, at = (x, y) => (y * c.width + x) * 4;
            let x0 = c.width, x1 = -1, y1 = -1;
            for (let y = 0; y < c.height; y++) for (let x = 0; x < c.width; x++) {
                const i = at(x, y);
                if (d[i] !== r || d[i + 1] !== g || d[i + 2] !== b) continue;
                x0 = Math.min(x0, x); x1 = Math.max(x1, x); y1 = y;
            }
            let n = 0;
            const [xa, xb] = right ? [x1 + right[0], x1 + right[1]] : [x0 - 2, x1 + 2];
            for (let y = y1 + 1; y <= Math.min(c.height - 1, y1 + 12); y++)
                for (let x = Math.max(0, xa); x <= Math.min(c.width - 1, xb); x++) {
                    const i = at(x, y);
                    if (d[i + 3] > 128 && d[i] < 100 && d[i + 1] < 100 && d[i + 2] < 100) n++;  // (transparent: none)
                }
            return n;
        }""",
        [list(rgb), right_of],
    )


def _ink(canvas, x0: float, y0: float, x1: float, y1: float) -> int:
    """Dark (text) pixels of a canvas inside a box given in CSS px."""
    return canvas.evaluate(
        """(c, [x0, y0, x1, y1]) => {
            const k = c.width / c.getBoundingClientRect().width;
            const d = c.getContext('2d').getImageData(x0 * k, y0 * k, (x1 - x0) * k, (y1 - y0) * k).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4) if (d[i] < 100 && d[i + 1] < 100 && d[i + 2] < 100) n++;
            return n;
        }""",
        [x0, y0, x1, y1],
    )


def _pixels_of(canvas, rgb) -> int:
    """Pixels of a canvas of exactly the colour ``rgb``."""
    return canvas.evaluate(
        """(c, [r, g, b]) => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
            for (let i = 0; i < d.length; i += 4) if (d[i] === r && d[i + 1] === g && d[i + 2] === b) n++;
            return n;
        }""",
        list(rgb),
    )


def _colour_x(img, rgb, y: float) -> float:
    """Where along the image's row at ``y`` (a fraction of its height) the last run of pixels of exactly the colour
    ``rgb`` has its middle, as a fraction of its width (fails where the row has none)."""
    x = img.evaluate(
        """(el, [[r, g, b], y]) => {
            const c = document.createElement('canvas'); c.width = el.naturalWidth; c.height = el.naturalHeight;
            c.getContext('2d').drawImage(el, 0, 0);
            const d = c.getContext('2d').getImageData(0, Math.floor(y * c.height), c.width, 1).data;
            let end = -1, start = -1;
            for (let x = c.width - 1; x >= 0; x--) {
                const hit = d[4 * x] === r && d[4 * x + 1] === g && d[4 * x + 2] === b;
                if (hit && end < 0) end = x;
                if (!hit && end >= 0) { start = x + 1; break; }
            }
            return end < 0 ? -1 : (Math.max(start, 0) + end + 1) / 2 / c.width;
        }""",
        [list(rgb), y],
    )
    assert x >= 0, f"no pixel of {rgb} in the row at {y} of the image"
    return x


def _longest_run(el, rgb, rows=None) -> float:
    """The longest horizontal run of pixels of exactly the colour ``rgb`` in a canvas or an image, within its rows
    ``rows`` = (y0, y1) (CSS px; default all), in CSS px."""
    return el.evaluate(
        """(el, [[r, g, b], rows]) => {
            let c = el;
            if (el.tagName === 'IMG') {
                c = document.createElement('canvas'); c.width = el.naturalWidth; c.height = el.naturalHeight;
                c.getContext('2d').drawImage(el, 0, 0);
            }
            const k = c.width / el.getBoundingClientRect().width;
            const [y0, y1] = rows ? [Math.floor(rows[0] * k), Math.ceil(rows[1] * k)] : [0, c.height];
            const d = c.getContext('2d').getImageData(0, y0, c.width, y1 - y0).data;
            let best = 0;
            for (let y = 0; y < y1 - y0; y++) {
                for (let x = 0, run = 0; x < c.width; x++) {
                    const i = (y * c.width + x) * 4;
                    run = d[i] === r && d[i + 1] === g && d[i + 2] === b ? run + 1 : 0;
                    best = Math.max(best, run);
                }
            }
            return best / k;
        }""",
        [list(rgb), rows],
    )


def _separators(canvas, x0: float, x1: float) -> list[float]:
    """The x (CSS px) of the thin grey lines in the group headers' row between x0 and x1: pixel columns grey from top
    to bottom of attention_figure.SEP_Y at the figure's scale (a letter's stem is shorter, and dark)."""
    y0, y1 = (y * canvas.bounding_box()["width"] / FIG_W for y in SEP_Y)
    return canvas.evaluate(
        """(c, [x0, x1, y0, y1]) => {
            const k = c.width / c.getBoundingClientRect().width;
            const [a, b] = [Math.floor(x0 * k), Math.ceil(x1 * k)];
            const [top, h] = [Math.ceil(y0 * k), Math.floor((y1 - y0) * k)];
            const d = c.getContext('2d').getImageData(a, top, b - a, h).data, found = [];
            for (let x = 0; x < b - a; x++) {
                let grey = 0;
                for (let y = 0; y < h; y++) {
                    const i = (y * (b - a) + x) * 4, [r, g, bl] = [d[i], d[i + 1], d[i + 2]];
                    if (r > 100 && r < 200 && Math.abs(r - g) < 12 && Math.abs(g - bl) < 12) grey++;
                }
                if (grey >= h - 1 && !(found.length && found.at(-1) === (a + x - 1) / k)) found.push((a + x) / k);
            }
            return found;
        }""",
        [x0, x1, y0, y1],
    )


def _separated(canvas, x0: float, x1: float) -> bool:
    """One separator line between x0 and x1 in the headers' row, in the middle of a gap: no text within 2.5 px of it,
    text within 14 px on both sides (the two headers it separates)."""
    found = _separators(canvas, x0, x1)
    if len(found) != 1:
        return False
    x = found[0]
    y0, y1 = 16 * canvas.bounding_box()["width"] / FIG_W, 28 * canvas.bounding_box()["width"] / FIG_W
    return (_ink(canvas, x - 2.5, y0, x, y1) == 0 and _ink(canvas, x + 1, y0, x + 3.5, y1) == 0
            and _ink(canvas, x - 14, y0, x, y1) > 0 and _ink(canvas, x + 1, y0, x + 15, y1) > 0)


IMAGE_HASH_JS = """(c) => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let h = 0;
    for (let i = 0; i < d.length; i += 4) h = (h * 31 + d[i] + 7 * d[i + 1] + 13 * d[i + 2]) | 0;
    return h; }"""


def _image_hash(canvas) -> int:
    return canvas.evaluate(IMAGE_HASH_JS)


@pytest.fixture
def files_closed(page):
    """JupyterLab's file browser closed for the test (its pixel counts were set on the attention figure at its full
    size, which a 1400 px page gives only without it: beside the file browser the figure shrinks for the heads)."""
    pg = page[0]
    was = _side_panel(pg, False)
    pg.wait_for_function(f"() => document.querySelector('.ds4-att-stage canvas').getBoundingClientRect().width"
                         f" == {FIG_W}", timeout=5_000)
    yield
    _side_panel(pg, was)


def test_attention_view_renders(page, files_closed):
    """The attention figure: at least 480 px wide, axis text drawn left of and under the heatmap, close group headers
    with a line between them, a tooltip naming layer, head, query, key and mass split; a layer switch keeps the size
    and re-describes what is under the pointer (no stale tooltip); a drag zooms into a region re-reduced in Python
    (every cell), which another layer keeps; a double-click resets."""
    pg, *_ = page
    views = pg.locator(".ds4-view:has(.ds4-att-stage)")
    assert views.count() == 1
    view = views.first
    title, note = view.locator(".ds4-title"), view.locator(".ds4-note")
    assert title.inner_text().startswith("layer 2 (ratio 4), head 0:")
    assert re.match(r"160×201 cells, max-pooled ×2 queries and ×2 keys", note.inner_text()), note.inner_text()
    canvas = view.locator(".ds4-att-stage canvas")
    stats = _painted(canvas)
    assert stats["cssW"] >= 480, stats
    assert stats["painted"] > 0.2 * stats["w"] * stats["h"], f"attention canvas looks blank: {stats}"
    assert stats["colours"] >= 8, f"attention canvas has too few colours for a heatmap: {stats}"
    # the compressed rows of weight 0 in the MaskView's colours: not yet compressed (the upper right triangle of
    # the compressed group) pale yellow, dropped by the indexer salmon
    assert _pixels_of(canvas, (255, 255, 204)) > 2000 and _pixels_of(canvas, (252, 187, 161)) > 500
    box = canvas.bounding_box()
    # "compressed 4:1 (80 rows)" and "sink": a line between them, none between the raw window's header and the next
    k = box["width"] / FIG_W
    assert _separated(canvas, (LEFT + WIDTH - 130) * k, (LEFT + WIDTH) * k)
    assert not _separators(canvas, LEFT * k, (LEFT + WIDTH - 130) * k)
    # axis text: query positions left of the heatmap (x < 118), key positions under it (y 522…596), group labels
    assert _ink(canvas, 0, 40, 112, 520) > 400 and _ink(canvas, 118, 524, 838, 596) > 400
    assert _ink(canvas, 118, 0, 838, 30) > 100
    # small multiples: one per captured head, the shown one marked
    assert view.locator(".ds4-att-head").count() == 4 and view.locator(".ds4-att-head.ds4-sel").inner_text() == "head 0"
    tip = view.locator(".ds4-hovertip")
    text = _hover_fills(pg, canvas, tip, position=(0.3, 0.4), until="el.textContent.includes('→')")
    assert re.match(r"layer 2 head 0 · queries \d+–\d+ → raw keys \d+–\d+: weight [\d.e+-]+.* · mass raw [\d.]+ \| "
                    r"compressed [\d.]+ \| sink [\d.e+-]+$", text), text
    out = _output_of(view)
    out.screenshot(path=str(ARTIFACTS / "attention_view.png"))
    dropdowns = out.locator(".widget-dropdown select")
    assert dropdowns.count() == 2  # layer and head pickers
    # switch to layer 3 with the pointer still on the canvas: same size, the tooltip describes layer 3 at once
    dropdowns.first.select_option(label="3")
    pg.wait_for_function("(el) => el.textContent.startsWith('layer 3 (ratio 128)')", arg=title.element_handle(),
                         timeout=10_000)
    pg.wait_for_function("(el) => el.textContent.startsWith('layer 3 head 0 ·')", arg=tip.element_handle(),
                         timeout=5_000)
    size = lambda b: (b["width"], b["height"])  # noqa: E731 (the page may scroll; the figure keeps its size)
    assert size(canvas.bounding_box()) == size(box)
    # no indexer on layer 3: no cell and no legend key in its salmon
    pg.wait_for_timeout(300)
    assert _pixels_of(canvas, (252, 187, 161)) == 0
    # its 2 compressed rows: 2 columns FEW_PX wide at least (the green bar over their group), not one of 4 px; the
    # group headers on one line (no ink above it over the heatmap), at most HEADER_CHAR px a character, as Python
    # placed them apart (attention_figure.place_headers)
    k = canvas.bounding_box()["width"] / FIG_W
    assert _longest_run(canvas, (49, 163, 84), rows=((TOP - 6) * k, (TOP - 4) * k)) >= (2 * FEW_PX - 1) * k
    assert _ink(canvas, LEFT * k, 0, (LEFT + WIDTH) * k, 14 * k) == 0
    assert _ink(canvas, (LEFT + WIDTH - 60) * k, 16 * k, (LEFT + WIDTH) * k, 28 * k) > 40  # "comp sink"
    # a thin grey line between "comp" and "sink", so that they read as two headers (they were 4 px apart)
    assert _separated(canvas, (LEFT + WIDTH - 60) * k, (LEFT + WIDTH) * k)
    font = canvas.evaluate("(c) => { const x = c.getContext('2d'); x.font = '11px ui-monospace, Menlo, Consolas, "
                           "monospace'; return x.measureText('raw keys 0–319 (320) comp sink').width / 30; }")
    assert font <= HEADER_CHAR
    out.screenshot(path=str(ARTIFACTS / "attention_view_layer3.png"))
    # a small multiple clicked: head 1, and the tooltip follows
    view.locator(".ds4-att-head[data-head='1']").click()
    pg.wait_for_function("(el) => el.textContent.startsWith('layer 3 (ratio 128), head 1')",
                         arg=title.element_handle(), timeout=10_000)
    assert view.locator(".ds4-att-head.ds4-sel").inner_text() == "head 1" and dropdowns.nth(1).input_value() != ""
    # drag over a region of the raw window: Python re-reduces it from the full weights, every cell shown
    before, note_h = _image_hash(canvas), note.bounding_box()["height"]
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    pg.mouse.move(box["x"] + 0.25 * box["width"], box["y"] + 0.3 * box["height"])
    pg.mouse.down()
    pg.mouse.move(box["x"] + 0.32 * box["width"], box["y"] + 0.38 * box["height"], steps=4)
    pg.mouse.up()
    pg.wait_for_function("(el) => el.textContent.includes('zoomed')", arg=note.element_handle(), timeout=10_000)
    m = re.match(r"(\d+)×(\d+) cells, every cell shown · zoomed: queries (\d+)–(\d+)", note.inner_text())
    assert m and int(m[1]) == int(m[4]) - int(m[3]) + 1 and int(m[1]) < 60 and int(m[2]) < 60, note.inner_text()
    pg.wait_for_timeout(300)
    assert _image_hash(canvas) != before and size(canvas.bounding_box()) == size(box)
    text = _hover_fills(pg, canvas, tip, position=(0.5, 0.5), until="el.textContent.includes('→')")
    assert re.match(r"layer 3 head 1 · query \d+ '.*' → raw key \d+ '.*': weight", text), text
    q = int(re.match(r"layer 3 head 1 · query (\d+)", text)[1])
    assert int(m[3]) <= q <= int(m[4])
    out.screenshot(path=str(ARTIFACTS / "attention_view_zoom.png"))
    # another layer keeps the zoom: the same queries and raw keys (both layers' raw windows hold the same positions)
    region = r"zoomed: queries \d+–\d+, columns \d+–\d+ of"  # of the layer's columns (323 here, 401 in layer 2)
    zoomed = re.search(region, note.inner_text())[0]
    before = _image_hash(canvas)
    dropdowns.first.select_option(label="2")
    pg.wait_for_function("(el) => el.textContent.startsWith('layer 2 (ratio 4), head 1')", arg=title.element_handle(),
                         timeout=10_000)
    pg.wait_for_timeout(300)
    kept = re.search(region, note.inner_text())
    assert kept and kept[0] == zoomed, note.inner_text()
    assert note.inner_text().startswith(m[0]) and _image_hash(canvas) != before  # as many cells, layer 2's weights
    assert not out.locator(".widget-button", has_text="reset zoom").is_disabled()
    out.screenshot(path=str(ARTIFACTS / "attention_view_zoom_layer2.png"))
    canvas.dblclick(position={"x": 0.5 * box["width"], "y": 0.5 * box["height"]})
    pg.wait_for_function("(el) => !el.textContent.includes('zoomed')", arg=note.element_handle(), timeout=10_000)
    # the note keeps two lines' height whether its text takes one (layer 3's, the zoom's) or two (layer 2's pooled
    # overview counts its hidden drops): what is under it does not move as a layer or the zoom changes
    assert "indexer-dropped" in note.inner_text()
    assert note.bounding_box()["height"] == note_h, (note.bounding_box(), note_h)
    # a log scale's long low end ("9.5e-05") beside both stripes: their names left of it ("comp" for "compressed"),
    # a blank gap between (drawn over each other, a walk-through read neither)
    before = _image_hash(canvas)
    out.locator(".widget-toggle-button", has_text="log").click()
    pg.wait_for_function("(el) => el.textContent.startsWith('layer 2')", arg=title.element_handle(), timeout=10_000)
    pg.wait_for_function(f"(c) => ({IMAGE_HASH_JS})(c) !== {before}", arg=canvas.element_handle(), timeout=10_000)
    ly = FIG_H - LEGEND + 4  # attention_figure's legend_y + 4: the colour bar's top, the figure at its full size
    cols = [_ink(canvas, x, ly, x + 1, ly + 20) > 0 for x in range(LEFT)]
    runs = "".join("#" if c else "." for c in cols).strip(".")
    assert re.fullmatch(r"[#.]*#\.{6,}#[#.]{0,50}", runs) and runs.count("#") > 30, runs  # names | gap | low end
    out.screenshot(path=str(ARTIFACTS / "attention_view_log.png"))
    out.locator(".widget-toggle-button", has_text="per row").click()


def _round_ticks(vmax: int, px: int = 40) -> list[int]:
    """0 and the multiples up to ``vmax`` of the smallest whole step 1, 2, 2.5 or 5 × 10^k whose ticks lie 16 px
    apart or more on an axis of ``px`` (the ExpertView's token axis: 0, 50 for 97, where 25's four ticks crowded),
    then ``vmax`` itself where it lies 16 px or more above the last (0, 50, 97: the tallest bar's height)."""
    steps = [m * 10 ** k for k in range(len(str(vmax)) + 1) for m in (1, 2, 2.5, 5) if float(m * 10 ** k).is_integer()]
    step = int(min(s for s in steps if px * s / vmax >= 16))
    ticks = list(range(0, vmax + 1, step))
    return ticks + [vmax] if px * (vmax - ticks[-1]) / vmax >= 16 else ticks


def test_expert_view_renders(page):
    pg, *_ = page
    view = _view(pg, "router: tokens per expert")
    assert re.match(r"router: tokens per expert, 6 layers × 8 experts", view.locator(".ds4-title").inner_text())
    hists = view.locator(".ds4-hist")
    assert hists.count() == 6
    assert view.locator(".ds4-hist .ds4-badge").count() >= 1  # hash layers marked
    for i in range(hists.count()):  # every layer has drawn bars
        assert hists.nth(i).locator("svg rect[pointer-events='none']").count() > 0
    # 8 experts: each bar's hover target 48 px wide (at 32 a student found them small on a 1920 px screen)
    assert hists.first.locator("svg rect[data-e]").first.bounding_box()["width"] == pytest.approx(48, abs=0.5)
    assert view.locator(".ds4-tip").inner_text().startswith("hover a bar")
    # a bar's text beside the pointer, on every layer (a caption under the title was 350 px from layer 5's bars)
    for layer, bar in ((0, 2), (5, 0)):
        target = hists.nth(layer).locator("svg rect[data-e]").nth(bar)
        tip = _hover_fills(pg, target, view.locator(".ds4-hovertip"), until="/expert \\d+:/.test(el.textContent)")
        routed = r" \(hash\)" if layer < 3 else ""  # the first three layers route by the token id
        assert re.match(rf"layer {layer}{routed}, expert {bar}: \d+ of \d+ tokens", tip), tip
        _tip_beside(pg, target, view.locator(".ds4-hovertip"), view)
    pg.screenshot(path=str(ARTIFACTS / "expert_view_tooltip.png"))
    # axes: expert ids 0–7 under the bars, tokens up the left from 0 to the top of the scale (one for every layer)
    top = max(int(re.search(r"max (\d+)", hists.nth(i).locator(".ds4-label").inner_text())[1])
              for i in range(hists.count()))
    for i in range(hists.count()):
        svg = hists.nth(i).locator("svg")
        assert svg.locator("text.ds4-xtick").all_text_contents() == [str(e) for e in range(8)]
        assert svg.locator("text.ds4-ytick").all_text_contents() == [str(v) for v in _round_ticks(top)]
        frame, bars = svg.bounding_box(), [r.bounding_box() for r in svg.locator("rect[pointer-events='none']").all()]
        ticks = [t.bounding_box() for t in svg.locator("text").all()]
        assert all(frame["x"] - 1 <= t["x"] and t["x"] + t["width"] <= frame["x"] + frame["width"] + 1 and
                   frame["y"] - 1 <= t["y"] and t["y"] + t["height"] <= frame["y"] + frame["height"] + 1 for t in ticks)
        lowest = max(b["y"] + b["height"] for b in bars)
        xt = [t.bounding_box() for t in svg.locator("text.ds4-xtick").all()]
        assert all(t["y"] >= lowest - 1 for t in xt)  # under the bars
        assert all(t["x"] + t["width"] <= min(b["x"] for b in bars) + 1
                   for t in (y.bounding_box() for y in svg.locator("text.ds4-ytick").all()))  # left of them
    out = _output_of(view)
    assert out.locator(".widget-dropdown").count() == 1 and out.locator(".widget-checkbox").count() == 1
    out.screenshot(path=str(ARTIFACTS / "expert_view.png"))
    height = view.bounding_box()["height"]
    out.locator(".widget-dropdown select").select_option(label="hash layers")  # the title counts what is shown
    view.locator(".ds4-title", has_text="hash layers only").wait_for(timeout=10_000)  # redrawn: a new element
    assert re.match(r"router: tokens per expert, 3 layers \(hash layers only\) × 8 experts",
                    view.locator(".ds4-title").inner_text()) and hists.count() == 3
    # the view keeps its height (as tall as all six layers, its key two lines): what is under it does not move
    assert view.bounding_box()["height"] == height, (view.bounding_box(), height)
    # one scale for every layer still means all six: the hash layers' bars as they were (their own top was 0-100)
    assert hists.first.locator("svg text.ds4-ytick").all_text_contents() == [str(v) for v in _round_ticks(top)]
    # the learned-router layers alone: the key explains their bars only (it still named the hash layers' light grey)
    select = out.locator(".widget-dropdown select")
    select.select_option(value=next(o for o in select.locator("option").all_inner_texts() if "learned" in o))
    view.locator(".ds4-title", has_text="learned-router layers only").wait_for(timeout=10_000)
    assert "hash" not in view.locator(".ds4-note").first.inner_text() and hists.count() == 3
    assert view.bounding_box()["height"] == height
    out.screenshot(path=str(ARTIFACTS / "expert_view_learned.png"))
    out.locator(".widget-dropdown select").select_option(label="all layers")
    # each layer its own scale: its own round ticks, their labels clear of each other (four ticks 10 px apart crowded)
    out.locator(".widget-checkbox input").uncheck()
    view.locator(".ds4-note", has_text="each layer its own scale").wait_for(timeout=10_000)
    for i in range(hists.count()):
        own = int(re.search(r"max (\d+)", hists.nth(i).locator(".ds4-label").inner_text())[1])
        labels = hists.nth(i).locator("svg text.ds4-ytick")
        assert labels.all_text_contents() == [str(v) for v in _round_ticks(own)], own
        ys = sorted(t.bounding_box()["y"] for t in labels.all())
        assert all(b - a >= 15 for a, b in zip(ys, ys[1:])), (own, ys)
    out.locator(".widget-checkbox input").check()


def test_generation_view_renders(page):
    pg, *_ = page
    pg.mouse.move(0, 0)  # out of every view (the test before left it on a histogram's bar)
    view = _view(pg, "Generation:")
    assert re.match(r"Generation: 12 tokens", view.locator(".ds4-title").inner_text())
    assert view.locator(".ds4-gen .ds4-ctx").inner_text().startswith("First Citizen")
    toks = view.locator(".ds4-gen .ds4-tok[data-i]")
    assert toks.count() == 12
    assert all(toks.nth(i).get_attribute("style").startswith("background:") for i in range(12))
    # a hairline ends each token, so that neighbours of one colour stay apart
    assert all(toks.nth(i).evaluate("(t) => getComputedStyle(t).boxShadow") != "none" for i in range(12))
    # the colour key's chips on one line
    chips = view.locator(".ds4-note .ds4-key")
    assert chips.count() == 6 and len({round(c.bounding_box()["y"]) for c in chips.all()}) == 1
    scale = {chips.nth(i).evaluate("(c) => getComputedStyle(c).backgroundColor") for i in range(6)}
    # which probability: the model's softmax (a student asked whether the sampler's temperature was in it)
    assert "(its softmax, before temperature and top-p;" in view.locator(".ds4-note").first.inner_text()
    alts = view.locator(".ds4-alts")
    # out of a token: the last one's alternatives (what the panel is for, and no blank room), said to be the last
    assert alts.inner_text().startswith("the last token generated (hover another for its alternatives)")
    assert re.search(r"position \d+: token \d+", alts.inner_text()) and alts.locator("tr").count() >= 2
    before = alts.bounding_box()["height"]
    # the token's line, from the panel's top (hovering may scroll the page)
    line = lambda: alts.locator("b", has_text="position").bounding_box()["y"] - alts.bounding_box()["y"]  # noqa: E731
    was = line()
    tip = _hover_fills(pg, toks.nth(3), alts, until="!el.textContent.startsWith('the last token generated')")
    assert re.match(r"the token under the pointer \(off the text: the last one generated\)\nposition \d+: token \d+",
                    tip), tip
    assert line() == pytest.approx(was, abs=1)  # it stays where it was (the panel's first line went, it moved up)
    assert alts.bounding_box()["height"] == pytest.approx(before, abs=2)  # filled, it pushes nothing down
    # over every token: the panel keeps its height (a token sampled outside the top 5 adds a row: it grew by one
    # the first time) and the bars start where they did (they moved 10-14 px with the token's width)
    seen = set()
    for i in range(12):
        _hover_fills(pg, toks.nth(i), alts,
                     until="el.textContent.includes('position ') && !el.textContent.startsWith('the last')")
        bar_x = alts.locator(".ds4-pbar").first.bounding_box()["x"] - alts.bounding_box()["x"]
        seen.add((round(alts.bounding_box()["height"]), round(bar_x)))
    assert len({h for h, _ in seen}) == 1 and max(x for _, x in seen) - min(x for _, x in seen) <= 1, seen
    assert view.locator(".ds4-alts tr").count() >= 2  # the sampled token and its alternatives
    # the bars: each alternative's probability over the largest shown (the note says so), the largest 160 px
    assert "bars: p relative to the most likely" in tip
    rows = alts.locator("tr").all()
    p = [float(r.locator("td").nth(1).inner_text().rstrip("%")) for r in rows]
    w = [r.locator(".ds4-pbar").evaluate("(b) => b.getBoundingClientRect().width") for r in rows]
    assert max(w) == pytest.approx(160 + 2, abs=1)  # + its border
    for pi, wi in zip(p, w):
        assert wi - 2 == pytest.approx(160 * pi / max(p), abs=0.02 * 160 + 1), (p, w)
    # the sampled token's row is marked by weight and a word, not by a background of the colour key
    assert all(td.evaluate("(c) => getComputedStyle(c).backgroundColor") not in scale
               for td in alts.locator("td").all())
    marked = alts.locator("tr.ds4-sampled")
    assert marked.count() <= 1 and all("◀ sampled" in r.inner_text() for r in marked.all())
    out = _output_of(view)
    out.screenshot(path=str(ARTIFACTS / "generation_view.png"))
    # the prompt's text has no alternatives: its last line (the box keeps the end of the text in view; its first
    # lines may be scrolled out of it)
    _hover_fills(pg, view.locator(".ds4-gen .ds4-ctx"), alts, position=(0.02, 0.98),
                 until="el.textContent.startsWith('the last token generated')")
    assert alts.inner_text().startswith("the last token generated")
    # the buttons: run / step / stop, each enabled only when it can act, and the status agrees
    buttons = {b.inner_text(): b for b in out.locator(".widget-button").all()}
    assert list(buttons) == ["run", "step", "stop"]
    title = view.locator(".ds4-title")
    assert title.inner_text() == "Generation: 12 tokens — paused: run or step for more"
    assert not buttons["run"].is_disabled() and not buttons["step"].is_disabled() and buttons["stop"].is_disabled()
    tokens = out.locator(".widget-text input")
    tokens.fill("300")
    tokens.press("Enter")
    buttons["run"].click()  # a run the kernel stops between tokens: only stop can act while it goes
    pg.wait_for_function("(b) => !b.disabled", arg=buttons["stop"].element_handle(), timeout=10_000)
    assert buttons["run"].is_disabled() and buttons["step"].is_disabled()
    assert "— running" in title.inner_text()
    out.screenshot(path=str(ARTIFACTS / "generation_view_running.png"))
    buttons["stop"].click()
    pg.wait_for_function("(b) => b.disabled", arg=buttons["stop"].element_handle(), timeout=20_000)
    pg.wait_for_function("(el) => el.textContent.includes('stopped')", arg=title.element_handle(), timeout=10_000)
    assert not buttons["run"].is_disabled() and not buttons["step"].is_disabled()
    n = int(re.match(r"Generation: (\d+) tokens — stopped .*: run or step for more$", title.inner_text())[1])
    assert 12 < n < 312, title.inner_text()
    out.screenshot(path=str(ARTIFACTS / "generation_view_stopped.png"))
    # the pace box: 4 tokens/s spaces a run's tokens a quarter second apart, so a class sees them come one by one
    out.locator(".widget-dropdown select").select_option(label="4 tokens/s")
    tokens.fill("3")
    tokens.press("Enter")
    began = time.monotonic()
    buttons["run"].click()
    counts = [n]
    while counts[-1] < n + 3 and time.monotonic() - began < 20:
        pg.wait_for_timeout(50)
        counts.append(int(re.match(r"Generation: (\d+)", title.inner_text())[1]))
    pg.wait_for_function("(el) => el.textContent.includes('paused')", arg=title.element_handle(), timeout=10_000)
    took = time.monotonic() - began
    assert title.inner_text().startswith(f"Generation: {n + 3} tokens"), title.inner_text()
    assert took >= 0.5 and {n + 1, n + 2} <= set(counts), (took, counts)  # two waits; each count seen on the way


def test_tier_view_renders(page):
    pg, *_ = page
    view = _view(pg, "Tiers:")
    assert re.search(r"2 tiers, 1 copying boundary per step", view.locator(".ds4-title").inner_text())
    units = view.locator(".ds4-stack .ds4-unit")
    assert units.count() == 6 + 2  # embedding, 6 layers, head
    assert {units.nth(i).inner_text() for i in range(units.count())} == {"embed", "head"} | {f"L{i}" for i in range(6)}
    assert view.locator(".ds4-stack .ds4-arrow").count() >= 1  # the last step's switches
    assert view.locator("table tr").count() == 1 + 2  # one row per tier
    bars = view.locator("svg.ds4-steps rect[pointer-events='none']")
    assert bars.count() == 2 + 12  # the prompt's 2 chunks, 12 decoded tokens
    tip = _hover_fills(pg, view.locator("svg.ds4-steps rect[data-i]").first, view.locator(".ds4-tip"))
    assert re.match(r"step 0: batch", tip), tip
    hot = view.locator("svg.ds4-steps rect.ds4-hot")
    assert hot.count() == 1 and hot.get_attribute("data-bar") == "0"  # the step described is outlined
    # the bounds black (dashed, dotted) and the bars greys (batch dark, decode lighter: no hue of a kind of row);
    # copies in near-black, unit colours the tiers'
    from ds4lab.viz import palette, tier_view

    assert view.locator("line.ds4-bound-batch").get_attribute("stroke") == tier_view.BATCH_BOUND
    assert view.locator("line.ds4-bound-decode").get_attribute("stroke") == tier_view.DECODE_BOUND
    assert [bars.nth(i).get_attribute("fill") for i in (0, 2)] == [palette.BATCH, palette.DECODE]
    arrow = view.locator(".ds4-stack .ds4-arrow:not(.nocopy)").first
    assert arrow.evaluate("el => getComputedStyle(el).color") == "rgb(37, 37, 37)"
    _output_of(view).screenshot(path=str(ARTIFACTS / "tier_view.png"))
    # a unit or a switch hovered: its text at once in the styled tooltip beside the pointer (no native title)
    assert view.locator("[title]").count() == 0
    tip = view.locator(".ds4-hovertip")
    unit = units.nth(3)
    text = _hover_fills(pg, unit, tip, until="el.checkVisibility() && el.textContent.length > 0")
    assert re.fullmatch(r"layer 2: tier \d \(.+\), weights [\d,]+ B, KV [\d,]+ B", text), text
    _tip_beside(pg, unit, tip, view)
    text = _hover_fills(pg, arrow, tip, until="el.checkVisibility() && el.textContent.includes('µs')")
    assert re.fullmatch(r"\d → \d, (batch|decode), [\d,]+ bytes, \d+ µs", text), text
    _tip_beside(pg, arrow, tip, view)
    _output_of(view).screenshot(path=str(ARTIFACTS / "tier_view_tooltip.png"))


def test_charts_render_offline(page):
    """Both chart cells are drawn by JupyterLab's Vega-Lite renderer (painted canvas or SVG marks), with no
    CDN, script or other remote request and no "Error loading script"."""
    pg, console, errors, remote = page
    outputs = pg.locator(CHART)
    assert outputs.count() == 2
    for i, name in enumerate(("charts_prefill.png", "chart_experts.png")):
        out = outputs.nth(i)
        if out.locator(".vega-embed canvas").count():
            stats = _painted(out.locator(".vega-embed canvas").first)
            assert stats["painted"] > 0.01 * stats["w"] * stats["h"] and stats["colours"] >= 4, stats
        else:
            assert out.locator(".vega-embed svg path, .vega-embed svg rect").count() > 4
        out.screenshot(path=str(ARTIFACTS / name))
    assert not pg.locator(".jp-OutputArea-output", has_text=re.compile("Error loading script|Javascript Error")).count()
    assert not remote, f"the page asked other hosts than the server: {remote}"
    # Chrome's advice on canvas readbacks (this test's own pixel reads cause it) cites a spec URL: not a request
    cdn = [m.text for m in console if not m.text.startswith("Canvas2D:")
           and re.search(r"cdn|https?://(?!127\.0\.0\.1)", f"{m.text} {m.location.get('url')}")]
    cdn += [str(e) for e in errors if re.search(r"cdn|https?://", str(e))]
    assert not cdn, cdn


def test_no_widget_errors_in_console(page):
    pg, console, errors, _ = page
    ours = [f"{m.type}: {m.text} @ {m.location.get('url', '')}" for m in console
            if m.type == "error" and OURS.search(f"{m.text} {m.location.get('url', '')}")]
    ours += [f"pageerror: {e} {e.stack or ''}" for e in errors if OURS.search(f"{e} {e.stack or ''}")]
    assert not ours, "JS errors from the widgets:\n" + "\n".join(ours)
    assert pg.get_by_text("Error displaying widget").count() == 0
    # one element per view, each drawn by its ESM: each PrefillView's own three (prompt, KV cache, mask), a KV
    # view, a decode step's mask, and the attention, expert, generation and tier views
    assert pg.locator(".ds4-view").count() == 12


# Elements of an output that stick out of an element between them and the output (the output included) which clips
# what overflows it sideways or scrolls it: what a reader does not see (lumino's widgets hide their overflow, an
# ipywidgets box scrolls it with a scrollbar at its bottom, often a screen below). ``scrollers``: a selector of the
# boxes meant to scroll sideways, whose contents count as shown.
CLIPPED_JS = """(out, scrollers) => {
    const cut = [];
    for (const el of out.querySelectorAll('*')) {
        const r = el.getBoundingClientRect();
        if (!r.width || !r.height) continue;
        for (let a = el.parentElement; a && a !== out.parentElement; a = a.parentElement) {
            if (getComputedStyle(a).overflowX === 'visible') continue;
            const ar = a.getBoundingClientRect();
            if (r.right <= ar.right + 1 && r.left >= ar.left - 1) continue;
            if (!(scrollers && a.matches(scrollers)))
                cut.push(`${el.tagName}.${el.className.baseVal ?? el.className} (${r.left | 0}–${r.right | 0}) in ` +
                         `${a.tagName}.${a.className} (${ar.left | 0}–${ar.right | 0})`);
            break;
        }
    }
    return cut;
}"""


def _cut_off(out, scrollers: str = "") -> list[str]:
    return out.evaluate(CLIPPED_JS, scrollers)


def _side_panel(pg, open_: bool) -> bool:
    """Open (or close) JupyterLab's file browser; whether it was open."""
    panel = pg.locator(".jp-FileBrowser")
    was = panel.is_visible()
    if was != open_:
        pg.locator(".lm-TabBar-tab[data-id='filebrowser']").first.click()
        pg.wait_for_function(f"() => {'!' if not open_ else ''}document.querySelector('.jp-FileBrowser')"
                             "?.checkVisibility()", timeout=5_000)
    return was


def _tip_beside_pointer(pg, canvas, tip, at) -> None:
    """Hover ``canvas`` at ``at`` (fractions of its box): the tooltip shows :func:`_tip_near` the pointer, inside the
    figure's stage (so nothing of it is cut off)."""
    _hover_fills(pg, canvas, tip, position=at, until="el.checkVisibility() && el.textContent.includes('→')")
    c = canvas.bounding_box()
    _tip_near(pg, tip, c["x"] + at[0] * c["width"], c["y"] + at[1] * c["height"],
              canvas.locator("xpath=..").bounding_box())


def test_views_fit_a_laptop_screen(page):
    """At 1280 × 800 with the file browser open (an output about 850 px wide) nothing of a view is cut off: the
    attention figure with its mass bars fits the output (drawn smaller), the PrefillView shows the mask and the KV
    cache's ring together under its slider (the chunk table beside the prompt), the controls wrap; narrower
    still, the attention figure scrolls sideways."""
    pg, *_ = page
    size = pg.viewport_size
    att = _output_of(pg.locator(".ds4-view:has(.ds4-att-stage)").first)
    prefill = _output_of(pg.locator(".ds4-view.ds4-prefill").first)
    tiers = _output_of(_view(pg, "Tiers:"))
    kv = next(v for v in pg.locator(".ds4-kv").all() if v.locator(".ds4-layer").count() > 1)  # all six layers
    canvas, heads = att.locator(".ds4-att-stage canvas"), att.locator(".ds4-att-heads")
    notebook = pg.locator(".jp-NotebookPanel-notebook").first
    # a teacher's 1400 × 900, the file browser closed: the heads' small multiples beside the figure, the whole view
    # (its colour bar and key too) in one screen (with the heads above the figure it was 843 px tall)
    pg.set_viewport_size({"width": 1400, "height": 900})
    was = _side_panel(pg, False)
    try:
        pg.wait_for_function("([c, h]) => h.getBoundingClientRect().left >= c.getBoundingClientRect().right",
                             arg=[canvas.element_handle(), heads.element_handle()], timeout=5_000)
        att.scroll_into_view_if_needed()
        view, area = att.bounding_box(), notebook.bounding_box()
        assert view["height"] <= area["height"], (view, area)
        pg.screenshot(path=str(ARTIFACTS / "screen_1400_attention.png"))
        assert canvas.bounding_box()["width"] == FIG_W  # room for the heads beside the figure at its full size
        # the file browser open (an output about 970 px wide): the figure shrinks, to MIN_SCALE at most, to keep
        # the heads beside it in one column no taller than it (scrolled where more heads are captured): the whole
        # view in one screen (with the heads wrapped under the figure, it was 866 px tall in a 779 px area)
        _side_panel(pg, True)
        pg.wait_for_function("([c, h]) => c.getBoundingClientRect().width < 946 && "
                             "h.getBoundingClientRect().left >= c.getBoundingClientRect().right",
                             arg=[canvas.element_handle(), heads.element_handle()], timeout=5_000)
        att.scroll_into_view_if_needed()
        c, h, view, area = canvas.bounding_box(), heads.bounding_box(), att.bounding_box(), notebook.bounding_box()
        assert 0.8 * FIG_W - 1 <= c["width"] < FIG_W and h["x"] + h["width"] <= view["x"] + view["width"] + 1
        assert view["height"] <= area["height"], (view, area)
        thumbs = [b.bounding_box() for b in heads.locator(".ds4-att-head").all()]
        assert len({round(b["x"]) for b in thumbs}) == 1 and len(thumbs) == 4, thumbs  # one column
        assert h["y"] + h["height"] <= c["y"] + c["height"] + 1, (h, c)
        assert heads.evaluate("(h) => parseFloat(h.style.maxHeight)") == pytest.approx(c["height"], abs=1)
        assert heads.locator(".ds4-att-strip").evaluate("(s) => getComputedStyle(s).overflowY") == "auto"
        pg.screenshot(path=str(ARTIFACTS / "screen_1400_files_attention.png"))
        _side_panel(pg, False)
        # the KV ring at 30% of the 900 lines (240 at 800, 330 at most)
        assert kv.locator(".ds4-ring").bounding_box()["width"] == pytest.approx(270, abs=1)
        pg.set_viewport_size({"width": 1280, "height": 800})
        _side_panel(pg, True)
        # no room beside it: the heads under the figure, which with its key and the controls still fits one screen
        pg.wait_for_function("([c, h]) => h.getBoundingClientRect().top >= c.getBoundingClientRect().bottom",
                             arg=[canvas.element_handle(), heads.element_handle()], timeout=5_000)
        att.scroll_into_view_if_needed()
        c, a = canvas.bounding_box(), att.bounding_box()
        assert c["y"] + c["height"] - a["y"] <= notebook.bounding_box()["height"], (a, c, notebook.bounding_box())
        # in one row, scrolled sideways where more are captured than fit
        assert len({round(b.bounding_box()["y"]) for b in heads.locator(".ds4-att-head").all()}) == 1
        # the note (cells, pooling, how to zoom) right under the figure, before the heads
        n = att.locator(".ds4-note").last.bounding_box()
        assert c["y"] + c["height"] <= n["y"] < heads.bounding_box()["y"], (c, n)
        # the figure redraws at the output's width: its right edge (the mass bars) inside the output
        pg.wait_for_function("([c, o]) => c.getBoundingClientRect().right <= o.getBoundingClientRect().right + 1",
                             arg=[canvas.element_handle(), att.element_handle()], timeout=5_000)
        assert att.bounding_box()["width"] < 900  # the file browser took its share
        for name, out in (("attention", att), ("prefill", prefill), ("tiers", tiers), ("kvcache", _output_of(kv))):
            out.scroll_into_view_if_needed()
            assert not _cut_off(out), f"{name} view cut off at 1280 px: {_cut_off(out)[:5]}"
            pg.screenshot(path=str(ARTIFACTS / f"laptop_{name}.png"))
        prefill.screenshot(path=str(ARTIFACTS / "laptop_prefill_whole.png"))  # all of it, as one scrolls through
        ring, mask = prefill.locator(".ds4-ring").bounding_box(), _mask_of(prefill).bounding_box()
        slider = prefill.locator(".widget-hslider").first.bounding_box()
        # both in one screen under the slider that scrubs them (the ring ended 950 px down, the mask over it)
        for box in (ring, mask):
            assert box["y"] + box["height"] - (slider["y"] + slider["height"]) < 620, (slider, ring, mask)
        table, prompt = (prefill.locator(s).first.bounding_box() for s in (".ds4-chunks table", ".ds4-prompt"))
        assert table["x"] >= prompt["x"] + prompt["width"] and table["y"] < prompt["y"] + prompt["height"]
        # the KV cache's six layers in two columns, their colours keyed once: the ring and every layer in one
        # screen of JupyterLab at 800 px (the view was 906 px tall, the ring's top to layer 5's end 800)
        blocks = [b.bounding_box() for b in kv.locator(".ds4-layer").all()]
        assert len(blocks) == 6 and len({round(b["y"]) for b in blocks}) == 3, blocks
        ring = kv.locator(".ds4-ring").bounding_box()
        assert max(b["y"] + b["height"] for b in blocks) - ring["y"] < 660
        assert ring["width"] == pytest.approx(240, abs=1)  # 30% of 800 lines
        for at in ((0.3, 0.8), (0.85, 0.1)):  # the lowest rows, the upper right: the tooltip where the reader looks
            _tip_beside_pointer(pg, canvas, att.locator(".ds4-hovertip"), at)
        pg.screenshot(path=str(ARTIFACTS / "laptop_attention_tooltip.png"))
        # the attention figure keeps legible text (at least MIN_SCALE of its size) and so, narrower, scrolls
        pg.set_viewport_size({"width": 1000, "height": 800})
        stage = att.locator(".ds4-att-stage")
        pg.wait_for_function("(v) => v.scrollWidth > v.clientWidth", arg=stage.element_handle(), timeout=5_000)
        assert canvas.bounding_box()["width"] >= 0.8 * 946 - 1  # MIN_SCALE of attention_figure.FIG_W
        for name, out in (("attention", att), ("prefill", prefill), ("tiers", tiers)):
            cut = _cut_off(out, ".ds4-att-stage")  # the attention figure, at its smallest, scrolls in its view
            assert not cut, f"{name} view cut off at 1000 px: {cut[:5]}"
        stage.evaluate("(v) => { v.scrollLeft = v.scrollWidth; }")
        assert canvas.evaluate("(c) => c.getBoundingClientRect().right <= "
                               "c.parentElement.getBoundingClientRect().right + 1")  # the mass bars, scrolled to
        att.scroll_into_view_if_needed()
        pg.screenshot(path=str(ARTIFACTS / "narrow_attention_scrolled.png"))
    finally:
        _side_panel(pg, was)
        pg.set_viewport_size(size)
