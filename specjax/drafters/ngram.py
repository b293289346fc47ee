"""Prompt-lookup (n-gram) drafting in JAX: copy what followed the most recent earlier occurrence of the text's tail.

The proposal is a deterministic function of the committed text, so its draft_probs are one-hot on the proposed
tokens — that is the exact distribution it was drawn from, and the acceptance rule stays exact at any temperature.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.drafters.base import ChainDrafter, Drafter, Traits
from specjax.drafters.entry import BenchOption, DrafterEntry, integer
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError

DEFAULT_NGRAM = 3  # the longest tail prompt lookup matches, and the tail lookup-first drafting needs to recur
MAX_NGRAM = 64  # a longer tail buys nothing and costs a compare per position and a policy estimate per length


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramDrafter(ChainDrafter):
    """Matches the last `max_n` tokens (falling back to shorter tails down to `min_n`) in prompt + generated text.

    Among the earlier occurrences of the longest matching tail, the most recent one wins, and the K tokens that
    followed it are proposed. Where that continuation runs into the tail itself, it continues periodically (a
    repetition loop is predicted to go on). Rows without any match propose their last token repeated. The kind of
    round (`regime`) is the length of the tail matched, 0 (none) to max_n: longer matches are accepted more often.
    """

    max_n: int = dataclasses.field(default=DEFAULT_NGRAM, metadata=dict(static=True))
    min_n: int = dataclasses.field(default=1, metadata=dict(static=True))

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n <= MAX_NGRAM:
            raise InputError(
                f"n-gram sizes must satisfy 1 <= min_n <= n <= {MAX_NGRAM}, got n={self.max_n}, min_n={self.min_n}"
            )

    @property
    def traits(self) -> Traits:
        return Traits(regimes=self.max_n + 1)

    def regime(self, state, tokens_bs, length_b):
        """The length of the tail the next proposal would match (0: none)."""
        return ngram_lookup(tokens_bs, length_b, 1, self.max_n, self.min_n)[1]

    def propose_chain(self, state, tokens_bs, length_b, keys_b, *, num_draft_tokens: int, vocab_size: int, sampling):
        """See `ChainDrafter.propose_chain`; `keys_b` and `sampling` are unused (the proposal is deterministic)."""
        draft_bk = ngram_proposal(tokens_bs, length_b, num_draft_tokens, self.max_n, self.min_n)
        return draft_bk, jax.nn.one_hot(draft_bk, vocab_size, dtype=jnp.float32), state


def ngram_proposal(tokens_bs: jax.Array, length_b: jax.Array, k: int, max_n: int, min_n: int = 1) -> jax.Array:
    """K proposed tokens per row by prompt lookup (see NgramDrafter): int32 [B, K]; see `ngram_lookup`."""
    return ngram_lookup(tokens_bs, length_b, k, max_n, min_n)[0]


def ngram_lookup(
    tokens_bs: jax.Array, length_b: jax.Array, k: int, max_n: int, min_n: int = 1
) -> tuple[jax.Array, jax.Array]:
    """Prompt lookup with the length of the tail it matched.

    Args:
      tokens_bs: int32 [B, S] committed tokens; slots >= length_b are ignored.
      length_b: int32 [B] committed tokens per row (>= 1).
      k: static number of tokens to propose.
      max_n, min_n: static; the longest and shortest tail lengths tried.
    Returns:
      (proposal int32 [B, K], matched tail length int32 [B]: 0 where no tail of at least min_n tokens recurs).
    """
    B, S = tokens_bs.shape
    ends = jnp.arange(S)[None, :]  # a candidate earlier occurrence ends at slot e (matching the pending token)
    run = jnp.ones((B, S), bool)
    match_len = jnp.zeros((B, S), jnp.int32)
    for t in range(max_n):
        src = ends - t
        tail = length_b[:, None] - 1 - t
        here = jnp.take_along_axis(tokens_bs, jnp.clip(src, 0, S - 1), axis=1)
        want = jnp.take_along_axis(tokens_bs, jnp.clip(tail, 0, S - 1), axis=1)
        run = run & (src >= 0) & (tail >= 0) & (here == want)
        match_len = match_len + run
    valid = (ends < length_b[:, None] - 1) & (match_len >= min_n)
    score = jnp.where(valid, match_len * S + ends, -1)  # longest tail first, then the most recent occurrence
    best = jnp.argmax(score, axis=1)
    found = jnp.max(score, axis=1) >= 0
    period = jnp.maximum(length_b - 1 - best, 1)  # the continuation repeats with this period past the tail
    src = best[:, None] + 1 + jnp.arange(k)[None, :] % period[:, None]
    proposal = jnp.take_along_axis(tokens_bs, jnp.clip(src, 0, S - 1), axis=1)
    last = jnp.take_along_axis(tokens_bs, (length_b - 1)[:, None], axis=1)
    matched = jnp.where(found, jnp.take_along_axis(match_len, best[:, None], axis=1)[:, 0], 0)
    return jnp.where(found[:, None], proposal, last).astype(jnp.int32), matched.astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LookupFirstDrafter(ChainDrafter):
    """Prompt lookup where the text repeats, another chain drafter elsewhere (e.g. EAGLE-3 on code that restates
    its prompt).

    A row whose last `n` tokens recur earlier in its text takes the lookup proposal (one-hot draft_probs); the
    others take the fallback's. The choice is a function of the committed text, so each round's proposal still has
    an exact distribution and the acceptance rule stays exact. The fallback's hooks (taps, state, commit) serve this
    drafter, and its commit runs every round; its drafting is skipped when every row has a lookup match.

    `fallback_tokens` (default: all K) lets the lookup propose more tokens than the fallback drafts: copied text is
    often right for many tokens, a small drafter's guesses rarely are. The fallback drafts that many; the rest of
    its row repeats its last draft (one-hot, so still exact), filling the K slots the round verifies.

    Its kinds of round (`regime`): 0, the fallback drafts; 1, the lookup proposes (copied text is accepted whole or
    not at all, so the two need their own acceptance estimates).
    """

    fallback: Drafter
    n: int = dataclasses.field(default=DEFAULT_NGRAM, metadata=dict(static=True))
    fallback_tokens: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        if not 1 <= self.n <= MAX_NGRAM:
            raise InputError(f"the n-gram size must be in 1..{MAX_NGRAM}, got {self.n}")
        if self.fallback_tokens is not None and self.fallback_tokens < 1:
            raise InputError(f"the fallback's draft tokens must be >= 1, got {self.fallback_tokens}")
        if self.fallback.draft_shape(1) != TreeSpec.chain(1):  # a chain drafter's shape follows K, a tree's does not
            raise InputError("lookup-first drafting drafts chains; its fallback cannot draft a tree")

    @property
    def traits(self) -> Traits:
        """The fallback's taps and plain rounds; its bound where it drafts K, none where it drafts its own count."""
        fallback = self.fallback.traits
        bound = fallback.max_draft_tokens if self.fallback_tokens is None else None
        return Traits(fallback.tap_layers, bound, fallback.plain_rounds, regimes=2)

    def validate(self, target_cfg: ModelConfig, num_draft_tokens: int) -> None:
        self.fallback.validate(target_cfg, min(self.fallback_tokens or num_draft_tokens, num_draft_tokens))

    def regime(self, state, tokens_bs, length_b):
        return (ngram_lookup(tokens_bs, length_b, 1, self.n, self.n)[1] >= self.n).astype(jnp.int32)

    def init(self, tokens_bp: jax.Array, lengths_b: jax.Array, num_slots: int) -> Any:
        return self.fallback.init(tokens_bp, lengths_b, num_slots)

    def commit(self, state: Any, next_tokens_bt, taps_btf, count_b) -> Any:
        return self.fallback.commit(state, next_tokens_bt, taps_btf, count_b)

    def propose_chain(self, state, tokens_bs, length_b, keys_b, *, num_draft_tokens: int, vocab_size: int, sampling):
        """See `ChainDrafter.propose_chain`."""
        lookup_bk, matched_b = ngram_lookup(tokens_bs, length_b, num_draft_tokens, self.n, self.n)
        lookup_bkv = jax.nn.one_hot(lookup_bk, vocab_size, dtype=jnp.float32)
        use_lookup = matched_b >= self.n

        k = min(self.fallback_tokens or num_draft_tokens, num_draft_tokens)

        def fallback(state):
            draft_bk, probs_bkv, state = self.fallback.propose_chain(
                state, tokens_bs, length_b, keys_b, num_draft_tokens=k, vocab_size=vocab_size, sampling=sampling
            )
            repeat_bk = jnp.repeat(draft_bk[:, -1:], num_draft_tokens - k, axis=1)
            repeat_bkv = jax.nn.one_hot(repeat_bk, vocab_size, dtype=jnp.float32)
            return (
                jnp.concatenate([draft_bk, repeat_bk], axis=1),
                jnp.concatenate([probs_bkv, repeat_bkv], axis=1),
                state,
            )

        draft_bk, probs_bkv, state = jax.lax.cond(
            use_lookup.all(), lambda state: (lookup_bk, lookup_bkv, state), fallback, state
        )
        draft_bk = jnp.where(use_lookup[:, None], lookup_bk, draft_bk)
        return draft_bk, jnp.where(use_lookup[:, None, None], lookup_bkv, probs_bkv), state


def with_lookup_tokens(drafter: Any, num_draft_tokens: int, lookup_tokens: int | None) -> tuple[Any, int]:
    """Lets a lookup-first drafter's lookup propose `lookup_tokens` while its fallback drafts `num_draft_tokens`.

    Returns:
      (drafter, tokens verified per round: the larger of the two). Raises InputError when `lookup_tokens` is given
      for another drafter.
    """
    if lookup_tokens is None:
        return drafter, num_draft_tokens
    if not isinstance(drafter, LookupFirstDrafter):
        raise InputError(
            "{lookup_tokens} applies to lookup-first drafting only (ngram[:N]+SPEC)",
            settings={"lookup_tokens": None},
        )
    if lookup_tokens < 1:
        raise InputError(f"{{lookup_tokens}} must be >= 1, got {lookup_tokens}", settings={"lookup_tokens": None})
    return dataclasses.replace(drafter, fallback_tokens=num_draft_tokens), max(num_draft_tokens, lookup_tokens)


LOOKUP_TOKENS_HELP = (
    "with lookup-first drafting (ngram[:N]+SPEC): tokens the lookup proposes (default K); SPEC still drafts K"
)


def _ngram_size(arg: str, cfg: ModelConfig) -> int:
    return integer(arg, "the n-gram size") if arg else DEFAULT_NGRAM


_NGRAM_OPTION = BenchOption("ngram", "n-gram size", DEFAULT_NGRAM)

NGRAM = DrafterEntry(
    "ngram",
    "ngram[:N]",
    f"N = longest n-gram, default {DEFAULT_NGRAM}",
    build=lambda n, target: NgramDrafter(max_n=n),
    example=lambda target, seed: NgramDrafter(max_n=2),
    parse=_ngram_size,
    bench=_NGRAM_OPTION,
)
LOOKUP_FIRST = DrafterEntry(
    "ngram+",
    "ngram[:N]+SPEC",
    "prompt lookup where the last N tokens recur, the chain drafter SPEC elsewhere",
    build=lambda n, target: LookupFirstDrafter(target.fallback, n=n),
    example=lambda target, seed: LookupFirstDrafter(target.fallback, n=2),
    parse=_ngram_size,
    bench=_NGRAM_OPTION,
)
