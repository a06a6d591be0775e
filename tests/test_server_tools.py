"""Tool calling in ``ds4lab serve`` (ds4lab/server/tools.py): the DSML block written and read back (by hand and by
Hypothesis), the reply's block found in streamed text, the prompts of conversations with tools and calls in each API
worked by hand from ds4-server's rendering (ds4_server.c at 8d57664), each API's answer read by the official clients'
own models, and the whole loop over HTTP with the real clients (the embedded model never writes a tool block: the
worker's decoder is given the model's text)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette", reason="the server extra (pip install -e '.[server]')")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

import ds4lab  # noqa: E402
from ds4lab.server import ServerThread, app, responses  # noqa: E402
from ds4lab.server.channels import Channels  # noqa: E402
from ds4lab.server.protocol import Limits, Request, RequestError, Sampling, parse_chat, parse_messages, parse_responses  # noqa: E402,E501
from ds4lab.server.tools import (  # noqa: E402
    SPELLINGS,
    TOOLS_FOOTER,
    TOOLS_HEADER,
    WRITTEN,
    StructureTracker,
    ToolBlocks,
    ToolCall,
    call_key,
    calls_block,
    read_calls,
    tools_prompt,
)
from ds4lab.server.worker import Job, Outcome  # noqa: E402
from ds4lab.tokenizer import ASSISTANT, BOS, EOS, THINK, THINK_END, USER  # noqa: E402

LIMITS = Limits(("m",), 4096, 64, Sampling(1.0, 0, 1.0, 0.05), "high", chat_model=True)
D = "｜DSML｜"
BLOCK = (f'\n\n<{D}tool_calls>\n<{D}invoke name="read_file">\n'
         f'<{D}parameter name="path" string="true">a&b <x>.txt</{D}parameter>\n'
         f'<{D}parameter name="lines" string="false">[1,20]</{D}parameter>\n'
         f'</{D}invoke>\n</{D}tool_calls>')
ARGS = '{"path":"a&b <x>.txt","lines":[1,20]}'
TOOL = {"name": "read_file", "description": "Read a file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "lines": {"type": "array"}}}}
SCHEMA_LINE = ('{"name":"read_file","description":"Read a file","parameters":{"type":"object","properties":'
               '{"path":{"type":"string"},"lines":{"type":"array"}}}}')


@pytest.fixture(scope="module")
def tokenizer():
    return ds4lab.load(backend="numpy").tokenizer


def test_the_tool_instructions_are_ds4_servers():
    # sha256 of ds4_server.c's append_tools_prompt_text literals (lines 1995-2020 at 8d57664), header and footer
    # joined by a NUL, each C string literal concatenated and its escapes read: the text the model is prompted with
    digest = hashlib.sha256((TOOLS_HEADER + "\0" + TOOLS_FOOTER).encode()).hexdigest()
    assert digest == "db54170b3374cc6ceedcd4ad96e75826c9132a897120a148cb237d028c209fc6"
    assert tools_prompt([TOOL, {"name": "é"}]) == TOOLS_HEADER + SCHEMA_LINE + '\n{"name":"é"}' + TOOLS_FOOTER


def test_a_call_is_written_as_ds4_server_writes_it():
    assert calls_block([ToolCall("read_file", ARGS)]) == BLOCK
    # a closing parameter tag in a string value: its '<' as "&lt;"; inside JSON: "\u003c"; a name's quotes escaped
    odd = ToolCall('say "hi"', json.dumps({"s": f"x</{D}parameter>y", "o": {"k": f"</{D}parameter>"}}))
    assert calls_block([odd]) == (
        f'\n\n<{D}tool_calls>\n<{D}invoke name="say &quot;hi&quot;">\n'
        f'<{D}parameter name="s" string="true">x&lt;/{D}parameter>y</{D}parameter>\n'
        f'<{D}parameter name="o" string="false">{{"k":"\\u003c/{D}parameter>"}}</{D}parameter>\n'
        f'</{D}invoke>\n</{D}tool_calls>')
    # arguments that are no JSON object: one string parameter named arguments
    for args in ("ls -l", '{"x": NaN}', "[" * 100000):  # (NaN is no JSON; nesting past Python's reader)
        assert f'<{D}parameter name="arguments" string="true">{args}</{D}parameter>' in calls_block(
            [ToolCall("sh", args)])
    assert calls_block([]) == ""


def test_a_block_reads_back_into_its_calls():
    assert read_calls("before" + BLOCK + "after") == (len("before\n\n"), [ToolCall("read_file", ARGS)])
    # the other spellings; a parameter without its string attribute is a string; entities undone in strings only;
    # a value that is no JSON (NaN, an infinity, text) its text
    for spelling in ("DSML｜", ""):
        assert read_calls(BLOCK.replace(D, spelling))[1] == [ToolCall("read_file", ARGS)], spelling
    loose = (f'<{D}tool_calls><{D}invoke name="f"><{D}parameter name="a">x &amp; y</{D}parameter>'
             f'<{D}parameter name="n" string="false">not json</{D}parameter>'
             f'<{D}parameter name="i" string="false">1e999</{D}parameter>'
             f'<{D}parameter name="o"><{D}parameter name="k" string="false">NaN</{D}parameter></{D}parameter>'
             f'</{D}invoke></{D}tool_calls>')
    assert read_calls(loose)[1] == [ToolCall("f", '{"a":"x & y","n":"not json","i":"1e999","o":{"k":"NaN"}}')]
    # ds4-server's order: a DSML block is read where plain XML tags came before it (a mention in the answer)
    assert read_calls("Use <tool_calls> here." + BLOCK) == (len("Use <tool_calls> here.\n\n"),
                                                            [ToolCall("read_file", ARGS)])
    # and of one spelling, the opening tag after a blank line before the first one
    mention = "Write <tool_calls> tags:\n\n<tool_calls>\n<invoke name=\"f\">\n</invoke>\n</tool_calls>"
    assert read_calls(mention) == (len("Write <tool_calls> tags:\n\n"), [ToolCall("f", "{}")])
    # the block ends at its first closing tag (one inside a string value too, as there); no closing tag, no call,
    # no opening tag: no block
    inner = ToolCall("f", f'{{"s":"</{D}tool_calls>"}}')
    assert read_calls(calls_block([inner])) is None
    assert read_calls(BLOCK[:-5]) is None and read_calls(f"<{D}tool_calls></{D}tool_calls>") is None
    assert read_calls("plain text") is None


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                     max_leaves=8)
# string values hold no '&' (reading undoes entities in them, as ds4-server's reader does)
_strings = st.text().filter(lambda t: "&" not in t)
_args = st.dictionaries(st.text(min_size=1), _strings | _json.filter(lambda v: not isinstance(v, str)), max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.text(min_size=1), _args), min_size=1, max_size=3))
def test_written_calls_read_back_as_they_were(calls):
    calls = [ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]
    text = calls_block(calls)
    start, read = read_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in read] == [(c.name, json.loads(c.arguments)) for c in calls]
    assert start == 2 and calls_block(read) == text  # written again: the same text (the model's tokens)


def test_the_blocks_kept_are_replayed_for_the_same_calls_only():
    blocks = ToolBlocks(kept=3)
    a, b = ToolCall("read_file", '{"path": "x"}'), ToolCall("sh", '{"cmd": "ls"}')
    blocks.remember([a, b], "\n<block a b>")
    sent_back = [ToolCall("read_file", '{"path":"x"}', a.key), ToolCall("sh", '{"cmd":"ls"}', b.key)]
    assert blocks.text_of(sent_back) == "\n<block a b>"  # the same calls, their JSON re-encoded
    assert blocks.text_of(sent_back[:1]) is None  # a block's calls in part
    assert blocks.text_of([ToolCall("read_file", '{"path":"y"}', a.key), sent_back[1]]) is None  # edited
    assert blocks.text_of([ToolCall("read_file", '{"path":"x"}', "other"), sent_back[1]]) is None  # not ours
    # the same JSON however written (members reordered); another JSON value is another call (1 is not true)
    n1, n2 = ToolCall("g", '{"n": 1, "m": [1]}'), ToolCall("g", '{"n": 2}')
    blocks.remember([n1], "<n1>")
    assert blocks.text_of([ToolCall("g", '{"m":[1],"n":1}', n1.key)]) == "<n1>"
    assert blocks.text_of([ToolCall("g", '{"m":[1],"n":true}', n1.key)]) is None
    blocks.remember([n2], "<n2>")  # past the bound of three calls: the least recently used forgotten (a)
    assert blocks.text_of(sent_back) is None and blocks.text_of([n1]) == "<n1>"
    lru = ToolBlocks(kept=2)
    x, y, z = (ToolCall(name, "{}") for name in "xyz")
    lru.remember([x], "<x>")
    lru.remember([y], "<y>")
    assert lru.text_of([x]) == "<x>"  # looked up: now the most recent
    lru.remember([z], "<z>")
    assert (lru.text_of([x]), lru.text_of([y]), lru.text_of([z])) == ("<x>", None, "<z>")
    assert call_key("call_ab12") == call_key("toolu_ab12") == call_key("fc_ab12") == "ab12" and call_key(7) == ""


def _feed(channels: Channels, pieces) -> list:
    out = []
    for piece in pieces:
        out += channels.feed(piece)
        if channels.ended:
            break
    return out + channels.flush()


def test_the_answers_block_ends_the_reply_and_its_blank_is_never_sent():
    pieces = ["Let me look.", "\n", "\n<｜DS", "ML｜tool_", "calls>\n", BLOCK[len("\n\n<｜DSML｜tool_calls>\n"):-4],
              BLOCK[-4:], "more text"]
    ch = Channels(False, tools=True)
    assert _feed(ch, pieces) == [("text", "Let me look.")] and ch.calls == [ToolCall("read_file", ARGS)]
    assert ch.ended and ch.stop is None
    # streamed: the blank before the block is held while a block may follow, then sent where none does
    ch = Channels(False, tools=True)
    assert ch.feed("a \n") == [("text", "a")] and ch.feed("b") == [("text", " \nb")]
    # without tools, the same text is the answer
    assert "".join(t for _, t in _feed(Channels(False), pieces)) == "".join(pieces)
    # a mention of plain tags before the block: held from the mention, the block read (ds4-server's order)
    ch = Channels(False, tools=True)
    assert _feed(ch, ["Use a <tool_calls> tag.", BLOCK, "more"]) == [("text", "Use a"), ("text", " <tool_calls> tag.")]
    assert ch.calls == [ToolCall("read_file", ARGS)]
    # held text that is no block of calls ends the reply at its closing tag, all of it sent as text
    ch = Channels(False, tools=True)
    assert "".join(t for _, t in _feed(ch, ["a <tool_calls>b</tool_calls>", "c"])) == "a <tool_calls>b</tool_calls>"
    assert ch.calls == [] and ch.ended
    # in the reasoning a block is text (ds4-server reads the answer only)
    ch = Channels(True, tools=True)
    assert _feed(ch, ["r" + BLOCK, "</think>", "ok"]) == [("reasoning", "r" + BLOCK), ("text", "ok")]
    assert ch.calls is None
    # a stop string ends the answer wherever it is met: before a block, or inside one (ds4-server's rule)
    ch = Channels(False, ["STOP"], tools=True)
    assert _feed(ch, ["xSTOP" + BLOCK]) == [("text", "x")] and (ch.stop, ch.calls) == ("STOP", None)
    block_with_stop = calls_block([ToolCall("f", '{"s":"STOP"}')])
    for pieces in ([block_with_stop], [block_with_stop[:30], block_with_stop[30:]]):
        ch = Channels(False, ["STOP"], tools=True)
        assert "".join(t for _, t in _feed(ch, pieces)) == block_with_stop[:block_with_stop.index("STOP")]
        assert (ch.stop, ch.calls) == ("STOP", None)
    # generation ends inside a block: all of it is sent as text, the blank before it too
    ch = Channels(False, tools=True)
    assert "".join(t for _, t in _feed(ch, ["a", BLOCK[:40]])) == "a" + BLOCK[:40] and ch.calls is None


_FRAGMENTS = ["a", " ", "\n\n", "</think>", "STOP", "ST", "<tool_calls>", "</tool_calls>", "<tool_", "calls>",
              f"<{D}tool_calls>", f"</{D}tool_calls>", f'<{D}invoke name="f">', f"</{D}invoke>",
              f'<{D}parameter name="x" string="true">', f"</{D}parameter>", "<", "｜", BLOCK]


def _merged(out) -> list:
    """Pieces of one channel in a row joined (streamed pieces cut anywhere)."""
    merged = []
    for channel, text in out:
        if merged and merged[-1][0] == channel:
            merged[-1] = (channel, merged[-1][1] + text)
        else:
            merged.append((channel, text))
    return merged


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=14), st.lists(st.integers(0, 400), max_size=8),
       st.booleans(), st.booleans())
def test_streamed_pieces_read_as_the_whole_text(fragments, cuts, thinking, tools):
    """However the generation's text is cut into tokens, what is sent, the stop and the calls are what the whole text
    gives (and no text is lost or repeated: with no stop, no block, all of it comes out)."""
    text = "".join(fragments)
    cuts = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole, cut = Channels(thinking, ["STOP"], tools=tools), Channels(thinking, ["STOP"], tools=tools)
    got_whole, got_cut = _merged(_feed(whole, [text])), _merged(_feed(cut, pieces))
    assert got_cut == got_whole and (cut.stop, cut.calls, cut.block) == (whole.stop, whole.calls, whole.block)
    if not whole.ended:
        assert "".join(t for _, t in got_whole) == text.replace("</think>", "", 1 if thinking else 0)


def _live(pieces) -> tuple[Channels, list, dict]:
    """A streamed reply's channels fed ``pieces``: the channels, the text items sent, each call's argument pieces."""
    ch = Channels(False, ["STOP"], tools=True, live=True)
    out = _feed(ch, pieces)
    args: dict[int, list] = {}
    for kind, value in out:
        if kind == "call":
            assert value[0] == len(args) and value[1] == ch.live.calls[value[0]][0]
            args[value[0]] = []
        elif kind == "args":
            args[value[0]].append(value[1])
    return ch, [(k, v) for k, v in out if k in ("reasoning", "text")], args


_CHARS = ["a", " ", "\n", '"', "\\", "&", "&amp;", "&lt;", "<", ">", "é", "</", f"</{D}parameter>", f"</{D}parameter",
          "\u2028"]  # of a string value: what JSON escapes, entities, closing tags whole and begun
_VALUES = st.one_of(st.lists(st.sampled_from(_CHARS), max_size=12).map("".join),
                    st.integers(-5, 5), st.booleans(), st.none(), st.lists(st.integers(0, 3), max_size=3),
                    st.dictionaries(st.sampled_from(["k", "j"]), st.text(max_size=3), max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["f", "read_file", 'say "hi"']),
                          st.dictionaries(st.sampled_from(["a", "path", "x y", "&"]), _VALUES, max_size=3)),
                min_size=1, max_size=3),
       st.sampled_from(["", "Let me look.", "Use <tool_calls> tags.", f"A <{D}tool_calls> mention"]),
       st.lists(st.integers(0, 600), max_size=40), st.sampled_from(SPELLINGS))
def test_streamed_calls_come_as_written_and_join_into_the_calls_read(calls, before, cuts, tags):
    """A streamed reply's calls, however the text is cut into tokens: each call's name once its invoke tag is whole,
    then its arguments' JSON in pieces that join into the arguments read from the whole text (read_calls), the
    text before the block sent before the first call, and the same calls, keys included, at the block's end."""
    block = calls_block([ToolCall(name, json.dumps(args)) for name, args in calls]).replace(WRITTEN.calls,
                                                                                            tags.calls)
    for a, b in zip(WRITTEN[1:], tags[1:]):
        block = block.replace(a, b)
    text = before + block + "after"
    cuts = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assume(read_calls(text) is not None)  # not a mention of a spelling read first (DSML's) before the block
    whole = Channels(False, ["STOP"], tools=True)
    sent = _merged(_feed(whole, [text]))
    live, live_sent, args = _live(pieces)
    assert live.error is None and whole.calls and live.calls == whole.calls and live.block == whole.block
    assert [c.key for c in live.calls] == [key for key, _, _ in live.live.calls]
    assert ["".join(args[i]) for i in range(len(args))] == [c.arguments for c in whole.calls]
    assert _merged(live_sent) == sent
    # the first call started before the block's closing tag came (its string payload too, where it has one)
    end = text.index(tags.calls_close)
    started = Channels(False, tools=True, live=True)
    first = [item for item in started.feed(text[:end]) if item[0] == "call"]
    assert first and first[0][1][2] == whole.calls[0].name and started.calls is None


def test_a_loose_block_streams_into_the_calls_it_reads():
    """Forms long generations drift into, streamed cut at every place: a parameter without its string attribute (a
    string, or parameters in it: sent at its call's end), a name given twice (both sent; JSON's readers keep the
    last, as read_calls does), values that are no JSON (their text), entities undone; then a second call."""
    loose = (f'<{D}tool_calls><{D}invoke name="f"><{D}parameter name="a">x &amp; y</{D}parameter>'
             f'<{D}parameter name="n" string="false">not json</{D}parameter>'
             f'<{D}parameter name="n" string="false">1e999</{D}parameter>'
             f'<{D}parameter name="o"> <{D}parameter name="k" string="false">NaN</{D}parameter></{D}parameter>'
             f'<{D}parameter name="z" string="true">&lt;/{D}parameter></{D}parameter></{D}invoke>'
             f'<{D}invoke name="g"></{D}invoke></{D}tool_calls>')
    read = read_calls(loose)[1]
    assert [json.loads(c.arguments) for c in read] == [{"a": "x & y", "n": "1e999", "o": {"k": "NaN"},
                                                        "z": f"</{D}parameter>"}, {}]
    for cut in range(len(loose) + 1):
        ch, sent, args = _live([loose[:cut], loose[cut:]])
        assert ch.error is None and sent == [] and [c.name for c in ch.calls] == ["f", "g"], cut
        assert [json.loads("".join(args[i])) for i in range(2)] == [json.loads(c.arguments) for c in read], cut


def test_a_streamed_call_that_is_not_finished_ends_the_reply_with_an_error():
    """A call sent cannot be taken back: a block that then ends with the generation, at a stop string or as no
    block of calls ends the reply with an error (ds4-server's "unterminated tool call"), not as text; a block
    before its first call is whole is still text, as unstreamed."""
    two = calls_block([ToolCall("read_file", ARGS), ToolCall("sh", '{"cmd":"ls"}')])
    cut = two.index("sh") + 30
    for pieces, why in (([two[:cut]], "unterminated tool call: generation ended"),
                        ([two[:cut], "xSTOPy"], "unterminated tool call: the stop string 'STOP'"),
                        ([two[:cut], f"junk</{D}tool_calls>"], "invalid tool call")):
        ch, sent, args = _live(["Hi", *pieces])
        assert ch.error.startswith(why) and ch.calls == [] and ch.ended, pieces
        assert _merged(sent) == [("text", "Hi")] and len(args) == 2
    ch, sent, args = _live(["Hi", two[:two.index("read_file") + 3]])
    assert ch.error is None and args == {} and "".join(t for _, t in sent) == "Hi" + two[:two.index("read_file") + 3]
    # text that is no block after a call was sent ends the reply at once (nothing it can still become)
    ch = Channels(False, tools=True, live=True)
    ch.feed("Hi" + two[:two.index(f"</{D}invoke>") + len(f"</{D}invoke>")] + "\njunk")
    assert ch.ended and ch.error.startswith("invalid tool call") and ch.calls == []
    # where only the first call is sent, it alone has to be finished: the reply is its call, no block kept
    for rest in ([], ["xSTOPy"], [f"junk</{D}tool_calls>"]):
        ch = Channels(False, ["STOP"], tools=True, live=True, first_only=True)
        out = _feed(ch, ["Hi", two[:cut], *rest])
        assert ch.error is None and ch.calls == [ToolCall("read_file", ARGS)] and ch.block == "", rest
        assert ch.calls[0].key == next(v[1] for k, v in out if k == "call")
    ch = Channels(False, tools=True, live=True, first_only=True)
    assert _feed(ch, ["Hi", two[:two.index("read_file") + 60]]) and ch.error.startswith("unterminated tool call")


def test_a_streamed_call_starts_only_where_the_whole_reply_reads_its_block():
    """Before its first call, a stream looks on past a tag that was no block only for one read_calls would read
    instead (after a blank line): a mention, then the block after a blank line, streams the block; a mention, then a
    block after one newline (which read_calls does not read: the reply is text) streams no call."""
    block = calls_block([ToolCall("f", '{"a":"b"}')])
    for before, streamed in (("Use <tool_calls> tags.", True), (f"Write <{D}tool_calls> then:", True),
                             (f"Write <{D}tool_calls> then:\n", False)):
        text = before + (block.lstrip("\n") if before.endswith("\n") else block)
        whole, live = Channels(False, tools=True), Channels(False, tools=True, live=True)
        sent, live_sent = _merged(_feed(whole, [text])), _feed(live, [text[:len(text) // 2], text[len(text) // 2:]])
        assert live.error is None and live.calls == whole.calls and (whole.calls != []) == streamed, before
        assert any(k == "call" for k, _ in live_sent) == streamed and _merged(
            [(k, v) for k, v in live_sent if k == "text"]) == sent, before


def test_a_blocks_structure_is_told_from_its_payload():
    """ds4-server's own cases (test_dsml_decode_state_separates_structure_and_payload, ds4_server.c:13542): tags and
    JSON punctuation are structure (sampled greedily), a string parameter's text and a JSON string payload."""
    prefix = f'<{D}tool_calls>\n<{D}invoke name="edit">\n'
    cases = [("plain text, no block", False), (prefix, True),
             (prefix + f'<{D}parameter name="path" string="true">/tmp/a.py', False),
             (prefix + f'<{D}parameter name="path" string="true">/tmp/a.py</', True),
             (prefix + f'<{D}parameter name="edits" string="false">[{{', True),
             (prefix + f'<{D}parameter name="edits" string="false">[{{"newText":"for i in', False),
             (prefix + f'<{D}parameter name="edits" string="false">[{{"t":"a\\"b', False),  # an escaped quote
             (prefix + f'<{D}parameter name="edits" string="false">[]</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
              False), ("<think>r</think>" + prefix, True)]
    for text, structure in cases:
        tracker = StructureTracker()
        assert tracker.feed(text) == structure, text
    done = StructureTracker()
    done.feed(cases[-2][0])
    assert done.feed(prefix) is False  # after the first block, never again (as there)


_STRUCTURE_FRAGMENTS = [f"<{D}tool_calls>", f"</{D}tool_calls>", f'<{D}invoke name="f">', f"</{D}invoke>",
                        f'<{D}parameter name="s" string="true">', f'<{D}parameter name="j" string="false">',
                        f"</{D}parameter>", "</", '"', "\\", "{", "x", " ", "\n", "<tool_calls>", "｜"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_STRUCTURE_FRAGMENTS), max_size=16))
def test_the_structure_read_token_by_token_is_the_whole_texts(fragments):
    """Each fragment a token: every prefix's state is what a fresh read of it gives. (As ds4-server's tracker, a
    payload's "<" that ends a token is read as payload: the closing tag is looked for from two characters on.)"""
    tracker = StructureTracker()
    for k in range(1, len(fragments) + 1):
        fresh = StructureTracker()
        assert tracker.feed(fragments[k - 1]) == fresh.feed("".join(fragments[:k])), fragments[:k]


def test_a_greedy_step_takes_the_argmax_and_draws_nothing(tokenizer):
    model = ds4lab.load(backend="numpy")
    sess = model.session(ctx=256)
    sess.sync(tokenizer.encode("ROMEO: what"))
    decode = sess.decoder(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    state, best = decode.rng.state, int(np.argmax(sess.logits))
    assert decode.step(greedy=True).token == best and decode.rng.state == state


def _chat(**extra) -> dict:
    return {"model": "m", "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "r1",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "contents"}], "tools": [{"type": "function",
                                                                                       "function": TOOL}], **extra}


# worked by hand from render_chat_prompt_text: the tools' text, then the system message after a blank line; the
# reply's calls after its text; the tool result under a User marker; thinking: the reasoning kept (a tool context)
WANT_THINKING = (BOS + TOOLS_HEADER + SCHEMA_LINE + TOOLS_FOOTER + "\n\nS" + USER + "q" + ASSISTANT + THINK + "r1"
                 + THINK_END + "Let me look." + BLOCK + EOS + USER + "<tool_result>contents</tool_result>" + ASSISTANT
                 + THINK)


def test_each_api_renders_a_tool_conversation_as_ds4_server_does(tokenizer):
    chat = parse_chat(_chat(), LIMITS, tokenizer)
    assert chat.text == WANT_THINKING and chat.tools == (TOOL,)
    assert chat.prompt == tokenizer.encode_rendered(WANT_THINKING)
    # no thinking: every reply's thinking closed; tool_choice none: no tools offered (nor read in the reply)
    plain = parse_chat(_chat(reasoning_effort="none"), LIMITS, tokenizer).text
    assert plain == WANT_THINKING.replace(THINK + "r1" + THINK_END, THINK_END)[:-len(THINK)] + THINK_END
    none = parse_chat(_chat(tool_choice="none"), LIMITS, tokenizer)
    assert none.tools == () and none.text == BOS + "S" + WANT_THINKING[WANT_THINKING.index(USER):]
    # tools offered are a tool context by themselves: a reply before the last user turn keeps its reasoning
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r0"},
             {"role": "user", "content": "q2"}]
    kept = THINK + "r0" + THINK_END + "a"
    assert kept in parse_chat(_chat(messages=turns), LIMITS, tokenizer).text
    assert kept not in parse_chat(_chat(messages=turns, tools=[]), LIMITS, tokenizer).text
    # Anthropic: tool_use and tool_result blocks, the result in the user turn's text
    msgs = parse_messages({"model": "m", "max_tokens": 8, "system": "S", "tools": [
        {"name": "read_file", "description": "Read a file", "input_schema": TOOL["parameters"]}], "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "r1", "signature": ""},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                           "input": json.loads(ARGS)}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "contents"}]}]}]}, LIMITS, tokenizer)
    anthropic_schema = SCHEMA_LINE.replace('"parameters"', '"input_schema"')
    assert msgs.text == WANT_THINKING.replace(SCHEMA_LINE, anthropic_schema)
    # Responses: function_call items the calls of the message before them, function_call_output a tool result
    resp = parse_responses({"model": "m", "instructions": "S", "tools": [dict(type="function", **TOOL)], "input": [
        {"role": "user", "content": "q"}, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r1"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "call_1", "output": "contents"}]}, LIMITS, tokenizer)
    assert resp.text == WANT_THINKING.replace(SCHEMA_LINE, '{"type":"function",' + SCHEMA_LINE[1:])
    # a call with no message before it is a reply of its own, taking the reasoning before it
    resp = parse_responses({"model": "m", "input": [
        {"role": "user", "content": "q"}, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
        {"type": "function_call", "call_id": "c", "name": "sh", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "ok"}]}, LIMITS, tokenizer)
    assert resp.text.endswith(USER + "q" + ASSISTANT + THINK + "r" + THINK_END
                              + f'\n\n<{D}tool_calls>\n<{D}invoke name="sh">\n</{D}invoke>\n</{D}tool_calls>' + EOS
                              + USER + "<tool_result>ok</tool_result>" + ASSISTANT + THINK)
    # bad tool input is refused naming the field
    for api, body, param in (
            (parse_chat, _chat(tools=[{"type": "function", "function": {"description": "x"}}]), "tools[0].function"),
            (parse_chat, _chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
            (parse_messages, {"model": "m", "max_tokens": 8, "messages": [{"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "input": {}}]}]}, "messages[0].content[0].name"),
            (parse_messages, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
            (parse_messages, {"model": "m", "max_tokens": 8, "messages": [{"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "f", "input": 3}]}]}, "messages[0].content[0].input"),
            (parse_messages, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}},
             "tool_choice.disable_parallel_tool_use"),
            (parse_responses, {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": 3}]},
             "input[0].arguments")):
        with pytest.raises(RequestError) as e:
            api(body, LIMITS, tokenizer)
        assert e.value.param == param, body


CALLS = [ToolCall("read_file", ARGS), ToolCall("sh", '{"cmd":"ls"}')]


def _events(api: str, events: list, finish: str = "tool_calls"):
    """What ``api`` sends for a worker's events ending in ``finish``: the streamed chunks' data and the whole
    answer."""
    tool = dict(type="function", **TOOL) if api == "responses" else TOOL  # as each API lists it
    req = Request(api, "m", [1, 2, 3], 8, Sampling(1.0, 0, 1.0, 0.0), stream=True, thinking=True, tools=(tool,))
    text = "".join(e[2] for e in events if e[0] == "text" and e[1] == "text")
    reasoning = "".join(e[2] for e in events if e[0] == "text" and e[1] == "reasoning")
    calls = next((e[1] for e in events if e[0] == "calls"), [])
    out = Outcome(3, 0, 9, finish, None, "cold", 0.0, 0.0, 2)
    stream = {"chat": app._openai_stream, "messages": app._anthropic_stream, "responses": responses.stream}[api]
    rid = responses.Ids(5) if api == "responses" else "id-5"

    async def run():
        job = Job(req, asyncio.get_running_loop())
        for e in [("start", 3, 0), *events, ("done", out)]:
            job.events.put_nowait(e)
        return [c async for c in stream(job, rid)]

    blocks = [b for c in asyncio.run(run()) for b in c.split("\n\n") if b.startswith(("data: {", "event: "))]
    data = [json.loads(b.split("data: ", 1)[1]) for b in blocks]
    return data, app._whole(api, rid, Job(req, None), out, reasoning, text, calls)


EVENTS = [("text", "reasoning", "hm"), ("text", "text", "Let me look."), ("calls", CALLS)]


def test_openai_chat_sends_the_calls_whole_and_streamed():
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    data, whole = _events("chat", EVENTS)
    whole = ChatCompletion.model_validate(whole)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("read_file", ARGS), ("sh", '{"cmd":"ls"}')]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    chunks = [ChatCompletionChunk.model_validate(d) for d in data]
    streamed = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.id, t.function.name, t.function.arguments) for t in streamed] == [
        (i, c.id, c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # calls alone: no content
    _, whole = _events("chat", [("calls", CALLS)])
    assert whole["choices"][0]["message"]["content"] is None


def test_anthropic_messages_send_tool_use_blocks():
    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    data, whole = _events("messages", EVENTS)
    whole = Message.model_validate(whole)
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["thinking", "text", "tool_use",
                                                                                   "tool_use"]
    assert [(b.name, b.input) for b in whole.content[2:]] == [("read_file", json.loads(ARGS)), ("sh", {"cmd": "ls"})]
    events = [TypeAdapter(RawMessageStreamEvent).validate_python(d) for d in data]
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["thinking", "text", "tool_use", "tool_use"]
    assert [b.id for b in starts[2:]] == [b.id for b in whole.content[2:]]
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta" and
               e.delta.type == "input_json_delta"]
    assert [json.loads(p) for p in partial] == [b.input for b in whole.content[2:]]
    kinds = [e.type for e in events]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4
    assert [e.delta.stop_reason for e in events if e.type == "message_delta"] == ["tool_use"]
    # calls alone: no text block
    data, whole = _events("messages", [("calls", CALLS[:1])])
    assert [b["type"] for b in whole["content"]] == ["thinking", "tool_use"]
    assert [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"] == ["tool_use"]


def test_responses_send_function_call_items():
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    data, whole = _events("responses", EVENTS)
    whole = Response.model_validate(whole)
    assert whole.status == "completed" and [o.type for o in whole.output] == ["message", "function_call",
                                                                              "function_call"]
    assert [(o.name, o.arguments, o.status) for o in whole.output[1:]] == [
        ("read_file", ARGS, "completed"), ("sh", '{"cmd":"ls"}', "completed")]
    assert [t.name for t in whole.tools] == ["read_file"] and whole.tool_choice == "auto"
    events = [TypeAdapter(ResponseStreamEvent).validate_python(d) for d in data]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.status) for i in done] == [(o.type, o.status) for o in whole.output]
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [ARGS,
                                                                                                  '{"cmd":"ls"}']
    assert events[-1].type == "response.completed" and events[-1].response.output == whole.output


def test_a_failed_response_keeps_the_items_it_streamed_as_streamed():
    """A Responses stream whose reply fails once a call was sent (reasoning, then the call straight after it): its
    reasoning item, done "completed" when the call's item was added, stays so in the failed response; the call is
    "incomplete" there (not to be run), with the arguments sent."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    req = Request("responses", "m", [1, 2, 3], 8, Sampling(1.0, 0, 1.0, 0.0), stream=True, thinking=True,
                  summary="auto", tools=(dict(type="function", **TOOL),))
    events = [("start", 3, 0), ("text", "reasoning", "hm"), ("call", 0, "k1", "read_file"), ("args", 0, '{"path":'),
              ("error", RequestError("unterminated tool call: ...", status=500))]

    async def run():
        job = Job(req, asyncio.get_running_loop())
        for e in events:
            job.events.put_nowait(e)
        return [c async for c in responses.stream(job, responses.Ids(5))]

    blocks = [b for c in asyncio.run(run()) for b in c.split("\n\n") if b.startswith("event: ")]
    data = [TypeAdapter(ResponseStreamEvent).validate_python(json.loads(b.split("data: ", 1)[1])) for b in blocks]
    done = [(e.item.type, e.item.status) for e in data if e.type == "response.output_item.done"]
    final = data[-1]
    assert final.type == "response.failed" and done == [("reasoning", "completed"), ("function_call", "incomplete")]
    assert [(o.type, o.status) for o in final.response.output] == done
    assert final.response.output[1].arguments == '{"path":' and final.response.output[1].call_id == "call_k1"


class _Scripted:
    """A decoder that writes ``pieces`` (a token's text each), then EOS; ``greedy`` holds each step's ask."""

    def __init__(self, pieces):
        self.pieces, self.stop_reason, self.greedy = list(pieces), None, []

    def step(self, more=True, greedy=False):
        self.greedy.append(greedy)
        if not self.pieces:
            self.stop_reason = "eos"
            return SimpleNamespace(text="")
        return SimpleNamespace(text=self.pieces.pop(0))


def test_a_tool_loop_over_http_with_the_real_clients(tokenizer):
    """The model's block becomes the clients' tool calls; the conversation sent back with them and the result renders
    the prompt that extends the first one by exactly the text the model wrote (what the live tokens hold)."""
    model = ds4lab.load(backend="numpy")
    written = ["I will read it.", "\n\n", BLOCK.lstrip()[:30], BLOCK.lstrip()[30:], "ignored after the block"]
    with ServerThread(model, ctx=1024, prefill_chunk=64, max_tokens=32) as srv:
        srv.worker.session.decoder = lambda **_: _Scripted(written)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "What is in notes.txt?"}]
        tools = [{"type": "function", "function": TOOL}]
        r = client.chat.completions.create(model="shakespeare", messages=messages, tools=tools, max_tokens=32)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content == "I will read it."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("read_file", json.loads(ARGS))]
        limits = dataclasses.replace(LIMITS, chat_model=False)  # the embedded model's: no chat template, no thinking
        first = parse_chat({"model": "m", "messages": messages, "tools": tools}, limits, tokenizer)
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "hello"}]
        second = parse_chat({"model": "m", "messages": messages, "tools": tools}, limits, tokenizer)
        assert second.text.startswith(first.text + "".join(written[:4]) + EOS)
        # a block written otherwise (one newline before it, a JSON value with spaces): rendered from the server's
        # memory of it as written, by the calls' ids, through each API's client; without it, as the canonical form
        loose = "I will read it.\n" + BLOCK.lstrip().replace("[1,20]", "[1, 20]")
        srv.worker.session.decoder = lambda **_: _Scripted([loose])
        message = client.chat.completions.create(model="shakespeare", messages=messages[:1], tools=tools,
                                                 max_tokens=32).choices[0].message
        again = {"model": "m", "tools": tools, "messages": messages[:1] + [
            message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                                                    "content": "hello"}]}
        assert parse_chat(again, limits, tokenizer, srv.worker.tool_blocks).text.startswith(first.text + loose + EOS)
        assert not parse_chat(again, limits, tokenizer).text.startswith(first.text + loose)
        # streamed, and the same model text through Anthropic's client
        srv.worker.session.decoder = lambda **_: _Scripted(written)
        chunks = list(client.chat.completions.create(model="shakespeare", messages=messages[:1], tools=tools,
                                                     max_tokens=32, stream=True))
        calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == "read_file" and {t.index for t in calls} == {0}
        assert "".join(t.function.arguments for t in calls) == ARGS
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "I will read it."
        srv.worker.session.decoder = lambda **_: _Scripted(written)
        claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        reply = claude.messages.create(model="shakespeare", max_tokens=32, messages=messages[:1], tools=[
            {"name": "read_file", "input_schema": TOOL["parameters"]}])
        assert reply.stop_reason == "tool_use" and reply.content[-1].input == json.loads(ARGS)
        srv.worker.session.decoder = lambda **_: _Scripted([loose])
        anthropic_tools = [{"name": "read_file", "input_schema": TOOL["parameters"]}]
        reply = claude.messages.create(model="shakespeare", max_tokens=32, messages=messages[:1], tools=anthropic_tools)
        back = {"model": "m", "max_tokens": 8, "tools": anthropic_tools, "messages": messages[:1] + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": reply.content[-1].id,
                                          "content": "hello"}]}]}
        first = parse_messages(dict(back, messages=messages[:1]), limits, tokenizer)
        assert parse_messages(back, limits, tokenizer, srv.worker.tool_blocks).text.startswith(first.text + loose + EOS)
        # the block's structure sampled greedily, its string payload and the answer as asked
        tokens = ["Sure.", "\n\n", f"<{D}tool_calls>", "\n", f'<{D}invoke name="read_file">', "\n",
                  f'<{D}parameter name="path" string="true">', "a.txt", "</", f"{D}parameter>", "\n",
                  f'<{D}parameter name="lines" string="false">', "[1,", "20]", f"</{D}parameter>", "\n",
                  f"</{D}invoke>", "\n", f"</{D}tool_calls>"]
        scripted = _Scripted(tokens)
        srv.worker.session.decoder = lambda **_: scripted
        client.chat.completions.create(model="shakespeare", messages=messages[:1], tools=tools, max_tokens=32)
        assert scripted.greedy == [False, False, False, True, True, True, True, False, False, True, True, True,
                                   True, True, True, True, True, True, True]
        # two calls in the block: both sent, or the first alone where parallel calls are off
        two = calls_block([ToolCall("read_file", ARGS), ToolCall("sh", '{"cmd":"ls"}')])
        for parallel, names in ((True, ["read_file", "sh"]), (False, ["read_file"])):
            srv.worker.session.decoder = lambda **_: _Scripted([two])
            r = client.chat.completions.create(model="shakespeare", messages=messages[:1], tools=tools, max_tokens=32,
                                               parallel_tool_calls=parallel)
            assert [c.function.name for c in r.choices[0].message.tool_calls] == names, parallel


def test_each_api_streams_calls_as_the_model_writes_them(tokenizer):
    """Streamed through each API's own client and its stream helper: a call's arguments come in pieces as the model
    writes them, and the clients put them together into the calls a whole reply holds (read by read_calls); the
    second call only where parallel calls are on. A block cut off after its first call was sent: the clients raise
    (OpenAI's, Anthropic's) or the response fails with the call incomplete (Responses)."""
    model = ds4lab.load(backend="numpy")
    two = calls_block([ToolCall("read_file", ARGS), ToolCall("sh", '{"cmd":"ls -l &","n":2}')])
    text = "I will read it." + two
    written = [text[i:i + 3] for i in range(0, len(text), 3)]  # a token every three characters
    messages = [{"role": "user", "content": "What is in notes.txt?"}]
    tools = [{"type": "function", "function": TOOL}]
    claude_tools = [{"name": "read_file", "input_schema": TOOL["parameters"]}]
    expected = [("read_file", json.loads(ARGS)), ("sh", {"cmd": "ls -l &", "n": 2})]
    with ServerThread(model, ctx=1024, prefill_chunk=64, max_tokens=400) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        srv.worker.session.decoder = lambda **_: _Scripted(written)
        with client.chat.completions.stream(model="shakespeare", messages=messages, tools=tools, max_tokens=400) as s:
            pieces = [e for e in s if e.type == "tool_calls.function.arguments.delta"]
            final = s.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls" and final.message.content == "I will read it."
        got = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
        assert got == expected and len(pieces) > 6 and len({c.id for c in final.message.tool_calls}) == 2
        srv.worker.session.decoder = lambda **_: _Scripted(written)
        with claude.messages.stream(model="shakespeare", max_tokens=400, messages=messages, tools=claude_tools) as s:
            pieces = [e for e in s if e.type == "input_json"]
            message = s.get_final_message()
        assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["text", "tool_use",
                                                                                           "tool_use"]
        assert [(b.name, b.input) for b in message.content[1:]] == expected and len(pieces) > 6
        srv.worker.session.decoder = lambda **_: _Scripted(written)
        with client.responses.stream(model="shakespeare", input="What is in notes.txt?", max_output_tokens=400,
                                     tools=[dict(type="function", **TOOL)]) as s:
            events = list(s)
            response = s.get_final_response()
        pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
        items = [(e.type[21:], e.output_index, e.item.type) for e in events
                 if e.type.startswith("response.output_item")]
        assert items == [("added", 0, "message"), ("done", 0, "message"), ("added", 1, "function_call"),
                         ("added", 2, "function_call"), ("done", 1, "function_call"), ("done", 2, "function_call")]
        assert response.status == "completed" and [o.type for o in response.output] == ["message", "function_call",
                                                                                       "function_call"]
        assert [(o.name, json.loads(o.arguments)) for o in response.output[1:]] == expected and len(pieces) > 6
        srv.worker.session.decoder = lambda **_: _Scripted(written)
        chunks = list(client.chat.completions.create(model="shakespeare", messages=messages, tools=tools,
                                                     max_tokens=400, stream=True, parallel_tool_calls=False))
        assert {t.index for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []} == {0}
        # cut off inside the second call
        cut = written[:len("I will read it." + two[:two.index('"sh"') + 20]) // 3]
        srv.worker.session.decoder = lambda **_: _Scripted(cut)
        with pytest.raises(openai.APIError, match="unterminated tool call"):
            list(client.chat.completions.create(model="shakespeare", messages=messages, tools=tools, max_tokens=400,
                                                stream=True))
        srv.worker.session.decoder = lambda **_: _Scripted(cut)
        with pytest.raises(anthropic.APIError, match="unterminated tool call"):
            with claude.messages.stream(model="shakespeare", max_tokens=400, messages=messages,
                                        tools=claude_tools) as s:
                list(s)
        srv.worker.session.decoder = lambda **_: _Scripted(cut)
        events = list(client.responses.create(model="shakespeare", input="x", max_output_tokens=400, stream=True,
                                              tools=[dict(type="function", **TOOL)]))
        failed = events[-1].response
        assert events[-1].type == "response.failed" and "unterminated tool call" in failed.error.message
        assert [(o.type, o.status) for o in failed.output] == [("message", "completed"),
                                                              ("function_call", "incomplete"),
                                                              ("function_call", "incomplete")]
        assert json.loads(failed.output[1].arguments) == json.loads(ARGS)
        srv.worker.session.decoder = lambda **_: _Scripted(written)  # the server serves on after a failed reply
        assert client.chat.completions.create(model="shakespeare", messages=messages, tools=tools,
                                              max_tokens=400).choices[0].finish_reason == "tool_calls"
