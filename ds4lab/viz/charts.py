"""The charts of a prefill, of the KV cache, of the router and of an intervention's effect, as Vega-Lite specs
(:mod:`ds4lab.viz.vegalite` says how they are shown and why they are not built with Altair). Data is reduced
first, far under the 5000 rows a browser draws comfortably.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ..text_table import layer_kind
from . import palette
from .vegalite import Chart, field, inline, tooltip, unit

MAX_ROWS = 4000  # rows a chart's data may hold
# the indexer's rows, kept or not
KEPT_COLORS = {"domain": ["kept", "dropped"], "range": [palette.KEPT, palette.DROPPED]}
# An axis label of bytes in binary units, tick by tick: 0, 256 KiB, 1.25 MiB, as TierView and the notebooks' text
# write them (an axis "format" of "~s" gave every tick the largest one's decimal prefix: 0M, 0.5M, 1M)
BINARY_BYTES = ("datum.value >= 1073741824 ? format(datum.value / 1073741824, '~g') + ' GiB' : "
                "datum.value >= 1048576 ? format(datum.value / 1048576, '~g') + ' MiB' : datum.value >= 1024 ? "
                "format(datum.value / 1024, '~g') + ' KiB' : datum.value ? datum.value + ' B' : '0'")


def bytes_axis(largest: float, most: int = 6) -> tuple[dict, dict]:
    """The scale and axis of a bytes field up to ``largest``: ticks at whole multiples of a power of two (at most
    ``most`` steps above 0; Vega's own ticks fall on decimal values, 488.28 KiB), labelled in binary units."""
    step = 1 << max(0, math.ceil(math.log2(max(largest, 1) / most)))
    top = step * max(1, math.ceil(largest / step))
    return {"domain": [0, top]}, {"values": list(range(0, top + 1, step)), "labelExpr": BINARY_BYTES}


def _label_step(n: int, most: int) -> int:
    """Every how many of ``n`` categories an axis labels one: a power of two, so that at most ``most`` get one."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1) / most)))


def _own_legend(spec: dict, **frame) -> Chart:
    """``spec`` with a colour scale of its own, so that its legend sits beside it when it is concatenated with
    another chart (``a | b``); a shared legend would go to the right of the whole row. ``frame``: the title and
    size, which belong to the layer, not to the view inside it."""
    return Chart({"layer": [spec], "resolve": {"scale": {"color": "independent"}}, **frame})


def _median(values) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))


def _cost_inputs(model):
    """(config, tensor types) of a loaded model, for :mod:`ds4lab.costs`."""
    from ..costs import file_types

    return model.config, file_types(model.file)


def prefill_chunks_chart(chunks, model=None, warmup: int = 0):
    """Tokens/s of each chunk of a prefill (a list of ``PrefillChunk``), as points. Chunks of one size are repeats
    of the same work, so their median is drawn as a rule and their range as a band: on a shared CPU the spread is
    the machine's noise. The first ``warmup`` chunks (a process's first step converts the weights it uses, which later
    steps reuse) are drawn hollow and left out of the band, the median and the rate below. With the ``model`` that ran
    them, a line shows each chunk's speed predicted from its FLOPs (:mod:`ds4lab.costs`) at the median FLOP rate of
    the chunks: where the points leave the line, the machine varied, not the work."""
    if not 0 <= warmup <= len(chunks):
        raise ValueError(f"warmup is {warmup}: it must be between 0 and the {len(chunks)} chunks")
    # positions "64–127", as the tables and the prose write a chunk (its end is the next chunk's start)
    rows = [dict(chunk=i, positions=f"{c.start}–{c.end - 1}", tokens=c.n_tokens, tokens_per_s=c.tokens_per_s,
                 ms=c.seconds * 1e3) for i, c in enumerate(chunks)]
    timed = rows[warmup:]
    size = max(r["tokens"] for r in timed) if timed else 0
    full = [r["tokens_per_s"] for r in timed if r["tokens"] == size]
    spread = [dict(low=min(full), high=max(full), median=_median(full), label=f"median of {len(full)} chunks of {size}")
              ] if full else []
    x = field("chunk:Q", title="chunk", axis={"tickMinStep": 1, "format": "d"})
    y = field("tokens_per_s:Q", title="tokens/s (measured)")
    tips = tooltip("chunk:O", "positions:N", "tokens:Q", field("ms:Q", format=".1f"),
                   field("tokens_per_s:Q", title="tokens/s", format=",.0f"))
    layers = [
        unit(spread, {"type": "rect", "opacity": 0.15, "color": palette.MEASURED}, y=field("low:Q"),
             y2={"field": "high"}),
        unit(spread, {"type": "rule", "color": palette.MEASURED}, y=field("median:Q"),
             tooltip=tooltip("label:N", field("median:Q", title="median tokens/s", format=",.0f"))),
        unit(timed, {"type": "point", "filled": True, "size": 40, "color": palette.MEASURED}, x=x, y=y, tooltip=tips),
    ]
    # (a shorter last chunk is a point alone; no timed chunk, no band)
    notes = [f"band: range of the {size}-token chunks; rule: median"] if spread else []
    if warmup:
        layers.append(unit([dict(r, run="warm-up") for r in rows[:warmup]],
                           {"type": "point", "filled": False, "size": 40, "color": palette.MEASURED}, x=x, y=y,
                           tooltip=tooltip("run:N", *tips)))
        # what they are left out of, where it is drawn: the band, and the rate of the dashed line below
        left_out = [name for name, drawn in (("band", spread), ("rate", model is not None and timed)) if drawn]
        notes.append(f"hollow: {'chunk 0' if warmup == 1 else f'chunks 0-{warmup - 1}'} (warm-up)"
                     + (f", left out of the {' and the '.join(left_out)}" if left_out else ""))
    if model is not None and timed:
        from ..costs import chunk_cost

        config, types = _cost_inputs(model)
        flops = [chunk_cost(config, c.start, c.n_tokens, types, ctx=chunks[-1].end).total_flops for c in chunks]
        rate = _median([f / c.seconds for f, c in list(zip(flops, chunks))[warmup:]])  # FLOP/s of the median chunk
        predicted = [dict(chunk=i, predicted=c.n_tokens * rate / f, gflop=f / 1e9)
                     for i, (c, f) in enumerate(zip(chunks, flops))]
        line = {"type": "line", "color": palette.PREDICTED, "strokeDash": [4, 2]}
        layers.append(unit(predicted, line, x=field("chunk:Q"), y=field("predicted:Q"),
                           tooltip=tooltip("chunk:O", field("gflop:Q", title="GFLOP", format=",.3~r"),
                                           field("predicted:Q", title="predicted tokens/s", format=",.0f"))))
        notes += ["dashed: predicted from FLOPs", f"at the median rate ({rate / 1e9:.2f} GFLOP/s)"]
    # the notes a line each, none wider than the plot's 260 px: beside kv_bytes_chart it fits a laptop's notebook
    title = {"text": "prefill speed per chunk", "subtitle": notes, "anchor": "start"}
    return Chart({"layer": layers, "title": title, "width": 260, "height": 160})


PANEL_TITLE = {"fontSize": 12, "fontWeight": "bold"}  # a panel's title beside a facet's column headers


def prefill_cost_chart(runs, model):
    """A chunk-size sweep on ``model``, measured beside predicted. ``runs``: ``{prefill_chunk: [chunks of a
    prefill, ...]}``, the same prompt prefilled once or more per chunk size (each a list of ``PrefillChunk``).
    Left: each repeat's prefill time (points), their median (tick) and range (rule); right: what
    :mod:`ds4lab.costs` predicts for the prefill at that chunk size (GFLOP, and MiB of weights read: a chunk reads
    every weight once, so fewer, bigger chunks read less), which no machine's noise changes."""
    from ..costs import prefill_costs

    if not runs:
        raise ValueError("prefill_cost_chart needs at least one chunk size with one prefill")
    config, types = _cost_inputs(model)
    measured, spread, predicted = [], [], []
    for chunk, repeats in runs.items():
        if not repeats:
            raise ValueError(f"chunk size {chunk} has no prefill")
        seconds = [sum(c.seconds for c in chunks) for chunks in repeats]
        measured += [dict(chunk=str(chunk), repeat=i, seconds=t) for i, t in enumerate(seconds, 1)]  # from 1
        spread.append(dict(chunk=str(chunk), low=min(seconds), high=max(seconds), median=_median(seconds),
                           repeats=len(seconds)))
        n_tokens, ctx = repeats[0][-1].end, repeats[0][-1].end
        costs = prefill_costs(config, n_tokens, int(chunk), types, ctx=ctx)
        predicted += [dict(chunk=str(chunk), measure="predicted: GFLOP",
                           value=sum(c.total_flops for c in costs) / 1e9),
                      dict(chunk=str(chunk), measure="predicted: weights read (MiB)",
                           value=sum(c.weight_bytes for c in costs) / 2**20)]
    order = [str(c) for c in runs]
    x = field("chunk:N", sort=order, title="prefill chunk (tokens)", axis={"labelAngle": 0})
    times = {"layer": [
        unit(spread, {"type": "rule", "color": palette.MEASURED}, x=x, y=field("low:Q"), y2={"field": "high"}),
        unit(spread, {"type": "tick", "color": palette.MEASURED, "thickness": 2, "size": 18}, x=x,
             y=field("median:Q", title="prefill seconds (measured)"),
             tooltip=tooltip("chunk:N", *(field(f"{f}:Q", format=".3f") for f in ("median", "low", "high")),
                             "repeats:Q")),
        # filled: hollow points are the warm-up left out in prefill_chunks_chart beside it
        unit(measured, {"type": "point", "filled": True, "color": palette.MEASURED, "opacity": 0.6}, x=x,
             y=field("seconds:Q"),
             tooltip=tooltip("chunk:N", field("repeat:Q", title="timed repeat"), field("seconds:Q", format=".3f"))),
    ], "title": {"text": "measured: each repeat, median (tick), range", **PANEL_TITLE}, "width": 220, "height": 160}
    bars = unit(None, {"type": "bar", "color": palette.PREDICTED}, x=x, y=field("value:Q", title=None),
                tooltip=tooltip("chunk:N", "measure:N", field("value:Q", format=",.1f")))
    # each column headed as the measured panel is titled, on one line with it (a facet's own title sat above, smaller)
    header = {"labelFontSize": PANEL_TITLE["fontSize"], "labelFontWeight": "bold"}
    costs = {"data": {"values": predicted}, "facet": {"column": field("measure:N", title=None, header=header)},
             "spec": dict(bars, width=160, height=160), "resolve": {"scale": {"y": "independent"}}}
    n_tokens = next(iter(runs.values()))[0][-1].end
    return Chart({"hconcat": [times, costs],
                  "title": f"prefill of {n_tokens} tokens by chunk size: measured, and predicted by ds4lab.costs"})


def kv_bytes_chart(session, chunks):
    """KV bytes per layer kind (raw only / ratio 4 / ratio 128): after each chunk, from the chunks' checkpoints
    (points); from no token to the session's context, the same bytes counted from the layout
    (:func:`ds4lab.kv.layout.layer_state_shapes`: what a fresh state holds already, where the kinds cross), solid to
    the last chunk, dashed past it."""
    from ..kv.checkpoint import state_to_payload
    from ..kv.layout import layer_state_shapes, raw_live_rows
    from ..kv.view import KVView

    cfg, b, geo = session.model.config, session.model.backend, session.geometry
    rows = []
    for c in chunks:
        cp = c.checkpoint
        kv = KVView(cfg, state_to_payload(cfg, b, cp.state_for(cfg, b, geo), cp.tokens, cp.logits))
        by_kind: dict[str, int] = {}
        for lk in kv:
            by_kind[layer_kind(lk.ratio)] = by_kind.get(layer_kind(lk.ratio), 0) + lk.nbytes
        rows += [dict(tokens=c.end, kind=k, bytes=v) for k, v in by_kind.items()]
    last = max((c.end for c in chunks), default=0)
    counted = []
    for T in sorted({*range(0, geo.ctx, max(1, geo.ctx // 128)), *(c.end for c in chunks), geo.ctx - 1}):
        by_kind = {}
        for il in range(cfg.n_layer):
            shapes = layer_state_shapes(cfg, il, T, raw_live_rows(T, geo.window, geo.raw_cap)).values()
            kind = layer_kind(cfg.ratio(il))
            by_kind[kind] = by_kind.get(kind, 0) + 4 * sum(s[0] * s[1] for s in shapes if s is not None)
        counted += [dict(tokens=T, kind=k, bytes=v, part="run" if T <= last else "past") for k, v in by_kind.items()]
    # raw rows in the raw window's blue, compressed ones in the compressed rows' greens (no orange: palette.py)
    colours = {"raw only": palette.RAW, "ratio 4": "#74c476", "ratio 128": "#006d2c"}
    present = [k for k in colours if any(r["kind"] == k for r in counted)]
    kinds = {"domain": present, "range": [colours[k] for k in present]}
    x = field("tokens:Q", title="tokens", scale={"domain": [0, geo.ctx]})
    y = field("bytes:Q", title="KV bytes (all layers of the kind)")
    lines = [unit([r for r in counted if r["part"] == part or part == "past" and r["tokens"] == last],
                  {"type": "line", "strokeWidth": 1.5, **({"strokeDash": [4, 3]} if part == "past" else {})},
                  x=x, y=y, color=field("kind:N", scale=kinds, title="kind"))
             for part in ("run", "past")]
    points = unit(rows, {"type": "point", "filled": True, "size": 36}, x=x, y=y, color=field("kind:N", scale=kinds),
                  tooltip=tooltip("tokens:Q", "kind:N", field("bytes:Q", format=",")))
    return _own_legend({"layer": [*lines, points]}, width=260, height=160, title={
        "text": "KV bytes by layer kind",
        "subtitle": ["points: after each chunk; lines: counted from",
                     f"the layout, dashed past the prompt to {geo.ctx}"]})


SCHEME_LEGEND = {"symbolType": "stroke", "symbolStrokeWidth": 2, "symbolSize": 300}


def kv_cache_chart(config, contexts=(1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20), bytes_per_value: int = 2):
    """KV cache size against context for a model shaped as ``config`` (e.g. ``ds4lab.FLASH``): DS4's compressed
    cache beside the dense caches of the same shape (:mod:`ds4lab.kv.sizes` says how each is counted), both axes
    logarithmic, in GiB at ``bytes_per_value`` bytes a cached value."""
    from ..kv.sizes import SCHEMES, cache_table

    rows = [dict(r, gib=r["bytes"] / 2**30) for r in cache_table(config, contexts, bytes_per_value)]
    x = field("tokens:Q", title="context (tokens)", scale={"type": "log", "base": 2},
              axis={"values": list(contexts), "labelExpr": (
                  "datum.value >= 1048576 ? datum.value / 1048576 + 'M' : datum.value / 1024 + 'K'")})
    lines = unit(
        None, {"type": "line", "point": True}, x=x,
        y=field("gib:Q", title=f"KV cache (GiB, {bytes_per_value} bytes a value)", scale={"type": "log"}),
        # a dash per scheme too: the shared row's and MLA's lines lie within 12% of each other, too close for colour
        # alone; one legend of both (the same domain and legend: Vega-Lite merges them, else a second legend of
        # black dots), its symbols strokes that show the dash. DS4 black, the dense caches greys: the views' hues
        # mean kinds of rows (blue raw, green compressed, purple the indexer's; palette.py), which these are not
        color=field("scheme:N", title="cache", legend=SCHEME_LEGEND,
                    scale={"domain": list(SCHEMES), "range": ["#000000", "#525252", "#737373", "#969696", "#b0b0b0"]}),
        strokeDash=field("scheme:N", title="cache", legend=SCHEME_LEGEND, scale={"domain": list(SCHEMES)}),
    )
    # the tooltip: every cache at the context nearest the pointer, on a rule there (a point's own tooltip hid the
    # shared row's under MLA's, whose points cover them)
    at = {"name": "at", "select": {"type": "point", "fields": ["tokens"], "nearest": True, "on": "mouseover",
                                   "clear": "mouseout"}}
    rule = dict(unit(None, {"type": "rule", "color": "#969696"}, x=x,
                     opacity={"condition": {"param": "at", "empty": False, "value": 1}, "value": 0},
                     tooltip=tooltip(field("tokens:Q", title="context (tokens)", format=","),
                                     *(field(f"{s}:Q", title=f"{s} (GiB)", format=",.4~r") for s in SCHEMES))),
                transform=[{"pivot": "scheme", "value": "gib", "groupby": ["tokens"]}], params=[at])
    # the two lines that overlap, said where a reader looks (a walk-through could not tell them apart)
    close = (f"shared row ({config.head_dim} values a token and layer) and MLA ({config.head_dim + config.n_rot}) "
             f"lie {config.n_rot / config.head_dim:.0%} apart: their lines overlap")
    title = {"text": f"KV cache by context: DS4 against dense caches ({config.n_layer} layers)", "subtitle": close,
             "anchor": "start"}
    # each line named at its end, over it (the shared row's under it, off MLA's; DS4's under it, off the shared
    # row's): projected, a legend of dash patterns alone was hard to read
    y = field("gib:Q", scale={"type": "log"})
    at_end = f"datum.tokens == {max(contexts)}"
    names = [dict(unit(None, {"type": "text", "align": "right", "dx": -4, "dy": dy, "fontSize": 11}, x=x, y=y,
                       text=field("scheme:N")),
                  transform=[{"filter": {"and": [at_end, {"field": "scheme", "oneOf": on}]}}])
             for dy, on in ((-9, ["MHA", "GQA", "MLA"]), (13, ["shared row", "ds4"]))]
    return Chart({"data": inline(rows), "layer": [lines, rule, *names], "title": title, "width": 360, "height": 220})


def batch_copies_chart(rows: list[dict]):
    """A chunk-size sweep of a tier plan's batch switches: copies and bytes moved per chunk size, and the time
    copying where the rows have it. ``rows``: one dict per chunk size with ``chunk``, ``switches`` (batch copies),
    ``bytes`` and optionally ``seconds`` (sums over the session's ``tier_trace``; leave it out where a copy is a
    memcpy within one CPU's memory, whose microseconds are noise). Panels of 150 pixels: three fit a laptop's
    notebook beside its file browser."""
    timed = all("seconds" in r for r in rows)
    rows = [dict(r, us=r["seconds"] * 1e6) if timed else r for r in rows]
    x = field("chunk:O", title="prefill chunk (tokens)", axis={"labelAngle": 0})
    tips = tooltip(field("chunk:O", title="prefill chunk"), field("switches:Q", title="batch copies"),
                   field("bytes:Q", title="bytes moved", format=","),
                   *([field("us:Q", title="µs copying", format=",.0f")] if timed else []))

    def panel(mark, y, title):  # in the TierView's batch grey: vega-lite's default blue is the raw rows'
        return dict(unit(rows, dict(mark, color=palette.BATCH), x=x, y=y, tooltip=tips), title=title, width=150,
                    height=140)

    scale, axis = bytes_axis(max((r["bytes"] for r in rows), default=0))
    panels = [
        panel({"type": "bar"}, field("switches:Q", title="batch copies"), "copies: one per chunk"),
        panel({"type": "line", "point": {"filled": True, "color": palette.BATCH}},
              field("bytes:Q", title="bytes moved", scale=scale, axis=axis),
              "bytes: the same for all"),
    ]
    if timed:
        panels.append(panel({"type": "bar"}, field("us:Q", title="µs copying"), "time copying (here)"))
    return Chart({"hconcat": panels})


def indexer_choices_chart(capture, layer: int, every: int = 8, start: int = 0):
    """Which compressed rows layer ``layer``'s indexer kept among those each query could see, from a capture
    of ``blk.{layer}.indexer.topk``: a cell per visible row for every ``every``-th query position from
    ``start`` (kept green, the compressed rows' colour; dropped salmon)."""
    if every < 1:
        raise ValueError(f"every must be 1 or more, got {every}")
    name = f"blk.{layer}.indexer.topk"
    topk, positions = capture[name], capture.positions(name)
    ratio = capture.cfg.ratio(layer)
    queries = [(i, int(p)) for i, p in enumerate(positions) if p >= start and p % every == 0]
    if not queries:
        raise ValueError(f"no query of the capture is at a position >= {start} that is a multiple of {every}")
    cells = [dict(q=p, r=r, kept="kept" if topk[i, r] else "dropped")
             for i, p in queries for r in range((p + 1) // ratio)]
    if len(cells) > MAX_ROWS:
        raise ValueError(f"{len(cells)} cells are more than a chart draws well ({MAX_ROWS}): raise every= or start=")
    n_rows = (max(p for _, p in queries) + 1) // ratio
    every_row = _label_step(n_rows, 10)
    spec = unit(
        cells, "rect",
        x=field("r:O", title=f"compressed row (one every {ratio} tokens)",
                axis={"values": list(range(0, n_rows, every_row)), "labelAngle": 0}),
        y=field("q:O", title="query position", axis={"values": [p for _, p in queries][:: max(1, len(queries) // 6)]}),
        color=field("kept:N", title=None, scale=KEPT_COLORS),
        tooltip=tooltip(field("q:Q", title="query position"), field("r:Q", title="compressed row"),
                        field("kept:N", title="the indexer")),
    )
    title = f"layer {layer}'s indexer: top-{capture.cfg.idx_topk} of the visible rows"
    return Chart(dict(spec, title=title, width=420, height=200))


def indexer_mass_chart(layers: dict, n_visible, layer: int, query: int, k: int):
    """For one query of a dense indexer pass (:func:`ds4lab.evaluate.dense_indexer_pass`: ``layers`` and
    ``n_visible``), a bar per compressed row it sees: the share of its attention over those rows that the row
    receives (summed over the heads), green where the indexer's top-``k`` keeps the row, salmon where it drops it.
    The title gives the share the kept rows hold: the query's recall. The kept rows are the dense pass's top-k:
    the running model's choice in the first indexed layer; in later ones, whose inputs the dense pass's earlier
    layers changed by attending every row, a query's choice can differ by a few rows."""
    from ..evaluate import top_k_rows

    if layer not in layers:
        raise ValueError(f"layer {layer} has no indexer; these do: {sorted(layers)}")
    mass, scores = layers[layer]
    if not 0 <= query < len(n_visible):
        raise ValueError(f"query {query} is outside the pass's {len(n_visible)} positions")
    n = int(n_visible[query])
    if n <= k:
        raise ValueError(f"query {query} sees {n} compressed rows, not more than the top-{k}: the indexer keeps "
                         "them all")
    if n > MAX_ROWS:
        raise ValueError(f"query {query} sees {n} compressed rows, more bars than a chart draws well ({MAX_ROWS})")
    share = mass[query, :n] / mass[query, :n].sum()
    kept = top_k_rows(scores[query:query + 1], n_visible[query:query + 1], k)[0, :n]
    recall = share[kept].sum()  # the query's top_k_recall
    rows = [dict(r=r, share=float(share[r]), kept="kept" if kept[r] else "dropped") for r in range(n)]
    spec = unit(
        rows, "bar",
        x=field("r:O", title="compressed row",
                axis={"values": list(range(0, n, _label_step(n, 10))), "labelAngle": 0}),
        # the axis ends at the 5% step above the tallest bar, so no bar touches the frame
        y=field("share:Q", title="share of the attention", axis={"format": ".0%"},
                scale={"domain": [0, math.floor(float(share.max()) * 20 + 1) / 20], "nice": False}),
        color=field("kept:N", title=None, scale=KEPT_COLORS),
        tooltip=tooltip(field("r:Q", title="compressed row"),
                        field("share:Q", title="share of the attention over compressed rows", format=".1%"),
                        field("kept:N", title="the indexer")),
    )
    title = f"layer {layer}, query {query}: the top-{k} holds {recall:.0%} of the attention over {n} rows"
    return Chart(dict(spec, title=title, width=420, height=160))


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
    every = _label_step(n_expert, 16)
    ticks = [e + 0.5 for e in range(0, n_expert, every)]
    spec = unit(
        rows, "rect",
        x=field("expert:Q", title="expert", scale={"nice": False},
                axis={"values": ticks, "labelExpr": "floor(datum.value)", "grid": False}),
        x2={"field": "expert_end"},
        y=field("label:O", title=None, sort=order),
        color=field("tokens:Q", title="tokens", scale={"scheme": "greys"}),  # no row hue (palette.py)
        tooltip=tooltip(field("label:N", title="layer"), field("experts:N", title="expert"),
                        field("tokens:Q", title="tokens routed")),
    )
    return Chart(dict(spec, title="tokens routed to each expert", width=360, height={"step": 14}))


def _edits_line(labels) -> str:
    """Edits' labels in one line: a patch over every layer has a dozen ("blk.0 raw position 312 patched ..."), said
    once each with the layers they span."""
    text = "; ".join(labels)
    if len(text) > 120 and len(labels) > 1:
        found = [re.match(r"blk\.(\d+) (.*)", label) for label in labels]
        what = list(dict.fromkeys(m[2] if m else label for m, label in zip(found, labels)))
        layers = sorted({int(m[1]) for m in found if m})
        where = f" in layers {layers[0]}–{layers[-1]}" if len(layers) > 1 and all(found) else ""
        text = f"{len(labels)} edits{where}: " + "; ".join(what)
    return (text if len(text) <= 160 else text[:159] + "…") or "edited"


def logit_diff_chart(diff, n: int = 6):
    """Next-token probabilities clean and under an intervention's edits (a :class:`ds4lab.interventions.LogitDiff`),
    side by side for the ``n`` likeliest tokens of each run (so a token the edits made likely shows, and one they
    made unlikely), ordered by their clean probability; the KL divergence in the title."""
    from ..config import check_count

    n = check_count(n, "n")
    if 4 * n > MAX_ROWS:  # two bars a token, up to 2n tokens
        raise ValueError(f"n={n}: up to {4 * n} bars, more than a chart draws well ({MAX_ROWS})")
    for run, logits in (("clean", diff.clean), ("edited", diff.edited)):
        if not np.all(np.isfinite(logits)):  # softmax would make every probability NaN
            raise ValueError(f"the {run} logits are not all finite: no probabilities to draw")
    p, q = diff.p_clean, diff.p_edited
    ids = list(dict.fromkeys(int(t) for t in [*np.argsort(-p, kind="stable")[:n], *np.argsort(-q, kind="stable")[:n]]))
    ids.sort(key=lambda t: (-p[t], -q[t]))
    texts = [repr(diff.tokenizer.decode([t])) for t in ids]
    # two tokens may read the same (a byte token beside a merged one): their ids tell them apart
    labels = [f"{x} ({t})" if texts.count(x) > 1 else x for x, t in zip(texts, ids)]
    rows = [dict(token=label, id=t, run=run, p=float(probs[t]))
            for label, t in zip(labels, ids) for run, probs in (("clean", p), ("edited", q))]
    spec = unit(
        rows, "bar",
        y=field("token:N", title=None, sort=labels),
        yOffset=field("run:N", sort=["clean", "edited"]),
        x=field("p:Q", title="probability of the next token"),
        color=field("run:N", title=None, sort=["clean", "edited"],
                    scale={"domain": ["clean", "edited"], "range": [palette.CLEAN, palette.ACCENT]}),
        tooltip=tooltip(field("token:N", title="token"), field("id:Q", title="id"), field("run:N", title="run"),
                        field("p:Q", title="probability", format=".4f")),
    )
    kl = diff.kl  # a property: two softmaxes over the vocabulary each time it is read
    title = {"text": f"next token, clean and edited: KL(clean ‖ edited) = {kl:{'.3g' if kl >= 1e-9 else '.1e'}} nats",
             "subtitle": _edits_line(diff.labels)}
    return Chart(dict(spec, title=title, width=360, height={"step": 11}))
