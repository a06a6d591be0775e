"""Generated text as the protocols send it: reasoning (before ``</think>`` in thinking mode) apart from the answer,
the answer cut at the first stop string, and, where the request offers tools, the answer's DSML tool block read into
calls (:mod:`.tools`). Text that may be the start of the tag, of a stop string or of a tool block (and, with tools,
the blank before a block, which the answer does not keep) is held back until the next token decides, so a streamed
delta never has to be taken back."""

from __future__ import annotations

from . import tools as dsml

THINK_END = "</think>"


def _partial_tail(text: str, needles) -> int:
    """The length of the longest end of ``text`` that is a proper start of one of ``needles``."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


class Channels:
    """Feed it each token's text; it returns ``[(channel, text)]`` ready to send, channel "reasoning" or "text".
    ``stop`` holds the stop string met (the answer ends before it), or None; with ``tools``, ``calls`` the calls of
    the answer's tool block once it has closed (the reply ends there, as ds4-server ends it), or None. A block that
    does not close well formed before generation ends is sent as text. Stop strings are looked for in the answer's
    text, not inside a tool block."""

    def __init__(self, thinking: bool, stops=(), tools: bool = False):
        self.channel = "reasoning" if thinking else "text"
        self.stops = tuple(stops)
        self.tools = tools
        self.pending = ""
        self.stop: str | None = None
        self.calls: list[dsml.ToolCall] | None = None
        self.spelling: str | None = None  # inside a tool block: its tags' spelling

    @property
    def ended(self) -> bool:
        """Whether the reply is over: a stop string met, or a tool block closed."""
        return self.stop is not None or self.calls is not None

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.ended:
            return []
        self.pending += text
        out = []
        if self.channel == "reasoning":
            i = self.pending.find(THINK_END)
            if i < 0:
                return self._release(out, (THINK_END,))
            out.append(("reasoning", self.pending[:i]))
            self.pending, self.channel = self.pending[i + len(THINK_END):], "text"
        if self.spelling is None:
            found = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
            start = dsml.block_start(self.pending) if self.tools else None
            if found and (start is None or min(found)[0] < start[0]):
                i, self.stop = min(found)
                out.append(("text", self.pending[:i]))
                self.pending = ""
                return [(c, t) for c, t in out if t]
            if start is None:
                return self._release(out, self.stops + (dsml.BLOCK_OPENS if self.tools else ()))
            at, self.spelling = start
            answer = self.pending[:at].rstrip()  # the blank before the block stays with it (sent if it never ends)
            out.append(("text", answer))
            self.pending = self.pending[len(answer):]
        block = dsml.read_block(self.pending, self.spelling)
        if block is not None:
            self.calls, self.pending = block[0], ""
        return [(c, t) for c, t in out if t]

    def _release(self, out: list, needles) -> list[tuple[str, str]]:
        keep = _partial_tail(self.pending, needles)
        if self.tools and self.channel == "text":  # a blank before a block is not the answer's
            keep = len(self.pending) - len(self.pending[:len(self.pending) - keep].rstrip())
        cut = len(self.pending) - keep
        out.append((self.channel, self.pending[:cut]))
        self.pending = self.pending[cut:]
        return [(c, t) for c, t in out if t]

    def flush(self) -> list[tuple[str, str]]:
        """The text held back, once generation has ended (a tool block left open included)."""
        rest, self.pending = self.pending, ""
        return [(self.channel, rest)] if rest and not self.ended else []
