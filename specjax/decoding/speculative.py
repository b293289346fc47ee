"""Exact speculative decoding: draft, verify every draft in one target forward, accept, repeat.

The whole loop is one `jax.jit` around `lax.while_loop` with a pytree state; it compiles once per
(batch, prompt bucket, max_new_tokens, K, drafter options, greedy or sampled) and makes no host round trip per round.
Rows accept independently; a row stops at EOS or max_new_tokens while the others go on.

Bookkeeping per row: `tokens_bs` holds the prompt and the generated tokens; `length_b` of them are committed. The
last committed token is "pending": the target has not seen it yet, so the target cache holds `length_b - 1` tokens.
A round has one path for every drafter (`specjax.drafters.base` has the protocol): the drafter proposes a draft tree
(`specjax.drafters.tree.DraftTree`) rooted at the pending token, of the static shape `drafter.draft_shape(K)`: a chain of K
drafts, or a tree drafter's own tree. One target forward runs its nodes at positions length_b - 1 + depth under their
ancestor mask; `specjax.decoding.acceptance` accepts n drafts along one path and adds one token from the target (the
correction, or the bonus); the path's n drafts and that token are emitted, and the cache advances by n + 1.
The accepted path's keys and values go to slots length_b - 1 .. length_b - 1 + n; the slots after it are never
committed, and later rounds overwrite them. A chain, known as one at trace time, skips what only branching trees
need: its mask is the plain causal one and its nodes are already its path, while a tree's path is gathered from its
nodes. Drafters with `tap_layers` get the target's taps, and `commit` sees the committed rows after the prefill and
every round.

With an adaptive menu (`specjax.adaptive`) the loop holds one round per menu entry, each of its own static shape,
and `lax.switch`es to the one the rows' acceptance so far and the measured costs favour; a plain decoding step is
the round whose draft is the pending token alone (`TreeSpec.chain(0)`). A round only reads the target cache: it
returns its accepted path's keys and values, and the loop writes them after the switch, so the cache is never
copied into or out of a branch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.adaptive import (
    Adaptive,
    choose,
    evidence,
    first_pace,
    menu_depths,
    never_drafts,
    observe,
    paces,
    rates,
    step_pace,
)
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.acceptance import accept
from specjax.decoding.autoregressive import (
    Completion,
    GenerateResult,
    _compiled,
    _is_eos,
    completions,
    prefill,
    prepare_batch,
)
from specjax.decoding.autoregressive import generate as plain_generate
from specjax.defaults import MAX_DRAFT_TOKENS
from specjax.drafters.base import Drafter
from specjax.drafters.tree import DraftTree, TreeSpec, path_to
from specjax.errors import InputError
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Weights, forward_new_kv
from specjax.sampling import Sampling, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    tokens_bs: jax.Array  # [B, P + max_new + capacity] prompt then generated tokens; slots >= length_b are stale
    length_b: jax.Array  # [B] committed tokens (prompt + generated); the last one is pending
    num_new_b: jax.Array  # [B] generated tokens
    done_b: jax.Array  # [B] the row produced EOS or reached max_new_tokens
    cache: KVCache  # target cache; lengths == length_b - 1
    draft_state: Any  # the drafter's pytree
    key: jax.Array
    rounds: jax.Array  # [] loop iterations
    accepted_hist: jax.Array  # [D + 1] row-rounds (of rows still running) that accepted 0..D drafts (D: the depth)
    menu_rounds: jax.Array  # [S] rounds of each menu entry (one entry, K, without adaptive drafting)
    tally_brc: jax.Array  # [B, R, 2] float32 accepted drafts and tried depths per kind of round (specjax.adaptive)
    pace_b2: jax.Array  # [B, 2] float32 running steps and emitted tokens (specjax.adaptive)
    evidence: jax.Array  # [R, 2] float32 accepted drafts and tried depths per kind of round (`Adaptive.learn`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecOutput:
    out_bn: jax.Array  # [B, max_new] generated tokens (pad after num_new_b)
    num_new_b: jax.Array  # [B]
    rounds: jax.Array  # []
    accepted_hist: jax.Array  # [D + 1]
    menu_rounds: jax.Array  # [S]
    evidence: jax.Array  # [R, 2]
    state: SpecState  # the final state (target cache, token buffer) for inspection


class Path(NamedTuple):
    """A round's accepted path, padded to D + 1 rows: what `step` writes after the round."""

    k: jax.Array  # [L, B, D + 1, K, H] target keys of the path's nodes
    v: jax.Array
    tokens: jax.Array  # [B, D + 1] emitted tokens (the first `count` are committed)
    taps: jax.Array | None  # [B, D + 1, F] the target's taps at the path's nodes (drafters with tap_layers)


@functools.partial(jax.jit, static_argnames=("cfg", "num_draft_tokens", "max_new_tokens", "eos_ids", "num_samples"))
def speculative_decode(
    weights: Weights,
    drafter: Drafter,
    tokens_up: jax.Array,
    lengths_u: jax.Array,
    key: jax.Array,
    sampling: Sampling,
    active_b: jax.Array | None = None,
    adaptive: Adaptive | None = None,
    *,
    cfg: ModelConfig,
    num_draft_tokens: int,
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    num_samples: int = 1,
) -> SpecOutput:
    """Speculative decoding of a padded batch, entirely on device: B = U * num_samples rows.

    Args:
      weights: the target weights.
      drafter: any `Drafter` (a pytree).
      tokens_up: int32 [U, P] right-padded prompts.
      lengths_u: int32 [U] prompt lengths.
      key: PRNG key (unused when greedy).
      sampling: the rows' sampling values, applied to target and draft alike (data: a new value does not compile
        again; only `sampling.greedy` is static).
      active_b: optional bool [B]; rows that are False (batch padding) start finished: they generate one token,
        never run a round and do not count in the statistics.
      adaptive: optional; every round then picks its draft size from `adaptive.menu` (`specjax.adaptive`), which
        replaces num_draft_tokens.
      cfg: static target config.
      num_draft_tokens: static K >= 1; the drafter's `draft_shape(K)` is the shape of every round's draft (without
        `adaptive`).
      max_new_tokens: static; at most this many tokens per row.
      eos_ids: static; a row stops after producing one of these.
      num_samples: static; rows per prompt (adjacent), sharing the prompt's target prefill.
    Returns:
      A SpecOutput.
    """
    U, P = tokens_up.shape
    B = U * num_samples
    menu = adaptive.menu if adaptive is not None else (num_draft_tokens,)
    shapes = [drafter.draft_shape(k) if k else TreeSpec.chain(0) for k in menu]  # chain(0): a plain step
    depths = [shape.depth for shape in shapes]
    D = max(depths)
    taps = drafter.tap_layers
    R = drafter.num_regimes
    if adaptive is not None:  # one prior for every kind of round, or one each
        adaptive = dataclasses.replace(adaptive, prior=jnp.broadcast_to(adaptive.prior, (R,)))
    num_slots = P + max_new_tokens + max(shape.capacity for shape in shapes)
    pad = eos_ids[0] if eos_ids else 0
    # The barrier keeps XLA from constant-folding attention over the empty (all-zero) cache, which took minutes to
    # compile at large batch sizes.
    cache = jax.lax.optimization_barrier(KVCache.empty(cfg, U, num_slots, weights.embed.dtype))
    logits_bv, taps_bpf, cache = prefill(weights, cfg, tokens_up, lengths_u, cache, num_samples, tap_layers=taps)
    tokens_bp, lengths_b = jnp.repeat(tokens_up, num_samples, axis=0), cache.lengths
    key, sub = jax.random.split(key)
    first = sample(sub, logits_bv, sampling)
    rows = jnp.arange(B)
    tokens_bs = jnp.full((B, num_slots), pad, jnp.int32).at[:, :P].set(tokens_bp).at[rows, lengths_b].set(first)
    draft_state = jax.lax.optimization_barrier(drafter.init(tokens_bp, lengths_b, num_slots))
    draft_state = drafter.commit(draft_state, tokens_bs[:, 1 : P + 1], taps_bpf, lengths_b)
    state = SpecState(
        tokens_bs=tokens_bs,
        length_b=lengths_b + 1,
        num_new_b=jnp.ones((B,), jnp.int32),
        done_b=_is_eos(first, eos_ids) | (max_new_tokens == 1) | (False if active_b is None else ~active_b),
        cache=cache,
        draft_state=draft_state,
        key=key,
        rounds=jnp.int32(0),
        accepted_hist=jnp.zeros((D + 1,), jnp.int32),
        menu_rounds=jnp.zeros((len(menu),), jnp.int32),
        tally_brc=jnp.zeros((B, R, 2), jnp.float32),
        pace_b2=first_pace(adaptive, depths, B) if adaptive is not None else jnp.ones((B, 2), jnp.float32),
        evidence=jnp.zeros((R, 2), jnp.float32),
    )

    def round_of(entry: int, shape: TreeSpec):
        """One round drafting `shape` (static); `entry` is its place in the menu. It returns the next state without its
        cache, the keys and values of the accepted path's D + 1 slots, and its emitted tokens and taps (all padded
        past the round's own depth), which `step` writes to the cache and commits to the drafter: so the cache,
        the largest part of the state, never passes through `lax.switch`, which copied it in and out every round,
        and the drafter's commit runs once, outside it."""
        j = jnp.arange(shape.depth + 1)[None, :]

        def run(s: SpecState, regime_b: jax.Array) -> tuple[SpecState, Path]:
            key, k_draft, k_accept = jax.random.split(s.key, 3)
            if shape.depth == 0:  # a plain step: the pending token alone, its next token from the target
                pending_b = jnp.take_along_axis(s.tokens_bs, (s.length_b - 1)[:, None], axis=1)[:, 0]
                none = jnp.zeros((B, 0), jnp.int32)
                draft = DraftTree.chain(pending_b, none, jnp.zeros((B, 0, cfg.vocab_size), jnp.float32))
                draft_state = s.draft_state
            else:
                draft, draft_state = drafter.propose_tree(
                    s.draft_state, s.tokens_bs, s.length_b, k_draft, shape=shape, vocab_size=cfg.vocab_size,
                    sampling=sampling,
                )  # fmt: skip
            base = s.length_b - 1
            logits, taps_btf, k_new, v_new = forward_new_kv(
                weights, cfg, draft.tokens, base[:, None] + draft.depths, s.cache,
                new_mask_btt=None if shape.is_chain else draft.ancestors, tap_layers=taps,
            )  # fmt: skip
            n, nxt, last = accept(k_accept, draft, logits, sampling)
            path_tokens, path_taps = draft.tokens, taps_btf  # a chain's path: nodes 0 .. n, in place
            if not shape.is_chain:
                path = path_to(draft, last, n, shape.depth)
                path_tokens = jnp.take_along_axis(draft.tokens, path, axis=1)
                path_taps = None if taps_btf is None else jnp.take_along_axis(taps_btf, path[..., None], axis=1)
                k_new, v_new = (jnp.take_along_axis(x, path[None, :, :, None, None], axis=2) for x in (k_new, v_new))
            to_depth = [(0, 0), (0, 0), (0, D - shape.depth), (0, 0), (0, 0)]  # every round's path: D + 1 slots
            k_path, v_path = (jnp.pad(x, to_depth) for x in (k_new, v_new))
            if path_taps is not None:
                path_taps = jnp.pad(path_taps, [(0, 0), (0, D - shape.depth), (0, 0)])
            # Emitted this round: the accepted drafts, then nxt; cut at the first EOS and at max_new_tokens.
            emitted = jnp.where(j < n[:, None], jnp.roll(path_tokens, -1, axis=1), nxt[:, None])
            eos_at = jnp.where(_is_eos(emitted, eos_ids) & (j <= n[:, None]), j, shape.depth + 1).min(axis=1)
            count = jnp.minimum(jnp.minimum(n + 1, eos_at + 1), max_new_tokens - s.num_new_b)
            count = jnp.where(s.done_b, 0, count)
            slots = s.length_b[:, None] + j
            tokens_bs = s.tokens_bs.at[rows[:, None], jnp.where(j < count[:, None], slots, num_slots)].set(
                emitted, mode="drop"
            )
            num_new = s.num_new_b + count
            done = s.done_b | (eos_at < count) | (num_new >= max_new_tokens)
            running = ~s.done_b
            hist = s.accepted_hist + jnp.sum(jax.nn.one_hot(n, D + 1, dtype=jnp.int32) * running[:, None], axis=0)
            tally, seen, pace = s.tally_brc, s.evidence, s.pace_b2
            if adaptive is not None:
                tally = observe(tally, regime_b, shape.depth, n, running)
                seen = seen + evidence(regime_b, shape.depth, n, running, R)
                pace = step_pace(pace, adaptive.cost[entry], count, running)
            next_state = SpecState(
                tokens_bs=tokens_bs,
                length_b=s.length_b + count,
                num_new_b=num_new,
                done_b=done,
                cache=None,
                draft_state=draft_state,
                key=key,
                rounds=s.rounds + 1,
                accepted_hist=hist,
                menu_rounds=s.menu_rounds.at[entry].add(1),
                tally_brc=tally,
                pace_b2=pace,
                evidence=seen,
            )
            return next_state, Path(k_path, v_path, jnp.pad(emitted, [(0, 0), (0, D - shape.depth)]), path_taps)

        return run

    rounds = [round_of(entry, shape) for entry, shape in enumerate(shapes)]

    def step(s: SpecState) -> SpecState:
        if adaptive is None:
            next_state, path = rounds[0](s, jnp.zeros((B,), jnp.int32))
        else:
            regime_b = drafter.regime(s.draft_state, s.tokens_bs, s.length_b)
            rate_b = jnp.take_along_axis(rates(adaptive, s.tally_brc), regime_b[:, None], axis=1)[:, 0]
            remaining_b = jnp.where(s.done_b, 0, max_new_tokens - s.num_new_b)
            entry = choose(adaptive, depths, rate_b, paces(s.pace_b2), remaining_b)
            next_state, path = jax.lax.switch(entry, rounds, s, regime_b)
        count = next_state.length_b - s.length_b
        return dataclasses.replace(
            next_state,
            cache=s.cache.write(path.k, path.v).advance(count),
            draft_state=drafter.commit(next_state.draft_state, path.tokens, path.taps, count),
        )

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done_b), step, state)
    out_slots = lengths_b[:, None] + jnp.arange(max_new_tokens)[None, :]
    out = jnp.take_along_axis(state.tokens_bs, out_slots, axis=1)
    out = jnp.where(jnp.arange(max_new_tokens)[None, :] < state.num_new_b[:, None], out, pad)
    return SpecOutput(out, state.num_new_b, state.rounds, state.accepted_hist, state.menu_rounds, state.evidence, state)


# ---------------------------------------------------------------------------------------------------------------
# Host-side entry point.


@dataclasses.dataclass(frozen=True)
class SpecStats:
    """What the drafts bought. Row-rounds count each running row once per round."""

    rounds: int  # loop iterations (verification passes of the whole batch)
    mean_accepted: float  # tokens emitted per row-round, counting the correction / bonus token (before EOS cuts)
    acceptance_by_position: list[float]  # [K] fraction of row-rounds whose draft i was accepted
    accepted_histogram: list[int]  # [D + 1] row-rounds that accepted 0..D drafts (D: K, or a tree's depth)
    new_tokens: int
    tokens_per_s: float
    rounds_by_drafts: dict[int, int] = dataclasses.field(default_factory=dict)  # rounds of each draft size (menu)
    # Adaptive drafting: (accepted drafts, tried depths) per kind of round, what `Adaptive.learn` pools into the prior.
    acceptance_evidence: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    plain_steps: int = 0  # steps plain decoding takes for these outputs: the longest, less the prefill's token

    @classmethod
    def from_histogram(cls, rounds: int, hist: Sequence[int], new_tokens: int, seconds: float) -> SpecStats:
        hist = [int(h) for h in hist]
        total = max(sum(hist), 1)
        mean = sum((i + 1) * h for i, h in enumerate(hist)) / total
        by_pos = [sum(hist[i + 1 :]) / total for i in range(len(hist) - 1)]
        return cls(int(rounds), mean, by_pos, hist, new_tokens, new_tokens / seconds if seconds > 0 else 0.0)


@dataclasses.dataclass(frozen=True)
class SpecResult:
    completions: list[Completion]
    seconds: float  # wall time of the decoding itself
    compile_seconds: float  # tracing and compilation, 0 when the executable was cached
    stats: SpecStats

    @property
    def new_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.completions)


def as_plain_rounds(plain: GenerateResult, menu: Sequence[int], depth: int) -> SpecResult:
    """Plain decoding's result as a speculative one whose every round was the menu's plain step (`never_drafts`)."""
    steps = [len(c.output_ids) - 1 for c in plain.completions]  # the first token comes with the prefill
    stats = SpecStats.from_histogram(max(steps, default=0), [sum(steps)] + [0] * depth, plain.new_tokens, plain.seconds)
    rounds_by_drafts = {k: stats.rounds if k == 0 else 0 for k in menu}
    stats = dataclasses.replace(stats, rounds_by_drafts=rounds_by_drafts, plain_steps=stats.rounds)
    return SpecResult(plain.completions, plain.seconds, plain.compile_seconds, stats)


def check_inputs(cfg: ModelConfig, drafter: Drafter, num_draft_tokens: int | Adaptive) -> None:
    """Raises InputError for a drafter that cannot serve this target, a chain of K out of range, or an adaptive menu
    with a plain step for a drafter that cannot follow one."""
    if not isinstance(drafter, Drafter):
        raise InputError(
            f"{type(drafter).__name__} is not a drafter (see specjax.drafters.Drafter: subclass BaseDrafter and "
            "implement propose)"
        )
    sizes = num_draft_tokens.menu if isinstance(num_draft_tokens, Adaptive) else (num_draft_tokens,)
    if isinstance(num_draft_tokens, Adaptive) and num_draft_tokens.prior.shape not in ((1,), (drafter.num_regimes,)):
        raise InputError(
            f"the adaptive menu has priors for {num_draft_tokens.prior.shape[0]} kinds of round, the drafter tells "
            f"{drafter.num_regimes} apart: build it with Adaptive.of(..., regimes=drafter.num_regimes)"
        )
    if 0 in sizes and not drafter.allows_plain_rounds:
        raise InputError(f"{type(drafter).__name__} cannot follow plain decoding steps: leave 0 out of the menu")
    # A menu of plain steps alone (drafting never pays here) still commits rows to the drafter: check it as for K=1.
    drafting = ([k for k in sizes if k] or [1]) if isinstance(num_draft_tokens, Adaptive) else [num_draft_tokens]
    for k in drafting:
        if not 1 <= drafter.draft_shape(k).depth <= MAX_DRAFT_TOKENS:
            raise InputError(f"the number of draft tokens must be in 1..{MAX_DRAFT_TOKENS}, got {k}")
        drafter.validate(cfg, k)


def generate(
    weights: Weights,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    drafter: Drafter,
    num_draft_tokens: int | Adaptive,
    max_new_tokens: int,
    seed: int = 0,
    sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
    eos_ids: Sequence[int] | None = None,
    batch_size: int | None = None,
    num_samples: int = 1,
) -> SpecResult:
    """Generates a continuation of each prompt (one batch) with speculative decoding.

    Greedy output is token-identical to `specjax.decoding.autoregressive.generate`; sampled output has the target's distribution.

    Args:
      weights: the target weights.
      cfg: the target config.
      prompts: token ids per prompt (different lengths are fine).
      drafter: an NgramDrafter, LayerSkipDrafter, ModelDrafter, Eagle3Drafter or any other `Drafter`.
      num_draft_tokens: K, drafts per round (1..MAX_DRAFT_TOKENS): the drafter's `draft_shape(K)` sets each round's
        draft, a chain of K, or a tree drafter's own tree whatever K. Or an `Adaptive` menu
        (`specjax.adaptive.calibrated`): every round picks its draft size from it; where it would pick the plain
        step in every round (`specjax.adaptive.never_drafts`), this is plain decoding.
      max_new_tokens: the most tokens generated per prompt.
      seed: PRNG seed.
      sampling: one setting for every prompt, or one per prompt; greedy by default.
      eos_ids: tokens that end a row; defaults to the config's EOS ids.
      batch_size: compiled prompts per call (>= len(prompts)); extra prompts are padding. Defaults to len(prompts).
      num_samples: rows per prompt, which share the prompt's target prefill.
    Returns:
      A SpecResult with num_samples Completions per prompt (adjacent), in prompt order, and the acceptance
      statistics.
    """
    check_inputs(cfg, drafter, num_draft_tokens)
    adaptive = num_draft_tokens if isinstance(num_draft_tokens, Adaptive) else None
    depths = menu_depths(drafter, adaptive.menu) if adaptive is not None else []
    if adaptive is not None and never_drafts(adaptive, depths):
        plain = plain_generate(
            weights, cfg, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, eos_ids=eos_ids,
            batch_size=batch_size, num_samples=num_samples,
        )  # fmt: skip
        return as_plain_rounds(plain, adaptive.menu, max(depths))
    req = prepare_batch(cfg, prompts, max_new_tokens, eos_ids, batch_size, sampling, num_samples)
    args = (weights, drafter, jnp.asarray(req.tokens), jnp.asarray(req.lengths), jax.random.key(seed), req.sampling,
            jnp.asarray(req.active), adaptive)  # fmt: skip
    static = dict(cfg=cfg, num_draft_tokens=0 if adaptive else num_draft_tokens, max_new_tokens=max_new_tokens,
                  eos_ids=req.eos, num_samples=num_samples)  # fmt: skip
    compiled, compile_seconds = _compiled(speculative_decode, args, static)
    t0 = time.perf_counter()
    result = compiled(*args)
    out, num_new, rounds, hist, by_entry, seen = jax.device_get(
        (result.out_bn, result.num_new_b, result.rounds, result.accepted_hist, result.menu_rounds, result.evidence)
    )
    seconds = time.perf_counter() - t0
    results = completions(req.row_prompts, out, num_new, req.eos)
    new_tokens = sum(len(c.output_ids) for c in results)
    stats = SpecStats.from_histogram(int(rounds), hist, new_tokens, seconds)
    menu = adaptive.menu if adaptive else (num_draft_tokens,)
    stats = dataclasses.replace(
        stats,
        rounds_by_drafts={k: int(r) for k, r in zip(menu, by_entry)},
        acceptance_evidence=[(float(a), float(t)) for a, t in seen] if adaptive else [],
        plain_steps=max((len(c.output_ids) for c in results), default=1) - 1,
    )
    return SpecResult(results, seconds, compile_seconds, stats)
