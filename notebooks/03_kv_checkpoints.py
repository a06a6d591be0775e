# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # KV checkpoints: save, diverge, restore, store on disk
#
# A **checkpoint** is a session's state at a token boundary: the tokens, the logits for the next token
# and every layer's KV state (raw window, compressed rows, indexer rows, the compressors' pending groups).
# ds4 serializes it as a `DSV4` payload; ds4-server keeps payloads in a directory of `KVC` files so that
# a conversation resumes without reading its prompt again.
#
# In ds4lab a session's state is an immutable value: `sess.checkpoint()` copies nothing and
# `sess.restore(cp)` is exact.

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
sess = model.session(ctx=512, prefill_chunk=64)
chunks = sess.prefill(ids).run(progress=False)
cp = sess.checkpoint()
print(cp, "|", f"{sess.kv_bytes:,} bytes of KV state")

# %% [markdown]
# The prefill also kept a checkpoint after every chunk (ds4's session is consistent at each chunk boundary
# too); `sess.sync` looks through them when a prompt does not extend the live tokens. The last 156 appears twice:
# the prefill's last chunk ended there, and `sess.checkpoint()` keeps what it returns as well (`sess.snapshot()`
# returns one without keeping it).

# %% tags=["nbval-check-output"]
print([len(c) for c in sess.checkpoints])

# %% [markdown]
# Each of them is a whole state, so a view can step through them. The prefill's chunks carry theirs (the three
# chunk checkpoints above, without `sess.checkpoint()`'s repeat): the slider shows the KV cache as it stood after
# each chunk, outlining what that chunk wrote (the raw ring's new slots, the compressed rows it finished).

# %%
from ds4lab.viz import KVCacheView

KVCacheView(sess, checkpoints=chunks)


# %% [markdown]
# ## Diverge
#
# Sample a continuation. We keep copies of the logits and of every KV array first, to compare after the
# restore.

# %% tags=["nbval-check-output"]
def kv_arrays(s):
    out = {}
    for lk in s.kv:
        for name in ("raw", "comp", "index"):
            if getattr(lk, name) is not None:
                out[f"{lk.layer}.{name}"] = getattr(lk, name).copy()
        for name in ("comp_pending", "index_pending"):
            if getattr(lk, name) is not None:
                kv, score = getattr(lk, name)
                out[f"{lk.layer}.{name}.kv"] = kv.copy()
                out[f"{lk.layer}.{name}.score"] = score.copy()
    return out

before_logits, before_kv = sess.logits.copy(), kv_arrays(sess)

first = "".join(step.text for step in sess.decoder(temperature=0.8, seed=1).stream(24))
print(repr(first))
print(len(sess.tokens), "tokens,", f"{sess.kv_bytes:,} bytes")

# %% [markdown]
# ## Restore
#
# The restored session is bit-identical to the one we checkpointed: same tokens, same logits, the same
# bytes in every KV array. Sampling again with the same seed therefore gives the same text.

# %% tags=["nbval-check-output"]
sess.restore(cp)
after = kv_arrays(sess)
print("tokens identical:", sess.tokens == list(cp.tokens))
print("logits bit-identical:", np.array_equal(sess.logits, before_logits))
same_kv = all(np.array_equal(after[k], before_kv[k]) for k in before_kv)
print(f"KV arrays bit-identical: {same_kv} ({len(before_kv)} arrays)")

again = "".join(step.text for step in sess.decoder(temperature=0.8, seed=1).stream(24))
print("same continuation:", again == first)

# %% tags=["nbval-check-output"]
sess.restore(cp)
other = "".join(step.text for step in sess.decoder(temperature=0.8, seed=2).stream(24))
print(repr(other))

# %% [markdown]
# ## `sync` reuses checkpoints
#
# `sess.sync(prompt)` brings the session to exactly `prompt`: it extends the live tokens when they are a
# prefix of it, otherwise restores the longest kept checkpoint that is a prefix (ds4's engine would
# prefill from zero; its server looks on disk), otherwise starts cold. A prompt that shares 150 tokens
# with ours reuses the checkpoint taken after the second chunk:

# %% tags=["nbval-check-output"]
print(sess.sync(ids[:150] + model.tokenizer.encode("Second Citizen:\n")))

# %% [markdown]
# ## The `DSV4` payload
#
# `cp.to_bytes(...)` writes the checkpoint as ds4 does: a header with the dimensions, the token ids, the
# logits, the row counts and every layer's arrays as float32. `Checkpoint.from_bytes` reads one back;
# a session with at least the same context (and the same raw window) restores it, whatever its chunk size: the
# raw rows are stored in position order and land in the restoring session's own ring.

# %% tags=["nbval-check-output"]
data = cp.to_bytes()
print(data[:4], f"{len(data):,} bytes")
cp2 = ds4lab.Checkpoint.from_bytes(data)
s2 = model.session(ctx=512, prefill_chunk=64)
s2.restore(cp2)
print(cp2, "| tokens identical:", s2.tokens == list(cp.tokens),
      "| logits identical:", np.array_equal(s2.logits, cp.logits))

# %% [markdown]
# The rows the model stores are rounded to F16 as they are written (that rounding is part of the model), so
# float32 holds them exactly. On this float64 backend the payload rounds only the compressors' pending
# projections (to float32); a group they complete pools them into a row that is rounded to F16 in its turn,
# which here absorbs the difference: the two sessions continue alike, 8 tokens and two completed ratio-4
# groups later (on ds4's float32 arithmetic the payload loses nothing at all):

# %% tags=["nbval-check-output"]
sess.restore(cp)
a = [step.token for step in sess.decoder(temperature=0).stream(8)]
b = [step.token for step in s2.decoder(temperature=0).stream(8)]
gap = np.abs(sess.logits - s2.logits).max()
print("same tokens:", a == b, f"| max |Δ logits| after 8 tokens = {gap:.1e}")

# %% [markdown]
# ## A disk store
#
# `ds4lab.KVStore(dir, budget_mb=...)` is ds4-server's `KVC` directory: one file per stored prefix, named by
# the SHA-1 of its text (the tokens' bytes), written atomically (temporary file, then rename), evicted by
# ds4's score (hits decayed with a half-life, per byte) when the files exceed the budget. Files hold a
# fixed header, the text, the `DSV4` payload and, in ds4lab's files, a trailer with the model's fingerprint and a
# CRC-32 (ds4 reads none of it). ds4-server stores
# prompts of at least 512 tokens; ours is shorter, so we lower `min_tokens`. `store.save(checkpoint, model)`
# writes a checkpoint (the model gives the tokenizer that renders its text and the header's quant byte).

# %% tags=["nbval-check-output"]
import tempfile
from pathlib import Path

tmp = Path(tempfile.mkdtemp(prefix="ds4lab-kv-"))
store = ds4lab.KVStore(tmp, budget_mb=64, min_tokens=32)
entry = store.save(cp, model, reason="shutdown")
print(entry.path.name, f"{entry.file_size:,} bytes,", entry.tokens, "tokens")

# %% [markdown]
# `ds4lab.KVFile.open(path)` inspects a `.kv` file without a model (also those ds4-server writes for the
# real Flash model): it maps the file, checks its structure, and reads arrays only when asked.

# %%
kf = ds4lab.KVFile.open(entry.path)
for line in kf.summary().splitlines():  # a line too long for a narrow notebook: broken at its colon
    print(line if len(line) <= 100 else line.replace(": ", ":\n    ", 1))

# %% [markdown]
# The header's words, in the order printed: the *payload ABI* is the version of the `DSV4` payload's layout
# (ds4 refuses a file of a version it does not know); *hits* counts the times a server reused the file; *ext* is
# a byte of flags, here bit 7, "this file ends in ds4lab's fingerprint trailer"; the *model quant byte* says how
# the model's routed experts are stored (4 for Q4_K, 2 for any other type; nothing of the KV rows, which are
# float32), so that ds4-server can refuse a cache made by a differently quantized model when told to
# (`--kv-cache-reject-different-quant`); and the `DSV4` line repeats the session's geometry (context, chunk,
# ring), which a reader needs to lay out the arrays. [docs/FORMATS.md](../docs/FORMATS.md) has every byte.

# %% tags=["nbval-check-output"]
kf.verify()  # the CRC-32 trailer; raises KVFileError on a damaged file
print("reason:", kf.header["reason"], "| ratios:", kf.ratios,
      "| token ids match:", np.array_equal(kf.token_ids, cp.tokens))
print("layer 2 compressed rows:", kf.layers[2].compressed.shape, "| pending state:")
for k, v in kf.layers[2].state.items():
    print(f"  {k}: {v.shape}")

# %% [markdown]
# ## Resume from disk
#
# A new session created with `kv_store=store` has no checkpoints in memory; its `sync` finds the longest
# stored prefix of the prompt on disk, restores it and evaluates only the rest. `sess.load(entry, prompt,
# store=store)` restores an entry of your choosing instead (one `store.lookup(prompt, model=model)` found, say)
# and evaluates the rest of the prompt.

# %% tags=["nbval-check-output"]
fresh = model.session(ctx=512, prefill_chunk=64, kv_store=store)
print(fresh.sync(ids + model.tokenizer.encode("All:\nAgainst him first.\n")))

# %% tags=["nbval-check-output"]
st = store.stats()
print(f"entries {st.entries}, {st.bytes:,} bytes of {st.budget_bytes:,}")
print(f"lookups {st.lookups}, hits {st.hits} ({st.request_hit_rate:.0%}); "
      f"tokens found {st.hit_tokens} of {st.query_tokens} ({st.token_hit_rate:.0%})")
print(f"saves {st.saves}, evictions {st.evictions}, bad files {st.bad_files}")

# %% [markdown]
# A store may also keep payloads smaller than ds4 does: `compression="q8"` stores rows as 8-bit values
# with a scale, `"zlib"`/`"zstd"` compress the payload, `"q8+zlib"` both. Such files are marked in their
# header, and files in ds4's format stay readable and writable.

# %%
for codec in (None, "q8", "q8+zlib"):
    store_c = ds4lab.KVStore(tmp / str(codec), budget_mb=64, min_tokens=32, compression=codec)
    e = store_c.save(cp, model)
    print(f"{str(codec):8} {e.file_size:>9,} bytes")

# %%
import shutil

shutil.rmtree(tmp)
