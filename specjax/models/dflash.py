"""The DFlash draft model (docs/dflash.md): L Qwen3-style decoder layers run once over a block
[anchor, MASK * (Bs - 1)], with the target's features injected into every layer's attention as extra keys and values.

Functional like the verifier: a weights pytree (the layers reuse `LayerWeights`) and pure functions. The draft has
no embedding and no LM head of its own: it reads the target's. Shape letters as in `specjax.models.llama`, plus C
context rows (target positions the draft attends to) and F = len(target_layer_ids) * target width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import MetadataFields, ModelConfig, layer_sizes_from_hf, rope_from_hf
from specjax.errors import CheckpointError, InputError
from specjax.models.attention import CachedKeys, attend
from specjax.models.llama import (
    LayerWeights,
    Rotary,
    is_norm_scale,
    keys_values,
    mlp_block,
    queries,
    rms_norm,
    weight_specs,
)
from specjax.models.quantize import embed_rows, weight_einsum
from specjax.sharding import ArraySpec


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The target layers ("output of layer i", 0-based) a draft reads when its config lists none: the middle layer
    for one draft layer, else one per draft layer spread from 1 to N - 3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash draft (static): its decoder stack, its block, and the target it serves."""

    layers: ModelConfig  # the decoder stack: Qwen3-style layers (q/k norms) over the target's vocabulary
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int

    def __post_init__(self):
        if self.block_size < 2:
            raise CheckpointError(
                f"block_size must be >= 2 (a DFlash block holds the anchor and at least one mask token), "
                f"got {self.block_size}"
            )
        if not self.target_layer_ids:
            raise CheckpointError("a DFlash draft reads at least one target layer; target_layer_ids is empty")

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The verifier's taps ("input of layer j") that carry the outputs of `target_layer_ids`."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        """K = Bs - 1: the drafts one block proposes."""
        return self.block_size - 1

    @classmethod
    def default_for(
        cls,
        target: ModelConfig,
        mask_token_id: int,
        *,
        num_layers: int = 1,
        block_size: int = 8,
        target_layer_ids: tuple[int, ...] | None = None,
    ) -> DFlashConfig:
        """A draft as wide as `target`, with its attention shape and rotary settings."""
        ids = target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)
        layers = ModelConfig(
            "qwen3",
            target.vocab_size,
            target.hidden_size,
            target.intermediate_size,
            num_layers,
            target.num_heads,
            target.num_kv_heads,
            target.head_dim,
            target.rms_norm_eps,
            target.rope_theta,
            target.rope_scaling,
            qk_norm=True,
        )
        return cls(layers, block_size, mask_token_id, tuple(ids), target.num_layers)

    def check_target(self, target: ModelConfig) -> None:
        """Raises InputError when this draft cannot serve `target`."""
        layers = self.layers
        if (layers.vocab_size, layers.hidden_size) != (target.vocab_size, target.hidden_size):
            raise InputError(
                f"this DFlash draft was made for a target with vocabulary {layers.vocab_size} and width "
                f"{layers.hidden_size}, but the target has {target.vocab_size} and {target.hidden_size}"
            )
        if self.num_target_layers != target.num_layers:
            raise InputError(
                f"this DFlash draft reads layers {list(self.target_layer_ids)} of a {self.num_target_layers}-layer "
                f"target, but the target has {target.num_layers} layers"
            )
        if not all(0 <= i < target.num_layers - 1 for i in self.target_layer_ids):
            raise InputError(
                f"DFlash target_layer_ids {list(self.target_layer_ids)} must lie in 0..{target.num_layers - 2} (the "
                "last layer's output is the target's normed final state in the reference, not a residual)"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise InputError(f"mask_token_id {self.mask_token_id} is outside the target's {target.vocab_size} tokens")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], target: ModelConfig, source: str = "DFlash config.json") -> DFlashConfig:
        """Reads a DFlash config.json, every field through `MetadataFields` (DFlash keys from `dflash_config` first,
        then the top level); the vocabulary is the target's. Raises CheckpointError naming the file and key of a
        malformed field, or for a variant specjax does not run."""
        fields = MetadataFields(hf, source)
        inner = fields.mapping("dflash_config")

        def dflash(name: str) -> MetadataFields:
            """The object that sets DFlash key `name`: dflash_config if it does, else the top level."""
            return inner if inner is not None and inner.data.get(name) is not None else fields

        layer_types, act = fields.strings("layer_types", default=[]), fields.text("hidden_act", "silu")
        tied = fields.flag("tie_word_embeddings", False)
        if any(t != "full_attention" for t in layer_types) or act != "silu" or tied:
            raise fields.error(
                "specjax runs DFlash drafts of full-attention, silu layers with the target's own LM head; this config "
                f"has layer_types {layer_types}, hidden_act {act!r}"
            )
        num_layers = fields.integer("num_hidden_layers")
        num_target = dflash("num_target_layers").integer("num_target_layers", default=target.num_layers)
        ids = dflash("target_layer_ids").integers("target_layer_ids", default=None)
        layers = dict(
            vocab_size=target.vocab_size,
            **layer_sizes_from_hf(fields),
            num_layers=num_layers,
            rms_norm_eps=fields.positive("rms_norm_eps", 1e-6),
            **rope_from_hf(fields),
            attention_bias=fields.flag("attention_bias", False),
            qk_norm=True,
        )
        block_size = dflash("block_size").integer("block_size")
        mask_token_id = dflash("mask_token_id").integer("mask_token_id", low=0)
        try:
            return cls(
                layers=ModelConfig("qwen3", **layers),
                block_size=block_size,
                mask_token_id=mask_token_id,
                target_layer_ids=ids or default_target_layer_ids(num_target, num_layers),
                num_target_layers=num_target,
            )
        except CheckpointError as e:
            raise fields.error(f"{e}; {fields.remedy}") from None

    def to_hf(self) -> dict[str, Any]:
        """The config.json of the published layout (docs/dflash.md, section 7.1)."""
        layers = self.layers
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "num_target_layers": self.num_target_layers,
            "num_hidden_layers": layers.num_layers,
            "hidden_size": layers.hidden_size,
            "intermediate_size": layers.intermediate_size,
            "num_attention_heads": layers.num_heads,
            "num_key_value_heads": layers.num_kv_heads,
            "head_dim": layers.head_dim,
            "hidden_act": "silu",
            "attention_bias": layers.attention_bias,
            "rms_norm_eps": layers.rms_norm_eps,
            "rope_theta": layers.rope_theta,
            "rope_scaling": layers.rope_scaling.to_hf() if layers.rope_scaling else None,
            "layer_types": ["full_attention"] * layers.num_layers,
            "vocab_size": layers.vocab_size,
            "tie_word_embeddings": False,
        }


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashWeights:
    fc: jax.Array  # [F, D]
    hidden_norm: jax.Array  # [D]
    layers: LayerWeights  # [L, ...]
    norm: jax.Array  # [D]
    vocab_ids: jax.Array | None = None  # int32 [Vd]: the target ids the draft scores; None: all V


def weight_specs_of(cfg: DFlashConfig) -> DFlashWeights:
    """The abstract weights of `cfg` (ArraySpec leaves; vocab_ids is not a trained weight and is left out)."""
    D = cfg.layers.hidden_size
    F = len(cfg.target_layer_ids) * D
    return DFlashWeights(
        fc=ArraySpec((F, D), ("mlp", "embed")),
        hidden_norm=ArraySpec((D,), ("embed",)),
        layers=weight_specs(cfg.layers).layers,
        norm=ArraySpec((D,), ("embed",)),
    )


def init_dflash(cfg: DFlashConfig, key: jax.Array, vocab_ids=None, dtype=jnp.float32, scale=0.02) -> DFlashWeights:
    """Random weights: matrices normal(0, scale), norms 1 (docs/dflash.md, section 6)."""
    leaves, treedef = jax.tree.flatten(weight_specs_of(cfg), is_leaf=lambda x: isinstance(x, ArraySpec))
    keys = jax.random.split(key, len(leaves))

    def make(spec: ArraySpec, k: jax.Array) -> jax.Array:
        if is_norm_scale(spec):
            return jnp.ones(spec.shape, dtype)
        return (scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

    weights = treedef.unflatten([make(s, k) for s, k in zip(leaves, keys)])
    ids = None if vocab_ids is None else jnp.asarray(vocab_ids, jnp.int32)
    return dataclasses.replace(weights, vocab_ids=ids)


def context_kv(
    w: DFlashWeights, cfg: DFlashConfig, taps_btf: jax.Array, positions_bt: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Every layer's keys and values of context rows: the target features projected by `fc` and `hidden_norm`,
    then each layer's k/v projection, k-norm and rotary at the rows' own positions (no input norm).

    Returns:
      (k, v), each [L, B, T, K, H].
    """
    eps = cfg.layers.rms_norm_eps
    c_btd = rms_norm(jnp.einsum("btf,fd->btd", taps_btf.astype(w.fc.dtype), w.fc), w.hidden_norm, eps)
    rope = Rotary.of(cfg.layers)
    return jax.lax.map(lambda lw: keys_values(lw, c_btd, positions_bt, rope, eps), w.layers)


def block_hidden(
    w: DFlashWeights,
    cfg: DFlashConfig,
    embed_vd: jax.Array,
    ids_bt: jax.Array,
    positions_bt: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    ctx_visible: Callable[[jax.Array], jax.Array],
    new_mask_btt: jax.Array,
    out_rows: slice | np.ndarray | None = None,
    ctx_live: jax.Array | None = None,
) -> jax.Array:
    """The draft over block rows (one block per row at inference; many blocks side by side in training).

    Args:
      w, cfg: the draft.
      embed_vd: the target's embedding.
      ids_bt, positions_bt: the block rows' tokens (anchor, mask ids) and rotary positions.
      ctx_k, ctx_v: [L, B, C, K, H] context keys/values (`context_kv`).
      ctx_visible: the context rows each block row sees (the positions before its anchor): context ids [Cb] ->
        bool [B, T or 1, Cb] (`specjax.models.attention.CachedKeys.visible`).
      new_mask_btt: bool [B, T, T], the block rows each block row sees (its own block, both directions).
      out_rows: the block rows whose states are returned (a slice or static indices; None: all). The last layer
        runs its queries, attention and MLP for these rows alone; every layer's keys and values span all T rows.
      ctx_live: no block row sees a context row at or past it (those are not read); None: all C may be seen.
    Returns:
      The final-normed hidden states [B, R, D] of the R rows `out_rows` names, for the target's LM head.
    """
    stack = cfg.layers
    rope, eps = Rotary.of(stack), stack.rms_norm_eps

    B, T = ids_bt.shape

    def layer(x_btd, lw, i, rows):
        h = rms_norm(x_btd, lw.attn_norm, eps)
        k, v = keys_values(lw, h, positions_bt, rope, eps)
        q = queries(lw, h[:, rows], positions_bt[:, rows], rope, eps)
        R = q.shape[1]
        q = q.reshape(B, R, stack.num_kv_heads, -1, stack.head_dim)

        def seen(ids):  # the context rows the layer's query rows see
            return jnp.broadcast_to(ctx_visible(ids), (B, T, ids.shape[0]))[:, rows]

        attn = attend(q, k, v, new_mask_btt[:, rows], CachedKeys(ctx_k, ctx_v, seen, ctx_live, layer=i))
        x_btd = x_btd[:, rows] + weight_einsum("btnh,nhd->btd", attn.reshape(B, R, stack.num_heads, -1), lw.o)
        return mlp_block(lw, x_btd, eps)

    x_btd = embed_rows(embed_vd, ids_bt).astype(w.fc.dtype)
    last = stack.num_layers - 1
    for i in range(stack.num_layers):
        lw = jax.tree.map(lambda a, i=i: a[i], w.layers)
        rows = out_rows if i == last and out_rows is not None else slice(None)
        x_btd = layer(x_btd, lw, i, rows)
    return rms_norm(x_btd, w.norm, eps)


def scored_head(w: DFlashWeights, head_vd: jax.Array) -> jax.Array:
    """The target's LM head [V, D] (an array or an Int8Matrix) restricted to the draft's scored ids: [Vd, D] in the
    order of `w.vocab_ids`."""
    return head_vd if w.vocab_ids is None else head_vd[w.vocab_ids]


def draft_logits(scored_vd: jax.Array, h_btd: jax.Array) -> jax.Array:
    """float32 logits [B, T, V or Vd] of the scored LM-head rows (`scored_head`)."""
    return weight_einsum("btd,vd->btv", h_btd.astype(scored_vd.dtype), scored_vd, preferred_element_type=jnp.float32)


def block_inputs(cfg: DFlashConfig, anchors_bn: jax.Array, anchor_ids_bn: jax.Array):
    """Token ids and positions [B, N * Bs] of N blocks per row (block n: its anchor at anchors_bn, then masks)."""
    Bs = cfg.block_size
    ids = jnp.full((*anchors_bn.shape, Bs), cfg.mask_token_id, jnp.int32).at[..., 0].set(anchor_ids_bn)
    positions = anchors_bn[..., None] + jnp.arange(Bs)
    B = anchors_bn.shape[0]
    return ids.reshape(B, -1), positions.reshape(B, -1).astype(jnp.int32)
