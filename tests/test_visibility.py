"""ds4lab.visibility.step_mask against what the model does: the attention map captured at ``attn.scores`` (its raw
positions, candidate and selected rows, zero vs nonzero weights) for every layer of chunks that wrap the ring,
ratio-4 and ratio-128 layers, an indexer choosing 32 rows, and a decode step; and a hand-worked mask."""

import numpy as np
import pytest

import ds4lab
from ds4lab import visibility
from ds4lab.visibility import CACHED, DROPPED, FUTURE, KEPT, NOT_YET, OUTSIDE, OWN, SINK, UNKNOWN, step_mask


@pytest.fixture(scope="module")
def model():
    return ds4lab.load(backend="numpy")  # the embedded model: window 64, ratios 0 0 4 128 4 128, indexer top-32


def _ids(n, vocab):
    return ((np.arange(n) * 7 + 3) % (vocab - 10) + 5).tolist()


def _agrees(sess, cap, pos0, n):
    """Every layer's mask equals the captured attention of the step at pos0…pos0+n−1; returns the masks."""
    cfg, masks = sess.model.config, []
    for il in range(cfg.n_layer):
        amap = cap.attention(il)
        topk = f"blk.{il}.indexer.topk"
        mask = step_mask(cfg, sess.geometry, il, pos0, n, cap[topk] if topk in cap else None)
        assert (amap.queries == mask.queries).all()
        np.testing.assert_array_equal(amap.raw_positions, mask.raw_positions)
        np.testing.assert_array_equal(amap.comp_rows, mask.comp_rows)
        np.testing.assert_array_equal(amap.candidates, mask.candidates)
        np.testing.assert_array_equal(amap.selected, mask.selected)
        np.testing.assert_array_equal(amap.weights[:, 0, :] > 0, mask.seen)
        assert not (mask.cells == UNKNOWN).any()
        masks.append(mask)
    return masks


def test_mask_is_what_the_model_attends(model, monkeypatch):
    monkeypatch.setenv("DS4_METAL_GRAPH_RAW_CAP", "128")  # a ring of 128 slots wraps at position 128
    cfg = model.config
    sess = model.session(ctx=512, prefill_chunk=64)
    assert (sess.geometry.raw_cap, cfg.swa, cfg.idx_topk) == (128, 64, 32)
    prefill = sess.prefill(_ids(320, cfg.n_vocab))
    for _ in range(5):
        with sess.capture(["attn.scores", "indexer.topk"]) as cap:
            chunk = prefill.step()
        masks = _agrees(sess, cap, chunk.start, chunk.n_tokens)
        ring = masks[0].ring_positions  # slot s holds the latest position ≡ s (mod 128)
        written = min(chunk.end, 128)  # slots not yet written hold negative positions
        np.testing.assert_array_equal(ring[:written], [max(p for p in range(chunk.end) if p % 128 == s)
                                                       for s in range(written)])
        assert (ring[written:] < 0).all()
        if chunk.start == 256:  # wrapped twice: the window reaches back into what the previous chunk wrote
            assert (masks[0].raw_positions == np.arange(193, 320)).all() and masks[0].n_own == 64
            idx = masks[2]  # ratio 4 with the indexer: 33+ rows visible from position 131 on, it keeps 32
            assert (idx.selected.sum(axis=1) == 32).all() and (idx.cells == DROPPED).any()
            assert (masks[3].cells[:, -3:-1] == KEPT).all()  # ratio 128: rows 0 and 1 (groups 0–127, 128–255)
    # a decode step: one query
    with sess.capture(["attn.scores", "indexer.topk"]) as cap:
        sess.decoder(temperature=0).step()
    masks = _agrees(sess, cap, 320, 1)
    assert masks[2].cells.shape == (1, 64 + 80 + 1) and (masks[2].cells[0, 64:-1] == KEPT).sum() == 32


def test_indexer_starts_choosing_at_position_131(model):
    cfg = model.config
    sess = model.session(ctx=512, prefill_chunk=64)
    prefill = sess.prefill(_ids(192, cfg.n_vocab))
    prefill.step(), prefill.step()
    with sess.capture(["attn.scores", "indexer.topk"], layers=[2]) as cap:
        prefill.step()
    mask = step_mask(cfg, sess.geometry, 2, 128, 64, cap["blk.2.indexer.topk"])
    kept = (mask.cells == KEPT).sum(axis=1)
    dropped = (mask.cells == DROPPED).sum(axis=1)
    q = np.arange(128, 192)
    np.testing.assert_array_equal(kept, np.minimum((q + 1) // 4, 32))  # row c visible iff 4(c+1) ≤ q+1
    np.testing.assert_array_equal(dropped, np.maximum((q + 1) // 4 - 32, 0))
    assert q[dropped > 0][0] == 131
    # without the capture the view cannot say which 32: candidates beyond the top-k are "unknown"
    blind = step_mask(cfg, sess.geometry, 2, 128, 64)
    assert blind.selected is None
    np.testing.assert_array_equal((blind.cells == UNKNOWN).any(axis=1), q >= 131)
    np.testing.assert_array_equal((blind.cells == KEPT).sum(axis=1), np.where(q < 131, (q + 1) // 4, 0))


def test_hand_worked_mask(model):
    """Window 64, ring 256, chunk 64…127 of a raw-only layer, cell by cell from the rule q−64 < k ≤ q."""
    cfg = model.config
    sess = model.session(ctx=512, prefill_chunk=64)
    mask = step_mask(cfg, sess.geometry, 0, 64, 64)
    assert mask.raw_positions.tolist() == list(range(1, 128)) and mask.comp_rows.size == 0 and mask.n_own == 64
    for qi, q in enumerate(range(64, 128)):
        for ki, k in enumerate(range(1, 128)):
            want = FUTURE if k > q else OUTSIDE if k <= q - 64 else CACHED if k < 64 else OWN
            assert mask.cells[qi, ki] == want, (q, k)
        assert mask.cells[qi, -1] == SINK
    r128 = step_mask(cfg, sess.geometry, 3, 64, 64)  # ratio 128: group 0–127 completes at the last query
    assert r128.comp_rows.size == 1 and (r128.cells[:-1, -2] == NOT_YET).all() and r128.cells[-1, -2] == KEPT
    r4 = step_mask(cfg, sess.geometry, 4, 64, 64)
    assert r4.comp_rows.size == 32 and r4.cells[0, -18] == KEPT and r4.cells[0, -17] == NOT_YET  # q=64 sees rows 0–15
    with pytest.raises(ValueError, match="layer 6"):
        step_mask(cfg, sess.geometry, 6, 0, 1)


@pytest.mark.parametrize("pos0, n", [(0, 64), (64, 64), (256, 64), (300, 5), (320, 1), (1000, 200)])
def test_key_groups_count_the_masks_columns_without_its_cells(model, pos0, n):
    """key_groups (what a view plans its drawing with) is the column count of step_mask's groups and its rows, on
    every layer: raw only, ratio 4 with an indexer, ratio 128; chunks, a short one, a decode step, a long one."""
    sess = model.session(ctx=2048, prefill_chunk=64)
    for il in range(model.config.n_layer):
        mask = step_mask(model.config, sess.geometry, il, pos0, n)
        want = [len(mask.raw_positions) - mask.n_own, mask.n_own, len(mask.comp_rows), len(mask.queries)]
        assert visibility.key_groups(model.config, sess.geometry, il, pos0, n) == want, (il, pos0, n)
        assert sum(want[:3]) + 1 == mask.cells.shape[1]
