"""``python -m pytest`` (testpaths: tests, notebooks) runs every notebook here with nbval.

Each code cell is a test item (``notebooks/NAME.ipynb::Cell N``), run in order in one kernel of this
interpreter. As with ``--nbval-lax``, a cell passes when it runs without an error, and only the cells
tagged ``nbval-check-output`` (or marked ``# NBVAL_CHECK_OUTPUT``) must also reproduce their saved
outputs, after the substitutions of ``nbval_sanitize.cfg`` (timings, addresses, temporary paths,
float64 round-off). Of a checked cell's outputs only text is compared: widget models, HTML, Vega and
images are not. Every live widget a cell displays must carry a static ``text/html`` fallback.

Saved fallbacks tell the truth: a notebook saved with its outputs (what GitHub and nbviewer show) shows each view's
static fallback where the live view would be, so it must show the state the notebook leaves the view in, not the
state when first displayed (a later cell stepping a prefill would make it lie). After a notebook's last cell, a
snippet run in the same kernel renders every live view's fallback as it is then (:data:`FINAL_FALLBACKS`);
:func:`check_fallbacks` holds the fallbacks this run displayed, and the committed ones, to it. A failure fails
the notebook's last cell.

Options given on the command line win (``--nbval`` compares every cell). Without nbval installed the
notebooks are not collected; tests/test_notebooks.py still checks their saved form.
"""

import json
import re
from pathlib import Path

import pytest

try:
    from nbval.plugin import IPyNbCell
except ImportError:  # nbval is in the test extra
    IPyNbCell = None

HERE = Path(__file__).resolve().parent
NOT_COMPARED = (
    "text/html",
    "image/svg+xml",
    "application/javascript",
    "application/vnd.vegalite.v4+json",
    "application/vnd.vegalite.v5+json",
    "application/vnd.vega.v5+json",
)
WIDGET = "application/vnd.jupyter.widget-view+json"


def pytest_configure(config):
    if IPyNbCell is None:
        return
    opt = config.option
    if not (opt.nbval or opt.nbval_lax):
        opt.nbval_lax = True
    if not opt.nbval_kernel_name:
        opt.nbval_current_env = True
    if opt.nbval_sanitize_with is None:
        opt.nbval_sanitize_with = str(HERE / "nbval_sanitize.cfg")
    if opt.nbval_cell_timeout == 2000:  # nbval's default; no cell here takes more than a few seconds
        opt.nbval_cell_timeout = 120


def pytest_collection_modifyitems(items):
    for item in items:
        if IPyNbCell is not None and isinstance(item, IPyNbCell):
            item.parent.skip_compare = tuple(dict.fromkeys(item.parent.skip_compare + NOT_COMPARED))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if IPyNbCell is None or not isinstance(item, IPyNbCell):
        return (yield)
    notebook = item.parent
    run = notebook.__dict__.setdefault("ds4_run", dict(shown=[], failed=False))
    try:
        result = yield
    except BaseException:  # a failed (or skipped) cell: its views and the notebook's end are not judged
        run["failed"] = True
        raise
    finally:  # the widget outputs the cell displayed, failed or not, in order
        bundles = [o["data"] for o in getattr(item, "test_outputs", None) or [] if "data" in o]
        run["shown"].extend((b[WIDGET]["model_id"], b.get("text/html", "")) for b in bundles if WIDGET in b)
    missing = [b.get("text/plain", "?") for b in bundles if WIDGET in b and "text/html" not in b]
    if missing:
        run["failed"] = True
        raise AssertionError(f"widget output without a static text/html fallback: {missing}")
    last = item.cell_num == sum(c.cell_type == "code" for c in notebook.nb.cells) - 1
    saved = saved_fallbacks(notebook.nb)
    if last and not run["failed"] and (run["shown"] or saved):
        final = json.loads(run_in_kernel(notebook.kernel, FINAL_FALLBACKS))
        check_fallbacks(Path(str(notebook.fspath)).name, saved, run["shown"], final)
    return result


# Run after a notebook's last cell, in its kernel: every live view's fallback as it is now, by the id of the widget
# a cell displayed (a View's composite widget, or the view's own model).
FINAL_FALLBACKS = """
import gc, json
from ds4lab.viz.base import View, ViewModel
print(json.dumps({getattr(v, "widget", v).model_id: v.static_html() for v in gc.get_objects()
                  if isinstance(v, (View, ViewModel)) and callable(getattr(v, "static_html", None))}))
"""


def run_in_kernel(kernel, code: str, timeout: float = 60) -> str:
    """What ``code`` prints when run in nbval's ``kernel`` (a ``RunningKernel``); an error in it fails."""
    msg_id = kernel.execute_cell_input(code, allow_stdin=False)
    out = []
    while True:
        msg = kernel.get_message("iopub", timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif kind == "error":
            raise AssertionError("the fallbacks' snippet failed:\n" + "\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


def saved_fallbacks(nb) -> list[tuple[str, str]]:
    """(widget model id, static text/html fallback) of every widget output saved in ``nb``, in order."""
    return [(o["data"][WIDGET]["model_id"], o["data"]["text/html"]) for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if WIDGET in o.get("data", {})]


def sanitize(text: str) -> str:
    """``text`` after nbval_sanitize.cfg's substitutions (timings, addresses, temporary paths, round-off)."""
    lines = (HERE / "nbval_sanitize.cfg").read_text(encoding="utf-8").splitlines()
    for a, b in zip(lines, lines[1:]):
        if a.startswith("regex: "):
            text = re.sub(a[len("regex: "):], b[len("replace: "):], text)
    return text


def _title(html: str) -> str:
    """A fallback's first text, its title (the view's state in a line: tokens, chunks, bytes)."""
    return next((t.strip() for t in re.split(r"<[^>]*>", html) if t.strip()), "")


def _masked(html: str) -> str:
    """A fallback with every number masked: the timings in its tables differ from run to run, its structure not."""
    return re.sub(r"\d[\d,.]*", "#", sanitize(html))


def check_fallbacks(name: str, saved: list, shown: list, final: dict) -> None:
    """Each fallback this run displayed (``shown``: (model id, html)) is its view's ``final`` one exactly, and the
    committed notebook's fallbacks (``saved``) agree with them: same title after nbval's substitutions, same text
    with every number masked."""
    lost = [_title(html) for model_id, html in shown if model_id not in final]
    assert not lost, f"{name}: no live ds4lab view is left of the displayed {lost}"
    for model_id, html in shown:
        assert html == final[model_id], (f"{name}: a view's fallback shows {_title(html)!r} but the notebook "
                                         f"leaves it at {_title(final[model_id])!r}")
    assert len(saved) == len(shown), f"{name}: {len(saved)} views saved, {len(shown)} displayed (rebuild it)"
    for (_, html), (model_id, _) in zip(saved, shown):
        assert sanitize(_title(html)) == sanitize(_title(final[model_id])), \
            f"{name}: the saved fallback shows {_title(html)!r}, its cell's view ends at {_title(final[model_id])!r}"
        assert _masked(html) == _masked(final[model_id]), \
            f"{name}: the saved fallback of {_title(html)!r} differs from its view's final state (rebuild it)"
