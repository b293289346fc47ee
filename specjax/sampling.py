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


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys with the order of the float32 values (-inf lowest; no NaN)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    flipped = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    return jax.lax.bitcast_convert_type(flipped, jnp.uint32) ^ jnp.uint32(0x80000000)


def top_p_mask(logits_bv: jax.Array, p: float) -> jax.Array:
    """Keeps the smallest set of most likely tokens whose probability reaches p (nucleus); p = 1 keeps all.

    A token is kept when the tokens strictly more likely than it hold less than p (ties are kept together). The
    threshold is found without a sort: the mass above a key falls as the key rises, so 32 bisection steps over
    the float32 values' order-preserving uint32 keys find the lowest kept key exactly, at O(32 V) per row.
    """
    if p >= 1.0:
        return logits_bv
    probs = jax.nn.softmax(logits_bv.astype(jnp.float32), axis=-1)
    keys = _order_keys(logits_bv)
    mass_above = lambda k: jnp.sum(jnp.where(keys > k, probs, 0.0), axis=-1, keepdims=True)  # noqa: E731

    def halve(_, bounds):  # invariant: mass_above(lo) >= p > mass_above(hi)
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        below = mass_above(mid) < p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    hi = jnp.max(keys, axis=-1, keepdims=True)
    _, lowest_kept = jax.lax.fori_loop(0, 32, halve, (jnp.zeros_like(hi), hi))
    return jnp.where(keys < lowest_kept, NEG_INF, logits_bv)


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
