"""specjax-serve across two processes (jax.distributed on 127.0.0.1, 4 fake CPU devices each, one data=2,tensor=4 mesh
over the 8): process 0 answers 8 concurrent clients of the official `openai` client with one device's greedy text and,
stopped, stops its follower; a follower killed mid-request makes process 0 answer with a 503 and exit with code 1,
within a bound. Every wait has a timeout."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import openai
import pytest
from conftest import fake_devices

from specjax.cli import serve
from specjax.decoding.autoregressive import generate
from specjax.io.loading import tiny_random_model

MODEL = tiny_random_model()
FLAGS = ["--model", "tiny-random", "--drafter", "ngram", "--num-draft-tokens", "2", "--max-context", "128"]
FLAGS += ["--mesh", "data=2,tensor=4"]
START_S = 300  # both processes compile the engine's programs on 2 shared cores
EXIT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def serving_pair(tmp_path: Path, slots: int):
    """Processes 0 and 1 of one server; yields (base URL, processes, their stderr files) once process 0 answers, and
    kills whichever is left at the end."""
    port, coordinator = free_port(), free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": fake_devices(4),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # the second pair reads the first one's programs
    }
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    multihost = ["--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2", "--port", str(port)]
    multihost += ["--batch-size", str(slots)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "specjax.cli.serve", *FLAGS, *multihost, "--process-id", str(i)],
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
            env=env,
        )
        for i, log in enumerate(logs)
    ]
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + START_S
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5):
                    break
            except OSError:
                for proc, log in zip(procs, logs):
                    assert proc.poll() is None, tail(log)
                assert time.time() < deadline, tail(logs[0])
                time.sleep(0.5)
        yield base, procs, logs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=EXIT_S)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=EXIT_S)


def test_two_processes_answer_eight_clients_with_one_devices_greedy_text_and_stop_together(tmp_path):
    prompts = [f"{word} {i}" for i, word in enumerate(["Count", "Name", "List", "Say", "Write", "Add", "Tell", "Sum"])]
    ids = [MODEL.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    expected = [
        MODEL.tokenizer.decode(c.output_ids)
        for c in generate(MODEL.weights, MODEL.cfg, ids, max_new_tokens=12, eos_ids=MODEL.eos_ids).completions
    ]
    with serving_pair(tmp_path, 2) as (base, procs, logs):
        api = client(base)

        def ask(prompt: str) -> str:
            return (
                api.completions.create(model="tiny-random", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
            )

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, prompts)) == expected
        procs[0].terminate()  # uvicorn stops; its lifespan tells the follower to stop
        codes = [proc.wait(timeout=EXIT_S) for proc in procs]
        assert codes == [-signal.SIGTERM, 0], [tail(log) for log in logs]  # uvicorn re-raises the SIGTERM it caught


def test_a_follower_killed_mid_request_gets_a_503_and_process_0_out_with_exit_code_1(tmp_path):
    with serving_pair(tmp_path, 1) as (base, procs, logs):  # one slot: the first pair's programs
        api = client(base)
        running = api.completions.create(
            model="tiny-random", prompt="Once upon a time", max_tokens=100, temperature=0, stream=True
        )
        chunks = iter(running)
        next(chunks)  # in a slot now
        procs[1].send_signal(signal.SIGSTOP)  # process 0 waits for it inside a collective
        errors = []

        def ask() -> None:
            try:
                api.completions.create(model="tiny-random", prompt="Hi", max_tokens=4, temperature=0)
            except openai.APIStatusError as e:
                errors.append(e)

        waiting = threading.Thread(target=ask)
        waiting.start()
        time.sleep(2.0)  # the second request reaches the server
        procs[1].kill()
        killed = time.time()
        waiting.join(timeout=EXIT_S)
        assert [e.status_code for e in errors] == [503], tail(logs[0])
        assert "multi-host server failed" in errors[0].message
        with pytest.raises(openai.APIError, match="multi-host server failed"):
            list(chunks)  # the running request ends with an error event
        assert procs[0].wait(timeout=EXIT_S) == 1
        assert time.time() - killed < EXIT_S
        lines = logs[0].read_text().splitlines()
        assert lines[-1].startswith("specjax-serve: error: a process of this multi-host server failed, so it stops")
        assert not any("Traceback" in line for line in lines)


def test_adaptive_drafting_is_refused_across_processes_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # what prepare reads; nothing starts
    with pytest.raises(SystemExit) as exit_info:
        serve.entry(["--model", "tiny-random", "--drafter", "ngram", "--max-context", "128"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "specjax-serve: error: adaptive drafting times each process's own calls, and the processes of a multi-host run "
        "must agree: give a fixed --num-draft-tokens"
    )
