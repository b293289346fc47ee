"""An OpenAI-compatible HTTP server over the refilling engine (`specjax.decoding.engine`).

One thread owns the engine: it takes new requests and cancellations from a queue, steps the engine a few rounds at a
time, and hands each request's new tokens to the request's handler on the event loop. Handlers turn tokens into text
(held back while it could still become a stop string), stream it as server-sent events or answer once, and cancel
their request when the client goes away, which frees its slot. Routes: `/v1/completions`, `/v1/chat/completions`
(the checkpoint's chat template), `/v1/models`, `/health`, `/metrics` (Prometheus text). A bad request gets an
OpenAI-shaped error and a 4xx; the engine thread survives any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import queue
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from specjax.config import SamplingConfig
from specjax.decoding.engine import Engine, Event
from specjax.decoding.stats import acceptance
from specjax.errors import InputError
from specjax.io.tokenizer import Tokenizer, check_text

ROUNDS_PER_STEP = 4  # engine rounds between two looks at new requests and cancellations
MAX_STOP_STRINGS = 4


class BadRequest(Exception):
    """A request the server refuses: its HTTP status, message, OpenAI error type and the parameter at fault."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_response(e: BadRequest) -> JSONResponse:
    body = {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": None}}
    return JSONResponse(body, status_code=e.status)


@dataclasses.dataclass
class Job:
    """A request between its handler and the engine thread."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int | None
    events: asyncio.Queue  # Event, or an Exception that ended it
    loop: asyncio.AbstractEventLoop
    id: int | None = None  # the engine's, once submitted


class EngineThread:
    """Runs the engine on its own thread; `submit` and `cancel` may be called from anywhere."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[int, Job] = {}
        self.tokens = 0  # generated, over the server's life
        self.mean_accepted = 0.0  # tokens per row-round, over the server's life
        self.accepted_hist = np.zeros((1,), np.int64)  # row-rounds that accepted 0..D drafts, over the server's life
        self.recent: list[tuple[float, int]] = []  # (time, tokens) of the last minute's steps
        self.requests = 0
        self._thread = threading.Thread(target=self._run, name="specjax-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self._inbox.put(("cancel", job))

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join()

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        self.recent = [(t, n) for t, n in self.recent if now - t < 60]
        if len(self.recent) < 2:
            return 0.0
        return sum(n for _, n in self.recent[1:]) / max(now - self.recent[0][0], 1e-9)

    def _deliver(self, job: Job, item: Event | Exception) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, item)

    def _take(self, command: str, job: Job | None) -> bool:
        """Applies one inbox command; False to stop."""
        if command == "stop":
            return False
        if command == "submit":
            try:
                job.id = self.engine.submit(job.prompt, job.max_tokens, job.sampling, job.seed)
            except InputError as e:
                self._deliver(job, BadRequest(str(e)))
                return True
            self._jobs[job.id] = job
            self.requests += 1
        elif job.id in self._jobs:
            self.engine.cancel(job.id)
            del self._jobs[job.id]
        return True

    def _run(self) -> None:
        while True:
            block = not (self.engine.busy or self.engine.queued)  # wait for work when there is none
            try:
                while True:  # every command that is waiting, then a step
                    command, job = self._inbox.get(block=block)
                    block = False
                    if not self._take(command, job):
                        return
            except queue.Empty:
                pass
            if not (self.engine.busy or self.engine.queued):
                continue
            try:
                events = self.engine.step(ROUNDS_PER_STEP)
            except Exception as e:  # the engine's failure ends the requests in it, not the server
                for job in self._jobs.values():
                    self._deliver(job, BadRequest(f"decoding failed: {e}", 500, "server_error"))
                self._jobs.clear()
                self.engine.reset()
                continue
            made = sum(len(e.new_ids) for e in events)
            self.tokens += made
            self.recent.append((time.monotonic(), made))
            self.accepted_hist = np.asarray(self.engine.state.accepted_hist)
            self.mean_accepted, _ = acceptance(self.accepted_hist)
            for event in events:
                job = self._jobs.get(event.request)
                if job is None:
                    continue
                self._deliver(job, event)
                if event.completion is not None:
                    del self._jobs[event.request]


def _field(body: dict, name: str, kind, default, check=None, why: str = ""):
    """body[name] (or `default`) of type `kind`, passing `check`; BadRequest otherwise."""
    value = body.get(name, default)
    if value is None:
        return default
    ok_type = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok_type = float(value), True
    if not ok_type or (check is not None and not check(value)):
        raise BadRequest(f"'{name}' must be {why or kind.__name__}, got {json.dumps(value)[:80]}", param=name)
    return value


@dataclasses.dataclass(frozen=True)
class Params:
    max_tokens: int
    sampling: SamplingConfig
    seed: int | None
    stop: tuple[str, ...]
    stream: bool


def params_of(body: dict, default_max_tokens: int) -> Params:
    """The generation parameters of an OpenAI request body."""
    if _field(body, "n", int, 1, lambda n: n == 1, "1 (one choice per request)") != 1:
        raise BadRequest("'n' must be 1", param="n")
    for unsupported in ("logprobs", "echo", "best_of", "logit_bias", "tools", "functions"):
        if body.get(unsupported) not in (None, False, 1 if unsupported == "best_of" else None):
            raise BadRequest(f"'{unsupported}' is not supported", param=unsupported)
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _field({name: cap}, name, int, default_max_tokens, lambda n: n >= 1, "an integer >= 1")
    temperature = _field(body, "temperature", float, 1.0, lambda t: 0 <= t <= 2 and math.isfinite(t), "in [0, 2]")
    top_p = _field(body, "top_p", float, 1.0, lambda p: 0 < p <= 1, "in (0, 1]")
    top_k = _field(body, "top_k", int, 0, lambda k: 0 <= k < 2**31, "an integer >= 0")
    seed = _field(body, "seed", int, None, lambda s: 0 <= s < 2**63, "an integer in 0..2**63-1")
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"'stop' must be a string or up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    stream = _field(body, "stream", bool, False)
    return Params(max_tokens, SamplingConfig(temperature, top_k, top_p), seed, stop, stream)


class TextStream:
    """A request's text as tokens arrive: what may be shown (never half a character, never a prefix of a stop string)
    and whether a stop string ended it."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.shown = 0  # characters handed out
        self.stopped = False

    def add(self, ids: Sequence[int], last: bool) -> str:
        """The new text to hand out after `ids`; all of it when `last`."""
        self.ids += ids
        text = self.tokenizer.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            text, self.stopped, last = text[: min(hits)], True, True
        end = len(text)
        if not last:
            if text.endswith("\ufffd"):
                end -= 1
            held = max((len(s) - 1 for s in self.stop), default=0)
            end = max(self.shown, end - held)
        new, self.shown = text[self.shown : end], max(self.shown, end)
        return new


def build_app(engine: Engine, tokenizer: Tokenizer, model_name: str, default_max_tokens: int = 256) -> Starlette:
    """The ASGI app serving `engine` (made with sampled=True) under the model id `model_name`."""
    worker = EngineThread(engine)
    created = int(time.time())

    def check_model(body: dict) -> None:
        name = body.get("model")
        if name != model_name:
            raise BadRequest(
                f"the model '{name}' does not exist; this server serves '{model_name}'", 404, "not_found_error", "model"
            )

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        check_model(body)
        return body

    def prompt_ids(body: dict, chat: bool) -> list[int]:
        try:
            if chat:
                messages = body.get("messages")
                if (
                    not isinstance(messages, list)
                    or not messages
                    or not all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in messages
                    )
                ):
                    raise BadRequest("'messages' must be a non-empty list of {role, content} strings", param="messages")
                text = tokenizer.apply_chat_template(
                    [{"role": m["role"], "content": check_text(m["content"])} for m in messages]
                )
                return tokenizer.encode(text)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                return list(prompt)
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest("'prompt' must be a non-empty string (or a list of token ids)", param="prompt")
            return tokenizer.encode(check_text(prompt), add_special_tokens=True)
        except InputError as e:
            raise BadRequest(str(e), param="messages" if chat else "prompt") from None

    async def respond(request: Request, chat: bool) -> Response:
        try:
            body = await body_of(request)
            params = params_of(body, default_max_tokens)
            ids = prompt_ids(body, chat)
        except BadRequest as e:
            return error_response(e)
        job = Job(ids, params.max_tokens, params.sampling, params.seed, asyncio.Queue(), asyncio.get_running_loop())
        worker.submit(job)
        kind = "chatcmpl" if chat else "cmpl"
        rid = f"{kind}-{uuid.uuid4().hex[:24]}"
        text = TextStream(tokenizer, params.stop)

        async def events() -> AsyncIterator[tuple[str, str | None]]:
            """(new text, finish reason once finished)."""
            count = 0
            while True:
                item = await job.events.get()
                if isinstance(item, Exception):
                    raise item
                count += len(item.new_ids)
                new = text.add(item.new_ids, item.completion is not None)
                if text.stopped:
                    worker.cancel(job)
                    yield new, "stop"
                    return
                if item.completion is not None:
                    yield new, item.completion.finish_reason
                    return
                yield new, None

        def usage() -> dict:
            n = len(text.ids)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        def choice(new: str, finish: str | None, streaming: bool) -> dict:
            if not chat:
                return {"index": 0, "text": new, "finish_reason": finish, "logprobs": None}
            if streaming:
                return {"index": 0, "delta": {"content": new} if new else {}, "finish_reason": finish}
            return {"index": 0, "message": {"role": "assistant", "content": new}, "finish_reason": finish}

        obj = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and params.stream else "")
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name}

        if params.stream:

            async def sse() -> AsyncIterator[str]:
                try:
                    if chat:
                        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        yield f"data: {json.dumps({**head, 'choices': [first]})}\n\n"
                    async for new, finish in events():
                        if new or finish:
                            yield f"data: {json.dumps({**head, 'choices': [choice(new, finish, True)]})}\n\n"
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage()})}\n\n"
                    yield "data: [DONE]\n\n"
                except BadRequest as e:
                    yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind}})}\n\n"
                finally:
                    worker.cancel(job)  # the client went away, or it ended: frees the slot if it still holds one

            return StreamingResponse(sse(), media_type="text/event-stream")

        parts, finish = [], None
        try:
            stream = events()
            while finish is None:
                next_part = asyncio.ensure_future(stream.__anext__())
                while not next_part.done():
                    await asyncio.wait({next_part}, timeout=0.5)
                    if not next_part.done() and await request.is_disconnected():
                        next_part.cancel()
                        worker.cancel(job)
                        return Response(status_code=499)
                new, finish = next_part.result()
                parts.append(new)
        except BadRequest as e:
            return error_response(e)
        return JSONResponse({**head, "choices": [choice("".join(parts), finish, False)], "usage": usage()})

    async def completions(request: Request) -> Response:
        return await respond(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await respond(request, chat=True)

    async def models(request: Request) -> Response:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "specjax"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        lines = [
            ("specjax_requests_total", "requests accepted", worker.requests),
            ("specjax_generated_tokens_total", "tokens generated", worker.tokens),
            ("specjax_tokens_per_second", "tokens generated per second over the last minute", worker.tokens_per_s()),
            ("specjax_mean_accepted_length", "tokens per round and row, over the server's life", worker.mean_accepted),
            ("specjax_queue_depth", "requests waiting for a slot", engine.queued),
            ("specjax_busy_slots", "slots holding a request", engine.busy),
            ("specjax_slots", "slots", engine.slots),
            (
                "specjax_compiled_programs",
                "programs the engine compiled (at start: every bucket's)",
                engine.compiled_programs,
            ),
        ]
        text = "".join(f"# HELP {n} {h}\n# TYPE {n} gauge\n{n} {v}\n" for n, h, v in lines)
        hist = worker.accepted_hist
        text += "# HELP specjax_row_rounds_total rounds of each running row\n# TYPE specjax_row_rounds_total counter\n"
        text += f"specjax_row_rounds_total {int(hist.sum())}\n"
        name = "specjax_accepted_drafts_per_pos_total"
        text += f"# HELP {name} row-rounds that accepted the draft at each position\n# TYPE {name} counter\n"
        text += "".join(f'{name}{{position="{i}"}} {int(hist[i + 1 :].sum())}\n' for i in range(len(hist) - 1))
        return PlainTextResponse(text)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        worker.stop()

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
            Route("/metrics", metrics),
        ],
        lifespan=lifespan,
    )
    app.state.worker = worker
    return app


@contextlib.contextmanager
def running_in_thread(app: Starlette) -> Iterator[str]:
    """Serves `app` from a thread of this process on 127.0.0.1, on a free port, until the block ends; yields its base
    URL (for tests and load tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
