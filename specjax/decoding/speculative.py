"""Exact speculative decoding: every round drafts, verifies, accepts, writes and commits, inside one jit.

The loop is one `lax.while_loop` over a pytree state (`SpecState`); it compiles once per (batch, number of slots S,
prefill chunk, drafter options, policy menu, greedy or sampled), each row's max_new_tokens being data, and makes no
host round trip per round. Rows accept independently; a row stops at EOS or its max_new_tokens while the others go
on.

Per row, `tokens_bs` holds the prompt and the generated tokens, `length_b` of them committed. The last committed
token is pending: the target has not run on it, so the target cache holds `length_b - 1` tokens. A round:
  draft   the drafter proposes a tree of the static shape `draft_shape(k)` rooted at the pending token (a chain of k,
          or a tree drafter's own tree; a plain step is the pending token alone, `TreeSpec.chain(0)`);
  verify  one target forward over its nodes at positions length_b - 1 + depth, under their ancestor mask, which
          only reads the cache;
  accept  `specjax.decoding.acceptance` keeps n drafts along one path and adds one target token;
  write   the path's keys and values go to the cache slots after the committed text, which advances by n + 1 (cut at
          EOS and max_new_tokens); slots past it are never committed, and later rounds overwrite them;
  commit  the drafter sees the committed rows (and the target's taps there).
The policy (`specjax.adaptive`: `Fixed(K)` or `Adaptive`) picks each round's menu entry; the loop holds one round
per entry and `lax.switch`es between them. Rounds only read the cache, so the cache never passes through the switch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.adaptive import Adaptive, Fixed, Policy, menu_depths, menu_shapes
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.acceptance import accept
from specjax.decoding.autoregressive import GenerateResult
from specjax.decoding.autoregressive import generate as plain_generate
from specjax.decoding.batch import (
    compiled,
    completions,
    is_eos,
    on_mesh,
    prepare_batch,
    to_host,
)
from specjax.decoding.stats import SpecResult, SpecStats
from specjax.drafters.base import Drafter, pending_tokens
from specjax.drafters.tree import MAX_DRAFT_TOKENS, DraftTree, TreeSpec, path_to
from specjax.errors import InputError
from specjax.models import llama
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Weights, chunk_size, forward_new_kv, num_chunks
from specjax.sampling import Sampling, sample, split_rows
from specjax.sharding import constrain, get_rows, set_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    tokens_bs: jax.Array  # [B, S] prompt then generated tokens; slots >= length_b are stale
    length_b: jax.Array  # [B] committed tokens (prompt + generated); the last one is pending
    num_new_b: jax.Array  # [B] generated tokens
    done_b: jax.Array  # [B] the row produced EOS or reached its max_new_tokens
    cache: KVCache | None  # the target's; lengths == length_b - 1 (None inside a round, which only reads it)
    draft_state: Any  # the drafter's pytree
    policy_state: Any  # the policy's pytree
    rounds: jax.Array  # [] loop iterations
    accepted_hist: jax.Array  # [D + 1] row-rounds (of rows still running) that accepted 0..D drafts
    menu_rounds: jax.Array  # [M] rounds of each menu entry
    keys_b: jax.Array  # [B] typed PRNG keys: each row's own, split every round


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecOutput:
    out_bn: jax.Array  # [B, S] generated tokens (pad after num_new_b)
    state: SpecState  # the final state: counts, the policy's state, the target cache and token buffer


class Path(NamedTuple):
    """A round's accepted path, padded to D + 1 rows: what `write_back` writes after the round."""

    k: jax.Array  # [L, B, D + 1, K, H] target keys of the path's nodes
    v: jax.Array
    tokens: jax.Array  # [B, D + 1] emitted tokens (the first `count` are committed)
    taps: jax.Array | None  # [B, D + 1, F] the target's taps at the path's nodes (drafters with tap_layers)


@dataclasses.dataclass(frozen=True)
class Loop:
    """What every round of one call reads: its inputs and static shapes."""

    weights: Weights
    drafter: Drafter
    policy: Policy
    sampling: Sampling
    cfg: ModelConfig
    shapes: tuple[TreeSpec, ...]  # each menu entry's draft
    max_new_b: jax.Array  # [B] each row's most new tokens
    eos_ids: tuple[int, ...]
    prefill_chunk: int

    @property
    def depth(self) -> int:
        """D: the deepest draft of the menu."""
        return max(shape.depth for shape in self.shapes)

    @property
    def capacity(self) -> int:
        """Slots past S the target cache holds for the menu's largest draft."""
        return max(shape.capacity for shape in self.shapes)


def start(loop: Loop, tokens_up, lengths_u, keys_b, active_b, num_samples: int) -> tuple[SpecState, jax.Array]:
    """The state after the prefill and its first sampled token; and the rows' prompt lengths.

    The drafter commits the prompt chunk by chunk, as the prefill makes the target's taps (`commit` is per position,
    as the loop's own commits of each round's path are), rather than once from a [B, S, F] buffer of them, which at
    long contexts would rival the cache. Each row's last prompt position waits, its taps kept, for the token after
    it: the first sampled one. The three steps are apart so that a prefill can run a few chunks at a time
    (`specjax.decoding.engine`)."""
    prefilled = prefill_and_commit(
        loop,
        begin_prefill(loop, tokens_up, lengths_u, num_samples),
        tokens_up,
        lengths_u,
        num_samples,
        0,
        num_chunks(lengths_u, chunk_size(loop.prefill_chunk, tokens_up.shape[1])),
    )
    return after_prefill(loop, prefilled, tokens_up, lengths_u, keys_b, active_b, num_samples)


class Prefilled(NamedTuple):
    """A prefill so far (`begin_prefill`, `prefill_and_commit`)."""

    logits_uv: jax.Array  # [U, V] the logits at each prompt's last position, once its chunk is in
    seen: tuple  # (the drafter's state [B], the last prompt position's taps [B, F] or None)
    cache: KVCache  # the target's [U]


def begin_prefill(loop: Loop, tokens_up, lengths_u, num_samples: int) -> Prefilled:
    """A prefill before its first chunk: zero logits, the drafter's fresh state and the target's empty cache."""
    U, P = tokens_up.shape
    B, taps = U * num_samples, loop.drafter.traits.tap_layers
    tokens_bp, lengths_b = (jnp.repeat(x, num_samples, axis=0) for x in (tokens_up, lengths_u))
    # The barriers keep XLA from constant-folding work over the empty (all-zero) caches.
    draft_state = jax.lax.optimization_barrier(loop.drafter.init(tokens_bp, lengths_b, P + loop.capacity))
    cache = jax.lax.optimization_barrier(KVCache.empty(loop.cfg, U, P + loop.capacity, loop.weights.embed.dtype))
    last0 = jnp.zeros((B, len(taps) * loop.cfg.hidden_size), loop.weights.embed.dtype) if taps else None
    return Prefilled(jnp.zeros((U, loop.cfg.vocab_size), jnp.float32), (draft_state, last0), cache)


def prefill_and_commit(
    loop: Loop, prefilled: Prefilled, tokens_up, lengths_u, num_samples: int, first, end
) -> Prefilled:
    """Prefill chunks `first` to `end` (exclusive) of the prompts, each committed by the drafter as it is made."""
    U, P = tokens_up.shape
    C = chunk_size(loop.prefill_chunk, P)
    tokens_bp, lengths_b = (jnp.repeat(x, num_samples, axis=0) for x in (tokens_up, lengths_u))

    def commit_chunk(seen, start, taps_ucf):
        """Commits the chunk's positions but each row's last prompt one, whose taps it keeps."""
        draft_state, last_bf = seen
        taps_bcf = None if taps_ucf is None else jnp.repeat(taps_ucf, num_samples, axis=0)
        next_bc = jnp.take(tokens_bp, start + 1 + jnp.arange(C), axis=1, mode="clip")
        at_b = lengths_b - 1 - start  # the last prompt position, in the chunk
        if taps_bcf is not None:
            here = ((at_b >= 0) & (at_b < C))[:, None]
            last_bf = jnp.where(here, get_rows(taps_bcf, jnp.clip(at_b, 0, C - 1)), last_bf)
        return loop.drafter.commit(draft_state, next_bc, taps_bcf, jnp.clip(at_b, 0, C)), last_bf

    tokens_up = constrain(tokens_up, ("batch", None))  # rows over the data axis of a mesh
    carry = llama.prefill_chunks(
        loop.weights,
        loop.cfg,
        tokens_up,
        lengths_u,
        tuple(prefilled),
        first,
        end,
        C,
        loop.drafter.traits.tap_layers,
        commit_chunk,
    )
    return Prefilled(*carry)


def after_prefill(loop: Loop, prefilled: Prefilled, tokens_up, lengths_u, keys_b, active_b, num_samples: int):
    """The state once every chunk is in: the first token sampled from the last prompt position's logits, and
    committed; the prompt's N samples given adjacent rows. Returns (state, the rows' prompt lengths)."""
    U, P = tokens_up.shape
    B = U * num_samples
    logits_uv, (draft_state, last_bf), cache = prefilled
    logits_bv, cache = jnp.repeat(logits_uv, num_samples, axis=0), cache.at_lengths(lengths_u)
    if num_samples > 1:
        cache = cache.repeat_rows(num_samples)
    lengths_b = jnp.repeat(lengths_u, num_samples, axis=0)
    pad = loop.eos_ids[0] if loop.eos_ids else 0
    keys_b, first_keys_b = split_rows(keys_b)
    first = sample(first_keys_b, logits_bv, loop.sampling)
    tokens_bs = jnp.full((B, P + loop.capacity), pad, jnp.int32).at[:, :P].set(jnp.repeat(tokens_up, num_samples, 0))
    tokens_bs = set_rows(tokens_bs, lengths_b, first)
    last_b1f = None if last_bf is None else last_bf[:, None]
    draft_state = loop.drafter.commit(draft_state, first[:, None], last_b1f, jnp.ones((B,), jnp.int32))
    depths = [shape.depth for shape in loop.shapes]
    state = SpecState(
        tokens_bs=tokens_bs,
        length_b=lengths_b + 1,
        num_new_b=jnp.ones((B,), jnp.int32),
        done_b=is_eos(first, loop.eos_ids) | (loop.max_new_b <= 1) | (False if active_b is None else ~active_b),
        cache=cache,
        draft_state=draft_state,
        policy_state=loop.policy.start(depths, B, loop.drafter.traits.regimes),
        rounds=jnp.int32(0),
        accepted_hist=jnp.zeros((loop.depth + 1,), jnp.int32),
        menu_rounds=jnp.zeros((len(loop.shapes),), jnp.int32),
        keys_b=keys_b,
    )
    return state, lengths_b


def draft_verify_accept(
    loop: Loop, entry: int, s: SpecState, regime_b: jax.Array, upkeep: bool = True
) -> tuple[SpecState, Path]:
    """One round of menu entry `entry` (static), reading the cache only: the next state without its cache, and the
    accepted path that `write_back` writes (padded to the menu's depth D, so every entry returns one shape). Without
    `upkeep` (a plain step only) the target computes no taps for the drafter."""
    shape, D = loop.shapes[entry], loop.depth
    B, V = s.tokens_bs.shape[0], loop.cfg.vocab_size
    j = jnp.arange(shape.depth + 1)[None, :]
    keys_b, draft_keys_b, accept_keys_b = split_rows(s.keys_b, 3)

    # Draft.
    if shape.depth == 0:  # a plain step: the pending token alone, its next token from the target
        none = jnp.zeros((B, 0), jnp.int32)
        draft = DraftTree.chain(pending_tokens(s.tokens_bs, s.length_b), none, jnp.zeros((B, 0, V), jnp.float32))
        draft_state = s.draft_state
    else:
        draft, draft_state = loop.drafter.propose(
            s.draft_state, s.tokens_bs, s.length_b, draft_keys_b, shape=shape, vocab_size=V, sampling=loop.sampling
        )

    # Verify.
    taps = loop.drafter.traits.tap_layers if upkeep else ()
    logits, taps_btf, k_new, v_new = forward_new_kv(
        loop.weights,
        loop.cfg,
        draft.tokens,
        (s.length_b - 1)[:, None] + draft.depths,
        s.cache,
        new_mask_btt=None if shape.is_chain else draft.ancestors,
        tap_layers=taps,
    )

    # Accept: n drafts along one path, then the target's token. A chain's path is its nodes 0..n, in place.
    n, nxt, last = accept(accept_keys_b, draft, logits, loop.sampling)
    path_tokens, path_taps = draft.tokens, taps_btf
    if not shape.is_chain:
        path = path_to(draft, last, n, shape.depth)
        path_tokens = jnp.take_along_axis(draft.tokens, path, axis=1)
        path_taps = None if taps_btf is None else jnp.take_along_axis(taps_btf, path[..., None], axis=1)
        k_new, v_new = (jnp.take_along_axis(x, path[None, :, :, None, None], axis=2) for x in (k_new, v_new))

    # Emitted: the accepted drafts, then nxt; cut at the first EOS and at the row's max_new_tokens.
    emitted = jnp.where(j < n[:, None], jnp.roll(path_tokens, -1, axis=1), nxt[:, None])
    eos_at = jnp.where(is_eos(emitted, loop.eos_ids) & (j <= n[:, None]), j, shape.depth + 1).min(axis=1)
    count = jnp.minimum(jnp.minimum(n + 1, eos_at + 1), loop.max_new_b - s.num_new_b)
    count = jnp.where(s.done_b, 0, count)
    slots = jnp.where(j < count[:, None], s.length_b[:, None] + j, s.tokens_bs.shape[1])
    num_new = s.num_new_b + count
    running = ~s.done_b
    after = dataclasses.replace(
        s,
        tokens_bs=set_rows(s.tokens_bs, slots, emitted),
        length_b=s.length_b + count,
        num_new_b=num_new,
        done_b=s.done_b | (eos_at < count) | (num_new >= loop.max_new_b),
        cache=None,
        draft_state=draft_state,
        policy_state=loop.policy.observe(s.policy_state, entry, shape.depth, regime_b, n, count, running),
        rounds=s.rounds + 1,
        accepted_hist=s.accepted_hist + jnp.sum(jax.nn.one_hot(n, D + 1, dtype=jnp.int32) * running[:, None], axis=0),
        menu_rounds=s.menu_rounds.at[entry].add(1),
        keys_b=keys_b,
    )
    pad = D - shape.depth  # every entry's path: D + 1 slots
    k_path, v_path = (jnp.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0), (0, 0)]) for x in (k_new, v_new))
    path_taps = None if path_taps is None else jnp.pad(path_taps, [(0, 0), (0, pad), (0, 0)])
    return after, Path(k_path, v_path, jnp.pad(emitted, [(0, 0), (0, pad)]), path_taps)


def write_back(loop: Loop, before: SpecState, after: SpecState, path: Path, upkeep: bool = True) -> SpecState:
    """`after` with the target cache written and advanced by each row's committed count, and (with `upkeep`) the
    drafter's commit."""
    count = after.length_b - before.length_b
    draft_state = loop.drafter.commit(after.draft_state, path.tokens, path.taps, count) if upkeep else after.draft_state
    return dataclasses.replace(after, cache=before.cache.write(path.k, path.v).advance(count), draft_state=draft_state)


def switch_in_halves(index: jax.Array, branches: Sequence[Callable], *operands):
    """`lax.switch` as a tree of two-way conditionals: XLA's CPU backend runs a many-way conditional over the loop's
    state markedly slower than two-way ones (a menu of six: 13% of a plain step of 4 rows, where two cost nothing)."""
    if len(branches) == 1:
        return branches[0](*operands)
    half = len(branches) // 2
    return jax.lax.cond(
        index < half,
        lambda *o: switch_in_halves(index, branches[:half], *o),
        lambda *o: switch_in_halves(index - half, branches[half:], *o),
        *operands,
    )


def next_round(loop: Loop, s: SpecState) -> SpecState:
    """One round: the policy picks its menu entry, whose draft is verified and accepted, then written back."""
    depths = [shape.depth for shape in loop.shapes]
    regime_b = loop.drafter.regime(s.draft_state, s.tokens_bs, s.length_b)
    remaining_b = jnp.where(s.done_b, 0, loop.max_new_b - s.num_new_b)
    entry = loop.policy.choose(s.policy_state, depths, regime_b, remaining_b)
    rounds = [functools.partial(draft_verify_accept, loop, entry) for entry in range(len(loop.shapes))]
    after, path = switch_in_halves(entry, rounds, s, regime_b)
    return write_back(loop, s, after, path)


def plain_round(loop: Loop, s: SpecState) -> SpecState:
    """The menu's plain step for every row, without the drafter's upkeep (no taps, no commit, no regime): the rounds
    of a batch whose drafting lost. The drafter's state stays where it was, behind the rows; drafts proposed from it
    later are still verified exactly (a draft is a proposal), they only accept less."""
    entry = [shape.depth for shape in loop.shapes].index(0)
    regime_b = jnp.zeros_like(s.length_b)
    after, path = draft_verify_accept(loop, entry, s, regime_b, upkeep=False)
    return write_back(loop, s, after, path, upkeep=False)


def finish(loop: Loop, s: SpecState, prompt_lengths_b: jax.Array) -> SpecOutput:
    """The generated tokens of each row [B, S] (S the prompts' width), padded after its count."""
    positions = jnp.arange(s.tokens_bs.shape[1] - loop.capacity)[None, :]
    out = jnp.take_along_axis(s.tokens_bs, prompt_lengths_b[:, None] + positions, axis=1)
    out = jnp.where(positions < s.num_new_b[:, None], out, loop.eos_ids[0] if loop.eos_ids else 0)
    return SpecOutput(out, s)


@functools.partial(jax.jit, static_argnames=("cfg", "eos_ids", "num_samples", "prefill_chunk"))
def speculative_decode(
    weights: Weights,
    drafter: Drafter,
    policy: Policy,
    tokens_up: jax.Array,
    lengths_u: jax.Array,
    max_new_b: jax.Array,
    keys_b: jax.Array,
    sampling: Sampling,
    active_b: jax.Array | None = None,
    *,
    cfg: ModelConfig,
    eos_ids: tuple[int, ...],
    num_samples: int = 1,
    prefill_chunk: int,
) -> SpecOutput:
    """Speculative decoding of a padded batch, entirely on device: B = U * num_samples rows.

    Args:
      weights: the target weights.
      drafter: any `Drafter` (a pytree).
      policy: `Fixed(K)` or an `Adaptive` menu (pytrees; their menus are static).
      tokens_up: int32 [U, S] prompts right-padded to S = `num_slots(...)`: the target cache holds S slots per row
        plus the menu's deepest draft capacity.
      lengths_u: int32 [U] prompt lengths.
      max_new_b: int32 [B] the most tokens each row generates, at most S - its prompt length (data).
      keys_b: typed PRNG keys [B], one per row (unused when greedy): a row's draws come from its key alone.
      sampling: the rows' sampling values, applied to target and draft alike (data; only `sampling.greedy` is
        static).
      active_b: optional bool [B]; rows that are False (batch padding) start finished: they generate one token,
        never run a round and do not count in the statistics.
      cfg: static target config.
      eos_ids: static; a row stops after producing one of these.
      num_samples: static; rows per prompt (adjacent), sharing the prompt's target prefill.
      prefill_chunk: static; prompt tokens per prefill forward.
    """
    shapes = tuple(menu_shapes(drafter, policy.menu))
    loop = Loop(weights, drafter, policy, sampling, cfg, shapes, max_new_b, eos_ids, prefill_chunk)
    state, prompt_lengths_b = start(loop, tokens_up, lengths_u, keys_b, active_b, num_samples)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done_b), functools.partial(next_round, loop), state)
    return finish(loop, state, prompt_lengths_b)


# ---------------------------------------------------------------------------------------------------------------
# Host side.


def as_policy(num_draft_tokens: int | Policy) -> Policy:
    """An int K is `Fixed(K)`."""
    return Fixed(int(num_draft_tokens)) if isinstance(num_draft_tokens, int) else num_draft_tokens


def check_inputs(cfg: ModelConfig, drafter: Drafter, policy: Policy) -> None:
    """Raises InputError for a drafter that cannot serve this target, a draft out of range, or an adaptive menu with a
    plain step for a drafter that cannot follow one."""
    if not isinstance(drafter, Drafter):
        raise InputError(
            f"{type(drafter).__name__} is not a drafter (see specjax.drafters.Drafter: subclass ChainDrafter and "
            "implement propose_chain)"
        )
    if not isinstance(policy, (Fixed, Adaptive)):
        raise InputError(f"num_draft_tokens is an int K, Fixed(K) or an Adaptive menu, got {type(policy).__name__}")
    traits = drafter.traits
    if isinstance(policy, Adaptive) and policy.prior.shape not in ((1,), (traits.regimes,)):
        raise InputError(
            f"the adaptive menu has priors for {policy.prior.shape[0]} kinds of round, the drafter tells "
            f"{traits.regimes} apart: build it with Adaptive.of(..., regimes=drafter.traits.regimes)"
        )
    if 0 in policy.menu and not traits.plain_rounds:
        raise InputError(f"{type(drafter).__name__} cannot follow plain decoding steps: leave 0 out of the menu")
    # A fixed K must draft; an adaptive menu of plain steps alone still commits rows to the drafter: checked as K=1.
    for k in policy.menu if isinstance(policy, Fixed) else [k for k in policy.menu if k] or [1]:
        if not 1 <= drafter.draft_shape(k).depth <= MAX_DRAFT_TOKENS:
            raise InputError(f"the number of draft tokens must be in 1..{MAX_DRAFT_TOKENS}, got {k}")
        drafter.validate(cfg, k)


def prefilled_tokens(prompts: Sequence[Sequence[int]], prefill_chunk: int | None) -> int:
    """Tokens the prefill runs per row: the longest prompt, in whole chunks."""
    chunk = chunk_size(prefill_chunk)
    return -(-max(map(len, prompts)) // chunk) * chunk


def as_plain_rounds(plain: GenerateResult, menu: Sequence[int], depth: int, prompt_tokens: int) -> SpecResult:
    """Plain decoding's result as a speculative one whose every round was the menu's plain step."""
    steps = [len(c.output_ids) - 1 for c in plain.completions]  # the first token comes with the prefill
    stats = SpecStats.from_histogram(max(steps, default=0), [sum(steps)] + [0] * depth, plain.new_tokens, plain.seconds)
    rounds_by_drafts = {k: stats.rounds if k == 0 else 0 for k in menu}
    stats = dataclasses.replace(
        stats, rounds_by_drafts=rounds_by_drafts, plain_steps=stats.rounds, prompt_tokens=prompt_tokens
    )
    return SpecResult(plain.completions, plain.seconds, plain.compile_seconds, stats)


def speculative_generate(
    weights: Weights,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    drafter: Drafter,
    num_draft_tokens: int | Policy,
    max_new_tokens: int | Sequence[int],
    seed: int | Sequence[int] = 0,
    sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
    eos_ids: Sequence[int] | None = None,
    batch_size: int | None = None,
    num_samples: int = 1,
    prefill_chunk: int | None = None,
) -> SpecResult:
    """Generates a continuation of each prompt (one batch) with speculative decoding.

    Greedy output is token-identical to `specjax.decoding.autoregressive.generate`; sampled output has the target's
    distribution.

    Args:
      weights: the target weights.
      cfg: the target config.
      prompts: token ids per prompt (different lengths are fine).
      drafter: any `Drafter` (`specjax.drafters.drafter_from_spec` builds the shipped kinds).
      num_draft_tokens: K, drafts per round (1..MAX_DRAFT_TOKENS; the same as `Fixed(K)`): the drafter's
        `draft_shape(K)` is each round's draft, a chain of K or a tree drafter's own tree. Or an `Adaptive` menu
        (`specjax.measure.calibration.calibrated`): every round picks its draft size from it; where it would pick the
        plain step in every round (`never_drafts`), this is plain decoding.
      max_new_tokens: the most tokens generated per prompt: one for every prompt, or one per prompt.
      seed: PRNG seed: one for the request, or one per prompt (as `specjax.decoding.autoregressive.generate`).
      sampling: one setting for every prompt, or one per prompt; greedy by default.
      eos_ids: tokens that end a row; defaults to the config's EOS ids.
      batch_size: compiled prompts per call (>= len(prompts)); extra prompts are padding. Defaults to len(prompts).
      num_samples: rows per prompt, which share the prompt's target prefill.
      prefill_chunk: prompt tokens per prefill forward; defaults to the platform's (`chunk_size`).
    Returns:
      A SpecResult with num_samples Completions per prompt (adjacent), in prompt order, and the acceptance
      statistics.
    """
    policy = as_policy(num_draft_tokens)
    check_inputs(cfg, drafter, policy)
    depths = menu_depths(drafter, policy.menu)
    if policy.never_drafts(depths):
        plain = plain_generate(
            weights,
            cfg,
            prompts,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            seed=seed,
            eos_ids=eos_ids,
            batch_size=batch_size,
            num_samples=num_samples,
            prefill_chunk=prefill_chunk,
        )
        return as_plain_rounds(plain, policy.menu, max(depths), prefilled_tokens(prompts, prefill_chunk))
    req = prepare_batch(cfg, prompts, max_new_tokens, eos_ids, batch_size, sampling, num_samples, seed)
    args = (
        weights,
        drafter,
        policy,
        jnp.asarray(req.tokens),
        jnp.asarray(req.lengths),
        jnp.asarray(req.max_new),
        req.keys,
        req.sampling,
        jnp.asarray(req.active),
    )
    static = dict(cfg=cfg, eos_ids=req.eos, num_samples=num_samples, prefill_chunk=chunk_size(prefill_chunk))
    args = on_mesh(args)
    executable, compile_seconds = compiled(speculative_decode, args, static)
    t0 = time.perf_counter()
    result = executable(*args)
    s = result.state
    out, num_new, rounds, hist, by_entry = to_host(
        (result.out_bn, s.num_new_b, s.rounds, s.accepted_hist, s.menu_rounds)
    )
    seconds = time.perf_counter() - t0
    results = completions(req.row_prompts, out, num_new, req.eos)
    new_tokens = sum(len(c.output_ids) for c in results)
    stats = dataclasses.replace(
        SpecStats.from_histogram(int(rounds), hist, new_tokens, seconds),
        rounds_by_drafts={k: int(r) for k, r in zip(policy.menu, by_entry)},
        acceptance_evidence=policy.evidence(s.policy_state),
        plain_steps=max((len(c.output_ids) for c in results), default=1) - 1,
        prompt_tokens=prefilled_tokens(prompts, prefill_chunk),
    )
    return SpecResult(results, seconds, compile_seconds, stats)
