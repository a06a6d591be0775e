"""``python -m pytest`` (testpaths: tests, notebooks) runs every notebook here with nbval.

Each code cell is a test item (``notebooks/NAME.ipynb::Cell N``), run in order in one kernel of this
interpreter. As with ``--nbval-lax``, a cell passes when it runs without an error, and only the cells
tagged ``nbval-check-output`` (or marked ``# NBVAL_CHECK_OUTPUT``) must also reproduce their saved
outputs, after the substitutions of ``nbval_sanitize.cfg`` (timings, addresses, temporary paths,
float64 round-off). Of a checked cell's outputs only text is compared: widget models, HTML, Vega and
images are not. Every live widget a cell displays must carry a static ``text/html`` fallback.

Options given on the command line win (``--nbval`` compares every cell). Without nbval installed the
notebooks are not collected; tests/test_notebooks.py still checks their saved form.
"""

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
    result = yield
    if IPyNbCell is not None and isinstance(item, IPyNbCell):
        bundles = [o["data"] for o in getattr(item, "test_outputs", None) or [] if "data" in o]
        missing = [b.get("text/plain", "?") for b in bundles if WIDGET in b and "text/html" not in b]
        assert not missing, f"widget output without a static text/html fallback: {missing}"
    return result
