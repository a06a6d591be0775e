"""mlx (float32) against the numpy float64 reference over 320 tokens, and chunked forward passes
against one-shot ones.

In ``exact`` numerics the whole 320-token prefill is compared at once. In ``ds4`` numerics a float32
value near an FP8/FP4/F16 rounding boundary can round the other way than in float64; such a flip in
a row that stays in the KV cache (a compressed row, an indexer row, a selection it changes) reaches
every later position, so over a whole prompt the two backends drift apart and never meet again. The
``ds4`` comparison therefore continues the float32 backend from the reference's own state every
``SPAN`` tokens: each span measures what one backend's arithmetic does to the same state.
"""

import numpy as np
import pytest

import ds4lab
from ds4lab.testing import data_file
from tests.conftest import CONFIGS

N_TOKENS = 320
SPAN = 8


def prompt_ids(model, n=N_TOKENS, seed=0):
    return np.random.default_rng(seed).integers(0, model.config.n_vocab - 7, n)


def rel_err(a, b):
    """Per-position relative error: max |a − b| over the vocabulary / max |b|."""
    return np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)


def span_forced_logits(path, numerics, ids):
    """Reference logits, and mlx logits for each span started from the reference's cache."""
    ref, fast = (ds4lab.load(path, backend=b, numerics=numerics) for b in ("numpy", "mlx"))
    cache = ref.new_state(len(ids) + 1, SPAN)
    want, got = [], []
    for start in range(0, len(ids), SPAN):
        span = ids[start:start + SPAN]
        X_fast, _ = fast.runtime.forward(span, cache.to_backend(fast.backend))
        got.append(np.asarray(fast.transformer.head(X_fast), dtype=np.float32))
        X_ref, cache = ref.runtime.forward(span, cache)
        want.append(ref.transformer.head(X_ref))
    return np.concatenate(want), np.concatenate(got)


@pytest.fixture(scope="module")
def compared(model_paths):
    out = {}
    for name, path in model_paths.items():
        ids = prompt_ids(ds4lab.load(path, backend="numpy"))
        out[name, "exact"] = tuple(ds4lab.load(path, backend=b, numerics="exact").logits(ids) for b in ("numpy", "mlx"))
        out[name, "ds4"] = span_forced_logits(path, "ds4", ids)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_exact_numerics_agree_over_the_whole_prompt(name, compared):
    ref, got = compared[name, "exact"]
    assert ref.shape == (N_TOKENS, CONFIGS[name][0].n_vocab) and got.dtype == np.float32
    err = rel_err(got, ref)
    assert err.max() <= 1e-3, f"worst position {err.argmax()} rel err {err.max():.2e}"
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ds4_numerics_agree_statistically(name, compared):
    err = rel_err(*compared[name, "ds4"][::-1])
    assert np.median(err) <= 5e-4
    outliers = np.nonzero(err > 1e-3)[0]
    assert len(outliers) <= 0.1 * N_TOKENS
    # The outliers are rounding flips of the FP8/FP4/F16 simulations: without the simulations the
    # two backends agree at those same positions, even over the whole prompt with no state forced.
    exact_err = rel_err(*compared[name, "exact"][::-1])
    assert exact_err.max() <= 1e-3
    assert (exact_err[outliers] <= 1e-3).all()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_numerics_modes_differ(name, compared):
    # The simulations are live: ds4 and exact numerics give different logits on the reference backend.
    assert rel_err(compared[name, "ds4"][0], compared[name, "exact"][0]).max() > 1e-4


@pytest.mark.parametrize("name", ["nano", "mixed"])
@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_chunked_forward_equals_one_shot(name, chunk, model_paths):
    model = ds4lab.load(model_paths[name], backend="numpy")
    ids = prompt_ids(model, 260)
    rt = model.runtime
    X_all, full = rt.forward(ids, model.new_state(len(ids) + 1, len(ids)))
    cache, outs = model.new_state(len(ids) + 1, chunk), []
    for start in range(0, len(ids), chunk):
        X, cache = rt.forward(ids[start:start + chunk], cache, pad_to=chunk)
        outs.append(X)
    np.testing.assert_allclose(np.concatenate(outs), X_all, rtol=1e-9, atol=1e-9)
    window = model.config.swa
    for a, b in zip(cache.layers, full.layers):
        # the rings differ in size; the last `window` positions agree
        ring = lambda layer: layer.raw[(np.arange(len(ids) - window, len(ids))) % layer.raw.shape[0]]  # noqa: E731
        np.testing.assert_allclose(ring(a), ring(b), rtol=1e-9, atol=1e-9)
        for f in ("comp", "comp_state_kv", "comp_state_score", "index", "index_state_kv", "index_state_score"):
            if getattr(b, f) is not None:
                np.testing.assert_allclose(getattr(a, f), getattr(b, f), rtol=1e-9, atol=1e-9, err_msg=f)


def test_ds4_numerics_agree_over_a_whole_prompt_on_the_trained_model():
    # A trained model is not chaotic in its KV rows: over a whole 400-token prefill of held-out text
    # the float32 backend stays with the float64 reference (measured: median 7e-7, max 9e-6).
    text = data_file("tinyshakespeare.txt").read_text()
    ref = ds4lab.load(backend="numpy")
    ids = ref.tokenizer.encode(text[-20000:])[:400]
    want, got = ref.logits(ids), ds4lab.load(backend="mlx").logits(ids)
    err = rel_err(got, want)
    assert np.median(err) <= 5e-4 and (err > 1e-3).mean() <= 0.1
    assert (got.argmax(-1) == want.argmax(-1)).all()
