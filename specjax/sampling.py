"""Logits -> token choice. The same processing (temperature, then top-k, then top-p) serves the target and drafts.

The values are data (`Sampling`, one per row): one batch mixes settings, and a new value never compiles again. Only
`Sampling.greedy` (every row greedy: the argmax fast path) is fixed at trace time. Top-k and top-p find their
thresholds by bisection instead of a full-vocabulary sort, and cost nothing when no row of the batch uses them.

Randomness is per row too: every draw takes the rows' typed PRNG keys [B] and draws each row from its own key
(`split_rows`, `categorical_rows`, `uniform_rows`, `gumbel_rows`), so a row's tokens depend only on its key and its
inputs, never on the other rows of the batch or on its place in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import SamplingConfig
from specjax.errors import InputError

NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Per-row sampling values, validated on the way in (`Sampling.of`).

    The arrays are [B] (or [] for one setting of any batch) and broadcast over the batch axis, the first axis of the
    logits they process. A row with temperature 0 is greedy inside a sampled batch: its distribution is the one-hot
    argmax.
    """

    temperature: jax.Array  # float32; 0: greedy row
    top_k: jax.Array  # int32; 0: off
    top_p: jax.Array  # float32; 1: off
    greedy: bool = dataclasses.field(default=False, metadata=dict(static=True))  # every row greedy (static)

    @classmethod
    def of(cls, settings: SamplingConfig | Sequence[SamplingConfig], batch: int | None = None) -> Sampling:
        """One setting for every row, or one per row (rows past their number repeat the first, as padding does).

        Args:
          settings: a SamplingConfig (validated when made), or a sequence of them.
          batch: the rows; None with one setting gives scalars that serve any batch.
        """
        if isinstance(settings, SamplingConfig):
            settings = [settings] if batch is None else [settings] * batch
        elif not settings or (batch is not None and len(settings) > batch):
            raise InputError(f"{len(settings)} sampling settings for a batch of {batch}")
        rows = list(settings) + [settings[0]] * ((batch or len(settings)) - len(settings))
        column = lambda name, dtype: np.asarray([getattr(s, name) for s in rows], dtype)  # noqa: E731
        values = dict(
            temperature=column("temperature", np.float32),
            top_k=column("top_k", np.int32),
            top_p=column("top_p", np.float32),
        )
        if batch is None:
            values = {k: v[0] for k, v in values.items()}
        return cls(**values, greedy=all(s.greedy for s in rows))


def _rows(values: jax.Array, ndim: int) -> jax.Array:
    """Per-row values [B] (or []) shaped to broadcast over logits [B, ..., V] of `ndim` axes."""
    return values.reshape(values.shape + (1,) * (ndim - values.ndim))


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys with the order of the float32 values (-inf lowest; no NaN)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    flipped = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    return jax.lax.bitcast_convert_type(flipped, jnp.uint32) ^ jnp.uint32(0x80000000)


def _lowest_kept_key(keys: jax.Array, kept) -> jax.Array:
    """The largest t with kept(t) for keys [..., V], by 32 bisection steps over uint32; kept(t) -> bool [..., 1]
    must hold at t = 0 (or never, which keeps t = 0), fail above the largest key, and stay false once false."""
    hi = jnp.max(keys, axis=-1, keepdims=True) + 1

    def halve(_, bounds):  # invariant: kept(lo) and not kept(hi)
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = kept(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return jax.lax.fori_loop(0, 32, halve, (jnp.zeros_like(hi), hi))[0]


def top_k_mask(logits_bv: jax.Array, k) -> jax.Array:
    """Keeps the k largest logits of each row (ties with the k-th are kept too); k = 0 keeps all.

    k is an int or per-row int32 values (see `Sampling`). The k-th largest value is found without a sort: the number
    of logits at or above a key falls as the key rises, so bisection over the values' order-preserving keys finds it.
    """
    k = _rows(jnp.asarray(k, jnp.int32), logits_bv.ndim)
    keys = _order_keys(logits_bv)
    kth = _lowest_kept_key(keys, lambda t: jnp.sum(keys >= t, axis=-1, keepdims=True) >= k)
    return jnp.where((keys < kth) & (k > 0), NEG_INF, logits_bv)


def top_p_mask(logits_bv: jax.Array, p) -> jax.Array:
    """Keeps the smallest set of most likely tokens whose probability reaches p (nucleus); p = 1 keeps all.

    p is a float or per-row values. A token is kept when the tokens strictly more likely than it hold less than p
    (ties are kept together). The mass above a key falls as the key rises, so bisection over the keys finds the
    lowest kept one exactly, at O(32 V) per row.
    """
    p = _rows(jnp.asarray(p, jnp.float32), logits_bv.ndim)
    probs = jax.nn.softmax(logits_bv.astype(jnp.float32), axis=-1)
    keys = _order_keys(logits_bv)
    # The lowest kept key is the largest t whose tokens at or above it hold at least p (all of them always do).
    mass_from = lambda t: jnp.sum(jnp.where(keys >= t, probs, 0.0), axis=-1, keepdims=True)  # noqa: E731
    lowest = _lowest_kept_key(keys, lambda t: (t == 0) | (mass_from(t) >= p))
    return jnp.where((keys < lowest) & (p < 1), NEG_INF, logits_bv)


def process_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Temperature, top-k and top-p, in that order (as HF transformers applies them). Masked entries are -inf.

    Args:
      logits: float logits [B, ..., V] (or [..., V] when the sampling values are scalars).
      sampling: the values; `sampling.greedy` must be False. Greedy rows keep only their argmax.
    Returns:
      float32 logits of the distribution that sampling draws from.
    """
    temperature = _rows(sampling.temperature, logits.ndim)
    greedy_row = temperature == 0
    x = logits.astype(jnp.float32) / jnp.where(greedy_row, 1.0, temperature)
    # The filters run only when some row uses them: a batch without truncation pays nothing for it.
    x = jax.lax.cond(jnp.any(sampling.top_k > 0), top_k_mask, lambda x, _: x, x, sampling.top_k)
    x = jax.lax.cond(jnp.any(sampling.top_p < 1), top_p_mask, lambda x, _: x, x, sampling.top_p)

    def argmax_only(x):  # greedy rows keep their argmax alone
        top = jnp.arange(x.shape[-1]) == jnp.argmax(logits, axis=-1)[..., None]
        return jnp.where(greedy_row, jnp.where(top, 0.0, NEG_INF), x)

    return jax.lax.cond(jnp.any(greedy_row), argmax_only, lambda x: x, x)


def probabilities(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The distribution the next token is drawn from: one-hot argmax when greedy."""
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(process_logits(logits, sampling), axis=-1)


def sample(keys_b: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Draws one token per row of logits [B, ..., V], row b with keys_b[b] (unused when greedy) -> int32 [B, ...]."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return categorical_rows(keys_b, process_logits(logits, sampling))


def split_rows(keys_b: jax.Array, num: int = 2) -> jax.Array:
    """Each row's key split in `num`: typed keys [num, B], entry [i, b] = split(keys_b[b], num)[i]. Unpacks as
    `carry_b, draw_b = split_rows(keys_b)`."""
    return jax.vmap(lambda key: jax.random.split(key, num), out_axes=1)(keys_b)


def categorical_rows(keys_b: jax.Array, logits: jax.Array) -> jax.Array:
    """A draw from softmax(logits) over the last axis of logits [B, ..., V], row b with keys_b[b] -> int32 [B, ...]."""
    return jax.vmap(lambda key, x: jax.random.categorical(key, x, axis=-1))(keys_b, logits).astype(jnp.int32)


def uniform_rows(keys_b: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniforms in [0, 1), float32 [B, *shape], row b from keys_b[b]."""
    return jax.vmap(lambda key: jax.random.uniform(key, shape, jnp.float32))(keys_b)


def gumbel_rows(keys_b: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Standard Gumbel noise, float32 [B, *shape], row b from keys_b[b]."""
    return jax.vmap(lambda key: jax.random.gumbel(key, shape, jnp.float32))(keys_b)


def in_target_vocab(probs: jax.Array, vocab_ids: jax.Array, vocab_size: int) -> jax.Array:
    """Probabilities over a draft vocabulary [..., Vd] (column j: target id vocab_ids[j]) as probabilities over the
    target's vocab_size ids, 0 outside it. Each target id reads its draft column or an appended zero: a gather, which a
    CPU runs faster than the equivalent scatter."""
    Vd = vocab_ids.shape[0]
    column = jnp.full((vocab_size,), Vd, jnp.int32).at[vocab_ids].set(jnp.arange(Vd, dtype=jnp.int32))
    return jnp.concatenate([probs, jnp.zeros_like(probs[..., :1])], axis=-1)[..., column]
