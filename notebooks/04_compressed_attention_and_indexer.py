# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # What each query can see: compressed attention, the indexer and the sink
#
# A DS4 layer has one KV head whose key is also its value (128 floats here, 512 in Flash), and every
# query attends three kinds of columns:
#
# - **raw rows**: the KV rows of the last `swa` tokens, itself included (64 here, 128 in Flash);
# - **compressed rows**: a ratio-4 layer pools every 4 tokens into one row (overlapping: row `c` mixes
#   tokens `4c−4 … 4c+3`), a ratio-128 layer every 128 tokens. Query `q` sees row `c` once the row's last
#   token is in: `(c + 1)·R ≤ q + 1`. A recent token can be both a raw row and part of a compressed row;
# - the **sink**: one learned logit per head, added to the softmax's denominator with no value, so a head
#   can give its attention to nothing.
#
# On ratio-4 layers an **indexer** (a small attention with its own compressed keys: 4 heads × 128 here,
# 64 × 128 in Flash) scores every visible compressed row and keeps the top `idx_topk` (32 here, 512 in
# Flash); the others are masked. It runs only when more rows are visible than that, from token 131 here.
#
# The model calls named hook points while it runs; `sess.capture([...])` records the ones asked for, for
# the selected layers, heads and queries, and materialises attention maps next to the fused computation.

# %%
import sys

if sys.platform == "emscripten":  # JupyterLite: ds4lab and the views' packages from this site
    import piplite

    await piplite.install(["ds4lab", "anywidget"])

# %% tags=["nbval-check-output"]
import textwrap

import numpy as np

import ds4lab
from ds4lab.texts import coriolanus

model = ds4lab.load(backend="numpy")  # the embedded model on the float64 reference backend

prompt = coriolanus(1000)  # the first 1,000 characters of Coriolanus's opening scene
print(prompt[:60] + " …")
ids = model.tokenizer.encode(prompt)
cfg = model.config
ratios = [cfg.ratio(il) for il in range(cfg.n_layer)]
print(len(ids), "tokens; ratios", ratios, "| indexer top-k", cfg.idx_topk)

# %% [markdown]
# Capture the whole prefill for three layers of the three kinds (0: raw only, 2: ratio 4, 3: ratio 128),
# two heads, and every 4th query; and, for every layer, which rows the indexer picked for the last query. The
# session is made here, so that running this cell again captures a fresh prefill (a session that already holds
# the prompt would have nothing to prefill, and nothing to capture):

# %% tags=["nbval-check-output"]
sess = model.session(ctx=512, prefill_chunk=64)
prefill = sess.prefill(ids)
with sess.capture(["indexer.topk"], queries=[len(ids) - 1]) as last:
    with sess.capture(["attn.scores", "attn.out", "indexer.topk", "indexer.scores"],
                      layers=[0, 2, 3], heads=[0, 1], queries=range(0, len(ids), 4)) as cap:
        prefill.run(progress=False)
calls = len({r.step for r in cap.records()})
print(f"captured {len(cap.records())} records over {calls} forward calls (one a chunk):")
points = [name.split(".", 2)[1:] for name in cap.names]  # 'blk.2.attn.out': ['2', 'attn.out']
for il in (0, 2, 3):
    print(f"  layer {il}:", ", ".join(point for layer, point in points if layer == str(il)))

# %% [markdown]
# What the last query reads from, layer by layer: the raw ring (the window is its last 64 positions), the
# compressed rows (green) and the tokens each pools (on the indexer's layers, the ones it did not pick for that
# query salmon), and the indexer's own rows.

# %%
from ds4lab.viz import KVCacheView

KVCacheView(sess, indexer=last)

# %% tags=["nbval-check-output"]
for il in (0, 2, 3):
    print(cap.attention(il))

# %% [markdown]
# Each map's columns are the union of what its queries saw: raw rows by position, compressed rows by index,
# and the sink. Per query, in the ratio-4 layer:

# %% tags=["nbval-check-output"]
amap = cap.attention(2)
queries = list(amap.queries)
for q in (60, 124, 128, 132, 200, 316):
    i = queries.index(q)
    raw = amap.raw_positions[amap.group("raw")[i, 0] > 0]
    seen, kept = amap.candidates[i].sum(), amap.selected[i].sum()
    print(f"query {q:3d}: raw rows {raw.min():3d}-{raw.max():3d} ({len(raw)}); "
          f"compressed rows visible {seen:2d} = ({q} + 1) // 4, attended {kept:2d}")

# %% [markdown]
# Up to query 63 the window holds every earlier token; from 64 on it slides. Query 128 sees 32 compressed
# rows, all of them; query 132 sees 33 and the indexer keeps 32.
#
# `AttentionView` draws the map at a fixed size: queries down, keys across in three groups (raw window |
# compressed rows | sink). Cells are scaled up, and max-pooled only when more than fit at 3 px (the note says by
# how much; a pooled cell shows its largest weight, so a row the indexer dropped for one of its queries shows salmon
# only once you zoom in: the note counts those cells). Colour "per row" shows where each query looks, "log" the small weights; the bar beside each row is
# that query's mass on raw | compressed | sink, and compressed rows the indexer dropped are salmon. Drag on the
# map to zoom in (every cell, with its token; another layer keeps the zoom), double-click to reset; click one of the
# heads' small pictures (beside the map, or under it on a narrower screen) to show that head.

# %%
from ds4lab.viz import AttentionView

AttentionView(cap, layer=2, head=0)

# %% [markdown]
# Zoomed from code: rows and columns are the map's own (its queries are every 4th position, so rows 70–79 are
# queries 280–316), here across the border of the last raw keys and the first compressed rows: a query sees the
# raw keys up to its own position (later ones are grey) and, from 131 on, only the compressed rows the indexer
# kept (dropped ones are salmon). Each row's bar says how its mass splits; the numbers for three of them:

# %% tags=["nbval-check-output"]
zoomed = AttentionView(cap, layer=2, head=0)
zoomed.zoom(queries=(70, 80), keys=(amap.n_raw - 16, amap.n_raw + 24))
for q, (raw, comp, sink) in zip(amap.queries[70:80:4], zoomed.mass_split()[70:80:4]):
    print(f"query {q}: raw {raw:.2f}, compressed {comp:.2f}, sink {sink:.4f}")
zoomed

# %% [markdown]
# ## Where the attention goes
#
# The weights of a query sum to 1 over raw rows, compressed rows and the sink. Averaged over the captured queries
# from position 128 on (where every layer with a compressor has compressed rows to see: the ratio-128 layer's
# first closes at token 127):

# %%
for il in (0, 2, 3):
    a = cap.attention(il)
    late = a.queries >= 128
    mass = {g: a.group(g)[late].sum(-1).mean(0) for g in ("raw", "comp", "sink")}
    for j, h in enumerate(a.heads):
        print(f"layer {il} (ratio {a.ratio:3d}), head {h}: raw {mass['raw'][j]:.2f}, "
              f"compressed {mass['comp'][j]:.2f}, sink {mass['sink'][j]:.2f}")

# %% [markdown]
# ## The indexer's choices
#
# `blk.2.indexer.topk` is the mask the indexer produced, `[queries, compressed capacity]`: the rows each
# query may attend. It is the attention map's selection, and never more than 32 rows:

# %% tags=["nbval-check-output"]
topk = cap["blk.2.indexer.topk"]
scores = cap["blk.2.indexer.scores"]
pos = cap.positions("blk.2.indexer.topk")
print("mask", topk.shape, "scores", scores.shape, "| same as the map's selection:",
      np.array_equal(topk[:, :amap.n_comp], amap.selected), "| most rows kept:", topk.sum(1).max())

# %%
q = len(ids) - 1  # the last query: the one whose picks the KV cache view at the top marks
kept = np.nonzero(last["blk.2.indexer.topk"][0])[0]
dropped = np.setdiff1d(np.arange((q + 1) // 4), kept)
print(f"query {q} keeps {len(kept)} rows:")
print(textwrap.fill(", ".join(map(str, kept)), 100, initial_indent="  ", subsequent_indent="  "))
print(f"and drops {len(dropped)}:")
print(textwrap.fill(", ".join(map(str, dropped)), 100, initial_indent="  ", subsequent_indent="  "))

# %% [markdown]
# The indexer is not a recency rule: it keeps rows from the whole prompt and drops some recent ones (whose
# tokens the raw window covers anyway). The chart shows the choice of every 8th query from position 128 on among the rows it could see:

# %%
from ds4lab.viz.charts import indexer_choices_chart

# every 8th query from 128 on, a cell per visible row
indexer_choices_chart(cap, layer=2, every=8, start=128)

# %% [markdown]
# ## Do the indexer's picks follow the attention?
#
# Let every query attend all its visible compressed rows while the indexer scores them, and add up the weight
# each row gets over the heads. The indexer's **recall** is the share of that weight on its top 32 rows. A
# random top-32 of n rows holds 32/n on average; the 32 heaviest rows (the oracle) are the best any indexer
# can do. The language-model loss sends the indexer no gradient (its choice is discrete), so DeepSeek trains it
# with a loss of its own: the KL divergence from this summed attention to the indexer's softmax. This model's
# indexer was trained that way (`training/train_indexer.py`; the section "The indexer" of the model card,
# `ds4lab/assets/MODEL_CARD.md`), after a few steps that taught the model to put its attention over compressed
# rows on a few of them (before those, it spread it almost evenly: over the model card's 2,000 held-out tokens the 32 heaviest rows held only a third,
# where now they hold 88-92% and a random 32 about 19%). This prompt is short, 320 tokens: a query sees at most
# 80 compressed rows, so even a random 32 of them hold most of the weight (61% below). The indexer's top 32 hold
# nearly all of it, as the oracle does.

# %% tags=["nbval-check-output"]
from ds4lab.evaluate import dense_indexer_pass, top_k_recall

layers, n_visible = dense_indexer_pass(model, ids)
k = cfg.idx_topk
late = n_visible > k
for il, (mass, idx_scores) in layers.items():
    held = top_k_recall(mass, idx_scores, n_visible, k).mean()
    best = top_k_recall(mass, mass, n_visible, k).mean()
    rand = (k / n_visible[late]).mean()
    print(f"layer {il}: the indexer's top-{k} holds {held:.0%} of the attention over compressed")
    print(f"  rows ({late.sum()} queries); a random top-{k} {rand:.0%}, "
          f"the {k} heaviest rows {best:.0%}")

# %% [markdown]
# One query, the prompt's last token, in both ratio-4 layers: a bar per compressed row it sees, its share of the
# attention over them; green where the indexer keeps the row. The tall bars are green. (Each chart's title gives this
# one query's share held by the top 32, lower than the average over every query above.)

# %%
from ds4lab.viz.charts import indexer_mass_chart

q_last = len(ids) - 1
(indexer_mass_chart(layers, n_visible, layer=2, query=q_last, k=k)
 & indexer_mass_chart(layers, n_visible, layer=4, query=q_last, k=k))

# %% [markdown]
# ## Ratio 128: few rows, all visible
#
# Layer 3 has one row for tokens 0–127 and one for 128–255; no indexer. A row becomes visible at the query
# that completes it (127, then 255):

# %% tags=["nbval-check-output"]
a3 = cap.attention(3)
print("rows pool tokens", a3.comp_windows)
for q in (124, 128, 252, 256):
    i = list(a3.queries).index(q)
    print(f"query {q}: sees {a3.candidates[i].sum()} compressed row(s)")

# %% [markdown]
# ## The other half of a layer: experts
#
# After attention, each layer's FFN sends every token to `n_expert_used` of `n_expert` routed experts (2 of
# 8 here, 6 of 256 in Flash) plus a shared one. The first `n_hash_layer` layers (0–2) choose by a fixed
# table indexed by the token id; the others by the router's top-k. `ExpertView` captures
# `blk.{il}.moe.experts` over a prefill and draws tokens per expert, layer by layer; `expert_load_chart`
# is the same as a Vega-Lite heatmap.

# %%
from ds4lab.viz import ExpertView
from ds4lab.viz.charts import expert_load_chart

experts = ExpertView.from_prompt(model.session(ctx=512, prefill_chunk=64), ids)
experts

# %%
expert_load_chart(experts)

# %% [markdown]
# ## The map is the attention the model computed
#
# The map is computed on request from the captured queries and keys; summing `weights · keys` reproduces the
# fused attention output the model used, to rounding:

# %% tags=["nbval-check-output"]
gap = np.abs(amap.output() - cap["blk.2.attn.out"]).max()
print(f"max |Σ weights·keys − attn.out| = {gap:.1e}")
