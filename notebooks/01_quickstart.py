# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Quick start: the embedded model, generation and the KV cache
#
# ds4lab runs the DeepSeek V4 Flash architecture (the model that antirez's C engine
# [ds4](https://github.com/antirez/ds4) runs) in Python you can read and take apart. The package
# embeds a small model of the same architecture (a 17 MB file): 6 layers, 256 wide, a 2048-token vocabulary,
# trained on tinyshakespeare (about 1 MB of Shakespeare's plays). Every mechanism of the 284B model is active in it within a few hundred
# tokens, which makes it a good specimen.
#
# This notebook loads it, looks at its layers, computes next-token probabilities, generates text with a
# session and looks at the KV cache the session keeps. Everything runs on a laptop CPU in seconds.
#
# Saving: JupyterLab saves an open notebook by itself every two minutes (autosave), and keeps the views' live state
# in it only with *Settings → Save Widget State Automatically* checked. Without it, a notebook you ran and open
# again later shows "model not found" where each view was, whether you pressed Save or not, until you run its
# cells again (`git checkout notebooks/` brings back the copies that show every view).

# %%
import sys

if sys.platform == "emscripten":  # JupyterLite: ds4lab and the views' packages from this site
    import piplite

    await piplite.install(["ds4lab", "anywidget"])

# %% tags=["nbval-check-output"]
import numpy as np

import ds4lab

model = ds4lab.load(backend="numpy")  # with no path: the embedded model
model

# %% [markdown]
# `backend="numpy"` is the float64 reference the test suite trusts. The default, `backend="auto"`, picks MLX
# (float32) on Apple GPUs, CuPy on NVIDIA GPUs (MLX where only mlx[cuda] is installed), and NumPy on CPUs, where
# MLX's Linux wheel is slower; these notebooks name NumPy everywhere, so they give the same numbers anywhere.
#
# ## The layers
#
# Every dimension comes from the GGUF file's `deepseek4.*` metadata, so the same code runs the real
# 284B file. A DS4 layer's attention is one of three kinds, set by its **compression ratio**:
#
# - **ratio 0** (layers 0 and 1): only the *raw sliding window*, the KV rows of the last `swa` tokens;
# - **ratio 4**: the window plus one *compressed row* per 4 tokens (row `c` pooling tokens 4c−4 … 4c+3, so
#   neighbouring rows overlap; row 0 pools tokens 0–3 only), and an *indexer*: once a query sees more than
#   `idx_topk` compressed rows, it picks the `idx_topk` of them the query attends;
# - **ratio 128**: the window plus one compressed row per 128 tokens, all of them visible.
#
# A KV row is one vector that serves as both the key and the value of every query head: each layer has one KV
# head, shared by all its query heads (notebook 02's chart of the cache at Flash scale sets what this keeps beside
# MHA's, GQA's and MLA's caches).
#
# The first `n_hash_layer` layers choose their experts from a fixed table indexed by the token id (no router);
# the others by the router's top-k.
#
# Between the layers the hidden state is not one vector but `n_hc` of them (4 *streams*, DeepSeek's
# *hyper-connections*). Before each attention and each FFN a small mixer reads all the streams: the
# sublayer's input is their weighted sum (the *pre* weights), and after it each stream becomes a mix of the
# old streams (an `n_hc × n_hc` matrix made nearly doubly stochastic by Sinkhorn steps) plus the sublayer's
# output scaled by that stream's *post gate*. The head reads the streams at the end
# ([docs/MODEL.md](../docs/MODEL.md), "Hyper-connections and Sinkhorn").

# %% tags=["nbval-check-output"]
cfg = model.config
print(f"{cfg.n_layer} layers, width {cfg.n_embd}, vocab {cfg.n_vocab}, "
      f"raw window {cfg.swa} tokens, indexer top-k {cfg.idx_topk}")
for il in range(cfg.n_layer):
    kind = {0: "raw window only", 4: "ratio 4 + indexer", 128: "ratio 128"}[cfg.ratio(il)]
    routing = "token-id hash" if cfg.is_hash_layer(il) else "router top-k"
    print(f"layer {il}: {kind:<18}  experts by {routing}")

# %% [markdown]
# The real Flash model has 43 layers of the same pattern (0, 0, then 4, 128, 4, 128, …), a window of 128 and
# an indexer top-k of 512. Here the window is 64 and the top-k 32: the window starts evicting at token 64,
# ratio-128 rows appear at tokens 127 and 255, and the indexer starts choosing at token 131, when a query
# first sees 33 ratio-4 rows.
#
# ## Next-token probabilities
#
# `model.logits(ids)` prefills the tokens from zero and returns float32 logits for every position,
# `[T, vocab]`. The tokenizer is byte-level BPE with ds4's pre-tokenizer; a string is tokenized as
# plain text.

# %% tags=["nbval-check-output"]
ids = model.tokenizer.encode("ROMEO:\nBut soft, what light")
logits = model.logits(ids)
print(len(ids), "tokens:", [model.tokenizer.decode([t]) for t in ids])
print("logits:", logits.shape, logits.dtype)
p = np.exp(logits[-1] - logits[-1].max())
p /= p.sum()
for t in np.argsort(-p)[:5]:
    print(f"{model.tokenizer.decode([int(t)])!r:>10}  p = {p[t]:.3f}")

# %% [markdown]
# ## A session: generate text
#
# A **session** is one live timeline: its tokens, the logits for the next token and the KV state of every
# layer. `generate` brings it to the prompt (reusing whatever it can) and samples with ds4's rules
# (temperature, top-k, top-p, min-p) and ds4's xorshift64\* random generator, so a seed repeats a run.
# The embedded model never saw a chat template: `chat=False` continues plain text, where a chat model
# would get the prompt rendered as a user turn.

# %% tags=["nbval-check-output"]
sess = model.session(ctx=512, prefill_chunk=64)  # 512 tokens: room for the 256-slot ring to wrap
text = sess.generate("ROMEO:\n", max_tokens=64, chat=False, temperature=0.8, seed=1)
print("ROMEO:\n" + text)
sess

# %% [markdown]
# ## Token by token
#
# `sess.decoder(...)` returns a `Decode` object; each `step()` samples one token, evaluates it and returns
# a `DecodeStep`: the token, its text, its log-probability and the most likely alternatives.
# `temperature=0` is greedy.

# %% tags=["nbval-check-output"]
decode = sess.decoder(temperature=0, top=3)
for step in decode.stream(8):
    alts = ", ".join(f"{model.tokenizer.decode([t])!r} {lp:.2f}" for t, lp in step.top)
    print(f"position {step.position}: {step.text!r:10} logprob {step.logprob:5.2f}   top: {alts}")

# %% [markdown]
# `GenerationView` does the same in a widget: each token coloured by the probability it was sampled with,
# its alternatives on hover, and run / step / stop buttons (the run button yields between tokens, so stop
# works while it runs). Without a prompt it continues the session; `.run(n)` runs from Python.

# %%
from ds4lab.viz import GenerationView

generation = GenerationView(sess, max_tokens=16, temperature=0.8, seed=3)
steps = generation.run()
generation

# %% [markdown]
# ## The KV cache
#
# What the model remembers of the past is the KV cache. `sess.kv` shows it layer by layer, as ds4 would
# save it: `raw` rows of the window, `comp` compressed rows, `index` the indexer's own compressed rows,
# and the bytes of the layer in ds4's `DSV4` payload (rows plus the compressor's pending state).

# %% tags=["nbval-check-output"]
sess.kv

# %% tags=["nbval-check-output"]
T = len(sess.tokens)
for lk in sess.kv:
    first, last = lk.raw_positions[0], lk.raw_positions[-1]
    print(f"layer {lk.layer}: raw {lk.raw.shape} holds positions {first}-{last}")
    if lk.ratio:  # the compressed rows on a line of their own
        line = f"         comp {lk.comp.shape} = {T} // {lk.ratio}; {T % lk.ratio} tokens pending"
        if lk.index is not None:
            line += f"; index {lk.index.shape}"
        print(line)

# %% [markdown]
# A query reads the raw rows of the last 64 positions only (the window: `raw` above). The ring that holds them
# has more slots (256 here, as ds4 sizes it for a chunk's rows and the window before it), so older rows stay
# in it until their slot is written again, but no query reads them: what the layers keep of those tokens is
# in the compressed rows. A ratio-4 layer keeps one row per 4 tokens, and beside each its indexer keeps one of
# its own: a key only, which a query scores to choose the compressed rows it reads (indexer rows are 128 wide,
# here as in Flash; the KV rows 128 here, 512 in Flash). A ratio-128 layer keeps one row per 128 tokens (none
# yet below 128 tokens). The tokens after the last full group wait in the compressor's pending state until their
# group is complete: a ratio-128 layer keeps room for 128 tokens' projections there from the first token on,
# which is why its bytes start larger than a ratio-4 layer's (notebook 02 follows them chunk by chunk).
#
# `KVCacheView` draws the same cache: the raw ring's slots, the compressed rows and the tokens they pool,
# the bytes per layer. With `follow=True` it redraws after every step of the session. The cell below shows the
# GenerationView's buttons again (`generation.controls`: the same buttons, driving the generation above) right over
# it: type 200 in the tokens box, pick a pace of 10 tokens/s (the embedded model makes hundreds a second), press
# run, and watch the ring turn; past position 255 it wraps, each new position overwriting the row of the one 256
# before it (without `follow`, a view keeps the state of the cell that made it, and `refresh()` brings it up to
# date). These are live widgets; a saved notebook shows the view's static table.

# %%
from IPython.display import display

from ds4lab.viz import KVCacheView

display(generation.controls)
KVCacheView(sess, follow=True)

# %% [markdown]
# ## Next
#
# - `02_chunked_prefill.ipynb`: how a prompt is evaluated chunk by chunk, and why the result does not depend on the chunk size;
# - `03_kv_checkpoints.ipynb`: checkpoints, restore, and ds4's on-disk KV store;
# - `04_compressed_attention_and_indexer.ipynb`: what each query attends, and what the indexer keeps;
# - `05_tiers_and_placement.ipynb`: layers split over tiers, and what moves between them;
# - `06_interventions.ipynb`: change what the model attends or routes to, and measure what it changes.
