"""Logit parity of the functional verifier with HF transformers on random tiny configs of every architecture."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from specjax.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, weights_from_hf, weights_to_hf

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
