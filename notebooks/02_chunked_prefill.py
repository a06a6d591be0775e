# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chunked prefill, step by step
#
# A prompt is evaluated in **chunks**: each step runs every layer over up to `prefill_chunk` tokens,
# writing their KV rows, and the next chunk attends to what the earlier ones left in the cache. ds4 does
# this on GPUs with chunks of 2048 tokens (`DS4_METAL_PREFILL_CHUNK`; 4096 in its later versions): the graph's
# batch buffers are sized for one chunk, so memory does not grow with the prompt. Three rules make chunking
# invisible in the results:
#
# 1. **Chunks end on absolute multiples of the chunk size.** A prefill resumed at token 3000 with chunk
#    2048 runs 3000–4095 first, so compressed rows are finished on the same schedule as in a cold prompt.
# 2. **The raw ring holds the window before the chunk plus the whole chunk**:
#    `raw_cap = align_up(min(window + chunk, ctx), 256)` slots; position `p` goes to slot `p mod raw_cap`.
# 3. **Compressors carry their pending group across chunks**: the tokens of an unfinished group wait in
#    the compressor's state until the group's last token arrives, in this chunk or a later one.
#
# We step through a prefill with `PrefillView`, draw what each query of a chunk can see with `MaskView`,
# watch the ring and the compressors in `KVCacheView`, compare chunk sizes (measured time beside the work
# `ds4lab.costs` counts), and check that chunked and one-shot prefills give the same logits and KV arrays.
# The charts are Vega-Lite specs: JupyterLab draws them with the Vega it ships (no network), and a saved
# notebook keeps a PNG of each.

# %%
import sys

if sys.platform == "emscripten":  # JupyterLite: ds4lab and the views' packages from this site
    import piplite

    await piplite.install(["ds4lab", "anywidget"])

# %% tags=["nbval-check-output"]
import numpy as np

import ds4lab
from ds4lab.texts import coriolanus
from ds4lab.viz import KVCacheView, MaskView, PrefillView
from ds4lab.viz.charts import kv_bytes_chart, prefill_chunks_chart

model = ds4lab.load(backend="numpy")
cfg = model.config
print("compression ratio per layer:", [cfg.ratio(il) for il in range(cfg.n_layer)],
      "| window", cfg.swa)

# %% tags=["nbval-check-output"]
prompt = coriolanus(1000)  # the first 1,000 characters of Coriolanus's opening scene
print(prompt[:60] + " …")
ids = model.tokenizer.encode(prompt)
sess = model.session(ctx=512, prefill_chunk=64)
print(len(ids), "prompt tokens;", sess.geometry)

# %% [markdown]
# With a 64-token window and chunks of 64, the ring needs 128 slots, rounded up to 256. `comp_cap` is the
# capacity of the compressed arrays: `ctx / 4 + 2` rows.
#
# ## Step through the prefill
#
# `PrefillView` wraps `sess.prefill(ids)`: nothing runs until `step()` (or its *step* button). It keeps, for
# every chunk, the checkpoint after it and the compressed rows the indexer kept, so that it can show any chunk
# again. Here we step it from code and look at snapshots (a view shows the state of the cell that made it);
# the stepper itself is displayed once the prefill is done.

# %% tags=["nbval-check-output"]
prefill_view = PrefillView(sess, ids)
planned = ", ".join(f"{a}-{b - 1}" for a, b in prefill_view.prefill.chunk_bounds())
print(len(prefill_view.prefill), "chunks planned:", planned)

def show(chunk):  # two lines a chunk: each fits a notebook at laptop width
    comp = ", ".join(f"layer {il} +{r['comp']}" for il, r in chunk.rows.items() if cfg.ratio(il))
    print(f"tokens {chunk.start}-{chunk.end - 1}: {chunk.n_tokens} raw rows per layer; "
          f"KV {chunk.kv_bytes:,} bytes")
    print(f"  compressed rows: {comp}")

show(prefill_view.step())


# %% [markdown]
# The first chunk wrote 64 raw rows in every layer and 16 compressed rows in each ratio-4 layer (one per 4
# tokens), but none in the ratio-128 layers: their first group closes at token 127.
#
# ## What a chunk's queries see
#
# The picture of a chunk in one layer: a row per query of the chunk, a column per key it could read — the raw
# rows earlier chunks left in the ring, the chunk's own rows (under an orange bar: written by this step, as the
# ring's orange arc marks them), the compressed rows, and the sink (a logit with no value). In chunk 0 of layer 2
# (ratio 4) the own rows form the causal triangle (a query never sees a later position), and a compressed row
# becomes visible from the query that completes its group of 4 tokens on. Hover a cell: it says why the key is or is
# not visible.

# %%
MaskView.of_step(sess, 2, 0, 64, label="chunk 0")

# %% [markdown]
#
# ## The raw ring
#
# Every layer's raw rows live in a ring of `raw_cap` slots. A query at position `q` attends the raw rows
# of positions `q − 63 … q` (the window, itself included). The ring is bigger than the window so that a
# chunk can be written whole while the window before it is still readable.

# %% tags=["nbval-check-output"]
def ring(sess):
    g, T = sess.geometry, len(sess.tokens)
    first, visible = max(0, T - g.raw_cap), max(0, T - g.window)
    slots = f"{visible % g.raw_cap}-{(T - 1) % g.raw_cap}"
    print(f"{T} tokens: the ring holds positions {first}-{T - 1}; "
          f"the last token's window is {visible}-{T - 1}, in slots {slots}")
    print(f"  layer 0's window: {sess.kv[0].raw_positions[0]}-{sess.kv[0].raw_positions[-1]}")

ring(sess)

# %% tags=["nbval-check-output"]
for _ in range(2):
    if not prefill_view.prefill.remaining:  # this cell run again after the prefill was finished
        print("every chunk is run: run the cells from the one that made sess to start again")
        break
    show(prefill_view.step())
ring(sess)
# the view's slider: the chunks so far, orange what one wrote; the indexer's picks from prefill_view
KVCacheView(sess, checkpoints=prefill_view.chunks, indexer=prefill_view.picked_rows)

# %% [markdown]
# The second chunk ended at token 127: the ratio-128 layers (3 and 5) finished their first row, which pools
# tokens 0–127. After the third chunk the window holds 128–191 only: tokens before 128 are no longer
# visible as raw rows, though the ring still stores them until positions 256 and later overwrite their slots.
# The ring above shows it: 256 slots, positions 0–191 written, the window the last 64 of them.
#
# In the mask of chunk 2 (tokens 128–191) of a raw-only layer, each query sees the last 64 positions: part
# from the rows earlier chunks cached in the ring, part from the chunk's own rows.

# %%
MaskView.of_step(sess, 0, 128, 64, label="chunk 2")

# %% [markdown]
#
# ## The compressors' pending state
#
# A ratio-R compressor scores each token and, when a group of R tokens is complete, pools it (a softmax over
# the group's tokens, per channel) into one row. Until then the group's projections wait in the pending
# state, which is part of the KV state and of a saved checkpoint. The ratio-4 compressor overlaps its
# groups: row `c` pools tokens `4c−4 … 4c+3`, so its state holds 8 rows, the previous group's 4 and the
# current one's (each twice as wide: the two halves feed the two groups).

# %% tags=["nbval-check-output"]
T = len(sess.tokens)
for il in (2, 3):
    lk = sess.kv[il]
    kv, score = lk.comp_pending
    rows = f"{lk.n_comp} row{'s' * (lk.n_comp != 1)}"
    print(f"layer {il} (ratio {lk.ratio}): {rows} finished, {T % lk.ratio} tokens pending")
    print(f"  pending state: kv {kv.shape}, score {score.shape}")

# %% [markdown]
# ## Finish and chart
#
# `run()` steps through the remaining chunks. Then the stepper: its slider shows any chunk again, without
# touching the session. The prompt box scrolls to the chunk; under it, side by side, the KV cache after that
# chunk (the raw ring as a ring buffer of 256 slots, orange: what the chunk wrote, the write pointer where the
# next position goes; "key" under the ring unfolds the colours) and what each query of the chunk could see in
# the layer picked. Chunk 4 (tokens 256–319) wraps the
# ring: positions 0–63 are overwritten. From position 131 a query of a ratio-4 layer sees more than 32
# compressed rows: the indexer keeps 32 of them (green, as every compressed row; raw rows are blue) and drops
# the rest (salmon).

# %% tags=["nbval-check-output"]
prefill_view.run()
for chunk in prefill_view.chunks:
    show(chunk)

# %%
prefill_view

# %% [markdown]
# Its *step* and *run* buttons are off: this prefill is done. To click through one yourself, give the view a
# fresh session and the same prompt: *step* runs the next chunk, *run* the rest.

# %%
PrefillView(model.session(ctx=512, prefill_chunk=64), ids)

# %%
(kv_bytes_chart(sess, prefill_view.chunks)
 | prefill_chunks_chart(prefill_view.chunks, model, warmup=1))

# %% [markdown]
# The points are the chunks' states; the lines count the same bytes from the layout, from no token to the
# session's context (dashed past the prompt). Raw-only layers stop growing once the window is full; ratio-4 layers
# grow by one row (plus one indexer row) per 4 tokens, ratio-128 layers by one row per 128. Yet the ratio-128 line
# is the highest, and nearly flat at about 330 KB for its two layers: besides its 64 raw rows (32 KiB), each
# ratio-128 layer keeps the pending state of a 128-token window, the kv and score projections (128 values each,
# float32) of up to 128 tokens waiting for their group to close, 128 KiB a layer before the first token (the line
# starts at 256 KiB at 0 tokens); a finished row adds only 512 bytes. A ratio-4 layer's pending state is 8 rows
# (32 KiB with the indexer's), but its rows grow 1 KiB per 4 tokens, so from about 390 tokens, past this prompt,
# the ratio-4 layers hold more: the dashed lines cross there.
#
# On the right, each chunk's tokens/s. Chunk 0 (hollow) is the process's first step: it dequantizes the weights
# it uses, which later steps reuse, so it is left out. The other chunks of one size do the same work, so their
# spread is the machine's noise: the band is their range, the rule their median. The dashed line is each chunk's
# speed predicted from its FLOPs (`ds4lab.costs`) at the median rate. On a small, busy machine (a 2-core laptop or
# CI box) the band can span a factor of three and hide the dashed line: compare the rule with it, and rerun the cell
# when the machine is idle for a narrower band.
#
# ## Compare chunk sizes
#
# The same prompt with chunk sizes that do and do not divide the compression ratios, and one chunk for the
# whole prompt (`prefill_chunk=512`): 30 (divides neither 4 nor 128), 64, and the one-shot 512. The stepped
# prefill above is no measure of chunks of 64 (its first chunk warmed the process up, and each step captured the
# indexer's choice), so every size gets fresh sessions: one untimed round first, then `REPEATS` timed rounds,
# the sizes taking turns so that a change in the machine's load falls on all of them; the median is the
# measure. About 12 prefills, a few seconds on a CPU. For the full sweep, set `CHUNKS = (16, 30, 64, 100, 512)`.

# %% tags=["nbval-check-output"]
CHUNKS, REPEATS = (30, 64, 512), 3
runs = {chunk: [] for chunk in CHUNKS}  # chunk size -> the chunks of each timed prefill
sessions = {}  # chunk size -> its last session, for the comparison below
for repeat in range(1 + REPEATS):
    for chunk in CHUNKS:
        s = model.session(ctx=512, prefill_chunk=chunk)
        chunks = s.prefill(ids).run(progress=False)
        if repeat:  # round 0 is the warm-up
            runs[chunk].append(chunks)
        sessions[chunk] = s
for chunk, s in sessions.items():
    chunks = runs[chunk][-1]
    bounds = ", ".join(f"{c.start}-{c.end - 1}" for c in chunks[:4])
    bounds += ", …" if len(chunks) > 4 else ""
    print(f"chunk {chunk:3d}: raw ring {s.geometry.raw_cap} slots, {len(chunks):2d} step(s): "
          f"{bounds}")
print(f"timed: {REPEATS} fresh prefills of each size, after one untimed round")

# %%
from ds4lab.viz.charts import prefill_cost_chart

medians = {chunk: float(np.median([sum(c.seconds for c in chunks) for chunks in repeats]))
           for chunk, repeats in runs.items()}
print(f"median of {REPEATS} prefills:",
      ", ".join(f"chunk {chunk}: {t:.2f} s" for chunk, t in medians.items()))
one = max(medians)  # the chunk size that takes the prompt in one chunk
gaps = {chunk: t - medians[one] for chunk, t in medians.items() if chunk != one}
print(f"behind one chunk of {one}:",
      ", ".join(f"chunk {chunk}: {gap:+.2f} s" for chunk, gap in gaps.items()))
prefill_cost_chart(runs, model)

# %% [markdown]
# Measured time moves with the machine; the counted work does not. The FLOPs hardly depend on the chunk size,
# but every chunk reads every weight once, so small chunks read the weights many more times. On the 2-core CPU
# these notebooks were written on, every run put the 11 chunks of 30 clearly slowest: 0.12–0.24 s behind one chunk
# of 512 on an idle machine, up to twice that with a browser and other work beside it (this run's gap is printed
# above): idle, some 12–24 ms for each of the 10 chunks more, on top of the same 4.3 GFLOP (a pass over the
# weights, and the Python calls of every layer). Between 64 and 512 (4 chunks more) the gap was about the spread between runs,
# so either may come out ahead. On a busy machine the ranges grow, and can overlap.
#
# ### At Flash scale
#
# The same counts for the real model's dimensions and its weights as the q2 file stores them (the routed experts
# in 2-bit blocks, the rest 8-bit or 16-bit): a chunk of 2048 tokens at position 32768, then one decode step.
# FLOP/byte is the step's arithmetic over the bytes it reads: a GPU needs some hundreds of them to be bound by
# its arithmetic rather than by its memory, so the chunk is compute-bound and the decode step memory-bound.

# %% tags=["nbval-check-output"]
from ds4lab.costs import PARTS, flash_table

for r in flash_table():  # lines under 100 characters: a notebook at laptop width wraps none of them
    print(f"{r['step']}: {r['GFLOP']:,.1f} GFLOP ({r['GFLOP_per_token']:.1f} a token), "
          f"{r['flop_per_byte']:.1f} FLOP/byte")
    print(f"  weights read {r['weights_GiB']:.2f} GiB, "
          f"KV written {r['kv_written_MiB']:.2f} MiB; GFLOP by part:")
    parts = [f"{p} {r[p + ' GFLOP']:,.1f}" for p in PARTS]
    print("    " + ", ".join(parts[:4]) + ",\n    " + ", ".join(parts[4:]))


# %% [markdown]
# What the compression buys at that scale: the cache DS4 keeps against the caches a model of the same shape would
# keep with dense attention (one row per token and layer for every head (MHA), for 8 shared heads (GQA), for one
# latent row (MLA), or one shared row as DS4's raw window has, but for every token), from 1K to 1M tokens
# (`ds4lab.kv.sizes` says how each is counted; 2 bytes a value):

# %%
from ds4lab.viz.charts import kv_cache_chart

kv_cache_chart(ds4lab.FLASH)

# %% [markdown]
# ## Chunked == one-shot
#
# Every KV array the sessions hold (raw window, compressed rows, indexer rows, and the compressors'
# pending kv and score) and the logits for the next token, against the one-shot prefill:

# %% tags=["nbval-check-output"]
def kv_arrays(s):
    out = {}
    for lk in s.kv:
        out[f"{lk.layer}.raw"] = lk.raw
        for name in ("comp", "index"):
            if getattr(lk, name) is not None:
                out[f"{lk.layer}.{name}"] = getattr(lk, name)
        for name in ("comp_pending", "index_pending"):
            if getattr(lk, name) is not None:
                out[f"{lk.layer}.{name}.kv"], out[f"{lk.layer}.{name}.score"] = getattr(lk, name)
    return out

one = sessions[512]
ref = kv_arrays(one)
compared = [(f"chunk {chunk:3d}", s) for chunk, s in sessions.items()]
for name, s in [*compared, ("chunk  64, stepped", sess)]:
    arrays = kv_arrays(s)
    d_logits = np.abs(s.logits - one.logits).max()
    d_kv = max(np.abs(arrays[k] - ref[k]).max() for k in ref)
    print(f"{name}: max |Δ logits| = {d_logits:.1e}, "
          f"max |Δ KV| over {len(ref)} arrays = {d_kv:.1e}")

# %% [markdown]
# Zero: each token's computation reads only its own row and the cache, so how the prompt is cut changes
# the order of work, not the numbers (on a float32 GPU backend the same comparison agrees to rounding).
# The last row is the session we stepped through chunk by chunk above: it agrees too.

# %% [markdown]
# ## Resuming a prefill
#
# When a prompt extends the live tokens, only the new tokens are evaluated, and the first chunk stops at
# the next multiple of the chunk size. Here a session holds the first 200 tokens and is extended to the
# whole prompt with chunks of 64: 200–255, then 256–319.

# %% tags=["nbval-check-output"]
s = model.session(ctx=512, prefill_chunk=64)
# tokens 0-191 from the stepped prefill, rather than run them again
s.restore(prefill_view.chunks[2].checkpoint)
s.prefill(ids[:200]).run(progress=False)
resumed = s.prefill(ids).run(progress=False)
print([(c.start, c.end) for c in resumed])
print(f"max |Δ logits| against one-shot = {np.abs(s.logits - one.logits).max():.1e}")

# %% [markdown]
# ## A decode step is a chunk of one query
#
# After the prompt, each generated token is a step of one query at the next position: it sees the last 64 raw
# rows (itself included), every compressed row whose group has closed, and in a ratio-4 layer only the 32 the
# indexer keeps. A capture of `indexer.topk` says which.

# %%
# a copy of the prefilled session: sess stays as the cells above compared it, however often this
# cell runs
step = model.session(ctx=512, prefill_chunk=64)
step.restore(sess.snapshot())
with step.capture(["indexer.topk"], layers=[2]) as cap:
    step.decoder(temperature=0).step()
MaskView.of_step(step, 2, len(step.tokens) - 1, 1, cap["blk.2.indexer.topk"], label="a decode step")
