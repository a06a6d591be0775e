"""Vega-Lite charts as plain specs, and how a chart is shown without a network.

ds4lab's chart builders (:mod:`ds4lab.viz.charts`) write Vega-Lite specs (dicts) and wrap them in
:class:`Chart`, which a notebook displays as a Vega-Lite mimebundle: JupyterLab (and Notebook 7, VS Code) draws
it with the Vega it ships, plus a PNG made by vl-convert (when ``vl-convert-python`` is installed) that a saved
notebook, nbviewer and GitHub show. No bundle holds a script or a URL to load one. They do not go through Altair
because importing Altair costs 1.5-4 s in a Jupyter environment (jsonschema builds its optional IRI parsers at
import), more than the rest of a teaching notebook's imports; ``chart.to_altair()`` gives the Altair chart to
restyle, compose with one's own or save.

Altair's default renderer writes HTML that loads Vega from a CDN, which fails in an offline JupyterLab ("Error
loading script"): for one's own Altair charts, :func:`offline_charts` switches this kernel to the same bundle.
"""

from __future__ import annotations

import base64
import copy

import numpy as np

# JupyterLab 4's built-in renderer (@jupyterlab/vega5-extension, bundled Vega 5 / Vega-Lite 5) takes Vega-Lite
# v3-v5 mimetypes; Altair 6 writes Vega-Lite 6 specs, whose marks and encodings used here Vega-Lite 5 reads alike.
VEGALITE_MIME = "application/vnd.vegalite.v5+json"
VEGALITE_SCHEMA = "https://vega.github.io/schema/vega-lite/v5.json"  # a schema id, never fetched
RENDERER = "ds4lab"  # the name offline_charts() registers with Altair's renderers

_TYPES = {"Q": "quantitative", "O": "ordinal", "N": "nominal", "T": "temporal"}


def field(shorthand: str, **props) -> dict:
    """An encoding channel from Altair's shorthand, ``"name:Q"`` (Q, O, N or T), with Vega-Lite's properties
    (``title``, ``axis``, ``scale``, ``sort``, ``format``...)."""
    name, _, kind = shorthand.rpartition(":")
    if not name or kind not in _TYPES:
        raise ValueError(f"a field is 'name:Q', 'name:O', 'name:N' or 'name:T', got {shorthand!r}")
    return {"field": name, "type": _TYPES[kind], **props}


def tooltip(*fields: str | dict) -> list[dict]:
    """A tooltip channel: one entry per field, each a shorthand (see :func:`field`) or a channel dict."""
    return [f if isinstance(f, dict) else field(f) for f in fields]


def unit(rows: list[dict] | None, mark: str | dict, **encoding) -> dict:
    """A single-view spec: ``rows`` inline (None: the data of the facet or layered chart it goes in; NumPy scalars
    become Python numbers, as JSON needs), one ``mark``, channels as keyword arguments."""
    spec = {"mark": mark, "encoding": encoding}
    return spec if rows is None else {"data": inline(rows), **spec}


def inline(rows: list[dict]) -> dict:
    """``rows`` as a spec's inline data (NumPy scalars become Python numbers, as JSON needs)."""
    return {"values": [{k: v.item() if isinstance(v, np.generic) else v for k, v in r.items()} for r in rows]}


class Chart:
    """A Vega-Lite spec that draws itself in a notebook (:func:`chart_bundle`). ``a | b`` and ``a & b`` put
    two charts side by side or one above the other, ``.properties(...)`` sets top-level properties (``title``,
    ``width``...), ``.to_dict()`` is the spec to save or send, ``.to_altair()`` the same chart in Altair."""

    def __init__(self, spec: dict):
        self.spec = spec

    def to_dict(self) -> dict:
        return {"$schema": VEGALITE_SCHEMA, **copy.deepcopy(self.spec)}

    def properties(self, **props) -> Chart:
        return Chart({**self.spec, **props})

    def _concat(self, key: str, other: Chart) -> Chart:
        # a | b | c is one row of three, as in Altair: an untitled row of charts is spliced in, not nested
        parts = [c.spec[key] if set(c.spec) == {key} else [c.spec] for c in (self, other)]
        return Chart({key: parts[0] + parts[1]})

    def __or__(self, other: Chart) -> Chart:
        return self._concat("hconcat", other)

    def __and__(self, other: Chart) -> Chart:
        return self._concat("vconcat", other)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return chart_bundle(self)

    def __repr__(self) -> str:
        return chart_bundle(self, png=False)["text/plain"]

    def to_altair(self):
        """The chart as an Altair chart (validated against Altair's Vega-Lite schema; needs altair)."""
        import altair as alt

        spec = self.to_dict()
        for key, kind in (("layer", alt.LayerChart), ("hconcat", alt.HConcatChart), ("vconcat", alt.VConcatChart),
                          ("facet", alt.FacetChart)):
            if key in spec:
                return kind.from_dict(spec)
        return alt.Chart.from_dict(spec)


def _png(spec: dict) -> bytes | None:
    """The chart as a PNG drawn by vl-convert (offline, in-process), or None without vl-convert."""
    try:
        import vl_convert as vlc
    except ImportError:
        return None
    major = str(spec.get("$schema", "")).rsplit("/v", 1)[-1].removesuffix(".json").split(".")[0]
    # the newest Vega-Lite of the spec's major version that vl-convert has ("5" -> "5.21"), else its default
    same = [v for v in vlc.get_vegalite_versions() if v.split(".")[0] == major]
    kw = {"vl_version": max(same, key=lambda v: tuple(map(int, v.split("."))))} if same else {}
    try:
        return vlc.vegalite_to_png(spec, scale=1, **kw)
    except Exception:  # a spec vl-convert cannot draw still has its live rendering
        return None


def chart_bundle(chart, png: bool | None = None) -> dict:
    """The mimebundle a :class:`Chart` (or an Altair chart, or a spec dict) is displayed as: the Vega-Lite spec
    under ``application/vnd.vegalite.v5+json``, a PNG (``image/png``, base64) when ``png`` is true or, with
    ``png=None``, when vl-convert is installed, and ``text/plain``. No ``text/html``: JupyterLab would prefer it
    to the Vega-Lite renderer."""
    spec = chart if isinstance(chart, dict) else chart.to_dict()
    live = dict(spec, **{"$schema": VEGALITE_SCHEMA})
    title = spec.get("title")
    title = title.get("text") if isinstance(title, dict) else title
    bundle = {VEGALITE_MIME: live, "text/plain": f"<Vega-Lite chart{': ' + repr(title) if title else ''}>"}
    if png is not False:
        image = _png(spec)
        if image is None and png:
            raise RuntimeError("a PNG of the chart needs vl-convert-python (pip install vl-convert-python)")
        if image is not None:
            bundle["image/png"] = base64.b64encode(image).decode("ascii")
    return bundle


def _render(spec: dict, png: bool | None = None, **_options) -> dict:
    return chart_bundle(spec, png=png)


def offline_charts(png: bool | None = None):
    """Show one's own Altair charts in this kernel without a network: registers the ``ds4lab`` renderer (see
    :func:`chart_bundle`) and enables it. ds4lab's own charts need nothing (they are :class:`Chart`). Returns
    Altair's enabler, so ``with offline_charts(): ...`` enables it for a block only; ``alt.renderers.enable(
    "default")`` goes back to Altair's HTML."""
    import altair as alt

    if RENDERER not in alt.renderers.names():
        alt.renderers.register(RENDERER, _render)
    return alt.renderers.enable(RENDERER, png=png)
