"""The indexer's recall measure (ds4lab.evaluate) and the KL objective its training uses
(training/train_indexer.py), each against an independent float64 computation."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import ds4lab
from ds4lab.evaluate import held_out_ids, indexer_recall, top_k_recall, with_top_k
from ds4lab.kv.layout import layer_comp_cap

TRAINING = Path(__file__).resolve().parents[1] / "training"


def test_top_k_recall_by_hand():
    mass = np.array([[0.5, 0.1, 0.3, 0.1, 9.0],   # row 4 is not visible: its mass and score do not count
                     [0.2, 0.2, 0.2, 0.4, 0.0],   # scores tie on rows 0-2: the lower rows win
                     [1.0, 1.0, 0.0, 0.0, 0.0]])  # sees only k rows: not a query the indexer chooses for
    scores = np.array([[0.0, 3.0, 2.0, 1.0, 99.0],
                       [1.0, 1.0, 1.0, 0.0, 0.0],
                       [0.0, 0.0, 0.0, 0.0, 0.0]])
    got = top_k_recall(mass, scores, np.array([4, 4, 2]), k=2)
    np.testing.assert_allclose(got, [(0.1 + 0.3) / 1.0, (0.2 + 0.2) / 1.0], rtol=0, atol=1e-15)


def test_attention_shape_by_hand():
    from ds4lab.evaluate import attention_shape

    mass = np.array([[1.0, 1.0, 1.0, 1.0, 5.0],   # sees 4 rows, evenly: log 4 nats; the first of the ties is
                     [0.0, 3.0, 1.0, 0.0, 0.0]])  # the heaviest, 3 back; sees 3: 0.75 / 0.25, 1 back of row 2
    got = attention_shape(mass, np.array([4, 3]))
    h2 = -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))
    assert got["entropy"] == pytest.approx((np.log(4) + h2) / 2, rel=1e-12)
    assert got["even_entropy"] == pytest.approx((np.log(4) + np.log(3)) / 2, rel=1e-12)
    assert got["heaviest_back"] == pytest.approx([1.2, 2.0, 2.8], rel=1e-12)  # numpy's linear percentiles of 3, 1
    for n in ([4, 0], [4, 3]):  # a query seeing nothing, one whose visible rows hold no mass (0/0 before)
        with pytest.raises(ValueError, match="query 1 sees"):
            attention_shape(mass * np.array([[1.0], [float(n[1] == 0)]]), np.array(n))


@pytest.fixture(scope="module")
def model():
    return ds4lab.load(backend="numpy", numerics="exact")


def numpy_top_k(scores: np.ndarray, n: int, k: int) -> np.ndarray:
    """The k highest of the first n scores, ties to the lower index (a stable sort of the negated scores)."""
    return np.argsort(-scores[:n], kind="stable")[:k]


def test_recall_matches_numpy_from_capture(model):
    ids = held_out_ids(model, 200)[:-1]  # 200 tokens: queries from position 131 see more rows than the top-32
    k, T = model.config.idx_topk, len(ids)
    figures = indexer_recall(model, ids)
    assert sorted(figures) == [2, 4]

    # Capture a prefill of the model with every visible row attended and scored, and sparse as it runs.
    dense = with_top_k(model, layer_comp_cap(model.config, 2, T + 1) - 1)
    caps = {}
    for name, m in (("dense", dense), ("sparse", model)):
        sess = m.session(ctx=T + 1, prefill_chunk=T)
        with sess.capture(["attn.scores", "indexer.scores", "indexer.topk"], layers=[2, 4]) as caps[name]:
            sess.prefill(ids).run(progress=False)
    queries = np.arange(T)[(np.arange(T) + 1) // 4 > k]
    assert len(queries) == T - (4 * (k + 1) - 1)  # positions 131 … 199
    for il in (2, 4):
        amap = caps["dense"].attention(il)
        assert np.array_equal(amap.selected, amap.candidates)  # nothing left out of the dense pass
        scores = caps["dense"][f"blk.{il}.indexer.scores"]
        recalls, randoms = [], []
        for t in queries:
            n = (t + 1) // 4
            p = amap.weights[t, :, amap.n_raw: amap.n_raw + n].sum(axis=0)  # the compressed rows' mass, all heads
            recalls.append(p[numpy_top_k(scores[t], n, k)].sum() / p.sum())
            randoms.append(k / n)
        assert figures[il]["queries"] == len(queries)
        assert figures[il]["indexer"] == pytest.approx(np.mean(recalls), rel=1e-12)
        assert figures[il]["random"] == pytest.approx(np.mean(randoms), rel=1e-12)
        assert figures[il]["random"] < figures[il]["oracle"] <= 1.0
        assert figures[il]["indexer"] <= figures[il]["oracle"] + 1e-12

    # Layer 2 is the first with compressed rows, so its inputs are the same in both runs: the rows the recall
    # credits to the indexer are the ones the running model attends.
    chosen = caps["sparse"]["blk.2.indexer.topk"]
    scores = caps["dense"]["blk.2.indexer.scores"]
    for t in queries:
        want = np.zeros(chosen.shape[1], bool)
        want[numpy_top_k(scores[t], (t + 1) // 4, k)] = True
        assert np.array_equal(chosen[t], want), t


def test_recall_of_too_short_a_text_is_refused(model):
    with pytest.raises(ValueError, match=r"100 tokens: no query sees more than the top-32 .* position 131"):
        indexer_recall(model, held_out_ids(model, 100)[:-1])


@pytest.fixture(scope="module")
def trainer():
    pytest.importorskip("mlx.core")
    import sys

    sys.path.insert(0, str(TRAINING))  # train_indexer imports train_shakespeare beside it
    try:
        spec = importlib.util.spec_from_file_location("train_indexer", TRAINING / "train_indexer.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_indexer"] = module  # its dataclass looks its module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(TRAINING))
    yield module
    for name in ("train_indexer", "train_shakespeare"):
        sys.modules.pop(name, None)


def test_kl_objective_against_float64(trainer):
    import mlx.core as mx

    rng = np.random.default_rng(0)
    C, N = 6, 9
    mass = rng.random((C, N))
    scores = rng.normal(size=(C, N)) * 3
    allowed = rng.random((C, N)) < 0.6
    allowed[:, 0] = True
    queries = np.array([1, 1, 0, 1, 1, 0], bool)
    got = trainer.indexer_kl(mx.array(mass.astype(np.float32)), mx.array(scores.astype(np.float32)),
                             mx.array(allowed), mx.array(queries)).item()
    kls = []
    for t in np.nonzero(queries)[0]:
        a = allowed[t]
        p = mass[t, a] / mass[t, a].sum()
        logq = scores[t, a] - np.log(np.exp(scores[t, a]).sum())
        kls.append((p * (np.log(p) - logq)).sum())
    assert got == pytest.approx(np.mean(kls), rel=1e-5)


def test_attention_entropy_against_float64(trainer):
    import mlx.core as mx

    rng = np.random.default_rng(2)
    C, N = 5, 7
    mass = rng.random((C, N))
    allowed = rng.random((C, N)) < 0.6
    allowed[:, 0] = True
    allowed[4] = False  # a query that sees no compressed row yet: its 0/0 must not poison the gradient
    queries = np.array([1, 0, 1, 1, 1], bool)
    args = [mx.array(a) for a in (mass.astype(np.float32), allowed, queries)]
    got = trainer.attention_entropy(*args).item()
    hs = []
    for t in np.nonzero(queries)[0]:
        p = mass[t, allowed[t]] / mass[t, allowed[t]].sum()
        hs.append(-(p * np.log(p)).sum() if allowed[t].any() else 0.0)
    assert got == pytest.approx(np.sum(hs) / queries.sum(), rel=1e-5)
    grad = np.array(mx.grad(lambda m: trainer.attention_entropy(m, *args[1:]))(args[0]))
    assert np.isfinite(grad).all()
    assert not grad[~allowed].any() and not grad[~queries].any()

    def entropy64(m):  # the same mean in float64, for central differences
        return sum(-(q * np.log(q)).sum() for q in (m[t, allowed[t]] / m[t, allowed[t]].sum()
                                                    for t in np.nonzero(queries & allowed.any(axis=1))[0]))
    eps, fd = 1e-6, np.zeros_like(mass)
    for i, j in zip(*np.nonzero(allowed)):
        up, down = mass.copy(), mass.copy()
        up[i, j] += eps
        down[i, j] -= eps
        fd[i, j] = (entropy64(up) - entropy64(down)) / (2 * eps) / queries.sum()
    np.testing.assert_allclose(grad, fd, rtol=0, atol=2e-5)  # float32 gradient against float64 differences


def test_sharpen_objective_against_the_engine(trainer, model_paths):
    """The sharpen phase's pass on the nano model (80 tokens: queries from position 67 see more rows than its
    top-16): its next-token loss is the float64 engine's with every compressed row attended, its entropies are
    those of the engine's own attention weights, and its loss adds them, weighted, to the next-token loss."""
    import mlx.core as mx

    from ds4lab.backends import get_backend
    from ds4lab.evaluate import FULL_ATTENTION, dense_indexer_pass, next_token_loss, with_top_k

    cfg, params, hashes, *_ = trainer.file_params(model_paths["nano"])
    indexer = {k: v for k, v in params.items() if trainer.is_indexer(k)}
    main = {k: v for k, v in params.items() if not trainer.is_indexer(k)}
    objective = trainer.Objective(cfg, hashes, get_backend("mlx", kernels=False), sharpen_weight=0.5)
    ids = (np.arange(81) * 7 + 3) % (cfg.n_vocab - 10) + 5
    loss, got = objective(indexer, main, ids, "sharpen")

    reference = ds4lab.load(model_paths["nano"], backend="numpy", numerics="exact")
    assert got.lm.item() == pytest.approx(next_token_loss(with_top_k(reference, FULL_ATTENTION), ids), rel=2e-5)
    layers, n_visible = dense_indexer_pass(reference, ids[:-1])
    queries = n_visible > cfg.idx_topk
    for il, (mass, _) in layers.items():
        p = [mass[t, :n] / mass[t, :n].sum() for t, n in enumerate(n_visible) if queries[t]]
        assert got.entropy[il].item() == pytest.approx(np.mean([-(q * np.log(q)).sum() for q in p]), rel=2e-5)
    want = got.lm.item() + 0.5 * np.mean([v.item() for v in got.entropy.values()])
    assert loss.item() == pytest.approx(want, rel=1e-6)
    # the sharpen phase's gradient: the indexer's weights are not among what it trains, nor reached by it
    grads = mx.grad(lambda ix: objective(ix, main, ids, "sharpen")[0])(indexer)
    assert all(not np.array(g).any() for g in grads.values())


def test_comp_mass_against_float64(trainer):
    import mlx.core as mx

    rng = np.random.default_rng(1)
    T, H, D, n_raw, n_comp = 5, 3, 8, 4, 6
    q, keys = rng.normal(size=(T, H, D)), rng.normal(size=(n_raw + n_comp, D))
    visible = rng.random((T, n_raw + n_comp)) < 0.7
    sinks = rng.normal(size=H)
    d = dict(q=mx.array(q.astype(np.float32)), keys=mx.array(keys.astype(np.float32)), visible=mx.array(visible),
             sinks=mx.array(sinks.astype(np.float32)), scale=D ** -0.5, n_raw=n_raw)
    got = np.array(trainer.attention_comp_mass(d))
    s = np.einsum("thd,nd->thn", q, keys) * D ** -0.5
    e = np.where(visible[:, None, :], np.exp(s), 0.0)
    w = e / (np.exp(sinks)[None, :, None] + e.sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(got, w[:, :, n_raw:].sum(axis=1), rtol=1e-5, atol=1e-7)


def test_indexer_inputs_are_detached(trainer):
    """The KL trains the indexer's weights and never the activations that feed it."""
    import mlx.core as mx

    w = {"blk.2.indexer.proj.weight": mx.array(np.ones((2, 3), np.float32)),
         "blk.2.attn_q_a.weight": mx.array(np.ones((2, 3), np.float32))}
    src = trainer.DetachedIndexerWeights(w, {}, mx, 1, 1)
    x = mx.array(np.arange(3, dtype=np.float32))
    for name, want in (("blk.2.indexer.proj.weight", 0.0), ("blk.2.attn_q_a.weight", 2.0)):
        gx = mx.grad(lambda v, n=name: src.linear(n)(v).sum())(x)
        np.testing.assert_array_equal(np.array(gx), np.full(3, want))
        gw = mx.grad(lambda p, n=name: trainer.DetachedIndexerWeights(p, {}, mx, 1, 1).linear(n)(x).sum())(w)[name]
        np.testing.assert_array_equal(np.array(gw), np.tile(np.arange(3, dtype=np.float32), (2, 1)))


def test_an_indexer_trained_already_is_refused(trainer, monkeypatch, tmp_path):
    """The embedded model ships the trained indexer: training it again would fine-tune it and name it twice."""
    import sys

    import ds4lab

    monkeypatch.setattr(sys, "argv", ["train_indexer.py", "--model", str(ds4lab.default_model_path()),
                                      "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit, match="its indexer is trained already"):
        trainer.main()
