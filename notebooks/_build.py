# ruff: noqa: E501  (cell sources are long strings)
"""Writes 01_chunked_prefill_and_kv_cache.ipynb (source of truth for its cells); outputs come from executing it."""

import nbformat as nbf

md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell
cells = [
    md(
        "# Chunked prefill and the compressed KV cache\n\n"
        "The embedded model is a 6-layer DeepSeek V4 Flash-architecture model trained on Shakespeare: a 64-token raw "
        "window, ratio-4 compressed rows (one every 4 tokens) whose indexer keeps 32 once more are visible, and ratio-128 "
        "rows (at positions 127, 255, …). We prefill a few hundred tokens chunk by chunk and look at the cache after each chunk."
    ),
    code(
        "import ds4lab\nfrom ds4lab.viz import PrefillView, KVCacheView, AttentionView\n"
        "from ds4lab.viz.charts import kv_bytes_chart, prefill_chunks_chart\n\n"
        'model = ds4lab.load(backend="numpy")  # float64 reference backend: fast enough here, on any CPU\n'
        "cfg = model.config\n"
        "[(il, cfg.ratio(il), cfg.has_indexer(il)) for il in range(cfg.n_layer)]"
    ),
    code(
        'prompt = """First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n'
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\n"
        "First Citizen:\nFirst, you know Caius Marcius is chief enemy to the people.\n\nAll:\nWe know't, we know't.\n\n"
        "First Citizen:\nLet us kill him, and we'll have corn at our own price.\nIs't a verdict?\n\n"
        "All:\nNo more talking on't; let it be done: away, away!\n\nSecond Citizen:\nOne word, good citizens.\n\n"
        "First Citizen:\nWe are accounted poor citizens, the patricians good.\nWhat authority surfeits on would relieve us: "
        'if they\nwould yield us but the superfluity, while it were\nwholesome, we might guess they relieved us humanely;"""\n'
        "ids = model.tokenizer.encode(prompt)\n"
        "sess = model.session(ctx=1024, prefill_chunk=64)\n"
        "len(ids), sess.geometry"
    ),
    md(
        "## Step through the prefill\n\nChunks end on absolute multiples of the chunk size. Each step evaluates one chunk; the "
        "KV view below is refreshed after every step (the outlined cells are what the step wrote)."
    ),
    code("kv_view = KVCacheView(sess)\nprefill_view = PrefillView(sess, ids, kv_view=kv_view)\nprefill_view"),
    code(
        "chunk = prefill_view.step()  # chunk 0: tokens 0-63; only raw rows and ratio-4 rows so far\n"
        "chunk.start, chunk.end, round(chunk.tokens_per_s), chunk.kv_bytes"
    ),
    code(
        "prefill_view.step(); prefill_view.step()  # chunk 2 ends at 192: the first ratio-128 row (tokens 0-127) exists\n"
        "kv_view"
    ),
    md(
        "## Capture attention during a chunk\n\nA capture records the named hook points of the steps run inside it; attention "
        "maps are materialised only for the selected layers, heads and queries, with the raw-window keys, the compressed rows and "
        "the sink as separate column groups."
    ),
    code(
        'with sess.capture(["attn.scores", "attn.out"], layers=[2, 3], heads=[0, 1]) as cap:\n'
        "    prefill_view.step()\ncap"
    ),
    code(
        "amap = cap.attention(2)\nprint(amap)\n"
        "import numpy as np\n"
        'print("max |Σ weights·keys − fused output| =", np.abs(amap.output() - cap["blk.2.attn.out"]).max())\n'
        'print("compressed rows each query could see:", amap.candidates.sum(1)[[0, -1]], "kept by the indexer:", amap.selected.sum(1)[[0, -1]])'
    ),
    code("AttentionView(cap, layer=2, head=0)"),
    md("## Finish and chart\n\nThe KV view's slider scrubs through the checkpoints taken after each chunk."),
    code(
        "prefill_view.run()\nkv_view.scrub_through(prefill_view.chunks)\n"
        "[(c.start, c.end, c.kv_bytes) for c in prefill_view.chunks]"
    ),
    code("kv_bytes_chart(sess, prefill_view.chunks) | prefill_chunks_chart(prefill_view.chunks)"),
    md("Chunked and one-shot prefill give the same state: the logits agree."),
    code(
        "one = model.session(ctx=1024, prefill_chunk=1024)\none.prefill(ids).run(progress=False)\n"
        "float(np.abs(one.logits - sess.logits).max())"
    ),
]
nb = nbf.v4.new_notebook(
    cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
)
nbf.write(nb, "notebooks/01_chunked_prefill_and_kv_cache.ipynb")
