"""A drafter that only the tests know, added by registration alone: it proposes the last committed token repeated K
times. The test conftest imports this module, so the shared parametrization (`drafters_fixture`) and with it the
shared exactness and engine tests run it with no edit to them."""

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters import ChainDrafter, DrafterEntry, pending_tokens, register


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RepeatLastDrafter(ChainDrafter):
    """Proposes the pending token K times (one-hot draft_probs: the proposal is a function of the text)."""

    def propose_chain(self, state, tokens_bs, length_b, keys_b, *, num_draft_tokens: int, vocab_size: int, sampling):
        draft_bk = jnp.repeat(pending_tokens(tokens_bs, length_b)[:, None], num_draft_tokens, axis=1)
        return draft_bk, jax.nn.one_hot(draft_bk, vocab_size, dtype=jnp.float32), state


REPEAT = register(
    DrafterEntry(
        "repeat",
        "repeat",
        "the last token, K times",
        build=lambda arg, target: RepeatLastDrafter(),
        example=lambda target, seed: RepeatLastDrafter(),
    )
)
