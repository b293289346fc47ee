"""Drafting with a smaller Llama-family model: a separate checkpoint, or the target's own first N layers.

Both keep their own KV cache, rolled back the way the target's is: each round the drafter sets its cache length to
`length_b - 2` and re-runs the last two committed tokens (the last accepted token, whose KV it may lack when all
K drafts were accepted, and the pending bonus token), then drafts autoregressively. Slots past the committed text
hold stale drafts and are overwritten later; nothing is ever resized.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.drafters.base import ChainDrafter, Traits, draw, static_field
from specjax.drafters.entry import BenchOption, DrafterEntry, DraftTarget, integer
from specjax.errors import InputError
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Weights, chunk_size, chunked_prefill, forward, init_weights
from specjax.sampling import Sampling, split_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelDraftState:
    cache: KVCache  # the draft model's own cache
    weights: Weights | None = None  # the layer-skip drafter's view of the target (sliced once per call)


def _draft_chain(
    weights: Weights,
    cfg: ModelConfig,
    cache: KVCache,
    tokens_bs: jax.Array,
    length_b: jax.Array,
    keys_b: jax.Array,
    num_draft_tokens: int,
    sampling: Sampling,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """K autoregressive draft steps after re-running the last two committed tokens. Returns (tokens, probs, cache)."""
    B = tokens_bs.shape[0]
    cache = cache.at_lengths(length_b - 2)
    slots_b2 = (length_b - 2)[:, None] + jnp.arange(2)[None, :]
    last_two = jnp.take_along_axis(tokens_bs, slots_b2, axis=1)
    logits, _, cache = forward(weights, cfg, last_two, slots_b2, cache, logits_at=jnp.ones((B, 1), jnp.int32))
    cache = cache.advance(jnp.full((B,), 2))
    keys = split_rows(keys_b, num_draft_tokens)  # [K, B]: the row keys of each draft step
    token, probs = draw(keys[0], logits[:, 0], sampling)

    def step(carry, k):
        token, cache = carry
        logits, _, cache = forward(weights, cfg, token[:, None], cache.lengths[:, None], cache)
        cache = cache.advance(jnp.ones((B,), jnp.int32))
        nxt, probs = draw(k, logits[:, 0], sampling)
        return (nxt, cache), (nxt, probs)

    if num_draft_tokens == 1:
        return token[:, None], probs[:, None], cache
    (_, cache), (rest_kb, rest_kbv) = jax.lax.scan(step, (token, cache), keys[1:])
    tokens_bk = jnp.concatenate([token[:, None], rest_kb.T], axis=1)
    probs_bkv = jnp.concatenate([probs[:, None], jnp.moveaxis(rest_kbv, 0, 1)], axis=1)
    return tokens_bk, probs_bkv, cache


def _prefill_draft(weights: Weights, cfg: ModelConfig, tokens_bp: jax.Array, lengths_b: jax.Array, num_slots: int):
    """The draft model's cache of the prompts, prefilled by the platform's chunks as the target's is."""
    cache = KVCache.empty(cfg, tokens_bp.shape[0], num_slots, weights.embed.dtype)
    return chunked_prefill(weights, cfg, tokens_bp, lengths_b, cache, chunk_size(None))[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelDrafter(ChainDrafter):
    """A separate draft model (any supported checkpoint whose vocabulary size equals the target's).

    Its cache learns the committed text when it proposes (it re-runs the last two committed tokens), not in
    `commit`, so it cannot follow more than two plain decoding steps in a row: no plain rounds."""

    weights: Weights
    cfg: ModelConfig = static_field()
    traits = Traits(plain_rounds=False)

    def validate(self, target_cfg: ModelConfig, num_draft_tokens: int) -> None:
        if self.cfg.vocab_size != target_cfg.vocab_size:
            raise InputError(
                f"the draft model's vocabulary has {self.cfg.vocab_size} tokens but the target's has "
                f"{target_cfg.vocab_size}; use a draft model with the same tokenizer as the target"
            )

    def init(self, tokens_bp: jax.Array, lengths_b: jax.Array, num_slots: int) -> ModelDraftState:
        return ModelDraftState(_prefill_draft(self.weights, self.cfg, tokens_bp, lengths_b, num_slots))

    def propose_chain(self, state, tokens_bs, length_b, keys_b, *, num_draft_tokens: int, vocab_size: int, sampling):
        """See `Drafter.propose`."""
        tokens, probs, cache = _draft_chain(
            self.weights, self.cfg, state.cache, tokens_bs, length_b, keys_b, num_draft_tokens, sampling
        )
        return tokens, probs, dataclasses.replace(state, cache=cache)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(ChainDrafter):
    """Self-drafting: the target's first `num_layers` layers, then its final norm and LM head.

    `weights` are the target's own arrays (no copy is made outside the jit); inside it the first N layers are
    sliced once per call, before the loop, and the drafter keeps a KV cache of N layers.
    """

    weights: Weights
    cfg: ModelConfig = static_field()  # the target's config
    num_layers: int = static_field(1)
    traits = Traits(plain_rounds=False)  # as ModelDrafter

    def __post_init__(self):
        if not 1 <= self.num_layers <= self.cfg.num_layers - 1:
            raise InputError(
                f"layer-skip drafting uses 1 to {self.cfg.num_layers - 1} of the target's {self.cfg.num_layers} "
                f"layers, got {self.num_layers}"
            )

    @staticmethod
    def default_layers(target_cfg: ModelConfig) -> int:
        """A quarter of the target's layers (specjax-bench's default)."""
        return max(1, target_cfg.num_layers // 4)

    @property
    def draft_cfg(self) -> ModelConfig:
        return dataclasses.replace(self.cfg, num_layers=self.num_layers)

    def validate(self, target_cfg: ModelConfig, num_draft_tokens: int) -> None:
        if self.cfg != target_cfg:
            raise InputError("a layer-skip drafter must be built from the target model's own weights and config")

    def init(self, tokens_bp: jax.Array, lengths_b: jax.Array, num_slots: int) -> ModelDraftState:
        n = self.num_layers
        weights = dataclasses.replace(self.weights, layers=jax.tree.map(lambda a: a[:n], self.weights.layers))
        return ModelDraftState(_prefill_draft(weights, self.draft_cfg, tokens_bp, lengths_b, num_slots), weights)

    def propose_chain(self, state, tokens_bs, length_b, keys_b, *, num_draft_tokens: int, vocab_size: int, sampling):
        """See `Drafter.propose`."""
        tokens, probs, cache = _draft_chain(
            state.weights, self.draft_cfg, state.cache, tokens_bs, length_b, keys_b, num_draft_tokens, sampling
        )
        return tokens, probs, dataclasses.replace(state, cache=cache)


def _draft_model(path: str, target: DraftTarget) -> ModelDrafter:
    if not path or target.load is None:
        raise InputError(
            "model drafting needs a checkpoint: model:PATH (a .gguf file, HF folder, Hub repo or built-in name)"
        )
    draft_cfg, draft_weights = target.load(path)
    drafter = ModelDrafter(draft_weights, draft_cfg)
    drafter.validate(target.cfg, 1)
    return drafter


def _layer_count(arg: str, cfg: ModelConfig) -> int:
    if not arg:
        raise InputError(f"layerskip needs a layer count, e.g. layerskip:{LayerSkipDrafter.default_layers(cfg)}")
    return integer(arg, "the layer-skip layer count")


MODEL = DrafterEntry(
    "model",
    "model:PATH",
    "",
    build=_draft_model,
    example=lambda target, seed: ModelDrafter(
        init_weights(target.cfg, jax.random.key(seed), target.weights.embed.dtype, scale=0.3), target.cfg
    ),
)
LAYER_SKIP = DrafterEntry(
    "layerskip",
    "layerskip:N",
    "first N layers",
    build=lambda n, target: LayerSkipDrafter(target.weights, target.cfg, n),
    example=lambda target, seed: LayerSkipDrafter(target.weights, target.cfg, 1),
    parse=_layer_count,
    bench=BenchOption(
        "draft-layers",
        "the target's first layers it drafts with (default: a quarter of them)",
        None,
        lambda n, cfg: str(n or LayerSkipDrafter.default_layers(cfg)),
    ),
)
