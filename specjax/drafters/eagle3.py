"""EAGLE-3 drafting: a draft head reading the target's hidden states, as a chain or a dynamic tree.

Head KV bookkeeping (docs/eagle3-head.md, sections 4 and 8.3): draft row j pairs the target's taps at position j
with the embedding of token j + 1, at rotary position j, in head-cache slot j. `commit` writes those rows for every
committed position from the target's own taps (after the prefill and after every verification) and advances the
head cache, so the head's KV for committed positions never comes from drafting. Drafting writes slots past the
committed length and never advances: the next commit overwrites them.

A committed row's keys and values are all later rows read of it, so `commit` computes only those (and keeps the last
row's query and features); the rest of the layer and the reduced LM head run for that one row when a round drafts
(`root`). Plain decoding steps and lookup rounds of an adaptive loop never pay for them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from specjax.config import ModelConfig
from specjax.drafters.base import ChainDrafter, Traits, draw, pending_tokens, static_field
from specjax.drafters.entry import DrafterEntry, DraftTarget
from specjax.drafters.tree import DraftTree, TreeSpec, grow_tree
from specjax.errors import InputError
from specjax.models.attention import slots_below
from specjax.models.eagle3 import NORMS, Eagle3Config, Eagle3Head, param_specs
from specjax.models.kv_cache import KVCache
from specjax.models.quantize import Int8Matrix, embed_rows
from specjax.sampling import Sampling, split_rows
from specjax.sharding import constrain, get_rows, mesh_of, set_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3State:
    cache: KVCache  # the head's cache: lengths == the target cache's lengths (committed positions - pending)
    q_bnh: jax.Array  # [B, N, Hd] the last committed row's query (its key and value are in the cache)
    g_bd: jax.Array  # [B, D] its fused target features (`root` finishes the row from these)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(ChainDrafter):
    """EAGLE-3 drafter (a pytree: the head's `nnx.split` state are leaves, its graph definition is static).

    Args (via `Eagle3Drafter.create(head, target_embed, tree=None)`):
      head: an `Eagle3Head` made for this target.
      target_embed: the target's embedding [V, D], an array or an Int8Matrix (used when the head shares it).
      tree: None for chain drafting (K = num_draft_tokens), else a `TreeSpec`.

    Where the embedding table the head reads is split over a mesh's vocabulary axis, looking a token up in it takes a
    reduction across the split. Drafted tokens are always in the draft vocabulary, so the drafter keeps those Vd rows
    replicated (`drafted_embed`, with `draft_ids` mapping target ids to them) and its draft steps look up locally;
    only `commit`, once a round, reads the whole table.
    """

    params: Any  # nnx.State of the head
    target_embed: jax.Array | Int8Matrix | None
    graphdef: Any = static_field()
    tree: TreeSpec | None = static_field(None)
    drafted_embed: jax.Array | None = None  # [Vd, D] replicated rows of the draft vocabulary, on a vocab-split mesh
    draft_ids: jax.Array | None = None  # int32 [V]: the draft id of each target id in the draft vocabulary

    @classmethod
    def create(
        cls, head: Eagle3Head, target_embed: jax.Array | Int8Matrix | None, tree: TreeSpec | None = None
    ) -> Eagle3Drafter:
        graphdef, params = nnx.split(head)
        if tree is not None:
            tree.validate(head.cfg.draft_vocab_size)
        table = target_embed if head.embed is None else head.embed[...]
        sharding = getattr(jax.tree.leaves(table)[0], "sharding", None)  # an int8 table's values split as its rows
        if not (isinstance(sharding, NamedSharding) and sharding.spec and sharding.spec[0] is not None):
            return cls(params, None if head.embed is not None else target_embed, graphdef, tree)
        whole = NamedSharding(sharding.mesh, PartitionSpec())
        drafted = jax.device_put(embed_rows(table, head.target_ids_of_draft_vocab()), whole)
        ids = jax.device_put(jnp.maximum(jnp.cumsum(head.t2d[...], dtype=jnp.int32) - 1, 0), whole)
        return cls(params, None if head.embed is not None else target_embed, graphdef, tree, drafted, ids)

    @property
    def head(self) -> Eagle3Head:
        return nnx.merge(self.graphdef, self.params)

    @property
    def traits(self) -> Traits:
        return Traits(tap_layers=tuple(self.head_cfg.tap_layers))

    @property
    def head_cfg(self):
        return self.head.cfg

    # -- the protocol ---------------------------------------------------------------------------------------

    def validate(self, target_cfg: ModelConfig, num_draft_tokens: int) -> None:
        cfg = self.head_cfg
        if cfg.vocab_size != target_cfg.vocab_size or cfg.target_hidden_size != target_cfg.hidden_size:
            raise InputError(
                f"this EAGLE-3 head was made for a target with vocabulary {cfg.vocab_size} and width "
                f"{cfg.target_hidden_size}, but the target has {target_cfg.vocab_size} and {target_cfg.hidden_size}"
            )
        if any(not 0 <= t < target_cfg.num_layers for t in cfg.tap_layers) or cfg.target_num_layers != (
            target_cfg.num_layers
        ):
            raise InputError(
                f"this EAGLE-3 head taps layers {list(cfg.tap_layers)} of a {cfg.target_num_layers}-layer target, but "
                f"the target has {target_cfg.num_layers} layers"
            )
        if self.tree is not None:
            self.tree.validate(cfg.draft_vocab_size)

    def embed_drafted(self, head: Eagle3Head, ids_bt: jax.Array) -> jax.Array:
        """Embeddings of drafted tokens (all in the draft vocabulary): local rows on a vocab-split mesh."""
        if self.drafted_embed is None:
            return head.embed_tokens(ids_bt, self.target_embed)
        return self.drafted_embed[self.draft_ids[ids_bt]].astype(head.dtype)

    def draft_shape(self, num_draft_tokens: int) -> TreeSpec:
        """The head's tree, else a chain of K."""
        return self.tree or TreeSpec.chain(num_draft_tokens)

    def init(self, tokens_bp: jax.Array, lengths_b: jax.Array, num_slots: int) -> Eagle3State:
        head = self.head
        cfg = head.cfg
        B = tokens_bp.shape[0]
        return Eagle3State(
            head.empty_cache(B, num_slots),
            constrain(jnp.zeros((B, cfg.num_heads, cfg.head_dim), head.dtype), ("batch", "heads", "head_dim")),
            constrain(jnp.zeros((B, cfg.hidden_size), head.dtype), ("batch", "embed")),
        )

    def commit(self, state: Eagle3State, next_tokens_bt, taps_btf, count_b) -> Eagle3State:
        """Head keys and values for the committed positions, from the target's taps (see the module docstring)."""
        head = self.head
        T = next_tokens_bt.shape[1]
        positions = state.cache.lengths[:, None] + jnp.arange(T)[None, :]
        g = head.fuse(taps_btf)
        q, k, v = head.qkv(head.embed_tokens(next_tokens_bt, self.target_embed), g, positions)
        last = jnp.maximum(count_b - 1, 0)[:, None]
        moved = (count_b > 0)[:, None]
        q_last = jnp.take_along_axis(q, last[..., None, None], axis=1)[:, 0]
        g_last = jnp.take_along_axis(g, last[..., None], axis=1)[:, 0]
        return Eagle3State(
            state.cache.write(k[None], v[None]).advance(count_b),
            jnp.where(moved[..., None], q_last.astype(state.q_bnh.dtype), state.q_bnh),
            jnp.where(moved, g_last.astype(state.g_bd.dtype), state.g_bd),
        )

    def root(self, state: Eagle3State) -> tuple[jax.Array, jax.Array]:
        """The head's output at the last committed row: (draft logits [B, Vd] of the first draft, its next g
        [B, D]). The row attends to the committed slots before it and to its own, as in one `head.step` over the
        committed text."""
        cache = state.cache
        B = state.q_bnh.shape[0]
        last = cache.lengths - 1
        k_last, v_last = (get_rows(x[0], last)[:, None].astype(state.q_bnh.dtype) for x in (cache.k, cache.v))
        logits, g = self.head.attend_and_read(
            state.q_bnh[:, None],
            state.g_bd[:, None],
            cache,
            k_last,
            v_last,
            jnp.ones((B, 1, 1), bool),
            slots_below(last),
            jnp.max(last),
        )
        return logits[:, 0], g[:, 0]

    def propose_chain(
        self, state: Eagle3State, tokens_bs, length_b, keys_b, *, num_draft_tokens: int, vocab_size, sampling
    ):
        """Chain drafting: draft 1 from the stored logits, then K - 1 cached steps on the head's own output."""
        head = self.head
        keys = split_rows(keys_b, num_draft_tokens)  # [K, B]: the row keys of each draft step
        c = state.cache.lengths
        logits_bv, g_bd = self.root(state)
        token, probs = _draw(head, keys[0], logits_bv, sampling)
        if num_draft_tokens == 1:
            return token[:, None], probs[:, None], state

        def step(carry, xs):
            token, g, cache = carry
            i, k = xs
            embed = self.embed_drafted(head, token[:, None])
            cache = cache.at_lengths(c + i)
            logits, out, cache = head.step(embed, g[:, None], (c + i)[:, None], cache)
            nxt, probs = _draw(head, k, logits[:, 0], sampling)
            return (nxt, out[:, 0], cache), (nxt, probs)

        xs = (jnp.arange(num_draft_tokens - 1, dtype=jnp.int32), keys[1:])
        (_, _, cache), (rest_kb, rest_kbv) = jax.lax.scan(step, (token, g_bd, state.cache), xs)
        cache = cache.at_lengths(c)
        tokens_bk = jnp.concatenate([token[:, None], rest_kb.T], axis=1)
        probs_bkv = jnp.concatenate([probs[:, None], jnp.moveaxis(rest_kbv, 0, 1)], axis=1)
        return tokens_bk, probs_bkv, dataclasses.replace(state, cache=cache)

    def propose(self, state: Eagle3State, tokens_bs, length_b, keys_b, *, shape: TreeSpec, vocab_size, sampling):
        """Grows a draft tree (`specjax.drafters.tree`), or drafts a chain without one. Node t >= 1 writes its head KV
        at slot c + t - 1 when expanded."""
        if self.tree is None:
            return super().propose(
                state, tokens_bs, length_b, keys_b, shape=shape, vocab_size=vocab_size, sampling=sampling
            )
        pending_b = pending_tokens(tokens_bs, length_b)
        head = self.head
        cfg = head.cfg
        M = shape.grown_nodes(sampling)
        B = pending_b.shape[0]
        c = state.cache.lengths
        S = state.cache.num_slots
        root_logits_bv, root_g_bd = self.root(state)
        node_out = jnp.zeros((B, M, cfg.hidden_size), root_g_bd.dtype).at[:, 0].set(root_g_bd)

        def expand(tree: DraftTree, nodes_bf, ok_bf, aux):
            cache, node_out = aux
            f = nodes_bf.shape[1]
            toks = jnp.take_along_axis(tree.tokens, nodes_bf, axis=1)
            parents = jnp.take_along_axis(tree.parents, nodes_bf, axis=1)
            g = jnp.take_along_axis(node_out, parents[..., None], axis=1)
            positions = c[:, None] - 1 + jnp.take_along_axis(tree.depths, nodes_bf, axis=1)
            q, k, v = head.qkv(self.embed_drafted(head, toks), g, positions)
            anc = jnp.take_along_axis(tree.ancestors, nodes_bf[..., None], axis=1)  # [B, f, M]

            def visible(slots):  # the committed text, and the slots of the node's expanded ancestors
                tree_idx = slots[None, None, :] - c[:, None, None] + 1  # node whose KV a slot holds
                in_tree = (tree_idx >= 1) & (tree_idx < M) & (tree_idx != nodes_bf[..., None])
                at = jnp.clip(tree_idx, 0, M - 1).astype(jnp.int32).repeat(f, 1)
                return (tree_idx < 1) | (in_tree & jnp.take_along_axis(anc, at, axis=2))

            logits, out = head.attend_and_read(
                q, g, cache, k, v, jnp.broadcast_to(jnp.eye(f, dtype=bool), (B, f, f)), visible, jnp.max(c) + M - 1
            )
            dst = jnp.where(ok_bf, c[:, None] + nodes_bf - 1, S)
            cache = cache.write_at(dst, k[None], v[None])
            node_out = set_rows(node_out, jnp.where(ok_bf, nodes_bf, M), out)
            return logits, (cache, node_out)

        tree, (cache, _) = grow_tree(
            keys_b,
            pending_b,
            root_logits_bv,
            expand,
            (state.cache, node_out),
            shape,
            sampling,
            vocab_ids=head.target_ids_of_draft_vocab(),
        )
        return tree, dataclasses.replace(state, cache=cache)


def _draw(head: Eagle3Head, keys_b: jax.Array, logits_bv: jax.Array, sampling: Sampling):
    """`draw` from draft-vocabulary logits [B, Vd]: (target id [B], draft_probs [B, V])."""
    return draw(keys_b, logits_bv, sampling, head.target_ids_of_draft_vocab(), head.cfg.vocab_size)


def load_eagle3_drafter(
    path: str, target_cfg: ModelConfig, target_embed: jax.Array | Int8Matrix, tree: TreeSpec | None = None
) -> Eagle3Drafter:
    """Loads a published-format EAGLE-3 head folder (config.json + safetensors) for this target, placed on the mesh of
    the target's embedding where it has one (`Eagle3Head.place`). Raises CheckpointError / InputError."""
    from specjax.io.eagle3_checkpoint import load_eagle3

    _, head = load_eagle3(path, target_cfg, dtype=target_embed.dtype)
    if (mesh := mesh_of(target_embed)) is not None:
        head.place(mesh)
    drafter = Eagle3Drafter.create(head, target_embed, tree)
    drafter.validate(target_cfg, 1)
    return drafter


def random_eagle3_drafter(target: DraftTarget, seed: int) -> Eagle3Drafter:
    """An untrained head shaped for the target (one target layer wide, the default taps where the target has the
    three layers they need, else every layer), sharing its embedding: matrices normal(0, 0.05) from NumPy (a JAX
    init would compile a kernel per shape), norms 1; drafting the target's tree where it has one."""
    cfg = target.cfg
    taps = None if cfg.num_layers >= 3 else tuple(range(cfg.num_layers))
    head_cfg = Eagle3Config.default_for(cfg, tap_layers=taps)
    rng = np.random.default_rng(seed)
    weights = {
        name: np.ones(spec.shape, np.float32) if name in NORMS else 0.05 * rng.standard_normal(spec.shape, np.float32)
        for name, spec in param_specs(head_cfg).items()
    }
    head = Eagle3Head(head_cfg, dtype=target.weights.embed.dtype, weights=weights)
    return Eagle3Drafter.create(head, target.weights.embed, target.tree)


EAGLE3 = DrafterEntry(
    "eagle3",
    "eagle3:PATH",
    "an EAGLE-3 head folder or Hub repo ORG/NAME[@REVISION], or eagle3:smollm2-135m for the built-in head; with "
    "--tree for tree drafting",
    build=lambda folder, target: load_eagle3_drafter(folder, target.cfg, target.weights.embed, target.tree),
    example=random_eagle3_drafter,
    trees=True,
    checkpoint="an EAGLE-3 head folder",
)
