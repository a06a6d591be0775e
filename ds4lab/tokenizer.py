"""ds4's tokenizer: GPT-2 byte-level BPE behind the hand-written JoyAI pre-tokenizer
(docs/MODEL.md, "The tokenizer").

``pretokenize`` splits text into pieces, each piece is mapped byte by byte through the GPT-2 table and merged
by BPE rank, and the chat helpers insert the special tokens by id around BPE-encoded text. ``train_bpe``
builds a small vocabulary with the same piece boundaries for tiny test and demo models.

Encoding and decoding are pure Python (the standard library only), so they run where the ``tokenizers`` wheel
does not (Pyodide); ``train_bpe`` alone imports ``tokenizers``, when it is called.
"""

from __future__ import annotations

import functools
import heapq
import json
import re

BOS, EOS, USER, ASSISTANT, THINK, THINK_END, DSML = SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
)

TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE = "<tool_result>", "</tool_result>"  # a tool message's wrapper (ds4 d6f23312)
# Must match DS4_REASONING_EFFORT_MAX_PREFIX, ds4.c:64-67.
REASONING_EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

PIECE_CACHE = 1 << 16  # pretokenized pieces whose ids a Tokenizer keeps
PIECE_CACHE_CHARS = 64  # the longest piece kept (a long run of letters is rarely sent twice)
_FULLWIDTH_BAR = "\uff5c"  # token strings containing it decode literally

# ---------------------------------------------------------------------------------------------------------
# GPT-2 byte <-> unicode table


def _byte_table() -> tuple[str, ...]:
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    table, shifted = [], 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + shifted))
            shifted += 1
    return tuple(table)


BYTE_TO_UNICODE: tuple[str, ...] = _byte_table()
UNICODE_TO_BYTE: dict[str, int] = {u: b for b, u in enumerate(BYTE_TO_UNICODE)}
_LATIN1_TO_GPT2 = str.maketrans({chr(b): u for b, u in enumerate(BYTE_TO_UNICODE)})


def byte_encode(data: bytes) -> str:
    """Map every byte to its printable GPT-2 code point."""
    return data.decode("latin-1").translate(_LATIN1_TO_GPT2)


# ---------------------------------------------------------------------------------------------------------
# Pre-tokenizer (ds4.c:14709-14777)
#
# ds4 scans UTF-8 bytes; a Python str is scanned by code point instead, which is the same thing for valid
# UTF-8: "byte >= 0x80" becomes "char >= U+0080" and "next UTF-8 char" becomes "next char".

_DIGITS = frozenset("0123456789")
_ALPHA = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_PUNCT = frozenset(chr(c) for c in [*range(0x21, 0x30), *range(0x3A, 0x41), *range(0x5B, 0x61), *range(0x7B, 0x7F)])
_SPACES = frozenset(" \t\n\r\v\f")
_NEWLINES = frozenset("\n\r")


def _is_cjk(ch: str) -> bool:
    return "\u4e00" <= ch <= "\u9fa5" or "\u3040" <= ch <= "\u30ff"  # CJK, hiragana + katakana (contiguous)


def _is_letter_like(ch: str) -> bool:
    # ds4's joyai_letter_like_at: every non-ASCII char counts, CJK included (rule 2 only wins at a piece start).
    return ch >= "\x80" or ch in _ALPHA


def _skip(text: str, pos: int, chars: frozenset[str]) -> int:
    n = len(text)
    while pos < n and text[pos] in chars:
        pos += 1
    return pos


def _skip_letters(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and _is_letter_like(text[pos]):
        pos += 1
    return pos


def pretokenize(text: str) -> list[str]:
    """Split ``text`` into BPE pieces with ds4's JoyAI rules 1-9 (docs/MODEL.md, "The tokenizer"); the pieces
    concatenate to ``text``."""
    pieces = []
    n = len(text)
    pos = 0
    while pos < n:
        start = pos
        c = text[pos]
        nxt = text[pos + 1] if pos + 1 < n else ""
        if c in _DIGITS:  # 1: at most three digits
            pos += 1
            while pos < n and pos - start < 3 and text[pos] in _DIGITS:
                pos += 1
        elif _is_cjk(c):  # 2
            pos += 1
            while pos < n and _is_cjk(text[pos]):
                pos += 1
        elif c in _PUNCT and nxt in _ALPHA:  # 3: "'s", ".com"
            pos = _skip(text, pos + 1, _ALPHA)
        elif _is_letter_like(c):  # 4
            pos = _skip_letters(text, pos + 1)
        elif c not in _NEWLINES and c not in _PUNCT and _is_letter_like(nxt):  # 5: " word"
            pos = _skip_letters(text, pos + 1)
        elif c == " " and nxt in _PUNCT:  # 6: " ..." plus trailing newlines
            pos = _skip(text, _skip(text, pos + 1, _PUNCT), _NEWLINES)
        elif c in _PUNCT:  # 7: ">;\n"
            pos = _skip(text, _skip(text, pos, _PUNCT), _NEWLINES)
        elif c in _SPACES:  # 8
            end = _skip(text, pos, _SPACES)
            run = text[pos:end]
            last_newline = max(run.rfind("\n"), run.rfind("\r"))
            if last_newline >= 0:
                pos += last_newline + 1
            elif end - pos >= 2 and end < n and (_is_letter_like(text[end]) or text[end] in _PUNCT):
                pos = end - 1  # the last space joins the next word or punctuation run
            else:
                pos = end
        else:  # 9
            pos += 1
        pieces.append(text[start:pos])
    return pieces


# ---------------------------------------------------------------------------------------------------------
# BPE tokenizer

_SPECIAL_RE = re.compile("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")")


THINK_MAX_MIN_CTX = 393216  # ds4 downgrades Think Max to normal thinking below this context


def think_mode(think: bool | str) -> str | None:
    """A rendering's ``think``: False or "none" (no thinking: None), True or "high", or "max" (the mode's name)."""
    if think is False or think == "none":
        return None
    if think is True or think == "high":
        return "high"
    if think == "max":
        return "max"
    raise ValueError(f"think must be False, True, 'none', 'high' or 'max', not {think!r}")


def effective_think(mode: str, ctx: int) -> str:
    """The mode ds4 runs for ``mode`` at context ``ctx``: Think Max only from THINK_MAX_MIN_CTX, else normal."""
    return "high" if mode == "max" and ctx < THINK_MAX_MIN_CTX else mode


class Tokenizer:
    """ds4's byte-level BPE over a GGUF token list and merge list (``"A B"`` strings in rank order)."""

    def __init__(self, tokens: list[str], merges: list[str]) -> None:
        self.tokens = list(tokens)
        self.vocab_size = len(self.tokens)
        # Later duplicates win, as in ds4's hash tables (table_put overwrites).
        self._token_id = {t: i for i, t in enumerate(self.tokens)}
        self._merge_rank = {m: r for r, m in enumerate(merges)}
        self._new_piece_cache()
        self._token_bytes = [self._decode_token(t) for t in self.tokens]
        self.max_token_bytes = max(map(len, self._token_bytes), default=1)  # the longest token's text

        ids = []
        for special in SPECIAL_TOKENS:
            if special not in self._token_id:
                raise ValueError(f"tokenizer vocabulary lacks the special token {special}")
            ids.append(self._token_id[special])
        self.special_ids: tuple[int, ...] = tuple(ids)
        (self.bos_id, self.eos_id, self.user_id, self.assistant_id,
         self.think_id, self.think_end_id, self.dsml_id) = ids

    def _new_piece_cache(self) -> None:
        """A piece's ids, kept for the PIECE_CACHE most recent: text repeats its words, and a server's tokenizer
        must not grow with every new word it is sent."""
        self._piece_ids = functools.lru_cache(maxsize=PIECE_CACHE)(self._bpe)

    def __getstate__(self) -> dict:  # the cache wraps a bound method: a pickle (a process's copy) starts without it
        return {k: v for k, v in self.__dict__.items() if k != "_piece_ids"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._new_piece_cache()

    @classmethod
    def from_metadata(cls, meta: dict) -> Tokenizer:
        """Build from GGUF metadata entries ``key -> (value, type_name)``."""
        arrays = []
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in meta:
                raise ValueError(f"metadata key {key} is missing")
            arrays.append(list(meta[key][0]))
        return cls(*arrays)

    # -- encoding ---------------------------------------------------------------------------------------

    def _merge(self, piece: str) -> list[str]:
        """Merge the lowest-ranked adjacent pair, leftmost on ties, until no pair has a rank.

        ds4 rescans all pairs after every merge (quadratic in the piece length); a heap keyed by
        (rank, position) picks the same pair each step. Merged-away symbols become None.
        """
        symbols: list[str | None] = list(byte_encode(piece.encode()))
        n = len(symbols)
        ranks = self._merge_rank
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))

        def push(i: int, j: int) -> None:
            rank = ranks.get(symbols[i] + " " + symbols[j])
            if rank is not None:
                heapq.heappush(heap, (rank, i, symbols[i], symbols[j]))

        heap: list[tuple[int, int, str, str]] = []
        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, i, left, right = heapq.heappop(heap)
            j = nxt[i]
            if symbols[i] != left or j >= n or symbols[j] != right:
                continue  # stale: one side has been merged since this entry was pushed
            symbols[i] = left + right
            symbols[j] = None
            nxt[i] = nxt[j]
            if nxt[i] < n:
                prv[nxt[i]] = i
                push(i, nxt[i])
            if prv[i] >= 0:
                push(prv[i], i)
        return [s for s in symbols if s is not None]

    def _bpe(self, piece: str) -> tuple[int, ...]:
        ids = []
        for sym in self._merge(piece):
            token = self._token_id.get(sym)
            if token is not None:
                ids.append(token)
                continue
            # ds4 looks up each single UTF-8 byte of the unknown symbol; only ASCII can be a 1-byte token.
            for b in sym.encode():
                token = self._token_id.get(chr(b)) if b < 0x80 else None
                if token is not None:
                    ids.append(token)
        return tuple(ids)

    def encode(self, text: str) -> list[int]:
        """BPE-encode plain text; special-token strings are treated as ordinary text."""
        ids: list[int] = []
        for piece in pretokenize(text):
            ids.extend(self._piece_ids(piece) if len(piece) <= PIECE_CACHE_CHARS else self._bpe(piece))
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        """Encode rendered chat text: exact special-token strings become their ids, the rest goes through BPE."""
        ids: list[int] = []
        for i, part in enumerate(_SPECIAL_RE.split(text)):
            if i % 2:
                ids.append(self._token_id[part])
            elif part:
                ids.extend(self.encode(part))
        return ids

    # -- decoding ---------------------------------------------------------------------------------------

    @staticmethod
    def _decode_token(token: str) -> bytes:
        if _FULLWIDTH_BAR in token:
            return token.encode()
        # Code points outside the GPT-2 table are dropped, as in ds4.
        return bytes(UNICODE_TO_BYTE[ch] for ch in token if ch in UNICODE_TO_BYTE)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (b"" for ids outside the vocabulary, as in ds4)."""
        return self._token_bytes[token_id] if 0 <= token_id < self.vocab_size else b""

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    # -- chat rendering ---------------------------------------------------------------------------------

    def encode_chat_prompt(self, user: str, system: str | None = None, think: bool | str = False) -> list[int]:
        """ds4's one-shot prompt: BOS [max prefix] [system] User user Assistant <think>|</think>."""
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user})
        return self.render_chat(messages, think=think)

    def render_chat(self, messages: list[dict], think: bool | str = False,
                    add_generation_prompt: bool = True) -> list[int]:
        """Render a conversation with ds4's multi-turn append rules.

        ``think`` is False or "none" (non-thinking), True or "high" (thinking), or "max" (thinking with the
        reasoning-effort prefix right after BOS, as in the one-shot prompt).
        """
        mode = think_mode(think)
        ids = [self.bos_id]
        if mode == "max":
            ids += self.encode(REASONING_EFFORT_MAX_PREFIX)
        for message in messages:
            self._append_message(ids, message["role"], message["content"])
        if add_generation_prompt:
            ids += [self.assistant_id, self.think_id if mode else self.think_end_id]
        return ids

    def _tool_result(self, content: str) -> list[int]:
        """A tool's output inside its wrapper, as ds4 writes it: the text as it is, but every closing tag in it
        with its '<' written "&lt;" (the output cannot end the wrapper early); each piece encoded alone."""
        ids, start, at = [], 0, content.find(TOOL_RESULT_CLOSE)
        while at >= 0:
            ids += self.encode(content[start:at]) + self.encode("&lt;")
            start = at + 1
            at = content.find(TOOL_RESULT_CLOSE, start)
        return ids + self.encode(content[start:])

    def _append_message(self, ids: list[int], role: str, content: str) -> None:
        if role in ("system", "developer"):
            ids += self.encode(content)
        elif role == "assistant":
            ids.append(self.assistant_id)
            if not content.startswith((THINK, THINK_END)):
                ids.append(self.think_end_id)
            ids += self.encode_rendered(content)
        elif role == "user":
            ids.append(self.user_id)
            ids += self.encode(content)
        elif role in ("tool", "function"):  # ds4 since d6f23312 (2026-05-30); "Tool: " + text before
            ids.append(self.user_id)
            ids += self.encode(TOOL_RESULT_OPEN) + self._tool_result(content) + self.encode(TOOL_RESULT_CLOSE)
        else:
            raise ValueError(f"unknown chat role {role!r}")


# ---------------------------------------------------------------------------------------------------------
# Training a small vocabulary


def train_bpe(text: str, vocab_size: int) -> tuple[list[str], list[str]]:
    """Train a byte-level BPE vocabulary of exactly ``vocab_size`` tokens on ``text``.

    Returns ``(tokens, merges)``: the 256 byte symbols in byte order, the merged symbols in merge order, then
    the 7 SPECIAL_TOKENS; merges are ``"A B"`` strings in rank order. Merges never cross ``pretokenize``
    boundaries because each piece is handed to the trainer as a separate sequence with no pre-tokenizer.
    """
    n_learned = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n_learned < 0:
        raise ValueError(f"vocab_size {vocab_size} is smaller than 256 bytes + {len(SPECIAL_TOKENS)} specials")
    try:  # imported here: encoding never needs it, and it has no Pyodide wheel
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, trainers
    except ImportError as e:
        raise ImportError(f"training a BPE vocabulary needs the tokenizers package ({e}); "
                          "pip install tokenizers") from e

    hf = HFTokenizer(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=256 + n_learned, initial_alphabet=list(BYTE_TO_UNICODE),
                                  show_progress=False)
    hf.train_from_iterator((byte_encode(p.encode()) for p in pretokenize(text)), trainer=trainer)

    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(hf.to_str())["model"]["merges"]]
    tokens = list(BYTE_TO_UNICODE)
    known = set(tokens)
    for merge in merges:
        left, right = merge.split(" ")
        if left not in known or right not in known:
            raise AssertionError(f"merge {merge!r} uses a symbol that no earlier merge produced")
        if left + right not in known:
            known.add(left + right)
            tokens.append(left + right)
    if known != set(hf.get_vocab()):
        raise AssertionError("the merge results differ from the trained vocabulary")
    if len(tokens) != 256 + n_learned:
        raise ValueError(f"the training text yields only {len(tokens) - 256} merged tokens, "
                         f"{n_learned} are needed for vocab_size {vocab_size}")
    return tokens + list(SPECIAL_TOKENS), merges
