# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Tiers: splitting the layers over devices
#
# A **placement** maps the embedding, every layer and the output head to a tier (a device). Whenever the
# next unit lives on another tier, the hidden state moves, in one of three modes:
#
# - **decode**: one token's hidden state, `n_hc × n_embd` floats (4 × 256 here; 4 × 4096 in Flash);
# - **batch**: the whole chunk's hidden states, `chunk × n_hc × n_embd`, once per tier boundary per chunk;
# - **no-copy**: only the active tier changes; at the start of a step (the embedding is computed on its own
#   tier, nothing is carried over) and between tiers that share a device.
#
# Every switch is recorded. Without `devices`, tiers are *logical*: each is its own device, a switch makes
# a real copy and the bytes are real; with MLX, `devices=["cpu", "gpu"]` runs layers on each device's
# stream. (ds4 itself runs one device per process; these switches are ds4lab's, to show what a split of
# the layers over devices moves.) Results never depend on the plan.

# %%
import sys

if sys.platform == "emscripten":  # JupyterLite: ds4lab and the views' packages from this site
    import piplite

    await piplite.install(["ds4lab", "anywidget"])

# %% tags=["nbval-check-output"]
import numpy as np

import ds4lab
from ds4lab.texts import coriolanus

model = ds4lab.load(backend="numpy")  # the embedded model on the float64 reference backend

prompt = coriolanus(532)  # the first 532 characters of Coriolanus's opening scene
print(prompt[:60] + " …")
ids = model.tokenizer.encode(prompt)
print(len(ids), "prompt tokens")

# %% [markdown]
# ## Plans
#
# `Placement.even(n)` cuts the layers into equal contiguous runs; `Placement.by_memory(budgets)` sizes the
# runs in proportion to each tier's byte budget (weights and KV, as llama.cpp's tensor split does), and
# checks that each tier fits; `Placement([...])` places every layer explicitly: here alternating, the
# worst plan, with a boundary after every layer. A session resolves its plan against the model and its KV
# arrays:

# %% tags=["nbval-check-output"]
from ds4lab import Placement
from ds4lab.text_table import plural
from ds4lab.tiers import unit_name

plans = {
    "single": Placement.single(),
    "even(2)": Placement.even(2),
    "by_memory": Placement.by_memory([16 << 20, 8 << 20]),
    "alternating": Placement([0, 1, 0, 1, 0, 1]),
}
sessions = {name: model.session(ctx=256, prefill_chunk=64, placement=p)
            for name, p in plans.items()}
for s in sessions.values():
    print(s.placement, end="\n\n")

# %% [markdown]
# In each tier's row, `activations` is the chunk's hidden-state buffer that a tier running anything must hold,
# whatever its layers. The weights and KV bytes come per unit; here those of `by_memory`. A unit's KV is what
# the session allocates for it on its device: the whole ring (256 slots) and room for the compressed rows, in
# the backend's float type (float64 here). A checkpoint (notebook 03) saves only the rows in use, as float32:
# layer 0 there is 64 rows × 128 × 4 B = 32,768 bytes, here 256 slots × 128 × 8 B = 262,144.

# %% tags=["nbval-check-output"]
for row in sessions["by_memory"].placement.table():
    print(f"{row['unit']:>8}: tier {row['tier']} ({row['device']}), "
          f"weights {row['weights']:>9,}, KV {row['kv']:>7,}")

# %% [markdown]
# ## Run and trace
#
# Prefill the prompt (3 chunks) and decode 4 tokens greedily on every plan. `sess.tier_trace` holds every
# switch: the step, the unit about to run (−1 the embedding, 6 the head), the tiers, the mode, the bytes and
# the seconds; each `PrefillChunk` and `DecodeStep` carries its own.

# %% tags=["nbval-check-output"]
results = {}
for name, s in sessions.items():
    chunks = s.prefill(ids).run(progress=False)
    steps = list(s.decoder(temperature=0).stream(4))
    results[name] = (s.logits.copy(), [step.token for step in steps], chunks, steps)

def per_step(s):
    for step in sorted({sw.step for sw in s.tier_trace}):
        sws = [sw for sw in s.tier_trace if sw.step == step]
        counts = {m: sum(sw.mode == m for sw in sws) for m in ("no-copy", "batch", "decode")}
        modes = ", ".join(f"{m} ×{n}" for m, n in counts.items() if n)
        moved = sum(sw.bytes for sw in sws)
        print(f"step {step}: {plural(len(sws), 'switch', 'switches')} ({modes}), {moved:>9,} bytes")

per_step(sessions["alternating"])

# %% tags=["nbval-check-output"]
for sw in [sw for sw in sessions["alternating"].tier_trace if sw.step in (2, 3)]:
    unit = unit_name(sw.layer, model.config.n_layer)
    print(f"step {sw.step}, before {unit:8}: tier {sw.from_tier} -> {sw.to_tier}  "
          f"{sw.mode:8} {sw.bytes:>8,} bytes")

# %% [markdown]
# `TierView` draws a session's plan and trace: the layer stack coloured by tier, the last step's switches,
# and the bytes of every step against the two bounds, a full chunk per boundary (batch) and one token per
# boundary (decode). With `follow=True` it redraws after every step of its session (decode another token in a
# new cell and watch): its greyed button reads "following" meanwhile, and becomes "refresh" once `detach()` stops
# that; a view made without `follow` redraws when its button is clicked or `refresh()` is called.

# %%
from ds4lab.viz import TierView

TierView(sessions["alternating"], follow=True)

# %% [markdown]
# Step 2 is the last prefill chunk (tokens 128–155: 28 rows of 4 × 256 float64 values, 8,192 bytes each),
# step 3 the first decoded token (one row). Each step after the first starts with a no-copy switch back to
# the embedding's tier. With `even(2)` there is one boundary:

# %% tags=["nbval-check-output"]
per_step(sessions["even(2)"])
chunk_bytes = [c.tier_bytes for c in results["even(2)"][2]]
token_bytes = [s.tier_bytes for s in results["even(2)"][3]]
print("bytes per prefill chunk:", chunk_bytes, "| per decoded token:", token_bytes)

# %% [markdown]
# ## Bytes moved vs chunk size
#
# In batch mode each token's hidden state crosses each boundary once, whatever the chunk size: the chunk
# size sets how many copies carry those bytes, not how many bytes there are. Smaller chunks mean more
# switches, each with its own latency: on two GPUs a transfer and a synchronisation. Here both tiers are
# this CPU and a copy is a memcpy (96 KiB to 1.2 MiB here), whose microseconds are mostly noise: the same sweep
# ran its largest chunk fastest on one run and slowest on the next, so the chart leaves time out.

# %% tags=["nbval-check-output"]
CHUNKS = (16, 64, 256)  # the full sweep: (8, 16, 32, 64, 128, 256)
sweep = []
for chunk in CHUNKS:
    # the even(2) session above prefilled with chunks of 64 (its decode steps copy in "decode" mode)
    if chunk == 64:
        s = sessions["even(2)"]
    else:
        s = model.session(ctx=256, prefill_chunk=chunk, placement=Placement.even(2))
        s.prefill(ids).run(progress=False)
    copies = [sw for sw in s.tier_trace if sw.mode == "batch"]
    sweep.append(dict(chunk=chunk, switches=len(copies), bytes=sum(sw.bytes for sw in copies)))
    copied = plural(len(copies), "batch copy", "batch copies")
    print(f"chunk {chunk:3d}: {copied:>16}, {sweep[-1]['bytes']:,} bytes "
          f"= {len(ids)} tokens × {sweep[-1]['bytes'] // len(ids):,}")

# %%
from ds4lab.viz.charts import batch_copies_chart

batch_copies_chart(sweep)

# %% [markdown]
# ## Results do not depend on the plan
#
# The same logits, to the bit, and the same tokens on every plan: a switch moves the hidden state, it
# never changes it.

# %% tags=["nbval-check-output"]
ref_logits, ref_tokens, _, _ = results["single"]
for name, (logits, tokens, _, _) in results.items():
    same = np.array_equal(logits, ref_logits)
    print(f"{name:12} logits bit-identical: {same}, same tokens: {tokens == ref_tokens}")
