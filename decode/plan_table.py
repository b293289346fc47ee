"""Per-device memory plans of Llama-3.1-8B and Llama-3.1-70B with an EAGLE-3 head shaped as the published ones (one
target layer wide, 32000 draft tokens) on TPU slices and GPU nodes, from the shapes alone: no weight is made; the
head's arrays are shapes with the shardings its own rules give them on a mesh of fake CPU devices
(`Eagle3Head.place`), so their per-device share is counted as a run places it. Batch 8, a 1000-token prompt, 1024
new tokens, an EAGLE-3 tree of depth 5, top-k 8, 32 nodes, bfloat16 (and int8 targets), the accelerators' 512-token
prefill chunk. Estimates, not measurements on the devices. Prints two Markdown tables.

Usage: python decode/plan_table.py
"""

from __future__ import annotations

import os

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specjax.config import ModelConfig  # noqa: E402
from specjax.drafters import Eagle3Drafter  # noqa: E402
from specjax.drafters.tree import TreeSpec  # noqa: E402
from specjax.host import GIB  # noqa: E402
from specjax.measure.memory import memory_plan  # noqa: E402
from specjax.models.eagle3 import Eagle3Config, Eagle3Head, param_specs  # noqa: E402
from specjax.models.llama import ACCELERATOR_PREFILL_CHUNK  # noqa: E402
from specjax.sharding import default_mesh_axes, make_mesh, named_sharding  # noqa: E402

TARGETS = {
    "Llama-3.1-8B": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, max_position_embeddings=131072),
    "Llama-3.1-70B": ModelConfig("llama", 128256, 8192, 28672, 80, 64, 8, 128, max_position_embeddings=131072),
}
# name, devices, GB of memory each (the vendors' figures)
DEVICES = [
    ("TPU v5e-8", 8, 16),
    ("TPU v5p-8", 4, 95),
    ("TPU v6e-8", 8, 32),
    ("1x H100", 1, 80),
    ("8x H100", 8, 80),
    ("1x H200", 1, 141),
    ("8x H200", 8, 141),
]
TREE = TreeSpec.parse("5,8,32")


def shaped(shape, axes, mesh, dtype=jnp.bfloat16) -> jax.ShapeDtypeStruct:
    """An array's shape, dtype and sharding by its logical axes on `mesh` (whole when None)."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=mesh and named_sharding(axes, shape, mesh))


def plans_gib(cfg: ModelConfig, devices: int) -> dict[str, float]:
    """GiB a device holds for `cfg` with its head on every one of `devices` (tensor-parallel as the tools' default),
    for bfloat16 ("none") and int8 target weights."""
    axes = default_mesh_axes(devices, cfg.num_kv_heads)
    mesh = make_mesh(axes, jax.devices()[:devices]) if devices > 1 else None
    head_cfg = Eagle3Config.default_for(cfg, draft_vocab_size=32000)
    head = nnx.eval_shape(lambda: Eagle3Head(head_cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    for name, spec in param_specs(head_cfg).items():
        getattr(head, name).set_value(shaped(spec.shape, spec.axes, mesh))
    graphdef, params = nnx.split(head)
    V, Vd, D = cfg.vocab_size, head_cfg.draft_vocab_size, cfg.hidden_size
    embed = shaped((V, D), ("vocab", "embed"), mesh)
    # As `Eagle3Drafter.create` on a mesh: the drafted tokens' rows of the embedding and their ids whole.
    drafted = (shaped((Vd, D), (), mesh), shaped((V,), (), mesh, jnp.int32)) if mesh is not None else (None, None)
    drafter = Eagle3Drafter(params, embed, graphdef, TREE, *drafted)
    return {
        quantize: memory_plan(
            cfg,
            jnp.bfloat16,
            batch=8,
            prompt_len=1000,
            max_new_tokens=1024,
            drafter=drafter,
            draft_shape=TREE,
            target_weights=embed,
            mesh=axes if mesh is not None else None,
            quantize=quantize,
            prefill_chunk=ACCELERATOR_PREFILL_CHUNK,
        ).total
        / GIB
        for quantize in ("none", "int8")
    }


def main() -> None:
    sizes = sorted({n for _, n, _ in DEVICES})
    plans = {(t, n, q): gib for t, cfg in TARGETS.items() for n in sizes for q, gib in plans_gib(cfg, n).items()}
    meshes = [", ".join(f"{a}={k}" for a, k in default_mesh_axes(n, 8).items() if k > 1) or "one device" for n in sizes]
    print("| GiB per device (target + EAGLE-3 head) | " + " | ".join(meshes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for t in TARGETS:
        for q, label in (("none", "bfloat16"), ("int8", "int8 weights")):
            print(f"| {t}, {label} | " + " | ".join(f"{plans[t, n, q]:.2f}" for n in sizes) + " |")
    print()
    columns = [(t, q) for t in TARGETS for q in ("none", "int8")]
    print("| devices | " + " | ".join(f"{t}{', int8' if q == 'int8' else ''}" for t, q in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, n, gb in DEVICES:
        fits = ["fits" if plans[t, n, q] * GIB <= gb * 1e9 * 0.95 else "no" for t, q in columns]
        print(f"| {name} ({n} x {gb} GB) | " + " | ".join(fits) + " |")


if __name__ == "__main__":
    main()
