"""EAGLE-3 draft head: one Llama decoder layer over [embedding, fused target features], as a Flax NNX module.

The head follows `LlamaForCausalLMEagle3` (docs/eagle3-head.md, sections 1-3): `fc` fuses the residual streams of
three target layers into g [H]; the single "midlayer" attends with a 2H-wide input concat[input_layernorm(embed),
hidden_norm(g)], keeps the *raw* g as its residual, and its pre-norm output is fed back as g at the next draft step;
`norm` and a reduced-vocabulary `lm_head` give draft logits over Vd tokens, mapped to target ids by
`target = draft + d2t[draft]`. Two published variants are config flags (section 7): `norm_output` (EAGLE-3.1) feeds
back the post-norm output instead, the vector the lm_head reads; `norm_before_residual` (vLLM's speculators) keeps
hidden_norm(g) as the residual.

Every method works in fixed shapes and is jit-friendly: split the module with `nnx.split` outside a jit and
`nnx.merge` it inside (e.g. a `lax.while_loop` body). The layer math lives in `qkv` / `finish` / `readout`, so the
cached inference `step` and a full-sequence training (TTT) path share it.

Shape letters: B batch, T new rows, S cache slots, D head hidden size (H in docs/eagle3-head.md), N query heads,
K kv heads, G query heads per kv head, Hd head dim, F MLP width, V target vocabulary, Vd draft vocabulary.

Tap layers (specjax convention): the ids of the target layers whose *input* residual stream is tapped, i.e. what
`llama.forward(..., tap_layers=cfg.tap_layers)` returns. The default for an N-layer target is (2, N//2, N-3).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from specjax.config import MetadataFields, ModelConfig, RopeScaling, layer_sizes_from_hf, rope_from_hf
from specjax.errors import CheckpointError, InputError, UnsupportedModelError
from specjax.models.attention import CachedKeys, attend, slots_below
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Rotary, apply_rope, rms_norm
from specjax.models.quantize import embed_rows
from specjax.sharding import DEFAULT_RULES, ArraySpec, Rules, constrain, shardings_of

ARCHITECTURE = "LlamaForCausalLMEagle3"
# What a head shaped like one layer of its target takes from the target's config (`Eagle3Config.default_for`).
LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_ids",
)


def default_tap_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 default taps of an N-layer target: the inputs of layers 2, N//2 and N-3 (docs/eagle3-head.md,
    section 1)."""
    n = num_target_layers
    return (2, n // 2, n - 3)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Shape and numerics of an EAGLE-3 draft head, plus the target features it reads.

    `tap_layers` are ids of target layers whose INPUT residual stream is tapped (specjax convention; SGLang's
    `eagle_config.eagle_aux_hidden_state_layer_ids` are these minus 1). None means the default for the target depth.
    `target_hidden_size` None means `hidden_size`. RoPE uses the head's own `rope_theta` / `rope_scaling`; the rotary
    angles are computed from positions, never from a table sized by `max_position_embeddings`.
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # V, the target vocabulary
    draft_vocab_size: int  # Vd
    target_num_layers: int  # depth of the target the head was trained for (fixes the default tap layers)
    target_hidden_size: int | None = None  # Ht; None -> hidden_size
    tap_layers: tuple[int, ...] | None = None  # None -> default_tap_layers(target_num_layers)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    norm_output: bool = False  # EAGLE-3.1: the next draft step reads the final-norm output, not the pre-norm one
    norm_before_residual: bool = False  # the residual is hidden_norm(g), not the raw g

    def __post_init__(self):
        if self.target_hidden_size is None:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        taps = default_tap_layers(self.target_num_layers) if self.tap_layers is None else tuple(self.tap_layers)
        object.__setattr__(self, "tap_layers", tuple(int(t) for t in taps))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"EAGLE-3 head: num_attention_heads={self.num_heads} must be a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise InputError(
                f"EAGLE-3 head: draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size={self.vocab_size}"
            )
        bad = [t for t in self.tap_layers if not 0 <= t < self.target_num_layers]
        if not self.tap_layers or bad:
            raise InputError(
                f"EAGLE-3 tap layers {list(self.tap_layers)} must be non-empty ids of target layers "
                f"0..{self.target_num_layers - 1} (inputs of those layers); the head was made for another target"
            )

    # KVCache.empty and Rotary.of read these by name.
    @property
    def num_layers(self) -> int:
        """The head has one decoder layer; its KV cache has L = 1."""
        return 1

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def fc_in_features(self) -> int:
        """Width of the concatenated target taps fed to fc (3 * Ht for the standard head)."""
        return len(self.tap_layers) * self.target_hidden_size

    @property
    def needs_own_embedding(self) -> bool:
        """A head narrower or wider than its target cannot share the target's embedding."""
        return self.target_hidden_size != self.hidden_size

    @classmethod
    def default_for(
        cls, target_cfg: ModelConfig, draft_vocab_size: int | None = None, tap_layers: tuple[int, ...] | None = None
    ) -> Eagle3Config:
        """A head shaped like one layer of the target (width, heads, MLP, RoPE).

        Args:
          target_cfg: the target model's config.
          draft_vocab_size: Vd; None keeps the full target vocabulary.
          tap_layers: the target layers it reads; None: the default taps (`default_tap_layers`).
        Returns:
          The head config.
        """
        return cls(
            **{name: getattr(target_cfg, name) for name in LAYER_FIELDS},
            draft_vocab_size=target_cfg.vocab_size if draft_vocab_size is None else draft_vocab_size,
            target_num_layers=target_cfg.num_layers,
            tap_layers=tap_layers,
        )

    @classmethod
    def from_hf(
        cls, hf: Mapping[str, Any], target_cfg: ModelConfig, source: str = "EAGLE-3 head config.json"
    ) -> Eagle3Config:
        """Reads a `LlamaForCausalLMEagle3` config.json dict, every field through `MetadataFields`, and checks it
        against the target.

        Aux layer ids are read from top-level `eagle_aux_hidden_state_layer_ids` (vLLM: inputs of layers, used as
        they are) or `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang: outputs of layers, so +1). When both
        are present and disagree, the SGLang ids win (the convention SpecForge trains with) and a warning is issued.

        Args:
          hf: the parsed config.json of the head.
          target_cfg: the config of the target model the head will draft for.
          source: the file it came from, named in errors.
        Returns:
          The config. Raises UnsupportedModelError for a head specjax cannot run and CheckpointError (naming the file
          and key) for a malformed config or a head made for another target.
        """
        fields = MetadataFields(hf, source)
        arch = fields.strings("architectures", default=[])
        if arch and not any("eagle3" in a.lower() for a in arch):
            raise UnsupportedModelError(
                f"config.json describes {arch}, not an EAGLE-3 head ({ARCHITECTURE}); point at an EAGLE-3 draft head"
            )
        fields = _flatten_speculators(fields)
        for flag in ("fc_norm", "norm_before_fc", "attention_bias", "mlp_bias"):
            if fields.flag(flag, False):
                raise UnsupportedModelError(f"EAGLE-3 head option {flag}=true is not supported; use a standard head")
        if fields.flag("tie_word_embeddings", False):
            raise UnsupportedModelError(
                "EAGLE-3 head config sets tie_word_embeddings=true (lm_head tied to the embedding); specjax runs heads "
                "with their own lm_head only: set it to false if the checkpoint stores lm_head.weight"
            )
        if (act := fields.text("hidden_act", "silu")) != "silu":
            raise UnsupportedModelError(f"EAGLE-3 head hidden_act={act!r} is not supported; need silu")
        if (layers := fields.integer("num_hidden_layers", default=1)) != 1:
            raise UnsupportedModelError(
                f"EAGLE-3 head config has num_hidden_layers={layers}; specjax runs single-layer heads only"
            )
        vocab, sizes = fields.integer("vocab_size"), layer_sizes_from_hf(fields)
        values = dict(
            **sizes,
            vocab_size=vocab,
            draft_vocab_size=fields.integer("draft_vocab_size", default=vocab),
            target_num_layers=target_cfg.num_layers,
            target_hidden_size=fields.integer("target_hidden_size", default=sizes["hidden_size"]),
            tap_layers=_read_tap_layers(fields),
            rms_norm_eps=fields.positive("rms_norm_eps", 1e-5),
            **rope_from_hf(fields),
            max_position_embeddings=fields.integer("max_position_embeddings", default=2048),
            bos_token_id=fields.integer("bos_token_id", 0, vocab, default=None),
            eos_token_ids=fields.token_ids("eos_token_id", vocab),
            norm_output=fields.flag("norm_output", False),
            norm_before_residual=fields.flag("norm_before_residual", False),
        )
        try:
            cfg = cls(**values)
        except (CheckpointError, InputError) as e:
            raise fields.error(f"{e}; {fields.remedy}") from None
        if cfg.target_hidden_size != target_cfg.hidden_size:
            raise fields.error(
                f"the head reads target features of width target_hidden_size={cfg.target_hidden_size} but the "
                f"target's hidden size is {target_cfg.hidden_size}; use the head trained for this target model"
            )
        if cfg.vocab_size != target_cfg.vocab_size:
            raise fields.error(
                f"the head has vocab_size {cfg.vocab_size} but the target's vocabulary has "
                f"{target_cfg.vocab_size} tokens; use the head trained for this target model"
            )
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """The `LlamaForCausalLMEagle3` config.json dict (inverse of `from_hf`).

        `target_hidden_size` is written only when it differs from `hidden_size` (EAGLE skips sharing the target's
        embedding when it is set); aux layer ids only when they differ from the default, and then in both the vLLM
        (top-level, inputs of layers) and the SGLang (`eagle_config`, outputs of layers) conventions.
        """
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "num_hidden_layers": 1,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "norm_output": self.norm_output,
            "norm_before_residual": self.norm_before_residual,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = self.rope_scaling.to_hf()
        if self.target_hidden_size != self.hidden_size:
            hf["target_hidden_size"] = self.target_hidden_size
        if self.tap_layers != default_tap_layers(self.target_num_layers):
            hf["eagle_aux_hidden_state_layer_ids"] = list(self.tap_layers)
            hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in self.tap_layers]}
        return hf


def _flatten_speculators(fields: MetadataFields) -> MetadataFields:
    """A config in the speculators format (vLLM's `Eagle3Speculator`) nests the layer's fields in
    `transformer_layer_config` and keeps the EAGLE-3 fields at the top; other configs are returned as they are."""
    layer = fields.mapping("transformer_layer_config")
    if layer is None:
        return fields
    top = {k: v for k, v in fields.data.items() if k != "transformer_layer_config"}
    return MetadataFields({**layer.data, **top}, fields.source)


def _read_tap_layers(fields: MetadataFields) -> tuple[int, ...] | None:
    """Tap ids in the specjax convention (inputs of layers) from either engine's field, or None for the default."""
    from_top = fields.integers("eagle_aux_hidden_state_layer_ids", default=None)
    eagle = fields.mapping("eagle_config")
    nested = eagle and eagle.integers("eagle_aux_hidden_state_layer_ids", low=-1, default=None)
    if nested is None:
        return from_top
    from_nested = tuple(t + 1 for t in nested)
    if from_top is not None and from_top != from_nested:
        warnings.warn(
            f"EAGLE-3 head config: eagle_config aux layer ids {list(nested)} (outputs of layers) disagree with "
            f"top-level eagle_aux_hidden_state_layer_ids {list(from_top)} (inputs of layers); tapping the inputs of "
            f"layers {list(from_nested)}",
            stacklevel=3,
        )
    return from_nested


# ---------------------------------------------------------------------------------------------------------------
# Module.


class VocabMap(nnx.Variable):
    """A non-trainable vocabulary buffer: d2t (int32 offsets [Vd]) or t2d (bool membership [V])."""


class FrozenEmbedding(nnx.Variable):
    """The head's own token embedding [V, D]: frozen, as in EAGLE; present only when the target's cannot be shared."""


def param_specs(cfg: Eagle3Config) -> dict[str, ArraySpec]:
    """Shapes and logical axes of the trainable weights (JAX layout: inputs first). Drives init and loading."""
    D, F, N, K, Hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {
        "fc": ArraySpec((cfg.fc_in_features, D), ("taps", "embed")),
        "input_norm": ArraySpec((D,), ("embed",)),
        "hidden_norm": ArraySpec((D,), ("embed",)),
        "q": ArraySpec((2 * D, N, Hd), ("embed2", "heads", "head_dim")),
        "k": ArraySpec((2 * D, K, Hd), ("embed2", "kv_heads", "head_dim")),
        "v": ArraySpec((2 * D, K, Hd), ("embed2", "kv_heads", "head_dim")),
        "o": ArraySpec((N, Hd, D), ("heads", "head_dim", "embed")),
        "mlp_norm": ArraySpec((D,), ("embed",)),
        "gate": ArraySpec((D, F), ("embed", "mlp")),
        "up": ArraySpec((D, F), ("embed", "mlp")),
        "down": ArraySpec((F, D), ("mlp", "embed")),
        "final_norm": ArraySpec((D,), ("embed",)),
        "lm_head": ArraySpec((D, cfg.draft_vocab_size), ("embed", "vocab")),
    }


NORMS = ("input_norm", "hidden_norm", "mlp_norm", "final_norm")


class Eagle3Head(nnx.Module):
    """The EAGLE-3 draft head (docs/eagle3-head.md, section 2).

    Trainable weights are `nnx.Param`s named as in `param_specs`; `d2t` / `t2d` are `VocabMap` buffers and the
    optional own embedding a `FrozenEmbedding`, so `nnx.split(head, nnx.Param, ...)` separates what training updates.
    """

    def __init__(
        self,
        cfg: Eagle3Config,
        *,
        rngs: nnx.Rngs | None = None,
        dtype=jnp.float32,
        weights: Mapping[str, jax.Array] | None = None,
        own_embedding: bool | None = None,
        init_scale: float = 0.02,
    ):
        """Builds a head from given weights, or randomly initialised.

        Args:
          cfg: the head config.
          rngs: random streams for initialisation (needed when `weights` is None).
          dtype: dtype of the float weights and of the computation (logits are float32).
          weights: JAX-layout arrays named as in `param_specs`, plus optional "d2t" [Vd] (default: the first Vd
            target ids), "t2d" [V] (default: derived from d2t) and "embed" [V, D].
          own_embedding: whether a random head carries its own embedding; None: only when `cfg.needs_own_embedding`.
          init_scale: standard deviation of the random matrices; norms start at 1.
        """
        self.cfg = cfg
        self.dtype = dtype
        specs = param_specs(cfg)
        if weights is None:
            if rngs is None:
                raise InputError("Eagle3Head needs rngs= to initialise random weights, or weights= to load them")

            def normal(shape):
                return (init_scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)

            weights = {n: jnp.ones(s.shape, dtype) if n in NORMS else normal(s.shape) for n, s in specs.items()}
            if cfg.needs_own_embedding if own_embedding is None else own_embedding:
                weights["embed"] = normal((cfg.vocab_size, cfg.hidden_size))
        for name, spec in specs.items():
            w = jnp.asarray(weights[name], dtype)
            if w.shape != spec.shape:
                raise InputError(f"Eagle3Head weight {name!r} has shape {list(w.shape)}, expected {list(spec.shape)}")
            setattr(self, name, nnx.Param(w))
        embed = weights.get("embed")
        if embed is None and cfg.needs_own_embedding:
            raise InputError(
                f"an EAGLE-3 head of width {cfg.hidden_size} over a target of width {cfg.target_hidden_size} needs its "
                "own embedding; pass weights['embed'] [V, D]"
            )
        self.embed = None if embed is None else FrozenEmbedding(jnp.asarray(embed, dtype))
        d2t = weights.get("d2t")
        d2t = jnp.zeros((cfg.draft_vocab_size,), jnp.int32) if d2t is None else jnp.asarray(d2t, jnp.int32)
        t2d = weights.get("t2d")
        t2d = t2d_from_d2t(d2t, cfg.vocab_size) if t2d is None else jnp.asarray(t2d, bool)
        if d2t.shape != (cfg.draft_vocab_size,) or t2d.shape != (cfg.vocab_size,):
            raise InputError(
                f"Eagle3Head d2t/t2d have shapes {list(d2t.shape)}/{list(t2d.shape)}, expected "
                f"[{cfg.draft_vocab_size}]/[{cfg.vocab_size}]"
            )
        self.d2t = VocabMap(d2t)
        self.t2d = VocabMap(t2d)

    def place(self, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> None:
        """Splits the weights over `mesh` by their logical axes (`param_specs`, the own embedding as ("vocab",
        "embed")) under `rules`: with the default rules the heads, KV heads, MLP columns and draft vocabulary go over
        "tensor", as the target's do, so each device holds its share of the head; the vocabulary maps are replicated.
        """
        cfg = self.cfg
        specs = {
            **param_specs(cfg),
            "embed": ArraySpec((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed")),
            "d2t": ArraySpec((cfg.draft_vocab_size,), (None,)),
            "t2d": ArraySpec((cfg.vocab_size,), (None,)),
        }
        for name, sharding in shardings_of(specs, mesh, rules).items():
            if (var := getattr(self, name)) is not None:
                var.set_value(jax.device_put(var[...], sharding))

    # -- inputs ------------------------------------------------------------------------------------------------

    def embed_tokens(self, ids_bt: jax.Array, target_embed_vd: jax.Array | None = None) -> jax.Array:
        """Embeds target-vocabulary ids with the head's own embedding, else with the target's (shared, frozen).

        Args:
          ids_bt: int32 target token ids.
          target_embed_vd: the target's embedding table [V, D] (an array or an Int8Matrix); needed when the head has
            none.
        Returns:
          [..., D] in the head dtype.
        """
        if self.embed is not None:
            table = self.embed[...]
        elif target_embed_vd is None:
            raise InputError("this EAGLE-3 head shares the target's embedding: pass target_embed_vd (weights.embed)")
        else:
            table = target_embed_vd
        return embed_rows(table, ids_bt).astype(self.dtype)

    def fuse(self, taps_btf: jax.Array) -> jax.Array:
        """fc over the concatenated target taps [B, T, n*Ht] (low, mid, high) -> g [B, T, D]."""
        return jnp.einsum("btf,fd->btd", taps_btf.astype(self.dtype), self.fc[...])

    # -- the layer, in pieces shared by inference and training -----------------------------------------------

    def qkv(
        self, embed_btd: jax.Array, g_btd: jax.Array, positions_bt: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values of the midlayer, RoPE applied with the head's own settings.

        Args:
          embed_btd: embeddings of the tokens paired with each row.
          g_btd: fused target features, or the previous draft step's next g (`readout`).
          positions_bt: int32 rotary positions (drafting row j pairs feature j with token j+1 at position j).
        Returns:
          (q [B, T, N, Hd], k [B, T, K, Hd], v [B, T, K, Hd]).
        """
        eps = self.cfg.rms_norm_eps
        e = rms_norm(embed_btd.astype(self.dtype), self.input_norm[...], eps)
        h = rms_norm(g_btd.astype(self.dtype), self.hidden_norm[...], eps)
        x = jnp.concatenate([e, h], axis=-1)  # embedding first
        q = jnp.einsum("bte,enh->btnh", x, self.q[...])
        k = jnp.einsum("bte,ekh->btkh", x, self.k[...])
        v = jnp.einsum("bte,ekh->btkh", x, self.v[...])
        rope = Rotary.of(self.cfg)
        return apply_rope(q, positions_bt, rope), apply_rope(k, positions_bt, rope), v

    def finish(self, g_btd: jax.Array, attn_btnh: jax.Array) -> jax.Array:
        """o_proj, residual on g, SwiGLU MLP: the midlayer's pre-norm output [B, T, D] (`readout`'s input).

        The residual is the raw g, or hidden_norm(g) when `cfg.norm_before_residual`.
        """
        eps = self.cfg.rms_norm_eps
        g = g_btd.astype(self.dtype)
        residual = rms_norm(g, self.hidden_norm[...], eps) if self.cfg.norm_before_residual else g
        h1 = residual + jnp.einsum("btnh,nhd->btd", attn_btnh.astype(self.dtype), self.o[...])
        x = rms_norm(h1, self.mlp_norm[...], eps)
        mlp = jax.nn.silu(jnp.einsum("btd,df->btf", x, self.gate[...])) * jnp.einsum("btd,df->btf", x, self.up[...])
        return h1 + jnp.einsum("btf,fd->btd", mlp, self.down[...])

    def readout(self, out_prenorm: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Final norm and the reduced lm_head, and what the next draft step reads as g.

        Returns:
          (float32 draft logits [..., Vd], next g [..., D]: the pre-norm output (EAGLE-3), or the post-norm one when
          `cfg.norm_output` (EAGLE-3.1)).
        """
        normed = rms_norm(out_prenorm, self.final_norm[...], self.cfg.rms_norm_eps)
        logits = jnp.einsum("...d,dv->...v", normed, self.lm_head[...], preferred_element_type=jnp.float32)
        logits = constrain(logits, ("batch", *(None,) * (logits.ndim - 2), "vocab"))  # as the lm_head's columns
        return logits, normed if self.cfg.norm_output else out_prenorm

    # -- cached inference ------------------------------------------------------------------------------------

    def empty_cache(self, batch: int, num_slots: int, dtype=None) -> KVCache:
        """The head's own KV cache (L = 1): `num_slots` slots per row, slot s holding draft position s."""
        return KVCache.empty(self.cfg, batch, num_slots, self.dtype if dtype is None else dtype)

    def step(
        self,
        embed_btd: jax.Array,
        g_btd: jax.Array,
        positions_bt: jax.Array,
        cache: KVCache,
        new_mask_btt: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """One midlayer pass of T new rows against the head's KV cache; writes their keys/values.

        As in `llama.forward`, the rows go to slots `cache.lengths + arange(T)` and `cache.lengths` is left for the
        caller to advance, so a draft round is rolled back by not advancing it (EAGLE keeps only the prefix KV,
        computed from target features: docs/eagle3-head.md, section 4).

        Args:
          embed_btd: embeddings of the paired tokens (`embed_tokens`).
          g_btd: `fuse(taps)` for rows backed by target features, else the parent's next g.
          positions_bt: int32 rotary positions [B, T] (or broadcastable): row j of a prefix pass at j; draft step k
            after row p at p + k.
          cache: the head's KV cache (L = 1); row b attends to its first `lengths[b]` slots.
          new_mask_btt: bool [B, T, T], which new rows each row sees; causal when None (a tree passes ancestors).
        Returns:
          (draft logits [B, T, Vd] float32, next g [B, T, D] (`readout`), cache with the new keys/values written).
        """
        B, T = embed_btd.shape[:2]
        positions_bt = jnp.broadcast_to(positions_bt, (B, T))
        if new_mask_btt is None:
            new_mask_btt = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        q, k, v = self.qkv(embed_btd, g_btd, positions_bt)
        seen = slots_below(cache.lengths)
        logits, next_g = self.attend_and_read(q, g_btd, cache, k, v, new_mask_btt, seen, jnp.max(cache.lengths))
        return logits, next_g, cache.write(k[None], v[None])

    def attend_and_read(
        self,
        q_btnh: jax.Array,
        g_btd: jax.Array,
        cache: KVCache,
        k_new: jax.Array,
        v_new: jax.Array,
        new_mask_btt: jax.Array,
        visible: Callable[[jax.Array], jax.Array],
        live: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """The midlayer after `qkv`: the rows' queries attend to new keys/values (under `new_mask_btt`) and to the
        head cache's slots (`visible`, none at or past `live`: `specjax.models.attention.CachedKeys`), then `finish`
        and `readout`: (draft logits, next g)."""
        cfg = self.cfg
        B, T = q_btnh.shape[:2]
        q = q_btnh.reshape(B, T, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
        attn = attend(q, k_new, v_new, new_mask_btt, CachedKeys(cache.k, cache.v, visible, live, layer=0))
        return self.readout(self.finish(g_btd, attn.reshape(B, T, cfg.num_heads, cfg.head_dim)))

    # -- vocabularies ----------------------------------------------------------------------------------------

    def target_ids_of_draft_vocab(self) -> jax.Array:
        """int32 [Vd]: the target id of every draft id (where draft probabilities land in the target vocabulary)."""
        return jnp.arange(self.cfg.draft_vocab_size, dtype=jnp.int32) + self.d2t[...]


def t2d_from_d2t(d2t: jax.Array, vocab_size: int) -> jax.Array:
    """The bool membership mask [V] of the draft vocabulary described by offsets d2t [Vd]."""
    target_ids = jnp.arange(d2t.shape[0], dtype=jnp.int32) + jnp.asarray(d2t, jnp.int32)
    return jnp.zeros((vocab_size,), bool).at[target_ids].set(True, mode="drop")


def vocab_map_from_ids(used_ids: Sequence[int], vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """d2t [Vd] int32 and t2d [V] bool for a draft vocabulary of the given distinct target ids (docs/eagle3-head.md,
    section 3).

    Args:
      used_ids: the target ids kept in the draft vocabulary (any order; they are sorted ascending).
      vocab_size: V.
    Returns:
      (d2t, t2d), with target_id = draft_id + d2t[draft_id].
    """
    used = sorted({int(i) for i in used_ids})
    if len(used) != len(used_ids) or (used and not 0 <= used[0] <= used[-1] < vocab_size):
        raise InputError(f"draft vocabulary ids must be distinct ids in 0..{vocab_size - 1}")
    used_arr = jnp.asarray(used, jnp.int32)
    d2t = used_arr - jnp.arange(len(used), dtype=jnp.int32)
    return d2t, t2d_from_d2t(d2t, vocab_size)
