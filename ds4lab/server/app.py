"""The HTTP side (Starlette): ds4-server's endpoints, each request checked (:mod:`.protocol`), queued on the one
:class:`~.worker.Worker` and answered in its protocol's shape, whole or streamed as server-sent events (OpenAI's
``chat.completion.chunk``/``text_completion`` chunks and ``[DONE]``; Anthropic's ``message_start`` …
``message_stop``; the Responses API's ``response.created`` … ``response.completed``, :mod:`.responses`). A client
that goes away cancels its request: the worker stops after the step under way.

``GET /v1/models``, ``GET /v1/models/{name}``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/messages``, ``POST /v1/responses``, and ``GET /ds4lab/stats`` (ds4lab's: the queue, the session, the
store's stats). As in ds4-server, ``OPTIONS`` on any path answers 204, and with ``cors`` every response carries the
``Access-Control-Allow-*`` headers a browser's JavaScript client needs (:class:`_Cors`; an unhandled error's 500,
which Starlette answers outside the app's middleware, aside)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from itertools import count

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import responses
from .protocol import (
    Limits,
    RequestError,
    anthropic_error,
    max_body_bytes,
    openai_error,
    parse_chat,
    parse_completion,
    parse_json,
    parse_messages,
    parse_responses,
)
from .sse import events, sse
from .tools import ToolCall
from .worker import Job, Outcome, Worker

DISCONNECT_POLL_S = 0.25  # non-streamed requests: how often the handler looks for a gone client
_PARSERS = {"chat": parse_chat, "completion": parse_completion, "messages": parse_messages,
            "responses": parse_responses}
_ID_PREFIX = {"chat": "chatcmpl", "completion": "cmpl", "messages": "msg"}
_OPENAI_FINISH = {"stop": "stop", "tool_calls": "tool_calls", "length": "length", "cancelled": "stop",
                  "shutdown": "error"}
_ANTHROPIC_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "cancelled": "end_turn",
                   "shutdown": "end_turn"}
# ds4-server's --cors headers, on every response (the preflight's 204, errors and event streams included)
CORS_HEADERS = ((b"access-control-allow-origin", b"*"), (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", b"*"))


@dataclass
class ServerState:
    worker: Worker
    limits: Limits
    created: int
    ids = count(1)

    @property
    def name(self) -> str:
        return self.limits.model_names[0]


def create_app(worker: Worker, limits: Limits, cors: bool = False) -> Starlette:
    """The Starlette app serving ``worker`` (started and closed with the app's lifespan); ``cors``: ds4-server's
    ``--cors``."""
    state = ServerState(worker, limits, int(time.time()))

    async def models(request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state, n) for n in limits.model_names]})

    async def model(request: HTTPRequest) -> Response:
        name = request.path_params["name"]
        if name not in limits.model_names:
            e = RequestError(f"model {name!r} is not served here", param="model", code="model_not_found",
                             status=404)
            return JSONResponse(openai_error(e), status_code=404)
        return JSONResponse(_model_card(state, name))

    async def stats(request: HTTPRequest) -> Response:
        return JSONResponse(worker.stats())

    def endpoint(api: str):
        async def handle(request: HTTPRequest) -> Response:
            return await _serve(state, request, api)
        return handle

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await asyncio.to_thread(worker.close)  # after the last response: the step under way, then "shutdown"

    routes = [Route("/v1/models", models), Route("/v1/models/{name:path}", model),
              Route("/v1/chat/completions", endpoint("chat"), methods=["POST"]),
              Route("/v1/completions", endpoint("completion"), methods=["POST"]),
              Route("/v1/messages", endpoint("messages"), methods=["POST"]),
              Route("/v1/responses", endpoint("responses"), methods=["POST"]),
              Route("/ds4lab/stats", stats)]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: _no_route, 405: _no_route},
                    middleware=[Middleware(_Cors, cors=cors)])
    app.state.server = state
    return app


class _Cors:
    """ASGI middleware: an ``OPTIONS`` request on any path gets 204 and no body, as ds4-server answers a browser's
    preflight (with or without ``--cors``); with ``cors`` every response gets :data:`CORS_HEADERS`."""

    def __init__(self, app, cors: bool):
        self.app, self.headers = app, list(CORS_HEADERS) if cors else []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif scope["method"] == "OPTIONS":
            await send({"type": "http.response.start", "status": 204, "headers": self.headers})
            await send({"type": "http.response.body", "body": b""})
        else:
            await self.app(scope, receive, self._with_headers(send) if self.headers else send)

    def _with_headers(self, send):
        """``send``, adding the headers to the response's start."""

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        return send_with_headers


async def _no_route(request: HTTPRequest, exc) -> Response:
    """An unknown path or method, answered in the API's error shape as every other refusal."""
    what = "no such endpoint" if exc.status_code == 404 else f"{request.method} is not allowed here"
    e = RequestError(f"{request.method} {request.url.path}: {what}", code="not_found" if exc.status_code == 404
                     else "method_not_allowed", status=exc.status_code)
    api = "messages" if request.url.path.startswith("/v1/messages") else "chat"  # count_tokens among them
    return _error_response(e, api, exc.headers)


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "ds4lab",
            "context_length": state.limits.ctx}


def _error_response(e: RequestError, api: str, headers: dict | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else headers  # 405: its Allow header
    body = anthropic_error(e) if api == "messages" else openai_error(e)
    return JSONResponse(body, status_code=e.status, headers=headers)


async def _body(request: HTTPRequest, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes before more of it is read."""
    too_large = RequestError(f"the request body is larger than this server reads ({limit} bytes for its context)",
                             code="request_too_large", status=413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


def _parse(api: str, body: bytes, state: ServerState):
    tokenizer = state.worker.model.tokenizer
    replay = {} if api == "completion" else {"replay": state.worker.tool_blocks}  # (a completion sends no calls)
    return _PARSERS[api](parse_json(body), state.limits, tokenizer, **replay)


async def _serve(state: ServerState, request: HTTPRequest, api: str) -> Response:
    try:
        body = await _body(request, max_body_bytes(state.limits, state.worker.model.tokenizer))
        # read and tokenized in a thread: a long prompt does not hold up the other requests' responses
        req = await asyncio.to_thread(_parse, api, body, state)
        job = Job(req, asyncio.get_running_loop())
        state.worker.submit(job)
    except RequestError as e:
        return _error_response(e, api)
    n = next(state.ids)
    rid = responses.Ids(n) if api == "responses" else f"{_ID_PREFIX[api]}-{n}"
    if req.stream:
        stream = {"messages": _anthropic_stream, "responses": responses.stream}.get(api, _openai_stream)
        return StreamingResponse(stream(job, rid), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    reasoning, text, calls = [], [], []
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), max(0.0, check_at - loop.time()))
            except asyncio.TimeoutError:
                event = None
            # whether the client is still there, every DISCONNECT_POLL_S even while tokens keep coming
            if loop.time() >= check_at:
                if await request.is_disconnected():
                    job.cancelled.set()
                    return Response(status_code=499)
                check_at = loop.time() + DISCONNECT_POLL_S
            if event is None:
                continue
            kind = event[0]
            if kind == "text":
                (reasoning if event[1] == "reasoning" else text).append(event[2])
            elif kind == "calls":
                calls = event[1]
            elif kind == "error":
                return _error_response(event[1], api)
            elif kind == "done":
                return JSONResponse(_whole(api, rid, job, event[1], "".join(reasoning), "".join(text), calls))
    finally:
        job.cancelled.set()  # a no-op once done; stops the worker if this handler was cancelled


def openai_call(call: ToolCall) -> dict:
    """A reply's call as OpenAI's chat API sends it (its arguments a JSON object's text)."""
    return {"id": f"call_{call.key}", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def anthropic_call(call: ToolCall) -> dict:
    """A reply's call as Anthropic's tool_use block (its input the object)."""
    return {"type": "tool_use", "id": f"toolu_{call.key}", "name": call.name, "input": json.loads(call.arguments)}


def _whole(api: str, rid, job: Job, out: Outcome, reasoning: str, text: str, calls: list[ToolCall]) -> dict:
    if api == "responses":
        return responses.whole(rid, job, out, reasoning, text, calls)
    req, now = job.request, int(time.time())
    if api == "messages":
        content = ([{"type": "thinking", "thinking": reasoning, "signature": ""}] if req.thinking else [])
        if text or not calls:  # a reply of calls alone has no text block
            content.append({"type": "text", "text": text})
        content += [anthropic_call(c) for c in calls]
        return {"id": rid, "type": "message", "role": "assistant", "model": req.model, "content": content,
                "stop_reason": "stop_sequence" if out.stop else _ANTHROPIC_STOP[out.finish],
                "stop_sequence": out.stop, "usage": _anthropic_usage(out)}
    if api == "chat":
        message = {"role": "assistant", "content": text if text or not calls else None}
        if req.thinking:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [openai_call(c) for c in calls]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _OPENAI_FINISH[out.finish]}
        return {"id": rid, "object": "chat.completion", "created": now, "model": req.model, "choices": [choice],
                "usage": _openai_usage(out)}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _OPENAI_FINISH[out.finish]}
    return {"id": rid, "object": "text_completion", "created": now, "model": req.model, "choices": [choice],
            "usage": _openai_usage(out)}


def _openai_usage(out: Outcome) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _anthropic_usage(out: Outcome | None, prompt_tokens: int = 0, cached: int = 0) -> dict:
    if out is not None:
        prompt_tokens, cached = out.prompt_tokens, out.cached_tokens
    return {"input_tokens": prompt_tokens - cached, "output_tokens": out.completion_tokens if out else 0,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def _openai_stream(job: Job, rid: str):
    req, created = job.request, int(time.time())
    chat = req.api == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta=None, text=None, finish=None, usage=None, choices=True) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": req.model}
        if choices:
            choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": text or "", "logprobs": None}
            body["choices"] = [dict(choice, finish_reason=finish)]
        else:
            body["choices"] = []
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    live = False  # whether calls came as they were written
    async for event in events(job):
        live = live or event is not None and event[0] == "call"
        if event is None:
            yield ": keep-alive\n\n"
        elif event[0] == "start" and chat:
            yield chunk({"role": "assistant", "content": ""})
        elif event[0] == "text":
            key = "reasoning_content" if event[1] == "reasoning" else "content"
            yield chunk({key: event[2]}, event[2]) if chat or event[1] == "text" else ""
        elif event[0] == "call":  # a call as the model writes it: its id and name, then its arguments in pieces
            i, key, name = event[1:]
            call = openai_call(ToolCall(name, "", key))
            yield chunk({"tool_calls": [dict(index=i, **call)]})
        elif event[0] == "args":
            yield chunk({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
        elif event[0] == "calls" and not live:  # each call whole, in one delta
            yield chunk({"tool_calls": [dict(index=i, **openai_call(c)) for i, c in enumerate(event[1])]})
        elif event[0] == "error":
            yield sse(openai_error(event[1]))
            yield "data: [DONE]\n\n"
        elif event[0] == "done":
            out: Outcome = event[1]
            yield chunk({}, "", _OPENAI_FINISH[out.finish])
            if req.include_usage:
                yield chunk(usage=_openai_usage(out), choices=False)
            yield "data: [DONE]\n\n"


async def _anthropic_stream(job: Job, rid: str):
    req = job.request
    block, index = None, -1  # the open content block's type and index
    started = False

    def open_block(kind: str, start: dict | None = None):
        nonlocal block, index
        events = [sse({"type": "content_block_stop", "index": index}, "content_block_stop")] if block else []
        block, index = kind, index + 1
        start = start or ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                          else {"type": "text", "text": ""})
        events.append(sse({"type": "content_block_start", "index": index, "content_block": start},
                           "content_block_start"))
        return "".join(events)

    async for event in events(job):
        if event is None:
            yield sse({"type": "ping"}, "ping")
        elif event[0] == "start" or event[0] == "done" and not started:  # a request stopped in its prefill
            started = True
            usage = _anthropic_usage(None, *event[1:]) if event[0] == "start" else _anthropic_usage(event[1])
            message = {"id": rid, "type": "message", "role": "assistant", "model": req.model, "content": [],
                       "stop_reason": None, "stop_sequence": None, "usage": dict(usage, output_tokens=0)}
            yield sse({"type": "message_start", "message": message}, "message_start")
        elif event[0] == "text":
            kind = "thinking" if event[1] == "reasoning" else "text"
            if block != kind:
                yield open_block(kind)
            delta = {"type": "thinking_delta", "thinking": event[2]} if kind == "thinking" else {
                "type": "text_delta", "text": event[2]}
            yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
        elif event[0] == "call":  # a tool_use block as the model writes it, its input in pieces
            yield open_block("tool_use", dict(anthropic_call(ToolCall(event[3], "{}", event[2])), input={}))
        elif event[0] == "args":
            delta = {"type": "input_json_delta", "partial_json": event[2]}
            yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
        elif event[0] == "calls" and block != "tool_use":  # each a tool_use block, its input in one delta
            for call in event[1]:
                yield open_block("tool_use", dict(anthropic_call(call), input={}))
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
        elif event[0] == "error":
            yield sse(anthropic_error(event[1]), "error")
        if event is not None and event[0] == "done":
            out: Outcome = event[1]
            if block not in ("text", "tool_use"):
                yield open_block("text")
            yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
            delta = {"stop_reason": "stop_sequence" if out.stop else _ANTHROPIC_STOP[out.finish],
                     "stop_sequence": out.stop}
            yield sse({"type": "message_delta", "delta": delta, "usage": {"output_tokens": out.completion_tokens}},
                       "message_delta")
            yield sse({"type": "message_stop"}, "message_stop")
