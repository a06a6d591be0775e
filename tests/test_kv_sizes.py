"""KV cache sizes from the config alone (ds4lab.kv.sizes), checked against a hand count on a small config and
against the bytes of a real session's checkpoint; the chart draws every scheme on log axes."""

from __future__ import annotations

from dataclasses import replace

import pytest

import ds4lab
from ds4lab.config import FLASH, NANO
from ds4lab.kv.payload import HEADER_BYTES
from ds4lab.kv.sizes import SCHEMES, cache_bytes, cache_table, ds4_values

# One layer of each kind, small enough to count by hand: head_dim 8, idx_dim 4, window 4.
TINY = replace(NANO, n_layer=3, compress_ratios=(0, 4, 128), swiglu_clamp=(10.0,) * 3, head_dim=8, idx_dim=4,
               swa=4, n_head=2, n_rot=2)


def test_ds4_values_by_hand():
    # 10 tokens. Raw: min(4, 10) = 4 rows of 8 in each of the 3 layers = 96. Ratio 4: 10 // 4 = 2 rows of 8,
    # the attention compressor's state 2·4 rows of 2·8 (ratio 4 overlaps two windows), 2 indexer rows of 4 and
    # its state 8 rows of 2·4: 16 + 2·128 + 8 + 2·64 = 408. Ratio 128: no row yet, state 128 rows of 8 twice
    # (kv and score): 2048.
    assert ds4_values(TINY, 10) == 96 + 408 + 2048
    b = cache_bytes(TINY, 10, bytes_per_value=4)
    assert b["ds4"] == 4 * (96 + 408 + 2048)
    assert b["shared row"] == 4 * 10 * 3 * 8
    assert b["MLA"] == 4 * 10 * 3 * (8 + 2)
    assert b["GQA"] == 4 * 10 * 3 * 2 * 8 * 8
    assert b["MHA"] == 4 * 10 * 3 * 2 * 2 * 8
    assert [r["scheme"] for r in cache_table(TINY, (10,))] == list(SCHEMES)


def test_ds4_values_are_a_checkpoints_arrays():
    """The count is what a session's DSV4 payload stores (float32: 4 bytes a value) less its header, tokens,
    logits and row counts."""
    model = ds4lab.load(backend="numpy")
    cfg = model.config
    sess = model.session(ctx=1024, prefill_chunk=256)
    ids = model.token_ids("To be, or not to be, that is the question: " * 30).tolist()[:300]
    sess.prefill(ids).run(progress=False)
    payload = len(sess.snapshot().to_bytes())
    assert payload == HEADER_BYTES + 4 * 300 + 4 * cfg.n_vocab + 8 * cfg.n_layer + 4 * ds4_values(cfg, 300)


def test_flash_at_a_million_tokens():
    """The real config at 1M tokens: the compression, not the shared row alone, is what puts DS4 under every
    dense cache (shared row 6.4×, MHA 818× DS4's bytes)."""
    b = cache_bytes(FLASH, 1 << 20)
    assert b["ds4"] < b["shared row"] < b["MLA"] < b["GQA"] < b["MHA"]
    assert b["shared row"] / b["ds4"] == pytest.approx(6.39, abs=0.01)
    assert b["MHA"] / b["ds4"] == pytest.approx(817.9, abs=0.1)


def test_the_chart_draws_every_scheme_on_log_axes():
    from ds4lab.viz.charts import kv_cache_chart

    spec = kv_cache_chart(FLASH).to_dict()
    enc = spec["layer"][0]["encoding"]  # the lines (the layer after them: the hover's rule)
    assert enc["x"]["scale"]["type"] == "log" and enc["y"]["scale"]["type"] == "log"
    rows = spec["data"]["values"]
    assert {r["scheme"] for r in rows} == set(SCHEMES) and len(rows) == 6 * len(SCHEMES)
    assert all(r["gib"] > 0 for r in rows)


def test_sizes_is_reached_from_the_package_as_the_readme_names_it():
    """``ds4lab.kv.sizes`` after ``import ds4lab`` alone (a fresh process: this one has imported it already); it
    was an AttributeError until the submodule was imported by name."""
    import subprocess
    import sys

    code = "import ds4lab, ds4lab.config as c; print(ds4lab.kv.sizes.cache_bytes(c.FLASH, 1 << 20)['ds4'] > 0)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr[-500:]
