"""One process of a multi-process (localhost) training run, or the single-process reference.

Usage: python tests/train_multiprocess.py PORT NUM_PROCESSES PROCESS_ID RUN_DIR
With NUM_PROCESSES > 1: gloo CPU collectives, jax.distributed.initialize on 127.0.0.1:PORT, one CPU device per
process, mesh data=NUM_PROCESSES. Trains the first 3 steps with `train()` (checkpoints and metrics under RUN_DIR),
exports the head (gathered from all processes), and prints "losses [...]" and a checksum of the head.
"""

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("XLA_FLAGS", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402


def main(port: int, num_processes: int, process_id: int, run_dir: str) -> None:
    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id,
            initialization_timeout=120,
        )  # fmt: skip
    import train_tiny

    from specjax.train.trainer import train

    assert jax.process_count() == num_processes and len(jax.local_devices()) == 1, jax.local_devices()
    assert len(jax.devices()) == num_processes
    mesh = {"data": num_processes, "fsdp": 1, "tensor": 1}
    _, trainer, source = train_tiny.build(mesh_axes=mesh)
    losses = []
    state = train(trainer, source, Path(run_dir), on_step=lambda step, host: losses.append(host["loss"]), stop_after=3)
    head = trainer.export(state)  # gathered to every host
    print("losses", json.dumps(losses), flush=True)
    print("head", json.dumps([float(head.q[...].sum()), float(abs(head.lm_head[...]).sum())]), flush=True)
    if num_processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
