"""The embedded default model: it loads without a path, and its held-out perplexity is the one its
model card records."""

import json
import math

import pytest

import ds4lab
from ds4lab.evaluate import held_out_split, next_token_loss
from ds4lab.testing import data_file

DATA = data_file("tinyshakespeare.txt")
RECORD = json.loads((ds4lab.default_model_path().parent / "shakespeare.json").read_text())


def test_default_model_loads():
    model = ds4lab.load()
    assert model.path == ds4lab.default_model_path() and model.path.name == RECORD["file"]
    assert model.config.n_vocab == 2048 and not model.is_chat


@pytest.mark.parametrize("numerics", ["exact", "ds4"])
def test_held_out_perplexity_matches_the_model_card(numerics):
    _, held_out = held_out_split(DATA.read_text(encoding="utf-8"))
    model = ds4lab.load(backend="numpy", numerics=numerics)
    n = RECORD["val_slice_tokens"]
    ppl = math.exp(next_token_loss(model, model.tokenizer.encode(held_out)[: n + 1]))
    assert ppl == pytest.approx(RECORD["val_slice_ppl"][numerics], rel=1e-6)  # float64: the same to the BLAS
    assert ppl < RECORD["unigram_val_ppl"] / 5  # far better than the unigram baseline


def test_the_indexer_is_the_trained_one():
    """The shipped indexer follows the attention: over 512 held-out tokens its top-32 holds at least 90% of what
    the 32 heaviest compressed rows hold, and clearly more than a random top-32 (the seeded indexer's figure)."""
    from ds4lab.evaluate import dense_indexer_pass, top_k_recall

    _, held_out = held_out_split(DATA.read_text(encoding="utf-8"))
    model = ds4lab.load(backend="numpy")
    assert "indexer trained" in model.file.metadata["general.name"][0]
    layers, n_visible = dense_indexer_pass(model, model.tokenizer.encode(held_out)[:512])
    k = model.config.idx_topk
    random = (k / n_visible[n_visible > k]).mean()  # the queries the recall averages over see more than k rows
    for il, (mass, scores) in layers.items():
        recall, oracle = top_k_recall(mass, scores, n_visible, k).mean(), top_k_recall(mass, mass, n_visible, k).mean()
        assert recall >= 0.9 * oracle and recall >= random + 0.1, (il, recall, oracle, random)


def test_next_token_loss_by_hand():
    model = ds4lab.load(backend="numpy")
    ids = model.tokenizer.encode("ROMEO:\nWhat light")
    logits = model.logits(ids[:-1])
    want = sum(-(logits[i, ids[i + 1]] - math.log(sum(math.exp(v) for v in logits[i])))
               for i in range(len(ids) - 1)) / (len(ids) - 1)
    assert next_token_loss(model, ids) == pytest.approx(want, rel=1e-6)
