"""Attention by blocks of cache slots, up to the live length: what a forward costs grows with the text, not the buffer.

Every attention of the package (the target's prefill chunks, one-token steps, chains and trees; the draft heads'
cached steps) is `attend`: the new tokens' scores first, then the cached keys read `KV_BLOCK` slots at a time with an
online softmax (a running max and sum in float32, as flash attention keeps them), for as many blocks as hold the
slots any query can see (`CachedKeys.live`). A buffer of 8k slots with 300 live tokens reads one block, not 8k slots;
an empty cache (a prefill's first chunk) reads none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

KV_BLOCK = 512  # cache slots read per block


@dataclasses.dataclass(frozen=True)
class CachedKeys:
    """The cached keys and values one attention reads, and which slots each query sees."""

    k: jax.Array  # [B, S, K, H], or every layer's [L, B, S, K, H], read at `layer`
    v: jax.Array
    visible: Callable[[jax.Array], jax.Array]  # slot ids [Sb] -> bool [B, T, Sb]: which of them each query sees
    live: jax.Array | int | None = None  # no query sees a slot >= live, so blocks past it are not read; None: all S
    layer: jax.Array | None = None

    @property
    def num_slots(self) -> int:
        return self.k.shape[-3]

    def read(self, start: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, size, K, H] of slots start .. start + size - 1 (of `layer` when stacked)."""
        if self.layer is None:
            return tuple(jax.lax.dynamic_slice_in_dim(x, start, size, axis=1) for x in (self.k, self.v))
        B, K, H = self.k.shape[1], *self.k.shape[3:]
        corner = (jnp.asarray(self.layer, jnp.int32), 0, jnp.asarray(start, jnp.int32), 0, 0)
        return tuple(jax.lax.dynamic_slice(x, corner, (1, B, size, K, H))[0] for x in (self.k, self.v))


def slots_below(counts_b: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """`CachedKeys.visible` for a row's first counts_b[b] slots, seen by each of its queries."""
    return lambda slots: slots[None, None, :] < counts_b[:, None, None]


def slots_where(mask_bts: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """`CachedKeys.visible` of a mask [B, T, S] given whole (training, where S is a short context)."""
    return lambda slots: jnp.take(mask_bts, slots, axis=2)


def attend(
    q_btkgh: jax.Array, k_new_btkh: jax.Array, v_new_btkh: jax.Array, new_mask_btt: jax.Array, cached: CachedKeys
) -> jax.Array:
    """Softmax attention of T new queries over the new tokens and the visible cache slots, never concatenating them.

    Args:
      q_btkgh: queries [B, T, K, G, H], rotary already applied.
      k_new_btkh, v_new_btkh: the new tokens' keys/values [B, T, K, H].
      new_mask_btt: bool [B, T, T], which new tokens each query sees; each sees at least itself.
      cached: the cache's keys/values, read by blocks up to `cached.live` (cast to the new values' dtype).
    Returns:
      [B, T, K, G, H] in the dtype of the values; scores, softmax statistics and sums in float32.
    """
    scale = q_btkgh.shape[-1] ** -0.5
    neg = jnp.finfo(jnp.float32).min
    dtype = v_new_btkh.dtype

    def scores(k_bskh, seen_bts):
        s = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32) * scale
        return jnp.where(seen_bts[:, None, None], s, neg)

    def weighted(p_bkgts, v_bskh):
        return jnp.einsum("bkgts,bskh->bkgth", p_bkgts.astype(dtype), v_bskh, preferred_element_type=jnp.float32)

    s = scores(k_new_btkh, new_mask_btt)
    m = s.max(-1)  # [B, K, G, T]; finite, as every query sees itself
    p = jnp.exp(s - m[..., None])
    total, acc = p.sum(-1), weighted(p, v_new_btkh)

    S = cached.num_slots
    size = min(KV_BLOCK, S)

    def block(j, carry):
        m, total, acc = carry
        first = j * size
        start = jnp.minimum(first, S - size)  # the last block may overlap the one before it: those slots are masked
        k, v = (x.astype(dtype) for x in cached.read(start, size))
        slots = start + jnp.arange(size)
        s = scores(k, cached.visible(slots) & (slots >= first)[None, None, :])
        m_new = jnp.maximum(m, s.max(-1))
        rescale, p = jnp.exp(m - m_new), jnp.exp(s - m_new[..., None])
        return m_new, total * rescale + p.sum(-1), acc * rescale[..., None] + weighted(p, v)

    blocks = -(-S // size) if cached.live is None else (cached.live + size - 1) // size
    _, total, acc = jax.lax.fori_loop(0, blocks, block, (m, total, acc))
    return jnp.einsum("bkgth->btkgh", acc / total[..., None]).astype(dtype)
