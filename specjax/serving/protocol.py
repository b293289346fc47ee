"""The OpenAI API as specjax-serve speaks it, without HTTP: a request body checked and turned into a `Params` record,
the text a request streams (`TextStream`), and the bodies of responses, chunks and errors (`Reply`, `APIError`).

Where the OpenAI reference is silent the server does what vLLM's does; what specjax cannot do (`n` > 1, logprobs,
penalties, tools, images, structured output) is refused with a 400 that names the parameter, never ignored, and so
is any parameter this module does not know.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence

from specjax.config import SamplingConfig
from specjax.errors import InputError
from specjax.io.tokenizer import Tokenizer, check_text

MAX_STOP_STRINGS = 4  # as OpenAI's API (vLLM takes any number)
ROLES = ("system", "developer", "user", "assistant")
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "server_error", 503: "server_error"}

# Parameters specjax does not implement, each with the value that asks for nothing (also accepted: null).
NEUTRAL = {
    "n": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "min_tokens": 0,
    "min_p": 0,
    "logit_bias": {},
    "ignore_eos": False,
    "top_logprobs": 0,
    "response_format": {"type": "text"},
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
}
CHAT_NEUTRAL = {**NEUTRAL, "logprobs": False}
COMPLETION_NEUTRAL = {**NEUTRAL, "logprobs": None, "best_of": 1, "echo": False, "suffix": ""}
# Taken and without effect on the output: who asks, and OpenAI's bookkeeping.
INERT = ("user", "metadata", "service_tier", "store", "parallel_tool_calls")
COMMON = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
KNOWN = {
    True: {*COMMON, "messages", "max_completion_tokens", *CHAT_NEUTRAL, *INERT},
    False: {*COMMON, "prompt", *COMPLETION_NEUTRAL, *INERT},
}


class APIError(Exception):
    """A request the server refuses or could not finish: its message, HTTP status, the parameter at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param
        self.type = ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        """OpenAI's error body; `code` is the HTTP status, as vLLM gives it."""
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}


@dataclasses.dataclass(frozen=True)
class Params:
    """A checked request: what to decode and how."""

    chat: bool
    prompt: str | list[int] | list[dict]  # completions: text or token ids; chat: the messages (`messages_of`)
    max_tokens: int | None  # None: what the context leaves
    sampling: SamplingConfig
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # a last chunk with the usage (streams only)


def shown(value) -> str:
    """A JSON value as an error message quotes it (shortened)."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_a(value, kind: str) -> bool:
    """Whether `value` is a JSON `kind`: integer, number, boolean, string, object or array (a bool is no number)."""
    if isinstance(value, bool):
        return kind == "boolean"
    types = {"integer": int, "number": (int, float), "string": str, "object": dict, "array": list, "boolean": bool}
    return isinstance(value, types[kind])


def field(body: dict, name: str, kind: str, default, ok=None, want: str = ""):
    """body[name] (`default` when absent or null), a JSON `kind` for which `ok` holds; APIError naming it otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if not is_a(value, kind) or (ok is not None and not ok(value)):
        raise APIError(f"'{name}' must be {want or f'a {kind}'}, got {shown(value)}", param=name)
    return float(value) if kind == "number" else value


def body_of(raw: bytes) -> dict:
    """The JSON object of a request body."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def params_of(body: dict, chat: bool, model: str) -> Params:
    """The checked parameters of a completions (`chat` False) or chat completions body for the served `model`."""
    name = body.get("model")
    if name is not None and name != model:  # absent: the served model, as vLLM
        raise APIError(f"the model {shown(name)} does not exist; this server serves '{model}'", 404, "model")
    unknown = sorted(set(body) - KNOWN[chat])
    if unknown:
        raise APIError(f"unknown or unsupported parameter '{unknown[0]}'", param=unknown[0])
    for key, neutral in (CHAT_NEUTRAL if chat else COMPLETION_NEUTRAL).items():
        value = body.get(key)
        if value is not None and (
            neutral is None or value != neutral or isinstance(value, bool) != isinstance(neutral, bool)
        ):
            raise APIError(
                f"'{key}' = {shown(value)} is not supported by specjax-serve; leave it out or give {shown(neutral)}",
                param=key,
            )
    stream = field(body, "stream", "boolean", False)
    options = field(body, "stream_options", "object", None)
    if options is not None and not stream:
        raise APIError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    options = options or {}
    if set(options) - {"include_usage", "continuous_usage_stats"}:
        raise APIError(f"'stream_options' takes 'include_usage', got {shown(options)}", param="stream_options")
    if field(options, "continuous_usage_stats", "boolean", False):
        raise APIError("'stream_options.continuous_usage_stats' is not supported", param="stream_options")
    cap = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    temperature = field(body, "temperature", "number", 1.0, lambda t: 0 <= t <= 2, "a number in [0, 2]")
    return Params(
        chat=chat,
        prompt=messages_of(body.get("messages")) if chat else prompt_of(body.get("prompt")),
        max_tokens=field(body, cap, "integer", None, lambda n: n >= 1, "an integer >= 1"),
        sampling=SamplingConfig(
            temperature,
            max(0, field(body, "top_k", "integer", 0, lambda k: -1 <= k < 2**31, "-1, 0 (off) or a positive integer")),
            field(body, "top_p", "number", 1.0, lambda p: 0 < p <= 1, "a number in (0, 1]"),
        ),
        seed=field(body, "seed", "integer", None, lambda s: 0 <= s < 2**63, "an integer in 0..2**63-1"),
        stop=stop_of(body.get("stop")),
        stream=stream,
        include_usage=field(options, "include_usage", "boolean", False),
    )


def stop_of(stop) -> tuple[str, ...]:
    """`stop`: null, a string, or a list of at most MAX_STOP_STRINGS strings, none empty."""
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not (
        isinstance(stops, list) and len(stops) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in stops)
    ):
        raise APIError(
            f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings, got {shown(stop)}",
            param="stop",
        )
    return tuple(stops)


def prompt_of(prompt) -> str | list[int]:
    """A completion's prompt: a non-empty string or list of token ids, alone or as a list of one."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(is_a(t, "integer") for t in prompt):
        return prompt
    raise APIError(
        f"'prompt' must be a non-empty string or list of token ids (one prompt per request), got {shown(prompt)}",
        param="prompt",
    )


def messages_of(messages) -> list[dict]:
    """A chat's messages as {role, content, name} text; text parts are joined with newlines (as vLLM joins them)."""
    if not (isinstance(messages, list) and messages):
        raise APIError(f"'messages' must be a non-empty list of messages, got {shown(messages)}", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"'{where}' must be an object with 'role' and 'content', got {shown(m)}", param=where)
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise APIError(f"'{where}.{extra[0]}' is not supported", param=f"{where}.{extra[0]}")
        if m.get("role") not in ROLES:
            raise APIError(f"'{where}.role' must be one of {', '.join(ROLES)}, got {shown(m.get('role'))}", param=where)
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
        if not isinstance(content, str):
            raise APIError(
                f"'{where}.content' must be a string or a list of text parts, got {shown(content)}", param=where
            )
        if not isinstance(m.get("name", ""), str):
            raise APIError(f"'{where}.name' must be a string, got {shown(m['name'])}", param=where)
        out.append({**m, "content": content})  # the name goes to the chat template
    return out


def text_part(part, where: str) -> str:
    """The text of a content part {"type": "text", "text": ...}; other part types are refused by name."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind != "text":
        reason = f"content parts of type {shown(kind)} are not supported (text only)" if kind else "not a text part"
        raise APIError(f"'{where}': {reason}", param=where)
    if not isinstance(part.get("text"), str):
        raise APIError(f"'{where}.text' must be a string, got {shown(part.get('text'))}", param=where)
    return part["text"]


def prompt_ids(params: Params, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: the messages through the chat template, the text with the tokenizer's special tokens,
    token ids as given (the engine checks them against the vocabulary)."""
    try:
        if params.chat:
            messages = [{**m, "content": check_text(m["content"])} for m in params.prompt]
            return tokenizer.encode(tokenizer.apply_chat_template(messages))
        if isinstance(params.prompt, str):
            return tokenizer.encode(params.prompt, add_special_tokens=True)
    except InputError as e:
        raise APIError(str(e), param="messages" if params.chat else "prompt") from None
    return list(params.prompt)


class TextStream:
    """A request's text as tokens arrive: what may be shown (never half a character, never a prefix of a stop string)
    and whether a stop string ended it. A stop string ends the text at the first token that completes one, as tokens
    arrive one at a time: `ids` keep the tokens up to that one (the usage counts them), the text ends before it."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.shown = 0  # characters handed out
        self.stopped = False

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string in `text` begins."""
        return min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=None)

    def add(self, ids: Sequence[int], last: bool) -> str:
        """The new text to hand out after `ids`; all of it when `last` (or when a stop string ended it)."""
        before = len(self.ids)
        self.ids += ids
        text = self.tokenizer.decode(self.ids)
        if self.stop and self._stop_at(text) is not None:
            for n in range(before + 1, len(self.ids) + 1):  # the first token that completes a stop string
                text = self.tokenizer.decode(self.ids[:n])
                cut = self._stop_at(text)
                if cut is not None:
                    self.ids, text, self.stopped, last = self.ids[:n], text[:cut], True, True
                    break
        end = len(text)
        if not last:
            end -= text.endswith("\ufffd")
            end = max(self.shown, end - max((len(s) - 1 for s in self.stop), default=0))
        new, self.shown = text[self.shown : end], max(self.shown, end)
        return new


@dataclasses.dataclass(frozen=True)
class Reply:
    """The bodies of one request's answer: whole, or as server-sent events."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> Reply:
        """A new answer's: a fresh id, created now."""
        return cls(chat, model, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()))

    def _head(self, streaming: bool) -> dict:
        kind = ("chat.completion" + ".chunk" * streaming) if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, usage: dict) -> dict:
        """The body of an answer that is not streamed."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {**self._head(False), "choices": [choice], "usage": usage}

    def chunk(self, text: str, finish: str | None = None, role: bool = False) -> str:
        """A streamed event carrying new text (and the finish reason once finished; with the role, a chat's first)."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if role else {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return event({**self._head(True), "choices": [choice]})

    def usage_chunk(self, usage: dict) -> str:
        """The streamed event with the usage (`stream_options.include_usage`): no choices."""
        return event({**self._head(True), "choices": [], "usage": usage})


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def event(data: dict | str) -> str:
    """A server-sent event: `data: JSON` (or a bare string such as [DONE])."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
