"""Run as a script with 8 fake CPU devices: the first 3 training losses on meshes data x fsdp x tensor.

Usage: python tests/train_sharded.py D,F,T [D,F,T ...]   prints one line "losses D F T [l1, l2, l3]" per mesh, after
asserting that the weights (when fsdp or tensor > 1) and the batches really are split over devices.
"""

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import train_tiny  # noqa: E402


def main(data: int, fsdp: int, tensor: int) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    _, trainer, source = train_tiny.build(mesh_axes={"data": data, "fsdp": fsdp, "tensor": tensor})
    params = trainer.initial_state["params"]
    split = sorted(k for k, p in params.items() if not p.sharding.is_fully_replicated)
    if fsdp * tensor > 1:  # the weights really are split over devices
        assert {"q", "fc", "gate", "lm_head"} <= set(split), split
        assert not trainer.target_weights.layers.q.sharding.is_fully_replicated
        assert params["q"].addressable_shards[0].data.shape != params["q"].shape
        mu = trainer.initial_state["opt_state"][1][0].mu["q"]  # Adam's moments are split like the weights
        assert mu.sharding == params["q"].sharding, (mu.sharding, params["q"].sharding)
    assert not trainer.batch_sharding.is_fully_replicated
    losses = train_tiny.first_losses(trainer, source, 3)
    compact = json.dumps(losses, separators=(",", ":"))
    print("losses", data, fsdp, tensor, compact, "split:", ",".join(split), flush=True)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        main(*map(int, arg.split(",")))
