"""One process of a multi-process (localhost) training run.

Usage: python tests/train_multiprocess.py PORT NUM_PROCESSES PROCESS_ID RUN_DIR STOP [--hang-after=N]
gloo CPU collectives, jax.distributed.initialize on 127.0.0.1:PORT, one CPU device per process, mesh
data=NUM_PROCESSES. Trains (or resumes) the tiny setup to step STOP of its schedule with `train()` (checkpoints and
metrics under RUN_DIR), each process
building only its own rows of every batch, and prints "loss STEP VALUE" after every step. With --hang-after it stands
still after step N, once the last checkpoint before it is on disk, waiting to be killed; otherwise it exports the
head (gathered from all processes) and prints a checksum of it ("head [...]").
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("XLA_FLAGS", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402


def main(port: int, num_processes: int, process_id: int, run_dir: Path, stop: int, hang_after: int | None) -> None:
    from specjax.host import start_distributed

    start_distributed(f"127.0.0.1:{port}", num_processes, process_id)
    import train_tiny

    from specjax.train.trainer import train

    assert jax.process_count() == num_processes and len(jax.local_devices()) == 1, jax.local_devices()
    _, trainer, source = train_tiny.build(mesh_axes={"data": num_processes, "fsdp": 1, "tensor": 1})
    assert len(trainer.local_rows) == trainer.cfg.training.batch_size // num_processes  # this process's rows only

    def on_step(step, host):
        print("loss", step, host["loss"], flush=True)
        if step == hang_after:
            last = step // trainer.cfg.checkpoint.every * trainer.cfg.checkpoint.every
            deadline = time.time() + 120
            while not (run_dir / "checkpoints" / str(last) / "commit_success.txt").exists() and time.time() < deadline:
                time.sleep(0.05)
            print("hanging", flush=True)
            time.sleep(3600)

    state = train(trainer, source, run_dir, on_step=on_step, stop_after=stop)
    head = trainer.export(state)  # gathered to every host
    print("head", json.dumps([float(head.q[...].sum()), float(abs(head.lm_head[...]).sum())]), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    hang = [int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--hang-after=")]
    args = [a for a in sys.argv[1:] if not a.startswith("--hang-after=")]
    main(int(args[0]), int(args[1]), int(args[2]), Path(args[3]), int(args[4]), hang[0] if hang else None)
