"""Generated text as the protocols send it: reasoning (before ``</think>`` in thinking mode) apart from the answer,
the answer cut at the first stop string, and, where the request offers tools, the answer's DSML tool block read into
calls (:mod:`.tools`). Text that may be the start of the tag, of a stop string or of a tool block (and, with tools,
the blank before a block, which the answer does not keep) is held back until the next token decides, and a block,
from its opening tag, until it closes (all of it sent as text if it never does), so a streamed delta never has to
be taken back."""

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
    ``stop`` holds the stop string met (the answer ends before it), or None. With ``tools``, the answer is held from
    the first opening tag of a tool block (any spelling) to the first closing tag after it, where the reply ends, as
    ds4-server ends it: ``calls`` is then the block's calls (:func:`.tools.read_calls`), the text before the block
    sent, or empty where the held text is no block of calls, all of it sent as text. A stop string ends the answer
    wherever it is met, inside a held block too (ds4-server's rule). Text held when generation ends is sent."""

    def __init__(self, thinking: bool, stops=(), tools: bool = False):
        self.channel = "reasoning" if thinking else "text"
        self.stops = tuple(stops)
        self.tools = tools
        self.pending = ""
        self.stop: str | None = None
        self.calls: list[dsml.ToolCall] | None = None
        self.block = ""  # with calls: the model's text after the answer's, to the block's closing tag
        # Inside a block (from the blank before its opening tag): the text held, in pieces, and its end that a stop
        # string or a closing tag may begin in: each token's text is looked through once, however long the block.
        self.held: list[str] | None = None
        self.held_len = 0
        self.tail = ""
        self._longest = max(map(len, self.stops + dsml.BLOCK_CLOSES))

    @property
    def ended(self) -> bool:
        """Whether the reply is over: a stop string met, or a tool block closed."""
        return self.stop is not None or self.calls is not None

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.ended:
            return []
        if self.held is not None:
            return self._block(text, [])
        self.pending += text
        out = []
        if self.channel == "reasoning":
            i = self.pending.find(THINK_END)
            if i < 0:
                return self._release(out, (THINK_END,))
            out.append(("reasoning", self.pending[:i]))
            self.pending, self.channel = self.pending[i + len(THINK_END):], "text"
        stop = dsml.first_of(self.pending, self.stops)
        opening = dsml.first_of(self.pending, dsml.BLOCK_OPENS) if self.tools else None
        if opening is None or stop is not None and stop[0] < opening[0]:
            return self._end_at(out, self.pending, stop) if stop else self._release(out, self.stops + (
                dsml.BLOCK_OPENS if self.tools else ()))
        # the blank before a block stays with it (sent if no block follows)
        answer = self.pending[:opening[0]].rstrip(dsml.BLANKS)
        out.append(("text", answer))
        rest, self.pending, self.held = self.pending[len(answer):], "", []
        return self._block(rest, out)

    def _block(self, text: str, out: list) -> list[tuple[str, str]]:
        """Inside a block: ``text`` held, until a stop string ends the answer or a closing tag the block."""
        window, offset = self.tail + text, self.held_len - len(self.tail)  # window[0]'s place in the held text
        self.held.append(text)
        self.held_len += len(text)
        stop, closing = dsml.first_of(window, self.stops), dsml.first_of(window, dsml.BLOCK_CLOSES)
        if stop is not None and (closing is None or stop[0] < closing[0]):
            held, self.held = "".join(self.held), []
            return self._end_at(out, held, (offset + stop[0], stop[1]))
        if closing is None:
            self.tail = window[max(0, len(window) - self._longest + 1):]  # where a stop or closing tag may begin
            return [(c, t) for c, t in out if t]
        held, self.held = "".join(self.held)[:offset + closing[0] + len(closing[1])], []
        found = dsml.read_calls(held)
        if found is None:  # no block of calls: the model's text, the reply over all the same
            out.append(("text", held))
            self.calls = []
        else:
            answer = held[:found[0]].rstrip(dsml.BLANKS)
            out.append(("text", answer))
            self.calls, self.block = found[1], held[len(answer):]
        return [(c, t) for c, t in out if t]

    def _end_at(self, out: list, text: str, stop: tuple[int, str]) -> list[tuple[str, str]]:
        """The answer ends before the stop string met in ``text``."""
        out.append(("text", text[:stop[0]]))
        self.pending, self.stop = "", stop[1]
        return [(c, t) for c, t in out if t]

    def _release(self, out: list, needles) -> list[tuple[str, str]]:
        keep = _partial_tail(self.pending, needles)
        if self.tools and self.channel == "text":  # a blank before a block is not the answer's
            keep = len(self.pending) - len(self.pending[:len(self.pending) - keep].rstrip(dsml.BLANKS))
        cut = len(self.pending) - keep
        out.append((self.channel, self.pending[:cut]))
        self.pending = self.pending[cut:]
        return [(c, t) for c, t in out if t]

    def flush(self) -> list[tuple[str, str]]:
        """The text held back, once generation has ended (a tool block left open included)."""
        rest, self.pending = self.pending + "".join(self.held or ()), ""
        self.held = [] if self.held is not None else None
        return [(self.channel, rest)] if rest and not self.ended else []
