"""The server's contract with OpenAI clients, on one server over the tiny model: the loop every client writes ends
cleanly, usage only when asked for, refusals as 4xx with OpenAI's error body (streamed ones before any event), what
specjax does not do refused by name, a sweep of bad requests and abrupt clients that leaves no traceback and a server
that still answers, and Prometheus metrics whose counters add up."""

import asyncio
import http.client
import json
import logging
import socket
import time
from urllib.parse import urlsplit

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from served_tiny import CONTEXT, MODEL, NAME, K, served_engine

from specjax.decoding.autoregressive import generate
from specjax.decoding.engine import Engine, Event
from specjax.serving import build_app, running_in_thread
from specjax.serving.metrics import WINDOW_S, ServerMetrics

PROMPT = "Once upon a time"  # greedy: no EOS in its first 250 tokens
USER = [{"role": "user", "content": "Name three rivers."}]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def server():
    """(base URL, engine, the server's log records at WARNING and above)."""
    engine = served_engine()
    log = Records()
    with running_in_thread(build_app(engine, MODEL.tokenizer, NAME)) as base:
        loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "asyncio", "starlette")]
        for logger in loggers:
            logger.addHandler(log)
        yield base, engine, log.records
        for logger in loggers:
            logger.removeHandler(log)


def api(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def call(base: str, method: str, path: str, body=None, headers=None) -> tuple[int, dict, bytes]:
    """(status, headers, body bytes); `body` a dict (sent as JSON) or bytes."""
    connection = http.client.HTTPConnection(urlsplit(base).netloc, timeout=60)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    result = response.status, dict(response.getheaders()), response.read()
    connection.close()
    return result


def assert_openai_error(status: int, raw: bytes, expected: int, needle: str = "") -> dict:
    error = json.loads(raw)["error"]
    assert status == expected and set(error) == {"message", "type", "param", "code"}, (status, raw)
    assert error["code"] == status and needle in error["message"], error
    return error


def greedy_ids(ids: list[int], n: int) -> list[int]:
    return generate(MODEL.weights, MODEL.cfg, [ids], max_new_tokens=n, eos_ids=MODEL.eos_ids).completions[0].output_ids


def scrape(base: str) -> dict[str, float]:
    """/metrics, parsed by prometheus_client, as {name{labels}: value}."""
    status, _, raw = call(base, "GET", "/metrics")
    assert status == 200
    return {
        s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(raw.decode())
        for s in family.samples
    }


def wait_idle(engine: Engine) -> None:
    deadline = time.time() + 60
    while (engine.busy or engine.queued) and time.time() < deadline:
        time.sleep(0.05)
    assert engine.busy == engine.queued == 0


def test_the_loop_every_client_writes_ends_cleanly_sync_async_and_legacy(server):
    base = server[0]
    client = api(base)
    expected = MODEL.tokenizer.decode(greedy_ids(MODEL.tokenizer.chat_prompt_ids(USER[0]["content"]), 8))
    text = ""
    for chunk in client.chat.completions.create(model=NAME, messages=USER, max_tokens=8, temperature=0, stream=True):
        text += chunk.choices[0].delta.content or ""
    assert text == expected

    async def async_loop() -> str:
        aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        out = ""
        async for chunk in await aclient.chat.completions.create(
            model=NAME, messages=USER, max_tokens=8, temperature=0, stream=True
        ):
            out += chunk.choices[0].delta.content or ""
        await aclient.close()
        return out

    assert asyncio.run(async_loop()) == expected
    legacy = ""
    for chunk in client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True):
        legacy += chunk.choices[0].text or ""
    ids = MODEL.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert legacy == MODEL.tokenizer.decode(greedy_ids(ids, 8))


@pytest.mark.parametrize("chat", [True, False])
def test_include_usage_gives_one_usage_chunk_last_before_done(server, chat):
    base = server[0]
    body = {"max_tokens": 6, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": USER} if chat else {"prompt": PROMPT})
    status, headers, raw = call(base, "POST", "/v1/chat/completions" if chat else "/v1/completions", body)
    events = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line]
    assert status == 200 and headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    with_usage = [c for c in chunks if c.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1]["choices"] == []
    ids = MODEL.tokenizer.chat_prompt_ids(USER[0]["content"]) if chat else MODEL.tokenizer.encode(PROMPT, True)
    completion = len(greedy_ids(ids, 6))
    assert chunks[-1]["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": completion,
        "total_tokens": len(ids) + completion,
    }
    assert all(c["choices"] for c in chunks[:-1])
    body["stream_options"] = {"include_usage": False}
    _, _, raw = call(base, "POST", "/v1/chat/completions" if chat else "/v1/completions", body)
    assert b'"usage"' not in raw and raw.endswith(b"data: [DONE]\n\n")


def test_a_streamed_request_that_is_refused_gets_a_400_before_any_event(server):
    base = server[0]
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**6, "stream": True}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 300, "stream": True}),
        ("/v1/completions", {"prompt": [MODEL.cfg.vocab_size], "stream": True}),
    ):
        status, headers, raw = call(base, "POST", path, body)
        assert headers["content-type"] == "application/json" and not raw.startswith(b"data:")
        assert_openai_error(
            status, raw, 400, "vocabulary" if body.get("prompt") == [MODEL.cfg.vocab_size] else "context"
        )
    with pytest.raises(openai.BadRequestError, match="context of 256 tokens"):
        api(base).completions.create(model=NAME, prompt=PROMPT, max_tokens=10**6, stream=True)
    status, _, raw = call(
        base, "POST", "/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}
    )
    assert assert_openai_error(status, raw, 400, "only allowed with 'stream': true")["param"] == "stream_options"


def test_content_as_text_parts_is_joined_and_other_parts_are_refused_by_type(server):
    base = server[0]
    client = api(base)
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "rivers."}]
    as_parts = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": parts}], max_tokens=6, temperature=0
    )
    joined = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Name three\nrivers."}], max_tokens=6, temperature=0
    )
    assert as_parts.choices[0].message.content == joined.choices[0].message.content
    assert as_parts.usage.prompt_tokens == joined.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    status, _, raw = call(base, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [image]}]})
    assert (
        assert_openai_error(status, raw, 400, 'type "image_url" are not supported')["param"] == "messages[0].content[0]"
    )


@pytest.mark.parametrize(
    "chat, name, value",
    [
        (True, "response_format", {"type": "json_object"}),
        (True, "presence_penalty", 0.5),
        (False, "frequency_penalty", -1),
        (True, "repetition_penalty", 1.2),
        (False, "min_tokens", 2),
        (True, "logprobs", True),
        (True, "top_logprobs", 2),
        (False, "logprobs", 0),
        (True, "n", 2),
        (False, "best_of", 3),
        (False, "echo", True),
        (True, "tools", [{"type": "function", "function": {"name": "f"}}]),
        (True, "temperature_schedule", 1),
    ],
)
def test_what_specjax_does_not_do_is_a_400_naming_the_parameter(server, chat, name, value):
    body = {"messages": USER} if chat else {"prompt": PROMPT}
    status, _, raw = call(
        server[0], "POST", "/v1/chat/completions" if chat else "/v1/completions", {**body, name: value}
    )
    assert assert_openai_error(status, raw, 400, f"'{name}'")["param"] == name


def test_neutral_values_of_what_specjax_does_not_do_are_accepted(server):
    neutral = dict(
        n=1,
        presence_penalty=0,
        frequency_penalty=0.0,
        logprobs=False,
        top_logprobs=0,
        response_format={"type": "text"},
        user="me",
    )
    extra = {"repetition_penalty": 1, "min_tokens": 0, "top_k": -1, "stop": []}
    reply = api(server[0]).chat.completions.create(
        model=NAME, messages=USER, max_tokens=3, temperature=0, extra_body=extra, **neutral
    )
    assert reply.usage.completion_tokens == 3


@pytest.mark.parametrize("stop", [5, True, {"a": 1}, ["a", "b", "c", "d", "e"], [""], ["x", 3]])
def test_a_stop_that_is_not_text_is_a_400(server, stop):
    status, _, raw = call(server[0], "POST", "/v1/completions", {"prompt": PROMPT, "stop": stop})
    assert assert_openai_error(status, raw, 400, "'stop' must be")["param"] == "stop"


def test_limits_model_and_top_k_as_vllm(server):
    base, engine, _ = server
    client = api(base)
    prompt_tokens = len(MODEL.tokenizer.encode(PROMPT, add_special_tokens=True))
    capped = client.chat.completions.create(
        model=NAME, messages=USER, max_tokens=3, temperature=0, extra_body={"max_completion_tokens": None}
    )
    assert capped.usage.completion_tokens == 3
    whole = client.completions.create(prompt=PROMPT, temperature=0, model=NAME)  # no max_tokens: the context's rest
    assert (whole.choices[0].finish_reason, whole.usage.completion_tokens) == ("length", CONTEXT - prompt_tokens)
    status, _, raw = call(base, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})  # no model: served
    assert status == 200 and json.loads(raw)["model"] == NAME
    status, _, raw = call(base, "POST", "/v1/completions", {"model": "gpt-9", "prompt": PROMPT})
    assert assert_openai_error(status, raw, 404, "does not exist")["type"] == "not_found_error"
    texts = {
        client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, seed=3, extra_body=extra).choices[0].text
        for extra in ({"top_k": -1}, {"top_k": 0}, {})
    }
    assert len(texts) == 1


def test_usage_with_a_stop_string_counts_the_tokens_up_to_the_one_that_completes_it(server):
    client = api(server[0])
    ids = MODEL.tokenizer.encode(PROMPT, add_special_tokens=True)
    out = greedy_ids(ids, 40)
    text = MODEL.tokenizer.decode(out)
    stop = text[20:24]
    count = next(n for n in range(1, 41) if stop in MODEL.tokenizer.decode(out[:n]))
    assert count < 40
    counts = set()
    for stream in (False, True, False):
        reply = client.completions.create(
            model=NAME,
            prompt=PROMPT,
            max_tokens=40,
            temperature=0,
            stop=stop,
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        if stream:
            chunks = list(reply)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == text[: text.index(stop)]
            counts.add(chunks[-1].usage.completion_tokens)
        else:
            assert reply.choices[0].text == text[: text.index(stop)] and reply.choices[0].finish_reason == "stop"
            counts.add(reply.usage.completion_tokens)
    assert counts == {count}


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/nothing", 404), ("DELETE", "/v1/completions", 405)])
def test_unknown_routes_and_methods_get_openai_errors(server, method, path, status):
    code, _, raw = call(server[0], method, path)
    assert_openai_error(code, raw, status, path)


BIG = 10**30
SWEEP = [
    *[
        (400, "POST", "/v1/completions", raw)
        for raw in (
            b"{not json",
            b"",
            b"\xff\xfe{}",
            b"[1, 2]",
            b"null",
            b'"text"',
            b"[" * 50000,
            b'{"prompt": "a"',
            b'{"prompt": "hi", "temperature": NaN}',
            b'{"prompt": "hi", "top_p": Infinity}',
        )
    ],
    *[
        (400, "POST", "/v1/completions", {"prompt": PROMPT, **fields})
        for fields in (
            {"prompt": 5},
            {"prompt": ""},
            {"prompt": []},
            {"prompt": ["a", "b"]},
            {"prompt": [1, "a"]},
            {"prompt": [True]},
            {"prompt": [10**9]},
            {"prompt": [-1]},
            {"prompt": {"a": 1}},
            {"prompt": "\ud800"},
            {"prompt": "word " * 400},
            {"max_tokens": "5"},
            {"max_tokens": 0},
            {"max_tokens": -1},
            {"max_tokens": 1.5},
            {"max_tokens": BIG},
            {"max_tokens": True},
            {"temperature": -0.1},
            {"temperature": 2.5},
            {"temperature": "hot"},
            {"top_p": 0},
            {"top_p": 1.5},
            {"top_k": -2},
            {"top_k": 2**40},
            {"top_k": 1.5},
            {"seed": -1},
            {"seed": 2**64},
            {"seed": "x"},
            {"stream": "yes"},
            {"stream": True, "stream_options": {"include_usage": "yes"}},
            {"stream": True, "stream_options": {"foo": 1}},
            {"stream": True, "stream_options": 5},
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            {"n": 0},
            {"suffix": "x"},
            {"logit_bias": {"1": 5}},
            {"max_completion_tokens": 5},
            {"ignore_eos": True},
            {"min_p": 0.1},
        )
    ],
    *[(404, "POST", "/v1/completions", {"prompt": PROMPT, "model": m}) for m in ("gpt-9", 5, "")],
    *[
        (400, "POST", "/v1/chat/completions", {"messages": USER, **fields})
        for fields in (
            {"messages": None},
            {"messages": []},
            {"messages": "hi"},
            {"messages": [5]},
            {"messages": [{"role": "wizard", "content": "hi"}]},
            {"messages": [{"role": "user"}]},
            {"messages": [{"role": "user", "content": 5}]},
            {"messages": [{"content": "hi"}]},
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            {"messages": [{"role": "user", "content": [5]}]},
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
            {"messages": [{"role": "user", "content": "hi", "name": 5}]},
            {"messages": [{"role": "user", "content": "\ud800"}]},
            {"max_completion_tokens": 0},
            {"max_tokens": 300, "stream": True},
            {"tool_choice": "auto"},
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            {"stop": ["x"] * 5},
            {"echo": True},
        )
    ],
    (405, "GET", "/v1/completions", None),
    (405, "PUT", "/v1/chat/completions", b"{}"),
    (405, "DELETE", "/v1/models", None),
    (405, "POST", "/health", b"{}"),
    (404, "GET", "/v2/completions", None),
    (404, "POST", "/v1/embeddings", {"input": "hi"}),
    (400, "POST", "/v1/completions", b'{"prompt": "caf\xe9"}'),  # Latin-1, not UTF-8
    (400, "POST", "/v1/completions", b"{bad", {"Content-Type": "text/plain"}),
    (400, "POST", "/v1/completions", b"", {"Content-Type": "application/x-www-form-urlencoded"}),
    (400, "POST", "/v1/completions", {"prompt": PROMPT, "top_p": 2}, {"Authorization": "Bearer nothing-to-check"}),
    (400, "POST", "/v1/chat/completions", {"messages": USER * 300}),  # past the context
    (400, "POST", "/v1/completions", {"prompt": list(range(300))}),
]


def abrupt_clients(base: str) -> None:
    """Clients that go away: after the headers, halfway through the body, right after a streamed request, right
    after a request that is not streamed."""
    host, port = urlsplit(base).netloc.split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 100, "temperature": 0}).encode()
    streamed = json.dumps({"prompt": PROMPT, "max_tokens": 100, "temperature": 0, "stream": True}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
    for data in (
        (head + "5000\r\n\r\n").encode(),
        (head + "5000\r\n\r\n").encode() + body[:20],
        (head + f"{len(streamed)}\r\n\r\n").encode() + streamed,
        (head + f"{len(body)}\r\n\r\n").encode() + body,
    ):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(data)
            time.sleep(0.2)


def test_a_sweep_of_bad_requests_and_abrupt_clients_leaves_no_traceback_and_a_server_that_answers(server):
    base, engine, records = server
    assert len(SWEEP) >= 60
    for status, method, path, body, *headers in SWEEP:
        code, headers, raw = call(base, method, path, body, *headers)
        assert code < 500 and headers["content-type"] == "application/json", (method, path, body, raw)
        assert_openai_error(code, raw, status)
    abrupt_clients(base)
    wait_idle(engine)
    assert call(base, "GET", "/health")[0] == 200
    assert api(base).completions.create(model=NAME, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    assert not [r.getMessage() for r in records if r.exc_info or r.levelno >= logging.ERROR]


def test_metrics_parse_and_add_up_after_requests(server):
    base, engine, _ = server
    client = api(base)
    wait_idle(engine)
    before = scrape(base)
    prompts, tokens, n = 0, 0, 6
    for i in range(n):
        reply = client.completions.create(model=NAME, prompt=f"{PROMPT} {i}", max_tokens=5 + 7 * i, temperature=0)
        prompts, tokens = prompts + reply.usage.prompt_tokens, tokens + reply.usage.completion_tokens
    call(base, "POST", "/v1/completions", {"prompt": PROMPT, "top_p": 7})
    after = scrape(base)
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    finished = sum(v for k, v in delta.items() if k.startswith("specjax:request_success_total"))
    assert finished == n and delta["specjax:request_refused_total{reason=invalid_request_error}"] == 1
    assert delta["specjax:prompt_tokens_total"] == prompts and delta["specjax:generation_tokens_total"] == tokens
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta[f"specjax:{histogram}_count"] == n
    accepted = delta["specjax:spec_decode_num_accepted_tokens_total"]
    per_pos = [delta[f"specjax:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(K)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert delta["specjax:spec_decode_num_draft_tokens_total"] == K * delta["specjax:spec_decode_num_drafts_total"]
    assert accepted <= delta["specjax:spec_decode_num_draft_tokens_total"]
    cut = n + delta["specjax:row_rounds_total"] + accepted - tokens  # each request's first token is its prefill's
    assert 0 <= cut <= K * n
    assert after["specjax:num_requests_running"] == after["specjax:num_requests_waiting"] == 0
    assert after["specjax:slots"] == 4 and after["specjax:compiled_programs"] == engine.compiled_programs


def test_the_metrics_memory_stays_flat_over_many_steps_without_a_scrape(server):
    engine = server[1]
    now = [0.0]
    metrics = ServerMetrics(engine, lambda: now[0])
    depth = int(engine.state.accepted_hist.shape[0]) - 1
    hist, menu = np.zeros(depth + 1, np.int64), np.zeros(1, np.int64)
    metrics.baseline((0, hist.copy(), menu.copy()))
    for step in range(1, 10_001):
        now[0] += 0.05
        hist[step % (depth + 1)] += 2  # two rows, one round: one accepts step % (depth + 1) drafts, so does the other
        menu[0] += 1
        made = [Event(1, [7] * (1 + step % (depth + 1))), Event(2, [7])]
        metrics.engine_step(made, (2 * step, hist.copy(), menu.copy()))
        assert len(metrics.throughput.seconds) <= WINDOW_S + 1
    values = {s.name: s.value for f in text_string_to_metric_families(metrics.text().decode()) for s in f.samples}
    assert values["specjax:row_rounds_total"] == 20_000 and values["specjax:spec_decode_num_drafts_total"] == 20_000
    assert values["specjax:spec_decode_num_accepted_tokens_total"] == int(hist @ np.arange(depth + 1))
    per_step = np.mean([2 + s % (depth + 1) for s in range(depth + 1)])  # 20 steps a second
    assert values["specjax:tokens_per_second"] == pytest.approx(20 * per_step, rel=0.05)
