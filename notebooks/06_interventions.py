# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
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

if sys.platform == "emscripten":  # JupyterLite: ds4lab and the views' packages from this site
    import piplite

    await piplite.install(["ds4lab", "anywidget"])

# %% tags=["nbval-check-output"]
import shutil
import tempfile
import textwrap
from pathlib import Path

import numpy as np

import ds4lab
from ds4lab.interventions import (LogitDiff, ablate_rows, ablate_sink, force_topk, logit_diff,
                                  patch_row, replace_experts)
from ds4lab.kv.edit import checkpoint_row, load_kv, patch_rows, save_kv
from ds4lab.texts import coriolanus

model = ds4lab.load(backend="numpy")  # the embedded Shakespeare model, float64 reference backend
cfg, tok = model.config, model.tokenizer

prompt = coriolanus(989)  # the first 989 characters of Coriolanus's opening scene
print(prompt[:60] + " …")
ids = tok.encode(prompt)
last = len(ids) - 1  # the token whose forward pass the edits change
sess = model.session(ctx=512, prefill_chunk=64)
sess.prefill(ids[:-1]).run(progress=False)  # everything but the last token, once
cp = sess.checkpoint()
n_rows = len(ids) // 4  # compressed rows of a ratio-4 layer the last token sees
print(f"{len(ids)} tokens; the last one, {tok.decode([ids[last]])!r} at position {last}, reads")
print(f"the raw rows of positions {len(ids) - cfg.swa}-{last} and the compressed rows of the rest:")
comp_rows = [len(ids) // cfg.ratio(il) if cfg.ratio(il) else 0 for il in range(cfg.n_layer)]
print("  compressed rows per layer:", comp_rows,
      f"(in layers 2 and 4 the indexer keeps {cfg.idx_topk} of the {n_rows})")


def probs(logits):
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def top(p, n=5):
    best = np.argsort(-p, kind="stable")[:n]
    return ", ".join(f"{tok.decode([int(t)])!r} {p[t]:.3f}" for t in best)


def show(d, n=4):
    """What edits did to the next-token distribution: the KL divergence, the top token clean →
    edited, and the n tokens whose probability moved most (clean → edited, and the ratio edited /
    clean), two a line."""
    p, q = d.p_clean, d.p_edited
    kl = f"{d.kl:.3g}" if d.kl >= 1e-9 else f"{d.kl:.1e}"
    print(f"  KL(clean ‖ edited) = {kl} nats; top token {top(p, 1)} → {top(q, 1)}")
    moved = [f"{tok.decode([int(t)])!r} {p[t]:.3f} → {q[t]:.3f} (×{q[t] / p[t]:.2f})"
             for t in np.argsort(-np.abs(q - p), kind="stable")[:n]]
    pairs = [", ".join(moved[i:i + 2]) for i in range(0, n, 2)]
    print("  moved most: " + (",\n" + " " * 14).join(pairs))


sess.prefill(ids).step()
clean_logits = sess.logits.copy()
sess.restore(cp)
print("the model's guess after '…not in thirst for':")
print("  " + top(probs(clean_logits)))
[revenge] = tok.encode(" revenge")  # one token
print(f"the play's next word, ' revenge': p = {probs(clean_logits)[revenge]:.1e}")

# %% [markdown]
# The prompt is the opening of *Coriolanus* that notebooks 02 and 04 use, cut in the middle of its last line. Long
# enough for every mechanism to act on the last token: it reads 64 raw rows, 79 compressed rows in layers 2 and 4
# (of which the indexer keeps 32) and 2 in layers 3 and 5. The model's best guess is a line break: this line is
# already as long as the play's verse lines run. It learned speakers, lines and punctuation, not sentences: the
# word the play goes on with gets a probability of 2e-5.
#
# `logit_diff(sess, ids, edits, start=...)` evaluates the prompt's tokens from `start` on twice, clean and
# edited, from the same shared prefix, and compares the next-token distributions. With `start=last` only the
# last token's forward pass is edited: every edit below acts on how *that* token reads the cache and routes
# its FFN. `show` prints the KL divergence, the top token, and the tokens whose probability moved most, with
# the ratio of their probabilities (×1.00: unchanged).
#
# ## 1. Ablate the sink
#
# Every head has a sink: a logit in the softmax with no value, which can soak up attention mass. Without it
# the same scores are renormalised over the keys alone: a head that gave the sink a share `s` of its mass
# gives its keys `1/(1−s)` times as much. So an ablation matters where the sink holds much: early in a
# prompt, where a query has few keys to read, and hardly at its end.

# %% tags=["nbval-check-output"]
early = 8  # '…Before we proceed any': the ninth token
e = model.session(ctx=512, prefill_chunk=64)
with e.capture(["attn.scores"], queries=[early]) as cap_early:
    e.prefill(ids[:early + 1]).run(progress=False)
with sess.capture(["attn.scores"]) as cap:
    sess.prefill(ids).step()
sess.restore(cp)
print(f"attention mass on the sink per head, at token {early} ({tok.decode([ids[early]])!r}) "
      f"and at token {last} ({tok.decode([ids[last]])!r}):")
for il in range(cfg.n_layer):
    at_early = cap_early.attention(il).group("sink")[-1, :, 0]
    at_last = cap.attention(il).group("sink")[0, :, 0]
    print(f"  layer {il}:  " + " ".join(f"{x:.2f}" for x in at_early)
          + "   |  " + " ".join(f"{x:.3f}" for x in at_last))

every_sink = [ablate_sink(il) for il in range(cfg.n_layer)]
print(f"every sink ablated for token {early}:")
show(logit_diff(model.session(ctx=512, prefill_chunk=64), ids[:early + 1], every_sink, start=early))
print(f"every sink ablated for token {last}:")
show(logit_diff(sess, ids, every_sink, start=last))

# %% [markdown]
# At token 8 heads give the sink up to 60% of their mass, and ablating every sink changes the guess (' man' gives
# way to ' of'; KL 0.045 nats). At token 317 no head gives it more than 4.5%, so the keys' weights grow by at
# most 5% and the distribution barely moves (KL 0.0002 nats).
#
# ## 2. Ablate compressed rows
#
# The compressed rows hold the prompt beyond the 64-token raw window. Masking them removes their attention
# mass: the softmax is taken over the raw window (and the sink) alone. Here the last token loses every
# compressed row of the four compressed layers.

# %% tags=["nbval-check-output"]
print(f"attention mass on the compressed rows per head, token {last}:")
for il in (2, 3, 4, 5):
    mass = cap.attention(il).group("comp")[0].sum(-1)  # [heads]: each head's weight on them
    print(f"  layer {il} (ratio {cfg.ratio(il):3d}): " + " ".join(f"{x:.3f}" for x in mass))
print("every compressed row ablated:")
show(logit_diff(sess, ids, [ablate_rows(il) for il in (2, 3, 4, 5)], start=last))

window_only = model.session(ctx=512, prefill_chunk=64)
window_only.prefill(ids[-cfg.swa:]).run(progress=False)
print(f"the prompt's last {cfg.swa} tokens alone, against the whole prompt:")
show(LogitDiff(clean_logits, window_only.logits, ("the last 64 tokens",), tok))

# %% [markdown]
# Most of the attention, little of the prediction: in layer 2 every head, in layer 4 head 0, give the compressed
# rows 79–94% of their mass, yet without them the distribution moves by only 0.00125 nats; the top token stays a
# line break, its probability 0.159 → 0.169. The second test says why: the prompt's last 64 tokens *alone*, the
# first 254 tokens never seen, move it by 0.0016 nats. This small model (14 M parameters, trained on 318k
# tokens of Shakespeare, 2.8 passes) predicts almost entirely from its window: what it reads in the compressed rows
# changes little. On a model that uses its long context the same edit is how you would find out where it does.
#
# ## 3. Force the indexer's top-k
#
# In ratio-4 layers the indexer picks the `idx_topk` (32) best-scoring compressed rows for each query once more
# are visible (from position 131 on); the last token sees 79. `force_topk` replaces its choice: the query attends
# exactly the rows given (among those already written). A capture of `indexer.topk` says which rows it keeps.

# %% tags=["nbval-check-output"]
with sess.capture(["indexer.topk"], layers=[2, 4]) as cap_topk:
    sess.prefill(ids).step()
sess.restore(cp)
kept = {il: np.flatnonzero(cap_topk[f"blk.{il}.indexer.topk"][0]) for il in (2, 4)}
dropped = {il: np.setdiff1d(np.arange(n_rows), kept[il]) for il in (2, 4)}
for il in (2, 4):
    print(f"layer {il}: the indexer keeps rows")
    print(textwrap.fill(", ".join(map(str, kept[il])), 100,
                        initial_indent="  ", subsequent_indent="  "))

same = logit_diff(sess, ids, [force_topk(il, kept[il]) for il in (2, 4)], start=last)
print("forcing the rows it keeps: logits bit-identical:", np.array_equal(same.clean, same.edited))
every_row = [force_topk(il, range(n_rows)) for il in (2, 4)]
dense = logit_diff(sess, ids, every_row, start=last)
print(f"forcing all {n_rows} rows (no selection): KL = {dense.kl:.1e} nats, "
      f"largest logit change {dense.max_abs_logit_change:.1e}")
with sess.intervene(every_row), sess.capture(["attn.scores"], layers=[2, 4]) as cap_dense:
    sess.prefill(ids).step()
print("  with all rows attended, the kept rows' share of each head's compressed-row mass:")
for il in (2, 4):
    comp = cap_dense.attention(il).group("comp")[0]  # [heads, rows]: the weights on the 79 rows
    share = comp[:, kept[il]].sum(-1) / comp.sum(-1)
    print(f"    layer {il}: " + " ".join(f"{x:.3f}" for x in share))
print(f"forcing the {len(dropped[2])} rows it drops instead:")
show(logit_diff(sess, ids, [force_topk(il, dropped[il]) for il in (2, 4)], start=last))
recent = n_rows - cfg.idx_topk  # row c pools tokens 4c-4 ... 4c+3
print(f"forcing the {cfg.idx_topk} most recent rows ({recent}-{n_rows - 1}, "
      f"pooling tokens {4 * recent - 4}-{4 * n_rows - 1}):")
show(logit_diff(sess, ids, [force_topk(il, range(recent, n_rows)) for il in (2, 4)], start=last))
print("for comparison, every compressed row of layers 2 and 4 ablated:")
show(logit_diff(sess, ids, [ablate_rows(2), ablate_rows(4)], start=last))

# %% [markdown]
# The kept rows are spread over the whole prompt, not the most recent ones. Forcing them changes nothing, bit for
# bit. Attending all 79 rows instead changes the logits by less than 1e-4: given every row, the heads put 96–100%
# of their compressed-row mass on the 32 the indexer kept (the model card, `ds4lab/assets/MODEL_CARD.md`, finds
# the same held-out perplexity, 64.72, with the indexer's selection and with every row attended). Forcing the 47
# dropped rows, or the 32 most recent, moves the distribution by 0.0011 nats, the same as ablating every
# compressed row of layers 2 and 4: those rows are not what the query reads. All of it is small, for section 2's reason.
#
# ## 4. Patch a KV row from another prompt
#
# Activation patching: run a second prompt that differs in one place, and give the last token of the first
# prompt the changed rows from the second prompt's checkpoint. The second prompt breaks the last line after
# "bread,": two tokens differ (',' becomes ',\n' and ' not' becomes 'not'). The rows after them differ too
# (their own passes read the line break), but only the two changed rows are patched.

# %% tags=["nbval-check-output"]
other = tok.encode(prompt.replace("bread, not", "bread,\nnot"))
assert len(other) == len(ids)
changed = [i for i, (a, b) in enumerate(zip(ids, other)) if a != b]
print("positions", changed, [tok.decode([ids[i]]) for i in changed], "→",
      [tok.decode([other[i]]) for i in changed])
broken = model.session(ctx=512, prefill_chunk=64)
broken.prefill(other[:-1]).run(progress=False)
cp_other = broken.checkpoint()
broken.prefill(other).step()
print("the other prompt's own guess:", top(probs(broken.logits)))

every_layer = [patch_row(il, cp_other, raw=i) for il in range(cfg.n_layer) for i in changed]
patched = logit_diff(sess, ids, every_layer, start=last)
print("the changed rows patched in every layer:")
show(patched)
kl_other = LogitDiff(broken.logits, patched.edited, (), tok).kl
print(f"KL(other prompt ‖ patched) = {kl_other:.1e} nats")
print("patched in one layer at a time, KL(clean ‖ edited):")
for il in range(cfg.n_layer):
    one_layer = [patch_row(il, cp_other, raw=i) for i in changed]
    print(f"  layer {il}: {logit_diff(sess, ids, one_layer, start=last).kl:.2g}")

# %% [markdown]
# With the line break five tokens back, the current line is short, and the other prompt's guess is no longer a
# line break (' this' 0.089 first). Patching just the two changed rows gives the first prompt's last token
# the same distribution: KL 0.74 nats from its own, and 1.6e-7 from the other prompt's. So what the last token
# knows of the break it reads from those rows themselves, not from the rows after them. Patching one layer at a
# time localises it further: layer 5 alone moves the distribution by 0.74 nats, layer 0 by 0.001, the others by
# less. The effect is large because it is local: the rows are in the raw window, where this model looks.
#
# `logit_diff_chart` draws such a comparison: the likeliest next tokens of either run, clean (grey) beside
# edited (orange; here the patched run). Hover a bar for its probability.

# %%
from ds4lab.viz.charts import logit_diff_chart

logit_diff_chart(patched)

# %% [markdown]
# ## 5. Replace an expert choice
#
# Each layer's router gives every routed expert a score `p = sqrt(softplus(logit))`
# ([docs/MODEL.md](../docs/MODEL.md), "Mixture of experts"): positive, but not probabilities (they do not sum to
# 1). Layers 0-2 pick a token's `n_expert_used` (2) of the 8 experts by its token id (hash routing: a fixed table,
# token id → experts), the others take the two highest scores. The route weights are the chosen experts' scores normalised to sum to
# `expert_weight_scale` (1.5): `w_i = 1.5 · p_i / (p_a + p_b)`. `replace_experts` swaps the experts; their
# weights come from their scores the same way.

# %% tags=["nbval-check-output"]
with sess.capture(["moe.router", "moe.experts", "moe.weights", "hc_ffn.post"]) as cap_moe:
    sess.prefill(ids).step()
sess.restore(cp)
print(f"token {last} ({tok.decode([ids[last]])!r}): router scores of experts 0-7, the two chosen, "
      "their route weights")
lowest = {}
for il in range(cfg.n_layer):
    scores = cap_moe[f"blk.{il}.moe.router"][0]
    chosen = cap_moe[f"blk.{il}.moe.experts"][0]
    weights = cap_moe[f"blk.{il}.moe.weights"][0]
    assert np.allclose(weights, cfg.expert_weight_scale * scores[chosen] / scores[chosen].sum())
    # the two lowest-scored experts not chosen: a swap that changes both of the token's experts
    lowest[il] = [e for e in np.argsort(scores, kind="stable") if e not in chosen][:2]
    routing = "(hash):" if il < cfg.n_hash_layer else "(top-2):"
    # three decimals in every row: numpy's shortest form prints 0.81 beside 0.809
    fixed = np.array2string(weights, precision=3, floatmode="fixed")
    print(f"  layer {il} {routing:8} {np.round(scores, 2)}  chosen {chosen.tolist()}, "
          f"weights {fixed}")

print("the two lowest-scored experts not chosen instead, one layer at a time, and the post gates")
print("that write the FFN's output into the 4 streams:")
print("  layer  experts  KL (nats)  top token     post gates")
for il in range(cfg.n_layer):
    d = logit_diff(sess, ids, [replace_experts(il, lowest[il])], start=last)
    # two significant digits, not two decimals: layer 5's gates are far below 0.01
    gates = " ".join(f"{g:.2g}" for g in cap_moe[f"blk.{il}.hc_ffn.post"][0])
    experts = str([int(e) for e in lowest[il]])
    print(f"  {il:5d}  {experts:7}  {d.kl:9.2g}  {top(d.p_edited, 1):12}  {gates}")
print("layer 1 in detail:")
show(logit_diff(sess, ids, [replace_experts(1, lowest[1])], start=last))

# %% [markdown]
# In the hash layers the scores only weight the experts the token id picked: layer 1 routes ' for' to experts
# 1 and 3, though the router scores experts 0 and 7 above 3. Swapping in the two lowest-scored experts the token
# did not get changes the most in layers 0 and 1 (KL 0.41 and 0.3 nats; in layer 1 the line break goes from
# 0.159 to 0.402) and less and less in later layers (0.012, 0.0075, 1e-4), down to nothing measurable in layer 5 (1e-10). The post gates
# say why the last two hardly count: the hyper-connections write the FFN's output `y` into each stream `o` as
# `post[o]·y` ([docs/MODEL.md](../docs/MODEL.md), "Hyper-connections and Sinkhorn"), and for this token layer 4's
# gates are 0.038–0.14 and layer 5's below 0.001: whatever its experts compute, layer 5 adds next to none of it to the streams the head
# reads.

# %% [markdown]
# ## What the block leaves behind
#
# Nothing: after the `with` block the session holds the tokens and state it had before it, so the next step
# equals that of a session that never intervened. The block's result is on the intervention object, in a
# checkpoint marked with its edits. (`keep=True` keeps the edited state instead: then `sess.edits` says so,
# `sync` never reuses it, and a KV store never saves it.)

# %% tags=["nbval-check-output"]
with sess.intervene([ablate_sink(2), replace_experts(4, lowest[4])]) as iv:
    sess.prefill(ids).step()
    print("inside:", len(sess.tokens), "tokens, edits:", sess.edits)
print("after: ", len(sess.tokens), "tokens, edits:", sess.edits)
print(f"iv.checkpoint: {len(iv.checkpoint)} tokens, its edits:")
for edit in iv.checkpoint.edits:
    print("  " + edit)
sess.prefill(ids).step()
print("the next step equals the clean one, bit for bit:", np.array_equal(sess.logits, clean_logits))
sess.restore(cp)
print("the block's logits differ from the clean ones:", not np.array_equal(iv.logits, clean_logits))

# %% [markdown]
# ## Edit a checkpoint, save it as a `.kv` file, load it back
#
# `ds4lab.kv.edit` edits a checkpoint's rows directly: `patch_rows(cp, source, layer, kind, indices)` copies
# rows from another checkpoint, `edit_rows` writes any values. The edited checkpoint carries its edits, and
# `save_kv` writes it as one `KVC` file in ds4-server's format (header, the text of its tokens, the `DSV4`
# payload, ds4lab's fingerprint and checksum trailers, which ds4 never reads). ds4-server would load it from
# its KV directory under the name `<sha1 of the text>.kv`; `load_kv` reads it back, refusing a damaged file (its
# checksum) or another model's (its fingerprint).
#
# Here the edit is section 4's patch made permanent: the two rows of the line break, in every layer, copied into
# the first prompt's checkpoint. A `.kv` file holds float32 rows, so to compare bit for bit we start from the
# checkpoints as the file format holds them (`Checkpoint.from_bytes(cp.to_bytes())`). Continued from the file,
# the last token guesses what the other prompt guesses.

# %% tags=["nbval-check-output"]
in_memory = model.session(ctx=512, prefill_chunk=64)
in_memory.restore(ds4lab.Checkpoint.from_bytes(cp.to_bytes(), cfg, fingerprint=cp.fingerprint))
other32 = ds4lab.Checkpoint.from_bytes(cp_other.to_bytes(), cfg)
edited = in_memory.snapshot()  # a live state holding the file format's float32 values
for il in range(cfg.n_layer):
    edited = patch_rows(edited, other32, il, "raw", changed)  # section 4's patch, in the checkpoint
print(f"edited: {len(edited)} tokens, its edits:")
for edit in edited.edits:
    print("  " + edit)

folder = Path(tempfile.mkdtemp())
kf = save_kv(edited, folder / "edited.kv", model)
print(f"{kf.path.name}: {kf.file_size:,} bytes, {kf.header['tokens']} tokens, "
      f"ctx {kf.header['ctx_size']}; ds4-server's name for it: {kf.sha1[:12]}….kv")
print("the file's rows are the edit, exactly:",
      all(np.array_equal(kf.layers[il].raw[i - (len(cp) - kf.layers[il].n_raw)],
                         checkpoint_row(other32, il, "raw", i))
          for il in range(cfg.n_layer) for i in changed))

loaded = load_kv(kf.path, model)  # its checksum and model fingerprint checked
from_file = model.session(ctx=512, prefill_chunk=64)
from_file.restore(loaded)
from_file.prefill(ids).step()
in_memory.restore(edited)
in_memory.prefill(ids).step()
print("continued from the file == continued from the edited state in memory:",
      np.array_equal(from_file.logits, in_memory.logits))
print("guess after the edited cache:", top(probs(from_file.logits), 3))
print("guess after the clean cache: ", top(probs(clean_logits), 3))
shutil.rmtree(folder)  # the .kv file was only for this cell
