"""Run as a script with 8 fake CPU devices: the first training losses on meshes data x fsdp x tensor, the target
loaded from its files straight onto the mesh (training.features=online).

Usage: python tests/train_sharded.py STEPS D,F,T[,N] ... [section.key=value ...]   prints one line
"losses D F T [l1, ...] split: NAMES vocabulary: AXES" per mesh (N: training.grad_accumulation, 1 by default; the
config overrides apply to every mesh, e.g. mesh.rules.vocab=null; AXES: the mesh axes the target's embedding rows
are split over), after asserting that the target stays as loaded (no second copy), that the target's and the
head's weights (when fsdp or tensor > 1) and the batches really are split over devices, and that the loaded target
decodes there (what the regenerate and evaluate stages do with it) the greedy tokens of the unsharded one.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import train_tiny  # noqa: E402

from specjax.decoding.autoregressive import generate  # noqa: E402
from specjax.io.hf import load_hf, save_hf  # noqa: E402
from specjax.sharding import make_mesh  # noqa: E402


def main(folder: Path, steps: int, overrides: list[str], data: int, fsdp: int, tensor: int, microbatches: int = 1):
    assert len(jax.devices()) == 8, jax.devices()
    axes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    overrides = [f"training.grad_accumulation={microbatches}", *overrides]
    rules = train_tiny.config(overrides).mesh.sharding_rules
    _, loaded = load_hf(folder, mesh=make_mesh(axes), rules=rules)  # each tensor read into its shards
    _, trainer, source = train_tiny.build(overrides, mesh_axes=axes, target_weights=loaded)
    assert all(a is b for a, b in zip(jax.tree.leaves(trainer.target_weights), jax.tree.leaves(loaded)))
    params = trainer.initial_state["params"]
    split = sorted(k for k, p in params.items() if not p.sharding.is_fully_replicated)
    if fsdp * tensor > 1:  # the weights really are split over devices
        assert {"q", "fc", "gate", "lm_head"} <= set(split), split
        q = trainer.target_weights.layers.q
        assert q.addressable_shards[0].data.size * fsdp * tensor == q.size, q.sharding
        assert params["q"].addressable_shards[0].data.shape != params["q"].shape
        mu = trainer.initial_state["opt_state"][1][0].mu["q"]  # Adam's moments are split like the weights
        assert mu.sharding == params["q"].sharding, (mu.sharding, params["q"].sharding)
    assert not trainer.batch_sharding.is_fully_replicated
    losses = train_tiny.first_losses(trainer, source, steps)
    compact = json.dumps(losses, separators=(",", ":"))
    rows = trainer.target_weights.embed.sharding.spec[0]  # the embedding's vocabulary dimension
    vocabulary = ",".join((rows,) if isinstance(rows, str) else rows or ("none",))
    print("losses", data, fsdp, tensor, compact, "split:", ",".join(split), "vocabulary:", vocabulary, flush=True)
    cfg, whole = train_tiny.target()
    prompts = [[1, 5, 9], [7, 3, 2, 8, 4], [11], [30, 31, 32, 33]]
    sharded, unsharded = (
        [c.output_ids for c in generate(w, cfg, prompts, max_new_tokens=6).completions] for w in (loaded, whole)
    )
    assert sharded == unsharded, (sharded, unsharded)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        save_hf(work, *train_tiny.target())
        meshes = [arg for arg in sys.argv[2:] if "=" not in arg]
        overrides = [arg for arg in sys.argv[2:] if "=" in arg]
        for mesh in meshes:
            main(Path(work), int(sys.argv[1]), overrides, *map(int, mesh.split(",")))
