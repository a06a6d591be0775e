"""Sessions: chunked prefill vs one-shot, decode vs one-shot, checkpoints, sync, failure atomicity,
geometry rules and the one reusable compiled step."""

import re

import numpy as np
import pytest

import ds4lab
from ds4lab.config import PRO
from ds4lab.kv.layout import PRO_CHUNK, Geometry, chunk_from_env
from ds4lab.kv.payload import PayloadError
from ds4lab.runtime.tables import ending

PROMPT = np.random.default_rng(11).integers(0, 1000, 300).tolist()  # crosses 127/255 and the indexer at 67


@pytest.fixture(scope="module")
def nano_np(model_paths):
    return ds4lab.load(model_paths["nano"], backend="numpy")


@pytest.fixture(scope="module")
def nano_mlx(model_paths):
    return ds4lab.load(model_paths["nano"], backend="mlx")


@pytest.fixture(scope="module")
def one_shot(nano_np):
    s = nano_np.session(ctx=400, prefill_chunk=len(PROMPT))
    s.prefill(PROMPT).run(progress=False)
    return s


def layer_arrays(sess):
    kv = sess.kv
    out = {}
    for lk in kv:
        out[lk.layer, "raw"] = lk.raw
        for name in ("comp", "index"):
            if getattr(lk, name) is not None:
                out[lk.layer, name] = getattr(lk, name)
        for name in ("comp_pending", "index_pending"):
            if getattr(lk, name) is not None:
                out[lk.layer, name + "_kv"], out[lk.layer, name + "_score"] = getattr(lk, name)
    return out


# Chunk sizes that do and do not divide the compression ratios; float64 chunked and one-shot runs differ
# only in BLAS summation order (~1e-16), far below any FP8/F16 rounding step.
@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 100, 300, 512])
def test_chunked_prefill_equals_one_shot(chunk, nano_np, one_shot):
    s = nano_np.session(ctx=400, prefill_chunk=chunk)
    chunks = s.prefill(PROMPT).run(progress=False)
    assert [c.start for c in chunks] == list(range(0, 300, min(chunk, 300)))
    np.testing.assert_allclose(s.logits, one_shot.logits, rtol=1e-9, atol=1e-9)
    want = layer_arrays(one_shot)
    got = layer_arrays(s)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-9, err_msg=str(key))


def test_one_shot_prefill_equals_model_logits(nano_np, one_shot):
    np.testing.assert_allclose(one_shot.logits, nano_np.logits(PROMPT)[-1], rtol=1e-9, atol=1e-9)


def test_decode_equals_one_shot_at_every_position(nano_np):
    s = nano_np.session(ctx=400, prefill_chunk=64)
    s.prefill(PROMPT[:200]).run(progress=False)
    decode = s.decoder(temperature=0)
    seen = [s.logits]
    for step in decode.stream(24):
        seen.append(s.logits)
        assert step.position == len(s.tokens) - 1
    full = nano_np.logits(s.tokens)
    np.testing.assert_allclose(np.array(seen[:-1]), full[199:len(s.tokens) - 1], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(seen[-1], full[-1], rtol=1e-9, atol=1e-9)
    assert [st for st in s.tokens[200:]] == [int(np.argmax(x)) for x in seen[:-1]]


def test_prefill_record_fields(nano_np):
    s = nano_np.session(ctx=400, prefill_chunk=64)
    p = s.prefill(PROMPT)
    assert len(p) == 5 and p.remaining == 300
    c = p.step()
    assert (c.start, c.end, c.n_tokens) == (0, 64, 64) and c.tokens_per_s > 0
    assert c.rows[0] == {"raw": 64, "comp": 0, "index": 0}
    assert c.rows[2] == {"raw": 64, "comp": 16, "index": 16}
    assert c.rows[3] == {"raw": 64, "comp": 0, "index": 0}
    assert c.kv_bytes == s.kv.nbytes
    assert p.remaining == 236 and len(p) == 5
    rest = list(p)
    assert rest[0].rows[3]["comp"] == 1  # the first ratio-128 row ends at position 127, in 64–127
    assert p.remaining == 0 and s.tokens == PROMPT


def test_resumed_prefill_is_aligned_to_the_chunk_grid(nano_np):
    s = nano_np.session(ctx=400, prefill_chunk=64)
    s.prefill(PROMPT[:100]).run(progress=False)
    chunks = s.prefill(PROMPT).run(progress=False)
    assert [(c.start, c.end) for c in chunks] == [(100, 128), (128, 192), (192, 256), (256, 300)]


def test_checkpoints_restore_exactly(nano_mlx):
    s = nano_mlx.session(ctx=400, prefill_chunk=64)
    chunks = s.prefill(PROMPT).run(progress=False)
    cp = s.checkpoint()
    logits = s.logits.copy()
    kv = layer_arrays(s)
    list(s.decoder(seed=5).stream(7))
    s.restore(cp)
    assert s.tokens == PROMPT and np.array_equal(s.logits, logits)
    after = layer_arrays(s)
    assert all(np.array_equal(after[k], kv[k]) for k in kv)
    # through the DSV4 bytes (float32 rows: exact on MLX)
    data = cp.to_bytes()
    assert len(data) == s.kv.nbytes
    list(s.decoder(seed=5).stream(3))
    s.restore(ds4lab.Checkpoint.from_bytes(data, nano_mlx.config))
    assert s.tokens == PROMPT and np.array_equal(s.logits, logits)
    after = layer_arrays(s)
    assert all(np.array_equal(after[k], kv[k]) for k in kv)
    # and generation continues identically from the restored state
    a = [st.token for st in s.decoder(seed=9).stream(6)]
    s.restore(cp)
    assert a == [st.token for st in s.decoder(seed=9).stream(6)]
    # every chunk's checkpoint restores its boundary
    fresh = nano_mlx.session(ctx=400, prefill_chunk=64)
    for c in chunks[:3]:
        fresh.prefill(PROMPT[:c.end]).run(progress=False)
        s.restore(c.checkpoint)
        assert s.tokens == PROMPT[:c.end] and np.array_equal(s.logits, fresh.logits)


def test_checkpoints_serialize_without_model_arguments(nano_mlx):
    """``cp.to_bytes()`` and ``Checkpoint.from_bytes(b)``: a checkpoint knows its model's configuration, and a
    payload's header and row counts give the layout without one."""
    s = nano_mlx.session(ctx=256, prefill_chunk=32)
    s.prefill(PROMPT[:150]).run(progress=False)
    cp = s.checkpoint()
    data = cp.to_bytes()
    back = ds4lab.Checkpoint.from_bytes(data)
    assert back.tokens == cp.tokens and np.array_equal(back.logits, cp.logits) and back.to_bytes() == data
    assert ds4lab.Checkpoint.from_bytes(data, nano_mlx.config).to_bytes() == data
    fresh = nano_mlx.session(ctx=256, prefill_chunk=32)
    fresh.restore(back)
    assert fresh.tokens == s.tokens and np.array_equal(fresh.logits, s.logits)
    assert fresh.kv.nbytes == s.kv.nbytes and all(
        np.array_equal(a, b) for a, b in zip(layer_arrays(fresh).values(), layer_arrays(s).values()))
    bare = ds4lab.Checkpoint(cp.tokens, cp.logits, cp.state)  # made by hand, without its model
    with pytest.raises(ValueError, match="Session.checkpoint"):
        bare.to_bytes()


def test_payload_from_another_chunk_restores_as_never_saved(nano_mlx):
    """ds4 has not compared the payload's chunk (prefill_cap) since bb543791: its raw rows are in position order
    and land in the restoring session's own ring. Restored into a session of another chunk, the state continues
    exactly as that session's own prefill of the same tokens does."""
    s = nano_mlx.session(ctx=400, prefill_chunk=256)
    s.prefill(PROMPT[:70]).run(progress=False)
    data = s.checkpoint().to_bytes()
    other = nano_mlx.session(ctx=400, prefill_chunk=32)
    assert (other.geometry.raw_cap, s.geometry.raw_cap) == (256, 400)  # another ring: the rows change slots
    other.restore(ds4lab.Checkpoint.from_bytes(data, nano_mlx.config))
    other.prefill(PROMPT[:110]).run(progress=False)  # from the restored 70 tokens
    never = nano_mlx.session(ctx=400, prefill_chunk=32)
    never.prefill(PROMPT[:110]).run(progress=False)
    assert other.tokens == never.tokens and np.array_equal(other.logits, never.logits)
    assert all(np.array_equal(a, b) for a, b in zip(layer_arrays(other).values(), layer_arrays(never).values()))
    small = nano_mlx.session(ctx=16, prefill_chunk=8)  # another raw window (min(swa, ctx)): refused, untouched
    with pytest.raises(PayloadError, match="raw_window|does not fit"):
        small.restore(ds4lab.Checkpoint.from_bytes(data, nano_mlx.config))
    assert small.tokens == []
    with pytest.raises(PayloadError):
        ds4lab.Checkpoint.from_bytes(data[:-3], nano_mlx.config)
    with pytest.raises(PayloadError):
        ds4lab.Checkpoint.from_bytes(data + b"\0", nano_mlx.config)
    bigger = nano_mlx.session(ctx=800, prefill_chunk=256)  # a larger context accepts it (ds4's rule)
    bigger.restore(ds4lab.Checkpoint.from_bytes(data, nano_mlx.config))
    assert bigger.tokens == PROMPT[:70] and np.array_equal(bigger.logits, s.logits)


def test_sync_cases(nano_np):
    s = nano_np.session(ctx=400, prefill_chunk=64)
    r = s.sync(PROMPT[:100])
    assert (r.source, r.reused, r.evaluated) == ("cold", 0, 100)
    for extra in (1, 3, 40):
        n = len(s.tokens)
        r = s.sync(PROMPT[: n + extra])
        assert (r.source, r.reused, r.evaluated) == ("live", n, extra)
    assert s.tokens == PROMPT[:144]
    ref = nano_np.session(ctx=400, prefill_chunk=64)
    ref.prefill(PROMPT[:144]).run(progress=False)
    np.testing.assert_allclose(s.logits, ref.logits, rtol=1e-9, atol=1e-9)
    # diverge inside the live tokens: the longest kept checkpoint that is a prefix is restored
    fork = PROMPT[:130] + [5, 6, 7]
    r = s.sync(fork)
    assert r.source == "checkpoint" and r.reused == 128 and r.evaluated == 5  # the chunk boundary at 128
    ref = nano_np.session(ctx=400, prefill_chunk=64)
    ref.prefill(fork).run(progress=False)
    np.testing.assert_allclose(s.logits, ref.logits, rtol=1e-9, atol=1e-9)
    assert s.sync(fork).evaluated == 0
    with pytest.raises(ValueError, match="non-empty"):
        s.sync([])
    with pytest.raises(ValueError, match="context holds 400"):
        s.sync(PROMPT + PROMPT)
    assert s.tokens == fork  # errors leave the session as it was


def test_interrupted_step_leaves_the_session_consistent(nano_np, monkeypatch):
    s = nano_np.session(ctx=400, prefill_chunk=64)
    p = s.prefill(PROMPT[:200])
    p.step()
    tokens, logits = list(s.tokens), s.logits.copy()
    t = nano_np.transformer
    original = t.ffn_block

    def interrupt(il, *args):
        if il == 3:
            raise KeyboardInterrupt
        return original(il, *args)

    monkeypatch.setattr(t, "ffn_block", interrupt)
    with pytest.raises(KeyboardInterrupt):
        p.step()
    assert s.tokens == tokens and np.array_equal(s.logits, logits)
    monkeypatch.setattr(t, "ffn_block", original)
    p.run(progress=False)
    ref = nano_np.session(ctx=400, prefill_chunk=64)
    ref.prefill(PROMPT[:200]).run(progress=False)
    np.testing.assert_allclose(s.logits, ref.logits, rtol=1e-9, atol=1e-9)


def test_decode_step_sums_the_vocabulary_while_the_device_runs(nano_np, monkeypatch):
    """A decode step launches its forward pass, then computes the sampled token's log-probability (a log-sum-exp
    over the vocabulary: most of a step's host work at Flash's 129,280 logits) before it waits for the device;
    the results are those of computing it first."""
    from ds4lab import session as session_module

    s = nano_np.session(ctx=200, prefill_chunk=64)
    s.sync(PROMPT[:50])
    ref = [(st.token, st.logprob, st.top) for st in s.decoder(seed=4, top=2).stream(3)]
    s.sync(PROMPT[:50])
    order = []
    for name in ("_launch", "_finish"):
        method = getattr(s, name)
        monkeypatch.setattr(s, name, lambda *a, _m=method, _n=name: order.append(_n) or _m(*a))
    both = session_module.token_and_top_logprobs
    monkeypatch.setattr(session_module, "token_and_top_logprobs", lambda *a: order.append("logprob") or both(*a))
    got = [(st.token, st.logprob, st.top) for st in s.decoder(seed=4, top=2).stream(3)]
    assert got == ref
    assert order == ["_launch", "logprob", "_finish"] * 3


def test_seeded_decoding_reproduces(nano_mlx):
    s = nano_mlx.session(ctx=200, prefill_chunk=64)
    s.sync(PROMPT[:50])
    cp = s.checkpoint()
    runs = []
    for seed in (1, 1, 2):
        s.restore(cp)
        runs.append([st.token for st in s.decoder(seed=seed, temperature=1.0, min_p=0.0).stream(12)])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    step = s.decoder(seed=3).step()
    assert step.top[0][1] >= step.top[-1][1] and step.logprob <= 0 and step.seconds > 0


def test_decode_stops_at_the_context_limit(nano_np):
    s = nano_np.session(ctx=40, prefill_chunk=16)
    s.sync(PROMPT[:35])
    d = s.decoder(temperature=0)
    steps = list(d.stream(100))
    assert len(s.tokens) == 40 and d.stop_reason == "ctx" and len(steps) == 5


def test_generate_renders_chat(nano_np):
    s = nano_np.session(ctx=256, prefill_chunk=64)
    text = s.generate("Hello", max_tokens=5, temperature=0)
    ids = nano_np.tokenizer.render_chat([{"role": "user", "content": "Hello"}], think=False)
    assert s.tokens[: len(ids)] == ids and isinstance(text, str)


def test_geometry_follows_ds4(nano_np, monkeypatch):
    cfg = nano_np.config
    monkeypatch.delenv("DS4_METAL_PREFILL_CHUNK", raising=False)
    monkeypatch.delenv("DS4_METAL_GRAPH_RAW_CAP", raising=False)
    assert chunk_from_env(4096) == 2048 and chunk_from_env(1000) == 1000
    for env, want in (("512", 512), ("9999", 4096), ("0", 4096), ("-3", 4096), ("abc", 4096)):
        monkeypatch.setenv("DS4_METAL_PREFILL_CHUNK", env)
        assert chunk_from_env(4096) == want, env
        assert Geometry.for_context(cfg, 4096, long_chunks=True).chunk == want  # the variable wins there too
    monkeypatch.delenv("DS4_METAL_PREFILL_CHUNK")
    g = Geometry.for_context(cfg, 4096)
    assert (g.chunk, g.raw_cap, g.window) == (2048, 2304, 32)  # align_up(32 + 2048, 256)
    # ds4's later rule (since 9ba160ae), a backend's whose chunks run eagerly (CuPy): 4096, Pro 8192, where the
    # context is longer, else the whole context in one chunk
    g = Geometry.for_context(cfg, 8192, long_chunks=True)
    assert (g.chunk, g.raw_cap) == (4096, 4352) and Geometry.for_context(cfg, 4096, long_chunks=True).chunk == 4096
    assert Geometry.for_context(PRO, 32768, long_chunks=True).chunk == 8192 == PRO_CHUNK
    assert Geometry.for_context(PRO, 32768).chunk == 2048
    assert Geometry.for_context(cfg, 100, 64).raw_cap == 100  # never more than ctx
    monkeypatch.setenv("DS4_METAL_GRAPH_RAW_CAP", "300")
    g = Geometry.for_context(cfg, 4096, 512)
    assert g.raw_cap == 300 and g.step == 268  # a chunk and the window must fit the ring together
    s = nano_np.session(ctx=1000, prefill_chunk=512)
    assert s.geometry.raw_cap == 300
    s.prefill(PROMPT).run(progress=False)
    for env in ("32", "0", "-5"):  # the window or less: one slot past it, a token a step (was step 0: a division by 0)
        monkeypatch.setenv("DS4_METAL_GRAPH_RAW_CAP", env)
        g = Geometry.for_context(cfg, 4096, 512)
        assert (g.raw_cap, g.step) == (33, 1), env
    assert Geometry.for_context(cfg, 32, 32).raw_cap == 32  # a ring of the whole context takes whole chunks
    short = nano_np.session(ctx=1000, prefill_chunk=512)
    short.prefill(PROMPT[:40]).run(progress=False)
    monkeypatch.delenv("DS4_METAL_GRAPH_RAW_CAP")
    ref = nano_np.session(ctx=1000, prefill_chunk=512)
    ref.prefill(PROMPT[:40]).run(progress=False)
    np.testing.assert_allclose(short.logits, ref.logits, rtol=1e-9, atol=1e-9)
    ref.prefill(PROMPT).run(progress=False)
    np.testing.assert_allclose(s.logits, ref.logits, rtol=1e-9, atol=1e-9)


def test_one_compiled_step_per_layer_and_chunk_size(model_paths):
    # MLX's cpu device: its plain ops compile per layer (on a GPU the kernels' decode step is one whole call)
    model = ds4lab.load(model_paths["nano"], backend="mlx", device="cpu")
    rt = model.runtime
    rt.compile = True
    s = model.session(ctx=400, prefill_chunk=64)
    chunks = s.prefill(PROMPT[:250]).run(progress=False)
    assert len(chunks) == 4 and chunks[-1].n_tokens == 58  # the last chunk is partial (padded)
    assert rt.trace_count == model.config.n_layer  # one trace per layer, shared by all four chunks
    s.prefill(PROMPT).run(progress=False)  # a resumed chunk (250-256) and another: no new trace
    assert rt.trace_count == model.config.n_layer
    start = len(s.tokens)
    list(s.decoder(temperature=0).stream(4))  # decode is its own shape: one more trace per layer and set of windows
    cfg = model.config
    ratios = [cfg.ratio(il) for il in range(cfg.n_layer) if cfg.ratio(il)]
    sets = [ending(ratios, p, 1) for p in range(start, start + 4)]
    assert set(sets) == {(), (4,)}  # position 303 ends a ratio-4 window: its layers trace a second decode half
    assert rt.trace_count == cfg.n_layer + sum(len({cfg.ratio(il) in e for e in sets}) for il in range(cfg.n_layer))
    eager = ds4lab.load(model_paths["nano"], backend="mlx", device="cpu")
    eager.runtime.compile = False
    e = eager.session(ctx=400, prefill_chunk=64)
    e.prefill(PROMPT).run(progress=False)
    list(e.decoder(temperature=0).stream(4))
    assert e.tokens == s.tokens
    np.testing.assert_allclose(e.logits, s.logits, rtol=1e-4, atol=1e-4)


def test_decode_stops_at_eos_without_evaluating_it(nano_np):
    s = nano_np.session(ctx=200, prefill_chunk=64)
    s.sync(PROMPT[:20])
    s.logits = s.logits.copy()
    s.logits[nano_np.tokenizer.eos_id] = 1e4  # make EOS the greedy choice
    d = s.decoder(temperature=0)
    assert list(d.stream(10)) == [] and d.stop_reason == "eos"
    assert s.tokens == PROMPT[:20]
    with pytest.raises(RuntimeError, match="stopped"):
        d.step()


def test_decode_excludes_tokens_from_sampling_but_not_from_logprobs(nano_np):
    s = nano_np.session(ctx=200, prefill_chunk=64)
    s.sync(PROMPT[:20])
    logits = s.logits.astype(np.float64)
    order = np.argsort(-logits, kind="stable")
    best, second = int(order[0]), int(order[1])
    step = s.decoder(temperature=0, exclude=[best]).step()
    assert step.token == second  # greedy among the rest
    assert step.top[0][0] == best  # the reported alternatives are the model's own, best first
    log_z = logits.max() + np.log(np.exp(logits - logits.max()).sum())
    assert abs(step.logprob - (logits[second] - log_z)) < 1e-5

    vocab = nano_np.config.n_vocab
    for bad in ([-1], [vocab], [3, vocab + 7]):  # named, on every backend (not wrapped as NumPy's indexing would)
        with pytest.raises(ValueError, match=rf"exclude: token ids must be in \[0, {vocab}\), got \[{bad[-1]}\]"):
            s.decoder(exclude=bad)


def test_packed_layers_unflatten_once_and_only_when_read():
    """A compiled step's state (PackedLayers) makes its LayerStates on the first read, once; its length is
    known before that, and it reads like the tuple it stands for."""
    from ds4lab.kv.layout import LayerState, PackedLayers

    calls = []

    def unflatten(arrays):
        calls.append(len(arrays))
        return tuple(LayerState(raw=a) for a in arrays)

    arrays = [np.full((2, 3), i, np.float32) for i in range(4)]
    layers = PackedLayers(arrays, 4, unflatten)
    assert len(layers) == 4 and calls == []
    assert layers[-1].raw is arrays[3] and calls == [4]
    assert all(la.raw is a for la, a in zip(layers, arrays, strict=True)) and calls == [4]
    assert [id(la.raw) for la in layers[1:3]] == [id(a) for a in arrays[1:3]] and calls == [4]


@pytest.mark.parametrize("change", ["truncated", "rewritten", "replaced"])
def test_a_model_file_changed_under_a_session_is_a_clear_error(model_paths, tmp_path, change):
    """A weight read from a truncated mapping kills the process with SIGBUS; one written in place would be used
    under the live KV state. The session checks the file before each step."""
    import os
    import shutil

    from ds4lab.config import ModelFileError

    path = shutil.copy(model_paths["nano"], tmp_path / "m.gguf")
    sess = ds4lab.load(path, backend="numpy").session(ctx=128, prefill_chunk=32)
    sess.prefill(PROMPT[:40]).run(progress=False)
    blob = open(path, "rb").read()
    if change == "truncated":
        os.truncate(path, len(blob) // 2)
    elif change == "rewritten":  # same size, same inode, new bytes (and a new mtime)
        with open(path, "r+b") as f:
            f.seek(len(blob) - 4096)
            f.write(bytes(4096))
        os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 1_000_000))
    else:
        (tmp_path / "new.gguf").write_bytes(blob)
        os.replace(tmp_path / "new.gguf", path)
    before = list(sess.tokens)
    with pytest.raises(ModelFileError, match=f"(?s){path}.*changed since it was loaded"):
        sess.sync(PROMPT[:41])
    assert sess.tokens == before


def test_a_live_checkpoint_of_another_backend_restores_through_its_bytes(model_paths):
    """Same file, same geometry, another backend: its arrays are not this backend's, so the state is rebuilt
    from the payload (the arrays used as they were broke every later step)."""
    a = ds4lab.load(model_paths["nano"], backend="numpy").session(ctx=128, prefill_chunk=32)
    b = ds4lab.load(model_paths["nano"], backend="mlx", device="cpu").session(ctx=128, prefill_chunk=32)
    a.sync(PROMPT[:40])
    b.restore(a.checkpoint())
    b.sync(PROMPT[:41])
    ref = ds4lab.load(model_paths["nano"], backend="mlx", device="cpu").session(ctx=128, prefill_chunk=32)
    ref.sync(PROMPT[:41])
    assert np.abs(b.logits - ref.logits).max() < 1e-3 * np.abs(ref.logits).max()


def test_ids_on_the_device_need_a_compiled_step(nano_np):
    """``device_ids`` (a token chosen on the device) is taken only where the step is one compiled call; elsewhere
    (NumPy: nothing compiles) a clear error, and the state given is left as it was."""
    state = nano_np.new_state(64)
    with pytest.raises(ValueError, match="ids on the device need a chunk that runs as one compiled call"):
        nano_np.runtime.forward_logits(np.array([5]), state, device_ids=np.array([5], np.int32))
    assert state.n_past == 0 and not nano_np.runtime.whole(1)


def test_rope_rows_gathered_on_the_device_are_the_uploaded_ones(model_paths, monkeypatch):
    """MLX's CUDA back-end gathers a chunk's RoPE rows on the device from tables it keeps there
    (``MLXBackend.gathers_rope_rows``): the logits of a chunked prefill and of decode steps are those of the rows
    uploaded from the host, bit for bit. Forced here on MLX's CPU, with tables of 64 positions at first, so that
    the kept tables double (and their device copies are made again) past position 63."""
    pytest.importorskip("mlx.core")
    from ds4lab.backends.mlx_backend import MLXBackend
    from ds4lab.model import rope

    monkeypatch.setattr(rope, "ROWS_MIN", 64)
    ids = np.random.default_rng(4).integers(0, 1000, 70).tolist()

    def logits():
        monkeypatch.setattr(rope, "_ROWS", {})
        sess = ds4lab.load(model_paths["nano"], backend="mlx", device="cpu").session(ctx=128, prefill_chunk=32)
        sess.sync(ids[:66])  # three chunks, the last past position 63
        out = [sess.logits]
        for end in range(67, len(ids) + 1):  # decode steps
            sess.sync(ids[:end])
            out.append(sess.logits)
        return np.stack(out)

    want = logits()
    gathered, rope_rows = [], MLXBackend.rope_rows

    def counted(self, params, positions, on_device):
        gathered.append(len(positions))
        return rope_rows(self, params, positions, on_device)

    monkeypatch.setattr(MLXBackend, "gathers_rope_rows", True)
    monkeypatch.setattr(MLXBackend, "rope_rows", counted)
    np.testing.assert_array_equal(logits(), want)
    assert 32 in gathered and 1 in gathered  # the chunks' rows and the decode steps'


@pytest.mark.parametrize("ctx,chunk", [(340, 32), (100, 32), (4096, 2048)])
def test_live_rows_are_the_rows_a_kv_payload_holds(nano_np, ctx, chunk):
    """runtime.compiled.live_rows after n tokens names, for every array of the state, the rows a .kv payload of it
    keeps (layer_to_payload: the window's ring slots in order, the rows below the count) and None for the pending
    states, at every n up to the context (rings that wrap and that do not)."""
    from ds4lab.kv.checkpoint import layer_to_payload
    from ds4lab.kv.layout import new_state
    from ds4lab.runtime.compiled import live_rows, present

    cfg = nano_np.config
    state = new_state(cfg, nano_np.backend, Geometry.for_context(cfg, ctx, chunk))
    for layer in state.layers:  # every row its own index, so a payload's rows name themselves
        for a in present(layer):
            a[...] = np.arange(len(a), dtype=np.float32)[:, None]
    for n in range(0, ctx + 1, 7):
        it = iter(live_rows(cfg, state.geometry, n))
        for il, layer in enumerate(state.layers):
            saved = layer_to_payload(cfg, nano_np.backend, il, layer, n, state.geometry)
            for f in ("raw", "comp", "comp_state_kv", "comp_state_score", "index", "index_state_kv",
                      "index_state_score"):
                if getattr(layer, f) is None:
                    continue
                live, kept = next(it), getattr(saved, f)
                if live is None:
                    assert f not in ("raw", "comp", "index") and kept.shape == getattr(layer, f).shape
                    continue
                rows = np.concatenate([np.arange(a, b) for a, b in live]) if live else np.zeros(0)
                assert np.array_equal(kept[:, 0], rows), (n, il, f)
        assert next(it, None) is None


# -- a bad-input probe of the Python API (2026-12-06): each of these failed later, or not at all, naming nothing --

@pytest.mark.parametrize("kwargs, error, named", [
    (dict(ctx="64"), TypeError, "ctx must be an integer, got '64'"),
    (dict(ctx=True), TypeError, "ctx must be an integer"),
    (dict(ctx=64, prefill_chunk=2.5), TypeError, "prefill_chunk must be an integer, got 2.5"),
    (dict(ctx=64, kv_store="dir"), TypeError, "kv_store must be a ds4lab.KVStore"),
    (dict(ctx=64, placement="even"), TypeError, "placement must be a ds4lab.Placement"),
    (dict(ctx=10**9), MemoryError, "ctx 1000000000: the session's KV state does not fit in memory"),
])
def test_session_arguments_are_checked_when_made(nano_np, kwargs, error, named):
    """prefill_chunk=2.5 failed at the first prefill (slice indices), kv_store="dir" at the first sync, placement
    "even" with an AttributeError, ctx=10**9 with numpy's MemoryError of 238 GiB (no ctx named)."""
    if error is MemoryError and not _allocation_fails(nano_np, 10**9):
        pytest.skip("this machine allocates a KV state for 10**9 tokens")
    with pytest.raises(error, match=re.escape(named)):
        nano_np.session(**kwargs)
    assert nano_np.session(ctx=np.int64(64), prefill_chunk=np.int32(16)).prefill_chunk == 16  # NumPy's ints are ints


def test_numpy_ints_make_the_first_rope_tables(nano_np, monkeypatch):
    """A first session of NumPy ints made its RoPE tables from ctx.bit_length(), which NumPy's ints lack (the test
    above passed only where an earlier test had made the tables already): the geometry holds Python ints."""
    from ds4lab.model import rope

    monkeypatch.setattr(rope, "_ROWS", {})
    sess = nano_np.session(ctx=np.int64(5000), prefill_chunk=np.int32(512))
    assert type(sess.geometry.ctx) is int and type(sess.geometry.chunk) is int
    assert all(len(cos) >= 5000 for cos, _ in rope._ROWS.values())


def _allocation_fails(model, ctx) -> bool:
    from ds4lab.kv.layout import new_state

    try:
        new_state(model.config, model.backend, Geometry.for_context(model.config, ctx, 16))
    except MemoryError:
        return True
    return False


@pytest.mark.parametrize("bad", [None, b"DSV4", "cache.kv"])
def test_restore_names_what_it_takes(nano_np, bad):
    sess = nano_np.session(ctx=64, prefill_chunk=16)
    with pytest.raises(TypeError, match=f"restore takes a Checkpoint .*got {type(bad).__name__}"):
        sess.restore(bad)
    assert sess.tokens == []


@pytest.mark.parametrize("device", ["tpu", "GPU", "cuda:x"])
def test_load_refuses_an_unknown_device(device):
    """load(device="tpu") with backend auto silently loaded numpy."""
    with pytest.raises(ValueError, match=f"unknown device '{re.escape(device)}'; choose cpu, gpu"):
        ds4lab.load(device=device)
    with pytest.raises(ValueError, match="path: an empty path"):
        ds4lab.load("")


def test_the_memory_warning_is_said_where_the_weights_outgrow_memory(model_paths, monkeypatch):
    """The embedded model's float64 weights and expert cache (about 0.5 GiB) against the memory available."""
    import warnings

    import ds4lab.engine as engine

    monkeypatch.setattr(engine, "available_memory", lambda: 1 << 20)
    model = ds4lab.load(model_paths["nano"], backend="numpy")
    with pytest.warns(UserWarning, match=r"about 0\.5 GiB, where this machine has 0\.0 GiB available"):
        model.session(ctx=64)
    monkeypatch.setattr(engine, "available_memory", lambda: 8 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds4lab.load(model_paths["nano"], backend="numpy").session(ctx=64)  # room enough: nothing said


@pytest.mark.parametrize("make", ["session", "new_state"])
def test_rope_tables_are_made_for_the_sessions_context(nano_np, monkeypatch, make):
    """A session (and Model.new_state, Model.logits' state) makes its RoPE tables for its context when it is made:
    made as steps needed them, a table doubled at the first step past a power of two, 30 ms of that one decode
    step at 32K (the Flash layout on an H100)."""
    from ds4lab.model import rope

    monkeypatch.setattr(rope, "_ROWS", {})
    getattr(nano_np, make)(9000, 512)
    made = dict(rope._ROWS)
    assert set(made) == set(nano_np.transformer.ropes) and all(len(cos) >= 9000 for cos, _ in made.values())
    for params in made:
        cos, _ = params.rows(np.array([8191, 8192, 8999]))  # what a step past 8192 reads: no table made again
        assert rope._ROWS[params] is made[params]
        np.testing.assert_array_equal(cos, params.tables(np.array([8191, 8192, 8999]))[0])


def test_a_backend_of_long_chunks_gets_ds4s_later_chunk(nano_np, monkeypatch):
    """Session and Model.new_state pass the backend's long_prefill_chunks (CuPy's) to the geometry."""
    monkeypatch.setattr(nano_np.backend, "long_prefill_chunks", True)
    assert nano_np.session(ctx=9000).geometry.chunk == 4096
    assert nano_np.new_state(9000).geometry.chunk == 4096
    monkeypatch.setattr(nano_np.backend, "long_prefill_chunks", False)
    assert nano_np.session(ctx=9000).geometry.chunk == 2048


def test_rope_tables_cover_the_windows_past_the_last_token(nano_np, monkeypatch):
    """A context of a power of two: the last positions' windows run past it, into the margin the session
    made its tables with (without it the last chunk's tables doubled)."""
    from ds4lab.model import rope

    monkeypatch.setattr(rope, "_ROWS", {})
    ctx = 16384
    sess = nano_np.session(ctx=ctx, prefill_chunk=512)
    made = dict(rope._ROWS)
    nano_np.runtime.tables(np.arange(512) % 100, ctx - 512, 512)  # the last chunk's tables, windows included
    assert all(rope._ROWS[p] is made[p] for p in made) and sess.geometry.ctx == ctx
