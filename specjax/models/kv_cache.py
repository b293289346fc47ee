"""Fixed-shape KV buffers. Nothing is ever resized: rows advance `lengths`, and rolling back is moving it back."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.sharding import CACHE_AXES, constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]
    lengths: jax.Array  # [B] int32: slots [0, lengths[b]) of row b hold committed tokens; slot s is position s

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, num_slots: int, dtype=jnp.float32) -> KVCache:
        """Zeroed buffers; on a mesh set with `jax.set_mesh`, rows over data and KV heads over tensor."""
        shape = (cfg.num_layers, batch, num_slots, cfg.num_kv_heads, cfg.head_dim)
        k, v = (constrain(jnp.zeros(shape, dtype), CACHE_AXES) for _ in "kv")
        return cls(k, v, constrain(jnp.zeros((batch,), jnp.int32), ("batch",)))

    @property
    def num_slots(self) -> int:
        return self.k.shape[2]

    def write(self, k_new: jax.Array, v_new: jax.Array) -> KVCache:
        """Writes [L, B, T, K, H] new keys/values to slots lengths + arange(T); slots past the end are dropped."""
        T = k_new.shape[2]
        return self.write_at(self.lengths[:, None] + jnp.arange(T)[None, :], k_new, v_new)

    def write_at(self, slots_bt: jax.Array, k_new: jax.Array, v_new: jax.Array) -> KVCache:
        """Writes [L, B, T, K, H] new keys/values to the given slots [B, T] of each row; slots past the end (>=
        num_slots) are dropped. Lengths do not move."""

        # The scatter names the rows as a batch dimension (row b's slots index row b), so on a mesh each data shard
        # writes its own rows without gathering the others' new keys and values, and nothing is transposed.
        numbers = jax.lax.ScatterDimensionNumbers(
            update_window_dims=(0, 3, 4),  # [L, B, T, K, H] updates: L, K and H are written whole
            inserted_window_dims=(2,),  # one slot per update
            scatter_dims_to_operand_dims=(2,),
            operand_batching_dims=(1,),
            scatter_indices_batching_dims=(0,),
        )

        def write(cache_lbskh, new_lbtkh):
            return jax.lax.scatter(
                cache_lbskh,
                slots_bt[..., None],
                new_lbtkh.astype(cache_lbskh.dtype),
                numbers,
                mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
            )

        return dataclasses.replace(self, k=write(self.k, k_new), v=write(self.v, v_new))

    def at_lengths(self, lengths_b: jax.Array) -> KVCache:
        """The same buffers with `lengths_b` committed slots per row: moving lengths back is rolling back."""
        return dataclasses.replace(self, lengths=jnp.asarray(lengths_b, jnp.int32))

    def repeat_rows(self, copies: int) -> KVCache:
        """Each row `copies` times, the copies adjacent: [B] rows -> [B * copies]."""
        return KVCache(*(jnp.repeat(x, copies, axis=1) for x in (self.k, self.v)), jnp.repeat(self.lengths, copies))

    def advance(self, n_b: jax.Array) -> KVCache:
        """Commits the first n_b[b] written tokens of each row."""
        return dataclasses.replace(self, lengths=self.lengths + n_b.astype(jnp.int32))
