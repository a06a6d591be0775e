# ruff: noqa: E501  (cell sources are long strings)
"""Writes the teaching notebooks: this file is the source of truth for their cells.

    python notebooks/_build.py                 # write every notebook and execute it (outputs are committed)
    python notebooks/_build.py 03 --no-execute # only notebooks whose name starts with 03, sources only

Cells tagged ``nbval-check-output`` are the ones whose outputs nbval compares (``python -m pytest``
runs every notebook with ``--nbval-lax``; see notebooks/conftest.py and nbval_sanitize.cfg): keep
them to deterministic facts (counts, bytes, bit-identical checks, seeded samples), never timings.
"""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import nbformat as nbf

HERE = Path(__file__).resolve().parent
CHECK = "nbval-check-output"


def md(text: str):
    return nbf.v4.new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(*parts: str, check: bool = False):
    """A code cell from ``parts`` (each dedented on its own), tagged for nbval's comparison with ``check``."""
    cell = nbf.v4.new_code_cell("\n".join(textwrap.dedent(p).strip("\n") for p in parts))
    if check:
        cell.metadata["tags"] = [CHECK]
    return cell


# The opening of Coriolanus (tinyshakespeare's first 1000 characters: the embedded model's training text).
CORIOLANUS = '''prompt = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?

All:
Resolved. resolved.

First Citizen:
First, you know Caius Marcius is chief enemy to the people.

All:
We know't, we know't.

First Citizen:
Let us kill him, and we'll have corn at our own price.
Is't a verdict?

All:
No more talking on't; let it be done: away, away!

Second Citizen:
One word, good citizens.

First Citizen:
We are accounted poor citizens, the patricians good.
What authority surfeits on would relieve us: if they
would yield us but the superfluity, while it were
wholesome, we might guess they relieved us humanely;
but they think we are too dear: the leanness that
afflicts us, the object of our misery, is as an
inventory to particularise their abundance; our
sufferance is a gain to them Let us revenge this with
our pikes, ere we become rakes: for the gods know I
speak this in hunger for bread, not in thirst for revenge.

"""
ids = model.tokenizer.encode(prompt)'''

# The same opening, cut after "the patricians good.": a shorter prompt.
SHORT_PROMPT = CORIOLANUS.split("What authority surfeits")[0].rstrip("\n") + '''
"""
ids = model.tokenizer.encode(prompt)'''

LOAD = '''import numpy as np

import ds4lab

model = ds4lab.load(backend="numpy")  # the embedded model on the float64 reference backend'''


# -- 01 -------------------------------------------------------------------------------------------------
def quickstart():
    return [
        md("""
        # Quick start: the embedded model, generation and the KV cache

        ds4lab runs the DeepSeek V4 Flash architecture (the model that antirez's C engine
        [ds4](https://github.com/antirez/ds4) runs) in Python you can read and take apart. The package
        embeds a small model of the same architecture: 6 layers, 256 wide, a 2048-token vocabulary, trained
        on tinyshakespeare (17 MB). Every mechanism of the 284B model is active in it within a few hundred
        tokens, which makes it a good specimen.

        This notebook loads it, looks at its layers, computes next-token probabilities, generates text with a
        session and looks at the KV cache the session keeps. Everything runs on a laptop CPU in seconds.
        """),
        code("""
        import numpy as np

        import ds4lab

        model = ds4lab.load(backend="numpy")  # with no path: the embedded model
        model
        """, check=True),
        md("""
        `backend="numpy"` is the float64 reference the test suite trusts. The default, `backend="auto"`, picks MLX
        (float32) on Apple GPUs or NVIDIA GPUs with mlx[cuda], CuPy on other NVIDIA GPUs, and NumPy on CPUs, where
        MLX's Linux wheel is slower; these notebooks name NumPy everywhere, so they give the same numbers anywhere.

        ## The layers

        Every dimension comes from the GGUF file's `deepseek4.*` metadata, so the same code runs the real
        284B file. A DS4 layer's attention is one of three kinds, set by its **compression ratio**:

        - **ratio 0** (layers 0 and 1): only the *raw sliding window*, the KV rows of the last `swa` tokens;
        - **ratio 4**: the window plus one *compressed row* per 4 tokens, and an *indexer* that picks the
          `idx_topk` rows each query may attend once more than that are visible;
        - **ratio 128**: the window plus one compressed row per 128 tokens, all of them visible.

        The first `n_hash_layer` layers choose their experts by a hash of the token id; the others by the
        router's top-k.
        """),
        code("""
        cfg = model.config
        print(f"{cfg.n_layer} layers, width {cfg.n_embd}, vocab {cfg.n_vocab}, "
              f"raw window {cfg.swa} tokens, indexer top-k {cfg.idx_topk}")
        for il in range(cfg.n_layer):
            kind = {0: "raw window only", 4: "ratio 4 + indexer", 128: "ratio 128"}[cfg.ratio(il)]
            routing = "token-id hash" if cfg.is_hash_layer(il) else "router top-k"
            print(f"layer {il}: {kind:<18}  experts by {routing}")
        """, check=True),
        md("""
        The real Flash model has 43 layers of the same pattern (0, 0, then 4, 128, 4, 128, …), a window of 128 and
        an indexer top-k of 512. Here the window is 64 and the top-k 32: the window starts evicting at token 64,
        ratio-128 rows appear at tokens 127 and 255, and the indexer starts choosing at token 131, when a query
        first sees 33 ratio-4 rows.

        ## Next-token probabilities

        `model.logits(ids)` prefills the tokens from zero and returns float32 logits for every position,
        `[T, vocab]`. The tokenizer is byte-level BPE with ds4's pre-tokenizer; a string is tokenized as
        plain text.
        """),
        code("""
        ids = model.tokenizer.encode("ROMEO:\\nBut soft, what light")
        logits = model.logits(ids)
        print(len(ids), "tokens:", [model.tokenizer.decode([t]) for t in ids])
        print("logits:", logits.shape, logits.dtype)
        p = np.exp(logits[-1] - logits[-1].max())
        p /= p.sum()
        for t in np.argsort(-p)[:5]:
            print(f"{model.tokenizer.decode([int(t)])!r:>10}  p = {p[t]:.3f}")
        """, check=True),
        md("""
        ## A session: generate text

        A **session** is one live timeline: its tokens, the logits for the next token and the KV state of every
        layer. `generate` brings it to the prompt (reusing whatever it can) and samples with ds4's rules
        (temperature, top-k, top-p, min-p) and ds4's xorshift64\\* random generator, so a seed repeats a run.
        The embedded model never saw a chat template: `chat=False` continues plain text, where a chat model
        would get the prompt rendered as a user turn.
        """),
        code("""
        sess = model.session(ctx=256, prefill_chunk=64)
        text = sess.generate("ROMEO:\\n", max_tokens=64, chat=False, temperature=0.8, seed=1)
        print("ROMEO:\\n" + text)
        sess
        """, check=True),
        md("""
        ## Token by token

        `sess.decoder(...)` returns a `Decode` object; each `step()` samples one token, evaluates it and returns
        a `DecodeStep`: the token, its text, its log-probability and the most likely alternatives.
        `temperature=0` is greedy.
        """),
        code("""
        decode = sess.decoder(temperature=0, top=3)
        for step in decode.stream(8):
            alts = ", ".join(f"{model.tokenizer.decode([t])!r} {lp:.2f}" for t, lp in step.top)
            print(f"position {step.position}: {step.text!r:10} logprob {step.logprob:5.2f}   top: {alts}")
        """, check=True),
        md("""
        `GenerationView` does the same in a widget: each token coloured by the probability it was sampled with,
        its alternatives on hover, and run / step / stop buttons (the run button yields between tokens, so stop
        works while it runs). Without a prompt it continues the session; `.run(n)` runs from Python.
        """),
        code("""
        from ds4lab.viz import GenerationView

        generation = GenerationView(sess, max_tokens=16, temperature=0.8, seed=3)
        steps = generation.run()
        generation
        """),
        md("""
        ## The KV cache

        What the model remembers of the past is the KV cache. `sess.kv` shows it layer by layer, as ds4 would
        save it: `raw` rows of the window, `comp` compressed rows, `index` the indexer's own compressed rows,
        and the bytes of the layer in ds4's `DSV4` payload (rows plus the compressor's pending state).
        """),
        code("sess.kv", check=True),
        code("""
        T = len(sess.tokens)
        for lk in sess.kv:
            line = f"layer {lk.layer}: raw {lk.raw.shape} holds positions {lk.raw_positions[0]}-{lk.raw_positions[-1]}"
            if lk.ratio:
                line += f"; comp {lk.comp.shape} = {T} // {lk.ratio}; {T % lk.ratio} tokens pending"
            if lk.index is not None:
                line += f"; index {lk.index.shape}"
            print(line)
        """, check=True),
        md("""
        The window holds at most the last 64 positions: older raw rows are gone, and what the layers keep of
        those tokens is in the compressed rows. A ratio-4 layer keeps one row per 4 tokens (and its indexer a
        smaller row of its own for each), a ratio-128 layer one row per 128 tokens (none yet below 128 tokens);
        the tokens after the last full group wait in the compressor's pending state until their group is complete.

        `KVCacheView` draws the same cache: the raw ring's slots, the compressed rows and the tokens they pool,
        the bytes per layer. It is a live widget; a saved notebook shows its static table.
        """),
        code("""
        from ds4lab.viz import KVCacheView

        KVCacheView(sess)
        """),
        md("""
        ## Next

        - `02_chunked_prefill.ipynb`: how a prompt is evaluated chunk by chunk, and why the result does not depend on the chunk size;
        - `03_kv_checkpoints.ipynb`: checkpoints, restore, and ds4's on-disk KV store;
        - `04_compressed_attention_and_indexer.ipynb`: what each query attends, and what the indexer keeps;
        - `05_tiers_and_placement.ipynb`: layers split over tiers, and what moves between them.
        """),
    ]


# -- 02 -------------------------------------------------------------------------------------------------
def chunked_prefill():
    return [
        md("""
        # Chunked prefill, step by step

        A prompt is evaluated in **chunks**: each step runs every layer over up to `prefill_chunk` tokens,
        writing their KV rows, and the next chunk attends to what the earlier ones left in the cache. ds4 does
        this on GPUs with chunks of 2048 tokens (`DS4_METAL_PREFILL_CHUNK`): the graph's batch buffers are
        sized for one chunk, so memory does not grow with the prompt. Three rules make chunking invisible in
        the results:

        1. **Chunks end on absolute multiples of the chunk size.** A prefill resumed at token 3000 with chunk
           2048 runs 3000–4095 first, so compressed rows are finished on the same schedule as in a cold prompt.
        2. **The raw ring holds the window before the chunk plus the whole chunk**:
           `raw_cap = align_up(min(window + chunk, ctx), 256)` slots; position `p` goes to slot `p mod raw_cap`.
        3. **Compressors carry their pending group across chunks**: the tokens of an unfinished group wait in
           the compressor's state until the group's last token arrives, in this chunk or a later one.

        We step through a prefill with `PrefillView`, watch the ring and the compressors in `KVCacheView`,
        compare chunk sizes, and check that chunked and one-shot prefills give the same logits and KV arrays.
        `offline_charts()` makes the Altair charts render without a network: JupyterLab draws them with the Vega it
        ships (Altair's default HTML would load Vega from a CDN), and a saved notebook keeps a PNG of each.
        """),
        code("""
        import numpy as np

        import ds4lab
        from ds4lab.viz import KVCacheView, PrefillView, offline_charts
        from ds4lab.viz.charts import kv_bytes_chart, prefill_chunks_chart

        offline_charts()  # Altair charts drawn by JupyterLab's own Vega-Lite renderer (no CDN), PNG when saved
        model = ds4lab.load(backend="numpy")
        cfg = model.config
        print("compression ratio per layer:", [cfg.ratio(il) for il in range(cfg.n_layer)], "| window", cfg.swa)
        """, check=True),
        code(CORIOLANUS, """
        sess = model.session(ctx=512, prefill_chunk=64)
        print(len(ids), "prompt tokens;", sess.geometry)
        """, check=True),
        md("""
        With a 64-token window and chunks of 64, the ring needs 128 slots, rounded up to 256. `comp_cap` is the
        capacity of the compressed arrays: `ctx / 4 + 2` rows.

        ## Step through the prefill

        `PrefillView` wraps `sess.prefill(ids)`: nothing runs until `step()` (or the *step* button). The prompt
        is coloured by chunk; the linked `KVCacheView` is refreshed after every step, with the cells the step
        wrote outlined.
        """),
        code("""
        kv_view = KVCacheView(sess)
        prefill_view = PrefillView(sess, ids, kv_view=kv_view)
        print(len(prefill_view.prefill), "chunks planned")
        prefill_view
        """),
        code("""
        def show(chunk):
            comp = ", ".join(f"layer {il} +{r['comp']}" for il, r in chunk.rows.items() if cfg.ratio(il))
            print(f"tokens {chunk.start}-{chunk.end - 1}: {chunk.n_tokens} raw rows per layer; "
                  f"compressed rows: {comp}; KV {chunk.kv_bytes:,} bytes")

        show(prefill_view.step())
        """, check=True),
        md("""
        The first chunk wrote 64 raw rows in every layer and 16 compressed rows in each ratio-4 layer (one per 4
        tokens), but none in the ratio-128 layers: their first group closes at token 127.

        ## The raw ring

        Every layer's raw rows live in a ring of `raw_cap` slots. A query at position `q` attends the raw rows
        of positions `q − 63 … q` (the window, itself included). The ring is bigger than the window so that a
        chunk can be written whole while the window before it is still readable.
        """),
        code("""
        def ring(sess):
            g, T = sess.geometry, len(sess.tokens)
            first, visible = max(0, T - g.raw_cap), max(0, T - g.window)
            print(f"{T} tokens: the ring holds positions {first}-{T - 1}; the next token sees {visible}-{T - 1} "
                  f"in slots {visible % g.raw_cap}-{(T - 1) % g.raw_cap}; layer 0's window: "
                  f"{sess.kv[0].raw_positions[0]}-{sess.kv[0].raw_positions[-1]}")

        ring(sess)
        """, check=True),
        code("""
        for _ in range(2):
            show(prefill_view.step())
        ring(sess)
        kv_view
        """, check=True),
        md("""
        The second chunk ended at token 127: the ratio-128 layers (3 and 5) finished their first row, which pools
        tokens 0–127. After the third chunk the window holds 128–191 only: tokens before 128 are no longer
        visible as raw rows, though the ring still stores them until positions 256 and later overwrite their slots.

        ## The compressors' pending state

        A ratio-R compressor scores each token and, when a group of R tokens is complete, pools it (a softmax over
        the group's tokens, per channel) into one row. Until then the group's projections wait in the pending
        state, which is part of the KV state and of a saved checkpoint. The ratio-4 compressor overlaps its
        groups: row `w` pools tokens `4w−4 … 4w+3`, so its state holds 8 rows, the previous group's 4 and the
        current one's (each twice as wide: the two halves feed the two groups).
        """),
        code("""
        T = len(sess.tokens)
        for il in (2, 3):
            lk = sess.kv[il]
            kv, score = lk.comp_pending
            print(f"layer {il} (ratio {lk.ratio}): {lk.n_comp} rows finished, {T % lk.ratio} tokens pending; "
                  f"pending state kv {kv.shape}, score {score.shape}")
        """, check=True),
        md("""
        ## Finish and chart

        `run()` steps through the remaining chunks; the KV view's slider then scrubs through the checkpoints taken
        after each chunk, without touching the session. It starts on the last one, the state on display; after a
        later step it reads "live" until it is moved.
        """),
        code("""
        prefill_view.run()
        kv_view.scrub_through(prefill_view.chunks)
        for chunk in prefill_view.chunks:
            show(chunk)
        """, check=True),
        code("kv_bytes_chart(sess, prefill_view.chunks) | prefill_chunks_chart(prefill_view.chunks)"),
        md("""
        Raw-only layers stop growing once the window is full; ratio-4 layers grow by one row (plus one indexer row)
        per 4 tokens, ratio-128 layers by one row per 128. The speed chart shows each chunk's tokens/s: on a CPU the
        cost of a chunk grows with the keys it attends, on a GPU small chunks also leave the device idle.

        ## Compare chunk sizes

        The same prompt with chunk sizes that do and do not divide the compression ratios, and one chunk for the
        whole prompt (`prefill_chunk=512`).
        """),
        code("""
        runs = {}
        for chunk in (16, 30, 64, 100, 512):
            s = model.session(ctx=512, prefill_chunk=chunk)
            chunks = s.prefill(ids).run(progress=False)
            runs[chunk] = (s, chunks)
            bounds = ", ".join(f"{c.start}-{c.end - 1}" for c in chunks[:4]) + (", …" if len(chunks) > 4 else "")
            print(f"chunk {chunk:3d}: raw ring {s.geometry.raw_cap} slots, {len(chunks):2d} step(s): {bounds}")
        """, check=True),
        code("""
        import altair as alt

        speed = [dict(chunk=str(chunk), tokens_per_s=len(ids) / sum(c.seconds for c in chunks))
                 for chunk, (s, chunks) in runs.items()]
        alt.Chart(alt.Data(values=speed)).mark_bar().encode(
            x=alt.X("chunk:N", sort=None, title="prefill_chunk"), y=alt.Y("tokens_per_s:Q", title="tokens/s")
        ).properties(title=f"prefill of {len(ids)} tokens", width=260, height=140)
        """),
        md("""
        ## Chunked == one-shot

        Every KV array the sessions hold (raw window, compressed rows, indexer rows, and the compressors'
        pending kv and score) and the logits for the next token, against the one-shot prefill:
        """),
        code("""
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

        one = runs[512][0]
        ref = kv_arrays(one)
        for chunk, (s, _) in runs.items():
            arrays = kv_arrays(s)
            d_logits = np.abs(s.logits - one.logits).max()
            d_kv = max(np.abs(arrays[k] - ref[k]).max() for k in ref)
            print(f"chunk {chunk:3d}: max |Δ logits| = {d_logits:.1e}, max |Δ KV| over {len(ref)} arrays = {d_kv:.1e}")
        """, check=True),
        md("""
        Zero: each token's computation reads only its own row and the cache, so how the prompt is cut changes
        the order of work, not the numbers (on a float32 GPU backend the same comparison agrees to rounding).
        The session we stepped through by hand agrees too:
        """),
        code("""
        print(f"stepped session: max |Δ logits| = {np.abs(sess.logits - one.logits).max():.1e}")
        """, check=True),
        md("""
        ## Resuming a prefill

        When a prompt extends the live tokens, only the new tokens are evaluated, and the first chunk stops at
        the next multiple of the chunk size. Here a session holds the first 200 tokens and is extended to the
        whole prompt with chunks of 64: 200–255, then 256–319.
        """),
        code("""
        s = model.session(ctx=512, prefill_chunk=64)
        s.prefill(ids[:200]).run(progress=False)
        resumed = s.prefill(ids).run(progress=False)
        print([(c.start, c.end) for c in resumed])
        print(f"max |Δ logits| against one-shot = {np.abs(s.logits - one.logits).max():.1e}")
        """, check=True),
    ]


# -- 03 -------------------------------------------------------------------------------------------------
def kv_checkpoints():
    return [
        md("""
        # KV checkpoints: save, diverge, restore, store on disk

        A **checkpoint** is a session's state at a token boundary: the tokens, the logits for the next token
        and every layer's KV state (raw window, compressed rows, indexer rows, the compressors' pending groups).
        ds4 serializes it as a `DSV4` payload; ds4-server keeps payloads in a directory of `KVC` files so that
        a conversation resumes without reading its prompt again.

        In ds4lab a session's state is an immutable value: `sess.checkpoint()` copies nothing and
        `sess.restore(cp)` is exact.
        """),
        code(LOAD, "", SHORT_PROMPT, """
        sess = model.session(ctx=512, prefill_chunk=64)
        chunks = sess.prefill(ids).run(progress=False)
        cp = sess.checkpoint()
        print(cp, "|", f"{sess.kv_bytes:,} bytes of KV state")
        """, check=True),
        md("""
        The prefill also kept a checkpoint after every chunk (ds4's session is consistent at each chunk boundary
        too); `sess.sync` looks through them when a prompt does not extend the live tokens.
        """),
        code("print([len(c) for c in sess.checkpoints])", check=True),
        md("""
        ## Diverge

        Sample a continuation. We keep copies of the logits and of every KV array first, to compare after the
        restore.
        """),
        code("""
        def kv_arrays(s):
            out = {}
            for lk in s.kv:
                for name in ("raw", "comp", "index"):
                    if getattr(lk, name) is not None:
                        out[f"{lk.layer}.{name}"] = getattr(lk, name).copy()
                for name in ("comp_pending", "index_pending"):
                    if getattr(lk, name) is not None:
                        kv, score = getattr(lk, name)
                        out[f"{lk.layer}.{name}.kv"], out[f"{lk.layer}.{name}.score"] = kv.copy(), score.copy()
            return out

        before_logits, before_kv = sess.logits.copy(), kv_arrays(sess)

        first = "".join(step.text for step in sess.decoder(temperature=0.8, seed=1).stream(24))
        print(repr(first))
        print(len(sess.tokens), "tokens,", f"{sess.kv_bytes:,} bytes")
        """, check=True),
        md("""
        ## Restore

        The restored session is bit-identical to the one we checkpointed: same tokens, same logits, the same
        bytes in every KV array. Sampling again with the same seed therefore gives the same text.
        """),
        code("""
        sess.restore(cp)
        after = kv_arrays(sess)
        print("tokens identical:", sess.tokens == list(cp.tokens))
        print("logits bit-identical:", np.array_equal(sess.logits, before_logits))
        same_kv = all(np.array_equal(after[k], before_kv[k]) for k in before_kv)
        print(f"KV arrays bit-identical: {same_kv} ({len(before_kv)} arrays)")

        again = "".join(step.text for step in sess.decoder(temperature=0.8, seed=1).stream(24))
        print("same continuation:", again == first)
        """, check=True),
        code("""
        sess.restore(cp)
        other = "".join(step.text for step in sess.decoder(temperature=0.8, seed=2).stream(24))
        print(repr(other))
        """, check=True),
        md("""
        ## `sync` reuses checkpoints

        `sess.sync(prompt)` brings the session to exactly `prompt`: it extends the live tokens when they are a
        prefix of it, otherwise restores the longest kept checkpoint that is a prefix (ds4's engine would
        prefill from zero; its server looks on disk), otherwise starts cold. A prompt that shares 150 tokens
        with ours reuses the checkpoint taken after the second chunk:
        """),
        code("print(sess.sync(ids[:150] + model.tokenizer.encode(\"Second Citizen:\\n\")))", check=True),
        md("""
        ## The `DSV4` payload

        `cp.to_bytes(...)` writes the checkpoint as ds4 does: a header with the dimensions, the token ids, the
        logits, the row counts and every layer's arrays as float32. `Checkpoint.from_bytes` reads one back;
        a session with the same chunk size and at least the same context restores it.
        """),
        code("""
        data = cp.to_bytes()
        print(data[:4], f"{len(data):,} bytes")
        cp2 = ds4lab.Checkpoint.from_bytes(data)
        s2 = model.session(ctx=512, prefill_chunk=64)
        s2.restore(cp2)
        print(cp2, "| tokens identical:", s2.tokens == list(cp.tokens),
              "| logits identical:", np.array_equal(s2.logits, cp.logits))
        """, check=True),
        md("""
        The rows the model stores are rounded to F16 as they are written (that rounding is part of the model), so
        float32 holds them exactly; on this float64 backend only the compressors' pending projections lose bits
        in the payload, and they matter once their group completes. The two sessions continue alike:
        """),
        code("""
        sess.restore(cp)
        a = [step.token for step in sess.decoder(temperature=0).stream(8)]
        b = [step.token for step in s2.decoder(temperature=0).stream(8)]
        print("same tokens:", a == b, f"| max |Δ logits| after 8 tokens = {np.abs(sess.logits - s2.logits).max():.1e}")
        """, check=True),
        md("""
        ## A disk store

        `ds4lab.KVStore(dir, budget_mb=...)` is ds4-server's `KVC` directory: one file per stored prefix, named by
        the SHA-1 of its text (the tokens' bytes), written atomically (temporary file, then rename), evicted by
        ds4's score (hits decayed with a half-life, per byte) when the files exceed the budget. Files hold a
        fixed header, the text, the `DSV4` payload and, in ds4lab's files, a CRC-32 trailer. ds4-server stores
        prompts of at least 512 tokens; ours is shorter, so we lower `min_tokens`. `store.save(checkpoint, model)`
        writes a checkpoint (the model gives the tokenizer that renders its text and the header's quant byte).
        """),
        code("""
        import tempfile
        from pathlib import Path

        tmp = Path(tempfile.mkdtemp(prefix="ds4lab-kv-"))
        store = ds4lab.KVStore(tmp, budget_mb=64, min_tokens=32)
        entry = store.save(cp, model, reason="shutdown")
        print(entry.path.name, f"{entry.file_size:,} bytes,", entry.tokens, "tokens")
        """, check=True),
        md("""
        `ds4lab.KVFile.open(path)` inspects a `.kv` file without a model (also those ds4-server writes for the
        real Flash model): it maps the file, checks its structure, and reads arrays only when asked.
        """),
        code("""
        kf = ds4lab.KVFile.open(entry.path)
        print(kf.summary())
        """),
        code("""
        kf.verify()  # the CRC-32 trailer; raises KVFileError on a damaged file
        print("reason:", kf.header["reason"], "| ratios:", kf.ratios,
              "| token ids match:", np.array_equal(kf.token_ids, cp.tokens))
        print("layer 2 compressed rows:", kf.layers[2].compressed.shape,
              "| pending state:", {k: v.shape for k, v in kf.layers[2].state.items()})
        """, check=True),
        md("""
        ## Resume from disk

        A new session created with `kv_store=store` has no checkpoints in memory; its `sync` finds the longest
        stored prefix of the prompt on disk, restores it and evaluates only the rest. `sess.load(entry, prompt,
        store=store)` restores an entry of your choosing instead (one `store.lookup(prompt, model=model)` found, say)
        and evaluates the rest of the prompt.
        """),
        code("""
        fresh = model.session(ctx=512, prefill_chunk=64, kv_store=store)
        print(fresh.sync(ids + model.tokenizer.encode("All:\\nAgainst him first.\\n")))
        """, check=True),
        code("""
        st = store.stats()
        print(f"entries {st.entries}, {st.bytes:,} bytes of {st.budget_bytes:,}; lookups {st.lookups}, hits {st.hits} "
              f"({st.request_hit_rate:.0%}); tokens found {st.hit_tokens} of {st.query_tokens} ({st.token_hit_rate:.0%}); "
              f"saves {st.saves}, evictions {st.evictions}, bad files {st.bad_files}")
        """, check=True),
        md("""
        A store may also keep payloads smaller than ds4 does: `compression="q8"` stores rows as 8-bit values
        with a scale, `"zlib"`/`"zstd"` compress the payload, `"q8+zlib"` both. Such files are marked in their
        header, and files in ds4's format stay readable and writable.
        """),
        code("""
        for codec in (None, "q8", "q8+zlib"):
            e = ds4lab.KVStore(tmp / str(codec), budget_mb=64, min_tokens=32, compression=codec).save(cp, model)
            print(f"{str(codec):8} {e.file_size:>9,} bytes")
        """),
        code("""
        import shutil

        shutil.rmtree(tmp)
        """),
    ]


# -- 04 -------------------------------------------------------------------------------------------------
def compressed_attention():
    return [
        md("""
        # What each query can see: compressed attention, the indexer and the sink

        A DS4 layer has one KV head whose key is also its value (128 floats here, 512 in Flash), and every
        query attends three kinds of columns:

        - **raw rows**: the KV rows of the last `swa` tokens, itself included (64 here, 128 in Flash);
        - **compressed rows**: a ratio-4 layer pools every 4 tokens into one row (overlapping: row `w` mixes
          tokens `4w−4 … 4w+3`), a ratio-128 layer every 128 tokens. Query `q` sees row `c` once the row's last
          token is in: `(c + 1)·R ≤ q + 1`. A recent token can be both a raw row and part of a compressed row;
        - the **sink**: one learned logit per head, added to the softmax's denominator with no value, so a head
          can give its attention to nothing.

        On ratio-4 layers an **indexer** (a small attention with its own compressed keys: 4 heads × 128 here,
        64 × 128 in Flash) scores every visible compressed row and keeps the top `idx_topk` (32 here, 512 in
        Flash); the others are masked. It runs only when more rows are visible than that, from token 131 here.

        The model calls named hook points while it runs; `sess.capture([...])` records the ones asked for, for
        the selected layers, heads and queries, and materialises attention maps next to the fused computation.
        """),
        code(LOAD, "", CORIOLANUS, """
        cfg = model.config
        sess = model.session(ctx=512, prefill_chunk=64)
        print(len(ids), "tokens; ratios", [cfg.ratio(il) for il in range(cfg.n_layer)], "| indexer top-k", cfg.idx_topk)
        """, check=True),
        md("""
        Capture the whole prefill for three layers of the three kinds (0: raw only, 2: ratio 4, 3: ratio 128),
        two heads, and every 4th query:
        """),
        code("""
        prefill = sess.prefill(ids)
        with sess.capture(["attn.scores", "attn.out", "indexer.topk", "indexer.scores"],
                          layers=[0, 2, 3], heads=[0, 1], queries=range(0, len(ids), 4)) as cap:
            prefill.run(progress=False)
        cap
        """, check=True),
        md("""
        What the last query reads from, layer by layer: the raw ring (the window is its last 64 positions), the
        compressed rows and the tokens each pools, the indexer's rows.
        """),
        code("""
        from ds4lab.viz import KVCacheView

        KVCacheView(sess)
        """),
        code("""
        for il in (0, 2, 3):
            print(cap.attention(il))
        """, check=True),
        md("""
        Each map's columns are the union of what its queries saw: raw rows by position, compressed rows by index,
        and the sink. Per query, in the ratio-4 layer:
        """),
        code("""
        amap = cap.attention(2)
        queries = list(amap.queries)
        for q in (60, 124, 128, 132, 200, 316):
            i = queries.index(q)
            raw = amap.raw_positions[amap.group("raw")[i, 0] > 0]
            print(f"query {q:3d}: raw rows {raw.min():3d}-{raw.max():3d} ({len(raw)}); compressed rows visible "
                  f"{amap.candidates[i].sum():2d} = ({q} + 1) // 4, attended {amap.selected[i].sum():2d}")
        """, check=True),
        md("""
        Up to query 63 the window holds every earlier token; from 64 on it slides. Query 128 sees 32 compressed
        rows, all of them; query 132 sees 33 and the indexer keeps 32.

        `AttentionView` draws the map: queries down, columns in the three groups (raw | compressed | sink);
        compressed rows the indexer dropped for a query are tinted. Large maps are max-pooled before they are
        sent to the browser.
        """),
        code("""
        from ds4lab.viz import AttentionView

        AttentionView(cap, layer=2, head=0)
        """),
        md("""
        ## Where the attention goes

        The weights of a query sum to 1 over raw rows, compressed rows and the sink. Averaged over the queries
        that see compressed rows:
        """),
        code("""
        for il in (0, 2, 3):
            a = cap.attention(il)
            late = a.queries >= 128
            mass = {g: a.group(g)[late].sum(-1).mean(0) for g in ("raw", "comp", "sink")}
            print(f"layer {il} (ratio {a.ratio:3d}): " + "; ".join(
                f"head {h}: raw {mass['raw'][j]:.2f}, compressed {mass['comp'][j]:.2f}, sink {mass['sink'][j]:.2f}"
                for j, h in enumerate(a.heads)))
        """),
        md("""
        ## The indexer's choices

        `blk.2.indexer.topk` is the mask the indexer produced, `[queries, compressed capacity]`: the rows each
        query may attend. It is the attention map's selection, and never more than 32 rows:
        """),
        code("""
        topk = cap["blk.2.indexer.topk"]
        scores = cap["blk.2.indexer.scores"]
        pos = cap.positions("blk.2.indexer.topk")
        print("mask", topk.shape, "scores", scores.shape, "| same as the map's selection:",
              np.array_equal(topk[:, :amap.n_comp], amap.selected), "| most rows kept:", topk.sum(1).max())
        """, check=True),
        code("""
        q = 316
        i = list(pos).index(q)
        kept = np.nonzero(topk[i])[0]
        dropped = np.setdiff1d(np.arange((q + 1) // 4), kept)
        print(f"query {q} keeps rows {kept.tolist()}")
        print(f"and drops {dropped.tolist()}")
        """),
        md("""
        The indexer is not a recency rule: it keeps rows from the whole prompt and drops some recent ones (whose
        tokens the raw window covers anyway). The chart shows every query's choice among the rows it could see:
        """),
        code("""
        import altair as alt

        from ds4lab.viz import offline_charts

        offline_charts()  # drawn by JupyterLab's own Vega-Lite renderer (no CDN); a PNG for saved notebooks
        # every 8th query from 128 on, one cell per visible row (the data travels inline with the chart)
        cells = [dict(q=int(p), r=int(r), kept="kept" if topk[i, r] else "dropped")
                 for i, p in enumerate(pos) if p >= 128 and p % 8 == 0 for r in range((p + 1) // 4)]
        alt.Chart(alt.Data(values=cells)).mark_rect().encode(
            x=alt.X("r:O", title="compressed row (4 tokens each)", axis=alt.Axis(values=list(range(0, 80, 8)))),
            y=alt.Y("q:O", title="query position", axis=alt.Axis(values=list(range(128, 320, 32)))),
            color=alt.Color("kept:N", scale=alt.Scale(domain=["kept", "dropped"], range=["#3182bd", "#fcbba1"])),
            tooltip=["q:Q", "r:Q", "kept:N"],
        ).properties(title=f"layer 2's indexer: top-{cfg.idx_topk} of the visible rows", width=420, height=200)
        """),
        md("""
        The chart builders of `ds4lab.viz.charts` reduce a prefill to one row per chunk and layer kind: here the
        KV bytes. The ratio-4 layers grow by a compressed row and an indexer row every 4 tokens, the ratio-128
        layers by one row every 128, the raw-only layers not at all once the window is full.
        """),
        code("""
        from ds4lab.viz.charts import kv_bytes_chart

        kv_bytes_chart(sess, prefill.chunks)
        """),
        md("""
        ## Ratio 128: few rows, all visible

        Layer 3 has one row for tokens 0–127 and one for 128–255; no indexer. A row becomes visible at the query
        that completes it (127, then 255):
        """),
        code("""
        a3 = cap.attention(3)
        print("rows pool tokens", a3.comp_windows)
        for q in (124, 128, 252, 256):
            i = list(a3.queries).index(q)
            print(f"query {q}: sees {a3.candidates[i].sum()} compressed row(s)")
        """, check=True),
        md("""
        ## The other half of a layer: experts

        After attention, each layer's FFN sends every token to `n_expert_used` of `n_expert` routed experts (2 of
        8 here, 6 of 256 in Flash) plus a shared one. The first `n_hash_layer` layers (0–2) choose by a fixed
        table indexed by the token id; the others by the router's top-k. `ExpertView` captures
        `blk.{il}.moe.experts` over a prefill and draws tokens per expert, layer by layer; `expert_load_chart`
        is the same as an Altair heatmap.
        """),
        code("""
        from ds4lab.viz import ExpertView
        from ds4lab.viz.charts import expert_load_chart

        experts = ExpertView.from_prompt(model.session(ctx=512, prefill_chunk=64), ids)
        experts
        """),
        code("expert_load_chart(experts)"),
        md("""
        ## The map is the attention the model computed

        The map is computed on request from the captured queries and keys; summing `weights · keys` reproduces the
        fused attention output the model used, to rounding:
        """),
        code("""
        print(f"max |Σ weights·keys − attn.out| = {np.abs(amap.output() - cap['blk.2.attn.out']).max():.1e}")
        """, check=True),
    ]


# -- 05 -------------------------------------------------------------------------------------------------
def tiers():
    return [
        md("""
        # Tiers: splitting the layers over devices

        A **placement** maps the embedding, every layer and the output head to a tier (a device). Whenever the
        next unit lives on another tier, the hidden state moves, in one of three modes:

        - **decode**: one token's hidden state, `n_hc × n_embd` floats (4 × 256 here; 4 × 4096 in Flash);
        - **batch**: the whole chunk's hidden states, `chunk × n_hc × n_embd`, once per tier boundary per chunk;
        - **no-copy**: only the active tier changes; at the start of a step (the embedding is computed on its own
          tier, nothing is carried over) and between tiers that share a device.

        Every switch is recorded. Without `devices`, tiers are *logical*: each is its own device, a switch makes
        a real copy and the bytes are real; with MLX, `devices=["cpu", "gpu"]` runs layers on each device's
        stream. (ds4 itself runs one device per process; these switches are the design of the articles ds4lab
        was described from.) Results never depend on the plan.
        """),
        code(LOAD, "", SHORT_PROMPT, """
        print(len(ids), "prompt tokens")
        """, check=True),
        md("""
        ## Plans

        `Placement.even(n)` cuts the layers into equal contiguous runs; `Placement.by_memory(budgets)` sizes the
        runs in proportion to each tier's byte budget (weights and KV, as llama.cpp's tensor split does), and
        checks that each tier fits; `Placement([...])` places every layer explicitly: here alternating, the
        worst plan, with a boundary after every layer. A session resolves its plan against the model and its KV
        arrays:
        """),
        code("""
        from ds4lab import Placement

        plans = {
            "single": Placement.single(),
            "even(2)": Placement.even(2),
            "by_memory": Placement.by_memory([16 << 20, 8 << 20]),
            "alternating": Placement([0, 1, 0, 1, 0, 1]),
        }
        sessions = {name: model.session(ctx=256, prefill_chunk=64, placement=p) for name, p in plans.items()}
        for s in sessions.values():
            print(s.placement, end="\\n\\n")
        """, check=True),
        md("""
        `activations` is the chunk's hidden-state buffer that a tier running anything must hold. Per unit:
        """),
        code("""
        for row in sessions["by_memory"].placement.table():
            print(f"{row['unit']:>8}: tier {row['tier']} ({row['device']}), weights {row['weights']:>9,}, KV {row['kv']:>7,}")
        """, check=True),
        md("""
        ## Run and trace

        Prefill the prompt (3 chunks) and decode 4 tokens greedily on every plan. `sess.tier_trace` holds every
        switch: the step, the unit about to run (−1 the embedding, 6 the head), the tiers, the mode, the bytes and
        the seconds; each `PrefillChunk` and `DecodeStep` carries its own.
        """),
        code("""
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
                print(f"step {step}: {len(sws)} switches ({modes}), {sum(sw.bytes for sw in sws):>9,} bytes")

        per_step(sessions["alternating"])
        """, check=True),
        code("""
        for sw in [sw for sw in sessions["alternating"].tier_trace if sw.step in (2, 3)]:
            print(f"step {sw.step}, before unit {sw.layer:2d}: tier {sw.from_tier} -> {sw.to_tier}  "
                  f"{sw.mode:8} {sw.bytes:>8,} bytes")
        """, check=True),
        md("""
        `TierView` draws a session's plan and trace: the layer stack coloured by tier, the last step's switches,
        and the bytes of every step against the two bounds, a full chunk per boundary (batch) and one token per
        boundary (decode). It refreshes itself after each step of its session.
        """),
        code("""
        from ds4lab.viz import TierView

        TierView(sessions["alternating"])
        """),
        md("""
        Step 2 is the last prefill chunk (tokens 128–155: 28 rows of 4 × 256 float64 values, 8,192 bytes each),
        step 3 the first decoded token (one row). Each step after the first starts with a no-copy switch back to
        the embedding's tier. With `even(2)` there is one boundary:
        """),
        code("""
        per_step(sessions["even(2)"])
        chunk_bytes = [c.tier_bytes for c in results["even(2)"][2]]
        token_bytes = [s.tier_bytes for s in results["even(2)"][3]]
        print("bytes per prefill chunk:", chunk_bytes, "| per decoded token:", token_bytes)
        """, check=True),
        md("""
        ## Bytes moved vs chunk size

        In batch mode each token's hidden state crosses each boundary once, whatever the chunk size: the chunk
        size sets how many copies carry those bytes, not how many bytes there are. Smaller chunks mean more
        switches, each with its own latency (on real devices, a synchronisation).
        """),
        code("""
        sweep = []
        for chunk in (8, 16, 32, 64, 128, 256):
            s = model.session(ctx=256, prefill_chunk=chunk, placement=Placement.even(2))
            s.prefill(ids).run(progress=False)
            copies = [sw for sw in s.tier_trace if sw.mode == "batch"]
            sweep.append(dict(chunk=chunk, switches=len(copies), bytes=sum(sw.bytes for sw in copies),
                              seconds=sum(sw.seconds for sw in copies)))
            print(f"chunk {chunk:3d}: {len(copies):2d} batch copies, {sweep[-1]['bytes']:,} bytes "
                  f"= {len(ids)} tokens × {sweep[-1]['bytes'] // len(ids):,}")
        """, check=True),
        code("""
        import altair as alt

        from ds4lab.viz import offline_charts

        offline_charts()  # drawn by JupyterLab's own Vega-Lite renderer (no CDN); a PNG for saved notebooks
        base = alt.Chart(alt.Data(values=sweep)).encode(x=alt.X("chunk:O", title="prefill_chunk"))
        base = base.properties(width=200, height=140)
        (base.mark_bar().encode(y=alt.Y("switches:Q", title="batch copies"))
         | base.mark_line(point=True).encode(y=alt.Y("bytes:Q", title="bytes moved", scale=alt.Scale(zero=True)))
         | base.mark_bar(color="#fdae6b").encode(y=alt.Y("seconds:Q", title="seconds copying")))
        """),
        md("""
        ## Results do not depend on the plan

        The same logits, to the bit, and the same tokens on every plan: a switch moves the hidden state, it
        never changes it.
        """),
        code("""
        ref_logits, ref_tokens, _, _ = results["single"]
        for name, (logits, tokens, _, _) in results.items():
            print(f"{name:12} logits bit-identical: {np.array_equal(logits, ref_logits)}, same tokens: {tokens == ref_tokens}")
        """, check=True),
    ]


NOTEBOOKS = {
    "01_quickstart.ipynb": quickstart,
    "02_chunked_prefill.ipynb": chunked_prefill,
    "03_kv_checkpoints.ipynb": kv_checkpoints,
    "04_compressed_attention_and_indexer.ipynb": compressed_attention,
    "05_tiers_and_placement.ipynb": tiers,
}


def build(name: str):
    """The notebook ``name`` with its cells and no outputs."""
    return nbf.v4.new_notebook(
        cells=NOTEBOOKS[name](),
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )


def execute(nb) -> float:
    """Run ``nb`` in place in a fresh kernel of this interpreter (cwd: notebooks/); returns the seconds."""
    import nbclient

    began = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(HERE)}}).execute()
    return time.perf_counter() - began


def main(argv: list[str]) -> None:
    run = "--no-execute" not in argv
    prefixes = [a for a in argv if not a.startswith("--")]
    for name in NOTEBOOKS:
        if prefixes and not any(name.startswith(p) for p in prefixes):
            continue
        nb = build(name)
        if run:
            print(f"{name}: executed in {execute(nb):.1f} s", file=sys.stderr)
        nbf.write(nb, HERE / name)


if __name__ == "__main__":
    main(sys.argv[1:])
