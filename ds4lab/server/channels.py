"""Generated text as the protocols send it: reasoning (before ``</think>`` in thinking mode) apart from the answer,
the answer cut at the first stop string, and, where the request offers tools, the answer's DSML tool block read into
calls (:mod:`.tools`). Text that may be the start of the tag, of a stop string or of a tool block (and, with tools,
the blank before a block, which the answer does not keep) is held back until the next token decides, and a block,
from its opening tag, until it closes (all of it sent as text if it never does), so a streamed delta never has to
be taken back. For a streamed reply (``live``) a block's calls are sent as the model writes them
(:class:`.tools.LiveCalls`), the text before the block first; a call sent cannot be taken back, so a block that then
does not close as a block of calls ends the reply with ``error`` (ds4-server's "unterminated tool call"), not as
text."""

from __future__ import annotations

from dataclasses import replace

from . import tools as dsml

THINK_END = "</think>"


class Channels:
    """Feed it each token's text; it returns ``[(channel, text)]`` ready to send, channel "reasoning" or "text".
    ``stop`` holds the stop string met (the answer ends before it), or None. With ``tools``, the answer is held from
    the first opening tag of a tool block (any spelling) to the first closing tag after it, where the reply ends, as
    ds4-server ends it: ``calls`` is then the block's calls (:func:`.tools.read_calls`), the text before the block
    sent, or empty where the held text is no block of calls, all of it sent as text. A stop string ends the answer
    wherever it is met, inside a held block too (ds4-server's rule). Text held when generation ends is sent.
    With ``live``, items ``("call", (index, key, name))`` and ``("args", (index, text))`` come too, each call's
    arguments in pieces, and ``calls`` hold the keys and argument texts sent; ``error`` says why a reply whose calls
    were under way ended without them (``calls`` then empty; with ``first_only``, a first call finished is the
    reply's, whatever follows it, and no block is kept: ``block`` empty)."""

    def __init__(self, thinking: bool, stops=(), tools: bool = False, live: bool = False, first_only: bool = False):
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
        self.live_wanted = live
        self.first_only = first_only  # only the first call is sent: it alone has to be finished
        self.live: dsml.LiveCalls | None = None  # inside a block of a streamed reply
        self.before: int | None = None  # once calls are under way: the length of the held text sent before them
        self.error: str | None = None

    @property
    def ended(self) -> bool:
        """Whether the reply is over: a stop string met, or a tool block closed."""
        return self.stop is not None or self.calls is not None

    @property
    def sent(self) -> bool:
        """Whether a streamed call of the block was sent (it cannot be taken back)."""
        return self.live is not None and bool(self.live.calls)

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
        self.live = dsml.LiveCalls() if self.live_wanted else None
        return self._block(rest, out)

    def _block(self, text: str, out: list) -> list[tuple[str, str]]:
        """Inside a block: ``text`` held, until a stop string ends the answer or a closing tag the block."""
        window, offset = self.tail + text, self.held_len - len(self.tail)  # window[0]'s place in the held text
        at = self.held_len  # text's place in the held text
        self.held.append(text)
        self.held_len += len(text)
        stop, closing = dsml.first_of(window, self.stops), dsml.first_of(window, dsml.BLOCK_CLOSES)
        if stop is not None and (closing is None or stop[0] < closing[0]):
            if self.sent:
                return self._broken(out, f"unterminated tool call: the stop string {stop[1]!r} ended the reply inside "
                                         "the tool block whose first call was already sent")
            held, self.held = "".join(self.held), []
            return self._end_at(out, held, (offset + stop[0], stop[1]))
        if closing is None:
            self._stream(text, out)
            if self.sent and self.live.failed:  # nothing it can still be
                return self._broken(out, "invalid tool call: the tool block whose first call was already sent is "
                                         "no block of calls")
            self.tail = window[max(0, len(window) - self._longest + 1):]  # where a stop or closing tag may begin
            return [(c, t) for c, t in out if t]
        end = offset + closing[0] + len(closing[1])
        self._stream(text[:end - at], out)
        held, self.held = "".join(self.held)[:end], []
        found = dsml.read_calls(held)
        if self.sent:
            live = self.live
            if (found is None or found[0] != live.block_at or not live.done
                    or [c.name for c in found[1]] != [name for _, name, _ in live.calls]):
                return self._broken(out, "invalid tool call: the tool block whose first call was already sent is no "
                                         "block of calls")
            self.calls = [replace(c, key=key, arguments=live.arguments(i))
                          for i, (c, (key, _, _)) in enumerate(zip(found[1], live.calls))]
            self.block = held[self.before:]
        elif found is None:  # no block of calls: the model's text, the reply over all the same
            out.append(("text", held))
            self.calls = []
        else:
            answer = held[:found[0]].rstrip(dsml.BLANKS)
            out.append(("text", answer))
            self.calls, self.block = found[1], held[len(answer):]
        return [(c, t) for c, t in out if t]

    def _stream(self, text: str, out: list) -> None:
        """A streamed reply's calls as they come; before the first, the held text before its block."""
        if self.live is None:
            return
        items = self.live.feed(text)
        if items and self.before is None:  # the first call started
            before = "".join(self.held)[:self.live.block_at].rstrip(dsml.BLANKS)
            out.append(("text", before))
            self.before = len(before)
        out += items

    def _broken(self, out: list, why: str) -> list[tuple[str, str]]:
        """A streamed reply whose calls were under way ends without them (but for a first call finished, where it
        alone is sent)."""
        live, self.held = self.live, []
        if self.first_only and live.closed:
            key, name, _ = live.calls[0]
            self.calls, self.block = [dsml.ToolCall(name, live.arguments(0), key)], ""
        else:
            self.error, self.calls = why, []
        return [(c, t) for c, t in out if t]

    def _end_at(self, out: list, text: str, stop: tuple[int, str]) -> list[tuple[str, str]]:
        """The answer ends before the stop string met in ``text``."""
        out.append(("text", text[:stop[0]]))
        self.pending, self.stop = "", stop[1]
        return [(c, t) for c, t in out if t]

    def _release(self, out: list, needles) -> list[tuple[str, str]]:
        keep = dsml.partial_tail(self.pending, needles)
        if self.tools and self.channel == "text":  # a blank before a block is not the answer's
            keep = len(self.pending) - len(self.pending[:len(self.pending) - keep].rstrip(dsml.BLANKS))
        cut = len(self.pending) - keep
        out.append((self.channel, self.pending[:cut]))
        self.pending = self.pending[cut:]
        return [(c, t) for c, t in out if t]

    def flush(self) -> list[tuple[str, str]]:
        """The text held back, once generation has ended (a tool block left open included, unless its calls were
        under way)."""
        if self.sent and not self.ended:
            return self._broken([], "unterminated tool call: generation ended inside the tool block whose first "
                                    "call was already sent")
        rest, self.pending = self.pending + "".join(self.held or ()), ""
        self.held = [] if self.held is not None else None
        return [(self.channel, rest)] if rest and not self.ended else []
