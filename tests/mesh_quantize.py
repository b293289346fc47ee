"""Run as a script on 8 fake CPU devices: `mesh_quantize.py WORK`. Random targets (tied and untied) saved in WORK are
read with int8 matrices straight into their shards on a data=2,tensor=4 mesh. Prints one JSON line: the bytes each
device holds against the memory plan's, the scales' partition specs against those of their values with the contracted
axes replicated, and the tied target's greedy tokens on the mesh and on one device."""

import os
import sys

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.decoding.autoregressive import generate
from specjax.io.hf import load_hf, save_hf
from specjax.models.llama import init_weights, weight_bytes
from specjax.models.quantize import Int8Matrix, map_matrices

MESH = {"data": 2, "tensor": 4}
PROMPTS = [[5, 6, 7], list(range(10, 31)), [42], [3, 9, 27, 17]]


def specs(weights) -> tuple[list, list]:
    """(each scale's partition spec, its values' with the contracted axes replicated)."""
    scales, values = [], []

    def note(m: Int8Matrix, contracted: tuple[int, ...]) -> Int8Matrix:
        n = len(m.shape)
        scales.append(list(m.scale.sharding.spec) + [None] * (n - len(m.scale.sharding.spec)))
        padded = list(m.values.sharding.spec) + [None] * (n - len(m.values.sharding.spec))
        values.append([None if i - n in contracted else a for i, a in enumerate(padded)])
        return m

    map_matrices(weights, note)
    return scales, values


def main(root: Path) -> None:
    found = {"bytes_per_device": [], "planned_per_device": [], "scale_specs": [], "value_specs_of_output_axes": []}
    for tied in (True, False):
        cfg = ModelConfig("llama", 512, 64, 128, 2, 8, 4, 8, max_position_embeddings=128, tie_word_embeddings=tied)
        folder = root / f"target-{tied}"
        save_hf(folder, cfg, init_weights(cfg, jax.random.key(0), scale=0.1))
        _, sharded = load_hf(folder, jnp.float32, MESH, "int8")
        if tied:  # the embedding, split over the vocabulary, serves the lookup and the head
            _, one = load_hf(folder, jnp.float32, None, "int8")
            for weights, key in ((sharded, "tokens_mesh"), (one, "tokens_one")):
                out = generate(weights, cfg, PROMPTS, max_new_tokens=8, eos_ids=())
                found[key] = [c.output_ids for c in out.completions]
        per_device = {d: 0 for d in jax.devices()}
        for leaf in jax.tree.leaves(sharded):
            for shard in leaf.addressable_shards:
                per_device[shard.device] += shard.data.nbytes
        found["bytes_per_device"].append(sorted(set(per_device.values())))
        found["planned_per_device"].append([weight_bytes(cfg, jnp.float32, MESH, "int8")])
        scales, values = specs(sharded)
        found["scale_specs"].append(scales)
        found["value_specs_of_output_axes"].append(values)
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
