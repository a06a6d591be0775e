"""The requests the server takes, read and checked: OpenAI's chat and text completions and responses and
Anthropic's messages become one :class:`Request` (token ids, sampling, limits); anything malformed is a
:class:`RequestError` naming the field, which the app sends as the protocol's error JSON (:func:`openai_error`,
:func:`anthropic_error`).

The fields and their meaning follow ds4-server (ds4_server.c's parse_chat_request, parse_completion_request,
parse_anthropic_request, parse_responses_request): ``max_tokens`` (or ``max_completion_tokens``,
``max_output_tokens``), ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``seed``, ``stream``, ``stream_options.include_usage``, ``stop``/``stop_sequences``, and the thinking
switches ``reasoning_effort``, ``thinking``, ``think`` and the model names ``deepseek-chat`` (no thinking) and
``deepseek-reasoner`` (thinking), ``tools`` and ``tool_choice`` (auto or none), and the calls and results a
conversation sends back."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..sampling import DEFAULT_MIN_P, DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from ..tokenizer import effective_think
from .prompt import render_text, tool_result
from .tools import ToolCall, call_key, compact

THINKING_MODELS = {"deepseek-chat": "none", "deepseek-reasoner": "high"}  # ds4-server's aliases
DS4_MODEL = "deepseek-v4-flash"  # ds4-server's one model name, also accepted
COMPLETION_SYSTEM = "You are a helpful assistant"  # the system message ds4-server puts before a completion's prompt
MAX_STOP_SEQUENCES = 16
_SEED_MAX = (1 << 64) - 1


class RequestError(Exception):
    """A refused request: ``status`` (400 unless said), the field (``param``), OpenAI's ``code``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type


def openai_error(e: RequestError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def anthropic_error(e: RequestError) -> dict:
    kind = {503: "overloaded_error", 404: "not_found_error"}.get(e.status, e.type)
    return {"type": "error", "error": {"type": kind, "message": e.message}}


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None = None

    def params(self) -> dict:
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    seed=self.seed)

    def for_thinking(self) -> Sampling:
        """What ds4-server samples a thinking request with, whatever it asked: ds4's defaults (temperature 1, no
        top-k, top-p 1, min-p 0.05), the request's seed kept."""
        return Sampling(DEFAULT_TEMPERATURE, 0, DEFAULT_TOP_P, DEFAULT_MIN_P, self.seed)


@dataclass(frozen=True)
class Limits:
    """What the server allows and uses when a request says nothing: the model's names, the context, the most
    tokens a request may ask for, the sampling and thinking defaults (the flags of ``ds4lab serve``)."""

    model_names: tuple[str, ...]
    ctx: int
    max_tokens: int
    sampling: Sampling
    think: str  # "none", "high" or "max": the default for chat requests
    chat_model: bool  # the model has a chat template; without one, chat requests default to no thinking


@dataclass(frozen=True)
class Request:
    api: str  # "chat", "completion" or "messages"
    model: str
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    thinking: bool = False  # the output starts inside <think>: reasoning first, then the answer (a text completion
    # sends both as one text)
    messages: list = field(default_factory=list, repr=False)
    text: str = field(default="", repr=False)  # the rendered chat prompt (what ds4-server matches); a chat model's
    # text completion's too
    # /v1/responses: reasoning.effort as asked (None: not asked), and reasoning.summary (auto, concise or detailed:
    # the reasoning sent back as a summary item; None: not sent)
    effort: str | None = None
    summary: str | None = None
    tools: tuple = ()  # the offered tools' schemas (none where tool_choice is none): the reply's tool block is read
    parallel: bool = True  # the reply's calls all sent back (parallel_tool_calls), or its first alone


def max_body_bytes(limits: Limits, tokenizer) -> int:
    """The largest request body read: room for a context's worth of the longest tokens written as JSON escapes
    (six bytes a byte), and each token its own message's keys; a larger body cannot fit the context."""
    return limits.ctx * (6 * tokenizer.max_token_bytes + 64) + (1 << 16)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of a double's range (JSON has no infinities)")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(body: bytes) -> dict:
    """The request's JSON object; NaN, the infinities and numbers past a double's range are refused as JSON does
    (Python's reader takes them, and they could not be written back into a prompt or an answer)."""
    try:
        data = json.loads(body, parse_float=_finite, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more digits than Python reads
        raise RequestError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise RequestError("the request body is not valid JSON: it nests too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}",
                           code="invalid_json")
    return data


# -- field readers: each names the field it refuses -------------------------------------------------------

def _type_error(name: str, want: str, value) -> RequestError:
    return RequestError(f"{name} must be {want}, got {json.dumps(value)[:80]}", param=name, code="invalid_type")


def _int(data: dict, name: str, default, lo: int, hi: int, path: str | None = None):
    """``data[name]``, an integer in [lo, hi] (``path``: the field's name in the request, when nested)."""
    value, path = data.get(name), path or name
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(path, "an integer", value)
    if not lo <= value <= hi:
        raise RequestError(f"{path} must be in [{lo}, {hi}], got {value}", param=path, code="out_of_range")
    return value


def _float(data: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, "a number", value)
    if not lo <= value <= hi:
        raise RequestError(f"{name} must be in [{lo:g}, {hi:g}], got {value}", param=name, code="out_of_range")
    return float(value)


def _bool(data: dict, name: str, default: bool = False, path: str | None = None) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(path or name, "true or false", value)
    return value


def _stop(data: dict, name: str) -> tuple[str, ...]:
    value = data.get(name)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise _type_error(name, "a non-empty string or a list of them", value)
    if len(value) > MAX_STOP_SEQUENCES:
        raise RequestError(f"{name} has {len(value)} entries; at most {MAX_STOP_SEQUENCES}", param=name,
                           code="out_of_range")
    return tuple(value)


def _model(data: dict, limits: Limits) -> str:
    value = data.get("model")
    if value is None:
        raise RequestError("model is required", param="model", code="missing_field")
    if not isinstance(value, str):
        raise _type_error("model", "a string", value)
    if value not in limits.model_names and value not in THINKING_MODELS and value != DS4_MODEL:
        names = ", ".join(limits.model_names + (DS4_MODEL, *THINKING_MODELS))
        raise RequestError(f"model {value!r} is not served here; this server serves {names}", param="model",
                           code="model_not_found")
    return value


def _max_tokens(data: dict, limits: Limits, names=("max_tokens", "max_completion_tokens"),
                required: bool = False) -> int:
    for name in names:
        if data.get(name) is not None:
            return _int(data, name, None, 1, limits.max_tokens)
    if required:
        raise RequestError(f"{names[0]} is required", param=names[0], code="missing_field")
    return limits.max_tokens


def _sampling(data: dict, limits: Limits, temperature_max: float = 2.0) -> Sampling:
    d = limits.sampling
    return Sampling(temperature=_float(data, "temperature", d.temperature, 0.0, temperature_max),
                    top_k=_int(data, "top_k", d.top_k, 0, 1 << 30),
                    top_p=_float(data, "top_p", d.top_p, 0.0, 1.0),
                    min_p=_float(data, "min_p", d.min_p, 0.0, 1.0),
                    seed=_int(data, "seed", d.seed, 0, _SEED_MAX))


def _text_content(value, name: str) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _type_error(f"{name}[{i}]", 'a text part {"type": "text", "text": "..."}', part)
            parts.append(part["text"])
        return "".join(parts)
    raise _type_error(name, "a string or a list of text parts", value)


# Tools (:mod:`.tools`): the schemas a request offers, as each API lists them (chat: {"type": "function",
# "function": {...}}, the function object rendered; messages: {"name", "description", "input_schema"}; responses:
# {"type": "function", "name", ...}), rendered as ds4-server renders them unless tool_choice is none. A call cannot be
# forced (ds4-server cannot either): tool_choice is auto or none.
_TOOL_CHOICES = ("auto", "none")


def _parallel(data: dict, api: str) -> bool:
    """Whether a reply's calls are all sent back: parallel_tool_calls (Anthropic: tool_choice's
    disable_parallel_tool_use); false sends the first alone (the model may write several in its block)."""
    if api == "messages":
        choice = data.get("tool_choice")
        return not _bool(choice if isinstance(choice, dict) else {}, "disable_parallel_tool_use",
                         path="tool_choice.disable_parallel_tool_use")
    return _bool(data, "parallel_tool_calls", True)


def _tool_choice(data: dict) -> str:
    """"auto" or "none", as a string or as Anthropic's object ({"type": "auto"})."""
    value = data.get("tool_choice")
    choice = value.get("type") if isinstance(value, dict) else value
    if value is not None and choice not in _TOOL_CHOICES:
        raise RequestError(f"tool_choice {json.dumps(value)[:80]}: ds4lab serve lets the model choose (auto) or offers "
                           "no tools (none); it cannot force a call", param="tool_choice", code="unsupported_parameter")
    return choice or "auto"


def _tools(data: dict, api: str) -> tuple[dict, ...]:
    """The schemas offered (none where tool_choice is none), each checked for its type and a name."""
    for key in ("functions", "function_call"):  # OpenAI's older form of tools (none listed is no tool)
        if data.get(key) not in (None, [], "none"):
            raise RequestError(f"{key}: the legacy functions API is not served; send tools (and tool_choice)",
                               param=key, code="unsupported_parameter")
    value = data.get("tools")
    if _tool_choice(data) == "none" or value is None:
        return ()
    if not isinstance(value, list):
        raise _type_error("tools", "a list of tools", value)
    out = []
    for i, tool in enumerate(value):
        name = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in ((None, "custom") if api == "messages" else (None, "function")):
            want = "a client tool (name, description, input_schema)" if api == "messages" else 'a "function" tool'
            raise RequestError(f"{name}.type {json.dumps(kind)[:80]}: ds4lab serve offers {want} only",
                               param=f"{name}.type", code="unsupported_parameter")
        schema = tool.get("function") if api == "chat" else tool
        if not (isinstance(schema, dict) and isinstance(schema.get("name"), str) and schema["name"]):
            field = f"{name}.function" if api == "chat" else name
            raise _type_error(field, "an object with a name", schema)
        out.append(schema)
    return tuple(out)


def _arguments(value, name: str) -> str:
    """A call's arguments as sent back: a JSON object's text (OpenAI's) or the object (Anthropic's input)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return compact(value)
    raise _type_error(name, "a JSON object or its text", value)


def _call(name: str, tool_name, arguments, call_id, field: str = "arguments") -> ToolCall:
    """A call sent back; its key the one the server gave it (from ``call_id``), if it did."""
    if not (isinstance(tool_name, str) and tool_name):
        raise _type_error(f"{name}.name", "a tool's name", tool_name)
    return ToolCall(tool_name, _arguments(arguments if arguments is not None else "{}", f"{name}.{field}"),
                    call_key(call_id))


def _chat_calls(value, name: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(value, list):
        raise _type_error(name, "a list of tool calls", value)
    out = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise _type_error(f"{name}[{i}]", 'a tool call {"type": "function", "function": {...}}', call)
        out.append(_call(f"{name}[{i}].function", function.get("name"), function.get("arguments"), call.get("id")))
    return tuple(out)


_NOTHING = object()  # no value but null is taken
# the sampler's other controls: penalties, biases and a forced format change the tokens, so ignoring them would not do
_SAMPLER_UNSUPPORTED = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}
_CHAT_UNSUPPORTED = {"n": 1, "logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"},
                     **_SAMPLER_UNSUPPORTED}
_COMPLETION_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "suffix": "", "logprobs": _NOTHING,
                           **_SAMPLER_UNSUPPORTED}


def _refuse_unsupported(data: dict, allowed: dict) -> None:
    """Fields whose other values ask for what this server does not do (several choices, log-probabilities, the
    prompt echoed, penalties, logit biases, a response format): refused by name unless absent or the one value it
    does anyway (n 1, echo false, penalty 0, no biases, plain text)."""
    for key, ok in allowed.items():
        value = data.get(key)
        if value is not None and not (value == ok and isinstance(value, bool) == isinstance(ok, bool)):
            only = "" if ok is _NOTHING else f" (only {json.dumps(ok)})"
            raise RequestError(f"{key} {json.dumps(value)[:80]}: ds4lab serve does not do this{only}; send the "
                               "request without it", param=key, code="unsupported_parameter")


def _include_usage(data: dict) -> bool:
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    return _bool(options or {}, "include_usage", path="stream_options.include_usage")


def _think_mode(data: dict, model: str, limits: Limits) -> str:
    """ds4-server's rules: reasoning_effort max → max, none → none, other efforts → high; thinking disabled,
    think false or the model deepseek-chat → none; deepseek-reasoner → high; else the server's default."""
    mode = THINKING_MODELS.get(model) or (limits.think if limits.chat_model else "none")
    effort, name = data.get("reasoning_effort"), "reasoning_effort"
    if effort is None and isinstance(data.get("output_config"), dict):
        effort, name = data["output_config"].get("effort"), "output_config.effort"
    if effort is not None:
        efforts = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
        if effort not in efforts:
            raise RequestError(f"{name} must be one of {', '.join(efforts)}, got {json.dumps(effort)}",
                               param=name, code="invalid_value")
        mode = {"max": "max", "none": "none"}.get(effort, "high")
    thinking = data.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise _type_error("thinking", '{"type": "enabled"} or {"type": "disabled"}', thinking)
        _int(thinking, "budget_tokens", None, 1, 1 << 62, "thinking.budget_tokens")  # checked, not used (as ds4)
        mode = "none" if thinking["type"] == "disabled" else (mode if mode != "none" else "high")
    if data.get("think") is not None:
        mode = ("high" if mode == "none" else mode) if _bool(data, "think") else "none"
    return effective_think(mode, limits.ctx)


def _check_length(ids: list[int], limits: Limits, param: str) -> list[int]:
    if len(ids) >= limits.ctx - 1:  # ds4 keeps one slot free: such a prompt leaves nothing to generate
        raise RequestError(f"{param}: the prompt has {len(ids)} tokens and the context holds {limits.ctx}: nothing "
                           "is left to generate (at most ctx - prompt - 1 tokens); send a shorter prompt", param=param,
                           code="context_length_exceeded")
    return ids


# -- the three request kinds ------------------------------------------------------------------------------

def _rendered(tokenizer, messages: list[dict], mode: str, tools=(), replay=None) -> tuple[str, list[int]]:
    """The prompt ds4-server makes of ``messages`` in thinking ``mode`` ("none", "high" or "max") offering ``tools``:
    its text (what the worker's reuse matches) and its tokens. A reply's calls that ``replay``
    (:class:`.tools.ToolBlocks`) kept are written as the model wrote their block."""
    for m in messages:
        block = replay.text_of(m["calls"]) if replay is not None and m.get("calls") else None
        if block:
            m["block"] = block
    text = render_text(messages, think=mode, tools=tools)
    return text, tokenizer.encode_rendered(text)


def _check_role(message: dict, name: str, roles: tuple[str, ...]) -> None:
    if message.get("role") not in roles:
        raise RequestError(f"{name}.role must be one of {', '.join(roles)}, got {json.dumps(message.get('role'))}",
                           param=f"{name}.role", code="invalid_value")


def _messages(data: dict, roles: tuple[str, ...], anthropic: bool = False) -> list[dict]:
    """The conversation as :mod:`.prompt` renders it: each message's role, text, reasoning (an assistant turn's
    ``reasoning_content``, or Anthropic's thinking blocks; ds4-server reads both) and tool calls (OpenAI's
    ``tool_calls``, Anthropic's tool_use blocks); Anthropic's tool_result blocks are the user turn's text, each in
    its wrapper, as ds4-server makes them."""
    messages = data.get("messages")
    if messages is None:
        raise RequestError("messages is required", param="messages", code="missing_field")
    if not isinstance(messages, list) or not messages:
        raise _type_error("messages", "a non-empty list of messages", messages)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object with role and content", m)
        _check_role(m, f"messages[{i}]", roles)
        if m.get("function_call") is not None:
            raise RequestError(f"messages[{i}].function_call: the legacy functions API is not served; send "
                               "tool_calls", param=f"messages[{i}].function_call", code="unsupported_parameter")
        content, reasoning, calls = m.get("content"), m.get("reasoning_content"), ()
        if anthropic:
            content, reasoning, calls = _anthropic_content(content, f"messages[{i}].content")
        else:
            if reasoning is not None:
                reasoning = _text_content(reasoning, f"messages[{i}].reasoning_content")
            if m.get("tool_calls") is not None and m["role"] == "assistant":
                calls = _chat_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            if content is None and m["role"] == "assistant":  # a reply of calls only
                content = ""
        out.append({"role": m["role"], "content": _text_content(content, f"messages[{i}].content")})
        if reasoning:
            out[-1]["reasoning"] = reasoning
        if calls:
            out[-1]["calls"] = calls
    return out


def _anthropic_content(content, name: str) -> tuple:
    """Anthropic content read in order: its text (tool_result blocks' content in their wrapper), its thinking
    blocks' text (a redacted block has none) and its tool_use blocks' calls."""
    if not isinstance(content, list):
        return content, None, ()
    text, thinking, calls = [], [], []
    for i, part in enumerate(content):
        kind, at = part.get("type") if isinstance(part, dict) else None, f"{name}[{i}]"
        if kind == "thinking":
            if not isinstance(part.get("thinking"), str):
                raise _type_error(at, 'a thinking block {"type": "thinking", "thinking": "..."}', part)
            thinking.append(part["thinking"])
        elif kind == "tool_use":
            calls.append(_call(at, part.get("name"), part.get("input"), part.get("id"), "input"))
        elif kind == "tool_result":
            result = part.get("content")
            result = _text_content(result if result is not None else "", f"{at}.content")
            text.append(tool_result(result))
        elif kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind != "redacted_thinking":
            raise _type_error(at, "a text, thinking, tool_use or tool_result block", part)
    return "".join(text), "".join(thinking), tuple(calls)


def parse_chat(data: dict, limits: Limits, tokenizer, replay=None) -> Request:
    """``POST /v1/chat/completions``."""
    model = _model(data, limits)
    tools = _tools(data, "chat")
    messages = _messages(data, ("system", "developer", "user", "assistant", "tool"))
    _refuse_unsupported(data, _CHAT_UNSUPPORTED)
    mode = _think_mode(data, model, limits)
    text, ids = _rendered(tokenizer, messages, mode, tools, replay)
    return Request("chat", model, _check_length(ids, limits, "messages"), _max_tokens(data, limits),
                   _sampling(data, limits), stream=_bool(data, "stream"),
                   include_usage=_include_usage(data), stop=_stop(data, "stop"),
                   thinking=mode != "none", messages=messages, text=text, tools=tools,
                   parallel=_parallel(data, "chat"))


def parse_completion(data: dict, limits: Limits, tokenizer) -> Request:
    """``POST /v1/completions``. A text prompt to a chat model becomes a chat turn as ds4-server makes it
    (parse_completion_request: a fixed system message, the prompt as the user's turn, thinking as for chat
    requests); the reply is sent as one text, its reasoning and ``</think>`` included. Without a chat template the
    prompt is continued as plain text; token ids are continued as they are (ds4lab's: ds4-server reads text only)."""
    model = _model(data, limits)
    _refuse_unsupported(data, _COMPLETION_UNSUPPORTED)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    messages, mode, text = [], "none", ""
    if isinstance(prompt, str) and limits.chat_model:
        messages = [{"role": "system", "content": COMPLETION_SYSTEM}, {"role": "user", "content": prompt}]
        mode = _think_mode(data, model, limits)
        text, ids = _rendered(tokenizer, messages, mode)
    elif isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt[{bad}] is {prompt[bad]}: token ids are in [0, {tokenizer.vocab_size})",
                               param="prompt", code="out_of_range")
        ids = list(prompt)
    else:
        raise _type_error("prompt", "a string or a list of token ids", prompt)
    if not ids:  # (a chat turn never is: BOS and its markers)
        raise RequestError("prompt is empty", param="prompt", code="invalid_value")
    return Request("completion", model, _check_length(ids, limits, "prompt"), _max_tokens(data, limits),
                   _sampling(data, limits), stream=_bool(data, "stream"), include_usage=_include_usage(data),
                   stop=_stop(data, "stop"), thinking=mode != "none", messages=messages, text=text)


def _anthropic_system(value) -> str:
    """Anthropic's ``system`` as ds4-server reads it: a string or a list of strings and text blocks, each on a line
    of its own; empty parts and Claude Code's private ones ("x-anthropic-...", a billing header) left out."""
    if value is None:
        return ""
    if isinstance(value, str):
        parts, names = [value], ["system"]
    elif isinstance(value, list):
        parts, names = value, [f"system[{i}]" for i in range(len(value))]
    else:
        raise _type_error("system", "a string or a list of text blocks", value)
    out = ""
    for part, name in zip(parts, names):
        text = part.get("text", "") if isinstance(part, dict) else part
        if not isinstance(text, str):
            raise _type_error(name, 'a string or a text block {"type": "text", "text": "..."}', part)
        if text and not text.startswith("x-anthropic-"):
            out += ("\n" if out and not out.endswith("\n") else "") + text
    return out


def parse_messages(data: dict, limits: Limits, tokenizer, replay=None) -> Request:
    """``POST /v1/messages`` (Anthropic): ``max_tokens`` required, ``system`` apart from the messages."""
    model = _model(data, limits)
    tools = _tools(data, "messages")
    messages = _messages(data, ("user", "assistant"), anthropic=True)
    system = _anthropic_system(data.get("system"))
    messages = ([{"role": "system", "content": system}] if system else []) + messages
    mode = _think_mode(data, model, limits)
    text, ids = _rendered(tokenizer, messages, mode, tools, replay)
    return Request("messages", model, _check_length(ids, limits, "messages"),
                   _max_tokens(data, limits, ("max_tokens",), required=True),
                   _sampling(data, limits, temperature_max=1.0), stream=_bool(data, "stream"),
                   stop=_stop(data, "stop_sequences"), thinking=mode != "none", messages=messages, text=text,
                   tools=tools, parallel=_parallel(data, "messages"))


# OpenAI's Responses API (ds4-server's parse_responses_request): ``input`` a string or a list of items (messages, their
# content a string or text parts; reasoning items go with the next reply, which the prompt keeps only after the last
# user turn), ``instructions`` a system message first, ``reasoning.effort`` the thinking
# mode (none and minimal: none), ``reasoning.summary`` whether the reasoning comes back. No stored state: a request
# carries its whole conversation.
_RESPONSE_ROLES = ("system", "developer", "user", "assistant")
_RESPONSE_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")  # ds4-server's
_RESPONSES_UNSUPPORTED = {"top_logprobs": 0, "background": False, **_SAMPLER_UNSUPPORTED}


def _response_content(value, name: str) -> str:
    """An item's content: a string (null: none), or a list of text parts or strings (ds4-server's)."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise _type_error(name, "a string or a list of text parts", value)
    parts = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            parts.append(part)
            continue
        if isinstance(part, dict) and part.get("type") not in _RESPONSE_PARTS:  # a text type required, as there
            raise RequestError(f"{name}[{i}].type {json.dumps(part.get('type'))[:80]}: ds4lab serve reads text parts "
                               f"only ({', '.join(_RESPONSE_PARTS)})", param=f"{name}[{i}].type",
                               code="unsupported_parameter")
        if not (isinstance(part, dict) and isinstance(part.get("text"), str)):
            raise _type_error(f"{name}[{i}]", 'a text part {"type": "input_text", "text": "..."}', part)
        parts.append(part["text"])
    return "".join(parts)


def _response_input(data: dict) -> list[dict]:
    """The conversation of ``input`` as ds4-server reads it: message items; function_call items the calls of the
    assistant message before them (or of an empty one of their own), function_call_output items tool results;
    reasoning items (summary, then content) given to the next assistant message or call, or to an empty message of
    their own where another item or the end comes first; compaction items passed over; an item whose ``status`` is
    not completed refused (partial state)."""
    value = data.get("input")
    if value is None:
        raise RequestError("input is required", param="input", code="missing_field")
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _type_error("input", "a string or a non-empty list of items", value)
    out, reasoning = [], []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _type_error(f"input[{i}]", "an item object", item)
        status = item.get("status", "")
        if status not in ("", "completed"):  # null too: ds4-server reads a string
            raise RequestError(f"input[{i}].status {json.dumps(status)[:80]}: only completed items can be sent back "
                               "(ds4-server refuses partial ones)", param=f"input[{i}].status", code="invalid_value")
        kind = item.get("type", "message")
        if kind in ("compaction", "context_compaction"):
            continue
        if kind == "reasoning":
            texts = (_response_content(item.get(key), f"input[{i}].{key}") for key in ("summary", "content"))
            reasoning += [t for t in texts if t]
            continue
        if kind == "function_call":
            call = _call(f"input[{i}]", item.get("name"), item.get("arguments"), item.get("call_id"))
            if not (out and out[-1]["role"] == "assistant"):  # calls after a message's text belong to it
                out.append({"role": "assistant", "content": ""})
            if reasoning and not out[-1].get("reasoning"):
                out[-1]["reasoning"], reasoning = "\n".join(reasoning), []
            out[-1]["calls"] = out[-1].get("calls", ()) + (call,)
            continue
        if kind == "function_call_output":
            message = {"role": "tool", "content": _response_content(item.get("output"), f"input[{i}].output")}
        elif kind == "message":
            _check_role(item, f"input[{i}]", _RESPONSE_ROLES)
            message = {"role": item["role"], "content": _response_content(item.get("content"), f"input[{i}].content")}
        else:
            raise RequestError(f"input[{i}].type {json.dumps(kind)[:80]}: ds4lab serve takes message, reasoning, "
                               "function_call, function_call_output and compaction items", param=f"input[{i}].type",
                               code="unsupported_parameter")
        if reasoning:
            text, reasoning = "\n".join(reasoning), []
            if message["role"] == "assistant":
                message["reasoning"] = text
            else:
                out.append({"role": "assistant", "content": "", "reasoning": text})
        out.append(message)
    if reasoning:
        out.append({"role": "assistant", "content": "", "reasoning": "\n".join(reasoning)})
    if not out:
        raise RequestError("input holds no message", param="input", code="invalid_value")
    return out


def _response_reasoning(data: dict, model: str, limits: Limits) -> tuple[str, str | None, str | None]:
    """The thinking mode, ``reasoning.effort`` as asked and ``reasoning.summary`` (auto, concise or detailed: the
    reasoning is sent back; None: it is not)."""
    value = data.get("reasoning")
    if value is None:
        return _think_mode({}, model, limits), None, None
    if not isinstance(value, dict):
        raise _type_error("reasoning", 'an object {"effort": ..., "summary": ...}', value)
    effort = value.get("effort")
    try:
        mode = _think_mode({"reasoning_effort": "none" if effort == "minimal" else effort}, model, limits)
    except RequestError as e:
        raise RequestError(e.message.replace("reasoning_effort", "reasoning.effort"), param="reasoning.effort",
                           code=e.code) from None
    summary = value.get("summary")
    if summary not in (None, "auto", "concise", "detailed"):
        raise RequestError(f"reasoning.summary must be auto, concise or detailed, got {json.dumps(summary)[:80]}",
                           param="reasoning.summary", code="invalid_value")
    return mode, effort, summary


def parse_responses(data: dict, limits: Limits, tokenizer, replay=None) -> Request:
    """``POST /v1/responses`` (OpenAI's Responses API), without stored state: function tools, their calls and
    outputs sent back as input items."""
    model = _model(data, limits)
    tools = _tools(data, "responses")
    for key in ("previous_response_id", "conversation"):
        if data.get(key) is not None:
            raise RequestError(f"{key}: ds4lab serve keeps no responses; send the whole conversation in input",
                               param=key, code="unsupported_parameter")
    _refuse_unsupported(data, _RESPONSES_UNSUPPORTED)
    text = data.get("text")
    if text is not None and not isinstance(text, dict):
        raise _type_error("text", 'an object {"format": {"type": "text"}}', text)
    fmt = (text or {}).get("format")
    if fmt not in (None, {"type": "text"}):
        raise RequestError(f"text.format {json.dumps(fmt)[:80]}: ds4lab serve writes plain text only; send the "
                           "request without it", param="text.format", code="unsupported_parameter")
    messages = _response_input(data)
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _type_error("instructions", "a string", instructions)
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + messages
    mode, effort, summary = _response_reasoning(data, model, limits)
    text, ids = _rendered(tokenizer, messages, mode, tools, replay)
    return Request("responses", model, _check_length(ids, limits, "input"),
                   _max_tokens(data, limits, ("max_output_tokens", "max_tokens")), _sampling(data, limits),
                   stream=_bool(data, "stream"), thinking=mode != "none", messages=messages, text=text, effort=effort,
                   summary=summary if mode != "none" else None, tools=tools, parallel=_parallel(data, "responses"))
