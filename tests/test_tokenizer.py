import pytest

from ds4lab.testing import data_file
from ds4lab.tokenizer import (
    BYTE_TO_UNICODE,
    REASONING_EFFORT_MAX_PREFIX,
    SPECIAL_TOKENS,
    UNICODE_TO_BYTE,
    Tokenizer,
    pretokenize,
    train_bpe,
)

DATA_FILES = ["tinyshakespeare.txt", "promessi_sposi.txt"]


def read_data(name: str) -> str:
    return data_file(name).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# Pre-tokenizer


@pytest.mark.parametrize("text, pieces", [
    # 1: digits in runs of at most three
    ("12345", ["123", "45"]),
    ("1234567", ["123", "456", "7"]),
    ("abc123d", ["abc", "123", "d"]),
    # 2: CJK / hiragana / katakana runs
    ("中文字", ["中文字"]),
    ("ひらがなカタカナ", ["ひらがなカタカナ"]),
    ("中文1", ["中文", "1"]),
    # 3: one punctuation byte plus ASCII letters
    ("it's", ["it", "'s"]),
    ("example.com", ["example", ".com"]),
    ("'café", ["'caf", "é"]),  # rule 3 takes ASCII letters only
    # 4: letter-like runs, any non-ASCII char included
    ("café", ["café"]),
    ("Привет", ["Привет"]),
    ("hi😀", ["hi😀"]),
    ("a\u00a0b", ["a\u00a0b"]),  # U+00A0 is non-ASCII, hence letter-like
    ("abc中文", ["abc中文"]),  # CJK only starts its own piece (rule 2), it does not end a letter run
    # 5: one non-newline, non-punctuation char plus a letter run
    ("a word", ["a", " word"]),
    ("\tword", ["\tword"]),
    (" über", [" über"]),
    (" 中文", [" 中文"]),
    ("\x01abc", ["\x01abc"]),
    ("\rword", ["\r", "word"]),  # \r counts as a newline
    # 6: space + punctuation run + trailing newlines
    ("a ...\n\nb", ["a", " ...\n\n", "b"]),
    ("a (b", ["a", " (", "b"]),
    # 7: punctuation run + trailing newlines
    (">;\n", [">;\n"]),
    ("});\n\n}", ["});\n\n", "}"]),
    ("!!\r\nx", ["!!\r\n", "x"]),
    # 8: whitespace runs
    ("a \n \n  b", ["a", " \n \n", " ", " b"]),  # ends after the last newline, then the rest is rescanned
    ("    int", ["   ", " int"]),  # run >= 2 before a letter: the last space joins the word
    ("a  (", ["a", " ", " ("]),  # ... or the punctuation run
    ("a  中", ["a", " ", " 中"]),
    ("a  1", ["a", "  ", "1"]),  # not before a letter or punctuation: the whole run
    ("x  ", ["x", "  "]),
    ("1 2", ["1", " ", "2"]),  # a single space
    ("a\rb", ["a", "\r", "b"]),
    # 9: anything else is one char
    ("\x00\x7f", ["\x00", "\x7f"]),
    ("", []),
])
def test_pretokenize_rules(text, pieces):
    assert pretokenize(text) == pieces


@pytest.mark.parametrize("name", DATA_FILES)
def test_pretokenize_pieces_concatenate_back(name):
    text = read_data(name)
    pieces = pretokenize(text)
    assert "".join(pieces) == text
    assert all(pieces)


# ---------------------------------------------------------------------------------------------------------
# Byte table and BPE on hand-made vocabularies


def test_gpt2_byte_table():
    assert len(set(BYTE_TO_UNICODE)) == 256
    assert BYTE_TO_UNICODE[ord("A")] == "A"
    assert BYTE_TO_UNICODE[0xA1] == "\xa1" and BYTE_TO_UNICODE[0xFF] == "\xff"
    assert BYTE_TO_UNICODE[0] == "\u0100"
    assert BYTE_TO_UNICODE[ord(" ")] == "\u0120"  # "Ġ"
    assert BYTE_TO_UNICODE[ord("\n")] == "\u010a"  # "Ċ"
    assert BYTE_TO_UNICODE[0x7F] == "\u0121"
    assert BYTE_TO_UNICODE[0xAD] == "\u0143"  # the last shifted byte
    assert all(UNICODE_TO_BYTE[u] == b for b, u in enumerate(BYTE_TO_UNICODE))


def tiny(tokens: list[str], merges: list[str]) -> Tokenizer:
    return Tokenizer(tokens + list(SPECIAL_TOKENS), merges)


def ids_of(tk: Tokenizer, *symbols: str) -> list[int]:
    return [tk.tokens.index(s) for s in symbols]


def test_bpe_lowest_rank_merges_first():
    vocab = ["a", "b", "c", "ab", "bc"]
    tk = tiny(vocab, ["b c", "a b"])
    assert tk.encode("abc") == ids_of(tk, "a", "bc")
    tk = tiny(vocab, ["a b", "b c"])
    assert tk.encode("abc") == ids_of(tk, "ab", "c")


def test_bpe_merges_repeatedly():
    tk = tiny(["a", "b", "c", "ab", "abc"], ["a b", "ab c"])
    assert tk.encode("abcab") == ids_of(tk, "abc", "ab")


def test_bpe_tie_goes_to_leftmost_pair():
    tk = tiny(["a", "aa"], ["a a"])
    assert tk.encode("aaa") == ids_of(tk, "aa", "a")


def test_bpe_unknown_symbol_falls_back_to_single_bytes():
    tk = tiny(["a", "b"], ["a b"])  # "ab" is merged but is not a token
    assert tk.encode("ab") == ids_of(tk, "a", "b")


def test_bpe_drops_bytes_that_are_not_tokens():
    tk = tiny(["x"], ["Ġ x"])
    # " x" merges to the unknown "Ġx"; of its UTF-8 bytes C4 A0 78 only "x" is a one-byte token.
    assert tk.encode(" x") == ids_of(tk, "x")
    assert tk.encode("yx") == ids_of(tk, "x")


def test_missing_special_token_is_named():
    for missing in SPECIAL_TOKENS:
        tokens = list(BYTE_TO_UNICODE) + [s for s in SPECIAL_TOKENS if s != missing]
        with pytest.raises(ValueError, match=missing):
            Tokenizer(tokens, [])


# ---------------------------------------------------------------------------------------------------------
# A byte-only vocabulary: token id b is byte b, so expected sequences can be written literally.

BOS, EOS, USER, ASSISTANT, THINK, THINK_END, DSML = range(256, 263)


@pytest.fixture(scope="module")
def byte_tk() -> Tokenizer:
    return Tokenizer(list(BYTE_TO_UNICODE) + list(SPECIAL_TOKENS), [])


def test_byte_vocab_ids(byte_tk):
    assert byte_tk.special_ids == (BOS, EOS, USER, ASSISTANT, THINK, THINK_END, DSML)
    assert (byte_tk.bos_id, byte_tk.eos_id, byte_tk.user_id, byte_tk.assistant_id) == (BOS, EOS, USER, ASSISTANT)
    assert (byte_tk.think_id, byte_tk.think_end_id, byte_tk.dsml_id) == (THINK, THINK_END, DSML)
    assert byte_tk.vocab_size == 263
    assert byte_tk.encode("héllo\n") == list("héllo\n".encode())


def test_from_metadata(byte_tk):
    meta = {"tokenizer.ggml.tokens": (byte_tk.tokens, "ARRAY[STRING]"),
            "tokenizer.ggml.merges": (["h e"], "ARRAY[STRING]")}
    tk = Tokenizer.from_metadata(meta)
    assert tk.vocab_size == 263 and tk.bos_id == BOS
    with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
        Tokenizer.from_metadata({"tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"]})


def test_decode(byte_tk):
    assert byte_tk.decode([*b"caf\xc3\xa9", USER]) == "café<｜User｜>"
    assert byte_tk.decode(byte_tk.special_ids) == "".join(SPECIAL_TOKENS)
    assert byte_tk.decode([0xC3, ord("x")]) == "\ufffdx"  # invalid UTF-8
    assert byte_tk.token_bytes(0xC3) == b"\xc3"
    assert byte_tk.token_bytes(THINK) == b"<think>"
    assert byte_tk.token_bytes(-1) == byte_tk.token_bytes(10**6) == b""


def test_specials_recognised_only_in_rendered_text(byte_tk):
    text = "<｜User｜>hi<think>"
    assert byte_tk.encode(text) == list(text.encode())
    assert byte_tk.encode_rendered(text) == [USER, *b"hi", THINK]
    assert byte_tk.encode_rendered("<｜DSML｜tool_calls>") == [*b"<", DSML, *b"tool_calls>"]
    assert byte_tk.encode_rendered("</think></think>") == [THINK_END, THINK_END]


def test_one_shot_prompt(byte_tk):
    assert byte_tk.encode_chat_prompt("hi") == [BOS, USER, *b"hi", ASSISTANT, THINK_END]
    assert byte_tk.encode_chat_prompt("hi", system="Be brief") == [
        BOS, *b"Be brief", USER, *b"hi", ASSISTANT, THINK_END]
    thinking = [BOS, *b"S", USER, *b"hi", ASSISTANT, THINK]
    assert byte_tk.encode_chat_prompt("hi", system="S", think=True) == thinking
    assert byte_tk.encode_chat_prompt("hi", system="S", think="high") == thinking
    assert byte_tk.encode_chat_prompt("hi", system="S", think="max") == [
        BOS, *REASONING_EFFORT_MAX_PREFIX.encode(), *b"S", USER, *b"hi", ASSISTANT, THINK]
    with pytest.raises(ValueError, match="think"):
        byte_tk.encode_chat_prompt("hi", think="low")
    # the modes' names, as the CLI and the server hold them: "none" is no thinking
    assert byte_tk.encode_chat_prompt("hi", think="none") == [BOS, USER, *b"hi", ASSISTANT, THINK_END]


def test_max_prefix_text():
    assert REASONING_EFFORT_MAX_PREFIX.startswith("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert REASONING_EFFORT_MAX_PREFIX.endswith("left unchecked.\n\n")


def test_multi_turn(byte_tk):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>r</think>a2"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "</think>a3"},
        {"role": "developer", "content": "D"},
        {"role": "function", "content": "7 </tool_result> <b>"},
    ]
    body = [
        BOS, *b"S",
        USER, *b"q1",
        ASSISTANT, THINK_END, *b"a1",
        USER, *b"q2",
        ASSISTANT, THINK, *b"r", THINK_END, *b"a2",
        USER, *b"<tool_result>42</tool_result>",
        ASSISTANT, THINK_END, *b"a3",
        *b"D",
        USER, *b"<tool_result>7 &lt;/tool_result> <b></tool_result>",  # the closing tag escaped inside
    ]
    assert byte_tk.render_chat(messages) == body + [ASSISTANT, THINK_END]
    assert byte_tk.render_chat(messages, think=True) == body + [ASSISTANT, THINK]
    assert byte_tk.render_chat(messages, add_generation_prompt=False) == body


def test_render_chat_matches_one_shot(byte_tk):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    for think in (False, True, "max"):
        assert byte_tk.render_chat(messages, think=think) == byte_tk.encode_chat_prompt("hi", "S", think)


def test_unknown_role(byte_tk):
    with pytest.raises(ValueError, match="narrator"):
        byte_tk.render_chat([{"role": "narrator", "content": "x"}])


# ---------------------------------------------------------------------------------------------------------
# Trained vocabulary


@pytest.fixture(scope="module")
def trained() -> tuple[list[str], list[str]]:
    return train_bpe(read_data("tinyshakespeare.txt")[:300_000], 1024)


@pytest.fixture(scope="module")
def trained_tk(trained) -> Tokenizer:
    return Tokenizer(*trained)


def test_train_bpe_vocabulary(trained):
    tokens, merges = trained
    assert len(tokens) == 1024 and len(set(tokens)) == 1024
    assert tokens[:256] == list(BYTE_TO_UNICODE)
    assert tokens[-7:] == list(SPECIAL_TOKENS)
    learned = {a + b for a, b in (m.split(" ") for m in merges)}
    assert learned == set(tokens[256:-7])


def test_train_bpe_is_deterministic(trained):
    assert train_bpe(read_data("tinyshakespeare.txt")[:300_000], 1024) == trained


def test_train_bpe_respects_piece_boundaries():
    tokens, merges = train_bpe("1234\n" * 100, 256 + 7 + 2)
    assert merges == ["1 2", "12 3"]  # "4", "\n" are separate pieces: nothing else can be merged
    assert tokens[256:258] == ["12", "123"]


def test_train_bpe_errors():
    with pytest.raises(ValueError, match="smaller"):
        train_bpe("abc", 100)
    with pytest.raises(ValueError, match="merged tokens"):
        train_bpe("hello world", 400)


def quadratic_bpe(tokens: list[str], merges: list[str], piece: str) -> list[int]:
    """ds4's BPE loop, literally: rescan every pair after each merge."""
    rank = {m: r for r, m in enumerate(merges)}
    symbols = [BYTE_TO_UNICODE[b] for b in piece.encode()]
    while True:
        pairs = [(rank[p], i) for i in range(len(symbols) - 1) if (p := symbols[i] + " " + symbols[i + 1]) in rank]
        if not pairs:
            return [tokens.index(s) for s in symbols]
        _, i = min(pairs)
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]


def test_bpe_matches_quadratic_reference(trained, trained_tk):
    pieces = set(pretokenize(read_data("promessi_sposi.txt")[:20_000]))
    pieces |= {"the" * 50, "e" * 41, " " * 33, "thethe the"}
    for piece in sorted(pieces):
        assert trained_tk.encode(piece) == quadratic_bpe(*trained, piece), piece


def test_long_piece(trained_tk):
    text = "the" * 100_000  # a single 300 KB piece
    assert trained_tk.decode(trained_tk.encode(text)) == text


@pytest.mark.parametrize("name", DATA_FILES)
def test_round_trip(trained_tk, name):
    text = read_data(name)
    ids = trained_tk.encode(text)
    assert len(ids) < len(text.encode())
    assert set(ids).isdisjoint(trained_tk.special_ids)
    assert trained_tk.decode(ids) == text


def test_trained_specials_and_chat(trained_tk):
    tk = trained_tk
    assert tk.user_id not in tk.encode("<｜User｜>hi")
    assert tk.encode_rendered("<｜User｜>hi") == [tk.user_id, *tk.encode("hi")]
    assert tk.decode([tk.user_id, tk.think_id, tk.eos_id]) == "<｜User｜><think><｜end▁of▁sentence｜>"
    rendered = "<｜begin▁of▁sentence｜>You are kind.<｜User｜>Hello, Romeo!<｜Assistant｜></think>Hi."
    assert tk.decode(tk.encode_rendered(rendered)) == rendered
    assert tk.encode_rendered(rendered) == tk.render_chat([
        {"role": "system", "content": "You are kind."},
        {"role": "user", "content": "Hello, Romeo!"},
        {"role": "assistant", "content": "Hi."},
    ], add_generation_prompt=False)
