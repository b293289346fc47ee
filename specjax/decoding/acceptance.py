"""Acceptance: which drafts of a round the target keeps, and the one token it adds. One set of rules for every draft.

A round's draft is a `specjax.drafters.tree.DraftTree` rooted at the pending token (a chain is the tree with one child
per node), and the target has run once over all its nodes: its row m is the target's prediction after node m, given the
path from the root to m. Every rule returns (n, next, last): n accepted drafts, the token the target adds after them
(the correction, or the bonus), and the last accepted node (the root when n = 0), at depth n; the path from the root to
it holds the accepted drafts.

- Greedy (`greedy_accept`): the deepest node whose every draft equals the target's argmax at its parent; the next
  token is the argmax after it. The output is token-identical to greedy autoregressive decoding.
- Sampling (`recursive_rejection`): from the root, the children of the current node are tried in their draw order,
  child c accepted with probability min(1, p(c) / q(c)) (p: the target's distribution at the node; q: the one its
  children were drawn from); after a rejection p <- residual(p, q) and q <- q without c, renormalised, for the next
  sibling; when every child is rejected (or the node has none) the next token is drawn from the current p. The
  output is distributed exactly as target sampling (docs/speculative-decoding.md has the proof).

For one child per node the sampling rule is the chain rule of Leviathan et al. (2023) / Chen et al. (2023): draft
x_i is accepted with min(1, p_i(x_i) / q_i(x_i)), in order; the first rejection, at i, is replaced by a draw from
residual(p_i, q_i); when all K are accepted the bonus is drawn from p_K (a leaf: there is nothing to subtract).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.tree import DraftTree
from specjax.sampling import Sampling, categorical_rows, in_target_vocab, probabilities, split_rows, uniform_rows


def accept(
    keys_b: jax.Array, draft: DraftTree, target_logits_bmv: jax.Array, sampling: Sampling
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Applies the rule of `sampling` (`sampling.greedy` chooses it at trace time) to a round's draft.

    Args:
      keys_b: the rows' PRNG keys [B] (unused when greedy).
      draft: the round's draft, M nodes per row.
      target_logits_bmv: float [B, M, V] the target's logits after each node.
      sampling: the rows' sampling values; the processing the drafts went through too.
    Returns:
      (accepted drafts n int32 [B], next token int32 [B], last accepted node int32 [B]).
    """
    if sampling.greedy:
        return greedy_accept(draft, jnp.argmax(target_logits_bmv, axis=-1).astype(jnp.int32))
    return recursive_rejection(keys_b, draft, probabilities(target_logits_bmv, sampling))


def greedy_accept(draft: DraftTree, target_tokens_bm: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy: the deepest node whose every draft equals the target's argmax at its parent.

    Args:
      draft: the round's draft.
      target_tokens_bm: int32 [B, M] the target's argmax after each node.
    Returns:
      (n, next token: the target's argmax after the last accepted node, last) as `accept`.
    """
    matches_bm = draft.valid & (draft.tokens == jnp.take_along_axis(target_tokens_bm, draft.parents, axis=1))
    n, last = _deepest_accepted(draft, matches_bm)
    return n, jnp.take_along_axis(target_tokens_bm, last[:, None], axis=1)[:, 0], last


def recursive_rejection(
    keys_b: jax.Array, draft: DraftTree, target_probs_bmv: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exact acceptance with the draft's real probabilities (temperature > 0); see the module docstring.

    Every node tries its children at once, with uniforms of its own. Only the nodes on the accepted path count, and
    each of their decisions depends on nothing the path before it drew, so this equals the walk from the root.

    Args:
      keys_b: the rows' PRNG keys [B].
      draft: the round's draft; `draft_probs` holds the distribution each node's children were drawn from.
      target_probs_bmv: float32 [B, M, V] the target's processed distribution after each node.
    Returns:
      (n, next token, last) as `accept`.
    """
    B, M, V = target_probs_bmv.shape
    k_accept, k_next = split_rows(keys_b)
    # One uniform per (node, child); the last node is a leaf, since children come after their parents.
    u_bmk = uniform_rows(k_accept, (M - 1, draft.children.shape[-1]))
    u_bmk = jnp.concatenate([u_bmk, jnp.ones_like(u_bmk[:, :1])], axis=1)
    p, q = target_probs_bmv, draft.draft_probs
    if draft.vocab_ids is not None:
        q = in_target_vocab(q, draft.vocab_ids, V)
    chosen = jnp.full((B, M), -1, jnp.int32)
    for i in range(u_bmk.shape[-1]):
        child = draft.children[..., i]
        token = jnp.take_along_axis(draft.tokens, jnp.maximum(child, 0), axis=1)
        tried = (chosen < 0) & (child >= 0)
        accepted = tried & (u_bmk[..., i] * _at(q, token) < _at(p, token))  # u < p/q without dividing: q(c) > 0
        chosen = jnp.where(accepted, child, chosen)
        if i + 1 < u_bmk.shape[-1]:  # the next sibling is tried against what this rejection leaves
            rejected = (tried & ~accepted & (draft.children[..., i + 1] >= 0))[..., None]
            p = jnp.where(rejected, residual_probs(p, q), p)
            q = jnp.where(rejected, _normalise(jnp.where(jnp.arange(V) == token[..., None], 0.0, q), 0.0), q)
    n, last = _deepest_accepted(draft, jnp.take_along_axis(chosen, draft.parents, axis=1) == jnp.arange(M))
    # The last node's children were all rejected, the last one tried against p and q; or it has none (q = 0).
    has_children = jnp.take_along_axis(draft.children[..., 0], last[:, None], axis=1) >= 0
    p_last, q_last = (jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0] for x in (p, q))
    dist = residual_probs(p_last, jnp.where(has_children, q_last, 0.0))
    return n, categorical_rows(k_next, jnp.log(dist)), last


def residual_probs(target_probs: jax.Array, draft_probs: jax.Array) -> jax.Array:
    """normalise(max(0, target_probs - draft_probs)): where to sample after a rejection.

    When the two are equal the rejection has probability 0; target_probs is returned then to stay well defined.
    """
    return _normalise(jnp.maximum(target_probs - draft_probs, 0.0), target_probs)


def _normalise(x: jax.Array, otherwise) -> jax.Array:
    """x / sum(x) over the last axis, or `otherwise` where the sum is 0."""
    total = jnp.sum(x, axis=-1, keepdims=True)
    return jnp.where(total > 0, x / jnp.where(total > 0, total, 1.0), otherwise)


def _at(probs_bmv: jax.Array, token_bm: jax.Array) -> jax.Array:
    """probs_bmv[b, m, token_bm[b, m]]."""
    return jnp.take_along_axis(probs_bmv, token_bm[..., None], axis=-1)[..., 0]


def _deepest_accepted(draft: DraftTree, accepted_bm: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(n, last): the deepest node whose path from the root is accepted all along (the root always is), and its depth.

    At most one child of a node is accepted (siblings are distinct tokens), so `last` is unique.
    """
    on_path = ~jnp.any(draft.ancestors & ~accepted_bm.at[:, 0].set(True)[:, None, :], axis=-1)
    n = jnp.max(jnp.where(on_path, draft.depths, 0), axis=1)
    last = jnp.argmax(on_path & (draft.depths == n[:, None]), axis=1).astype(jnp.int32)
    return n, last
