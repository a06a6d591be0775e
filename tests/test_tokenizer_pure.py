"""ds4lab's tokenizer is pure Python (it runs under Pyodide, where ``tokenizers`` has no wheel); here it is checked
against Hugging Face ``tokenizers`` as an independent oracle: its BPE model built from the same GGUF token and
merge lists, its byte-level mapping and decoder, and its added-token splitting for the special tokens. Both sides
share ds4's hand-written pre-tokenizer (``pretokenize``, checked by test_tokenizer.py), which ``tokenizers`` cannot
express; everything after it is computed twice.

Vocabularies: the embedded model's, a test model's trained vocabulary (``train_bpe``, as ``ds4lab.testing``
trains it) and the layout vocabulary of the sparse test models (``ds4lab.testing.layout_vocab``)."""

from __future__ import annotations

import functools

import pytest

import ds4lab
from ds4lab.testing import data_file, default_tokenizer_text, layout_vocab
from ds4lab.tokenizer import REASONING_EFFORT_MAX_PREFIX, SPECIAL_TOKENS, Tokenizer, byte_encode, pretokenize, train_bpe

hf = pytest.importorskip("tokenizers")
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

TEST_VOCAB = 1024  # the NANO preset's vocabulary
CORPORA = ("tinyshakespeare.txt", "promessi_sposi.txt")
TEST_MODEL_CHARS = 200_000  # the test vocabularies read a prefix of each corpus: the whole costs seconds each


@functools.cache
def tokenizer(name: str) -> Tokenizer:
    if name == "embedded":
        return ds4lab.load(backend="numpy").tokenizer
    if name == "trained":
        return Tokenizer(*train_bpe(default_tokenizer_text(), TEST_VOCAB))
    return Tokenizer(*layout_vocab(TEST_VOCAB))


def merges_of(tok: Tokenizer) -> list[tuple[str, str]]:
    return [tuple(m.split(" ")) for m in sorted(tok._merge_rank, key=tok._merge_rank.get)]


class _DS4Pieces:
    """ds4's pre-tokenizer as a ``tokenizers`` custom pre-tokenizer (for short texts: slicing a NormalizedString
    costs time linear in its length, so a whole corpus would take minutes)."""

    def pre_tokenize(self, pretok) -> None:
        pretok.split(self._split)

    @staticmethod
    def _split(_, normalized):
        out, pos = [], 0
        for piece in pretokenize(str(normalized)):
            out.append(normalized[pos:pos + len(piece)])
            pos += len(piece)
        return out


@functools.cache
def oracle(name: str, specials: bool):
    """``tokenizers``' pipeline for vocabulary ``name``: special tokens split first when ``specials`` (as
    ``encode_rendered`` does; ``encode`` takes them as text), then ds4's pieces, GPT-2 bytes, BPE."""
    tok = tokenizer(name)
    vocab = {t: i for i, t in enumerate(tok.tokens)}  # later duplicates win, as in Tokenizer
    pipeline = hf.Tokenizer(hf.models.BPE(vocab=vocab, merges=merges_of(tok)))
    pipeline.pre_tokenizer = hf.pre_tokenizers.Sequence([
        hf.pre_tokenizers.PreTokenizer.custom(_DS4Pieces()),
        hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    pipeline.decoder = hf.decoders.ByteLevel()
    if specials:
        pipeline.add_special_tokens(list(SPECIAL_TOKENS))
    return pipeline


def oracle_decode(name: str, ids: list[int]) -> str:
    return oracle(name, True).decode(ids, skip_special_tokens=False)


@functools.cache
def corpus_pieces(name: str, chars: int | None) -> tuple[str, list[str]]:
    text = data_file(name).read_text(encoding="utf-8")[:chars]
    return text, pretokenize(text)


VOCABS = ("embedded", "trained", "layout")


@pytest.mark.parametrize("corpus", CORPORA)
@pytest.mark.parametrize("vocab", VOCABS)
def test_a_corpus_encodes_and_decodes_as_tokenizers_does(vocab, corpus):
    """The corpus piece by piece through ``tokenizers``' BPE model (each distinct piece once), against
    ``Tokenizer.encode`` of the whole text."""
    text, pieces = corpus_pieces(corpus, None if vocab == "embedded" else TEST_MODEL_CHARS)
    tok, model = tokenizer(vocab), oracle(vocab, False).model
    per_piece = {p: [t.id for t in model.tokenize(byte_encode(p.encode()))] for p in set(pieces)}
    expected = [i for p in pieces for i in per_piece[p]]
    ids = tok.encode(text)
    assert len(ids) == len(expected)
    first_difference = next((k for k, (a, b) in enumerate(zip(ids, expected)) if a != b), None)
    assert first_difference is None, f"token {first_difference} differs"
    assert tok.decode(ids) == oracle_decode(vocab, ids) == text


def _conversations() -> list[tuple[list[dict], bool | str]]:
    shakespeare = data_file("tinyshakespeare.txt").read_text(encoding="utf-8")[:600]
    return [
        ([{"role": "user", "content": "What light through yonder window breaks?"}], False),
        ([{"role": "system", "content": "You are a terse assistant. Answer in one line."},
          {"role": "user", "content": shakespeare}], True),
        ([{"role": "system", "content": " Reply in Italian."},
          {"role": "user", "content": "Quel ramo del lago di Como, 1827, «I promessi sposi»?"},
          {"role": "assistant", "content": "<think>The user asks…</think>Sì: Manzoni, 1840–42."},
          {"role": "tool", "content": '{"ok": true, "pages": 720}'},
          {"role": "user", "content": "E in giapponese? 婚約者 (いいなづけ)\n\n\tgrazie!!"}], "max"),
    ]


@pytest.mark.parametrize("vocab", VOCABS)
def test_chat_renderings_are_what_tokenizers_makes_of_their_text(vocab):
    """The rendered conversation's text (its decoded ids: the special tokens spelled out) through the oracle
    gives ``render_chat``'s ids back."""
    tok = tokenizer(vocab)
    for messages, think in _conversations():
        ids = tok.render_chat(messages, think=think)
        text = tok.decode(ids)
        assert text.startswith(SPECIAL_TOKENS[0]) and (think != "max" or REASONING_EFFORT_MAX_PREFIX in text)
        assert oracle(vocab, True).encode(text).ids == ids
        assert oracle_decode(vocab, ids) == text


# Random text leaning on what the pre-tokenizer's rules tell apart: digits, ASCII letters and punctuation,
# whitespace runs, accented Latin, CJK and kana, emoji, and the special tokens' own characters.
_ALPHABET = st.sampled_from(list("0123456789abcXYZ .,;:'\"!?-_()[]<>/\\\n\r\t\v\f  éàüßñ中文字ひらカナ한글😀🙂｜▁")
                            + list(SPECIAL_TOKENS))
TEXTS = st.one_of(st.text(max_size=80), st.lists(_ALPHABET, max_size=40).map("".join))


@pytest.mark.parametrize("vocab", VOCABS)
def test_random_text_encodes_and_decodes_as_tokenizers_does(vocab):
    tok = tokenizer(vocab)
    plain, rendered = oracle(vocab, False), oracle(vocab, True)

    @hypothesis.settings(max_examples=250, deadline=None, database=None, derandomize=True)
    @hypothesis.given(TEXTS)
    def check(text):
        ids = tok.encode(text)
        assert ids == plain.encode(text).ids
        assert tok.encode_rendered(text) == rendered.encode(text).ids
        assert tok.decode(ids) == oracle_decode(vocab, ids)

    check()


@pytest.mark.parametrize("vocab", VOCABS)
def test_every_token_decodes_as_tokenizers_does(vocab):
    tok = tokenizer(vocab)
    assert [tok.decode([i]) for i in range(tok.vocab_size)] == [oracle_decode(vocab, [i])
                                                                  for i in range(tok.vocab_size)]
