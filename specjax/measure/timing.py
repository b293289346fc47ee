"""Where the time of a speculative round goes, measured: target step, verification, drafting.

`forward_costs` times the target alone (one token, and K+1 tokens against the same cache; `forward_seconds` any
token counts); `drafter_seconds` times the drafter alone (its commit of a round's verified rows, then its
proposal). These are the pieces adaptive drafting's calibration prices a round with (`specjax.measure.calibration`).
Calls whose times are compared take turns (`interleaved_medians`), so a shared machine's slow spells cancel out;
`round_breakdown` turns a speculative run's wall time and statistics into the draft cost ratio c and the speedup the
model of `specjax.measure.speedup` predicts from them, to set beside the measured speedup.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.autoregressive import prefill_prompts
from specjax.drafters.base import Drafter
from specjax.measure.speedup import acceptance_rate_from_mean, expected_tokens_per_round
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Weights, forward_new_kv
from specjax.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class ForwardCosts:
    step_s: float  # one target forward of 1 token per row
    verify_s: float  # one target forward of K+1 tokens per row, against the same cache

    @property
    def verify_ratio(self) -> float:
        return self.verify_s / self.step_s


def forward_costs(
    weights: Weights, cfg: ModelConfig, batch: int, context: int, num_tokens: int, reps: int = 7
) -> ForwardCosts:
    """Median wall times of the target forward over 1 and `num_tokens` tokens per row (see `forward_seconds`).

    Args:
      weights: the target weights.
      cfg: the target config.
      batch: rows.
      context: committed tokens per row.
      num_tokens: the K+1 tokens of a verification.
      reps: timed repetitions (after one warm-up).
    Returns:
      ForwardCosts.
    """
    step_s, verify_s = forward_seconds(weights, cfg, batch, context, (1, num_tokens), reps)
    return ForwardCosts(step_s=step_s, verify_s=verify_s)


def forward_seconds(
    weights: Weights, cfg: ModelConfig, batch: int, context: int, token_counts: Sequence[int], reps: int = 7
) -> list[float]:
    """Median wall time of the target forward over T tokens per row for each T in `token_counts`, all against one
    cache of `context` valid slots (sized context + the largest T), timed in turn (`interleaved_medians`)."""
    return interleaved_medians(forward_timers(weights, cfg, batch, context, token_counts), reps)


def forward_timers(
    weights: Weights, cfg: ModelConfig, batch: int, context: int, token_counts: Sequence[int]
) -> list[Callable[[], Any]]:
    """One call per T in `token_counts`: the target forward over T tokens per row (see `forward_seconds`)."""
    slots = context + max(token_counts)
    return shape_timers(weights, cfg, batch, [ForwardShape(t, context, slots) for t in token_counts])


@dataclasses.dataclass(frozen=True)
class ForwardShape:
    """A target forward to time: `tokens` new tokens per row, a chain or a binary tree of them (node i's parent is
    (i - 1) // 2), after `live` committed tokens in a buffer of `slots` per row."""

    tokens: int
    live: int
    slots: int
    tree: bool = False

    def ancestors(self) -> np.ndarray:
        """bool [T, T]: which nodes each node sees (itself and the nodes above it; a chain: causal)."""
        seen = np.eye(self.tokens, dtype=bool)
        for i in range(1, self.tokens):
            seen[i] |= seen[(i - 1) // 2] if self.tree else seen[i - 1]
        return seen


def shape_timers(
    weights: Weights, cfg: ModelConfig, batch: int, shapes: Sequence[ForwardShape]
) -> list[Callable[[], Any]]:
    """One call per shape: the target forward over its new tokens against a cache of its live tokens and slots
    (shapes of one live length and buffer share one cache). It only reads the cache, as a round of the speculative
    loop does (`forward_new_kv`): a call that returned the cache written would copy all of it (~77 MB at batch 8 on
    SmolLM2), and time the copy."""
    run = jax.jit(forward_new_kv, static_argnums=1)
    caches = {}

    def timer(shape: ForwardShape) -> Callable[[], Any]:
        if (shape.live, shape.slots) not in caches:
            cache = KVCache.empty(cfg, batch, shape.slots, weights.embed.dtype)
            caches[shape.live, shape.slots] = cache.at_lengths(jnp.full((batch,), shape.live, jnp.int32))
        cache = caches[shape.live, shape.slots]
        seen = shape.ancestors()
        tokens = jnp.ones((batch, shape.tokens), jnp.int32)
        positions = jnp.broadcast_to(shape.live + seen.sum(1, dtype=np.int32) - 1, (batch, shape.tokens))
        mask = jnp.broadcast_to(seen, (batch, *seen.shape))
        return lambda: run(weights, cfg, tokens, positions, cache, mask)

    return [timer(shape) for shape in shapes]


def prefill_timer(
    weights: Weights, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array, chunk: int
) -> Callable[[], Any]:
    """A call that prefills `tokens` [batch, S] (`lengths` valid per row) by chunks into an empty cache of S slots,
    as a decode starts."""

    @jax.jit
    def start(weights, tokens, lengths):
        cache = jax.lax.optimization_barrier(KVCache.empty(cfg, *tokens.shape, weights.embed.dtype))
        return prefill_prompts(weights, cfg, tokens, lengths, cache, 1, chunk)

    return lambda: start(weights, tokens, lengths)


def drafter_seconds(
    drafter: Drafter,
    cfg: ModelConfig,
    batch: int,
    context: int,
    num_draft_tokens: int,
    sampling: SamplingConfig,
    reps: int = 7,
) -> float:
    """Median wall time of a drafter's own work in one round, alone: its commit of a whole path of verified rows,
    then its proposal of the round's draft, over `context` committed tokens of random text.

    Args:
      drafter: any `Drafter`.
      cfg: the target config (vocabulary, width of the taps).
      batch: rows.
      context: committed tokens per row.
      num_draft_tokens: K (its `draft_shape(K)` is the round's draft).
      sampling: the sampling config of the run.
      reps: timed repetitions (after one warm-up).
    """
    return median_seconds(drafter_timer(drafter, cfg, batch, context, num_draft_tokens, sampling), reps)


def drafter_timer(
    drafter: Drafter, cfg: ModelConfig, batch: int, context: int, num_draft_tokens: int, sampling: SamplingConfig
) -> Callable[[], Any]:
    """The call `drafter_seconds` times."""
    shape = drafter.draft_shape(num_draft_tokens)
    slots = context + shape.capacity
    tokens = jax.random.randint(jax.random.key(0), (batch, slots), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    taps = len(drafter.traits.tap_layers) * cfg.hidden_size
    state = drafter.init(tokens[:, :context], lengths, slots)
    state = drafter.commit(state, tokens[:, 1 : context + 1], jnp.ones((batch, context, taps)), lengths)
    path = shape.depth + 1
    rows = Sampling.of(sampling, batch)

    @jax.jit
    def one_round(drafter, state, keys):
        state = drafter.commit(state, tokens[:, :path], jnp.ones((batch, path, taps)), jnp.full((batch,), path - 1))
        return drafter.propose(state, tokens, lengths + 1, keys, shape=shape, vocab_size=cfg.vocab_size, sampling=rows)

    keys_b = jax.random.split(jax.random.key(1), batch)
    return lambda: one_round(drafter, state, keys_b)


def median_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of `fn()` (a jitted call) over `reps` runs after one warm-up."""
    return interleaved_medians([fn], reps)[0]


def interleaved_medians(fns: Sequence[Callable[[], Any]], reps: int, warm_up: bool = True) -> list[float]:
    """Median wall time of each jitted call over `reps` runs, after one warm-up each (unless the caller has run
    them). The calls take turns, so a machine that slows down for a while (a shared CPU) slows all of them alike and
    their ratios hold."""
    for fn in fns if warm_up else ():
        jax.block_until_ready(fn())
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def round_breakdown(
    costs: ForwardCosts,
    seconds: float,
    rounds: int,
    mean_accepted: float,
    num_draft_tokens: int,
    drafter_s: float | None = None,
    prefill_s: float = 0.0,
):
    """Splits a speculative run's time per round into verification and drafting, and predicts its speedup.

    Args:
      costs: the target's forward costs at this batch size and K.
      seconds: wall time of the run.
      rounds: its rounds (verification passes).
      mean_accepted: tokens per round, bonus included.
      num_draft_tokens: K (for trees: the depth).
      drafter_s: optionally, the drafter's own work per round measured alone (`drafter_seconds`).
      prefill_s: the run's prefills, measured alone, taken out of `seconds` before it is split.
    Returns:
      dict with prefill_ms, round_ms, verify_ms, draft_ms (the round minus the verification: drafting and the
      loop's own work), cost_ratio c (draft_ms over K target steps), verify_ratio, alpha (per-token acceptance rate
      implied by mean_accepted) and predicted_speedup = expected tokens per round / (verify_ratio + K c); with
      drafter_s also drafter_ms and rest_ms = draft_ms - drafter_ms.
    """
    K = num_draft_tokens
    round_s = (seconds - prefill_s) / max(rounds, 1)
    draft_s = max(round_s - costs.verify_s, 0.0)
    c = draft_s / (K * costs.step_s)
    alpha = acceptance_rate_from_mean(min(mean_accepted, K + 1), K)
    predicted = expected_tokens_per_round(alpha, K) / (costs.verify_ratio + K * c)
    return {
        "prefill_ms": 1000 * prefill_s,
        "round_ms": 1000 * round_s,
        "verify_ms": 1000 * costs.verify_s,
        "draft_ms": 1000 * draft_s,
        "target_step_ms": 1000 * costs.step_s,
        "cost_ratio": c,
        "verify_ratio": costs.verify_ratio,
        "alpha": alpha,
        "predicted_speedup": predicted,
        **({} if drafter_s is None else {"drafter_ms": 1000 * drafter_s, "rest_ms": 1000 * (draft_s - drafter_s)}),
    }
