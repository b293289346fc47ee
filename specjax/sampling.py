"""Logits -> token choice. The same processing (temperature, then top-k, then top-p) serves the target and drafts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.config import SamplingConfig

NEG_INF = -jnp.inf


def top_k_mask(logits_bv: jax.Array, k: int) -> jax.Array:
    """Keeps the k largest logits of each row (ties with the k-th are kept too); k = 0 keeps all."""
    if k <= 0 or k >= logits_bv.shape[-1]:
        return logits_bv
    kth = jax.lax.top_k(logits_bv, k)[0][..., -1:]
    return jnp.where(logits_bv < kth, NEG_INF, logits_bv)


def top_p_mask(logits_bv: jax.Array, p: float) -> jax.Array:
    """Keeps the smallest set of most likely tokens whose probability reaches p (nucleus); p = 1 keeps all."""
    if p >= 1.0:
        return logits_bv
    sorted_desc = -jnp.sort(-logits_bv, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < p  # the first token always has mass_before 0
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_bv < threshold, NEG_INF, logits_bv)


def process_logits(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Temperature, top-k and top-p, in that order (as HF transformers applies them). Masked entries are -inf.

    Args:
      logits: float logits [..., V].
      sampling: the sampling config; must not be greedy.
    Returns:
      float32 logits of the distribution that sampling draws from.
    """
    x = logits.astype(jnp.float32) / sampling.temperature
    return top_p_mask(top_k_mask(x, sampling.top_k), sampling.top_p)


def probabilities(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """The distribution the next token is drawn from: one-hot argmax when greedy."""
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(process_logits(logits, sampling), axis=-1)


def sample(key: jax.Array, logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Draws one token per row of logits [..., V] -> int32 [...]."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, process_logits(logits, sampling), axis=-1).astype(jnp.int32)
