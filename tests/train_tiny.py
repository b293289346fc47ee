"""A tiny, fully in-memory EAGLE-3 training setup shared by the trainer tests and their subprocess scripts.

Target: a 4-layer llama, vocab 96, hidden 32, 4 heads / 2 KV heads, MLP 64 (every sharded dimension divides by 2).
Samples: 24 random token sequences with a "prompt" (loss mask 0) and a "response" (loss mask 1), packed into rows;
the target runs inside the step (training.features=online).
Run as a script (`python tests/train_tiny.py RUN_DIR STEPS [--hang-after=N] [k=v ...]`), it trains with `train()` and
prints one "step N" line per finished step (flushed); with --hang-after it stops moving after step N, waiting to be
killed (the kill/resume test).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

VOCAB, HIDDEN, DRAFT_VOCAB = 96, 32, 48

BASE_OVERRIDES = (
    "model.tap_layers=[1, 2, 3]",
    f"model.draft_vocab_size={DRAFT_VOCAB}",
    "training.batch_size=8",
    "training.seq_len=24",
    "training.features=online",
    "training.ttt_length=3",
    "training.steps=8",
    "training.warmup_steps=2",
    "training.learning_rate=0.01",
    "checkpoint.every=3",
    "checkpoint.keep=2",
    "logging.every=1",
)


def target():
    """(ModelConfig, Weights) of the tiny target."""
    import jax

    from specjax.config import ModelConfig
    from specjax.models.llama import init_weights

    cfg = ModelConfig("llama", VOCAB, HIDDEN, 64, 4, 4, 2, 8, max_position_embeddings=256)
    # The rbg generator: threefry compiles a kernel per weight shape that costs ~5 s on 2 busy cores (rbg: ~1.5 s).
    return cfg, init_weights(cfg, jax.random.key(0, impl="unsafe_rbg"), scale=0.2)


def samples(n: int = 24, seed: int = 0):
    """In-memory (tokens, loss_mask) pairs: a prompt of 4..8 tokens, then 8..24 response tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, r = int(rng.integers(4, 9)), int(rng.integers(8, 25))
        tokens = rng.integers(0, VOCAB, p + r).astype(np.int32)
        out.append((tokens, np.r_[np.zeros(p, np.int8), np.ones(r, np.int8)]))
    return out


def config(overrides: Sequence[str] = ()):
    from specjax.train.config import load_config

    return load_config(None, [*BASE_OVERRIDES, *overrides])


def build(overrides: Sequence[str] = (), mesh_axes: dict | None = None, devices=None, target_weights=None):
    """(TrainConfig, Trainer, BatchSource) of the tiny setup; the mesh defaults to the config's, the target's weights
    to `target()`'s (given, e.g. loaded onto the mesh, they must be those)."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.models.eagle3 import NORMS, Eagle3Config, Eagle3Head, param_specs
    from specjax.sharding import make_mesh
    from specjax.train.batches import BatchSource, pack
    from specjax.train.drafts import Eagle3Training
    from specjax.train.trainer import Trainer
    from specjax.train.vocab import draft_vocab

    cfg = config(overrides)
    target_cfg, weights = target()
    weights = weights if target_weights is None else target_weights
    data = samples()
    d2t, t2d, _ = draft_vocab(data, VOCAB, cfg.model.draft_vocab_size)
    head_cfg = Eagle3Config.default_for(target_cfg, cfg.model.draft_vocab_size)
    head_cfg = dataclasses.replace(head_cfg, tap_layers=cfg.model.tap_layers)
    # Random head weights from numpy (Eagle3Head's own random init compiles one kernel per shape: slow on 2 cores).
    rng = np.random.default_rng(cfg.training.seed)
    head_weights = {
        name: np.ones(spec.shape, np.float32) if name in NORMS else 0.05 * rng.standard_normal(spec.shape, np.float32)
        for name, spec in param_specs(head_cfg).items()
    }
    head = Eagle3Head(head_cfg, weights=head_weights)
    head.d2t[...] = jnp.asarray(d2t, jnp.int32)
    head.t2d[...] = jnp.asarray(t2d)
    axes = mesh_axes or {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    mesh = make_mesh(axes, devices)
    trainer = Trainer(cfg, target_cfg, weights, Eagle3Training(head, target_cfg, cfg.training), mesh)
    source = BatchSource(pack(data, cfg.training.seq_len), cfg.training.batch_size, cfg.training.seed)
    return cfg, trainer, source


def first_losses(trainer, source, steps: int) -> list[float]:
    """Losses of the first `steps` steps from the initial state (no checkpoints)."""
    import numpy as np

    state, losses = trainer.initial_state, []
    for step in range(steps):
        state, metrics = trainer.step(state, source.batch(step, trainer.local_rows))
        losses.append(float(np.asarray(metrics["loss"])))
    return losses


def main(argv: list[str]) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import time

    from specjax.train.trainer import train

    hang_after = [int(a.split("=", 1)[1]) for a in argv if a.startswith("--hang-after=")]
    argv = [a for a in argv if not a.startswith("--hang-after=")]
    run_dir, steps, overrides = Path(argv[0]), int(argv[1]), argv[2:]
    _, trainer, source = build([f"training.steps={steps}", *overrides])

    def on_step(step, host):
        print(f"step {step}", flush=True)
        if hang_after and step == hang_after[0]:
            # Stand still between checkpoints until the test kills us, once the last one is on disk (orbax writes
            # it in the background: under load that can take a while).
            last = (step // trainer.cfg.checkpoint.every) * trainer.cfg.checkpoint.every
            deadline = time.time() + 120
            while not (run_dir / "checkpoints" / str(last) / "commit_success.txt").exists() and time.time() < deadline:
                time.sleep(0.05)
            print("hanging", flush=True)
            time.sleep(3600)

    train(trainer, source, run_dir, on_step=on_step)
    print("finished", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
