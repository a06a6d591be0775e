# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Interventions: ablate, force, patch, replace — and see what the logits do
#
# Notebook 04 *looked* at the hook points; here we *change* what the model computes at them, as
# TransformerLens's hooks and nnsight's edits do, and measure the effect on the next-token logits:
#
# | edit | hook point | what it does |
# |---|---|---|
# | `ablate_sink(layer, heads)` | `blk.L.attn.sinks` | the sink logit to −inf: the softmax runs over the keys alone |
# | `ablate_rows(layer, rows)` | `blk.L.attn.comp_visible` | compressed rows masked before the softmax |
# | `force_topk(layer, rows)` | `blk.L.attn.comp_visible` | each query attends exactly these compressed rows |
# | `patch_row(layer, source, raw=/comp=/index=)` | `blk.L.attn.state` | one KV row taken from another prompt's checkpoint |
# | `replace_experts(layer, experts)` | `blk.L.moe.experts` | other routed experts for a token |
#
# `with sess.intervene([...]) as iv:` applies edits to the steps run inside the block, on that session only.
# When the block ends the session is back where it started, bit for bit: the edited result stays readable
# on `iv` (`iv.logits`, `iv.checkpoint`, marked with its edits), never in the session's later steps.

# %%
import sys

if sys.platform == "emscripten":  # JupyterLite (Pyodide): ds4lab and the views' packages from this site
    import piplite

    await piplite.install(["ds4lab", "anywidget"])

# %% tags=["nbval-check-output"]
import tempfile
from pathlib import Path

import numpy as np

import ds4lab
from ds4lab.interventions import ablate_rows, ablate_sink, force_topk, logit_diff, patch_row, replace_experts
from ds4lab.kv.edit import checkpoint_row, patch_rows, save_kv

model = ds4lab.load(backend="numpy")  # the embedded Shakespeare model, float64 reference backend
cfg = model.config

prompt = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?

All:
Resolved. resolved.

First Citizen:
First, you know Caius Marcius is chief enemy to the"""
ids = model.tokenizer.encode(prompt)
sess = model.session(ctx=256, prefill_chunk=64)
sess.prefill(ids[:-1]).run(progress=False)  # everything but the last token, once
cp = sess.checkpoint()
print(f"{len(ids)} tokens; after {len(cp)}: compressed rows per layer",
      [len(cp) // cfg.ratio(il) if cfg.ratio(il) else 0 for il in range(cfg.n_layer)])

# %% [markdown]
# `logit_diff(sess, ids, edits, start=...)` evaluates the prompt's tokens from `start` on twice, clean and
# edited, from the same shared prefix, and compares the next-token distributions: the KL divergence,
# the largest logit change, the top token, and the tokens that gained or lost the most probability.
# With `start=len(ids) - 1` only the last token's forward pass is edited: every edit below acts on how
# *that* token reads the cache.
#
# ## 1. Ablate the sink
#
# Every head has a sink: a logit in the softmax with no value, which can soak up attention mass.
# Without it the same scores are renormalised over the keys alone.

# %% tags=["nbval-check-output"]
last = len(ids) - 1
with sess.capture(["attn.scores"], layers=[2]) as cap:
    sess.prefill(ids).step()
print("layer 2, last token: attention mass on the sink per head",
      np.round(cap.attention(2).group("sink")[0, :, 0], 3))
sess.restore(cp)

print(logit_diff(sess, ids, [ablate_sink(il) for il in range(cfg.n_layer)], start=last))

# %% [markdown]
# ## 2. Ablate compressed rows
#
# Ratio-4 layers (2 and 4 here) keep one compressed row per 4 tokens. Masking rows removes their attention
# mass: the softmax is taken over the raw window and the remaining rows. Here the last token loses every
# compressed row of both layers, so it sees only its 64-token raw window there.

# %% tags=["nbval-check-output"]
print(logit_diff(sess, ids, [ablate_rows(2), ablate_rows(4)], start=last))

# %% [markdown]
# ## 3. Force the indexer's top-k
#
# In ratio-4 layers the indexer picks the `idx_topk` (32) best-scoring compressed rows for each query once
# more are visible (past 128 tokens); before that every row is attended. `force_topk` replaces its choice:
# the query attends exactly the rows given (among those already written). Forcing the rows it would attend
# anyway changes nothing, bit for bit; forcing only the opening rows ("First Citizen: Before we proceed")
# does.

# %% tags=["nbval-check-output"]
n_rows = len(cp) // 4
same = logit_diff(sess, ids, [force_topk(2, range(n_rows)), force_topk(4, range(n_rows))], start=last)
print("forcing every visible row: logits bit-identical:", np.array_equal(same.clean, same.edited))
print(logit_diff(sess, ids, [force_topk(2, [0, 1, 2]), force_topk(4, [0, 1, 2])], start=last))

# %% [markdown]
# ## 4. Patch a KV row from another prompt
#
# Activation patching: run a second prompt that differs in one word ("enemy" → "friend"), and give the last
# token of the first prompt that word's KV row from the second prompt's checkpoint, in every layer.
# The last token reads "friend" there while everything else it reads still comes from "enemy".

# %% tags=["nbval-check-output"]
other = model.tokenizer.encode(prompt.replace("chief enemy", "chief friend"))
assert len(other) == len(ids)
where = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)
print(f"position {where}: {model.tokenizer.decode([ids[where]])!r} → {model.tokenizer.decode([other[where]])!r}")
friend = model.session(ctx=256, prefill_chunk=64)
friend.prefill(other[:-1]).run(progress=False)
cp_friend = friend.checkpoint()

print(logit_diff(sess, ids, [patch_row(il, cp_friend, raw=where) for il in range(cfg.n_layer)], start=last))

# %% [markdown]
# ## 5. Replace an expert choice
#
# Each layer's router picks `n_expert_used` (2) of 8 routed experts per token (layers 0-2 by a hash of the
# token id, the others by top-k). `replace_experts` swaps them; their weights come from the router's
# probabilities of the new experts, normalised as the model normalises its own choice.

# %% tags=["nbval-check-output"]
with sess.capture(["moe.experts", "moe.router"], layers=[4]) as cap:
    sess.prefill(ids).step()
sess.restore(cp)
chosen = cap["blk.4.moe.experts"][0]
probs = cap["blk.4.moe.router"][0]
print("layer 4, last token: router chose", chosen.tolist(), "of probabilities", np.round(probs, 3).tolist())
least = np.argsort(probs)[:2]
print(logit_diff(sess, ids, [replace_experts(4, least)], start=last))

# %% [markdown]
# ## What the block leaves behind
#
# Nothing: after the `with` block the session holds the tokens and state it had before it, so the next step
# equals that of a session that never intervened. The block's result is on the intervention object, in a
# checkpoint marked with its edits. (`keep=True` keeps the edited state instead: then `sess.edits` says so,
# `sync` never reuses it, and a KV store never saves it.)

# %% tags=["nbval-check-output"]
with sess.intervene([ablate_sink(2), replace_experts(4, least)]) as iv:
    sess.prefill(ids).step()
    print("inside:", len(sess.tokens), "tokens, edits:", sess.edits)
print("after: ", len(sess.tokens), "tokens, edits:", sess.edits)
print(iv.checkpoint)
sess.prefill(ids).step()
clean_next = sess.logits.copy()
sess.restore(cp)
print("the block's logits differ from the clean ones:", not np.array_equal(iv.logits, clean_next))

# %% [markdown]
# ## Edit a checkpoint, save it as a `.kv` file, load it back
#
# `ds4lab.kv.edit` edits a checkpoint's rows directly: `patch_rows(cp, source, layer, kind, indices)` copies
# rows from another checkpoint, `edit_rows` writes any values. The edited checkpoint carries its edits, and
# `save_kv` writes it as one `KVC` file in ds4-server's format (header, the text of its tokens, the `DSV4`
# payload, ds4lab's fingerprint and checksum trailers, which ds4 never reads). ds4-server would load it from
# its KV directory under the name `<sha1 of the text>.kv`.
#
# A `.kv` file holds float32 rows, so to compare bit for bit we start from the checkpoints as the file
# format holds them (`Checkpoint.from_bytes(cp.to_bytes())`).

# %% tags=["nbval-check-output"]
in_memory = model.session(ctx=256, prefill_chunk=64)
in_memory.restore(ds4lab.Checkpoint.from_bytes(cp.to_bytes(), cfg, fingerprint=cp.fingerprint))
friend32 = ds4lab.Checkpoint.from_bytes(cp_friend.to_bytes(), cfg)
edited = in_memory.snapshot()  # a live state holding the file format's float32 values
for il in range(cfg.n_layer):
    edited = patch_rows(edited, friend32, il, "raw", [where])
print(edited)

folder = Path(tempfile.mkdtemp())
kf = save_kv(edited, folder / "edited.kv", model)
print(f"{kf.path.name}: {kf.file_size:,} bytes, {kf.header['tokens']} tokens, ctx {kf.header['ctx_size']}; "
      f"ds4-server's name for it: {kf.sha1[:12]}….kv")
print("the file's row is the edit, exactly:",
      all(np.array_equal(kf.layers[il].raw[where - (len(cp) - kf.layers[il].n_raw)],
                         checkpoint_row(friend32, il, "raw", where)) for il in range(cfg.n_layer)))

loaded = ds4lab.Checkpoint.from_bytes(kf.payload(), cfg)
from_file = model.session(ctx=256, prefill_chunk=64)
from_file.restore(loaded)
from_file.prefill(ids).step()
in_memory.restore(edited)
in_memory.prefill(ids).step()
print("continued from the file == continued from the edited state in memory:",
      np.array_equal(from_file.logits, in_memory.logits))
top = int(np.argmax(from_file.logits))
print("next token after the edited cache:", repr(model.tokenizer.decode([top])))
