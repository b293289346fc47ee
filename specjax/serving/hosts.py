"""Serving across hosts (multi-controller JAX): process 0 leads, every other process follows.

Every process of a multi-host run holds the same `Engine` over the same global arrays, and each must run the same
programs in the same order. Process 0 serves HTTP. Before each engine step, its engine thread sends the others the
commands that step depends on: the submits since the last one (prompt ids, max_tokens, sampling values, seed), the
cancellations, the step and its max_rounds, in the order it applies them (`exchange`: JSON bytes over
`jax.experimental.multihost_utils.broadcast_one_to_all`). A follower applies them to its own engine (`follow`), and
since the engine's host decisions (request ids, slots, buckets, prefill chunks) are functions of those commands alone,
it makes the same calls. The one decision that reads a clock, adaptive drafting (`Engine._learn`, and its calibration
at start-up), is refused with several processes (`specjax.prepare`): a multi-host server drafts a fixed K, or none.

While idle, process 0 sends an empty message every IDLE_S seconds, so a follower never waits long in a collective and
a dead peer shows at once. A peer that dies makes the next collective raise (on the CPU, gloo's "connection closed"):
process 0 then fails its requests with 503 and exits, and a follower exits.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
from jax.experimental import multihost_utils

from specjax.config import SamplingConfig
from specjax.decoding.engine import Engine, Event
from specjax.errors import InputError

IDLE_S = 1.0  # how often an idle process 0 tells the followers that it is still there
MIN_MESSAGE = 1024  # bytes; a message is padded to a power of two at least this long, so few shapes compile


def submit_command(prompt: list[int], max_tokens: int, sampling: SamplingConfig, seed: int | None) -> list:
    return ["submit", prompt, max_tokens, dataclasses.asdict(sampling), seed]


def apply(engine: Engine, command: list) -> int | bool | list[Event]:
    """Applies one command to `engine`: what `Engine.submit` (the request's id; it raises InputError for a request
    the engine refuses, alike on every process), `Engine.cancel` or `Engine.step` returns."""
    kind, *args = command
    if kind == "submit":
        prompt, max_tokens, sampling, seed = args
        return engine.submit(prompt, max_tokens, SamplingConfig(**sampling), seed)
    if kind == "cancel":
        return engine.cancel(*args)
    return engine.step(*args)


def exchange(commands: list[list]) -> list[list]:
    """Process 0's `commands`, on every process (the others' are ignored); as they are with one process."""
    if jax.process_count() == 1:
        return commands
    data = json.dumps(commands).encode() if jax.process_index() == 0 else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buffer = np.zeros(max(MIN_MESSAGE, 1 << (size - 1).bit_length()), np.uint8)
    buffer[: len(data)] = np.frombuffer(data, np.uint8)
    return json.loads(multihost_utils.broadcast_one_to_all(buffer)[:size].tobytes())


def first_line(error: Exception) -> str:
    """What a failed collective says, in one line (gloo's messages run over several)."""
    return (str(error).strip() or type(error).__name__).splitlines()[0]


def stop_followers() -> None:
    """Process 0's end of a multi-host run: tells the followers to stop, then leaves jax.distributed with them (they
    leave as they exit), so that however process 0 ends then (uvicorn re-raises a SIGTERM it caught, which skips the
    shutdown at exit) no follower waits for it at the shutdown barrier."""
    exchange([["stop"]])
    jax.distributed.shutdown()


def follow(engine: Engine) -> None:
    """A follower's serving: applies process 0's commands to `engine` until it says stop. Raises what a collective
    raises when a peer is gone."""
    while True:
        for command in exchange([]):
            if command[0] == "stop":
                return
            try:
                apply(engine, command)
            except InputError:
                pass  # process 0 refused it too
