"""specjax-serve's app, started by the test on 127.0.0.1 and called with the official `openai` client: completions and
chat, streamed and not, greedy text equal to plain decoding, stop strings, 16 concurrent clients, a client gone
mid-stream, malformed and out-of-range requests; afterwards the server still answers and every slot is free."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from served_tiny import MODEL, NAME, served_engine

from specjax.decoding.autoregressive import generate
from specjax.serving import build_app, running_in_thread


@pytest.fixture(scope="module")
def server():
    engine = served_engine()
    with running_in_thread(build_app(engine, MODEL.tokenizer, NAME)) as base:
        yield base, engine


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def greedy_text(ids: list[int], n: int) -> str:
    out = generate(MODEL.weights, MODEL.cfg, [ids], max_new_tokens=n, eos_ids=MODEL.eos_ids).completions[0]
    return MODEL.tokenizer.decode(out.output_ids)


def post(base: str, path: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completions_and_chat_streamed_or_not_give_plain_greedy_text(server):
    base, engine = server
    api = client(base)
    assert [m.id for m in api.models.list().data] == [NAME]
    prompt = "def add(a, b):"
    expected = greedy_text(MODEL.tokenizer.encode(prompt, add_special_tokens=True), 12)
    done = api.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == expected and done.usage.completion_tokens <= 12
    streamed = api.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected

    messages = [{"role": "user", "content": "Name three rivers."}]
    expected = greedy_text(MODEL.tokenizer.chat_prompt_ids("Name three rivers."), 10)
    chat = api.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    chunks = api.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected

    stop = expected[3:6]  # a stop string inside the greedy text: the text ends before it
    cut = api.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == expected[: expected.index(stop)]
    assert cut.choices[0].finish_reason == "stop"

    seeded = [api.completions.create(model=NAME, prompt=prompt, max_tokens=8, seed=7).choices[0].text for _ in "ab"]
    assert seeded[0] == seeded[1]  # temperature 1 by default; one seed, one text


def test_sixteen_concurrent_clients_and_one_gone_mid_stream_leave_every_slot_free(server):
    base, engine = server
    api = client(base)

    def ask(i: int) -> str:
        reply = api.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=6 + i % 5, seed=i
        )
        return reply.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        assert set(pool.map(ask, range(16))) <= {"stop", "length"}

    def metrics() -> dict[str, float]:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
            families = text_string_to_metric_families(response.read().decode())
        samples = [s for family in families for s in family.samples]
        return {"finished": sum(s.value for s in samples if s.name == "specjax:request_success_total")} | {
            s.name: s.value for s in samples if not s.labels
        }

    before = metrics()
    assert before["finished"] >= 16 and before["specjax:generation_tokens_total"] >= 16
    prompt = "Once upon a time"
    whole = generate(
        MODEL.weights,
        MODEL.cfg,
        [MODEL.tokenizer.encode(prompt, add_special_tokens=True)],
        max_new_tokens=200,
        eos_ids=MODEL.eos_ids,
    ).completions[0]
    assert len(whole.output_ids) == 200  # no EOS: only a cancellation ends it early
    long = api.completions.create(model=NAME, prompt=prompt, max_tokens=200, stream=True, temperature=0)
    next(iter(long))  # the first chunk, then the client goes away
    long.response.close()
    deadline = time.time() + 60
    while (engine.busy or engine.queued) and time.time() < deadline:
        time.sleep(0.1)
    after = metrics()
    assert engine.busy == 0 and engine.queued == 0
    assert after["specjax:num_requests_running"] == after["specjax:num_requests_waiting"] == 0
    assert after["specjax:generation_tokens_total"] - before["specjax:generation_tokens_total"] < 200


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "a JSON object"),
        (json.dumps({"model": "gpt-9", "prompt": "Hi"}).encode(), 404, "does not exist"),
        (json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": -5}).encode(), 400, "max_tokens"),
        (json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 10**12}).encode(), 400, "context of 256 tokens"),
        (json.dumps({"model": NAME, "prompt": "word " * 400, "max_tokens": 4}).encode(), 400, "context of 256"),
        (json.dumps({"model": NAME, "prompt": "Hi", "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"model": NAME, "prompt": "Hi", "n": 3}).encode(), 400, "'n' = 3 is not supported"),
        (json.dumps({"model": NAME, "prompt": ""}).encode(), 400, "prompt"),
    ],
)
def test_bad_requests_get_an_openai_error_and_the_server_goes_on(server, body, status, needle):
    base, engine = server
    code, reply = post(base, "/v1/completions", body)
    assert code == status and needle in reply["error"]["message"], reply
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    with urllib.request.urlopen(base + "/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}
    assert engine.busy == 0


def test_the_openai_client_raises_its_own_errors(server):
    api = client(server[0])
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-9", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context of 256 tokens"):
        api.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x " * 300}], max_tokens=4)


def test_specjax_serve_starts_answers_and_refuses_bad_flags_in_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = [sys.executable, "-m", "specjax.cli.serve", "--model", "tiny-random"]
    bad = subprocess.run([*serve, "--prompt", "Hi"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().endswith("leave out --prompt and --prompts-file")
    flags = ["--drafter", "ngram", "--num-draft-tokens", "2", "--batch-size", "2", "--max-context", "128"]
    env = {**os.environ, "SPECJAX_API_KEY": "sesame"}
    proc = subprocess.Popen([*serve, *flags, "--port", str(port)], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.5)
        base = f"http://127.0.0.1:{port}"
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="sesame", max_retries=0, timeout=120)
        reply = api.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
        )
        assert reply.choices[0].message.content == greedy_text(MODEL.tokenizer.chat_prompt_ids("Hi"), 5)
        with pytest.raises(openai.AuthenticationError, match="Authorization: Bearer"):
            client(base).models.list()  # the wrong key
        code, body = post(base, "/v1/completions", b'{"prompt": "Hi"}')  # no key
        assert code == 401 and body["error"]["type"] == "authentication_error"
        for open_route in ("/health", "/metrics"):
            with urllib.request.urlopen(base + open_route, timeout=10) as response:
                assert response.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)
