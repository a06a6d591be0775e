"""What every notebook view shares: :class:`View` (a live widget plus its static HTML fallback, and
``View.guarded``, which shows a callback's error inside the widget), :class:`FollowingView` (a view that refreshes
after every step of its session when asked, ``follow=True``), :func:`token_texts`, and the
front-end: :func:`widgets_dir` finds the views' ESM and CSS (``widgets/`` at the repository root, the package
``ds4lab.widgets`` once installed), :func:`widget_file` hands one of its files to an anywidget model,
:func:`widget_module` a view's file after the scripts it shares with others, and :class:`ViewModel`, the base of
every view's model, carries the one stylesheet they share."""

from __future__ import annotations

import html
import importlib.resources
from importlib.resources.abc import Traversable
from pathlib import Path

import anywidget
import ipywidgets as W

WIDGETS_PACKAGE = "ds4lab.widgets"  # what the wheel installs widgets/ as (pyproject.toml, [tool.setuptools])
STYLESHEET = "views.css"  # the style of every view


def widgets_dir() -> Traversable:
    """The folder of the views' front-end sources. In a source checkout (the repository root on ``sys.path``, or
    an editable install of it) it is ``widgets/`` beside the ``ds4lab`` package imported, so that a checkout
    never shows another checkout's front-end; elsewhere (a wheel) it is the installed package ``ds4lab.widgets``,
    found by :mod:`importlib.resources`."""
    root = Path(__file__).resolve().parents[2]  # ds4lab/viz/base.py -> the folder holding the ds4lab package
    if (root / "pyproject.toml").is_file() and (root / "widgets" / "__init__.py").is_file():
        return root / "widgets"
    return importlib.resources.files(WIDGETS_PACKAGE)


def widget_file(name: str) -> Path | str:
    """The front-end file ``name`` of :func:`widgets_dir`, as an anywidget model's ``_esm`` or ``_css`` takes it:
    its path when it is a file on disk (anywidget reads it, and with ``ANYWIDGET_HMR=1`` reloads it when it
    changes), else its text."""
    res = widgets_dir() / name
    if isinstance(res, Path):
        if not res.is_file():
            raise FileNotFoundError(f"no front-end file {name!r} in {res.parent}")
        return res
    return res.read_text(encoding="utf-8")


def widget_module(name: str, *shared: str) -> str:
    """A view's ESM: the front-end scripts ``shared`` (functions several views call, such as ``hovertip.js``), then
    the view's own file ``name``, as one text. The cost: ``ANYWIDGET_HMR`` reloads a lone file's path on a change,
    not this text (rerun the cell instead)."""
    return "".join(_widget_text(n) for n in (*shared, name))


def _widget_text(name: str) -> str:
    res = widget_file(name)
    return res.read_text(encoding="utf-8") if isinstance(res, Path) else res


class ViewModel(anywidget.AnyWidget):
    """The base of every view's anywidget model: the shared stylesheet. A view's model names its ESM
    (``_esm = widget_file("prefill.js")``, or ``widget_module("tiers.js", "hovertip.js")``) and its synced traits."""

    _css = widget_file(STYLESHEET)


def check_session(session, view: str) -> None:
    """A view of a session refuses anything else by name (a model given for its session failed on an attribute)."""
    from ..session import Session

    if not isinstance(session, Session):
        raise TypeError(f"{view} takes a session (model.session(...)), not {type(session).__name__}")


def token_texts(tokenizer, ids) -> list[str]:
    return [tokenizer.token_bytes(int(i)).decode("utf-8", "replace") for i in ids]


class View:
    """A composite view: ``widget`` (what Jupyter renders live) plus a static HTML fallback. A view shows the
    state at the moment its cell ran; its fallback (what a saved notebook shows) is that same state."""

    widget: W.Widget
    _error_line: W.HTML | None = None  # added to the widget by the first callback that fails

    def static_html(self) -> str:
        raise NotImplementedError

    def guarded(self, fn):
        """``fn`` as a button or slider callback: an exception it raises is shown as an error line inside the
        widget (JupyterLab sends a callback's traceback only to its log console), and cleared by the next call
        that succeeds."""

        def call(*args):
            line = self._error_line
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 -- any error of a click must reach the reader
                if line is None:
                    line = self._error_line = W.HTML()
                    self.widget.children = (*self.widget.children, line)
                line.value = f"<div class='ds4-error'>{type(e).__name__}: {html.escape(str(e))}</div>"
                return
            if line is not None:
                line.value = ""

        return call

    def _repr_mimebundle_(self, **kwargs):
        # A displayed widget lives until it is closed; so does its view (the controls' callbacks, the fallback), even
        # where nothing else holds it: a cell's last expression that the kernel does not keep in Out (nbval's runs).
        self.widget.ds4lab_view = self
        bundle = self.widget._repr_mimebundle_(**kwargs)
        data = dict(bundle[0] if isinstance(bundle, tuple) else bundle)
        data["text/html"] = self.static_html()
        data["text/plain"] = repr(self)
        return data


class FollowingView(View):
    """A view of ``self.session`` that refreshes itself after every step of it (``session.step_observers``)
    only when built with ``follow=True``: by default it keeps showing the state of the cell that made it, so that
    later cells moving the session do not change what earlier text describes."""

    def _follow(self, follow: bool) -> None:
        self.follow = follow
        if follow:
            self.session.step_observers.append(self._on_step)

    def _on_step(self, record) -> None:
        self.refresh()

    def detach(self) -> None:
        """Stop refreshing after the session's steps."""
        self.session.step_observers[:] = [f for f in self.session.step_observers if f != self._on_step]
        self.follow = False
