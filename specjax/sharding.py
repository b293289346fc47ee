"""Device meshes and the logical-axis rules that map weights, caches and batches onto them.

Every weight declares logical axis names (models.llama.weight_specs); one rule table maps those names onto mesh axes.
A dimension that does not divide by its mesh axis, or whose mesh axis is already used by another dimension of the
same array, is replicated instead, so one rule table serves every model size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.config import ModelConfig
from specjax.errors import InputError
from specjax.models.llama import ArraySpec, Weights, weight_specs

# Logical axis -> mesh axis. Heads and MLP columns go tensor-parallel, batches data-parallel.
DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    ("batch", "data"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with the named axis sizes, e.g. {"data": 2, "tensor": 4}; one size may be -1 (the rest of the devices).

    Raises InputError when the sizes do not multiply to the device count.
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = dict(axes)
    free = [name for name, size in sizes.items() if size == -1]
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if len(free) > 1 or fixed <= 0:
        raise InputError(f"mesh {sizes}: sizes must be positive, with at most one -1")
    if free:
        if len(devices) % fixed:
            raise InputError(f"mesh {sizes} does not divide the {len(devices)} available devices")
        sizes[free[0]] = len(devices) // fixed
    if math.prod(sizes.values()) != len(devices):
        raise InputError(f"mesh {sizes} needs {math.prod(sizes.values())} devices, but {len(devices)} are available")
    return Mesh(np.array(devices).reshape(tuple(sizes.values())), tuple(sizes))


def partition_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules=DEFAULT_RULES) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axes on `mesh`.

    A rule maps a logical axis to one mesh axis or a tuple of them (e.g. batch over ("data", "fsdp")).
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        target = table.get(name)
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        present = tuple(a for a in mesh_axes if a in mesh.shape and a not in used)
        size = math.prod(mesh.shape[a] for a in present)
        if present and dim % size == 0:
            spec.append(present[0] if len(present) == 1 else present)
            used.update(present)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def named_sharding(axes, shape, mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(axes, shape, mesh, rules))


def weight_shardings(cfg: ModelConfig, mesh: Mesh, rules=DEFAULT_RULES) -> Weights:
    """A Weights pytree of NamedShardings for `cfg` on `mesh`."""
    return jax.tree.map(
        lambda s: named_sharding(s.axes, s.shape, mesh, rules),
        weight_specs(cfg),
        is_leaf=lambda x: isinstance(x, ArraySpec),
    )


def shard_weights(weights: Weights, cfg: ModelConfig, mesh: Mesh, rules=DEFAULT_RULES) -> Weights:
    """Places existing weights onto the mesh."""
    return jax.tree.map(jax.device_put, weights, weight_shardings(cfg, mesh, rules))
