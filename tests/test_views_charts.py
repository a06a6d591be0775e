"""Charts without a network: ds4lab's charts (Vega-Lite specs) and, through ``offline_charts()``, one's own
Altair charts show as JupyterLab's own Vega-Lite mimetype and a PNG fallback, never Altair's HTML that loads
Vega from a CDN (see also test_notebooks.py for the saved notebooks and test_browser.py for the page)."""

import base64
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import ds4lab
from ds4lab.viz import palette

# A script fetched from the network: a CDN, <script src="http...">, an http(s) URL in a <script> element,
# import/require of a URL, a quoted .js URL; any URL at all in an application/javascript output.
REMOTE_SCRIPT = re.compile(
    r"cdn\.jsdelivr|unpkg\.com|cdnjs\.|esm\.sh|skypack"
    r"|<script\b[^>]*\bsrc\s*=\s*[\"']?\s*(?:https?:)?//"
    r"|<script\b[^>]*>(?:(?!</script>).)*?https?://"
    r"|\b(?:import|from|require|requirejs)\s*\(?\s*\[?\s*[\"'](?:https?:)?//"
    r"|[\"'](?:https?:)?//[^\"'\s]+\.m?js(?:\?[^\"'\s]*)?[\"']",
    re.I | re.S,
)
URL = re.compile(r"(?:https?:)?//[\w.-]+", re.I)


def _strings(obj, key=""):
    """(mimetype or key above it, string) for every string in ``obj``."""
    if isinstance(obj, str):
        yield key, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(k, key)
            yield from _strings(v, k if "/" in str(k) else key)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v, key)


def remote_scripts(obj) -> list[str]:
    """Every place in ``obj`` (a string, or the strings of nested dicts/lists: a mimebundle, a notebook output)
    that loads a script from the network, with some context."""
    found = []
    for key, s in _strings(obj):
        rx = URL if key == "application/javascript" else REMOTE_SCRIPT
        found += [s[max(0, m.start() - 40) : m.end() + 40] for m in rx.finditer(s)]
    return found


def test_remote_script_detector():
    assert remote_scripts({"text/html": '<script src="https://cdn.example.org/vega.js"></script>'})
    assert remote_scripts(['<script>requirejs.config({paths: {"vega": "https://example.org/npm/vega@6?noext"}})'])
    assert remote_scripts('import embed from "https://esm.example.org/vega-embed@7";')
    assert remote_scripts('<script src="//example.org/x.js">')
    assert remote_scripts('{"vega-embed": "https://cdn.jsdelivr.net/npm/vega-embed@7?noext"}')
    assert remote_scripts({"application/javascript": "fetch('https://example.org/data')"})
    assert not remote_scripts({"$schema": "https://vega.github.io/schema/vega-lite/v5.json", "text/html":
                               "<a href='https://github.com/antirez/ds4'>ds4</a> <script>let a = 1 < 2;</script>"})


@pytest.fixture(scope="module")
def alt():
    return pytest.importorskip("altair")


def prompt_ids(model) -> list[int]:
    return ((np.arange(80) * 7 + 3) % (model.config.n_vocab - 10) + 5).tolist()


@pytest.fixture(scope="module")
def dense(prefilled):
    """A dense indexer pass over the same 80 tokens: queries from position 67 see more rows than the top-16."""
    from ds4lab.evaluate import dense_indexer_pass

    model = prefilled[0]
    return dense_indexer_pass(model, prompt_ids(model))


@pytest.fixture(scope="module")
def prefilled(model_paths):
    """The nano model and a session that prefilled 80 tokens in chunks of 32, with layer 2's indexer choices."""
    model = ds4lab.load(model_paths["nano"], backend="numpy")
    sess = model.session(ctx=256, prefill_chunk=32)
    ids = prompt_ids(model)
    with sess.capture(["indexer.topk"], layers=[2]) as cap:
        chunks = sess.prefill(ids).run(progress=False)
    return model, sess, chunks, cap


@pytest.fixture(scope="module")
def charts(prefilled, dense):
    from ds4lab.viz.charts import (
        batch_copies_chart,
        expert_load_chart,
        indexer_choices_chart,
        indexer_mass_chart,
        kv_bytes_chart,
        kv_cache_chart,
        logit_diff_chart,
        prefill_chunks_chart,
        prefill_cost_chart,
    )

    model, sess, chunks, cap = prefilled
    speed = prefill_chunks_chart(chunks)
    return {
        "prefill_cost_chart": prefill_cost_chart({32: [chunks]}, model),
        "prefill_chunks_chart": speed,
        "kv_bytes_chart": kv_bytes_chart(sess, chunks),
        "expert_load_chart": expert_load_chart({0: np.arange(8), 1: np.ones(8, int)}, hash_layers=[0]),
        "kv_cache_chart": kv_cache_chart(ds4lab.FLASH),
        "indexer_choices_chart": indexer_choices_chart(cap, layer=2, every=4, start=16),
        "indexer_mass_chart": indexer_mass_chart(*dense, layer=2, query=79, k=16),
        "batch_copies_chart": batch_copies_chart([dict(chunk=16, switches=5, bytes=4096, seconds=0.01),
                                                  dict(chunk=64, switches=2, bytes=4096, seconds=0.004)]),
        "logit_diff_chart": logit_diff_chart(_logit_diff(model)),
        "hconcat": kv_bytes_chart(sess, chunks) | speed,
        "vconcat": kv_bytes_chart(sess, chunks) & speed,
    }


CHARTS = ["prefill_chunks_chart", "kv_bytes_chart", "expert_load_chart", "kv_cache_chart", "indexer_choices_chart",
          "indexer_mass_chart",
          "batch_copies_chart", "prefill_cost_chart", "logit_diff_chart", "hconcat", "vconcat"]


def _logit_diff(model):
    """Clean logits with tokens 5 > 6 > 7 ..., edited ones where token 40 rose to the top."""
    from ds4lab.interventions import LogitDiff

    clean = np.zeros(model.config.n_vocab, np.float32)
    clean[5:15] = np.arange(10, 0, -1)
    edited = clean.copy()
    edited[40] = 12.0
    return LogitDiff(clean, edited, ("blk.2 sink ablated (every head)",), model.tokenizer)


def test_logit_diff_chart_shows_both_runs_likeliest_tokens(prefilled):
    """The n likeliest tokens of either run (so the one the edits made likely shows: 40), ordered by the clean
    probability, each with its two bars' probabilities; the KL and the edits in the title."""
    from ds4lab.viz.charts import logit_diff_chart

    model = prefilled[0]
    diff = _logit_diff(model)
    spec = logit_diff_chart(diff, n=3).spec
    rows = spec["data"]["values"]
    assert [r["id"] for r in rows if r["run"] == "clean"] == [5, 6, 7, 40]
    for r in rows:
        want = diff.p_clean if r["run"] == "clean" else diff.p_edited
        assert r["p"] == pytest.approx(float(want[r["id"]]), rel=1e-12)
    assert spec["encoding"]["y"]["sort"] == [repr(model.tokenizer.decode([t])) for t in (5, 6, 7, 40)]
    assert f"{diff.kl:.3g} nats" in spec["title"]["text"] and "sink ablated" in spec["title"]["subtitle"]
    color = spec["encoding"]["color"]["scale"]
    assert color == {"domain": ["clean", "edited"], "range": [palette.CLEAN, palette.ACCENT]}


def test_logit_diff_chart_tells_tokens_of_one_text_apart_and_refuses_what_it_cannot_draw(prefilled):
    """Tokens that decode alike get their ids; a long list of edits is named by its first; n and non-finite
    logits are refused by name."""
    from ds4lab.interventions import LogitDiff
    from ds4lab.viz.charts import logit_diff_chart

    model = prefilled[0]
    tok = model.tokenizer
    ids = range(model.config.n_vocab)
    same = next((a, b) for a in ids for b in ids if a < b and tok.decode([a]) == tok.decode([b]))
    clean = np.zeros(model.config.n_vocab, np.float32)
    clean[list(same)] = [5.0, 4.0]
    diff = LogitDiff(clean, clean, tuple(f"blk.{i} raw position 312 patched" for i in range(12)), tok)
    spec = logit_diff_chart(diff, n=2).spec
    text = repr(tok.decode([same[0]]))
    assert spec["encoding"]["y"]["sort"] == [f"{text} ({same[0]})", f"{text} ({same[1]})"]
    assert spec["title"]["subtitle"] == "12 edits in layers 0–11: raw position 312 patched"
    long = LogitDiff(clean, clean, ("blk.3 " + "x" * 200,), tok)
    assert logit_diff_chart(long).spec["title"]["subtitle"] == "blk.3 " + "x" * 153 + "…"
    assert "KL(clean ‖ edited) = 0.0e+00 nats" in spec["title"]["text"]
    for n, message in ((0, "n must be a whole number, at least 1, got 0"), (2.5, "got 2.5"),
                       (1001, "more than a chart draws well")):
        with pytest.raises(ValueError, match=re.escape(message)):
            logit_diff_chart(diff, n=n)
    bad = clean.copy()
    bad[3] = np.nan
    with pytest.raises(ValueError, match="the edited logits are not all finite"):
        logit_diff_chart(LogitDiff(clean, bad, (), tok))


def test_altair_default_html_loads_vega_from_a_cdn(alt):
    """What offline_charts() replaces for one's own Altair charts: Altair's default renderer, whose HTML fails
    in an offline JupyterLab."""
    chart = alt.Chart(alt.Data(values=[dict(a=1, b=2)])).mark_bar().encode(x="a:O", y="b:Q")
    with alt.renderers.enable("default"):
        bundle = chart._repr_mimebundle_()
    bundle = bundle[0] if isinstance(bundle, tuple) else bundle
    assert remote_scripts(bundle)


def _check_bundle(data: dict, spec: dict):
    """A chart's bundle as JupyterLab gets it: Vega-Lite v5 and a PNG (with vl-convert), no HTML, no URL."""
    from ds4lab.viz.vegalite import VEGALITE_MIME

    assert not remote_scripts(data), remote_scripts(data)
    assert VEGALITE_MIME in data and "text/html" not in data  # JupyterLab would prefer HTML to Vega-Lite
    assert data[VEGALITE_MIME]["$schema"].endswith("/vega-lite/v5.json")
    assert data[VEGALITE_MIME] == dict(spec, **{"$schema": data[VEGALITE_MIME]["$schema"]})
    assert data["text/plain"].startswith("<Vega-Lite chart")
    try:
        import vl_convert  # noqa: F401
    except ImportError:
        assert "image/png" not in data
    else:
        assert base64.b64decode(data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", CHARTS)
def test_chart_bundles(charts, name):
    """ds4lab's charts display as the offline bundle by themselves, with no renderer to enable."""
    from IPython.core.formatters import DisplayFormatter

    from ds4lab.viz import chart_bundle

    chart = charts[name]
    data, _ = DisplayFormatter().format(chart)  # what IPython sends to the front-end
    _check_bundle(data, chart.to_dict())
    assert json.loads(json.dumps(chart.to_dict())) == chart.to_dict()  # plain JSON: no NumPy scalars
    assert "image/png" not in chart_bundle(chart, png=False)


@pytest.mark.parametrize("name", CHARTS)
def test_charts_are_valid_vega_lite(alt, charts, name):
    """Each spec validates against the Vega-Lite schema Altair carries: to_altair() reads it with validation,
    and Altair writes it back validated, with the same marks (Altair may move data up a level)."""
    def marks(obj):  # every mark of a spec, as a sorted tuple of its properties
        if isinstance(obj, dict):
            own = obj.get("mark")
            own = [tuple(sorted(({"type": own} if isinstance(own, str) else own).items()))] if own else []
            return own + [m for k, v in obj.items() if k != "mark" for m in marks(v)]
        return [m for v in obj for m in marks(v)] if isinstance(obj, list) else []

    back = charts[name].to_altair().to_dict(validate=True)
    assert sorted(marks(back)) == sorted(marks(charts[name].to_dict()))


def test_own_altair_charts_offline(alt):
    from IPython.core.formatters import DisplayFormatter

    from ds4lab.viz import offline_charts
    from ds4lab.viz.vegalite import RENDERER

    chart = alt.Chart(alt.Data(values=[dict(a=1, b=2)])).mark_bar().encode(x="a:O", y="b:Q")
    before = alt.renderers.active
    with offline_charts():
        assert alt.renderers.active == RENDERER
        data, _ = DisplayFormatter().format(chart)
    assert alt.renderers.active == before
    _check_bundle(data, chart.to_dict())


def test_charts_do_not_import_altair(model_paths):
    """Showing every ds4lab chart imports neither Altair nor jsonschema (seconds of a notebook's start)."""
    code = ("import sys, numpy as np, ds4lab\n"
            "from ds4lab.viz.charts import expert_load_chart, kv_cache_chart\n"
            "from IPython.core.formatters import DisplayFormatter\n"
            "DisplayFormatter().format(kv_cache_chart(ds4lab.FLASH) | expert_load_chart({0: np.arange(8)}))\n"
            "print(sorted(m for m in ('altair', 'jsonschema') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_png_required_without_vl_convert(charts, monkeypatch):
    from ds4lab.viz import chart_bundle

    monkeypatch.setitem(sys.modules, "vl_convert", None)  # import fails
    assert "image/png" not in chart_bundle(charts["kv_cache_chart"])
    with pytest.raises(RuntimeError, match="vl-convert"):
        chart_bundle(charts["kv_cache_chart"], png=True)


def test_field_shorthand():
    from ds4lab.viz.vegalite import field, tooltip

    assert field("a:Q", title="A") == {"field": "a", "type": "quantitative", "title": "A"}
    assert field("x:y:N") == {"field": "x:y", "type": "nominal"}
    assert tooltip("b:O", {"field": "c"}) == [{"field": "b", "type": "ordinal"}, {"field": "c"}]
    for bad in ("a", "a:X", ":Q"):
        with pytest.raises(ValueError, match="name:Q"):
            field(bad)


def test_indexer_choices_chart(prefilled, charts):
    """One cell per query (every 4th position from 16) and compressed row it could see, kept exactly where the
    captured top-k mask says."""
    from ds4lab.viz.charts import indexer_choices_chart

    model, _, _, cap = prefilled
    topk, pos = cap["blk.2.indexer.topk"], list(cap.positions("blk.2.indexer.topk"))
    cells = charts["indexer_choices_chart"].to_dict()["data"]["values"]
    queries = [p for p in pos if p >= 16 and p % 4 == 0]
    assert sorted({c["q"] for c in cells}) == queries
    ratio = model.config.ratio(2)
    for q in queries:
        row = [c for c in cells if c["q"] == q]
        assert [c["r"] for c in row] == list(range((q + 1) // ratio))
        assert [c["kept"] == "kept" for c in row] == [bool(topk[pos.index(q), c["r"]]) for c in row]
    with pytest.raises(ValueError, match="no query"):
        indexer_choices_chart(cap, layer=2, every=4, start=10_000)


def test_indexer_mass_chart(prefilled, dense, charts):
    """A bar per row query 79 sees (20): its share of the query's attention over the rows, summed over the heads,
    kept where the indexer's 16 highest scores are (a stable sort of the negated scores, ties to the lower row),
    and the title's recall the kept bars' sum."""
    from ds4lab.viz.charts import indexer_mass_chart

    layers, n_visible = dense
    mass, scores = layers[2]
    spec = charts["indexer_mass_chart"].to_dict()
    bars = spec["data"]["values"]
    n = int(n_visible[79])
    assert n == 20 and [b["r"] for b in bars] == list(range(n))
    np.testing.assert_allclose([b["share"] for b in bars], mass[79, :n] / mass[79, :n].sum(), rtol=1e-12)
    top = set(np.argsort(-scores[79, :n], kind="stable")[:16].tolist())
    assert [b["kept"] == "kept" for b in bars] == [r in top for r in range(n)]
    # layer 2 is the first indexed layer, so its dense pass's choice is the running model's (the capture's)
    cap = prefilled[3]
    pos = list(cap.positions("blk.2.indexer.topk"))
    assert [b["kept"] == "kept" for b in bars] == cap["blk.2.indexer.topk"][pos.index(79), :n].tolist()
    recall = sum(b["share"] for b in bars if b["kept"] == "kept")
    assert f"holds {recall:.0%} of the attention over 20 rows" in spec["title"]
    for bad, match in ((dict(layer=3, query=79), "no indexer"), (dict(layer=2, query=80), "outside"),
                       (dict(layer=2, query=60), "keeps them all")):
        with pytest.raises(ValueError, match=match):
            indexer_mass_chart(layers, n_visible, k=16, **bad)


def test_expert_ticks_sit_in_the_middle_of_their_cells():
    """Expert e's cell spans [e, e + 1): its tick is at e + 0.5 (labelled e), never on an edge, so 8 experts get
    ticks 0-7 and no "8"; 256 experts get one every 16."""
    from ds4lab.viz.charts import expert_load_chart

    axis = expert_load_chart({0: np.arange(8), 1: np.ones(8)}).to_dict()["encoding"]["x"]["axis"]
    assert axis["values"] == [e + 0.5 for e in range(8)] and axis["labelExpr"] == "floor(datum.value)"
    big = expert_load_chart({il: np.arange(256) for il in range(43)}).to_dict()  # grouped: 43 × 256 > MAX_ROWS
    values = big["encoding"]["x"]["axis"]["values"]
    assert values == [e + 0.5 for e in range(0, 256, 16)]
    rows = big["data"]["values"]
    assert all(any(r["expert"] <= v < r["expert_end"] for r in rows if r["layer"] == 0) for v in values)


# -- measured beside predicted ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sweep(model_paths):
    """The nano model's prefill of 80 tokens at chunk sizes 16 and 40, twice each."""
    model = ds4lab.load(model_paths["nano"], backend="numpy")
    ids = ((np.arange(80) * 7 + 3) % (model.config.n_vocab - 10) + 5).tolist()
    runs = {chunk: [model.session(ctx=256, prefill_chunk=chunk).prefill(ids).run(progress=False) for _ in range(2)]
            for chunk in (16, 40)}
    return model, runs


def test_kv_legend_sits_with_its_own_chart(charts):
    """Concatenated, the kind legend belongs to the KV chart (its colour scale is its own), not to the row."""
    spec = charts["hconcat"].to_dict()
    left, right = spec["hconcat"]
    assert left["resolve"] == {"scale": {"color": "independent"}}
    assert all(layer["encoding"]["color"] for layer in left["layer"][0]["layer"])
    assert "color" not in str(right.get("encoding", {})) and "resolve" not in spec


def test_prefill_chunks_chart_median_and_prediction(sweep):
    """The band and rule are the range and median of the full chunks' tokens/s; the dashed line is each chunk's
    speed predicted from its FLOPs at the median FLOP rate, so it passes through the median-rate chunk."""
    from ds4lab.costs import chunk_cost, file_types
    from ds4lab.viz.charts import prefill_chunks_chart

    model, runs = sweep
    chunks = runs[16][0]
    layers = prefill_chunks_chart(chunks, model).to_dict()["layer"]
    band, rule, points, line = (layer["data"]["values"] for layer in layers)
    speeds = [c.tokens_per_s for c in chunks]  # 80 tokens in 5 chunks of 16
    assert band == rule and band[0]["median"] == pytest.approx(np.median(speeds), rel=1e-12)
    assert (band[0]["low"], band[0]["high"]) == (min(speeds), max(speeds))
    assert [p["tokens_per_s"] for p in points] == speeds
    # a chunk's positions as the tables write them (its tooltip read "start 16, end 32" for positions 16-31)
    assert [p["positions"] for p in points] == [f"{16 * i}–{16 * i + 15}" for i in range(5)]
    flops = np.array([chunk_cost(model.config, c.start, c.n_tokens, file_types(model.file), ctx=80).total_flops
                      for c in chunks], dtype=np.float64)
    rates = flops / np.array([c.seconds for c in chunks])
    predicted = np.array([p["predicted"] for p in line])
    assert predicted == pytest.approx(16 * np.median(rates) / flops, rel=1e-12)
    assert [p["gflop"] for p in line] == pytest.approx(flops / 1e9, rel=1e-12)


def test_prefill_chunks_chart_leaves_warm_up_chunks_out(sweep):
    """``warmup=2``: the first two chunks are hollow points of their own, and the band, the median and the FLOP rate
    come from the other three alone."""
    from ds4lab.costs import chunk_cost, file_types
    from ds4lab.viz.charts import prefill_chunks_chart

    model, runs = sweep
    chunks = runs[16][0]
    layers = prefill_chunks_chart(chunks, model, warmup=2).to_dict()["layer"]
    band, rule, points, hollow, line = (layer["data"]["values"] for layer in layers)
    speeds = [c.tokens_per_s for c in chunks]
    assert band[0]["median"] == pytest.approx(np.median(speeds[2:]), rel=1e-12)
    assert (band[0]["low"], band[0]["high"]) == (min(speeds[2:]), max(speeds[2:]))
    assert [p["tokens_per_s"] for p in points] == speeds[2:] and [p["tokens_per_s"] for p in hollow] == speeds[:2]
    assert layers[3]["mark"]["filled"] is False and {p["run"] for p in hollow} == {"warm-up"}
    notes = prefill_chunks_chart(chunks, model, warmup=2).to_dict()["title"]["subtitle"]
    assert notes[:2] == ["band: range of the 16-token chunks; rule: median",
                         "hollow: chunks 0-1 (warm-up), left out of the band and the rate"]
    # no model, no rate; every chunk a warm-up, no band
    assert prefill_chunks_chart(chunks, warmup=2).to_dict()["title"]["subtitle"][1] == (
        "hollow: chunks 0-1 (warm-up), left out of the band")
    all_warm = prefill_chunks_chart(chunks, model, warmup=5).to_dict()["title"]["subtitle"]
    assert all_warm == ["hollow: chunks 0-4 (warm-up)"]
    flops = np.array([chunk_cost(model.config, c.start, c.n_tokens, file_types(model.file), ctx=80).total_flops
                      for c in chunks], dtype=np.float64)
    rate = np.median(flops[2:] / np.array([c.seconds for c in chunks[2:]]))
    assert [p["predicted"] for p in line] == pytest.approx(16 * rate / flops, rel=1e-12)
    with pytest.raises(ValueError, match="warmup is 6: it must be between 0 and the 5 chunks"):
        prefill_chunks_chart(chunks, model, warmup=6)


def test_prefill_cost_chart(sweep):
    """Measured: every repeat's total seconds, their median and range per chunk size; predicted: the prefill's
    GFLOP and weight MiB from ds4lab.costs (chunks of 40 read the weights 2 times, chunks of 16 5 times)."""
    from ds4lab.costs import file_types, prefill_costs
    from ds4lab.viz.charts import prefill_cost_chart

    model, runs = sweep
    types = file_types(model.file)
    spec = prefill_cost_chart(runs, model).to_dict()
    times, costs = spec["hconcat"]
    spread, _, measured = (layer["data"]["values"] for layer in times["layer"])
    for chunk, repeats in runs.items():
        seconds = [sum(c.seconds for c in chunks) for chunks in repeats]
        assert [m["seconds"] for m in measured if m["chunk"] == str(chunk)] == seconds
        row = next(r for r in spread if r["chunk"] == str(chunk))
        assert (row["median"], row["low"], row["high"]) == (np.median(seconds), min(seconds), max(seconds))
    values = {(r["chunk"], r["measure"]): r["value"] for r in costs["data"]["values"]}
    for chunk in runs:
        cs = prefill_costs(model.config, 80, chunk, types, ctx=80)
        assert values[str(chunk), "predicted: GFLOP"] == pytest.approx(sum(c.total_flops for c in cs) / 1e9, rel=1e-12)
        assert values[str(chunk), "predicted: weights read (MiB)"] == sum(c.weight_bytes for c in cs) / 2**20
    assert values["16", "predicted: weights read (MiB)"] > 2 * values["40", "predicted: weights read (MiB)"]
    with pytest.raises(ValueError, match="chunk size 8 has no prefill"):
        prefill_cost_chart({8: []}, model)


def test_concat_is_flat_and_numpy_values_are_json(monkeypatch):
    """a | b | c is one row of three (as in Altair), a titled row stays whole; NumPy scalars in the rows become
    Python numbers; the PNG is drawn with vl-convert's newest Vega-Lite 5, the spec's version."""
    from ds4lab.viz.charts import batch_copies_chart
    from ds4lab.viz.vegalite import Chart, _png, unit

    a, b, c = (Chart(unit([dict(x=np.int64(i), y=np.float32(0.5))], "point")) for i in range(3))
    assert json.loads(json.dumps(a.to_dict()))["data"]["values"] == [dict(x=0, y=0.5)]
    assert [s["data"]["values"][0]["x"] for s in (a | b | c).to_dict()["hconcat"]] == [0, 1, 2]
    assert len((a & b & c).to_dict()["vconcat"]) == 3
    titled = (a | b).properties(title="t")
    assert len((titled | c).to_dict()["hconcat"]) == 2
    rows = [dict(chunk=np.int64(16), switches=np.int64(2), bytes=np.int64(4096), seconds=np.float64(0.1))]
    json.dumps(batch_copies_chart(rows).to_dict())
    json.dumps(batch_copies_chart([]).to_dict())  # no chunk size yet: empty panels, not max() of nothing
    # the time panel only where every row was timed (copies within a CPU's memory time noise: notebook 05 leaves it out)
    def titles(rows):
        return [p["title"] for p in batch_copies_chart(rows).to_dict()["hconcat"]]

    untimed = [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert len(titles(rows)) == 3 and titles(untimed) == titles(rows)[:2]
    assert titles([rows[0] | {"seconds": 0}]) == titles(rows)  # a copy timed at 0 is still timed
    vlc = pytest.importorskip("vl_convert")
    seen = {}
    monkeypatch.setattr(vlc, "vegalite_to_png", lambda spec, **kw: seen.update(kw) or b"png")
    assert _png(a.to_dict()) == b"png"
    fives = [v for v in vlc.get_vegalite_versions() if v.startswith("5.")]
    assert seen["vl_version"] == max(fives, key=lambda v: tuple(map(int, v.split("."))))


def test_kv_cache_chart_tells_its_lines_apart_by_dash_as_well(charts):
    """The shared row's and MLA's lines lie within 12% of each other on the log axis (a student saw one line): each
    scheme has a dash pattern as well as a colour, in one legend: Vega-Lite merges the two channels' legends where
    field, title, domain and legend agree (with a sort alone it drew a second legend of black dots)."""
    from ds4lab.kv.sizes import SCHEMES

    enc = charts["kv_cache_chart"].to_dict()["layer"][0]["encoding"]
    assert enc["strokeDash"]["field"] == enc["color"]["field"] == "scheme"
    assert enc["strokeDash"]["title"] == enc["color"]["title"] and enc["strokeDash"]["legend"] == enc["color"]["legend"]
    assert enc["strokeDash"]["scale"]["domain"] == enc["color"]["scale"]["domain"] == list(SCHEMES)
    vlc = pytest.importorskip("vl_convert")
    vega = vlc.vegalite_to_vega(charts["kv_cache_chart"].to_dict())
    assert len(vega["legends"]) == 1 and {"stroke", "strokeDash"} <= set(vega["legends"][0]), vega["legends"]


def test_kv_cache_chart_names_every_cache_at_the_context_hovered(charts):
    """Hovering the KV cache chart names every cache's size at the context nearest the pointer (a rule's tooltip
    from the rows pivoted by scheme): the shared row's points lie under MLA's, so their own tooltips never showed."""
    from ds4lab.kv.sizes import SCHEMES

    spec = charts["kv_cache_chart"].to_dict()
    lines, rule, *names = spec["layer"]
    # and each line named once at its end (the largest context)
    named = [n["transform"][0]["filter"]["and"][1]["oneOf"] for n in names]
    assert sorted(sum(named, [])) == sorted(SCHEMES) and all(n["mark"]["type"] == "text" for n in names)
    assert "tooltip" not in lines["encoding"] and rule["mark"]["type"] == "rule"
    assert [t["field"] for t in rule["encoding"]["tooltip"]] == ["tokens", *SCHEMES]
    assert rule["transform"] == [{"pivot": "scheme", "value": "gib", "groupby": ["tokens"]}]
    vlc = pytest.importorskip("vl_convert")
    vega = json.dumps(vlc.vegalite_to_vega(spec)["marks"])  # compiled, the marks' tooltip reads the pivot's fields
    assert all(f'"{s} (GiB)\\": ' in vega for s in SCHEMES), vega[:2000]
