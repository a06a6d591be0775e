"""The prompt ds4-server renders from a conversation (``render_chat_prompt_text`` in ds4_server.c at 8d57664), which
every chat API of ``ds4lab serve`` uses, so that a conversation is read as ds4-server reads it (the same tokens:
the same answers, and disk checkpoints that either server's prompts extend).

It is not the append rule of ds4's library that ``Tokenizer.render_chat`` follows (the CLI's chat, a Session's
``generate``): the offered tools' schemas (:mod:`.tools`) and every system and developer message go first, joined by
a blank line; an assistant message ends with its tool calls' DSML block, if any, and EOS; consecutive tool results
share one User marker; when thinking, an assistant message after the last user turn, or any once tools are offered
or a tool call or result is in the conversation, keeps its reasoning in ``<think>...</think>`` (the others only
close it); an assistant message that no user turn precedes has no Assistant marker, and a conversation that ends
with one gets no new assistant turn. The text is then tokenized as a whole with its special tokens, as
``ds4_tokenize_rendered_chat`` does."""

from __future__ import annotations

from ..tokenizer import (
    ASSISTANT,
    BOS,
    EOS,
    REASONING_EFFORT_MAX_PREFIX,
    THINK,
    THINK_END,
    TOOL_RESULT_CLOSE,
    TOOL_RESULT_OPEN,
    USER,
    think_mode,
)
from .tools import calls_block, tools_prompt

SYSTEM_ROLES = ("system", "developer")
TOOL_ROLES = ("tool", "function")


def tool_result(content: str) -> str:
    """A tool's output in ds4-server's wrapper: as it is, but for the wrapper's own closing tag, whose '<' becomes
    "&lt;" (the output cannot end the wrapper early)."""
    return TOOL_RESULT_OPEN + content.replace(TOOL_RESULT_CLOSE, "&lt;" + TOOL_RESULT_CLOSE[1:]) + TOOL_RESULT_CLOSE


def tool_context(messages: list[dict], tools=()) -> bool:
    """Whether tools are offered, or a tool call or result is in the conversation (ds4-server's "tool context":
    every reply keeps its reasoning in the prompt)."""
    return bool(tools) or any(m["role"] in TOOL_ROLES or m.get("calls") for m in messages)


def render_text(messages: list[dict], think: bool | str, tools=()) -> str:
    """The rendered conversation: ``messages`` are dicts of ``role``, ``content`` and, for an assistant message,
    an optional ``reasoning``, ``calls`` (:class:`.tools.ToolCall`, written after its text as a DSML block) and
    ``block`` (the text the model wrote for them, written in the block's place); ``think`` as
    ``Tokenizer.render_chat`` takes it: False or "none" (no thinking), True or "high" (thinking) or "max" (thinking,
    with the reasoning-effort prefix after BOS); ``tools`` the offered tools' schemas, which open the system
    prompt."""
    mode = think_mode(think)
    system = tools_prompt(tools) if tools else ""
    for m in messages:  # a blank line before each one but where none came yet (an empty first one adds none)
        if m["role"] in SYSTEM_ROLES:
            system += ("\n\n" if system else "") + m["content"]
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user" or m["role"] in TOOL_ROLES),
                    default=-1)
    keep_reasoning = tool_context(messages, tools)
    out = [BOS, REASONING_EFFORT_MAX_PREFIX if mode == "max" else "", system]
    awaiting_reply = in_tool_results = False  # a user turn or tool results came last; several results in a row
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "user":
            out += [USER, m["content"]]
            awaiting_reply, in_tool_results = True, False
        elif role in TOOL_ROLES:
            out += [USER if not in_tool_results else "", tool_result(m["content"])]
            awaiting_reply = in_tool_results = True
        elif role == "assistant":
            if awaiting_reply:
                # the reasoning of a reply after the last user turn is kept (a continued reply); earlier ones' not
                kept = mode and (keep_reasoning or i > last_user)
                out += [ASSISTANT, THINK + m.get("reasoning", "") + THINK_END if kept else THINK_END]
            out += [m["content"], m.get("block") or calls_block(m.get("calls")), EOS]
            awaiting_reply = in_tool_results = False
        elif role not in SYSTEM_ROLES:
            raise ValueError(f"unknown chat role {role!r}")
    if awaiting_reply:
        out += [ASSISTANT, THINK if mode else THINK_END]
    return "".join(out)


def render(tokenizer, messages: list[dict], think: bool | str, tools=()) -> list[int]:
    """:func:`render_text`'s token ids: special tokens wherever their text is, the rest byte-pair encoded."""
    return tokenizer.encode_rendered(render_text(messages, think, tools))
