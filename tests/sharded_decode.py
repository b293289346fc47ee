"""Run as a script with 8 fake CPU devices: tensor-parallel forward and greedy decode equal single-device ones."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.decoding.autoregressive import generate
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, init_weights, shard_weights
from specjax.sharding import make_mesh


def main(mesh_axes: dict[str, int]) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    cfg = ModelConfig("llama", 256, 64, 128, 3, 8, 4, 8, max_position_embeddings=256, eos_token_ids=(3,))
    weights = init_weights(cfg, jax.random.key(0), scale=0.1)
    mesh = make_mesh(mesh_axes)
    sharded = shard_weights(weights, cfg, mesh)
    assert not sharded.layers.q.sharding.is_fully_replicated
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 10)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(10), (4, 10))
    run = jax.jit(forward, static_argnums=1)
    single, _, _ = run(weights, cfg, ids, pos, KVCache.empty(cfg, 4, 16))
    multi, _, _ = run(sharded, cfg, ids, pos, KVCache.empty(cfg, 4, 16))
    np.testing.assert_allclose(np.asarray(multi), np.asarray(single), rtol=1e-5, atol=1e-5)

    prompts = [[5, 6, 7], list(range(10, 30)), [42], list(range(100, 109))]
    a = generate(weights, cfg, prompts, max_new_tokens=24)
    b = generate(sharded, cfg, prompts, max_new_tokens=24)
    assert [c.output_ids for c in a.completions] == [c.output_ids for c in b.completions]
    print("ok", mesh_axes, [len(c.output_ids) for c in b.completions])


if __name__ == "__main__":
    main(dict(zip(("data", "tensor"), map(int, sys.argv[1:3]))))
