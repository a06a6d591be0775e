"""Generated text as the protocols send it: reasoning (before ``</think>`` in thinking mode) apart from the answer,
and the answer cut at the first stop string. Text that may be the start of the tag or of a stop string is held
back until the next token decides, so a streamed delta never has to be taken back."""

from __future__ import annotations

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
    ``stop`` holds the stop string met (the answer ends before it), or None."""

    def __init__(self, thinking: bool, stops=()):
        self.channel = "reasoning" if thinking else "text"
        self.stops = tuple(stops)
        self.pending = ""
        self.stop: str | None = None

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.stop is not None:
            return []
        self.pending += text
        out = []
        if self.channel == "reasoning":
            i = self.pending.find(THINK_END)
            if i < 0:
                return self._release(out, (THINK_END,))
            out.append(("reasoning", self.pending[:i]))
            self.pending, self.channel = self.pending[i + len(THINK_END):], "text"
        found = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if found:
            i, self.stop = min(found)
            out.append(("text", self.pending[:i]))
            self.pending = ""
            return [(c, t) for c, t in out if t]
        return self._release(out, self.stops)

    def _release(self, out: list, needles) -> list[tuple[str, str]]:
        keep = _partial_tail(self.pending, needles)
        cut = len(self.pending) - keep
        out.append((self.channel, self.pending[:cut]))
        self.pending = self.pending[cut:]
        return [(c, t) for c, t in out if t]

    def flush(self) -> list[tuple[str, str]]:
        """The text held back, once generation has ended."""
        rest, self.pending = self.pending, ""
        return [(self.channel, rest)] if rest and self.stop is None else []
