"""Run as a script with 8 fake CPU devices: exports the tiny sharded training step (mesh data 2 x fsdp 2 x tensor 2)
for GPUs and TPUs with `jax.export`, writes its module text to OUT and prints its platforms and device count (JSON).

Usage: python tests/export_sharded.py OUT
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
from jax import export  # noqa: E402


def main(out: Path) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    _, trainer, source = train_tiny.build(mesh_axes={"data": 2, "fsdp": 2, "tensor": 2})
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding) for k, v in source.batch(0).items()
    }
    exported = export.export(trainer._step, platforms=("cuda", "tpu"))(
        trainer.initial_state, trainer.target_weights, batch
    )
    out.write_text(exported.mlir_module())
    print(json.dumps({"platforms": exported.platforms, "nr_devices": exported.nr_devices}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
