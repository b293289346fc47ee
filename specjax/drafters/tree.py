"""Draft trees in fixed shapes: the one draft shape of a round, best-first growth, ancestor masks, KV compaction.

Every round drafts a tree (`DraftTree`) of a static shape (`TreeSpec`). Node 0 is the root (the pending token,
already committed); nodes are stored in creation order, so every parent precedes its children. A chain of K drafts is
the tree with one child per node, `TreeSpec.chain(K)`: its nodes are the path itself, so it is verified under the
causal mask and its accepted path already lies contiguous in the cache. `specjax.decoding.acceptance` decides what a
round keeps, the same way for both.

Growth of a dynamic tree (EAGLE-2 style, `depth` - 1 expansion rounds after the root): the root's children are its
top-k (greedy) or k draws without replacement (Gumbel-top-k, temperature > 0) from the processed draft distribution;
each round then expands the `topk` unexpanded nodes of highest cumulative draft log-probability (depth < `depth`)
with one batched drafter step, and each of them gets a whole sibling group of up to `topk` children while the budget
lasts (in score order). Greedy growth gives every expanded node its group (up to the tree's capacity) and then keeps
the `budget` nodes of highest score, as EAGLE-2 reranks: the same drafter steps, a better tree.

Why whole groups, decided when the parent is expanded (and not EAGLE-2's per-node rerank afterwards): recursive
rejection over siblings is exact only if the number of children a node gets does not depend on those children's own
sampled values. Here it is fixed when the parent is popped, from scores of nodes that already exist, so the sampled
output is exactly the target's distribution at any temperature (tests/test_eagle3_decoding.py checks it by
enumeration).

Verification runs one target forward over all nodes (positions = pending position + depth, attention = ancestors);
the accepted path's keys and values are then written to contiguous slots (`specjax.decoding.speculative`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from specjax.errors import InputError
from specjax.sampling import Sampling, gumbel_rows, probabilities, process_logits, split_rows
from specjax.sharding import constrain, get_rows, set_rows, top_k_rows

MAX_DRAFT_TOKENS = 32  # the deepest draft a round verifies: a chain's K, a tree's depth
MAX_TREE_NODES = 64  # a tree's budget (root included): one verification forward over this many tokens
MAX_TREE_TOPK = 16  # children per expanded tree node


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """The static shape of a round's draft.

    depth: the deepest draft level (the most drafts a round accepts); topk: children per expanded node and nodes
    expanded per growth round; budget: tree nodes including the root (so budget - 1 drafts are verified per round).
    """

    depth: int
    topk: int
    budget: int

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """'depth,topk,budget' -> TreeSpec (validated). Raises InputError."""
        parts = text.split(",")
        try:
            depth, topk, budget = (int(x) for x in parts)
        except ValueError:
            raise InputError(
                f"{{tree}} takes depth,topk,budget (three integers, e.g. 5,4,24), got {text!r}", settings={"tree": None}
            ) from None
        spec = cls(depth, topk, budget)
        spec.validate()
        return spec

    @classmethod
    def chain(cls, num_draft_tokens: int) -> TreeSpec:
        """K drafts in a row: the tree with one child per node."""
        return cls(num_draft_tokens, 1, num_draft_tokens + 1)

    @property
    def is_chain(self) -> bool:
        """One child per node, down to the full depth (static): the nodes are one path in creation order, so a round
        verifies them under the plain causal mask, and the accepted path is already contiguous in the cache."""
        return self.topk == 1 and self.budget == self.depth + 1

    def validate(self, draft_vocab_size: int | None = None) -> None:
        """Raises InputError for a tree the buffers cannot hold or that cannot be filled."""
        if not 1 <= self.depth <= MAX_DRAFT_TOKENS:
            raise InputError(f"tree depth must be in 1..{MAX_DRAFT_TOKENS}, got {self.depth}")
        if not 1 <= self.topk <= MAX_TREE_TOPK:
            raise InputError(f"tree top-k must be in 1..{MAX_TREE_TOPK}, got {self.topk}")
        if draft_vocab_size is not None and self.topk > draft_vocab_size:
            raise InputError(f"tree top-k {self.topk} exceeds the draft vocabulary ({draft_vocab_size} tokens)")
        if not 2 <= self.budget <= MAX_TREE_NODES:
            raise InputError(
                f"tree budget (nodes including the root) must be in 2..{MAX_TREE_NODES}, got {self.budget}; "
                "a larger tree does not fit the verification buffer"
            )
        if self.budget > self.capacity:
            raise InputError(
                f"a tree of depth {self.depth} and top-k {self.topk} holds at most {self.capacity} nodes, but the "
                f"budget is {self.budget}; lower the budget or raise depth / top-k"
            )

    @property
    def capacity(self) -> int:
        """The most nodes growth can create: root + k + (depth - 1) rounds of k groups of k (a chain: K + 1).

        A round writes KV for at most this many nodes from the pending token's slot on, so the loop's buffers hold
        `capacity` slots past the committed text."""
        return 1 + self.topk + (self.depth - 1) * self.topk * self.topk

    def grown_nodes(self, sampling: Sampling) -> int:
        """Nodes growth creates before verification: greedy grows to capacity and keeps the best `budget`."""
        return self.capacity if sampling.greedy else self.budget


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """One round's draft, per row: M nodes in creation order, node 0 the pending token (see the module docstring)."""

    tokens: jax.Array  # [B, M] int32 target ids (node 0: the pending token)
    parents: jax.Array  # [B, M] int32 (root: 0)
    depths: jax.Array  # [B, M] int32 (root: 0)
    valid: jax.Array  # [B, M] bool: a real draft (unused slots and zero-probability draws are False)
    scores: jax.Array  # [B, M] float32 cumulative draft log-probability (-inf when invalid; growth bookkeeping)
    ancestors: jax.Array  # [B, M, M] bool: ancestors[t, s] = s is t or an ancestor of t
    children: jax.Array  # [B, M, k] int32 valid children in draw order, then -1
    expanded: jax.Array  # [B, M] bool (growth bookkeeping)
    draft_probs: jax.Array  # [B, M, Vd] the processed draft distribution each node's children were drawn from
    vocab_ids: jax.Array | None  # [Vd] int32 the target id of each column of draft_probs; None: Vd is the target's V

    @classmethod
    def chain(cls, root_b: jax.Array, draft_bk: jax.Array, draft_probs_bkv: jax.Array) -> DraftTree:
        """K drafts in a row as a tree: node i + 1 holds draft i, the only child of node i.

        Args:
          root_b: int32 [B] the pending token.
          draft_bk: int32 [B, K] the drafts.
          draft_probs_bkv: float32 [B, K, V] the distribution each draft was drawn from, over the target vocabulary.
        """
        B, K = draft_bk.shape
        node = jnp.arange(K + 1, dtype=jnp.int32)
        per_row = functools.partial(jnp.broadcast_to, shape=(B, K + 1))
        return cls(
            tokens=jnp.concatenate([root_b[:, None], draft_bk], axis=1),
            parents=per_row(jnp.maximum(node - 1, 0)),
            depths=per_row(node),
            valid=jnp.ones((B, K + 1), bool),
            scores=jnp.zeros((B, K + 1), jnp.float32),
            ancestors=jnp.broadcast_to(node[:, None] >= node[None, :], (B, K + 1, K + 1)),
            children=per_row(jnp.where(node < K, node + 1, -1))[..., None],
            expanded=per_row(node < K),
            draft_probs=jnp.concatenate([draft_probs_bkv, jnp.zeros_like(draft_probs_bkv[:, :1])], axis=1),  # leaf
            vocab_ids=None,
        )


def draw_children(
    keys_b: jax.Array, logits_nv: jax.Array, k: int, sampling: Sampling
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """k distinct children per row: greedy top-k, else k draws without replacement (Gumbel-top-k order).

    Args:
      keys_b: the rows' PRNG keys [B] (unused when greedy).
      logits_nv: float32 [B, ..., Vd] draft logits over the draft's vocabulary.
      k: static number of children.
      sampling: the same processing as the target.
    Returns:
      (draft-vocabulary ids int32 [..., k], log-probability float32 [..., k] (greedy: of the raw softmax), valid
      bool [..., k] (probability > 0), draft_probs float32 [..., Vd] (greedy: one-hot argmax)).
    """
    if sampling.greedy:
        logp = jax.nn.log_softmax(logits_nv.astype(jnp.float32), axis=-1)
        top, idx = top_k_rows(logp, k)
        return idx.astype(jnp.int32), top, top > -jnp.inf, probabilities(logits_nv, sampling)
    logp = jax.nn.log_softmax(process_logits(logits_nv, sampling), axis=-1)
    gumbel = gumbel_rows(keys_b, logp.shape[1:])
    _, idx = top_k_rows(jnp.where(logp > -jnp.inf, logp + gumbel, -jnp.inf), k)
    lp = jnp.take_along_axis(logp, idx, axis=-1)
    return idx.astype(jnp.int32), lp, lp > -jnp.inf, jnp.exp(logp)


ExpandFn = Callable[[DraftTree, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def grow_tree(
    keys_b: jax.Array,
    root_token_b: jax.Array,
    root_logits_bv: jax.Array,
    expand: ExpandFn,
    aux: Any,
    spec: TreeSpec,
    sampling: Sampling,
    vocab_ids: jax.Array | None = None,
) -> tuple[DraftTree, Any]:
    """Grows a draft tree per row (see the module docstring).

    Args:
      keys_b: the rows' PRNG keys [B] for the draws.
      root_token_b: int32 [B] the pending token.
      root_logits_bv: float32 [B, Vd] draft logits after the root, over the draft vocabulary `vocab_ids`.
      expand: `expand(tree, nodes_bf, ok_bf, aux) -> (logits [B, f, Vd], aux)` runs the drafter on nodes (the node's
        token, its parent's hidden state, its ancestors' KV) and returns the logits of their children.
      aux: the drafter's carry for `expand`.
      spec: static tree shape.
      sampling: the rows' sampling values (`sampling.greedy` is static).
      vocab_ids: int32 [Vd], the target id of each logit column; None when the drafter's vocabulary is the
        target's. Drawing in the draft vocabulary keeps top-k and softmax at Vd columns instead of V.
    Returns:
      (tree, aux).
    """
    B, V = root_logits_bv.shape
    if vocab_ids is None:
        vocab_ids = jnp.arange(V, dtype=jnp.int32)
    M, k = spec.grown_nodes(sampling), spec.topk
    keys = split_rows(keys_b, spec.depth)  # [depth, B]: one set of row keys per growth round
    tree = DraftTree(
        tokens=jnp.zeros((B, M), jnp.int32).at[:, 0].set(root_token_b),
        parents=jnp.zeros((B, M), jnp.int32),
        depths=jnp.ones((B, M), jnp.int32).at[:, 0].set(0),
        valid=jnp.zeros((B, M), bool).at[:, 0].set(True),
        scores=jnp.full((B, M), -jnp.inf, jnp.float32).at[:, 0].set(0.0),
        ancestors=jnp.broadcast_to(jnp.eye(M, dtype=bool), (B, M, M)),
        children=jnp.full((B, M, k), -1, jnp.int32),
        expanded=jnp.zeros((B, M), bool),
        draft_probs=jnp.zeros((B, M, V), jnp.float32),
        vocab_ids=vocab_ids,
    )
    count_b = jnp.ones((B,), jnp.int32)

    def attach(tree, count_b, keys_b, nodes_bf, ok_bf, logits_bfv):
        f = nodes_bf.shape[1]
        logits_bfv = constrain(logits_bfv, ("batch", None, None))  # each row's whole draft vocabulary, for top-k
        column, lp, ok_child, probs = draw_children(keys_b, logits_bfv, k, sampling)  # [B, f, k]
        tok = vocab_ids[column]
        n_valid = jnp.sum(ok_child, axis=-1) * ok_bf  # [B, f]: the support, not the draws, sets the group size
        before = jnp.cumsum(n_valid, axis=1) - n_valid
        room = jnp.maximum(M - count_b[:, None] - before, 0)
        take = jnp.minimum(n_valid, room)  # [B, f] children given to each expanded node, in score order
        start = count_b[:, None] + jnp.minimum(before, M)
        i = jnp.arange(k)[None, None, :]
        new = start[..., None] + i  # [B, f, k] node index of each child
        keep = i < take[..., None]
        dst = jnp.where(keep, new, M).reshape(B, f * k)  # M = dropped
        par = jnp.broadcast_to(nodes_bf[..., None], (B, f, k)).reshape(B, f * k)
        par_depth = jnp.take_along_axis(tree.depths, nodes_bf, axis=1)
        par_score = jnp.take_along_axis(tree.scores, nodes_bf, axis=1)
        par_anc = jnp.take_along_axis(tree.ancestors, nodes_bf[..., None], axis=1)  # [B, f, M]
        anc_new = jnp.broadcast_to(par_anc[:, :, None, :], (B, f, k, M)).reshape(B, f * k, M)
        anc_new = anc_new | jax.nn.one_hot(dst, M, dtype=bool)
        nodes_drop = jnp.where(ok_bf, nodes_bf, M)
        tree = DraftTree(
            tokens=set_rows(tree.tokens, dst, tok.reshape(B, f * k)),
            parents=set_rows(tree.parents, dst, par),
            depths=set_rows(tree.depths, dst, jnp.repeat(par_depth + 1, k, axis=1)),
            valid=set_rows(tree.valid, dst, True),
            scores=set_rows(tree.scores, dst, (par_score[..., None] + lp).reshape(B, f * k)),
            ancestors=set_rows(tree.ancestors, dst, anc_new),
            children=set_rows(tree.children, nodes_drop, jnp.where(keep, new, -1)),
            expanded=set_rows(tree.expanded, nodes_drop, True),
            draft_probs=set_rows(tree.draft_probs, nodes_drop, probs),
            vocab_ids=vocab_ids,
        )
        return tree, count_b + jnp.sum(take, axis=1)

    root = jnp.zeros((B, 1), jnp.int32)
    tree, count_b = attach(tree, count_b, keys[0], root, jnp.ones((B, 1), bool), root_logits_bv[:, None])
    f = min(k, M - 1)
    for r in range(1, spec.depth):
        eligible = tree.valid & ~tree.expanded & (tree.depths < spec.depth)
        score = jnp.where(eligible, tree.scores, -jnp.inf)
        top, nodes = top_k_rows(score, f)
        ok = (top > -jnp.inf) & (count_b[:, None] < M)
        logits, aux = expand(tree, nodes.astype(jnp.int32), ok, aux)
        tree, count_b = attach(tree, count_b, keys[r], nodes.astype(jnp.int32), ok, logits)
    return (best_nodes(tree, spec.budget) if M > spec.budget else tree), aux


def best_nodes(tree: DraftTree, m: int) -> DraftTree:
    """The `m` nodes of highest score, kept in creation order (EAGLE-2's rerank; greedy only).

    Scores never grow along a path and `top_k` puts the lower (earlier) index first among equals, so every kept
    node's ancestors are kept too.
    """
    B, C = tree.tokens.shape
    _, kept = top_k_rows(jnp.where(tree.valid, tree.scores, -jnp.inf), m)
    kept = jnp.sort(kept, axis=1).astype(jnp.int32)  # [B, m], the root first
    new_index = set_rows(jnp.zeros((B, C), jnp.int32), kept, jnp.arange(m, dtype=jnp.int32))
    is_kept = set_rows(jnp.zeros((B, C), bool), kept, True)

    def pick(x):
        return get_rows(x, kept)

    children = pick(tree.children)  # [B, m, k] old indices, -1 where none
    c = jnp.maximum(children, 0)
    children = jnp.where((children >= 0) & get_rows(is_kept, c), get_rows(new_index, c), -1)
    return dataclasses.replace(
        tree,
        tokens=pick(tree.tokens),
        parents=get_rows(new_index, pick(tree.parents)),
        depths=pick(tree.depths),
        valid=pick(tree.valid),
        scores=pick(tree.scores),
        ancestors=jnp.take_along_axis(pick(tree.ancestors), kept[:, None, :], axis=2),
        children=children,
        expanded=pick(tree.expanded),
        draft_probs=pick(tree.draft_probs),
    )


def path_to(tree: DraftTree, last_b: jax.Array, n_b: jax.Array, depth: int) -> jax.Array:
    """[B, depth + 1] the nodes on the path root -> last_b, a node at depth n_b (last at index n, repeated after it)."""
    path = jnp.broadcast_to(last_b[:, None], (last_b.shape[0], depth + 1))
    cur = last_b
    for d in range(depth, -1, -1):
        on = d <= n_b
        path = path.at[:, d].set(jnp.where(on, cur, last_b))
        cur = jnp.where(on & (d > 0), jnp.take_along_axis(tree.parents, cur[:, None], axis=1)[:, 0], cur)
    return path
