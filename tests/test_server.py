"""``ds4lab serve`` driven by the real ``openai`` and ``anthropic`` clients (tests start it on 127.0.0.1 on a free
port, in a thread or, for SIGKILL and SIGTERM, as ``ds4lab serve`` in a child process) with the embedded model on
the numpy backend. What the server sends is compared with the same work done through the Python API on a model
loaded apart (sessions, the sampler, the tokenizer); reuse is read from ``usage`` and from the store's files."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the server extra (pip install -e '.[server]')")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import ds4lab  # noqa: E402
from ds4lab.kv.kvfile import REASONS  # noqa: E402
from ds4lab.server import ServerThread  # noqa: E402
from ds4lab.server.channels import Channels  # noqa: E402
from ds4lab.server.prompt import render as render_prompt  # noqa: E402
from ds4lab.server.prompt import render_text as render_prompt_text  # noqa: E402
from ds4lab.server.protocol import (  # noqa: E402
    Limits,
    RequestError,
    Sampling,
    parse_chat,
    parse_completion,
    parse_messages,
    parse_responses,
)
from ds4lab.tokenizer import REASONING_EFFORT_MAX_PREFIX  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CTX, CHUNK, MIN_TOKENS = 1024, 64, 16  # small: prefill runs at ~20 tokens/s on a loaded 2-core box
# what a request is read against (a model of one name, a chat template, thinking "high" unless asked otherwise)
CHAT_LIMITS = Limits(("m",), 4096, 64, Sampling(1.0, 0, 1.0, 0.05), "high", chat_model=True)
SHAKESPEARE = (ROOT / "data" / "tinyshakespeare.txt").read_text()
SYSTEM = SHAKESPEARE[:100]  # about 30 tokens: over MIN_TOKENS, so a cold checkpoint is stored


@pytest.fixture(scope="module")
def reference():
    """The Python API on a model of its own (the server's is used by its worker thread)."""
    return ds4lab.load(backend="numpy")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    kv = tmp_path_factory.mktemp("kv")
    with ServerThread(ds4lab.load(backend="numpy"), ctx=CTX, prefill_chunk=CHUNK, max_tokens=64, kv_disk_dir=kv,
                      kv_cache_min_tokens=MIN_TOKENS, queue_size=16) as srv:
        yield srv


def _openai(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _expected(model, ids: list[int], n: int, seed: int, **sampling) -> tuple[str, int]:
    """What a fresh session samples after ``ids``: (text, tokens), stopping at EOS as the server does."""
    sess = model.session(ctx=CTX, prefill_chunk=CHUNK)
    sess.sync(ids)
    steps = list(sess.decoder(seed=seed, top=1, **sampling).stream(n))
    return "".join(s.text for s in steps), len(steps)


def _chat_ids(model, messages) -> list[int]:
    return render_prompt(model.tokenizer, messages, think=False)  # the embedded model does not think unless asked


def _feed(channels: Channels, pieces) -> list:
    return [out for piece in pieces for out in channels.feed(piece)] + channels.flush()


def test_channels_split_reasoning_and_cut_at_stop_strings():
    # the tag split over tokens: nothing of it is sent, the reasoning before it is, the answer after it
    assert _feed(Channels(True), ["abc</th", "ink>Hel", "lo"]) == [("reasoning", "abc"), ("text", "Hel"),
                                                                   ("text", "lo")]
    ch = Channels(False, ["END"])
    assert _feed(ch, ["foo E", "NDbar", "more"]) == [("text", "foo ")] and ch.stop == "END"
    assert _feed(Channels(False, ["END"]), ["xE", "x"]) == [("text", "x"), ("text", "Ex")]  # not a stop after all
    assert _feed(Channels(False, ["END"]), ["a", "EN"]) == [("text", "a"), ("text", "EN")]  # held, then flushed
    ch = Channels(True, ["</think>"])  # a stop string only applies to the answer
    assert _feed(ch, ["r</think>a</think>b"]) == [("reasoning", "r"), ("text", "a")] and ch.stop == "</think>"


def test_thinking_modes_follow_ds4_server(reference):
    tk = reference.tokenizer
    chat, plain = CHAT_LIMITS, dataclasses.replace(CHAT_LIMITS, chat_model=False)
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    cases = [(chat, {}, True), (chat, {"reasoning_effort": "none"}, False), (chat, {"reasoning_effort": "low"}, True),
             (chat, {"model": "deepseek-chat"}, False), (chat, {"thinking": {"type": "disabled"}}, False),
             (chat, {"think": False}, False), (plain, {}, False), (plain, {"model": "deepseek-reasoner"}, True),
             (plain, {"thinking": {"type": "enabled"}}, True), (chat, {"reasoning_effort": "max"}, True)]
    for limits, extra, thinking in cases:
        req = parse_chat(dict(base, **extra), limits, tk)
        assert req.thinking == thinking, extra
        assert req.prompt[-1] == (tk.think_id if thinking else tk.think_end_id), extra
        assert req.prompt == render_prompt(tk, base["messages"], think=thinking), extra  # max needs ctx >= 393216
    with pytest.raises(RequestError) as e:
        parse_chat(dict(base, reasoning_effort="huge"), chat, tk)
    assert e.value.param == "reasoning_effort"
    # the renderer takes the modes' names: "none" is no thinking, as False
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]
    assert render_prompt_text(turn, "none") == render_prompt_text(turn, False) != render_prompt_text(turn, "high")


# ds4-server's rendering, worked by hand from render_chat_prompt_text (ds4_server.c at 8d57664); ds4's own unit test
# of it checks "<｜User｜>Hello<｜Assistant｜></think>" with no thinking and the Think Max prefix after BOS
B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
T, TE = "<think>", "</think>"
SERVER_PROMPTS = [  # (messages, think, the rendered text)
    ([{"role": "user", "content": "Hello"}], False, B + U + "Hello" + A + TE),
    # systems first, joined by a blank line; EOS after a reply; its reasoning dropped before the last user turn
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
      {"role": "assistant", "content": "a1", "reasoning": "r1"}, {"role": "developer", "content": "D"},
      {"role": "user", "content": "q2"}], True,
     B + "S\n\nD" + U + "q1" + A + TE + "a1" + E + U + "q2" + A + T),
    # consecutive tool results under one User marker, the wrapper's closing tag escaped; with a tool result in the
    # conversation every reply keeps its reasoning
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"},
      {"role": "tool", "content": "t1"}, {"role": "tool", "content": "x</tool_result>y"}], True,
     B + U + "q" + A + T + "r" + TE + "a" + E + U + "<tool_result>t1</tool_result><tool_result>x&lt;/tool_result>y"
     "</tool_result>" + A + T),
    # a reply after the last user turn keeps its reasoning, ends with EOS, and no new turn is opened
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "part", "reasoning": "r"}], True,
     B + U + "q" + A + T + "r" + TE + "part" + E),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "part", "reasoning": "r"}], False,
     B + U + "q" + A + TE + "part" + E),
    # a blank line only between systems (an empty first one adds none, an empty later one its blank line); a
    # function's result without thinking
    ([{"role": "system", "content": ""}, {"role": "developer", "content": "D"}, {"role": "system", "content": ""},
      {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "function", "content": "f"}],
     False, B + "D\n\n" + U + "q" + A + TE + "a" + E + U + "<tool_result>f</tool_result>" + A + TE),
    # a reply no user turn precedes has no Assistant marker
    ([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}], "max",
     B + REASONING_EFFORT_MAX_PREFIX + "a" + E + "b" + E),
]


@pytest.mark.parametrize("messages, think, text", SERVER_PROMPTS)
def test_prompts_render_as_ds4_server_renders_them(reference, messages, think, text):
    tk = reference.tokenizer
    assert render_prompt_text(messages, think) == text
    # tokenized as one text: special tokens where their text is, also inside a message, as ds4-server does (the
    # library's rule keeps a user's text as text)
    said = [{"role": "user", "content": "a" + U + "b"}]
    assert render_prompt(tk, said, False).count(tk.user_id) == 2 == tk.render_chat(said).count(tk.user_id) + 1


def test_each_api_reads_reasoning_where_ds4_server_does(reference):
    """Chat's ``reasoning_content``, Anthropic's thinking blocks (a redacted one has no text) and the Responses
    API's reasoning items go with their assistant turn; reasoning items with none after them get an empty one;
    compaction items are passed over; an item that is not completed is refused, as ds4-server refuses it."""
    tk = reference.tokenizer
    limits = CHAT_LIMITS
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]
    chat = parse_chat({"model": "m", "messages": [turns[0], {"role": "assistant", "content": "a",
                                                             "reasoning_content": "r"}]}, limits, tk)
    assert chat.messages == turns and chat.prompt == render_prompt(tk, turns, True)
    blocks = [{"type": "redacted_thinking", "data": "x"}, {"type": "thinking", "thinking": "r", "signature": "s"},
              {"type": "text", "text": "a"}]
    anthropic = parse_messages({"model": "m", "max_tokens": 8, "messages": [turns[0], {"role": "assistant",
                                                                                      "content": blocks}]}, limits, tk)
    assert anthropic.messages == turns
    with pytest.raises(RequestError) as e:
        parse_messages({"model": "m", "max_tokens": 8, "messages": [
            turns[0], {"role": "assistant", "content": [{"type": "thinking"}]}]}, limits, tk)
    assert e.value.param == "messages[1].content[0]"

    def responses(*items):
        return parse_responses({"model": "m", "input": list(items)}, limits, tk).messages

    user = {"type": "message", "role": "user", "content": "q", "status": "completed"}
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]}
    thought = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
               "content": [{"type": "reasoning_text", "text": "c"}]}
    assert responses(user, thought, {"type": "compaction", "encrypted_content": "z"}, said) == [
        turns[0], {"role": "assistant", "content": "a", "reasoning": "s\nc"}]
    assert responses(user, thought, user) == [turns[0], {"role": "assistant", "content": "", "reasoning": "s\nc"},
                                              turns[0]]
    assert responses(user, thought) == [turns[0], {"role": "assistant", "content": "", "reasoning": "s\nc"}]
    for status in ("in_progress", "incomplete", "failed", None):  # null too: ds4-server reads a string
        with pytest.raises(RequestError) as e:
            responses(user, dict(said, status=status))
        assert e.value.param == "input[1].status" and json.dumps(status) in e.value.message
    with pytest.raises(RequestError) as e:  # a content part must say it is text, as there
        responses(dict(user, content=[{"text": "q"}]))
    assert e.value.param == "input[0].content[0].type"
    # Anthropic's system as a list: one part a line, Claude Code's private "x-anthropic-" parts and empty ones out
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1"}, {"type": "text", "text": "A"},
              "", "B"]
    req = parse_messages({"model": "m", "max_tokens": 8, "system": system, "messages": [turns[0]]}, limits, tk)
    assert req.messages[0] == {"role": "system", "content": "A\nB"}
    with pytest.raises(RequestError) as e:
        parse_messages({"model": "m", "max_tokens": 8, "system": [3], "messages": [turns[0]]}, limits, tk)
    assert e.value.param == "system[0]"


def test_no_tools_is_not_a_tool_request(reference):
    # what clients send when they have none (README, "ds4lab serve"): answered like a request without the field
    tk = reference.tokenizer
    limits = CHAT_LIMITS
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for extra in ({"tools": []}, {"functions": []}, {"tool_choice": "none"}, {"tool_choice": {"type": "none"}},
                  {"tools": None}):
        assert parse_chat(dict(base, **extra), limits, tk).prompt == parse_chat(base, limits, tk).prompt, extra
    for extra, param in (({"tools": [{"type": "function"}]}, "tools[0].function"), ({"tool_choice": "required"},
                         "tool_choice"), ({"function_call": "auto"}, "function_call")):
        with pytest.raises(RequestError) as e:
            parse_chat(dict(base, **extra), limits, tk)
        assert e.value.param == param, extra


def test_memory_text_continuation_keeps_the_live_tokens(reference):
    """ds4-server's "memory-text" reuse: the live tokens spell the prompt's first bytes in other tokens (a reply
    sent back and tokenized again): the prompt becomes the live tokens and its remaining text, tokenized."""
    from ds4lab.server.worker import Worker

    tk = reference.tokenizer
    worker = Worker(reference, ctx=256)
    live = [tk.bos_id, *tk.encode("ROMEO:"), *(tk.encode(c)[0] for c in " the")]  # one token a character
    prompt = [tk.bos_id, *tk.encode("ROMEO: the end")]
    assert prompt[:len(live)] != live  # BPE spells " the" otherwise
    assert worker._continuation(prompt) == prompt  # an empty session: nothing to keep
    worker.session.sync(live)
    out = worker._continuation(prompt)
    assert out[:len(live)] == live and tk.decode(out) == tk.decode(prompt)
    assert out[len(live):] == tk.encode(" end")
    assert worker._continuation([tk.bos_id, *tk.encode("JULIET: the end")]) == [tk.bos_id,
                                                                               *tk.encode("JULIET: the end")]


def test_a_thinking_reply_is_continued_from_the_live_tokens_by_its_visible_text(reference):
    """ds4-server's "thinking-visible" reuse: the next turn's prompt leaves the reply's reasoning out, so its tokens
    are no prefix of the live ones (which hold the reasoning); after a thinking reply that closed its thinking and
    stopped, the server keeps the text the next prompt starts with (the prompt without its "<think>", "</think>",
    the answer, EOS) and continues such a prompt from the live tokens, reasoning and all. Not for the Responses
    API, a reply cut by max_tokens or still thinking, a conversation with tool results, or a live state that moved."""
    from ds4lab.server.worker import Worker

    tk = reference.tokenizer
    limits = CHAT_LIMITS
    turn1 = [{"role": "user", "content": "ROMEO: Speak."}]
    first = parse_chat({"model": "m", "messages": turn1}, limits, tk)
    assert first.thinking and first.text.endswith(T)
    worker = Worker(reference, ctx=1024)
    live = first.prompt + tk.encode("I ponder.") + [tk.think_end_id] + tk.encode("Hark!")  # what the reply left
    worker.session.sync(live)
    worker._remember_visible(first, "stop", "Hark!", in_reasoning=False)
    assert worker.visible == (first.text[: -len(T)] + TE + "Hark!" + E, len(live))
    turn2 = turn1 + [{"role": "assistant", "content": "Hark!"}, {"role": "user", "content": "Again."}]
    second = parse_chat({"model": "m", "messages": turn2}, limits, tk)
    assert second.prompt[:len(live)] != live  # the reasoning is not in the prompt
    assert worker._visible_continuation(second) == live + tk.encode_rendered(U + "Again." + A + T)
    responses = parse_responses({"model": "m", "input": turn2}, limits, tk)
    assert responses.text == second.text and worker._visible_continuation(responses) is None
    tools = parse_chat({"model": "m", "messages": turn2[:2] + [{"role": "tool", "content": "7"}]}, limits, tk)
    for req, finish, thinking in ((first, "length", False), (first, "stop", True), (tools, "stop", False)):
        worker._remember_visible(req, finish, "Hark!", in_reasoning=thinking)
        assert worker.visible is None, (finish, thinking)
    worker._remember_visible(first, "stop", "Hark!", in_reasoning=False)
    worker.session.sync(live + tk.encode(" more"))  # the live state moved on: the key no longer stands for it
    assert worker._visible_continuation(second) is None


def test_the_server_continues_a_thinking_reply_by_its_visible_text(server, reference):
    """The same through a request: with the key kept (the embedded model never closes its thinking, so the reply is
    laid in the live state here), the next turn is evaluated from the live tokens: only its new text."""
    tk, worker = reference.tokenizer, server.worker
    turn1 = [{"role": "user", "content": "ROMEO: Speak."}]
    live = render_prompt(tk, turn1, True) + tk.encode("I ponder.") + [tk.think_end_id] + tk.encode("Hark!")
    worker.session.sync(live)  # (the worker is idle between requests)
    worker.visible = (render_prompt_text(turn1, True)[: -len(T)] + TE + "Hark!" + E, len(live))
    turn2 = turn1 + [{"role": "assistant", "content": "Hark!"}, {"role": "user", "content": "Again."}]
    r = _openai(server).chat.completions.create(model="shakespeare", messages=turn2, max_tokens=2, seed=1,
                                                reasoning_effort="high")
    rest = tk.encode_rendered(U + "Again." + A + T)
    assert r.usage.prompt_tokens_details.cached_tokens == len(live)
    assert r.usage.prompt_tokens == len(live) + len(rest) != len(render_prompt(tk, turn2, True))


def test_a_chat_models_completion_is_the_chat_turn_ds4_server_makes(reference):
    """ds4-server's /v1/completions (parse_completion_request): a text prompt becomes "You are a helpful assistant",
    the prompt as the user's turn and the assistant's turn opened, thinking chosen as for a chat request. A model
    without a chat template continues the text as it is; token ids are continued as they are."""
    tk = reference.tokenizer
    base = {"model": "m", "prompt": "Hi"}
    system = "You are a helpful assistant"
    for extra, think in (({}, T), ({"think": False}, TE), ({"model": "deepseek-chat"}, TE),
                         ({"reasoning_effort": "max"}, T)):
        req = parse_completion(dict(base, **extra), CHAT_LIMITS, tk)
        assert req.text == B + system + U + "Hi" + A + think, extra
        assert req.prompt == tk.encode_rendered(req.text) and req.thinking == (think == T), extra
    big = dataclasses.replace(CHAT_LIMITS, ctx=393216)  # Think Max needs that context, as in ds4
    assert parse_completion(dict(base, reasoning_effort="max"), big, tk).text == (
        B + REASONING_EFFORT_MAX_PREFIX + system + U + "Hi" + A + T)
    assert parse_completion(dict(base, prompt=""), CHAT_LIMITS, tk).text == B + system + U + A + T
    ids = tk.encode("Hi")
    assert parse_completion(dict(base, prompt=ids), CHAT_LIMITS, tk).prompt == ids
    plain = parse_completion(base, dataclasses.replace(CHAT_LIMITS, chat_model=False), tk)
    assert plain.prompt == ids and not plain.thinking


def test_a_thinking_completion_is_sent_as_one_text(reference):
    """ds4-server sends a completion's reply as generated, reasoning and all (it parses chat replies only), sampled
    at ds4's thinking defaults, its stop strings looked for from the first token: the worker's events for a chat
    model's completion are one "text" channel, the tokens a session samples after the rendered prompt."""
    import asyncio

    from ds4lab.server.worker import Job, Worker

    tk = reference.tokenizer
    req = parse_completion({"model": "m", "prompt": "ROMEO:", "max_tokens": 8, "seed": 4, "temperature": 0.1},
                           CHAT_LIMITS, tk)
    want, _ = _expected(reference, req.prompt, 8, seed=4, temperature=1.0, top_k=0, top_p=1.0, min_p=0.05)
    assert req.thinking and TE not in want  # the embedded model never closes its thinking: all of it reasoning
    assert want != _expected(reference, req.prompt, 8, seed=4, temperature=0.1)[0]  # the request's own sampling

    def events(request) -> list:
        loop = asyncio.new_event_loop()
        try:
            job = Job(request, loop)
            Worker(reference, ctx=CTX, prefill_chunk=CHUNK)._run(job)

            async def drain():
                await asyncio.sleep(0)
                return [job.events.get_nowait() for _ in range(job.events.qsize())]

            return loop.run_until_complete(drain())
        finally:
            loop.close()

    got = events(req)
    assert {e[1] for e in got if e[0] == "text"} == {"text"}
    assert "".join(e[2] for e in got if e[0] == "text") == want
    stop = want[2:4]
    cut = events(dataclasses.replace(req, stop=(stop,)))
    assert "".join(e[2] for e in cut if e[0] == "text") == want[:want.index(stop)]
    assert cut[-1][1].finish == "stop" and cut[-1][1].stop == stop


def test_memory_text_continuation_tokenizes_the_rest_as_ds4_server_does(reference):
    """After the live tokens, the rest of the prompt's text is tokenized whole as rendered chat text, as ds4-server
    does (build_prompt_from_exact_prefix_and_text_suffix): across the token the live text ends inside (BPE may
    merge it otherwise than the prompt's tokens did), and text that spells a control token is that token, as the
    server's prompts have it."""
    from ds4lab.server.worker import Worker

    tk = reference.tokenizer
    user = tk.tokens[tk.user_id]
    worker = Worker(reference, ctx=256)
    live = [tk.bos_id, *(tk.encode(c)[0] for c in "ROMEO: h")]
    worker.session.sync(live)
    prompt = tk.encode_rendered(f"{tk.tokens[tk.bos_id]}ROMEO: hel, {user}JULIET:")
    assert prompt[:len(live)] != live and tk.user_id in prompt
    out = worker._continuation(prompt)
    assert out == live + tk.encode_rendered(f"el, {user}JULIET:") and tk.decode(out) == tk.decode(prompt)
    # the live text no prefix of the prompt's: the prompt as it is
    assert worker._continuation(tk.encode_rendered(f"{tk.tokens[tk.bos_id]}JULIET:")) == \
        tk.encode_rendered(f"{tk.tokens[tk.bos_id]}JULIET:")


def test_serve_usage_errors(capsys, tmp_path):
    from ds4lab import cli

    assert cli.main(["serve", "--backend", "numpy", "--gpu-device", "0,1"]) == 2
    assert "--gpu-device places layers on CUDA GPUs: it needs the cupy backend, got numpy" in capsys.readouterr().err
    assert cli.main(["serve", "--backend", "numpy", "--ctx", "999999"]) == 2
    assert "--ctx must be in [3, 4096] for this model, got 999999" in capsys.readouterr().err
    # a malformed GPU list is refused as it is parsed, whatever the backend; a KV folder that cannot be made names
    # the flag (it once said only "/proc/nope: No such file or directory")
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--gpu-device", "abc"])
    assert e.value.code == 2 and "--gpu-device: expected distinct GPU numbers such as 0,1, got 'abc'" in \
        capsys.readouterr().err
    blocker = tmp_path / "a file"
    blocker.write_text("")
    for where, why in ((blocker, "exists and is not a folder"), (blocker / "kv", "cannot make the folder")):
        assert cli.main(["serve", "--backend", "numpy", "--kv-disk-dir", str(where)]) == 2
        assert f"--kv-disk-dir {where}: {why}" in capsys.readouterr().err
    # the folder it makes before the model loads is the store's: its owner's alone (its files hold prompts' text)
    from ds4lab.cli.serve import _kv_disk_dir

    _kv_disk_dir(tmp_path / "new" / "kv")
    assert (tmp_path / "new" / "kv").stat().st_mode & 0o777 == 0o700


def test_a_listen_failure_names_the_address_and_the_reason():
    """A port in use once gave ``[Errno 98] Address already in use`` alone, after the model had loaded."""
    import errno
    import socket

    from ds4lab.server.running import listen

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=rf"^cannot listen on --host 127\.0\.0\.1 --port {port}: "
                                          "Address already in use$") as e:
            listen("127.0.0.1", port)
        assert e.value.errno == errno.EADDRINUSE
    with contextlib.closing(listen("127.0.0.1", 0)) as first:  # a second serve started while the first loads
        with pytest.raises(OSError, match="Address already in use"):
            listen("127.0.0.1", first.getsockname()[1])  # (bound alone, both would have taken the port)
    with pytest.raises(OSError, match=r"^cannot listen on --host 192\.0\.2\.1 --port 8000: "):
        listen("192.0.2.1", 8000)  # TEST-NET-1: an address no machine here has
    with pytest.raises(OSError, match=r"^cannot listen on --host 127\.0\.0\.1 --port 70000: "):
        listen("127.0.0.1", 70000)  # the Python API takes any int: bind's OverflowError, named the same way


def test_models_are_listed(server):
    client = _openai(server)
    assert [m.id for m in client.models.list().data] == ["shakespeare"]
    assert client.models.retrieve("shakespeare").id == "shakespeare"
    assert httpx.get(server.url + "/v1/models/nope").status_code == 404


def test_chat_whole_and_streamed_match_the_python_api(server, reference):
    client = _openai(server)
    messages = [{"role": "user", "content": "ROMEO: What light through yonder window breaks?"}]
    ids = _chat_ids(reference, messages)
    want, n = _expected(reference, ids, 6, seed=7)
    whole = client.chat.completions.create(model="shakespeare", messages=messages, max_tokens=6, seed=7)
    assert whole.choices[0].message.content == want
    assert whole.choices[0].finish_reason == ("length" if n == 6 else "stop")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), n)
    again = client.chat.completions.create(model="shakespeare", messages=messages, max_tokens=6, seed=7)
    assert again.choices[0].message.content == want  # the same seed, the same text (the prompt's state restored)
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids)  # nothing evaluated again
    chunks = list(client.chat.completions.create(model="shakespeare", messages=messages, max_tokens=6, seed=7,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    other = client.chat.completions.create(model="shakespeare", messages=messages, max_tokens=6, seed=8)
    assert other.choices[0].message.content == _expected(reference, ids, 6, seed=8)[0]


def test_completions_continue_plain_text(server, reference):
    client = _openai(server)
    prompt = "KING RICHARD III:\nNow is the winter of our"
    ids = reference.tokenizer.encode(prompt)
    want, n = _expected(reference, ids, 6, seed=3, temperature=0.5)
    whole = client.completions.create(model="shakespeare", prompt=prompt, max_tokens=6, seed=3, temperature=0.5)
    assert whole.choices[0].text == want and whole.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(model="shakespeare", prompt=prompt, max_tokens=6, seed=3, temperature=0.5,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want
    by_ids = client.completions.create(model="shakespeare", prompt=ids, max_tokens=6, seed=3, temperature=0.5)
    assert by_ids.choices[0].text == want and n == whole.usage.completion_tokens


def test_a_chat_models_completions_over_http(reference, tmp_path):
    """/v1/completions served for a chat model (the embedded model's file with a chat template added): the reply to
    ds4-server's rendered turn, sampled at ds4's thinking defaults, sent as one text whole and streamed, the usage
    counting the rendered prompt."""
    from ds4lab.gguf_file import GGUFModelFile, write_gguf

    f = GGUFModelFile.open(reference.path)
    chat_file = write_gguf(tmp_path / "chat.gguf", {**f.metadata, "tokenizer.chat_template": ("ds4", "STRING")},
                           [(n, t.shape, t.qtype, t.data) for n, t in f.tensors.items()])
    model = ds4lab.load(chat_file, backend="numpy")
    assert model.is_chat
    req = parse_completion({"model": "m", "prompt": "ROMEO:"}, CHAT_LIMITS, reference.tokenizer)
    want, n = _expected(reference, req.prompt, 6, seed=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.05)
    with ServerThread(model, ctx=CTX, prefill_chunk=CHUNK, max_tokens=64) as srv:
        client = _openai(srv)
        whole = client.completions.create(model="chat", prompt="ROMEO:", max_tokens=6, seed=3, temperature=0.2)
        assert whole.choices[0].text == want and whole.usage.prompt_tokens == len(req.prompt)
        assert whole.usage.completion_tokens == n
        chunks = list(client.completions.create(model="chat", prompt="ROMEO:", max_tokens=6, seed=3,
                                                temperature=0.2, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(req.prompt)


def test_stop_strings_cut_the_answer(server, reference):
    client = _openai(server)
    prompt = "First Citizen:\nBefore we proceed any further, hear me"
    full, _ = _expected(reference, reference.tokenizer.encode(prompt), 12, seed=5)
    stop = full[6:9]
    cut = full[:full.index(stop)]
    whole = client.completions.create(model="shakespeare", prompt=prompt, max_tokens=12, seed=5, stop=[stop])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="shakespeare", prompt=prompt, max_tokens=12, seed=5, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_anthropic_messages_whole_and_streamed(server, reference):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="shakespeare", max_tokens=6, system="A play.", extra_body={"seed": 11},
              messages=[{"role": "user", "content": "JULIET: O Romeo, Romeo!"}])
    ids = _chat_ids(reference, [{"role": "system", "content": "A play."}, kw["messages"][0]])
    want, n = _expected(reference, ids, 6, seed=11)
    whole = client.messages.create(**kw)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == want
    assert whole.stop_reason == ("max_tokens" if n == 6 else "end_turn")
    u = whole.usage
    assert (u.input_tokens + u.cache_read_input_tokens, u.output_tokens) == (len(ids), n)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want and final.usage.cache_read_input_tokens == len(ids)  # the repeat reuses the prompt
    stop = want[3:5]
    if stop.strip():
        cut = client.messages.create(**kw, stop_sequences=[stop])
        assert (cut.content[0].text, cut.stop_reason, cut.stop_sequence) == (want[:want.index(stop)],
                                                                             "stop_sequence", stop)


def test_thinking_comes_back_as_reasoning(server, reference):
    """Thinking asked for on the embedded model (no chat template: it does not think unless asked): the prompt ends
    in <think>, the text before </think> is reasoning (OpenAI's reasoning_content, Anthropic's thinking block)."""
    messages = [{"role": "user", "content": "MERCUTIO: Nay, gentle Romeo"}]
    ids = render_prompt(reference.tokenizer, messages, think=True)
    want, _ = _expected(reference, ids, 6, seed=9)
    reasoning, tag, answer = want.partition("</think>")
    r = _openai(server).chat.completions.create(model="shakespeare", messages=messages, max_tokens=6, seed=9,
                                                reasoning_effort="high")
    assert r.usage.prompt_tokens == len(ids)
    assert (r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content) == (reasoning,
                                                                                                      answer)
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="shakespeare", max_tokens=6, messages=messages, extra_body={"seed": 9},
              thinking={"type": "enabled", "budget_tokens": 1024})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    for m in (whole, final):
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", "")) for b in m.content] == [
            ("thinking", reasoning), ("text", answer)]


def _streamed_response(client, **kw) -> list:
    """A streamed response's events, as the openai client reads them (its helper's final response needs a
    ``response.completed``; one cut by max_output_tokens ends on ``response.incomplete``, as OpenAI's does)."""
    with client.responses.stream(**kw) as stream:
        return list(stream)


def test_responses_whole_and_streamed_match_the_python_api(server, reference):
    """OpenAI's Responses API (ds4-server's /v1/responses): the text a session samples for
    the same conversation, whole and streamed; the events in order with consecutive sequence numbers, the deltas
    adding up to the final item's text, the final response the whole one's."""
    client = _openai(server)
    messages = [{"role": "system", "content": "A play."}, {"role": "user", "content": "ROMEO: What light?"}]
    ids = _chat_ids(reference, messages)
    want, n = _expected(reference, ids, 6, seed=13)
    kw = dict(model="shakespeare", instructions="A play.", max_output_tokens=6, extra_body={"seed": 13})
    whole = client.responses.create(input="ROMEO: What light?", **kw)
    status = "incomplete" if n == 6 else "completed"
    assert (whole.output_text, whole.status, whole.object) == (want, status, "response")
    assert [o.type for o in whole.output] == ["message"] and whole.output[0].status == status
    assert (whole.incomplete_details.reason if n == 6 else whole.incomplete_details) == (
        "max_output_tokens" if n == 6 else None)
    u = whole.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (len(ids), n, len(ids) + n)
    assert u.output_tokens_details.reasoning_tokens == 0
    # the same conversation as message items (an earlier turn's reasoning item left out), streamed
    items = [{"type": "reasoning", "summary": []},
             {"type": "message", "role": "user", "content": ["ROMEO: ",  # a bare string part, as ds4 reads it
                                                             {"type": "input_text", "text": "What light?"}]}]
    events = _streamed_response(client, input=items, **kw)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events[4:-4]) == want == events[-4].text
    final = events[-1].response
    assert final.output_text == want and final.usage.input_tokens_details.cached_tokens == len(ids)  # a repeat
    assert final.output[0].id == events[2].item.id == events[-2].item.id != whole.output[0].id
    assert final.model_dump(exclude={"id", "created_at", "output", "usage"}) == whole.model_dump(
        exclude={"id", "created_at", "output", "usage"})
    # thinking on: the embedded model never writes </think>, so every token is reasoning (counted by the worker), sent
    # back as an incomplete reasoning item (summary asked for), with no message
    messages = [{"role": "user", "content": "MERCUTIO: Nay, gentle Romeo"}]
    want, n = _expected(reference, render_prompt(reference.tokenizer, messages, think=True), 4, seed=9)
    # sampled at ds4's defaults whatever the request asks, as ds4-server samples a thinking request (the seed kept)
    thought = client.responses.create(model="shakespeare", input=messages[0]["content"], max_output_tokens=4,
                                      reasoning={"effort": "high", "summary": "auto"}, temperature=0.1, top_p=0.2,
                                      extra_body={"seed": 9})
    assert want != _expected(reference, render_prompt(reference.tokenizer, messages, think=True), 4, seed=9,
                             temperature=0.1, top_p=0.2)[0]  # (what the request's own sampling gives)
    assert thought.usage.output_tokens_details.reasoning_tokens == thought.usage.output_tokens == n > 0
    assert [(o.type, o.status) for o in thought.output] == [("reasoning", "incomplete")]
    assert thought.output[0].summary[0].text == want and thought.output_text == ""


def _responses_of(events, summary: str | None, finish: str = "stop", error: RequestError | None = None):
    """What /v1/responses sends for a worker's ``events`` (("text", channel, text), ...) ending in a request done as
    ``finish`` (or failed with ``error``): the streamed events read by the openai client's own models (a shape it
    does not know fails), and the whole response (None where the worker failed)."""
    import asyncio

    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from ds4lab.server import responses
    from ds4lab.server.protocol import Request
    from ds4lab.server.worker import Job, Outcome

    req = Request("responses", "shakespeare", [1, 2, 3], 8, Sampling(1.0, 0, 1.0, 0.0), stream=True, thinking=True,
                  effort="medium", summary=summary)
    n = sum(len(t) for _, _, t in events)
    in_reasoning = bool(events) and events[-1][1] == "reasoning"  # no </think> met: the answer never began
    out = Outcome(3, 0, n, finish, None, "cold", 0.0, 0.0, sum(len(t) for _, c, t in events if c == "reasoning"),
                  in_reasoning)

    async def run():
        job = Job(req, asyncio.get_running_loop())
        for e in [*events, ("error", error) if error else ("done", out)]:
            job.events.put_nowait(e)
        return [chunk async for chunk in responses.stream(job, responses.Ids(7))]

    chunks = asyncio.run(run())
    blocks = [b for c in chunks for b in c.split("\n\n") if b]  # a chunk may carry several events
    assert all(b.startswith("event: ") and b.split("\n")[1].startswith("data: ") for b in blocks)
    streamed = [TypeAdapter(ResponseStreamEvent).validate_json(b.split("\ndata: ", 1)[1]) for b in blocks]
    assert [b.split("\n")[0][len("event: "):] for b in blocks] == [e.type for e in streamed]
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    if error:
        return streamed, None
    text = "".join(t for _, c, t in events if c == "text")
    reasoning = "".join(t for _, c, t in events if c == "reasoning")
    whole = responses.whole(responses.Ids(7), Job(req, None), out, reasoning, text, [])
    return streamed, Response.model_validate(whole)


def _done_items(streamed) -> list:
    return [(e.item.type, e.item.status) for e in streamed if e.type == "response.output_item.done"]


def test_responses_send_the_reasoning_as_a_summary_when_asked():
    """Thinking on: the reasoning comes back as a reasoning item, its summary the text before </think>, only where
    reasoning.summary asks for it (ds4-server's rule); the reasoning item is done before the message opens, and the
    stream's last event holds the whole response. (The embedded model never writes </think>: the worker's events
    are given here.)"""
    events = [("text", "reasoning", "Who"), ("text", "reasoning", " speaks?"), ("text", "text", "Peace,"),
              ("text", "text", " peace!")]
    streamed, whole = _responses_of(events, summary="detailed")
    kinds = [e.type for e in streamed]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
                     "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
                     "response.reasoning_summary_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [(e.output_index, e.item.type) for e in streamed if e.type == "response.output_item.done"] == [
        (0, "reasoning"), (1, "message")]
    assert [(o.type, o.status) for o in whole.output] == [("reasoning", "completed"), ("message", "completed")]
    assert whole.output[0].summary[0].text == "Who speaks?" and whole.output_text == "Peace, peace!"
    assert streamed[-1].response.output == whole.output and whole.usage.output_tokens_details.reasoning_tokens == 11
    assert (whole.reasoning.effort, whole.reasoning.summary) == ("medium", "detailed")  # as asked
    # not asked for: thought, not sent (the usage still counts it)
    streamed, whole = _responses_of(events, summary=None)
    assert [o.type for o in whole.output] == ["message"] and whole.output_text == "Peace, peace!"
    assert not [e for e in streamed if "reasoning" in e.type] and streamed[-1].response.output == whole.output
    # ended inside the reasoning (max_output_tokens, or an EOS before </think>): no message, the reasoning
    # incomplete in the stream as in the whole response; cut by the length, response.incomplete
    for finish, status in (("length", "incomplete"), ("stop", "completed")):
        streamed, whole = _responses_of(events[:2], summary="auto", finish=finish)
        assert [(o.type, o.status) for o in whole.output] == _done_items(streamed) == [("reasoning", "incomplete")]
        assert (whole.status, streamed[-1].type) == (status, f"response.{status}")
    cut = _responses_of(events[:2], "auto", "length")[1]
    assert whole.incomplete_details is None and cut.incomplete_details.reason == "max_output_tokens"
    # cut inside the answer: the reasoning ended at its </think>, completed; the message incomplete
    streamed, whole = _responses_of(events, summary="auto", finish="length")
    assert [(o.type, o.status) for o in whole.output] == _done_items(streamed) == [("reasoning", "completed"),
                                                                                     ("message", "incomplete")]
    assert streamed[-1].response.output == whole.output
    # the server stopped under way: failed, with its error
    streamed, whole = _responses_of(events, summary="auto", finish="shutdown")
    assert (whole.status, whole.error.code, streamed[-1].type) == ("failed", "server_error", "response.failed")


def test_a_response_the_worker_fails_ends_failed_with_its_items_closed():
    """The worker's error under way (an engine error, a request refused at shutdown): the open item is closed
    incomplete and response.failed ends the stream with the error, as ds4-server ends it (the openai client waits
    for one of the response's last events)."""
    events = [("text", "text", "Peace,"), ("text", "text", " peace!")]
    error = RequestError("the model failed: out of memory", code="engine_error", status=500, type="server_error")
    streamed, _ = _responses_of(events, summary=None, error=error)
    assert [e.type for e in streamed][-5:] == ["response.output_text.delta", "response.output_text.done",
                                               "response.content_part.done", "response.output_item.done",
                                               "response.failed"]
    final = streamed[-1].response
    assert _done_items(streamed) == [(o.type, o.status) for o in final.output] == [("message", "incomplete")]
    assert (final.status, final.error.code, final.error.message) == ("failed", "server_error", error.message)
    assert final.output_text == "Peace, peace!" and final.usage is None
    streamed, _ = _responses_of([], summary=None, error=error)  # before any text: no item, failed
    assert [e.type for e in streamed] == ["response.created", "response.in_progress", "response.failed"]


def _store_entries(srv) -> dict:
    return {(REASONS[e.header.reason], e.tokens) for e in srv.worker.store.entries()}


def test_multi_turn_reuse_in_usage_and_store(server, reference):
    client = _openai(server)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Speak, friend."}]
    ids1 = _chat_ids(reference, turn1)
    anchor = ids1.index(reference.tokenizer.user_id)  # ds4's cold checkpoint: up to the user turn
    assert anchor >= MIN_TOKENS
    before = server.worker.store.stats()
    r1 = client.chat.completions.create(model="shakespeare", messages=turn1, max_tokens=4, seed=1)
    assert r1.usage.prompt_tokens == len(ids1)
    assert ("cold", anchor) in _store_entries(server)
    assert server.worker.store.stats().saves >= before.saves + 1
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "What news?"}]
    r2 = client.chat.completions.create(model="shakespeare", messages=turn2, max_tokens=4, seed=1)
    # the second turn evaluates only what the first did not: its prompt and its reply are reused
    assert r2.usage.prompt_tokens_details.cached_tokens == len(ids1) + r1.usage.completion_tokens
    assert r2.usage.prompt_tokens == len(_chat_ids(reference, turn2))
    stats = httpx.get(server.url + "/ds4lab/stats").json()
    assert stats["store"]["entries"] == len(server.worker.store.entries()) and stats["cached_tokens"] > 0


def test_a_client_that_leaves_stops_generation(server):
    stats = lambda: httpx.get(server.url + "/ds4lab/stats").json()  # noqa: E731
    before = stats()
    body = {"model": "shakespeare", "prompt": "GLOUCESTER:", "max_tokens": 64, "stream": True, "seed": 2}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: {")
            if seen == 3:
                break
    deadline = time.monotonic() + 20
    while stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = stats()
    assert not after["running"] and after["cancelled"] == before["cancelled"] + 1
    generated = after["completion_tokens"] - before["completion_tokens"]
    assert 3 <= generated < 20, generated  # stopped within a few steps of the close, not at 64
    # a whole (not streamed) request whose client gives up: the handler sees it gone and stops the worker
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=dict(body, stream=False), timeout=0.4)
    deadline = time.monotonic() + 20
    while stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    last = stats()
    assert not last["running"] and last["cancelled"] == after["cancelled"] + 1
    assert last["completion_tokens"] - after["completion_tokens"] < 64  # stopped before the request's 64


BAD = [  # (endpoint, body, status, param, code)
    ("chat", b"{not json", 400, None, "invalid_json"),
    ("chat", b"[1, 2]", 400, None, "invalid_json"),
    ("chat", {"messages": [{"role": "user", "content": "x"}]}, 400, "model", "missing_field"),
    ("chat", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 400, "model", "model_not_found"),
    ("chat", {"model": 3, "messages": [{"role": "user", "content": "x"}]}, 400, "model", "invalid_type"),
    ("chat", {"model": "shakespeare", "messages": "hello"}, 400, "messages", "invalid_type"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "invalid_type"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
     "max_tokens", "out_of_range"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "max_tokens": 65}, 400,
     "max_tokens", "out_of_range"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "max_tokens": True}, 400,
     "max_tokens", "invalid_type"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400,
     "temperature", "invalid_type"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, 400,
     "top_p", "out_of_range"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "seed": -1}, 400,
     "seed", "out_of_range"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400,
     "stream", "invalid_type"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": SHAKESPEARE[:6000]}]}, 400,
     "messages", "context_length_exceeded"),
    # tools: function tools offered, the model's choice (a call cannot be forced), calls sent back whole
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}],
              "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "tools[0].type",
     "unsupported_parameter"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice", "unsupported_parameter"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}, {"role": "assistant",
              "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"arguments": "{}"}}]}]},
     400, "messages[1].tool_calls[0].function.name", "invalid_type"),
    ("completion", {"model": "shakespeare", "prompt": 123}, 400, "prompt", "invalid_type"),
    ("completion", {"model": "shakespeare", "prompt": [1, 99999]}, 400, "prompt", "out_of_range"),
    ("completion", {"model": "shakespeare", "prompt": SHAKESPEARE[:6000]}, 400, "prompt", "context_length_exceeded"),
    # JSON that Python's reader refuses past its limits (was a plain-text 500)
    ("chat", b"[" * 100000, 400, None, "invalid_json"),
    # NaN and infinities, which Python's reader takes: no JSON (a tool's schema with one was a 500)
    ("chat", b'{"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",'
             b' "function": {"name": "f", "x": NaN}}]}', 400, None, "invalid_json"),
    ("responses", b'{"model": "shakespeare", "input": "x", "tools": [{"type": "function", "name": "f", "parameters":'
                  b' {"maximum": 1e999}}]}', 400, None, "invalid_json"),
    ("completion", b'{"model": "shakespeare", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None,
     "invalid_json"),
    # what the server does not do is refused by name, not answered as if it had been asked for nothing
    ("completion", {"model": "shakespeare", "prompt": "x", "n": 3}, 400, "n", "unsupported_parameter"),
    ("completion", {"model": "shakespeare", "prompt": "x", "best_of": 2}, 400, "best_of", "unsupported_parameter"),
    ("completion", {"model": "shakespeare", "prompt": "x", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("completion", {"model": "shakespeare", "prompt": "x", "suffix": "!"}, 400, "suffix", "unsupported_parameter"),
    ("completion", {"model": "shakespeare", "prompt": "x", "logprobs": 0}, 400, "logprobs", "unsupported_parameter"),
    # sampler controls that would change the tokens (ignored before: a 200 as if they had not been sent)
    ("completion", {"model": "shakespeare", "prompt": "x", "logit_bias": {"5": 100}}, 400, "logit_bias",
     "unsupported_parameter"),
    ("completion", {"model": "shakespeare", "prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty",
     "unsupported_parameter"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}, 400,
     "presence_penalty", "unsupported_parameter"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}],
              "response_format": {"type": "json_object"}}, 400, "response_format", "unsupported_parameter"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "n": True}, 400, "n",
     "unsupported_parameter"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400,
     "logprobs", "unsupported_parameter"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}],
              "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage", "invalid_type"),
    ("chat", {"model": "shakespeare", "messages": [{"role": "user", "content": "x"}],
              "output_config": {"effort": "huge"}}, 400, "output_config.effort", "invalid_value"),
    # /v1/responses: no stored responses, function tools, plain text, message and tool items
    ("responses", {"model": "shakespeare"}, 400, "input", "missing_field"),
    ("responses", {"model": "shakespeare", "input": []}, 400, "input", "invalid_type"),
    ("responses", {"model": "shakespeare", "input": "x", "previous_response_id": "resp_1"}, 400,
     "previous_response_id", "unsupported_parameter"),
    ("responses", {"model": "shakespeare", "input": "x", "conversation": "conv_1"}, 400, "conversation",
     "unsupported_parameter"),
    ("responses", {"model": "shakespeare", "input": "x", "tools": [{"type": "web_search"}]}, 400,
     "tools[0].type", "unsupported_parameter"),
    ("responses", {"model": "shakespeare", "input": [{"type": "custom_tool_call_output", "call_id": "c",
                                                      "output": "1"}]}, 400, "input[0].type",
     "unsupported_parameter"),
    ("responses", {"model": "shakespeare", "input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role",
     "invalid_value"),
    ("responses", {"model": "shakespeare", "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     400, "input[0].content[0].type", "unsupported_parameter"),
    ("responses", {"model": "shakespeare", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     400, "input[0].content[0]", "invalid_type"),
    ("responses", {"model": "shakespeare", "input": [{"type": "reasoning", "summary": []}]}, 400, "input",
     "invalid_value"),
    ("responses", {"model": "shakespeare", "input": "x", "instructions": 5}, 400, "instructions", "invalid_type"),
    ("responses", {"model": "shakespeare", "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens",
     "out_of_range"),
    ("responses", {"model": "shakespeare", "input": "x", "reasoning": {"effort": "huge"}}, 400, "reasoning.effort",
     "invalid_value"),
    ("responses", {"model": "shakespeare", "input": "x", "reasoning": {"summary": "long"}}, 400,
     "reasoning.summary", "invalid_value"),
    ("responses", {"model": "shakespeare", "input": "x", "text": {"format": {"type": "json_object"}}}, 400,
     "text.format", "unsupported_parameter"),
    ("responses", {"model": "shakespeare", "input": "x", "top_logprobs": 3}, 400, "top_logprobs",
     "unsupported_parameter"),
    ("responses", {"model": "shakespeare", "input": SHAKESPEARE[:6000]}, 400, "input", "context_length_exceeded"),
]
_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "messages": "/v1/messages",
          "responses": "/v1/responses"}


@pytest.mark.parametrize("api,body,status,param,code", BAD, ids=[f"{b[0]}-{b[3]}-{b[4]}" for b in BAD])
def test_bad_openai_requests_are_refused_naming_the_field(server, api, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + _PATHS[api], content=content, headers={"content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert param is None or param.split("[")[0] in error["message"]


def test_requests_that_are_no_api_call_are_refused_in_its_error_shape(server):
    """A body past what the context can hold is refused before it is read (was read whole and tokenized on the
    event loop, every other request waiting); an unknown path or method is answered as JSON."""
    from ds4lab.server.protocol import max_body_bytes

    tk = server.worker.model.tokenizer
    limit = max_body_bytes(server.app.state.server.limits, tk)
    big = b'{"model": "shakespeare", "prompt": "' + b"a" * limit + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert str(limit) in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["type"] == "error"
    # the same body sent in chunks, without a Content-Length: read up to the limit, then refused
    r = httpx.post(server.url + "/v1/completions", content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and "/v1/nothing" in r.json()[
        "error"]["message"]
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed" and "POST" in r.headers["allow"]
    r = httpx.get(server.url + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={})  # an Anthropic client's: its error shape
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/completions", json={"model": "shakespeare", "prompt": "x", "n": 1.0,
                                                         "echo": False, "max_tokens": 1, "frequency_penalty": 0,
                                                         "presence_penalty": 0.0, "logit_bias": {}})
    assert r.status_code == 200  # the one value the server does anyway, as a float: accepted
    r = httpx.post(server.url + "/v1/messages", json={"model": "shakespeare", "max_tokens": 8, "messages": [
        {"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": "lots"}})
    assert r.status_code == 400 and "thinking.budget_tokens must be an integer" in r.json()["error"]["message"]


def test_the_tokenizer_keeps_a_bounded_number_of_pieces(monkeypatch):
    """A server's tokenizer sees new words with every request: it keeps the ids of the PIECE_CACHE most recent
    pieces, not every piece it was ever sent, and encodes the same with a small cache as with none kept."""
    from ds4lab import tokenizer as tokenizer_module
    from ds4lab.gguf_file import GGUFModelFile

    meta = GGUFModelFile.open(ROOT / "ds4lab" / "assets" / "shakespeare.gguf").metadata
    monkeypatch.setattr(tokenizer_module, "PIECE_CACHE", 8)
    small = tokenizer_module.Tokenizer.from_metadata(meta)
    text = " ".join(f"w{i}x{i * 7}" for i in range(200))
    ids = small.encode(text)
    assert small._piece_ids.cache_info().currsize == 8
    monkeypatch.setattr(tokenizer_module, "PIECE_CACHE", 0)
    assert tokenizer_module.Tokenizer.from_metadata(meta).encode(text) == ids
    copy = pickle.loads(pickle.dumps(small))  # as a process's copy: the cache, a bound method's, made anew
    assert copy.encode(text) == ids and copy._piece_ids.cache_info().currsize == 0


def test_bad_requests_through_the_clients(server):
    with pytest.raises(openai.BadRequestError) as e:
        _openai(server).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 400 and "nope" in e.value.message
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="shakespeare", max_tokens=100, messages=[{"role": "user", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "max_tokens must be in [1, 64], got 100"}}
    r = httpx.post(server.url + "/v1/messages", json={"model": "shakespeare", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages must be")
    r = httpx.post(server.url + "/v1/messages", json={"model": "shakespeare", "messages": [
        {"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens is required"
    r = httpx.post(server.url + "/v1/messages", json={"model": "shakespeare", "max_tokens": 8, "messages": [
        {"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"}})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith('tool_choice {"type": "any"}: ds4lab serve lets the model choose')


CORS = {"access-control-allow-origin": "*", "access-control-allow-methods": "GET, POST, OPTIONS",
        "access-control-allow-headers": "*"}


def test_a_preflight_gets_204_and_cors_adds_its_headers_everywhere(server):
    """A browser's JavaScript client asks OPTIONS first: ds4-server answers 204 on any path (ds4lab answered 405),
    and with --cors every response, errors and event streams included, carries the Access-Control-Allow-* headers;
    without it none does."""
    preflight = {"origin": "http://localhost:3000", "access-control-request-method": "POST"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 204 and r.content == b"" and not CORS.keys() & r.headers.keys()
    assert not CORS.keys() & httpx.get(server.url + "/v1/models").headers.keys()
    with ServerThread(ds4lab.load(backend="numpy"), ctx=256, max_tokens=8, cors=True) as srv:
        replies = [httpx.options(srv.url + "/v1/chat/completions", headers=preflight),
                   httpx.options(srv.url + "/anything"),
                   httpx.get(srv.url + "/v1/models"),
                   httpx.get(srv.url + "/v1/nothing"),
                   httpx.post(srv.url + "/v1/completions", json={"model": "shakespeare", "prompt": "x", "n": 2}),
                   httpx.post(srv.url + "/v1/completions", timeout=60, json={
                       "model": "shakespeare", "prompt": "HAMLET:", "max_tokens": 2, "stream": True})]
    assert [r.status_code for r in replies] == [204, 204, 200, 404, 400, 200]
    for r in replies:
        assert {k: r.headers.get(k) for k in CORS} == CORS, (r.request.method, r.request.url)
    assert replies[-1].headers["content-type"].startswith("text/event-stream") and "[DONE]" in replies[-1].text


def test_a_full_queue_answers_503_with_retry_after():
    with ServerThread(ds4lab.load(backend="numpy"), ctx=256, max_tokens=32, queue_size=1) as srv:
        body = {"model": "shakespeare", "prompt": "HAMLET:", "max_tokens": 8, "seed": 1}
        barrier = threading.Barrier(6)

        def post(_):
            barrier.wait()
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=60)

        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(post, range(6)))
    codes = sorted(r.status_code for r in replies)
    # One running and one waiting at most, the rest refused; two answered only where the worker took the first
    # off the queue before the second came (a loaded machine can be slower: then one is answered, five refused).
    assert set(codes) == {200, 503} and 1 <= codes.count(200) <= 2, codes
    for r in replies:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "server_busy"


def test_load_8_concurrent_clients(server):
    """32 streamed requests, 8 at a time, 4 conversations sharing a system prompt: every one answered (or refused
    with 503), the figures printed. (benchmarks/server_load.py runs more, with the overhead against the API.)"""
    client = _openai(server)
    system = SHAKESPEARE[2000:2100]

    def one(i):
        began = time.perf_counter()
        first = None
        try:
            stream = client.chat.completions.create(
                model="shakespeare", max_tokens=1, seed=i, stream=True, stream_options={"include_usage": True},
                messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Scene {i % 4}."}])
            usage = None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - began
                usage = chunk.usage or usage
        except openai.APIStatusError as e:
            return e.status_code, None, None
        return 200, first, usage

    began = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(32)))
    seconds = time.perf_counter() - began
    assert all(code in (200, 503) for code, _, _ in results)
    served = [(t, u) for code, t, u in results if code == 200]
    assert len(served) >= 24 and all(u is not None and u.completion_tokens <= 1 for _, u in served)
    prompt = sum(u.prompt_tokens for _, u in served)
    cached = sum(u.prompt_tokens_details.cached_tokens for _, u in served)
    ttft = sorted(t for t, _ in served if t is not None)
    print(f"\nload: {len(served)}/32 served in {seconds:.1f} s, {len(served) / seconds:.2f} requests/s, TTFT median "
          f"{ttft[len(ttft) // 2]:.3f} s (max {ttft[-1]:.3f} s), cache hit rate {cached / prompt:.1%} of "
          f"{prompt} prompt tokens")
    assert cached / prompt > 0.5  # the shared system prompt is evaluated once per conversation switch at most


# -- as a process: SIGKILL mid-request, restart, SIGTERM --------------------------------------------------

def _start(kv: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """``ds4lab serve`` in a child process, once it answers; ``proc.said`` holds its stderr lines up to then."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "ds4lab.cli", "serve", "--backend", "numpy", "--ctx", str(CTX),
                             "--prefill-chunk", str(CHUNK), "--port", "0", "--kv-disk-dir", str(kv),
                             "--kv-cache-min-tokens", str(MIN_TOKENS), "--max-tokens", "256", *flags],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    proc.said = []
    for line in proc.stderr:
        proc.said.append(line)
        if "serving " in line:
            url = line.split("serving ")[1].split("/v1")[0]
            break
    else:
        raise AssertionError(f"ds4lab serve exited with {proc.wait()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/v1/models", timeout=2)
            return proc, url
        except httpx.TransportError:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)


def test_serve_writes_the_payload_version_asked_for(tmp_path):
    """``--kv-payload-version 1``: the store's files in ds4's legacy form (header byte 20 zero, payload version 1),
    for a folder shared with an older ds4-server, which cannot load version 2 and never replaces a file it failed
    to load; with a warning where the session's chunk is not the one such a ds4 loads (min(2048, ctx))."""
    from ds4lab import cli

    kv = tmp_path / "kv"
    proc, url = _start(kv, "--kv-payload-version", "1")
    try:
        _openai(type("srv", (), {"url": url})).chat.completions.create(
            model="shakespeare", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
            max_tokens=2, seed=1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert (f"ds4lab: warning: a ds4-server before 2026-05-23 loads only files of its own prefill chunk ({CTX} at "
            f"ctx {CTX}); this session's is {CHUNK}: add --prefill-chunk {CTX}\n") in proc.said
    headers = [e.header for e in ds4lab.KVStore(kv).entries()]
    assert headers and all(h.payload_abi == 0 and h.payload_version == 1 for h in headers), headers
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--kv-payload-version", "3"])
    assert e.value.code == 2


def test_sigkill_mid_request_then_restart_serves_the_store(tmp_path, reference):
    kv = tmp_path / "kv"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who's there?"}]
    ids = _chat_ids(reference, messages)
    anchor = ids.index(reference.tokenizer.user_id)
    proc, url = _start(kv)
    try:
        stream = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="shakespeare", messages=messages, max_tokens=200, seed=4, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        proc.send_signal(signal.SIGKILL)  # mid-generation: no shutdown save, maybe a temporary left behind
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.kill()
    store = ds4lab.KVStore(kv)  # as a notebook watching the folder opens it: stale temporaries go
    assert not [p for p in kv.iterdir() if not p.name.endswith(".kv")]
    entries = store.entries()
    assert ("cold", anchor) in {(REASONS[e.header.reason], e.tokens) for e in entries}
    for e in entries:  # every file whole: header, checksum, payload and text check out
        assert store.load(e, reference.config, tokenizer=reference.tokenizer) is not None

    proc, url = _start(kv)
    try:
        other = [messages[0], {"role": "user", "content": "Nay, answer me."}]
        r = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="shakespeare", messages=other, max_tokens=4, seed=4)
        assert r.usage.prompt_tokens_details.cached_tokens == anchor  # the system prompt, read from disk
        stats = httpx.get(url + "/ds4lab/stats").json()
        assert stats["store"]["hits"] == 1 and stats["store"]["hit_tokens"] == anchor
        # SIGTERM mid-stream: the step under way finishes, the request ends ("error", as ds4-server's shutdown
        # ends it) with its usage, the process exits 0 and the live state is stored as "shutdown"
        stream = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="shakespeare", messages=other, max_tokens=200, seed=5, stream=True,
            stream_options={"include_usage": True})
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "error"
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(_chat_ids(reference, other)) and 2 <= usage.completion_tokens < 200
    shutdown = [e for e in ds4lab.KVStore(kv).entries() if REASONS[e.header.reason] == "shutdown"]
    assert [e.tokens for e in shutdown] == [usage.prompt_tokens + usage.completion_tokens]
