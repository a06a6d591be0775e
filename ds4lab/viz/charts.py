"""Altair charts of a prefill and of the router (data reduced first, far under Altair's 5000-row limit), and
how they are shown without a network.

Altair's default renderer writes HTML that loads Vega from a CDN, which fails in an offline JupyterLab
("Error loading script"). :func:`offline_charts` switches this kernel to the ``ds4lab`` renderer: a chart is
shown as a Vega-Lite mimebundle, which JupyterLab (and Notebook 7, VS Code) draws with the Vega it ships, plus a
PNG made by vl-convert (when ``vl-convert-python`` is installed) that a saved notebook, nbviewer and GitHub show.
No bundle holds a script or a URL to load one. :func:`chart_bundle` is the same bundle for one chart.
"""

from __future__ import annotations

import base64
import math

import numpy as np

MAX_ROWS = 4000  # rows a chart's data may hold (Altair refuses more than 5000 by default)
RENDERER = "ds4lab"  # the name offline_charts() registers with Altair's renderers
# JupyterLab 4's built-in renderer (@jupyterlab/vega5-extension, bundled Vega 5 / Vega-Lite 5) takes Vega-Lite
# v3-v5 mimetypes; Altair 6 writes Vega-Lite 6 specs, whose marks and encodings used here Vega-Lite 5 reads alike.
VEGALITE_MIME = "application/vnd.vegalite.v5+json"
VEGALITE_SCHEMA = "https://vega.github.io/schema/vega-lite/v5.json"  # a schema id, never fetched


def _alt():
    import altair as alt

    return alt


def _png(spec: dict) -> bytes | None:
    """The chart as a PNG drawn by vl-convert (offline, in-process), or None without vl-convert."""
    try:
        import vl_convert as vlc
    except ImportError:
        return None
    version = str(spec.get("$schema", "")).rsplit("/v", 1)[-1].removesuffix(".json")
    major_minor = ".".join(version.split(".")[:2])
    kw = {"vl_version": major_minor} if major_minor in vlc.get_vegalite_versions() else {}
    try:
        return vlc.vegalite_to_png(spec, scale=1, **kw)
    except Exception:  # a spec vl-convert cannot draw still has its live rendering
        return None


def chart_bundle(chart, png: bool | None = None) -> dict:
    """The mimebundle ``offline_charts()`` displays for ``chart`` (an Altair chart or its ``to_dict()``):
    the Vega-Lite spec under ``application/vnd.vegalite.v5+json``, a PNG (``image/png``, base64) when ``png`` is
    true or, with ``png=None``, when vl-convert is installed, and ``text/plain``. No ``text/html``: JupyterLab
    would prefer it to the Vega-Lite renderer."""
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
    """Show Altair charts in this kernel without a network: registers the ``ds4lab`` renderer (see
    :func:`chart_bundle`) and enables it. Call it once, after importing altair; ds4lab's notebooks do. Returns
    Altair's enabler, so ``with offline_charts(): ...`` enables it for a block only; ``alt.renderers.enable(
    "default")`` goes back to Altair's HTML."""
    alt = _alt()
    if RENDERER not in alt.renderers.names():
        alt.renderers.register(RENDERER, _render)
    return alt.renderers.enable(RENDERER, png=png)


def _own_legend(chart):
    """``chart`` with a colour scale of its own, so that its legend sits beside it when it is concatenated with
    another chart (``a | b``); a shared legend would go to the right of the whole row."""
    return _alt().layer(chart).resolve_scale(color="independent")


def _median(values) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))


def _cost_inputs(model):
    """(config, tensor types) of a loaded model, for :mod:`ds4lab.costs`."""
    from ..costs import file_types

    return model.config, file_types(model.file)


def prefill_chunks_chart(chunks, model=None):
    """Tokens/s of each chunk of a prefill (a list of ``PrefillChunk``), as points. Chunks of one size are repeats
    of the same work, so their median is drawn as a rule and their range as a band: on a shared CPU the spread is
    the machine's noise. With the ``model`` that ran them, a line shows each chunk's speed predicted from its FLOPs
    (:mod:`ds4lab.costs`) at the median FLOP rate of the chunks: where the points leave the line, the machine
    varied, not the work."""
    alt = _alt()
    rows = [dict(chunk=i, start=c.start, end=c.end, tokens=c.n_tokens, tokens_per_s=c.tokens_per_s,
                 ms=c.seconds * 1e3) for i, c in enumerate(chunks)]
    size = max(r["tokens"] for r in rows) if rows else 0
    full = [r["tokens_per_s"] for r in rows if r["tokens"] == size]
    spread = [dict(low=min(full), high=max(full), median=_median(full), label=f"median of {len(full)} chunks of {size}")
              ] if full else []
    x = alt.X("chunk:Q", title="chunk", axis=alt.Axis(tickMinStep=1, format="d"))
    y = alt.Y("tokens_per_s:Q", title="tokens/s (measured)")
    layers = [
        alt.Chart(alt.Data(values=spread)).mark_rect(opacity=0.15, color="#3182bd").encode(y="low:Q", y2="high:Q"),
        alt.Chart(alt.Data(values=spread)).mark_rule(color="#3182bd").encode(y="median:Q", tooltip=["label:N",
                                                                                                     "median:Q"]),
        alt.Chart(alt.Data(values=rows)).mark_point(filled=True, size=40, color="#3182bd").encode(
            x=x, y=y, tooltip=["chunk:O", "start:Q", "end:Q", "tokens:Q", "ms:Q", "tokens_per_s:Q"]),
    ]
    notes = ["band: range of the full chunks, rule: their median"]
    if model is not None and rows:
        from ..costs import chunk_cost

        config, types = _cost_inputs(model)
        flops = [chunk_cost(config, c.start, c.n_tokens, types, ctx=chunks[-1].end).total_flops for c in chunks]
        rate = _median([f / c.seconds for f, c in zip(flops, chunks)])  # FLOP/s of the median chunk
        predicted = [dict(chunk=i, predicted=c.n_tokens * rate / f, gflop=f / 1e9)
                     for i, (c, f) in enumerate(zip(chunks, flops))]
        layers.append(alt.Chart(alt.Data(values=predicted)).mark_line(color="#e6550d", strokeDash=[4, 2]).encode(
            x="chunk:Q", y="predicted:Q", tooltip=["chunk:O", "gflop:Q", "predicted:Q"]))
        notes.append(f"dashed: predicted from FLOPs at the median rate ({rate / 1e9:.2f} GFLOP/s)")
    # a title over two lines of notes: one line would run past the plot's 320 px (and out of a notebook's width)
    title = alt.TitleParams("prefill speed per chunk", subtitle=notes, anchor="start")
    return alt.layer(*layers).properties(title=title, width=320, height=160)


def prefill_cost_chart(runs, model):
    """A chunk-size sweep on ``model``, measured beside predicted. ``runs``: ``{prefill_chunk: [chunks of a
    prefill, ...]}``, the same prompt prefilled once or more per chunk size (each a list of ``PrefillChunk``).
    Left: each repeat's prefill time (points), their median (tick) and range (rule); right: what
    :mod:`ds4lab.costs` predicts for the prefill at that chunk size (GFLOP, and MiB of weights read: a chunk reads
    every weight once, so fewer, bigger chunks read less), which no machine's noise changes."""
    alt = _alt()
    from ..costs import prefill_costs

    if not runs:
        raise ValueError("prefill_cost_chart needs at least one chunk size with one prefill")
    config, types = _cost_inputs(model)
    measured, spread, predicted = [], [], []
    for chunk, repeats in runs.items():
        if not repeats:
            raise ValueError(f"chunk size {chunk} has no prefill")
        seconds = [sum(c.seconds for c in chunks) for chunks in repeats]
        measured += [dict(chunk=str(chunk), repeat=i, seconds=t) for i, t in enumerate(seconds)]
        spread.append(dict(chunk=str(chunk), low=min(seconds), high=max(seconds), median=_median(seconds),
                           repeats=len(seconds)))
        n_tokens, ctx = repeats[0][-1].end, repeats[0][-1].end
        costs = prefill_costs(config, n_tokens, int(chunk), types, ctx=ctx)
        predicted += [dict(chunk=str(chunk), measure="GFLOP", value=sum(c.total_flops for c in costs) / 1e9),
                      dict(chunk=str(chunk), measure="weights read (MiB)",
                           value=sum(c.weight_bytes for c in costs) / 2**20)]
    order = [str(c) for c in runs]
    x = alt.X("chunk:N", sort=order, title="prefill_chunk")
    times = alt.layer(
        alt.Chart(alt.Data(values=spread)).mark_rule(color="#3182bd").encode(x=x, y="low:Q", y2="high:Q"),
        alt.Chart(alt.Data(values=spread)).mark_tick(color="#08519c", thickness=2, size=18).encode(
            x=x, y=alt.Y("median:Q", title="prefill seconds (measured)"), tooltip=["chunk:N", "median:Q", "low:Q",
                                                                                   "high:Q", "repeats:Q"]),
        alt.Chart(alt.Data(values=measured)).mark_point(color="#3182bd", opacity=0.6).encode(
            x=x, y="seconds:Q", tooltip=["chunk:N", "repeat:Q", "seconds:Q"]),
    ).properties(title="measured: each repeat, median (tick), range", width=220, height=160)
    costs = alt.Chart(alt.Data(values=predicted)).mark_bar(color="#e6550d").encode(
        x=x, y=alt.Y("value:Q", title=None), tooltip=["chunk:N", "measure:N", alt.Tooltip("value:Q", format=",.1f")],
    ).properties(width=160, height=160).facet(column=alt.Facet("measure:N", title="predicted (ds4lab.costs)")
                                               ).resolve_scale(y="independent")
    n_tokens = next(iter(runs.values()))[0][-1].end
    return alt.hconcat(times, costs).properties(title=f"prefill of {n_tokens} tokens by chunk size")


def kv_bytes_chart(session, chunks):
    """KV bytes after each chunk, per layer kind (raw only / ratio 4 / ratio 128), from the chunks' checkpoints."""
    alt = _alt()
    from ..kv.checkpoint import state_to_payload
    from ..kv.view import KVView

    cfg, b = session.model.config, session.model.backend
    rows = []
    for c in chunks:
        cp = c.checkpoint
        kv = KVView(cfg, state_to_payload(cfg, b, cp.state_for(cfg, b, session.geometry), cp.tokens, cp.logits))
        by_kind: dict[str, int] = {}
        for lk in kv:
            kind = f"ratio {lk.ratio}" if lk.ratio else "raw only"
            by_kind[kind] = by_kind.get(kind, 0) + lk.nbytes
        rows += [dict(tokens=c.end, kind=k, bytes=v) for k, v in by_kind.items()]
    return _own_legend(
        alt.Chart(alt.Data(values=rows))
        .mark_line(point=True)
        .encode(
            x=alt.X("tokens:Q", title="tokens"),
            y=alt.Y("bytes:Q", title="KV bytes (all layers of the kind)"),
            color="kind:N",
            tooltip=["tokens:Q", "kind:N", "bytes:Q"],
        )
        .properties(title="KV bytes by layer kind", width=320, height=160)
    )


def kv_cache_chart(config, contexts=(1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20), bytes_per_value: int = 2):
    """KV cache size against context for a model shaped as ``config`` (e.g. ``ds4lab.FLASH``): DS4's compressed
    cache beside the dense caches of the same shape (:mod:`ds4lab.kv.sizes` says how each is counted), both axes
    logarithmic, in GiB at ``bytes_per_value`` bytes a cached value."""
    alt = _alt()
    from ..kv.sizes import SCHEMES, cache_table

    rows = [dict(r, gib=r["bytes"] / 2**30) for r in cache_table(config, contexts, bytes_per_value)]
    return (
        alt.Chart(alt.Data(values=rows))
        .mark_line(point=True)
        .encode(
            x=alt.X("tokens:Q", title="context (tokens)", scale=alt.Scale(type="log", base=2),
                    axis=alt.Axis(values=list(contexts), labelExpr=(
                        "datum.value >= 1048576 ? datum.value / 1048576 + 'M' : datum.value / 1024 + 'K'"))),
            y=alt.Y("gib:Q", title=f"KV cache (GiB, {bytes_per_value} bytes a value)", scale=alt.Scale(type="log")),
            color=alt.Color("scheme:N", title="cache", sort=list(SCHEMES)),
            tooltip=["scheme:N", "tokens:Q", alt.Tooltip("gib:Q", format=".3~f", title="GiB")],
        )
        .properties(title=f"KV cache by context: DS4 against dense caches ({config.n_layer} layers)", width=360,
                    height=220)
    )


def expert_load_rows(counts: dict, hash_layers=(), max_rows: int = MAX_ROWS) -> list[dict]:
    """One row per layer and expert, or per layer and run of ``group`` consecutive experts (their counts
    summed) when layers × experts would exceed ``max_rows``."""
    if not counts:
        return []
    n_expert = len(next(iter(counts.values())))
    group = max(1, math.ceil(len(counts) * n_expert / max_rows))
    rows = []
    for il, c in counts.items():
        c = np.asarray(c)
        label = f"layer {il}" + (" (hash)" if il in hash_layers else "")
        for e in range(0, n_expert, group):
            last = min(e + group, n_expert) - 1
            rows.append(dict(layer=int(il), label=label, expert=e, expert_end=last + 1,
                             experts=f"{e}" if last == e else f"{e}-{last}", tokens=int(c[e : last + 1].sum())))
    return rows


def expert_load_chart(source, hash_layers=None, max_rows: int = MAX_ROWS):
    """Tokens per expert and layer as a heatmap (hash-routed layers labelled) from an ``ExpertView``, a
    ``Capture`` of ``moe.experts`` or a ``{layer: counts}`` dict; experts are grouped in runs when layers ×
    experts exceed ``max_rows``."""
    alt = _alt()
    from .experts import expert_counts

    if hasattr(source, "counts") and hasattr(source, "hash_layers"):
        counts, hashed = source.counts, source.hash_layers
    elif hasattr(source, "records") and hasattr(source, "cfg"):
        counts = expert_counts(source)
        hashed = [il for il in counts if source.cfg.is_hash_layer(il)]
    else:
        counts, hashed = dict(source), []
    hashed = set(hashed if hash_layers is None else hash_layers)
    rows = expert_load_rows(counts, hashed, max_rows)
    order = [r["label"] for r in rows if r["expert"] == 0]
    # Expert e spans [e, e + 1): its tick goes at e + 0.5, labelled e, every 2^k experts (at most 16 ticks).
    n_expert = max((r["expert_end"] for r in rows), default=0)
    every = 1 << max(0, math.ceil(math.log2(max(n_expert, 1) / 16)))
    ticks = [e + 0.5 for e in range(0, n_expert, every)]
    return (
        alt.Chart(alt.Data(values=rows))
        .mark_rect()
        .encode(
            x=alt.X("expert:Q", title="expert", scale=alt.Scale(nice=False),
                    axis=alt.Axis(values=ticks, labelExpr="floor(datum.value)", grid=False)),
            x2="expert_end:Q",
            y=alt.Y("label:O", title=None, sort=order),
            color=alt.Color("tokens:Q", title="tokens", scale=alt.Scale(scheme="blues")),
            tooltip=["label:N", "experts:N", "tokens:Q"],
        )
        .properties(title="tokens routed to each expert", width=360, height=alt.Step(14))
    )
