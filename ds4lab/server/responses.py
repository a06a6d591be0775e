"""OpenAI's Responses API (``POST /v1/responses``) as ds4-server answers it (ds4_server.c's responses_final_response
and responses_sse_*): a response object whose ``output`` holds a reasoning item (only where ``reasoning.summary``
asked for it: its summary is the reasoning text) and a message item with one ``output_text`` part, whole or streamed
as ``response.created`` ... ``response.completed`` events, each with its ``sequence_number``; then a function_call
item for each tool call the reply made (streamed as the model writes it, its arguments in pieces). A response cut by
``max_output_tokens`` is ``incomplete``, one the server could not finish ``failed`` (and streamed as
``response.incomplete`` / ``response.failed``, the event clients end on)."""

from __future__ import annotations

import time

from .protocol import Request, RequestError
from .sse import events, sse
from .tools import ToolCall
from .worker import Job, Outcome

_STATUS = {"stop": "completed", "tool_calls": "completed", "cancelled": "completed", "length": "incomplete",
           "shutdown": "failed"}


class Ids:
    """The ids of one response and of its two items."""

    def __init__(self, n: int):
        self.response, self.reasoning, self.message = f"resp_{n}", f"rs_{n}", f"msg_{n}"


def usage(out: Outcome) -> dict:
    """ds4-server's: the prompt's tokens not reused are written to the cache (its cache_write_tokens)."""
    written = out.prompt_tokens - out.cached_tokens
    return {"input_tokens": out.prompt_tokens,
            "input_tokens_details": {"cached_tokens": out.cached_tokens, "cache_write_tokens": written},
            "output_tokens": out.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": out.reasoning_tokens},
            "total_tokens": out.prompt_tokens + out.completion_tokens}


_STOPPED = {"code": "server_error", "message": "the server stopped before the response was done"}


def response(ids: Ids, req: Request, created: int, status: str, output: list, out: Outcome | None = None,
             error: dict | None = None) -> dict:
    """The response object: what the request asked for, its status, output and usage (None while in progress, or
    where it failed before its end)."""
    return {"id": ids.response, "object": "response", "created_at": created, "status": status, "model": req.model,
            "output": output, "usage": usage(out) if out else None,
            "error": error or _STOPPED if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "max_output_tokens": req.max_tokens, "temperature": req.sampling.temperature, "top_p": req.sampling.top_p,
            "reasoning": {"effort": req.effort, "summary": req.summary},
            "text": {"format": {"type": "text"}}, "tools": list(req.tools),
            "tool_choice": "auto" if req.tools else "none", "parallel_tool_calls": req.parallel,
            "previous_response_id": None, "store": False, "metadata": {}}


def _item_status(status: str) -> str:
    """A message item's status at the response's end: completed, or incomplete where the response is not."""
    return "completed" if status == "completed" else "incomplete"


def _reasoning_status(in_reasoning: bool) -> str:
    """A reasoning item's status: incomplete where the generation ended before its </think> (ds4-server's)."""
    return "incomplete" if in_reasoning else "completed"


def reasoning_item(ids: Ids, text: str, status: str) -> dict:
    summary = [{"type": "summary_text", "text": text}] if text else []
    return {"id": ids.reasoning, "type": "reasoning", "status": status, "summary": summary}


def message_item(ids: Ids, text: str, status: str) -> dict:
    return {"id": ids.message, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"id": f"fc_{call.key}", "type": "function_call", "status": status, "call_id": f"call_{call.key}",
            "name": call.name, "arguments": call.arguments}


def _items(ids: Ids, req: Request, reasoning: str, text: str, status: str, in_reasoning: bool,
           calls: list[ToolCall]) -> list:
    """The output items: the reasoning where a summary was asked for and there is some (incomplete where the
    generation ended before its </think>, as ds4-server marks it), the message where there is text (ds4's rule: an
    answer cut inside its reasoning has no message), a function_call item a call."""
    return ([reasoning_item(ids, reasoning, _reasoning_status(in_reasoning))] if req.summary and reasoning else []) + (
        [message_item(ids, text, _item_status(status))] if text else []) + [call_item(c) for c in calls]


def whole(ids: Ids, job: Job, out: Outcome, reasoning: str, text: str, calls: list[ToolCall]) -> dict:
    status = _STATUS[out.finish]
    output = _items(ids, job.request, reasoning, text, status, out.in_reasoning, calls)
    return response(ids, job.request, int(time.time()), status, output, out)


async def stream(job: Job, ids: Ids):
    """The events of a streamed response: its creation, each item added, its text as deltas, each item done, and
    the response at the end (``response.completed``, ``.incomplete`` or ``.failed``: also where the worker failed
    under way, the item open then closed incomplete)."""
    req, created, seq = job.request, int(time.time()), 0
    texts = {"reasoning": [], "text": []}
    opened = []  # the text items opened so far, in order: "reasoning", "message"
    calls = []
    live = []  # (key, name, argument pieces) of each call that came as it was written
    where = {}  # a call's key: its output index

    def event(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **fields}, kind)

    def open_item(name: str) -> str:
        opened.append(name)
        at = dict(item_id=ids.reasoning if name == "reasoning" else ids.message, output_index=len(opened) - 1)
        if name == "reasoning":
            return (event("response.output_item.added", output_index=at["output_index"],
                          item=reasoning_item(ids, "", "in_progress"))
                    + event("response.reasoning_summary_part.added", **at, summary_index=0,
                            part={"type": "summary_text", "text": ""}))
        item = message_item(ids, "", "in_progress")
        return (event("response.output_item.added", output_index=at["output_index"], item=dict(item, content=[]))
                + event("response.content_part.added", **at, content_index=0, part=item["content"][0]))

    def close_item(name: str, status: str) -> str:
        text, index = "".join(texts[name if name == "reasoning" else "text"]), opened.index(name)
        if name == "reasoning":
            at = dict(item_id=ids.reasoning, output_index=index, summary_index=0)
            return (event("response.reasoning_summary_text.done", **at, text=text)
                    + event("response.reasoning_summary_part.done", **at, part={"type": "summary_text", "text": text})
                    + event("response.output_item.done", output_index=index,
                            item=reasoning_item(ids, text, status)))
        item = message_item(ids, text, status)
        at = dict(item_id=ids.message, output_index=index, content_index=0)
        return (event("response.output_text.done", **at, text=text, logprobs=[])
                + event("response.content_part.done", **at, part=item["content"][0])
                + event("response.output_item.done", output_index=index, item=item))

    def open_call(key: str, name: str) -> str:
        """A call's item added, the reply's text item done before the first."""
        done = close_item(opened[-1], "completed") if opened and not where else ""
        where[key] = len(opened) + len(where)
        return done + event("response.output_item.added", output_index=where[key],
                            item=call_item(ToolCall(name, "", key), "in_progress"))

    yield event("response.created", response=response(ids, req, created, "in_progress", []))
    yield event("response.in_progress", response=response(ids, req, created, "in_progress", []))
    async for ev in events(job):
        if ev is None:
            yield ": keep-alive\n\n"
        elif ev[0] == "text":
            channel, text = ev[1], ev[2]
            texts[channel].append(text)
            if channel == "reasoning" and not req.summary:
                continue  # thought, not sent: the answer follows
            name = "reasoning" if channel == "reasoning" else "message"
            if name not in opened:
                yield (close_item("reasoning", "completed") if opened == ["reasoning"] else "") + open_item(name)
            at = dict(item_id=ids.reasoning if name == "reasoning" else ids.message, output_index=len(opened) - 1)
            yield (event("response.reasoning_summary_text.delta", **at, summary_index=0, delta=text)
                   if name == "reasoning" else event("response.output_text.delta", **at, content_index=0, delta=text,
                                                    logprobs=[]))
        elif ev[0] == "call":  # a call as the model writes it: its item, then its arguments in pieces
            live.append((ev[2], ev[3], []))
            yield open_call(ev[2], ev[3])
        elif ev[0] == "args":
            key, _, pieces = live[ev[1]]
            pieces.append(ev[2])
            yield event("response.function_call_arguments.delta", item_id=f"fc_{key}", output_index=where[key],
                        delta=ev[2])
        elif ev[0] == "calls":  # each call's item done (added first, its arguments in one delta, if not yet)
            calls = ev[1]
            for call in calls:
                if call.key not in where:
                    yield open_call(call.key, call.name) + event(
                        "response.function_call_arguments.delta", item_id=f"fc_{call.key}",
                        output_index=where[call.key], delta=call.arguments)
                at = dict(item_id=f"fc_{call.key}", output_index=where[call.key])
                yield (event("response.function_call_arguments.done", **at, name=call.name, arguments=call.arguments)
                       + event("response.output_item.done", output_index=at["output_index"], item=call_item(call)))
        elif ev[0] in ("done", "error"):
            out: Outcome | None = ev[1] if ev[0] == "done" else None
            status = _STATUS[out.finish] if out else "failed"
            # failed: unfinished where neither an answer nor a call came after it
            in_reasoning = out.in_reasoning if out else "message" not in opened and not where
            if opened and not where:  # the message, or the reasoning where no answer followed
                yield close_item(opened[-1], _reasoning_status(in_reasoning) if opened[-1] == "reasoning"
                                 else _item_status(status))
            # calls sent when the reply failed: done incomplete (none of them to be run), with the arguments sent
            unfinished = [] if calls else [ToolCall(name, "".join(pieces), key) for key, name, pieces in live]
            for call in unfinished:
                yield event("response.output_item.done", output_index=where[call.key],
                            item=call_item(call, "incomplete"))
            error = None
            if out is None:
                e: RequestError = ev[1]
                error = {"code": "server_error", "message": e.message}  # the one code of OpenAI's that fits
            reasoning, text = "".join(texts["reasoning"]), "".join(texts["text"])
            # a text item is done when the first call's is added (completed, as it was streamed)
            output = _items(ids, req, reasoning, text, "completed" if where else status, in_reasoning, calls) + [
                call_item(c, "incomplete") for c in unfinished]
            yield event(f"response.{status}", response=response(ids, req, created, status, output, out, error))
