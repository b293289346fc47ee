"""The drafter protocol: what the speculative loop asks of a drafter, and nothing more.

A drafter is a pytree (its arrays are leaves, its options static), so it is passed into the loop's jit as an
argument. Inside the jit the loop calls `init` once and `propose` once per round; both run in fixed shapes.

The loop keeps every row's committed text in a token buffer `tokens_bs` (prompt, then generated tokens) with
`length_b` committed tokens per row. The last committed token (`tokens_bs[b, length_b - 1]`) is "pending": the target
has not run on it yet, and it is the first token of the next verification.

Two optional hooks serve drafters that read the target's hidden states (EAGLE-3); `DrafterHooks` gives their
defaults, and `tap_layers_of` / `commit_to` apply them to any drafter, so drafters without them work unchanged:
- `tap_layers` (static tuple, default ()): target layers whose input residual stream the loop returns from the
  prefill and from every verification forward.
- `commit(state, next_tokens_bt, taps_btf, count_b) -> state`: called right after the prefill with the prompt rows
  (row j's next token is x[j+1]; the last prompt row's is the first sampled token; count = prompt lengths) and after
  every verification with the verified rows (next tokens [d_1 .. d_K] with the emitted token at index n; count =
  tokens committed). Row j of `taps_btf` is the target's taps at the j-th committed-or-verified position.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig, SamplingConfig
from specjax.sampling import probabilities


@runtime_checkable
class Drafter(Protocol):
    """Proposes K draft tokens per row and the distribution each was drawn from."""

    def validate(self, target_cfg: ModelConfig, num_draft_tokens: int) -> None:
        """Raises InputError when this drafter cannot serve `target_cfg` (host side, before compiling)."""

    def init(self, tokens_bp: jax.Array, lengths_b: jax.Array, num_slots: int) -> Any:
        """The drafter's state (a pytree) after seeing the right-padded prompts [B, P] (inside the jit)."""

    def propose(
        self,
        state: Any,
        tokens_bs: jax.Array,
        length_b: jax.Array,
        key: jax.Array,
        *,
        num_draft_tokens: int,
        vocab_size: int,
        sampling: SamplingConfig,
    ) -> tuple[jax.Array, jax.Array, Any]:
        """Drafts the next K tokens of each row (inside the jit).

        Args:
          state: the drafter's state from `init` or the previous `propose`.
          tokens_bs: int32 [B, S] committed tokens (slots >= length_b hold stale values).
          length_b: int32 [B] committed tokens per row (>= 2: the prompt plus at least one generated token).
          key: PRNG key for sampling the drafts.
          num_draft_tokens: static K.
          vocab_size: static V of the target (draft_probs must have it).
          sampling: static; the same processing the target uses (`sampling.probabilities`).
        Returns:
          (draft tokens int32 [B, K], draft_probs float32 [B, K, V] — the exact distribution each draft token was
          drawn from, state).
        """


def draw(key: jax.Array, logits_bv: jax.Array, sampling: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """Draws a token from processed logits and returns it with the distribution it was drawn from.

    Returns:
      (token int32 [B], draft_probs float32 [B, V]); greedy: the argmax and its one-hot.
    """
    probs = probabilities(logits_bv, sampling)
    if sampling.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32), probs
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32), probs


class DrafterHooks:
    """Default optional hooks (mix in, or rely on `tap_layers_of` / `commit_to`): no taps, commit does nothing."""

    tap_layers: tuple[int, ...] = ()

    def commit(self, state: Any, next_tokens_bt: jax.Array, taps_btf: jax.Array | None, count_b: jax.Array) -> Any:
        """Sees the rows the loop committed (see the module docstring); returns the new drafter state."""
        return state


def tap_layers_of(drafter: Any) -> tuple[int, ...]:
    """The target layers a drafter wants tapped (static); () for drafters without the hook."""
    return tuple(getattr(drafter, "tap_layers", ()) or ())


def extra_slots_of(drafter: Any, num_draft_tokens: int) -> int:
    """KV slots a drafter needs past the committed text: its `extra_slots(K)` hook, else K."""
    extra = getattr(drafter, "extra_slots", None)
    return num_draft_tokens if extra is None else extra(num_draft_tokens)


def commit_to(drafter: Any, state: Any, next_tokens_bt, taps_btf, count_b) -> Any:
    """Calls `drafter.commit` when the drafter has one, else returns the state unchanged."""
    commit = getattr(drafter, "commit", None)
    return state if commit is None else commit(state, next_tokens_bt, taps_btf, count_b)
