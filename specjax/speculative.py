"""Exact speculative decoding: draft K tokens, verify all K+1 positions in one target forward, accept, repeat.

The whole loop is one `jax.jit` around `lax.while_loop` with a pytree state; it compiles once per
(batch, prompt bucket, max_new_tokens, K, drafter options, sampling) and makes no host round trip per round.
Rows accept independently; a row stops at EOS or max_new_tokens while the others go on.

Bookkeeping per row: `tokens_bs` holds the prompt and the generated tokens; `length_b` of them are committed. The
last committed token is "pending": the target has not seen it yet, so the target cache holds `length_b - 1` tokens.
A round feeds [pending, d_1 .. d_K] at positions length_b - 1 + arange(K + 1), accepts n drafts, emits
d_1 .. d_n plus one token from the target (the correction, or the bonus when n = K), and advances the cache by
n + 1. Rejected drafts' KV slots are simply never committed; later rounds overwrite them.

A drafter with a `tree` (a `specjax.tree.TreeSpec`, e.g. the EAGLE-3 drafter) instead proposes a draft tree of
`budget` nodes rooted at the pending token; one target forward verifies it under the ancestor mask, the accepted
path (at most `depth` = K drafts) is chosen by `specjax.tree`, and its KV is compacted into contiguous slots. Drafters
with `tap_layers` get the target's taps, and `commit` sees the committed rows after the prefill and every round.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig, SamplingConfig
from specjax.drafters.base import Drafter, commit_to, extra_slots_of, tap_layers_of
from specjax.errors import InputError
from specjax.generate import Completion, _compiled, _is_eos, completions, prefill, prepare_batch
from specjax.kv_cache import KVCache
from specjax.models.llama import Weights, forward
from specjax.sampling import probabilities, sample
from specjax.tree import compact_path, greedy_tree_accept, tree_accept

MAX_DRAFT_TOKENS = 32


# ---------------------------------------------------------------------------------------------------------------
# Acceptance rules: pure functions of one round.


def greedy_accept(draft_tokens_bk: jax.Array, target_tokens_bk1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy acceptance: a draft token is accepted while it equals the target's argmax.

    Args:
      draft_tokens_bk: int32 [B, K] draft tokens.
      target_tokens_bk1: int32 [B, K+1] the target's argmax after the pending token and after each draft token.
    Returns:
      (accepted drafts n [B] in 0..K, next token [B]: the target's argmax at position n — the correction, or the
      bonus token when n = K).
    """
    K = draft_tokens_bk.shape[1]
    match = draft_tokens_bk == target_tokens_bk1[:, :K]
    n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
    return n, jnp.take_along_axis(target_tokens_bk1, n[:, None], axis=1)[:, 0]


def residual_probs(target_probs: jax.Array, draft_probs: jax.Array) -> jax.Array:
    """normalise(max(0, target_probs - draft_probs)): where to sample after a rejection.

    When the two are equal the rejection has probability 0; target_probs is returned then to stay well defined.
    """
    residual = jnp.maximum(target_probs - draft_probs, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    return jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), target_probs)


def speculative_accept(
    key: jax.Array, draft_tokens_bk: jax.Array, draft_probs_bkv: jax.Array, target_probs_bk1v: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The exact chain rule (Leviathan et al. 2023; Chen et al. 2023) for one round.

    Draft token x_i is accepted with probability min(1, target_probs_i[x_i] / draft_probs_i[x_i]), in order, until
    the first rejection; at a rejection at position n the next token is drawn from
    normalise(max(0, target_probs_n - draft_probs_n)); when all K are accepted the bonus token is drawn from
    target_probs_K. The emitted tokens are then distributed exactly as target sampling, provided each x_i was drawn
    from draft_probs_i and both distributions went through the same temperature / top-k / top-p processing.

    Args:
      key: PRNG key.
      draft_tokens_bk: int32 [B, K].
      draft_probs_bkv: float [B, K, V], the distributions the drafts were drawn from.
      target_probs_bk1v: float [B, K+1, V], the target's distributions after the pending token and each draft.
    Returns:
      (accepted drafts n [B] in 0..K, next token [B]).
    """
    B, K = draft_tokens_bk.shape
    k_accept, k_next = jax.random.split(key)
    tgt = jnp.take_along_axis(target_probs_bk1v[:, :K], draft_tokens_bk[..., None], axis=-1)[..., 0]
    drf = jnp.take_along_axis(draft_probs_bkv, draft_tokens_bk[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_accept, (B, K))
    accept = u * drf < tgt  # u < target/draft without dividing; draft_probs[x] > 0 since x was drawn from it
    n = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
    padded_draft = jnp.concatenate([draft_probs_bkv, jnp.zeros_like(draft_probs_bkv[:, :1])], axis=1)
    at_n = lambda x: jnp.take_along_axis(x, n[:, None, None], axis=1)[:, 0]  # noqa: E731
    dist = residual_probs(at_n(target_probs_bk1v), at_n(padded_draft))  # at n = K: residual(p, 0) = p, the bonus
    nxt = jax.random.categorical(k_next, jnp.log(dist), axis=-1).astype(jnp.int32)
    return n, nxt


# ---------------------------------------------------------------------------------------------------------------
# The loop.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    tokens_bs: jax.Array  # [B, P + max_new + K + 1] prompt then generated tokens; slots >= length_b are stale
    length_b: jax.Array  # [B] committed tokens (prompt + generated); the last one is pending
    num_new_b: jax.Array  # [B] generated tokens
    done_b: jax.Array  # [B] the row produced EOS or reached max_new_tokens
    cache: KVCache  # target cache; lengths == length_b - 1
    draft_state: Any  # the drafter's pytree
    key: jax.Array
    rounds: jax.Array  # [] loop iterations
    accepted_hist: jax.Array  # [K + 1] row-rounds (of rows still running) that accepted 0..K drafts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecOutput:
    out_bn: jax.Array  # [B, max_new] generated tokens (pad after num_new_b)
    num_new_b: jax.Array  # [B]
    rounds: jax.Array  # []
    accepted_hist: jax.Array  # [K + 1]
    state: SpecState  # the final state (target cache, token buffer) for inspection


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "num_draft_tokens", "max_new_tokens", "eos_ids"))
def speculative_decode(
    weights: Weights,
    drafter: Drafter,
    tokens_bp: jax.Array,
    lengths_b: jax.Array,
    key: jax.Array,
    active_b: jax.Array | None = None,
    *,
    cfg: ModelConfig,
    sampling: SamplingConfig,
    num_draft_tokens: int,
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
) -> SpecOutput:
    """Speculative decoding of a padded batch, entirely on device.

    Args:
      weights: the target weights.
      drafter: any `Drafter` (a pytree).
      tokens_bp: int32 [B, P] right-padded prompts.
      lengths_b: int32 [B] prompt lengths.
      key: PRNG key (unused when greedy).
      active_b: optional bool [B]; rows that are False (batch padding) start finished: they generate one token,
        never run a round and do not count in the statistics.
      cfg: static target config.
      sampling: static sampling config, applied to target and draft alike.
      num_draft_tokens: static K >= 1.
      max_new_tokens: static; at most this many tokens per row.
      eos_ids: static; a row stops after producing one of these.
    Returns:
      A SpecOutput.
    """
    B, P = tokens_bp.shape
    K = num_draft_tokens
    tree = getattr(drafter, "tree", None)  # a TreeSpec: verify a draft tree; K is then its depth
    taps = tap_layers_of(drafter)
    extra = extra_slots_of(drafter, K)
    num_slots = P + max_new_tokens + extra + 1
    pad = eos_ids[0] if eos_ids else 0
    # The barrier keeps XLA from constant-folding attention over the empty (all-zero) cache, which took minutes to
    # compile at large batch sizes.
    cache = jax.lax.optimization_barrier(KVCache.empty(cfg, B, num_slots, weights.embed.dtype))
    logits_bv, taps_bpf, cache = prefill(weights, cfg, tokens_bp, lengths_b, cache, tap_layers=taps)
    key, sub = jax.random.split(key)
    first = sample(sub, logits_bv, sampling)
    rows = jnp.arange(B)
    tokens_bs = jnp.full((B, num_slots), pad, jnp.int32).at[:, :P].set(tokens_bp).at[rows, lengths_b].set(first)
    draft_state = jax.lax.optimization_barrier(drafter.init(tokens_bp, lengths_b, num_slots))
    # The prompt rows: row j's next token is x[j + 1]; the last prompt row's is the first sampled token.
    draft_state = commit_to(drafter, draft_state, tokens_bs[:, 1 : P + 1], taps_bpf, lengths_b)
    state = SpecState(
        tokens_bs=tokens_bs,
        length_b=lengths_b + 1,
        num_new_b=jnp.ones((B,), jnp.int32),
        done_b=_is_eos(first, eos_ids) | (max_new_tokens == 1) | (False if active_b is None else ~active_b),
        cache=cache,
        draft_state=draft_state,
        key=key,
        rounds=jnp.int32(0),
        accepted_hist=jnp.zeros((K + 1,), jnp.int32),
    )
    j = jnp.arange(K + 1)[None, :]

    def verify_chain(s: SpecState, k_draft, k_accept):
        draft_bk, draft_probs, draft_state = drafter.propose(
            s.draft_state, s.tokens_bs, s.length_b, k_draft,
            num_draft_tokens=K, vocab_size=cfg.vocab_size, sampling=sampling,
        )  # fmt: skip
        pending = jnp.take_along_axis(s.tokens_bs, (s.length_b - 1)[:, None], axis=1)
        verify_bt = jnp.concatenate([pending, draft_bk], axis=1)
        positions = (s.length_b - 1)[:, None] + j
        logits, taps_btf, cache = forward(weights, cfg, verify_bt, positions, s.cache, tap_layers=taps)
        if sampling.greedy:
            n, nxt = greedy_accept(draft_bk, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        else:
            n, nxt = speculative_accept(k_accept, draft_bk, draft_probs, probabilities(logits, sampling))
        # Emitted this round: d_1 .. d_n, then nxt.
        emitted = jnp.where(j < n[:, None], jnp.concatenate([draft_bk, draft_bk[:, :1]], axis=1), nxt[:, None])
        return n, emitted, taps_btf, cache, draft_state

    def verify_tree(s: SpecState, k_draft, k_accept):
        pending = jnp.take_along_axis(s.tokens_bs, (s.length_b - 1)[:, None], axis=1)[:, 0]
        draft, draft_state = drafter.propose_tree(s.draft_state, pending, k_draft, sampling)
        base = s.length_b - 1
        logits, taps_btf, cache = forward(
            weights, cfg, draft.tokens, base[:, None] + draft.depths, s.cache, new_mask_btt=draft.ancestors,
            tap_layers=taps,
        )  # fmt: skip
        if sampling.greedy:
            n, nxt, path = greedy_tree_accept(draft, logits, K)
        else:
            n, nxt, path = tree_accept(k_accept, draft, probabilities(logits, sampling), K)
        cache = compact_path(cache, base, path)
        path_tokens = jnp.take_along_axis(draft.tokens, path, axis=1)  # [B, K + 1], root first
        emitted = jnp.where(j < n[:, None], jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], 1), nxt[:, None])
        if taps_btf is not None:
            taps_btf = jnp.take_along_axis(taps_btf, path[..., None], axis=1)
        return n, emitted, taps_btf, cache, draft_state

    def step(s: SpecState) -> SpecState:
        key, k_draft, k_accept = jax.random.split(s.key, 3)
        n, emitted, taps_btf, cache, draft_state = (verify_tree if tree is not None else verify_chain)(
            s, k_draft, k_accept
        )
        # Cut at the first EOS and at max_new_tokens.
        eos_at = jnp.where(_is_eos(emitted, eos_ids) & (j <= n[:, None]), j, K + 1).min(axis=1)
        count = jnp.minimum(jnp.minimum(n + 1, eos_at + 1), max_new_tokens - s.num_new_b)
        count = jnp.where(s.done_b, 0, count)
        slots = s.length_b[:, None] + j
        tokens_bs = s.tokens_bs.at[rows[:, None], jnp.where(j < count[:, None], slots, num_slots)].set(
            emitted, mode="drop"
        )
        num_new = s.num_new_b + count
        done = s.done_b | (eos_at < count) | (num_new >= max_new_tokens)
        draft_state = commit_to(drafter, draft_state, emitted, taps_btf, count)
        running = (~s.done_b).astype(jnp.int32)
        hist = s.accepted_hist + jnp.sum(jax.nn.one_hot(n, K + 1, dtype=jnp.int32) * running[:, None], axis=0)
        return SpecState(
            tokens_bs=tokens_bs,
            length_b=s.length_b + count,
            num_new_b=num_new,
            done_b=done,
            cache=cache.advance(count),
            draft_state=draft_state,
            key=key,
            rounds=s.rounds + 1,
            accepted_hist=hist,
        )

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done_b), step, state)
    out_slots = lengths_b[:, None] + jnp.arange(max_new_tokens)[None, :]
    out = jnp.take_along_axis(state.tokens_bs, out_slots, axis=1)
    out = jnp.where(jnp.arange(max_new_tokens)[None, :] < state.num_new_b[:, None], out, pad)
    return SpecOutput(out, state.num_new_b, state.rounds, state.accepted_hist, state)


# ---------------------------------------------------------------------------------------------------------------
# Host-side entry point.


@dataclasses.dataclass(frozen=True)
class SpecStats:
    """What the drafts bought. Row-rounds count each running row once per round."""

    rounds: int  # loop iterations (verification passes of the whole batch)
    mean_accepted: float  # tokens emitted per row-round, counting the correction / bonus token (before EOS cuts)
    acceptance_by_position: list[float]  # [K] fraction of row-rounds whose draft i was accepted
    accepted_histogram: list[int]  # [K + 1] row-rounds that accepted 0..K drafts
    new_tokens: int
    tokens_per_s: float

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


def check_inputs(cfg: ModelConfig, drafter: Drafter, num_draft_tokens: int) -> None:
    """Raises InputError for a K out of range or a drafter that cannot serve this target."""
    if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise InputError(f"the number of draft tokens must be in 1..{MAX_DRAFT_TOKENS}, got {num_draft_tokens}")
    if not isinstance(drafter, Drafter):
        raise InputError(f"{type(drafter).__name__} is not a drafter (needs validate, init and propose)")
    drafter.validate(cfg, num_draft_tokens)


def generate(
    weights: Weights,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    drafter: Drafter,
    num_draft_tokens: int,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    batch_size: int | None = None,
) -> SpecResult:
    """Generates a continuation of each prompt (one batch) with speculative decoding.

    Greedy output is token-identical to `specjax.generate.generate`; sampled output has the target's distribution.

    Args:
      weights: the target weights.
      cfg: the target config.
      prompts: token ids per prompt (different lengths are fine).
      drafter: an NgramDrafter, LayerSkipDrafter, ModelDrafter or any other `Drafter`.
      num_draft_tokens: K, drafts per round (1..MAX_DRAFT_TOKENS); ignored for a tree drafter (K = tree depth).
      max_new_tokens: the most tokens generated per prompt.
      sampling: greedy by default.
      seed: PRNG seed.
      eos_ids: tokens that end a row; defaults to the config's EOS ids.
      batch_size: compiled batch size (>= len(prompts)); extra rows are padding. Defaults to len(prompts).
    Returns:
      A SpecResult with one Completion per prompt, in order, and the acceptance statistics.
    """
    tree = getattr(drafter, "tree", None)
    if tree is not None:
        num_draft_tokens = tree.depth  # a tree drafter verifies `budget` nodes; K is the deepest path
    check_inputs(cfg, drafter, num_draft_tokens)
    tokens, lengths, eos = prepare_batch(cfg, prompts, max_new_tokens, eos_ids, batch_size)
    batch = len(tokens)
    active = jnp.arange(batch) < len(prompts)
    args = (weights, drafter, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(seed), active)
    static = dict(
        cfg=cfg, sampling=sampling, num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens, eos_ids=eos
    )
    compiled, compile_seconds = _compiled(speculative_decode, args, static)
    t0 = time.perf_counter()
    result = compiled(*args)
    out, num_new, rounds, hist = jax.device_get((result.out_bn, result.num_new_b, result.rounds, result.accepted_hist))
    seconds = time.perf_counter() - t0
    results = completions(prompts, out, num_new, eos)
    new_tokens = sum(len(c.output_ids) for c in results)
    stats = SpecStats.from_histogram(int(rounds), hist, new_tokens, seconds)
    return SpecResult(results, seconds, compile_seconds, stats)
