"""The views in a real browser: JupyterLab (started here, on a free port with a token, rooted in a temp dir
holding a copy of the notebook) runs the notebook that shows both KVCacheView and AttentionView through
its own UI (Run > Run All Cells) in headless Chromium, driven by Playwright; then the DOM our ESM built
is checked, the attention canvas is read back for painted pixels, and the console is checked for errors
from the widgets. Screenshots of each view go to ``$DS4LAB_ARTIFACTS`` (default ``test-artifacts/``).

Needs Debian's ``chromium`` (``/usr/bin/chromium``, or ``$DS4LAB_CHROMIUM``) and the ``browser`` extra
(jupyterlab, playwright); Playwright's own browser downloads are not used. Skips, saying what is missing,
when it cannot run. Deselect with ``-m "not browser"``.
"""

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("DS4LAB_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("DS4LAB_ARTIFACTS") or ROOT / "test-artifacts")
SERVER_START_S = 60  # JupyterLab answering /api/status
RUN_ALL_S = 150  # every cell of the notebook run (about 15 s of kernel time here)
# console errors that come from the widgets: our ESM is imported from a blob: URL by anywidget
OURS = re.compile(r"blob:|anywidget|ds4|jupyter-widgets|Error displaying widget", re.I)


def _code_sources(path: Path) -> str:
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    return "\n".join("".join(c.get("source", "")) for c in nb.get("cells", []) if c.get("cell_type") == "code")


def pick_notebook() -> Path | None:
    """The notebook to open: one named *quickstart* that shows both views, else the first that does."""
    both = [p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
            if all(name in _code_sources(p) for name in ("KVCacheView", "AttentionView"))]
    quick = [p for p in both if "quickstart" in p.name.lower()]
    return (quick or both or [None])[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_copy(src: Path, dst: Path) -> int:
    """The notebook without saved outputs or widget state, so that every view on the page is from this run;
    its number of code cells."""
    nb = json.loads(src.read_text(encoding="utf-8"))
    for c in nb["cells"]:
        if c.get("cell_type") == "code":
            c["outputs"], c["execution_count"] = [], None
    nb.setdefault("metadata", {}).pop("widgets", None)
    nb["metadata"]["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    dst.write_text(json.dumps(nb, indent=1), encoding="utf-8")
    return sum(c.get("cell_type") == "code" for c in nb["cells"])


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


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server rooted in a temp dir with a clean copy of the notebook: (base url, token, notebook
    name, its number of code cells)."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium binary at {CHROMIUM} (apt-get install chromium, or set DS4LAB_CHROMIUM)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[browser]')")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (pip install -e '.[browser]')")
    pytest.importorskip("anywidget", reason="anywidget is not installed")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed")
    src = pick_notebook()
    if src is None:
        pytest.skip("no notebook under notebooks/ shows both KVCacheView and AttentionView")

    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"
    root.mkdir()
    n_code = _clean_copy(src, root / src.name)
    _settings(tmp / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               IPYTHONDIR=str(tmp / "ipython"), JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1")
    log = open(tmp / "server.log", "w")
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
                            + (tmp / "server.log").read_text()[-1500:])
            try:
                _get(f"{base}/api/status", token)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.skip(f"JupyterLab did not answer on {base} within {SERVER_START_S} s: "
                                + (tmp / "server.log").read_text()[-1500:])
                time.sleep(0.3)
        yield base, token, src.name, n_code
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


@pytest.fixture(scope="module")
def page(lab):
    """The notebook opened in headless Chromium and run through Run > Run All Cells; the page, its console
    errors and page errors."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    base, token, name, n_code = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    console, errors = [], []
    with sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        except PlaywrightError as e:
            pytest.skip(f"Chromium at {CHROMIUM} did not start under Playwright: {str(e)[:500]}")
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 2000})
            pg.on("console", lambda m: console.append(m))
            pg.on("pageerror", lambda e: errors.append(e))
            pg.goto(f"{base}/lab/tree/{name}?token={token}", wait_until="domcontentloaded", timeout=60_000)
            pg.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=60_000)
            # the kernel started by opening the notebook
            deadline = time.monotonic() + 60
            while not [k for k in _get(f"{base}/api/kernels", token) if k["execution_state"] == "idle"]:
                assert time.monotonic() < deadline, "the notebook's kernel did not start"
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
                busy = any(k["execution_state"] != "idle" for k in _get(f"{base}/api/kernels", token))
                stopped = "[*]:" not in prompts and not busy
                idle_since = (idle_since or time.monotonic()) if stopped else None
                if (idle_since and time.monotonic() - idle_since > 5) or time.monotonic() > deadline:
                    pg.screenshot(path=str(ARTIFACTS / "notebook-failed.png"), full_page=True)
                    stderr = pg.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
                    text = "\n".join(stderr.all_inner_texts())[-3000:]
                    pytest.fail(f"Run All did not run every cell: prompts {prompts}\n{text}")
                time.sleep(0.5)
            # the views draw once their models arrive; wait for both kinds
            pg.wait_for_selector(".ds4-view .ds4-layer", timeout=20_000)
            pg.wait_for_selector(".ds4-view canvas", timeout=20_000)
            pg.wait_for_timeout(500)
            pg.screenshot(path=str(ARTIFACTS / "notebook.png"))
            yield pg, console, errors
        finally:
            (ARTIFACTS / "browser-console.log").write_text(
                "\n".join(f"{m.type}: {m.text} @ {m.location.get('url', '')}" for m in console)
                + "\n" + "\n".join(f"pageerror: {e}" for e in errors) + "\n"
            )
            browser.close()


def _output_of(view):
    """The whole cell output holding a view: the ipywidgets controls and our ESM's element."""
    return view.locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea-output')][1]")


def test_kvcache_view_renders(page):
    pg, _, _ = page
    views = pg.locator(".ds4-view:has(.ds4-layer)")
    assert views.count() >= 1
    view = views.last
    assert re.match(r"KV cache: [1-9]\d* tokens, [\d,]+ bytes", view.locator(".ds4-title").inner_text())
    n_layers = view.locator(".ds4-layer").count()
    assert n_layers >= 2
    assert view.locator(".ds4-strip").count() >= n_layers  # every layer's raw ring
    for kind in ("live", "comp", "index"):
        assert view.locator(f".ds4-layer .ds4-cell.{kind}").count() > 0, f"no .ds4-cell.{kind} cells"
    cell = view.locator(".ds4-layer .ds4-cell.live").first
    box = cell.bounding_box()
    assert box and box["width"] > 0 and box["height"] > 0  # the CSS reached the page
    assert re.fullmatch(r"slot \d+: position \d+", cell.get_attribute("title"))
    out = _output_of(view)
    assert out.locator(".widget-hslider").count() == 1  # the checkpoint slider from ipywidgets
    out.screenshot(path=str(ARTIFACTS / "kvcache_view.png"))


def test_attention_view_renders(page):
    pg, _, _ = page
    views = pg.locator(".ds4-view:has(canvas)")
    assert views.count() >= 1
    view = views.first
    assert "layer" in view.locator(".ds4-title").inner_text()
    assert re.match(r"\d+×\d+ cells", view.locator(".ds4-note").inner_text())
    canvas = view.locator("canvas")
    stats = canvas.evaluate(
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
    assert stats["w"] > 1 and stats["h"] > 1 and stats["cssW"] > 0, stats
    assert stats["painted"] > 0.01 * stats["w"] * stats["h"], f"attention canvas looks blank: {stats}"
    assert stats["colours"] >= 8, f"attention canvas has too few colours for a heatmap: {stats}"
    # hovering a cell fills the tooltip line: "query … → key …: weight"
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    canvas.hover(position={"x": box["width"] * 0.5, "y": box["height"] * 0.5})
    pg.wait_for_function("(el) => el.textContent.includes('→')", arg=view.locator(".ds4-tip").element_handle(),
                         timeout=5_000)
    out = _output_of(view)
    assert out.locator(".widget-dropdown").count() == 2  # layer and head pickers
    out.screenshot(path=str(ARTIFACTS / "attention_view.png"))


def test_no_widget_errors_in_console(page):
    pg, console, errors = page
    ours = [f"{m.type}: {m.text} @ {m.location.get('url', '')}" for m in console
            if m.type == "error" and OURS.search(f"{m.text} {m.location.get('url', '')}")]
    ours += [f"pageerror: {e} {e.stack or ''}" for e in errors if OURS.search(f"{e} {e.stack or ''}")]
    assert not ours, "JS errors from the widgets:\n" + "\n".join(ours)
    assert pg.get_by_text("Error displaying widget").count() == 0
    assert pg.locator(".ds4-view").count() >= 2
