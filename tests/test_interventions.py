"""Interventions at the editable hook points, and edited checkpoints saved as .kv files, against independent
computations: float64 attention and MoE written out here, direct state edits, never-intervened sessions."""

import numpy as np
import pytest

import ds4lab
from ds4lab.interventions import (
    Edit,
    ablate_rows,
    ablate_sink,
    force_topk,
    logit_diff,
    patch_row,
    replace_experts,
)
from ds4lab.kv.edit import checkpoint_row, edit_rows, patch_rows, save_kv

PREFIX = 72  # 18 ratio-4 rows: more than idx_topk (16), so the indexer chooses; raw window 32
NEXT = 11  # the decode token evaluated after the prefix


@pytest.fixture(scope="module")
def model(model_paths):
    return ds4lab.load(model_paths["nano"], backend="numpy")


def _prompt(n, vocab, seed):
    return ((np.arange(n) * (7 + seed) + 3 * seed) % (vocab - 10) + 5).tolist()


@pytest.fixture(scope="module")
def prefixes(model):
    """Two prompts' checkpoints after PREFIX tokens (A and B), as float32 payload values restored (so that saving
    one as a .kv file loses nothing), and the session they were taken in."""
    sess = model.session(ctx=256, prefill_chunk=32)
    cps = []
    for seed in (1, 2):
        sess.prefill(_prompt(PREFIX, model.config.n_vocab, seed)).run(progress=False)
        sess.restore(ds4lab.Checkpoint.from_bytes(sess.snapshot().to_bytes(), model.config))
        cps.append(sess.snapshot())
    return sess, cps[0], cps[1]


class Grab:
    """An observer set before an intervention opens (so it sees the edited values): the raw value of each point."""

    def __init__(self, sess):
        self.sess, self.values = sess, {}

    def __enter__(self):
        self.sess.hook_observer = self
        return self

    def __exit__(self, *exc):
        self.sess.hook_observer = None

    def __call__(self, name, value):
        if name.endswith(".attn.scores"):
            value = {k: np.array(v) if hasattr(v, "shape") else v for k, v in value.items()}
        elif not name.endswith((".attn.state", ".span")):
            value = np.array(value)
        self.values[name] = value


def _step(sess, cp, edits=None, token=NEXT):
    """Restore ``cp``, evaluate one token (with ``edits``) and return (logits, grabbed values, intervention)."""
    sess.restore(cp)
    with Grab(sess) as grab:
        if edits is None:
            sess.prefill(list(cp.tokens) + [token]).step()
            return sess.logits.copy(), grab.values, None
        with sess.intervene(edits) as iv:
            sess.prefill(list(cp.tokens) + [token]).step()
    return iv.logits, grab.values, iv


def _attention64(d, sink: bool):
    """softmax(q·k·scale over visible keys [+ the sink logit]) · keys, written out in float64."""
    q, keys, vis = d["q"].astype(np.float64), d["keys"].astype(np.float64), d["visible"]
    s = np.einsum("thd,nd->thn", q, keys) * d["scale"]
    s = np.where(vis[:, None, :], s, -np.inf)
    cols = [s]
    if sink:
        cols.append(np.broadcast_to(np.asarray(d["sinks"], np.float64)[None, :, None], s.shape[:2] + (1,)))
    z = np.concatenate(cols, axis=-1)
    w = np.exp(z - z.max(axis=-1, keepdims=True))
    w = w / w.sum(axis=-1, keepdims=True)
    return np.einsum("thn,nd->thd", w[..., : keys.shape[0]], keys)


def _close(a, b, tol=1e-12):
    assert np.max(np.abs(a - b)) <= tol * max(1.0, np.max(np.abs(b))), np.max(np.abs(a - b))


def test_sink_ablation_equals_float64_attention_without_the_sink(model, prefixes):
    sess, cp, _ = prefixes
    L = 2
    clean, cv, _ = _step(sess, cp)
    logits, ev, iv = _step(sess, cp, [ablate_sink(L)])
    assert iv.applied == [1] and np.isneginf(ev[f"blk.{L}.attn.scores"]["sinks"]).all()
    for il in range(L):  # the layers before are untouched
        np.testing.assert_array_equal(ev[f"blk.{il}.attn.out"], cv[f"blk.{il}.attn.out"])
    d = ev[f"blk.{L}.attn.scores"]
    _close(ev[f"blk.{L}.attn.out"], _attention64(d, sink=False))
    # the same keys with the clean sinks give the clean output, and that differs: the test can fail
    _close(cv[f"blk.{L}.attn.out"], _attention64(cv[f"blk.{L}.attn.scores"], sink=True))
    assert np.max(np.abs(ev[f"blk.{L}.attn.out"] - cv[f"blk.{L}.attn.out"])) > 1e-6
    assert not np.array_equal(logits, clean)


def test_some_heads_sink_ablated(model, prefixes):
    sess, cp, _ = prefixes
    _, cv, _ = _step(sess, cp)
    _, ev, _ = _step(sess, cp, [ablate_sink(3, heads=[1])])
    sinks = ev["blk.3.attn.scores"]["sinks"]
    assert np.isneginf(sinks[1]) and np.array_equal(np.delete(sinks, 1), np.delete(cv["blk.3.attn.scores"]["sinks"], 1))
    out, ref = ev["blk.3.attn.out"], cv["blk.3.attn.out"]
    np.testing.assert_array_equal(np.delete(out, 1, axis=1), np.delete(ref, 1, axis=1))  # other heads: unchanged
    _close(out[:, 1], _attention64(ev["blk.3.attn.scores"], sink=False)[:, 1])


def test_forcing_the_indexers_own_topk_is_bit_identical(model, prefixes):
    sess, cp, _ = prefixes
    clean, cv, _ = _step(sess, cp)
    own = np.nonzero(cv["blk.2.indexer.topk"][0])[0]
    assert len(own) == model.config.idx_topk < PREFIX // 4  # the indexer did choose
    logits, ev, iv = _step(sess, cp, [force_topk(2, own)])
    assert iv.applied == [1]
    np.testing.assert_array_equal(logits, clean)
    for name in cv:
        if name.endswith(".attn.out"):
            np.testing.assert_array_equal(ev[name], cv[name])


def test_forcing_other_rows_changes_only_that_layer_as_the_reference_predicts(model, prefixes):
    sess, cp, _ = prefixes
    L, R = 2, 4
    clean, cv, _ = _step(sess, cp)
    own = set(np.nonzero(cv[f"blk.{L}.indexer.topk"][0])[0].tolist())
    forced = sorted(set(range(PREFIX // R)) - own)[:3] + [17, 40]  # rows it did not choose, and one not written yet
    logits, ev, _ = _step(sess, cp, [force_topk(L, forced)])
    for il in range(L):
        np.testing.assert_array_equal(ev[f"blk.{il}.attn.out"], cv[f"blk.{il}.attn.out"])
    d_clean, d = cv[f"blk.{L}.attn.scores"], ev[f"blk.{L}.attn.scores"]
    n_raw = d_clean["n_raw"]
    # the mask built here: the clean raw visibility, and of the compressed rows exactly `forced` ∩ written
    want = d_clean["visible"].copy()
    comp = np.zeros(want.shape[1] - n_raw, bool)
    comp[[r for r in forced if r < (PREFIX + 1) // R]] = True
    want[:, n_raw:] = comp
    np.testing.assert_array_equal(d["visible"], want)
    np.testing.assert_array_equal(d["keys"], d_clean["keys"])
    _close(ev[f"blk.{L}.attn.out"], _attention64(dict(d_clean, visible=want), sink=True))
    assert np.max(np.abs(ev[f"blk.{L}.attn.out"] - cv[f"blk.{L}.attn.out"])) > 1e-6
    assert not np.array_equal(logits, clean)


def test_ablating_compressed_rows_masks_them_before_the_softmax(model, prefixes):
    sess, cp, _ = prefixes
    _, cv, _ = _step(sess, cp)
    _, ev, iv = _step(sess, cp, [ablate_rows(4, rows=[1, 5]), ablate_rows(2)])
    assert iv.applied == [1, 1]
    for L, gone in ((2, list(range(PREFIX // 4))), (4, [1, 5])):
        d = ev[f"blk.{L}.attn.scores"]
        want = d["visible"].copy()  # raw keys as they were; compressed rows: the indexer's choice less `gone`
        want[:, d["n_raw"]:] = ev[f"blk.{L}.indexer.topk"]
        want[:, [d["n_raw"] + r for r in gone]] = False
        np.testing.assert_array_equal(d["visible"], want)
        raw = slice(0, d["n_raw"])
        np.testing.assert_array_equal(d["visible"][:, raw], cv[f"blk.{L}.attn.scores"]["visible"][:, raw])
    # layer 2's inputs are the clean ones: its output is the float64 attention over the remaining keys
    _close(ev["blk.2.attn.out"], _attention64(dict(cv["blk.2.attn.scores"], visible=ev["blk.2.attn.scores"]["visible"]),
                                              sink=True))
    assert np.max(np.abs(ev["blk.2.attn.out"] - cv["blk.2.attn.out"])) > 1e-6


@pytest.mark.parametrize("kind,index,layer", [("comp", 5, 2), ("raw", 60, 3), ("index", 7, 4)])
def test_patching_a_kv_row(model, prefixes, kind, index, layer):
    sess, cp_a, cp_b = prefixes
    clean, cv, _ = _step(sess, cp_a)
    same, _, iv = _step(sess, cp_a, [patch_row(layer, cp_a, **{kind: index})])
    assert iv.applied == [1]
    np.testing.assert_array_equal(same, clean)  # the identical row: nothing changes, bit for bit
    patched, pv, _ = _step(sess, cp_a, [patch_row(layer, cp_b, **{kind: index})])
    direct = patch_rows(cp_a, cp_b, layer, kind, [index])  # the state row edited directly
    np.testing.assert_array_equal(checkpoint_row(direct, layer, kind, index), checkpoint_row(cp_b, layer, kind, index))
    assert direct.edits and not cp_a.edits
    edited, _, _ = _step(sess, direct)
    np.testing.assert_array_equal(patched, edited)
    if kind == "index":  # an indexer row only scores its compressed row: that column changes, no other
        sp, sc = pv[f"blk.{layer}.indexer.scores"], cv[f"blk.{layer}.indexer.scores"]
        assert sp[0, index] != sc[0, index]
        np.testing.assert_array_equal(np.delete(sp, index, axis=1), np.delete(sc, index, axis=1))
    else:
        assert not np.array_equal(patched, clean)


@pytest.mark.parametrize("layer", [1, 4])  # a hash layer, a top-k layer
def test_replacing_experts(model, prefixes, layer):
    sess, cp, _ = prefixes
    cfg = model.config
    clean, cv, _ = _step(sess, cp)
    own = cv[f"blk.{layer}.moe.experts"][0]
    same, _, iv = _step(sess, cp, [replace_experts(layer, own)])
    np.testing.assert_array_equal(same, clean)
    other = [e for e in range(cfg.n_expert) if e not in own][: cfg.n_expert_used]
    logits, ev, iv = _step(sess, cp, [replace_experts(layer, other)])
    assert iv.applied == [1]
    np.testing.assert_array_equal(ev[f"blk.{layer}.moe.experts"], [other])
    # the reference MoE: Σ_e w_e · down_e(silu(min(gate_e f, c)) · clip(up_e f, ±c)), w from the router's p
    f, p, c = ev[f"blk.{layer}.ffn_norm"], ev[f"blk.{layer}.moe.router"][0], cfg.swiglu_clamp[layer]
    w = p[other] / max(p[other].sum(), 2.0 ** -14) * cfg.expert_weight_scale
    ref = np.zeros_like(f)
    for e, we in zip(other, w):
        gate, up, down = model.transformer.layers[layer].expert(e)
        g, u = np.minimum(gate(f), c), np.clip(up(f), -c, c)
        ref += we * down(g / (1 + np.exp(-g)) * u)
    np.testing.assert_allclose(ev[f"blk.{layer}.moe.weights"][0], w, rtol=1e-14)
    _close(ev[f"blk.{layer}.moe.out"], ref)
    np.testing.assert_array_equal(ev[f"blk.{layer}.ffn_norm"], cv[f"blk.{layer}.ffn_norm"])
    assert not np.array_equal(logits, clean)


def test_no_trace_after_the_block(model):
    cfg = model.config
    ids = _prompt(90, cfg.n_vocab, 3)
    sess, never = model.session(ctx=256, prefill_chunk=32), model.session(ctx=256, prefill_chunk=32)
    for s in (sess, never):
        s.prefill(ids[:40]).run(progress=False)
    n_cps = len(sess.checkpoints)
    edits = [ablate_sink(1), ablate_rows(2, [0, 3]), replace_experts(4, [6, 7]), force_topk(4, [1, 2])]
    with sess.intervene(edits) as iv:
        sess.prefill(ids[:70]).run(progress=False)
        assert sess.edits == iv.labels and sess.snapshot().edits == iv.labels
    assert iv.tokens == tuple(ids[:70]) and iv.checkpoint.edits == iv.labels and all(iv.applied)
    assert sess.tokens == ids[:40] and sess.edits == () and sess.hook_observer is None
    assert len(sess.checkpoints) == n_cps and not any(cp.edits for cp in sess.checkpoints)
    np.testing.assert_array_equal(sess.logits, never.logits)
    for s in (sess, never):
        s.prefill(ids).run(progress=False)
    np.testing.assert_array_equal(sess.logits, never.logits)
    for a, b in zip(sess.snapshot().state.layers, never.snapshot().state.layers):
        for x, y in zip(a.arrays(), b.arrays()):
            assert (x is None and y is None) or np.array_equal(x, y)
    never.prefill(ids[:70]).run(progress=False)  # what the block computed differs from the state of its tokens
    assert not np.array_equal(iv.logits, never.logits)


def test_kept_state_is_marked_and_never_reused(model, tmp_path):
    cfg = model.config
    ids = _prompt(40, cfg.n_vocab, 4)
    store = ds4lab.KVStore(tmp_path / "kv", min_tokens=1, continued_interval=1)
    sess = model.session(ctx=256, prefill_chunk=32, kv_store=store)
    with sess.intervene([ablate_sink(0)], keep=True) as iv:
        sess.prefill(ids).run(progress=False)
    assert sess.edits == iv.labels and "sink ablated" in repr(sess.snapshot())
    assert store.entries() == []  # the store was never given an edited state
    with pytest.raises(ValueError, match="edited"):
        store.save(sess.snapshot(), model)
    result = sess.sync(ids)  # not the edited live state, nor its checkpoints: the state of the prompt
    assert result.source == "cold" and sess.edits == ()


def test_bad_edits_are_refused_by_name(model, prefixes):
    sess, cp, _ = prefixes
    with pytest.raises(ValueError, match="not an editable hook point"):
        Edit("blk.2.attn.q", lambda v, s: v, "x")
    with pytest.raises(ValueError, match="layer 9 is not a layer"):
        sess.intervene([ablate_sink(9)])
    with pytest.raises(ValueError, match="layer 0 has no compressed rows"):
        sess.intervene([ablate_rows(0)])
    with pytest.raises(ValueError, match="layer 3 has no indexer"):
        sess.intervene([force_topk(3, [0])])
    with pytest.raises(ValueError, match=r"experts \[1, 1\]"):
        sess.intervene([replace_experts(4, [1, 1])])
    with pytest.raises(ValueError, match="exactly one of"):
        patch_row(2, cp, raw=70, comp=1)
    with pytest.raises(ValueError, match="raw position 5 is not in the raw window"):
        patch_row(2, cp, raw=5)
    with pytest.raises(ValueError, match="comp row 18 is not a row"):
        patch_row(2, cp, comp=18)
    with pytest.warns(UserWarning, match="'a no-op' never applied"):
        _step(sess, cp, [Edit("blk.2.attn.sinks", lambda v, s: None, "a no-op")])


def test_logit_diff(model, prefixes):
    sess, cp, _ = prefixes
    ids = list(cp.tokens) + [NEXT]
    sess.restore(cp)
    d = logit_diff(sess, ids, [ablate_sink(2)], start=PREFIX)
    assert sess.tokens == list(cp.tokens)  # left as it was
    clean, _, _ = _step(sess, cp)
    edited, _, _ = _step(sess, cp, [ablate_sink(2)])
    np.testing.assert_array_equal(d.clean, clean)
    np.testing.assert_array_equal(d.edited, edited)
    clean, edited = clean.astype(np.float64), edited.astype(np.float64)
    p = np.exp(clean - clean.max()) / np.exp(clean - clean.max()).sum()
    q = np.exp(edited - edited.max()) / np.exp(edited - edited.max()).sum()
    assert abs(d.kl - np.sum(p * np.log(p / q))) <= 1e-12 * max(d.kl, 1e-300) + 1e-15
    gained = d.gained(3)
    assert gained[0][0] == int(np.argmax(q - p)) and d.lost(1)[0][0] == int(np.argmin(q - p))
    assert "KL(clean ‖ edited)" in repr(d)


def test_edited_checkpoint_saved_as_kv_and_reloaded(model, prefixes, tmp_path):
    sess, cp_a, cp_b = prefixes
    cfg = model.config
    edited = patch_rows(cp_a, cp_b, 2, "comp", [3])
    new_raw = np.linspace(-1, 1, cfg.head_dim).astype(np.float32)
    edited = edit_rows(edited, 3, "raw", {PREFIX - 2: new_raw})
    assert len(edited.edits) == 2
    kf = save_kv(edited, tmp_path / "edited.kv", model)
    kf.verify()
    # the file's rows are the edit, exactly, and every other row is A's
    np.testing.assert_array_equal(kf.layers[2].compressed[3], checkpoint_row(cp_b, 2, "comp", 3))
    np.testing.assert_array_equal(kf.layers[3].raw[-2], new_raw)
    a = ds4lab.KVFile.open(save_kv(cp_a, tmp_path / "a.kv", model).path)
    for il in range(cfg.n_layer):
        ra, re = a.layers[il].raw, kf.layers[il].raw
        if il == 3:
            ra, re = np.delete(ra, -2, axis=0), np.delete(re, -2, axis=0)
        np.testing.assert_array_equal(ra, re)
        if a.layers[il].compressed is not None:
            ca, ce = a.layers[il].compressed, kf.layers[il].compressed
            if il == 2:
                ca, ce = np.delete(ca, 3, axis=0), np.delete(ce, 3, axis=0)
            np.testing.assert_array_equal(ca, ce)
    assert kf.text_bytes == a.text_bytes and kf.fingerprint == model.file.fingerprint
    # the file says its state was edited, so that what loads it knows (its payload cannot say so): a restored session
    # is marked edited and a store refuses to keep it as the state of its text (the mark was lost on the way)
    from ds4lab.kv.edit import load_kv
    from ds4lab.kv.store import EDITED_IN_FILE

    assert kf.edited and not a.edited and "the state was edited" in kf.summary()
    back = load_kv(kf.path, model)
    assert back.edits == (EDITED_IN_FILE,) and load_kv(a.path, model).edits == ()
    fresh = model.session(ctx=sess.ctx, prefill_chunk=sess.geometry.chunk)
    fresh.restore(back)
    assert fresh.edits == (EDITED_IN_FILE,)
    with pytest.raises(ValueError, match="this checkpoint is edited"):
        ds4lab.KVStore(tmp_path / "store").save(back, model)
    with pytest.raises(ValueError, match="an edited state cannot be marked so in a DSV4 version 1 file"):
        save_kv(edited, tmp_path / "old.kv", model, payload_version=1)
    assert not (tmp_path / "old.kv").exists()
    # a session restored from the file continues as one whose state was edited in memory
    loaded = ds4lab.Checkpoint.from_bytes(kf.payload(), cfg)
    from_file, _, _ = _step(sess, loaded)
    in_memory, _, _ = _step(sess, edited)
    np.testing.assert_array_equal(from_file, in_memory)
    # and the payload checkpoint edits the same way as the live one
    again = patch_rows(ds4lab.Checkpoint.from_bytes(cp_a.to_bytes(), cfg), cp_b, 2, "comp", [3])
    np.testing.assert_array_equal(checkpoint_row(again, 2, "comp", 3), checkpoint_row(cp_b, 2, "comp", 3))


def test_edits_through_the_gpu_kernels_agree_with_the_reference(model_paths):
    """The kernels' path (attention with a −inf sink, gathered experts with other ids), run by the CPU emulator
    of the GPU kernels in float32, gives the float64 reference's edited logits within the kernels' whole-model
    tolerance (1e-3 of the logits' scale, as tests/test_gpu_kernels.py)."""
    from ds4lab import ops
    from ds4lab.backends.emulated_backend import EmulatedBackend
    from ds4lab.mlx_kernels.cpu import compiler
    from ds4lab.model.transformer import Transformer
    from ds4lab.model.weights import Weights
    from ds4lab.runtime import Runtime

    if compiler() is None:
        pytest.skip("no C++20 compiler here for the CPU kernel emulator")
    kernels = ds4lab.load(model_paths["nano"], backend="numpy")
    kernels.backend = EmulatedBackend(True)
    cfg = kernels.config
    kernels.transformer = Transformer(cfg, Weights(kernels.file, kernels.backend, cfg.o_groups, cfg.o_lora),
                                      ops.Ops(kernels.backend), "ds4")
    kernels.runtime = Runtime(kernels.transformer, kernels.backend)
    ids = _prompt(PREFIX + 1, cfg.n_vocab, 5)
    edits = [ablate_sink(il) for il in range(cfg.n_layer)] + [replace_experts(4, [0, 1]), force_topk(2, [0, 3])]
    diffs = []
    for m in (ds4lab.load(model_paths["nano"], backend="numpy"), kernels):
        sess = m.session(ctx=256, prefill_chunk=32)
        sess.prefill(ids[:-1]).run(progress=False)
        diffs.append(logit_diff(sess, ids, edits, start=PREFIX))
    ref, got = diffs

    def rel(a, b):  # tests/test_gpu_kernels.py's measure: to the scale of the float64 logits
        return np.abs(a - b).max() / np.abs(b).max()

    assert rel(got.clean, ref.clean) < 1e-3 and rel(got.edited, ref.edited) < 1e-3
    assert rel(ref.edited, ref.clean) > 1e-2  # the edits move the logits ten times the tolerance and more


def test_edits_refuse_numbers_that_are_not_row_head_or_expert_ids(model):
    """Bools and fractions were cast to ids (heads [True, False] ablated heads 1 and 0, experts [0.5, 5.9] were
    [0, 5]), and an empty list made an edit that changed nothing and said nothing."""
    for make, what, bad in ((lambda v: ablate_sink(2, v), "heads", [True, False]),
                            (lambda v: ablate_rows(2, v), "rows", [1.7]),
                            (lambda v: force_topk(2, v), "rows", ["1"]),
                            (lambda v: replace_experts(2, v), "experts", [0.5, 5.9]),
                            (lambda v: force_topk(2, [0], queries=v), "queries", [-1])):
        with pytest.raises(ValueError, match=f"{what} must be whole numbers >= 0, got"):
            make(bad)
    for make, what in ((lambda v: ablate_sink(2, v), "heads"), (lambda v: force_topk(2, v), "rows"),
                       (lambda v: ablate_rows(2, v), "rows")):
        with pytest.raises(ValueError, match=f"{what} is empty: the edit would change nothing"):
            make([])
    assert ablate_sink(2, np.array([0, 1])).label == ablate_sink(2, [0, 1]).label


def test_next_token_loss_checks_its_ids(model):
    from ds4lab.evaluate import held_out_split, next_token_loss, with_top_k

    ids = _prompt(12, model.config.n_vocab, 0)
    with pytest.raises(ValueError, match="token 2 is -1: .*; nothing was scored"):  # it indexed from the end
        next_token_loss(model, ids[:2] + [-1])
    with pytest.raises(ValueError, match=f"token 1 is {model.config.n_vocab}"):  # was an IndexError
        next_token_loss(model, [1, model.config.n_vocab])
    text = model.tokenizer.decode(ids)
    assert next_token_loss(model, text) == next_token_loss(model, model.tokenizer.encode(text))
    for fraction in (0, 1.5, -0.5):
        with pytest.raises(ValueError, match="fraction is the training part's share"):
            held_out_split("abc", fraction)
    with pytest.raises(ValueError, match="top_k must be a whole number of rows, at least 1, got 2.5"):
        with_top_k(model, 2.5)
    from ds4lab.evaluate import top_k_recall

    with pytest.raises(ValueError, match="k must be a whole number of rows, at least 1, got 0"):  # a broadcast error
        top_k_recall(np.ones((2, 4)), np.ones((2, 4)), np.array([4, 4]), 0)


def test_row_edits_refuse_what_they_would_change_otherwise(model, prefixes):
    """Row numbers that are not whole numbers were read as others (1.7 and "1" as row 1), complex rows lost their
    imaginary part with a warning, a row of 1e300 passed and failed at save_kv as an inf, and an empty edit failed
    in a numpy broadcast."""
    _, cp_a, cp_b = prefixes
    width = model.config.head_dim
    for index in (1.7, "1", True):
        with pytest.raises(ValueError, match=f"a comp row is a whole number, got {index!r}"):
            edit_rows(cp_a, 2, "comp", {index: np.zeros(width)})
    with pytest.raises(ValueError, match="complex values"):
        edit_rows(cp_a, 2, "comp", {1: np.zeros(width, complex)})
    with pytest.raises(ValueError, match="finite as float32: False"):
        edit_rows(cp_a, 2, "comp", {1: np.full(width, 1e300)})
    with pytest.raises(ValueError, match="rows is a dict"):
        edit_rows(cp_a, 2, "comp", {})
    for indices in ([], None, [[0, 1]]):
        with pytest.raises(ValueError, match="indices: the rows to patch|a comp row is a whole number"):
            patch_rows(cp_a, cp_b, 2, "comp", indices)
    assert patch_rows(cp_a, cp_b, 2, "comp", np.array([3])).edits == patch_rows(cp_a, cp_b, 2, "comp", 3).edits
    # a layer none of whose rows has closed yet (ratio 128 after 72 tokens): said so, not "rows 0 … -1"
    ratio_128 = next(il for il in range(model.config.n_layer) if model.config.ratio(il) > len(cp_a))
    with pytest.raises(ValueError, match="none yet: its first closes at token 127"):
        edit_rows(cp_a, ratio_128, "comp", {0: np.zeros(width)})


def test_an_intervention_runs_one_block(model, prefixes):
    """A second block on the same Intervention read the first block's logits and added to its counts."""
    sess, cp_a, _ = prefixes
    sess.restore(cp_a)
    iv = sess.intervene([ablate_sink(2)])
    with iv:
        sess.decoder(temperature=0).step()
    with pytest.raises(RuntimeError, match="an Intervention runs one block"):
        with iv:
            pass
    assert sess.hook_observer is None


def test_edits_with_nothing_to_edit_in_the_block_are_reported(model, prefixes):
    """Rows past the state and positions or queries no step reached edit nothing: counted as not applied (each
    counted once before), so the block warns; the step's own position is applied."""
    sess, cp, _ = prefixes
    cfg = model.config
    own = list(range(cfg.n_expert_used))
    step = PREFIX  # the position _step evaluates
    for edit in (ablate_rows(4, rows=[PREFIX]), ablate_rows(4, rows=[30]),  # past the capacity; not written yet
                 replace_experts(4, own, positions=[step + 1]),
                 force_topk(2, [0], queries=[step + 1])):
        with pytest.warns(UserWarning, match="never applied"):
            _, _, iv = _step(sess, cp, [edit])
        assert iv.applied == [0]
    _, _, iv = _step(sess, cp, [ablate_rows(4, rows=[3, PREFIX]), replace_experts(4, own, positions=[step]),
                                force_topk(2, [0], queries=[step])])
    assert iv.applied == [1, 1, 1]


def test_blocks_closed_out_of_order_are_refused(model, prefixes):
    """An intervention closed (by hand) while a capture opened inside it is still open: closed in that order, the
    capture put the intervention's observer back, so its edit ran on after the block. Refused now, nothing changed."""
    sess, cp, _ = prefixes
    sess.restore(cp)
    iv = sess.intervene([ablate_sink(2)])
    iv.__enter__()
    cap = sess.capture(["attn.sinks"], layers=[2])
    cap.__enter__()
    with pytest.raises(RuntimeError, match="opened inside this block is still open"):
        iv.__exit__(None, None, None)
    sess.decoder(temperature=0).step()  # still inside both blocks: the capture sees the edited sinks
    assert np.isneginf(cap["blk.2.attn.sinks"]).all()
    cap.__exit__(None, None, None)
    iv.__exit__(None, None, None)
    assert sess.hook_observer is None and list(sess.tokens) == list(cp.tokens)
    sess.prefill(list(cp.tokens) + [NEXT]).step()
    after = sess.logits.copy()
    clean, _, _ = _step(sess, cp)
    np.testing.assert_array_equal(after, clean)
