"""The drafter protocol: every hook the speculative loop calls (`Drafter`), and a base for chain drafters.

A drafter is a pytree (its arrays are leaves, its options static), so it is passed into the loop's jit as an
argument. On the host the loop calls `validate`; inside the jit it reads `traits` and `draft_shape(K)` (static),
calls `init` and `commit` once after the prefill, then, every round, `regime`, `propose` and, after the verification,
`commit`. Everything inside the jit runs in fixed shapes.

The loop keeps every row's committed text in a token buffer `tokens_bs` (prompt, then generated tokens) with
`length_b` committed tokens per row. The last committed token (`tokens_bs[b, length_b - 1]`) is "pending": the target
has not run on it yet, and it is the root of the next round's draft.

Every round drafts a tree (`specjax.drafters.tree.DraftTree`) of the static shape `draft_shape(K)`; a chain of K
drafts is the tree with one child per node (`TreeSpec.chain(K)`). Chain drafters subclass `ChainDrafter` and implement
`propose_chain`; its `propose` turns their K drafts into that tree.

The rows `commit` receives mean the same in every case, after the prefill and after every round. For batch row b,
row j holds the target's taps at position c_b + j and the committed token at position c_b + j + 1, where c_b is the
number of positions the target cache held before (0 after the prefill; the pending token's position after a round).
The first `count_b` rows are newly committed: after the prefill the prompt (the token after its last position is the
first sampled one); after a round the pending token and the accepted drafts (the tokens after them are the accepted
drafts, then the correction or bonus token), cut at EOS and at max_new_tokens (none for a finished row). Rows past
`count_b` carry no meaning.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.drafters.tree import DraftTree, TreeSpec
from specjax.sampling import Sampling, categorical_rows, in_target_vocab, probabilities


@dataclasses.dataclass(frozen=True)
class Traits:
    """What a drafter can do and needs, read by the loop and the tools before anything runs."""

    tap_layers: tuple[int, ...] = ()  # target layers whose input residual stream the drafter reads (EAGLE-3, DFlash)
    max_draft_tokens: int | None = None  # the most drafts one round can propose; None: no bound
    plain_rounds: bool = True  # rounds without drafts may come between proposals (`commit` alone keeps it current)
    regimes: int = 1  # kinds of round `regime` tells apart (adaptive drafting keeps an estimate per row and kind)


@runtime_checkable
class Drafter(Protocol):
    """Drafts each round's tree, with the distribution each draft was drawn from."""

    traits: Traits

    def validate(self, target_cfg: ModelConfig, num_draft_tokens: int) -> None:
        """Raises InputError when this drafter cannot serve `target_cfg` with K drafts (host side, before compiling)."""

    def draft_shape(self, num_draft_tokens: int) -> TreeSpec:
        """The static shape of a round's draft when the caller asks for K drafts: a chain of K, or a tree drafter's own
        tree (whose depth, not K, bounds the drafts a round accepts)."""

    def init(self, tokens_bp: jax.Array, lengths_b: jax.Array, num_slots: int) -> Any:
        """The drafter's state (a pytree) after seeing the right-padded prompts [B, P] (inside the jit)."""

    def commit(self, state: Any, next_tokens_bt: jax.Array, taps_btf: jax.Array | None, count_b: jax.Array) -> Any:
        """Sees the rows the loop committed (inside the jit) and returns the new state.

        Args:
          state: the drafter's state.
          next_tokens_bt: int32 [B, T] the committed token that follows each row's position (module docstring).
          taps_btf: [B, T, len(tap_layers) * D] the target's taps at those positions; None without tap layers.
          count_b: int32 [B] rows newly committed: the first count_b[b] of the T (rows past them are padding, to
            be ignored or written where the next commit overwrites them).
        """

    def regime(self, state: Any, tokens_bs: jax.Array, length_b: jax.Array) -> jax.Array:
        """int32 [B] in [0, traits.regimes): the kind of draft each row would get next, from its committed text and
        the drafter's state (inside the jit, before the round), e.g. whether prompt lookup finds a match."""

    def propose(
        self,
        state: Any,
        tokens_bs: jax.Array,
        length_b: jax.Array,
        keys_b: jax.Array,
        *,
        shape: TreeSpec,
        vocab_size: int,
        sampling: Sampling,
    ) -> tuple[DraftTree, Any]:
        """Drafts the round's tree of `shape` (= `draft_shape(K)`), rooted at each row's pending token (inside the jit).

        Args:
          state: the drafter's state from `init`, `commit` or the previous proposal.
          tokens_bs: int32 [B, S] committed tokens (slots >= length_b hold stale values).
          length_b: int32 [B] committed tokens per row (>= 2: the prompt plus at least one generated token).
          keys_b: the rows' PRNG keys [B] for sampling the drafts; row b draws from keys_b[b] alone.
          shape: static.
          vocab_size: static V of the target (draft distributions are over it, or name their columns' target ids).
          sampling: the rows' values, the same processing the target uses (`specjax.sampling.probabilities`);
            `sampling.greedy` is static.
        Returns:
          (draft tree, state).
        """


class ChainDrafter:
    """A drafter that proposes chains: subclasses implement `propose_chain` and override the hooks they need. The
    defaults: no taps, no bound, nothing to check, no state, nothing to commit, one kind of round."""

    traits: Traits = Traits()

    def validate(self, target_cfg: ModelConfig, num_draft_tokens: int) -> None:
        """Serves any target."""

    def draft_shape(self, num_draft_tokens: int) -> TreeSpec:
        """A chain of K drafts."""
        return TreeSpec.chain(num_draft_tokens)

    def init(self, tokens_bp: jax.Array, lengths_b: jax.Array, num_slots: int) -> Any:
        """No state."""
        return ()

    def commit(self, state: Any, next_tokens_bt: jax.Array, taps_btf: jax.Array | None, count_b: jax.Array) -> Any:
        """Keeps the state."""
        return state

    def regime(self, state: Any, tokens_bs: jax.Array, length_b: jax.Array) -> jax.Array:
        """Every round is of one kind."""
        return jnp.zeros(length_b.shape, jnp.int32)

    def propose_chain(
        self,
        state: Any,
        tokens_bs: jax.Array,
        length_b: jax.Array,
        keys_b: jax.Array,
        *,
        num_draft_tokens: int,
        vocab_size: int,
        sampling: Sampling,
    ) -> tuple[jax.Array, jax.Array, Any]:
        """Drafts the next K tokens of each row (inside the jit); args as `Drafter.propose`, with K in place of the
        shape.

        Returns:
          (draft tokens int32 [B, K], draft_probs float32 [B, K, V]: the exact distribution each draft token was
          drawn from, state).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement propose_chain")

    def propose(self, state, tokens_bs, length_b, keys_b, *, shape: TreeSpec, vocab_size: int, sampling):
        """The chain of `propose_chain`'s K = shape.depth drafts, as a tree."""
        draft_bk, draft_probs_bkv, state = self.propose_chain(
            state, tokens_bs, length_b, keys_b, num_draft_tokens=shape.depth, vocab_size=vocab_size, sampling=sampling
        )
        return DraftTree.chain(pending_tokens(tokens_bs, length_b), draft_bk, draft_probs_bkv), state


def static_field(default=dataclasses.MISSING):
    """A dataclass field that is static in the drafter's pytree (an option, not an array)."""
    return dataclasses.field(default=default, metadata=dict(static=True))


def pending_tokens(tokens_bs: jax.Array, length_b: jax.Array) -> jax.Array:
    """int32 [B]: each row's pending token, its last committed one (the root of the next round's draft)."""
    return jnp.take_along_axis(tokens_bs, (length_b - 1)[:, None], axis=1)[:, 0]


def draw(
    keys_b: jax.Array,
    logits_bv: jax.Array,
    sampling: Sampling,
    vocab_ids: jax.Array | None = None,
    vocab_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Draws a token from processed logits [B, ..., V] (row b with keys_b[b]; unused when greedy) and returns it with
    the distribution it was drawn from.

    With `vocab_ids` (int32 [Vd], the target id of each logit column) the logits are a draft vocabulary's: the
    processing and the draw run over its Vd columns, and the token and distribution come back in the target's
    `vocab_size` ids, probability 0 elsewhere. That is the draw over target logits that are -inf outside the draft
    vocabulary (temperature, top-k and top-p keep the same tokens), at Vd / V of the cost.

    Returns:
      (token int32 [B, ...], draft_probs float32 [B, ..., V]); greedy: the argmax and its one-hot.
    """
    if sampling.greedy:
        token = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        if vocab_ids is not None:
            token = vocab_ids[token]
        return token, jax.nn.one_hot(token, vocab_size or logits_bv.shape[-1], dtype=jnp.float32)
    probs = probabilities(logits_bv, sampling)
    token = categorical_rows(keys_b, jnp.log(probs))
    if vocab_ids is None:
        return token, probs
    return vocab_ids[token], in_target_vocab(probs, vocab_ids, vocab_size)
