"""Logit parity of the functional verifier with HF transformers on random tiny configs of every architecture."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specjax.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Rotary, forward, weights_from_hf, weights_to_hf

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=10000.0)),
    "llama-untied-mha": (transformers.LlamaConfig, dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama3-rope-scaling": (
        transformers.LlamaConfig,
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "smollm2-tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, rope_theta=100000.0)),
    "mistral-sliding-window": (transformers.MistralConfig, dict(sliding_window=5, head_dim=16)),
    "qwen2-bias": (transformers.Qwen2Config, dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3-qk-norm": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=False)),
    "llama-yarn": (
        transformers.LlamaConfig,
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
    ),
    "qwen2-yarn": (
        transformers.Qwen2Config,
        dict(rope_theta=1e6, rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32)),
    ),
    "qwen3-yarn-betas-mscales": (
        transformers.Qwen3Config,
        dict(
            head_dim=24,
            rope_scaling=dict(
                rope_type="yarn",
                factor=8.0,
                original_max_position_embeddings=32,
                beta_fast=16,
                beta_slow=2,
                mscale=0.9,
                mscale_all_dim=0.4,
                truncate=False,
            ),
        ),
    ),
    "llama-yarn-attention-factor": (
        transformers.LlamaConfig,
        dict(
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, attention_factor=1.5)
        ),
    ),
}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


def make_pair(name):
    config_cls, extra = ARCHITECTURES[name]
    hf_cfg = config_cls(**{**TINY, **extra})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases, so a missing or misplaced one shows up
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    return model, cfg, weights_from_hf(cfg, state.__getitem__)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_prefill_and_decode_match_transformers(name):
    model, cfg, weights = make_pair(name)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 12))
    expected = hf_logits(model, ids)
    run = jax.jit(forward, static_argnums=1)

    # Prefill of the whole sequence.
    cache = KVCache.empty(cfg, 2, 16)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    logits, _, _ = run(weights, cfg, jnp.asarray(ids), positions, cache)
    assert rel_err(logits, expected) <= 1e-4

    # Prefill of 5 tokens, then one token at a time through the cache.
    cache = KVCache.empty(cfg, 2, 16)
    logits, _, cache = run(weights, cfg, jnp.asarray(ids[:, :5]), positions[:, :5], cache)
    cache = cache.advance(jnp.full((2,), 5))
    steps = [logits]
    for t in range(5, 12):
        logits, _, cache = run(weights, cfg, jnp.asarray(ids[:, t : t + 1]), positions[:, t : t + 1], cache)
        cache = cache.advance(jnp.ones((2,), jnp.int32))
        steps.append(logits)
    assert rel_err(jnp.concatenate(steps, axis=1), expected) <= 1e-4


def test_taps_are_the_residual_stream_entering_layers():
    model, cfg, weights = make_pair("llama")
    ids = np.arange(8)[None] % cfg.vocab_size
    with torch.no_grad():
        hidden = model(torch.tensor(ids), output_hidden_states=True).hidden_states  # [embeddings, layer 0 out, ...]
    _, taps, _ = forward(
        weights, cfg, jnp.asarray(ids), jnp.arange(8)[None], KVCache.empty(cfg, 1, 8), tap_layers=(0, 2)
    )
    expected = np.concatenate([hidden[0].numpy(), hidden[2].numpy()], axis=-1)
    assert rel_err(taps, expected) <= 1e-5


@pytest.mark.parametrize("name", ["qwen2-bias", "qwen3-qk-norm", "llama-untied-mha"])
def test_hf_tensor_round_trip(name):
    model, cfg, weights = make_pair(name)
    state = model.state_dict()
    back = weights_to_hf(cfg, weights)
    assert set(back) == {k for k in state if k != "lm_head.weight" or not cfg.tie_word_embeddings}
    for k, v in back.items():
        np.testing.assert_array_equal(v, state[k].numpy())


@pytest.mark.parametrize("name", [name for name in sorted(ARCHITECTURES) if "yarn" in name])
def test_yarn_past_the_original_context_matches_transformers(name):
    """100 tokens, three times yarn's original context of 32: a prefill of 96, then 4 steps through the cache."""
    model, cfg, weights = make_pair(name)
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.max_position_embeddings == 256
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, 100))
    expected = hf_logits(model, ids)
    run = jax.jit(forward, static_argnums=1)
    positions = jnp.arange(100)[None]
    cache = KVCache.empty(cfg, 1, 100)
    logits, _, cache = run(weights, cfg, jnp.asarray(ids[:, :96]), positions[:, :96], cache)
    cache = cache.advance(jnp.full((1,), 96))
    steps = [logits]
    for t in range(96, 100):
        logits, _, cache = run(weights, cfg, jnp.asarray(ids[:, t : t + 1]), positions[:, t : t + 1], cache)
        cache = cache.advance(jnp.ones((1,), jnp.int32))
        steps.append(logits)
    assert rel_err(jnp.concatenate(steps, axis=1), expected) <= 1e-4


# config.json rope settings whose defaults come from elsewhere in the file, as transformers resolves them.
ROPE_DEFAULTS = {
    "yarn without original context (max_position_embeddings)": dict(rope_scaling=dict(rope_type="yarn", factor=4.0)),
    "yarn factor null (max / original)": dict(
        rope_scaling=dict(rope_type="yarn", factor=None, original_max_position_embeddings=32)
    ),
    "top-level original context wins": dict(
        original_max_position_embeddings=16,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    ),
    "llama3 without original context": dict(
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    ),
}


@pytest.mark.parametrize("case", ROPE_DEFAULTS)
def test_rope_defaults_resolve_as_in_transformers(case):
    hf = {**TINY, "model_type": "llama", **ROPE_DEFAULTS[case]}
    hf_cfg = transformers.LlamaConfig.from_dict(hf)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[hf_cfg.rope_parameters["rope_type"]](hf_cfg)
    rope = Rotary.of(ModelConfig.from_hf(hf))
    np.testing.assert_allclose(rope.inv_freq, inv_freq.numpy(), rtol=1e-6)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)


def test_default_rope_type_is_no_scaling():
    for raw in ({"rope_type": "default"}, {"type": "default", "rope_theta": 5.0}):
        assert ModelConfig.from_hf({**TINY, "model_type": "qwen2", "rope_scaling": raw}).rope_scaling is None
