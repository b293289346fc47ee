"""specjax-serve's Prometheus metrics, named as vLLM names its own with a `specjax:` prefix, in a registry of the app's
own.

The engine thread counts tokens and rounds after each engine step (`engine_step`); handlers count finished and refused
requests and their latencies. How the speculative counters add up (one row-round: one row of the batch through one
round of the loop): a row-round that drafts proposes `spec_decode_num_draft_tokens / spec_decode_num_drafts` tokens on
average and its target accepts n of them (`spec_decode_num_accepted_tokens`, summed over positions in
`..._per_pos`); it then yields the n accepted tokens and one of the target's, cut at an EOS and at the request's
`max_tokens` in its last round. So
    generation_tokens = requests started (each one's first token comes from its prefill) + row_rounds + accepted - cut
with cut >= 0 only from requests' last rounds (at most the deepest draft per request).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specjax.adaptive import menu_shapes
from specjax.decoding.engine import Engine, Event

WINDOW_S = 60  # tokens_per_second's window
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)


class Throughput:
    """Tokens per second over the last WINDOW_S seconds, from per-second sums: at most WINDOW_S + 1 entries, however
    many steps add to it and however rarely it is read."""

    def __init__(self):
        self.seconds: collections.deque[list[int]] = collections.deque(maxlen=WINDOW_S + 1)  # [second, tokens]
        self._lock = threading.Lock()

    def add(self, now: float, tokens: int) -> None:
        with self._lock:
            if self.seconds and self.seconds[-1][0] == int(now):
                self.seconds[-1][1] += tokens
            else:
                self.seconds.append([int(now), tokens])

    def rate(self, now: float) -> float:
        with self._lock:
            recent = [(s, n) for s, n in self.seconds if s > now - WINDOW_S]
        return sum(n for _, n in recent) / max(now - recent[0][0], 1.0) if recent else 0.0


class ServerMetrics:
    """The app's metrics over `engine` (its gauges read the engine when scraped); `clock()` is the time in seconds
    (time.monotonic), the one the handlers' start times and `engine_step` use."""

    def __init__(self, engine: Engine, clock):
        self.registry = r = CollectorRegistry()
        self.clock = clock
        reason, position = ["finished_reason"], ["position"]
        self.success = Counter("specjax:request_success", "requests finished, by reason", reason, registry=r)
        self.refused = Counter("specjax:request_refused", "requests refused, by error type", ["reason"], registry=r)
        self.prompt_tokens = Counter("specjax:prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("specjax:generation_tokens", "tokens the engine generated", registry=r)
        self.row_rounds = Counter(
            "specjax:row_rounds", "rounds of the loop, times the rows running in each", registry=r
        )
        self.drafts = Counter("specjax:spec_decode_num_drafts", "row-rounds that drafted", registry=r)
        self.draft_tokens = Counter("specjax:spec_decode_num_draft_tokens", "draft tokens proposed", registry=r)
        self.accepted = Counter("specjax:spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r)
        self.per_pos = Counter(
            "specjax:spec_decode_num_accepted_tokens_per_pos", "drafts accepted at each position", position, registry=r
        )
        self.ttft = Histogram(
            "specjax:time_to_first_token_seconds", "time to first token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "specjax:time_per_output_token_seconds", "time per token after the first", registry=r, buckets=TOKEN_BUCKETS
        )
        self.e2e = Histogram(
            "specjax:e2e_request_latency_seconds", "request latency", registry=r, buckets=LATENCY_BUCKETS
        )
        self.throughput = Throughput()
        gauges = {
            "num_requests_running": ("requests in a slot", lambda: engine.busy),
            "num_requests_waiting": ("requests waiting for a slot", lambda: engine.queued),
            "slots": ("slots (--batch-size)", lambda: engine.slots),
            "compiled_programs": (
                "programs the engine compiled (at start: every bucket's)",
                lambda: engine.compiled_programs,
            ),
            "tokens_per_second": (
                "tokens generated per second over the last minute",
                lambda: self.throughput.rate(clock()),
            ),
            "mean_accepted_length": ("tokens per row-round over the server's life", self._mean_accepted),
        }
        for name, (doc, read) in gauges.items():
            Gauge(f"specjax:{name}", doc, registry=r).set_function(read)
        menu = engine.policies[engine.slots].menu
        self.draft_sizes = np.array([s.budget - 1 for s in menu_shapes(engine.decoder.drafter, menu)])
        depth = int(engine.state.accepted_hist.shape[0]) - 1
        for i in range(depth):
            self.per_pos.labels(str(i))
        self._last: tuple | None = None
        self._totals = np.zeros(2, np.int64)  # row-rounds, accepted tokens

    def _mean_accepted(self) -> float:
        rounds, accepted = self._totals
        return 1 + accepted / rounds if rounds else 0.0

    def baseline(self, counters: tuple[int, np.ndarray, np.ndarray]) -> None:
        """The engine's counters (`engine_counters`) that later steps count from: at start and after a reset."""
        self._last = counters

    def engine_step(self, events: Sequence[Event], counters: tuple[int, np.ndarray, np.ndarray]) -> None:
        """Counts one engine step: its events and the engine's counters after it (`engine_counters`)."""
        made = sum(len(e.new_ids) for e in events)
        self.generation_tokens.inc(made)
        self.throughput.add(self.clock(), made)
        (row_rounds, hist, menu), (row_rounds0, hist0, menu0) = counters, self._last
        self._last = counters
        if row_rounds == row_rounds0:
            return
        by_entry = (menu - menu0) * ((row_rounds - row_rounds0) // int((menu - menu0).sum()))  # row-rounds per entry
        hist = hist - hist0
        accepted = int(hist @ np.arange(len(hist)))
        self.row_rounds.inc(row_rounds - row_rounds0)
        self.drafts.inc(int(by_entry[self.draft_sizes > 0].sum()))
        self.draft_tokens.inc(int(by_entry @ self.draft_sizes))
        self.accepted.inc(accepted)
        for i in range(len(hist) - 1):
            self.per_pos.labels(str(i)).inc(int(hist[i + 1 :].sum()))
        self._totals += (row_rounds - row_rounds0, accepted)

    def finished(self, reason: str, prompt_tokens: int, tokens: int, start: float, first: float | None) -> None:
        """Counts a request that ended (`reason`: stop, length, abort, error) after `tokens` tokens; `start` and
        `first` (its first token, if any) on `clock`."""
        now = self.clock()
        self.success.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(now - start)
        if first is not None:
            self.ttft.observe(first - start)
            if tokens > 1:
                self.tpot.observe((now - first) / (tokens - 1))

    def text(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


def engine_counters(engine: Engine) -> tuple[int, np.ndarray, np.ndarray]:
    """The engine's running totals the metrics count from: row-rounds of live rows, row-rounds by accepted drafts,
    rounds by menu entry (call it on the engine's thread)."""
    state = engine.state
    return engine.slot_rounds["running"], np.asarray(state.accepted_hist), np.asarray(state.menu_rounds)
