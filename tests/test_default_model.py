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
    assert ppl == pytest.approx(RECORD["val_slice_ppl"][numerics], rel=0.01)
    assert ppl < RECORD["unigram_val_ppl"] / 5  # far better than the unigram baseline


def test_next_token_loss_by_hand():
    model = ds4lab.load(backend="numpy")
    ids = model.tokenizer.encode("ROMEO:\nWhat light")
    logits = model.logits(ids[:-1])
    want = sum(-(logits[i, ids[i + 1]] - math.log(sum(math.exp(v) for v in logits[i])))
               for i in range(len(ids) - 1)) / (len(ids) - 1)
    assert next_token_loss(model, ids) == pytest.approx(want, rel=1e-6)
