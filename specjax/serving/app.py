"""The app: the engine thread and the routes over the refilling engine (`specjax.decoding.engine`).

One thread owns the engine: it takes new requests and cancellations from a queue, steps the engine a few rounds at a
time, and hands each request's new tokens to the request's handler on the event loop. A handler checks its request
(`protocol`) and waits for the engine to queue it before it answers, so a refused request gets a 4xx even when
streamed; then it turns tokens into text (held back while it could still become a stop string), streams it as
server-sent events or answers once, and cancels its request when the client goes away, which frees its slot. Routes:
`/v1/completions`, `/v1/chat/completions` (the checkpoint's chat template), `/v1/models`, `/health`, `/metrics`
(Prometheus text, `metrics`). Every error is OpenAI-shaped JSON; the engine thread survives any request. Across hosts
it sends its commands to the other processes before applying them (`hosts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import jax
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specjax.config import SamplingConfig
from specjax.decoding.engine import Engine, Event
from specjax.errors import InputError
from specjax.io.tokenizer import Tokenizer
from specjax.serving.hosts import IDLE_S, apply, exchange, first_line, stop_followers, submit_command
from specjax.serving.metrics import ServerMetrics, engine_counters
from specjax.serving.protocol import APIError, Params, Reply, TextStream, body_of, event, params_of, prompt_ids, usage

ROUNDS_PER_STEP = 4  # engine rounds between two looks at new requests and cancellations
DISCONNECT_POLL_S = 0.5  # how often an answer that is not streamed checks that its client is still there


@dataclasses.dataclass(eq=False)
class Job:
    """A request between its handler and the engine thread."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int | None
    loop: asyncio.AbstractEventLoop
    queued: asyncio.Future = dataclasses.field(init=False)  # done once the engine queued it; raises its refusal
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)  # Event, or the APIError that ended it
    id: int | None = None  # the engine's, once submitted

    def __post_init__(self):
        self.queued = self.loop.create_future()


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    """Ends a job's wait for the engine (on the event loop): queued, or refused with `error`."""
    if future.done():  # its handler has gone
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class EngineThread:
    """Runs the engine on its own thread; `submit` and `cancel` may be called from anywhere.

    Each pass turns the commands waiting in the inbox into the engine's (`hosts.apply`), adds a step while there is
    work, hands them to the followers of a multi-host run (`hosts.exchange`) and applies them. With followers, a
    failure of a collective or of a step is fatal (a peer is gone): every request gets a 503, later ones too, and
    `on_failure` is called; with one process, a failed step ends the requests in the engine with a 500 and the engine
    goes on.
    """

    def __init__(self, engine: Engine, metrics: ServerMetrics, on_failure: Callable[[], None] = lambda: None):
        self.engine, self.metrics, self.on_failure = engine, metrics, on_failure
        self.hosts = jax.process_count()
        self.failure: str | None = None  # why a multi-host server stopped
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders `submit` against a failure's refusal of what waits
        self._jobs: dict[int, Job] = {}
        metrics.baseline(engine_counters(engine))
        self._thread = threading.Thread(target=self._run, name="specjax-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.failure is None:
                self._inbox.put(("submit", job))
                return
        job.loop.call_soon_threadsafe(_settle, job.queued, APIError(self.failure, 503))

    def cancel(self, job: Job) -> None:
        self._inbox.put(("cancel", job))

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join()

    def _deliver(self, job: Job, item: Event | Exception) -> None:
        job.loop.call_soon_threadsafe(job.events.put_nowait, item)

    def _gather(self) -> tuple[list[list], list[Job | None]] | None:
        """The inbox's commands as the engine takes them, with the job of each submit (None for the others); None to
        stop. While the engine has nothing to do it waits for the first, with followers at most IDLE_S seconds (then
        the followers get no command, which tells them that process 0 is still there)."""
        commands, jobs = [], []
        wait = not (self.engine.busy or self.engine.queued)
        while True:
            try:
                kind, job = self._inbox.get(block=wait, timeout=IDLE_S if self.hosts > 1 else None)
            except queue.Empty:
                return commands, jobs
            wait = False
            if kind == "stop":
                return None
            if kind == "submit":
                commands.append(submit_command(job.prompt, job.max_tokens, job.sampling, job.seed))
                jobs.append(job)
            elif job in jobs:  # gone before the engine saw it
                i = jobs.index(job)
                del commands[i], jobs[i]
            elif job.id in self._jobs:
                commands.append(["cancel", job.id])
                jobs.append(None)
                del self._jobs[job.id]

    def _run(self) -> None:
        while (gathered := self._gather()) is not None:
            commands, jobs = gathered
            if commands or self.engine.busy or self.engine.queued:
                commands.append(["step", ROUNDS_PER_STEP])
                jobs.append(None)
            elif self.hosts == 1:
                continue
            try:
                for command, job in zip(exchange(commands), jobs):
                    self._apply(command, job)
            except Exception as e:  # the engine's failure ends the requests in it, not a one-process server
                if self.hosts > 1:
                    self._fail(e, jobs)
                    return
                for job in self._jobs.values():
                    self._deliver(job, APIError(f"decoding failed: {e}", 500))
                self._jobs.clear()
                self.engine.reset()
                self.metrics.baseline(engine_counters(self.engine))
        if self.hosts > 1:
            stop_followers()

    def _apply(self, command: list, job: Job | None) -> None:
        """Applies a command to the engine and hands its outcome to the job or jobs it concerns."""
        try:
            outcome = apply(self.engine, command)
        except InputError as e:
            if job is None:
                raise
            job.loop.call_soon_threadsafe(_settle, job.queued, APIError(str(e)))
            return
        if job is not None:
            job.id = outcome
            self._jobs[job.id] = job
            job.loop.call_soon_threadsafe(_settle, job.queued, None)
        elif command[0] == "step":
            self.metrics.engine_step(outcome, engine_counters(self.engine))
            for step_event in outcome:
                job = self._jobs.get(step_event.request)
                if job is None:
                    continue
                self._deliver(job, step_event)
                if step_event.completion is not None:
                    del self._jobs[step_event.request]

    def _fail(self, error: Exception, jobs: list[Job | None]) -> None:
        """Ends every request, waiting or in the engine, and every later one with a 503, then calls `on_failure`."""
        with self._lock:
            self.failure = f"a process of this multi-host server failed, so it stops: {first_line(error)}"
            waiting = []
            while not self._inbox.empty():
                waiting.append(self._inbox.get())
        refusal = APIError(self.failure, 503)
        for job in [job for kind, job in waiting if kind == "submit"] + [job for job in jobs if job is not None]:
            job.loop.call_soon_threadsafe(_settle, job.queued, refusal)
        for job in self._jobs.values():
            self._deliver(job, refusal)
        self._jobs.clear()
        self.on_failure()


@dataclasses.dataclass
class Server:
    """What the handlers share (the app's `state.server`)."""

    worker: EngineThread
    tokenizer: Tokenizer
    model: str
    metrics: ServerMetrics
    default_max_tokens: int | None
    created: int


class Generation:
    """One request in the engine: its text as it comes, and its metrics once it ends."""

    def __init__(self, server: Server, params: Params, ids: list[int], start: float):
        self.server, self.params, self.prompt_tokens = server, params, len(ids)
        context = server.worker.engine.num_slots
        max_tokens = params.max_tokens or server.default_max_tokens or max(context - len(ids), 1)  # as vLLM
        loop = asyncio.get_running_loop()
        self.job = Job(ids, max_tokens, params.sampling, params.seed, loop)
        self.text = TextStream(server.tokenizer, params.stop)
        self.start, self.first = start, None  # when the request came, its first token came (metrics' clock)
        self.queued = False  # the engine took it
        self.closed = False
        self.finish: str | None = None

    async def queue(self) -> None:
        """Submits the request; raises the engine's refusal (an APIError) before anything is sent."""
        self.server.worker.submit(self.job)
        try:
            await self.job.queued
        except BaseException:
            self.close()
            raise
        self.queued = True

    async def parts(self) -> AsyncIterator[str]:
        """The new text of each engine step; `finish` is set before the last."""
        while self.finish is None:
            item = await self.job.events.get()
            if isinstance(item, Exception):
                self.finish = "error"
                raise item
            self.first = self.first or self.server.metrics.clock()
            new = self.text.add(item.new_ids, item.completion is not None)
            if self.text.stopped:
                self.finish = "stop"
            elif item.completion is not None:
                self.finish = item.completion.finish_reason
            yield new

    def usage(self) -> dict:
        return usage(self.prompt_tokens, len(self.text.ids))

    def close(self) -> None:
        """Frees the slot if the request still holds one and counts the request, aborted if it had not finished (once;
        later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        self.server.worker.cancel(self.job)
        if self.queued:
            reason = self.finish or "abort"
            self.server.metrics.finished(reason, self.prompt_tokens, len(self.text.ids), self.start, self.first)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def _generate(request: Request, chat: bool) -> Response:
    server: Server = request.app.state.server
    start = server.metrics.clock()
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise APIError("the client went away while sending its request", 499) from None
    params = params_of(body_of(raw), chat, server.model)
    generation = Generation(server, params, prompt_ids(params, server.tokenizer), start)
    await generation.queue()
    reply = Reply.new(chat, server.model)
    if params.stream:
        # The task closes it too where the client went away before the stream began (and the events never ran).
        closing = BackgroundTask(generation.close)
        return StreamingResponse(_events(generation, reply), media_type="text/event-stream", background=closing)
    try:
        text = await _whole_text(request, generation)
    finally:
        generation.close()
    if text is None:
        return Response(status_code=499)  # the client went away
    return JSONResponse(reply.whole(text, generation.finish, generation.usage()))


async def _whole_text(request: Request, generation: Generation) -> str | None:
    """The request's whole text, or None once its client has gone."""
    parts, stream = [], generation.parts()
    while generation.finish is None:
        next_part = asyncio.ensure_future(anext(stream))
        while not next_part.done():
            await asyncio.wait({next_part}, timeout=DISCONNECT_POLL_S)
            if not next_part.done() and await request.is_disconnected():
                next_part.cancel()
                return None
        parts.append(next_part.result())
    return "".join(parts)


async def _events(generation: Generation, reply: Reply) -> AsyncIterator[str]:
    """The server-sent events of a streamed request; an error after the first is an error event, then [DONE]."""
    try:
        if reply.chat:
            yield reply.chunk("", role=True)
        async for new in generation.parts():
            if new or generation.finish:
                yield reply.chunk(new, generation.finish)
        if generation.params.include_usage:
            yield reply.usage_chunk(generation.usage())
    except APIError as e:
        yield event(e.body())
    finally:
        generation.close()  # the client went away, or it ended
    yield event("[DONE]")


async def models(request: Request) -> Response:
    server: Server = request.app.state.server
    card = {"id": server.model, "object": "model", "created": server.created, "owned_by": "specjax"}
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(request.app.state.server.metrics.text(), media_type=CONTENT_TYPE_LATEST)


def _refused(request: Request, error: APIError) -> Response:
    request.app.state.server.metrics.refused.labels(error.type).inc()
    return JSONResponse(error.body(), status_code=error.status)


async def _http_error(request: Request, e: HTTPException) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take) as OpenAI errors."""
    return _refused(request, APIError(f"{request.method} {request.url.path}: {e.detail}", e.status_code))


class RequireKey:
    """ASGI middleware: every /v1 route wants `Authorization: Bearer <key>`; /health and /metrics stay open."""

    def __init__(self, app, key: str):
        self.app, self.key = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.key):
                error = APIError("a valid API key is needed: send the header 'Authorization: Bearer <key>'", 401)
                await _refused(Request(scope, receive), error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    default_max_tokens: int | None = None,
    api_key: str | None = None,
    on_failure: Callable[[], None] = lambda: None,
) -> Starlette:
    """The ASGI app serving `engine` (made with sampled=True) under the model id `model_name`.

    Args:
      engine: the engine; the app's thread steps it from now on.
      tokenizer: the model's tokenizer (and chat template).
      model_name: the id clients name (a request that names none gets it).
      default_max_tokens: a request's max_tokens when it gives none; None: what the context leaves, as vLLM.
      api_key: when given, the /v1 routes want `Authorization: Bearer <api_key>`.
      on_failure: called (from the engine thread) when a multi-host server stops because a process failed; the
        worker's `failure` says why.
    Returns:
      The Starlette app.
    """
    server_metrics = ServerMetrics(engine, time.monotonic)
    worker = EngineThread(engine, server_metrics, on_failure)

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
        middleware=[Middleware(RequireKey, key=api_key)] if api_key else [],
        exception_handlers={APIError: _refused, HTTPException: _http_error},
        lifespan=lifespan,
    )
    app.state.server = Server(worker, tokenizer, model_name, server_metrics, default_max_tokens, int(time.time()))
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
