"""DFlash drafting (docs/dflash.md, section 5): one forward of the draft over [pending, MASK * (Bs - 1)] proposes K
drafts at once, each with the distribution it was drawn from.

Context bookkeeping: the draft's cache holds, for every committed position before the pending token, every layer's
keys and values of the target's features there (`context_kv`). `commit` writes them from the target's own taps after
the prefill and after every verification, so its lengths equal the target cache's; drafting never writes it. Row j's
distribution depends on the committed text alone, not on the other rows' draws, so drawing the K drafts in parallel
is exact (section 5.2).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.drafters.base import ChainDrafter, Traits, draw, pending_tokens
from specjax.drafters.entry import DrafterEntry, DraftTarget
from specjax.errors import InputError
from specjax.models.attention import slots_below
from specjax.models.dflash import (
    DFlashConfig,
    DFlashWeights,
    block_hidden,
    block_inputs,
    context_kv,
    draft_logits,
    init_dflash,
    scored_head,
    weight_specs_of,
)
from specjax.models.kv_cache import KVCache
from specjax.models.llama import head_rows
from specjax.models.quantize import Int8Matrix
from specjax.sharding import mesh_of, place


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashDrafter(ChainDrafter):
    """DFlash drafter (a pytree). `embed_vd` is the target's embedding [V, D]; `scored_vd` its LM head's rows of the
    draft's scored ids (`scored_head`), gathered once here rather than in every round; both int8 where the target's
    weights are (`specjax.models.quantize`)."""

    weights: DFlashWeights
    embed_vd: jax.Array | Int8Matrix
    scored_vd: jax.Array | Int8Matrix
    cfg: DFlashConfig = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def for_target(cls, weights: DFlashWeights, cfg: DFlashConfig, target) -> DFlashDrafter:
        """The drafter over a target's `specjax.models.llama.Weights` (its embedding and LM head, shared)."""
        return cls(weights, target.embed, scored_head(weights, head_rows(target)), cfg)

    @property
    def traits(self) -> Traits:
        return Traits(tap_layers=self.cfg.tap_layers, max_draft_tokens=self.cfg.max_drafts)

    def validate(self, target_cfg: ModelConfig, num_draft_tokens: int) -> None:
        self.cfg.check_target(target_cfg)
        if num_draft_tokens > self.cfg.max_drafts:
            raise InputError(
                f"a DFlash draft with block size {self.cfg.block_size} proposes at most {self.cfg.max_drafts} tokens "
                "a round; got {num_draft_tokens}",
                settings={"num_draft_tokens": num_draft_tokens},
            )

    def init(self, tokens_bp: jax.Array, lengths_b: jax.Array, num_slots: int) -> KVCache:
        return KVCache.empty(self.cfg.layers, tokens_bp.shape[0], num_slots, self.weights.fc.dtype)

    def commit(self, cache: KVCache, next_tokens_bt, taps_btf, count_b) -> KVCache:
        """Context keys and values of the newly committed positions, from the target's taps there."""
        T = next_tokens_bt.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        k, v = context_kv(self.weights, self.cfg, taps_btf, positions)
        return cache.write(k, v).advance(count_b)

    def block_logits(self, cache: KVCache, pending_b: jax.Array, num_rows: int) -> jax.Array:
        """float32 logits [B, num_rows, V or Vd] of the block rows after the anchor, for the block at the pending
        token's position (= cache.lengths)."""
        Bs, B = self.cfg.block_size, pending_b.shape[0]
        ids, positions = block_inputs(self.cfg, cache.lengths[:, None], pending_b[:, None])
        h = block_hidden(
            self.weights,
            self.cfg,
            self.embed_vd,
            ids,
            positions,
            cache.k,
            cache.v,
            slots_below(cache.lengths),
            jnp.ones((B, Bs, Bs), bool),
            out_rows=slice(1, num_rows + 1),
            ctx_live=jnp.max(cache.lengths),
        )
        return draft_logits(self.scored_vd, h)

    def propose_chain(
        self, cache: KVCache, tokens_bs, length_b, keys_b, *, num_draft_tokens: int, vocab_size, sampling
    ):
        """Rows 1..K of one block: the whole block runs whatever K is (its rows attend to each other)."""
        logits_bkv = self.block_logits(cache, pending_tokens(tokens_bs, length_b), num_draft_tokens)
        tokens, probs = draw(keys_b, logits_bkv, sampling, self.weights.vocab_ids, vocab_size)
        return tokens, probs, cache


def load_dflash_drafter(path: str, target_cfg: ModelConfig, target_weights: Any) -> DFlashDrafter:
    """Loads a DFlash draft folder (config.json + safetensors) for this target, split by its logical axes over the
    target's mesh where it has one. Raises CheckpointError / InputError."""
    from specjax.io.dflash_checkpoint import load_dflash

    cfg, weights = load_dflash(path, target_cfg, dtype=target_weights.embed.dtype)  # checks it serves this target
    if (mesh := mesh_of(target_weights)) is not None:  # by the draft's own logical axes, beside the target
        vocab_ids = weights.vocab_ids
        weights = dataclasses.replace(
            place(dataclasses.replace(weights, vocab_ids=None), weight_specs_of(cfg), mesh), vocab_ids=vocab_ids
        )
    return DFlashDrafter.for_target(weights, cfg, target_weights)


def random_dflash_drafter(target: DraftTarget, seed: int) -> DFlashDrafter:
    """An untrained one-layer draft for the target, in blocks of 8 (7 drafts a round), reading its middle layer (the
    first of a 2-layer target: never the last); its mask token is the target's last id."""
    n = target.cfg.num_layers
    cfg = DFlashConfig.default_for(
        target.cfg,
        mask_token_id=target.cfg.vocab_size - 1,
        block_size=8,
        target_layer_ids=(min(n // 2, max(n - 2, 0)),),
    )
    weights = init_dflash(cfg, jax.random.key(seed), dtype=target.weights.embed.dtype, scale=0.3)
    return DFlashDrafter.for_target(weights, cfg, target.weights)


DFLASH = DrafterEntry(
    "dflash",
    "dflash:PATH",
    "a DFlash draft folder or Hub repo ORG/NAME[@REVISION], or dflash:smollm2-135m for the built-in draft",
    build=lambda folder, target: load_dflash_drafter(folder, target.cfg, target.weights),
    example=random_dflash_drafter,
    checkpoint="a DFlash draft folder",
)
