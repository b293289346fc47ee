"""Device meshes and the logical-axis rules that map weights, caches, batches and activations onto them.

Every array that decoding or training keeps declares logical axis names (`LOGICAL_AXES`): the weights in
`models.llama.weight_specs`, the KV cache in `CACHE_AXES`, batches as ("batch", ...). A rule table maps those names
onto mesh axes: `DEFAULT_RULES`, or a run's own (`merged_rules`: the training config's `mesh.rules`, `load_model`'s
`rules`), and `shardings_of` turns a tree of logical specs into the NamedShardings of a mesh. A dimension that does
not divide by its mesh axis, or whose mesh axis is already used by another dimension of the same array, is replicated
instead, so one rule table serves every model size.

Inside a traced function, `constrain` pins a value to its logical axes on the mesh set with `jax.set_mesh` (the
decoding loops enter the mesh of the weights they are given); with no mesh set it does nothing.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specjax.errors import InputError

# A rule table: (logical axis, mesh axis or axes) pairs; an axis without a rule, or whose rule is None or (), is
# replicated.
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]
# Every logical axis name an array of specjax declares.
LOGICAL_AXES = (
    "batch",  # rows of a batch
    "layers",  # a stacked weight's layer index
    "slots",  # KV cache positions
    "embed",  # the model (hidden) dimension
    "embed2",  # an EAGLE-3 midlayer's doubled input (embedding and hidden state side by side)
    "taps",  # an EAGLE-3 head's concatenated target features
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",  # MLP columns
    "vocab",
)
# Logical axis -> mesh axis (or axes). Heads and MLP columns go tensor-parallel, batches data-parallel. The trainer's
# meshes add "fsdp": the weights' model dimension goes over it and batches over data x fsdp; on a mesh without that
# axis (the decoding tools') those rules do nothing, so a model loaded onto a training mesh decodes there as it is.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("embed2", "fsdp"),
    ("taps", "fsdp"),
)
# A KV cache's k and v: [L, B, S, K, H].
CACHE_AXES = ("layers", "batch", "slots", "kv_heads", "head_dim")
MESH_AXES = ("data", "tensor")  # the axes the decoding tools' --mesh names


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """Shape, logical axis names (`LOGICAL_AXES`, or None for a dimension never split) and dtype (None: the run's) of
    one array: a weight of `specjax.models.llama.weight_specs` and the like."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: Any = None


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


def default_mesh_axes(num_devices: int, num_kv_heads: int) -> dict[str, int]:
    """Every device: tensor-parallel as far as the KV heads divide (each device keeps whole KV heads), the rest of
    the devices data-parallel."""
    tensor = max(t for t in range(1, num_devices + 1) if num_devices % t == 0 and num_kv_heads % t == 0)
    return {"data": num_devices // tensor, "tensor": tensor}


MeshChoice = Mesh | Mapping[str, int] | str | None  # a mesh, axis sizes, "auto" (every local device) or None (one)


def mesh_for(choice: MeshChoice, num_kv_heads: int) -> Mesh | None:
    """The mesh a model with `num_kv_heads` KV heads is placed on: `choice` itself; a mesh of its axis sizes (over the
    first devices when they ask for fewer than there are); every device by `default_mesh_axes` ("auto"); None (one
    device, unsharded) for None or a single device."""
    if choice is None or isinstance(choice, Mesh):
        return choice
    devices = jax.local_devices() if jax.process_count() == 1 else jax.devices()
    axes = default_mesh_axes(len(devices), num_kv_heads) if choice == "auto" else dict(choice)
    if -1 not in axes.values():  # fewer devices than there are: the first ones (data=1 is one device)
        devices = devices[: math.prod(axes.values())]
    mesh = make_mesh(axes, devices)
    return mesh if mesh.size > 1 else None


def larger_meshes(used: int, devices: int) -> list[dict[str, int]]:
    """Meshes over more than `used` of `devices` devices, fewest devices first, the most tensor-parallel first
    among the same number: where to look when a run does not fit."""
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    return [
        {"data": d // t, "tensor": t}
        for d in divisors
        if d > used
        for t in reversed([t for t in divisors if d % t == 0])
    ]


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,tensor=4' -> {"data": 2, "tensor": 4}; an axis left out has size 1, one size may be -1 (the rest).
    Raises InputError."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    for part in text.split(","):
        name, _, size = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or not size.strip().lstrip("-").isdigit():
            raise InputError(
                f"{{mesh}}: expected axes like data=2,tensor=4 (axes: {', '.join(MESH_AXES)})", settings={"mesh": text}
            )
        sizes[name] = int(size)
    if any(s == 0 or s < -1 for s in sizes.values()):
        raise InputError("{mesh}: sizes must be positive, or -1 for the rest of the devices", settings={"mesh": text})
    return sizes


def merged_rules(
    overrides: Mapping[str, str | Sequence[str] | None], mesh_axes: Sequence[str], base: Rules = DEFAULT_RULES
) -> Rules:
    """`base` with the logical axes of `overrides` mapped anew (MaxText's `logical_axis_rules`).

    Args:
      overrides: logical axis -> a mesh axis, a sequence of them (split over their product), or None (replicated).
      mesh_axes: the mesh axes a rule may name.
      base: the table the overrides replace entries of.
    Returns:
      The merged table: `base`'s order, then the axes it had no rule for.
    Raises:
      InputError naming every unknown logical axis and mesh axis at once.
    """
    targets = {
        name: (target,) if isinstance(target, str) else tuple(target or ()) for name, target in overrides.items()
    }
    unknown = [f"logical axis {name!r}" for name in targets if name not in LOGICAL_AXES]
    unknown += [f"mesh axis {a!r} (for {name})" for name, axes in targets.items() for a in axes if a not in mesh_axes]
    if unknown:
        raise InputError(
            f"sharding rules name an unknown {', an unknown '.join(unknown)}; logical axes: {', '.join(LOGICAL_AXES)}; "
            f"mesh axes: {', '.join(mesh_axes)}"
        )
    table = dict(base)
    table.update({name: axes[0] if len(axes) == 1 else axes or None for name, axes in targets.items()})
    return tuple(table.items())


def partition_spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh, rules: Rules = DEFAULT_RULES
) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axes on `mesh` (a Mesh or an AbstractMesh).

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


def named_sharding(axes, shape, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """The NamedSharding of one array with these logical axes and shape on `mesh` under `rules`."""
    return NamedSharding(mesh, partition_spec(axes, shape, mesh, rules))


def shardings_of(specs, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """The NamedShardings of a tree of logical specs on `mesh`.

    Args:
      specs: a tree of ArraySpecs (e.g. `specjax.models.llama.weight_specs`), or one ArraySpec.
      mesh: the mesh.
      rules: the logical-axis rules (`DEFAULT_RULES`, or a run's `merged_rules`).
    Returns:
      The tree of `specs`' structure with a NamedSharding in place of each spec.
    """
    return jax.tree.map(
        lambda s: named_sharding(s.axes, s.shape, mesh, rules), specs, is_leaf=lambda s: isinstance(s, ArraySpec)
    )


def place(arrays, specs, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """`arrays` on `mesh`, each split by the logical axes of its spec under `rules`: `specs` is a tree of ArraySpecs
    in `arrays`' structure (`shardings_of`)."""
    return jax.device_put(arrays, shardings_of(specs, mesh, rules))


def shard_fraction(
    axes: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int], rules: Rules = DEFAULT_RULES
) -> int:
    """How many ways an array with these logical axes is split on a mesh of `mesh_shape` under `rules` (its bytes per
    device are its bytes over this)."""
    spec = partition_spec(axes, shape, types.SimpleNamespace(shape=dict(mesh_shape)), rules)  # the sizes suffice
    names = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
    return math.prod(mesh_shape[a] for a in names)


def constrain(x: jax.Array, axes: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> jax.Array:
    """`x` pinned to its logical axes on the mesh set by `jax.set_mesh`; `x` itself when none is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, partition_spec(axes, x.shape, mesh, rules))


def set_rows(x: jax.Array, index: jax.Array, values, mode: str = "drop") -> jax.Array:
    """`x.at[b, index[b]].set(values[b])` for every row b, written row by row (vmap): the scatter's batch dimension
    is then explicit, so where rows are split over a mesh's data axis each shard writes its own rows and gathers
    nothing. `index` is [B] or [B, T]; `values` broadcasts to it (and x's trailing dimensions)."""
    values = jnp.broadcast_to(jnp.asarray(values, x.dtype), index.shape + x.shape[2:])
    return jax.vmap(lambda row, i, v: row.at[i].set(v, mode=mode))(x, index, values)


def get_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """`x[b, index[b]]` for every row b, read row by row (vmap), as `set_rows` writes: each data shard reads its own
    rows. `index` is [B] or [B, ...]."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def top_k_rows(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis, each data shard ranking its own rows (axis 0, "batch"): XLA's top-k
    partitioner would otherwise gather every row onto every device."""
    mesh = jax.sharding.get_abstract_mesh()
    rows = None if mesh.empty or mesh.size == 1 else partition_spec(("batch",), x.shape[:1], mesh)
    if rows is None or rows[0] is None:
        return jax.lax.top_k(x, k)
    return jax.shard_map(lambda block: jax.lax.top_k(block, k), in_specs=rows, out_specs=rows)(x)


def mesh_of(tree) -> Mesh | None:
    """The mesh of the first array of `tree` placed on more than one device by a NamedSharding, else None."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None
