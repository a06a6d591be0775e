"""Tool calling in DeepSeek V4's DSML, as ds4-server serves it (ds4_server.c at 8d57664): the tools' schemas open
the system prompt under :data:`TOOLS_HEADER`, one JSON object a line; an earlier reply's calls follow its text as a
DSML block (:func:`calls_block`); and the block a reply writes is read back into calls (:func:`read_calls`):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="read_file">
    <｜DSML｜parameter name="path" string="true">notes.txt</｜DSML｜parameter>
    <｜DSML｜parameter name="lines" string="false">[1,20]</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A string parameter is its raw text, a closing parameter tag in it written with "&lt;" for its '<'; any other value
is JSON. Reading follows ds4-server's reader: the five XML entities are undone in string values and names (a
string that holds "&amp;" as text reads back as "&"); the block ends at its first closing tag; the tags are also
read with the first bar of ``｜DSML｜`` left out or as plain XML (``<tool_calls>``), forms long generations drift
into. A block written as the model is asked to write it (one blank line before it, compact JSON values, as above)
reads back into calls that :func:`calls_block` writes again as the same text; a block written otherwise is kept
by its calls' ids (:class:`ToolBlocks`, as ds4-server's tool memory keeps it), so that a conversation sent back
with the calls the server returned renders the text the model wrote, and continues from the live tokens."""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from ..tokenizer import DSML

# Must match append_tools_prompt_text, ds4_server.c:1995-2020 at 8d57664 (DeepSeek's tool prompt, as ds4-server
# words it): the same text renders the same tokens, so either server's checkpoints serve the other's requests.
TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. "
    f"You can invoke tools by writing a \"<{DSML}tool_calls>\" block like the following:\n\n"
    f"<{DSML}tool_calls>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME\">\n"
    f"<{DSML}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{DSML}parameter>\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"<{DSML}invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>\n\n"
    "String parameters should be specified as raw text and set `string=\"true\"`. "
    "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or "
    "HTML entity escapes. "
    f"Only if a string value itself contains the exact closing parameter tag `</{DSML}parameter>`, write that tag as "
    f"`&lt;/{DSML}parameter>` inside the value. "
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    "`string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_FOOTER = ("\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. "
                "Use the exact parameter names from the schemas.")

class Tags(NamedTuple):
    """A block's tags in one spelling (``invoke`` and ``param`` open a tag that its attributes and '>' end)."""

    calls: str
    calls_close: str
    invoke: str
    invoke_close: str
    param: str
    param_close: str


def _tags(spelling: str) -> Tags:
    s = spelling
    return Tags(f"<{s}tool_calls>", f"</{s}tool_calls>", f"<{s}invoke", f"</{s}invoke>", f"<{s}parameter",
                f"</{s}parameter>")


# The three spellings read, in ds4-server's order: DSML, DSML without its first bar, plain XML (written: the first).
SPELLINGS = tuple(_tags(s) for s in (DSML, DSML[1:], ""))
WRITTEN = SPELLINGS[0]
BLOCK_OPENS = tuple(t.calls for t in SPELLINGS)
BLOCK_CLOSES = tuple(t.calls_close for t in SPELLINGS)
BLANKS = " \t\n\r\v\f"  # what ds4-server's reader skips between tags (C's isspace: ASCII only)
_ENTITIES = {"&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'"}
_ENTITY = re.compile("|".join(_ENTITIES))


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments as a JSON object's text; ``key`` the server's id for a call a
    reply made (each API writes it with its prefix: ``call_``, ``toolu_``, ``fc_``)."""

    name: str
    arguments: str
    key: str = field(default_factory=lambda: secrets.token_hex(12), compare=False)


def compact(value) -> str:
    """JSON as the tools' schemas and a call's arguments are written: no spaces, characters as they are (no NaN or
    infinities: a ValueError)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def tools_prompt(schemas: list[dict]) -> str:
    """The system prompt's head that offers ``schemas`` (each a tool's JSON object, written compact; ds4-server writes
    the bytes the client sent, which most clients send compact)."""
    return TOOLS_HEADER + "\n".join(compact(s) for s in schemas) + TOOLS_FOOTER


def _attr(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _parameter(name: str, value) -> str:
    if isinstance(value, str):
        kind, body = "true", value.replace(WRITTEN.param_close, "&lt;" + WRITTEN.param_close[1:])
    else:  # in JSON the tag can only be inside a string, where "\u003c" is its '<'
        kind, body = "false", compact(value).replace(WRITTEN.param_close, "\\u003c" + WRITTEN.param_close[1:])
    return f'{WRITTEN.param} name="{_attr(name)}" string="{kind}">{body}{WRITTEN.param_close}\n'


def calls_block(calls) -> str:
    """The DSML block of an assistant message's ``calls`` (after its text, a blank line between): each call's
    arguments one parameter a member, in their order; arguments that are no JSON object one string parameter
    named "arguments" (ds4-server's rule)."""
    if not calls:
        return ""
    out = ["\n\n", WRITTEN.calls, "\n"]
    for call in calls:
        args = json_value(call.arguments, None)
        params = ([_parameter(k, v) for k, v in args.items()] if isinstance(args, dict)
                  else [_parameter("arguments", call.arguments)])
        out += [f'{WRITTEN.invoke} name="{_attr(call.name)}">\n', *params, WRITTEN.invoke_close, "\n"]
    out.append(WRITTEN.calls_close)
    return "".join(out)


def _unescape(text: str) -> str:
    return _ENTITY.sub(lambda m: _ENTITIES[m.group()], text)


def _tag_attrs(tag: str) -> dict:
    return {k: _unescape(v) for k, v in re.findall(r'(\w+)="([^"]*)"', tag)}


class _Reader:
    """A block's text read left to right in one spelling; each method returns None where the text is not DSML."""

    def __init__(self, text: str, tags: Tags):
        self.text, self.at, self.tags = text, 0, tags

    def skip_space(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in BLANKS:
            self.at += 1

    def take(self, literal: str) -> bool:
        self.skip_space()
        if self.text.startswith(literal, self.at):
            self.at += len(literal)
            return True
        return False

    def tag(self, opening: str) -> dict | None:
        """The attributes of the tag that starts with ``opening`` here (None if another comes)."""
        self.skip_space()
        end = self.text.find(">", self.at)
        if not self.text.startswith(opening, self.at) or end < 0:
            return None
        attrs = _tag_attrs(self.text[self.at:end])
        self.at = end + 1
        return attrs

    def calls(self) -> list[ToolCall] | None:
        calls = []
        while not self.take(self.tags.calls_close):
            attrs = self.tag(self.tags.invoke)
            if attrs is None or "name" not in attrs:
                return None
            args = self.arguments(self.tags.invoke_close)
            if args is None:
                return None
            calls.append(ToolCall(attrs["name"], compact(args)))
        return calls

    def arguments(self, close: str) -> dict | None:
        """Parameters up to ``close``: a string one's raw text unescaped, another's JSON (its text as a string
        where it is no JSON); one with no ``string`` attribute that holds parameters is an object of them (a form
        long generations drift into, read as ds4-server reads it)."""
        args = {}
        while not self.take(close):
            attrs = self.tag(self.tags.param)
            if attrs is None or "name" not in attrs:
                return None
            value_at = self.at  # a value's own blanks are its text
            self.skip_space()
            if "string" not in attrs and self.text.startswith(self.tags.param, self.at):
                value = self.arguments(self.tags.param_close)
                if value is None:
                    return None
            else:
                end = self.text.find(self.tags.param_close, value_at)
                if end < 0:
                    return None
                raw, self.at = self.text[value_at:end], end + len(self.tags.param_close)
                value = _unescape(raw) if attrs.get("string", "true") == "true" else json_value(raw, raw)
            args[attrs["name"]] = value
        return args


def json_value(text: str, default):
    """The JSON value ``text`` holds, or ``default`` where it is no JSON that can be written again (NaN and
    infinities, which Python's reader takes, or nesting past Python's reader)."""
    try:
        value = json.loads(text)
        compact(value)
    except (ValueError, RecursionError):
        return default
    return value


def first_of(text: str, markers, start: int = 0) -> tuple[int, str] | None:
    """The first of ``markers`` in ``text`` from ``start``: ``(where, which)``, or None."""
    return min(((at, m) for m in markers if (at := text.find(m, start)) >= 0), default=None)


def read_calls(text: str) -> tuple[int, list[ToolCall]] | None:
    """The calls of the answer ``text``'s tool block and where the block starts, read as ds4-server reads them
    (parse_generated_message_ex): the block of the first spelling, in the order DSML, DSML without its first bar,
    plain XML, that ``text`` holds an opening tag of (the first after a blank line, else the first), up to its
    first closing tag; None where it holds none or that is no well-formed block of calls."""
    for tags in SPELLINGS:
        start = text.find("\n\n" + tags.calls)
        start = start + 2 if start >= 0 else text.find(tags.calls)
        if start < 0:
            continue
        end = text.find(tags.calls_close, start)
        if end < 0:
            return None
        reader = _Reader(text[:end + len(tags.calls_close)], tags)
        reader.at = start + len(tags.calls)
        calls = reader.calls()
        return (start, calls) if calls else None
    return None


def partial_tail(text: str, needles) -> int:
    """The length of the longest end of ``text`` that is a proper start of one of ``needles``."""
    best = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:k]):
                best = k
                break
    return best


def _json_chars(text: str) -> str:
    """``text`` as the inside of a JSON string (so a string's pieces, each written so, join into the string's JSON)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class LiveCalls:
    """A streamed reply's tool calls as the model writes them (ds4-server's live tool stream, ds4_server.c:5530-5860
    at 8d57664): fed the held text from the blank before the first opening tag, ``feed`` returns
    ``("call", (index, key, name))`` once a call's invoke tag is whole, and ``("args", (index, text))``, pieces of its
    arguments' JSON: the object's opening brace, each parameter's name, a string's characters as they come (a
    closing tag or an entity that may be under way held back), any other value whole at its closing tag, the
    closing brace. Read as :func:`read_calls` reads, so a call's pieces join into the arguments it reads (where a
    name is given twice both are sent, the last read back, as it keeps it); from a parameter without a ``string``
    attribute (which may hold parameters) on, the rest of its call is sent at the call's end. Where the text after
    an opening tag is no block, an opening tag read_calls would read instead is looked for until a call starts;
    after that, text that is no block stops the stream (``failed``). ``block_at`` is where the block's opening tag
    is in the text fed, ``calls`` each started call's ``[key, name, pieces]``, ``closed`` how many of them ended,
    ``done`` whether the block's closing tag was read."""

    def __init__(self):
        self.text, self.base, self.at = "", 0, 0  # the text not yet dropped, its place in all fed, the read point
        self.mode = "search"  # search, invokes, params, value, deferred, done, failed
        self.tags = WRITTEN
        self.block_at: int | None = None
        self.after_blank = False  # whether the opening tag read came after a blank line
        self.retry: tuple[str, ...] = ()  # after a tag that was no block: the tags looked for instead
        self.calls: list[list] = []
        self.closed = 0  # calls whose closing brace was sent
        self.first = True  # no parameter sent yet in the call under way
        self.string = False  # the value under way is a string's (sent as it comes)
        self.value_at = self.scan = 0  # a value's start; where its closing tag is looked for from

    @property
    def done(self) -> bool:
        return self.mode == "done"

    @property
    def failed(self) -> bool:
        return self.mode == "failed"

    def arguments(self, index: int) -> str:
        return "".join(self.calls[index][2])

    def feed(self, text: str) -> list[tuple[str, tuple]]:
        self.text += text
        out: list[tuple[str, tuple]] = []
        while self.mode not in ("done", "failed") and getattr(self, "_" + self.mode)(out):
            pass
        # kept: from the read point, or from the value where it is read whole at its end
        whole = self.mode == "deferred" or self.mode == "value" and not self.string
        keep = min(self.at, self.value_at) if whole else self.at
        self.text, self.base = self.text[keep:], self.base + keep  # what is read is dropped
        self.at, self.value_at, self.scan = self.at - keep, self.value_at - keep, max(0, self.scan - keep)
        return out

    def _send(self, out: list, text: str) -> None:
        if text:
            self.calls[-1][2].append(text)
            out.append(("args", (len(self.calls) - 1, text)))

    def _fail(self) -> bool:
        """Text that is no block: after a call, stop; before one, look on for an opening tag that read_calls would
        read instead (after a blank line: of a spelling it reads first, or of this one where this tag came after
        none)."""
        if not self.calls:
            k = SPELLINGS.index(self.tags)
            self.retry = tuple("\n\n" + t.calls for t in SPELLINGS[:k + (not self.after_blank)])
        self.mode = "search" if not self.calls and self.retry else "failed"
        return self.mode == "search"

    def _at_tag(self, *tags) -> bool:
        """Whether the text from the read point (blanks skipped) is whole, i.e. not a proper start of ``tags``."""
        while self.at < len(self.text) and self.text[self.at] in BLANKS:
            self.at += 1
        rest = self.text[self.at:self.at + max(map(len, tags))]
        return bool(rest) and partial_tail(rest, tags) < len(rest)

    def _tag(self) -> dict | None:
        """The attributes of the tag at the read point, the point moved past it; None where its '>' is still to come."""
        gt = self.text.find(">", self.at)
        if gt < 0:
            return None
        attrs, self.at = _tag_attrs(self.text[self.at:gt]), gt + 1
        return attrs

    def _search(self, out) -> bool:
        opens = self.retry or BLOCK_OPENS
        found = first_of(self.text, opens, self.at)
        if found is None:
            self.at = max(self.at, len(self.text) - max(map(len, opens)) + 1)
            return False
        opening = found[1].lstrip("\n")
        start = found[0] + len(found[1]) - len(opening)
        self.tags, self.after_blank = SPELLINGS[BLOCK_OPENS.index(opening)], self.text[:start].endswith("\n\n")
        self.block_at, self.at, self.mode = self.base + start, start + len(opening), "invokes"
        return True

    def _next(self, close: str, opening: str):
        """What is at the read point (read past): "close" for the tag ``close``, ``(start, attributes)`` for a named
        tag that ``opening`` begins; None until more text tells, False where the text is no block."""
        if not self._at_tag(close, opening):
            return None
        if self.text.startswith(close, self.at):
            self.at += len(close)
            return "close"
        start = self.at
        attrs = self._tag() if self.text.startswith(opening, self.at) else {}
        if attrs is None:
            return None
        if "name" not in attrs:
            self.at = start
            return False
        return start, attrs

    def _invokes(self, out) -> bool:
        got = self._next(self.tags.calls_close, self.tags.invoke)
        if got == "close":
            self.mode = "done"
        if not isinstance(got, tuple):
            return got is False and self._fail()
        key, name = secrets.token_hex(12), got[1]["name"]
        self.calls.append([key, name, []])
        out.append(("call", (len(self.calls) - 1, key, name)))
        self._send(out, "{")
        self.first, self.mode = True, "params"
        return True

    def _params(self, out) -> bool:
        got = self._next(self.tags.invoke_close, self.tags.param)
        if got == "close":
            self._send(out, "}")
            self.closed += 1
            self.mode = "invokes"
            return True
        if not isinstance(got, tuple):
            return got is False and self._fail()
        at, attrs = got
        if "string" not in attrs:  # perhaps parameters in it: sent whole at the call's end
            self.at = self.value_at = self.scan = at
            self.mode = "deferred"
            return True
        self.string = attrs["string"] == "true"
        self._send(out, ("" if self.first else ",") + compact(attrs["name"]) + ":" + '"' * self.string)
        self.first, self.mode, self.value_at = False, "value", self.at
        self.scan = self.at
        return True

    def _value(self, out) -> bool:
        close = self.tags.param_close
        end = self.text.find(close, self.scan)
        if end < 0:
            self.scan = max(self.scan, len(self.text) - len(close) + 1)
            if self.string:  # send what can no longer be part of the closing tag or of an entity
                safe = len(self.text) - partial_tail(self.text[self.at:], (close,))
                amp = self.text.rfind("&", self.at, safe)
                if amp >= 0 and partial_tail(self.text[amp:safe], _ENTITIES) == safe - amp:
                    safe = amp
                self._send(out, _json_chars(_unescape(self.text[self.at:safe])))
                self.at = max(self.at, safe)
            return False
        if self.string:
            self._send(out, _json_chars(_unescape(self.text[self.at:end])) + '"')
        else:
            raw = self.text[self.value_at:end]
            self._send(out, compact(json_value(raw, raw)))
        self.at, self.mode = end + len(close), "params"
        return True

    def _deferred(self, out) -> bool:
        """The call's parameters from one without a ``string`` attribute to its closing tag, read whole by the
        reader once that tag has come (each sent as the reader writes it)."""
        t = self.tags
        if self.text.find(t.invoke_close, self.scan) < 0:
            self.scan = max(self.scan, len(self.text) - len(t.invoke_close) + 1)
            return False
        reader = _Reader(self.text, t)
        reader.at = self.value_at
        args = reader.arguments(t.invoke_close)
        if args is None:  # not yet whole (a closing tag inside a value), or no block: the reply's end tells
            self.scan = len(self.text) - len(t.invoke_close) + 1
            return False
        for name, value in args.items():
            self._send(out, ("" if self.first else ",") + compact(name) + ":" + compact(value))
            self.first = False
        self._send(out, "}")
        self.closed += 1
        self.at, self.mode = reader.at, "invokes"
        return True


TOOL_BLOCKS_KEPT = 1024  # calls whose block a server keeps (the least recently used forgotten first)
_ID_PREFIXES = ("call_", "toolu_", "fc_")  # the APIs' prefixes of a call's key (app.openai_call and the others)


def call_key(call_id) -> str:
    """The key of a call the server returned, from the id a client sends back ("" for an id it never made)."""
    if isinstance(call_id, str):
        for prefix in _ID_PREFIXES:
            if call_id.startswith(prefix):
                return call_id[len(prefix):]
    return ""


class ToolBlocks:
    """The text of the blocks the model wrote (from the end of the reply's text, its blank included, to the block's
    closing tag), by their calls' keys; a reply sent back with all of its block's calls, unchanged, is rendered with
    the block's own text. Bounded: the TOOL_BLOCKS_KEPT calls last remembered or looked up (ds4-server keeps up to
    100,000 ids in 512 MiB, and replays a block for any of its calls). Shared by the worker, which remembers, and the
    request parser, which looks up (a thread each)."""

    def __init__(self, kept: int = TOOL_BLOCKS_KEPT):
        self.kept = kept
        self._blocks: OrderedDict[str, tuple[str, tuple]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, calls: list[ToolCall], text: str) -> None:
        with self._lock:
            for call in calls:
                self._blocks[call.key] = (text, tuple(calls))
                self._blocks.move_to_end(call.key)
            while len(self._blocks) > self.kept:
                self._blocks.popitem(last=False)

    def text_of(self, calls) -> str | None:
        """The block's own text where ``calls`` are exactly the calls of one block kept (names and arguments as
        values: a client's re-encoded JSON matches), else None."""
        with self._lock:
            kept = {self._blocks.get(c.key, (None, None)) for c in calls} if calls else set()
            if len(kept) == 1 and None not in next(iter(kept)):
                for call in calls:
                    self._blocks.move_to_end(call.key)
        if len(kept) != 1:
            return None
        text, block_calls = kept.pop()
        if text is None or len(block_calls) != len(calls):
            return None
        same = all(a.key == b.key and a.name == b.name and _same_json(a.arguments, b.arguments)
                   for a, b in zip(calls, block_calls))
        return text if same else None


def _same_json(a: str, b: str) -> bool:
    """Whether two arguments' texts are one JSON value, however written (members in any order; 1, 1.0 and true
    apart, as JSON's text tells them)."""
    def norm(text):
        value = json_value(text, None)
        return text if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)
    return norm(a) == norm(b)


class StructureTracker:
    """Whether the model is writing a tool block's structure, which ds4-server samples greedily (its
    dsml_decode_tracker, ds4_server.c:5366-5500): from the first opening tag of any spelling in the generated text
    (the reasoning's too, as there) to the block's closing tag, but for a string parameter's text and the strings
    inside a JSON value (the payload, sampled as asked). Fed each token's text; :attr:`structure` is the state the
    next token is sampled in. Only the text not yet read is kept; as there, a payload's closing tag is looked for
    from its first two characters ("</"), so a token that ends the payload's text with "<" leaves it payload."""

    def __init__(self):
        self.mode = "search"  # search, structure, string (a string parameter's text), json (a JSON value), done
        self.text = ""  # what is not yet read (in search mode, the end an opening tag may begin in)
        self.tags = WRITTEN  # the block's spelling, once its opening tag is read
        self.in_string = self.escaped = False
        self.structure = False

    def feed(self, text: str) -> bool:
        self.text += text
        self.structure = self._read()
        return self.structure

    def _read(self) -> bool:
        while True:
            if self.mode == "done":
                return False
            if self.mode == "search":
                found = first_of(self.text, BLOCK_OPENS)
                if found is None:
                    keep = max(map(len, BLOCK_OPENS)) - 1  # where an opening tag may begin
                    self.text = self.text[max(0, len(self.text) - keep):]
                    return False
                self.tags = SPELLINGS[BLOCK_OPENS.index(found[1])]
                self.text, self.mode = self.text[found[0] + len(found[1]):], "structure"
            if self.mode in ("string", "json"):
                end = self._payload_end()
                if end is None:  # all read: at what may begin the closing tag (structure), in a JSON value's
                    # punctuation (structure), or in a string's text (payload)
                    return bool(self.text) or self.mode == "json" and not self.in_string
                self.text, self.mode = self.text[end:], "structure"
            t = self.tags
            self.text = self.text.lstrip(BLANKS)
            if self.text.startswith(t.calls_close):
                self.text, self.mode = "", "done"
                return False
            if self.text.startswith(t.invoke_close):
                self.text = self.text[len(t.invoke_close):]
                continue
            gt = self.text.find(">")
            if self.text.startswith((t.invoke, t.param)) and gt >= 0:
                tag, self.text = self.text[:gt + 1], self.text[gt + 1:]
                if tag.startswith(t.param):
                    self.mode = "string" if _tag_attrs(tag).get("string") == "true" else "json"
                    self.in_string = self.escaped = False
                continue
            return True  # a tag begun, text between tags, or nothing yet: structure

    def _payload_end(self) -> int | None:
        """In a payload: where its closing tag ends (the text read up to there), or None (all of it read but a
        possible start of the closing tag, at least "</", which stays)."""
        close = self.tags.param_close
        at = 0
        while at < len(self.text):
            if not (self.mode == "json" and self.in_string):
                if self.text.startswith(close, at):
                    return at + len(close)
                rest = self.text[at:]
                if len(rest) >= 2 and close.startswith(rest):
                    self.text = rest
                    return None
            if self.mode == "json":
                c = self.text[at]
                if self.in_string:
                    self.escaped, self.in_string = (False, True) if self.escaped else (c == "\\", c != '"')
                elif c == '"':
                    self.in_string = True
            at += 1
        self.text = ""
        return None
