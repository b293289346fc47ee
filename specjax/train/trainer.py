"""Stage 4 (train): the sharded, jitted step of a draft's loss (specjax/train/drafts.py), orbax checkpoints, exact
resume, metrics.

The step reads the target's features from the batch (stored by the features stage), or with `training.features:
online` runs the frozen target itself. Target weights, draft weights, optimizer state and batches all carry
NamedShardings on one mesh (axes data / fsdp / tensor), split by the run's logical-axis rules (`mesh.rules` over
`specjax.sharding.DEFAULT_RULES`); the step is `jax.jit` with in/out shardings. Everything a run depends on (the
batch, a DFlash step's anchors) is a function of (config, step), so resuming from a checkpoint continues bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental.multihost_utils import process_allgather
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from specjax.errors import CheckpointError, OutputError, SpecjaxError
from specjax.host import append_text, write_file
from specjax.models.llama import Weights, weight_shardings
from specjax.sharding import ArraySpec, shardings_of
from specjax.train.batches import ROW_KEYS, BatchSource
from specjax.train.config import TrainConfig
from specjax.train.features import feature_layers, target_features


class TrainingDiverged(SpecjaxError):
    """The loss or a weight became NaN or infinite, or a weight grew past PARAM_LIMIT."""


# A step whose weights leave [-PARAM_LIMIT, PARAM_LIMIT] has diverged even while its loss is finite: a head's weights
# are of order 1, and a checkpoint is kept as "last good" only when its loss and weights are finite and bounded.
PARAM_LIMIT = 1e4


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW (betas 0.9 / 0.95, as EAGLE) with linear warmup and cosine decay, after global-norm clipping."""
    t = cfg.training
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.learning_rate,
        warmup_steps=min(t.warmup_steps, t.steps - 1),
        decay_steps=t.steps,
        end_value=t.learning_rate * t.final_lr_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=t.weight_decay),
    )


def compute_dtype(name: str) -> jnp.dtype:
    """`training.compute_dtype`: bfloat16 or float32; "auto" is bfloat16 on GPU and TPU, float32 on the CPU."""
    if name == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    return jnp.dtype(name)


def to_global(host: np.ndarray | jax.Array, sharding: NamedSharding) -> jax.Array:
    """Places an array that every process holds in full onto a (possibly multi-host) sharding."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def placed(x: np.ndarray | jax.Array, sharding: NamedSharding) -> jax.Array:
    """`x` on `sharding`: as it is when it is there already (a target loaded onto the run's mesh), else `to_global`."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return to_global(x, sharding)


class Trainer:
    """Owns the mesh placement and the compiled step of one training run of a draft (specjax/train/drafts.py)."""

    def __init__(self, cfg: TrainConfig, target_cfg, target_weights: Weights, draft, mesh: Mesh):
        self.cfg, self.target_cfg, self.draft, self.mesh = cfg, target_cfg, draft, mesh
        self.feature_layers = feature_layers(draft.tap_layers, target_cfg)
        self.batch_keys = (*ROW_KEYS, "features") if cfg.training.features == "stored" else ROW_KEYS
        self.optimizer = make_optimizer(cfg)
        self.compute_dtype = compute_dtype(cfg.training.compute_dtype)

        rules = cfg.mesh.sharding_rules
        target_shardings = weight_shardings(target_cfg, mesh, rules)
        self.target_weights = jax.tree.map(placed, target_weights, target_shardings)
        # The master weights: float32, whatever the compute dtype.
        draft_shardings = shardings_of(draft.specs(), mesh, rules)
        params = jax.tree.map(lambda x, s: to_global(np.asarray(x, np.float32), s), draft.params, draft_shardings)
        B = cfg.training.batch_size
        self.batch_sharding = shardings_of(ArraySpec((B, 1), ("batch", None)), mesh, rules)
        # The rows of a global batch that this process's devices hold: the only ones it builds (`step`).
        held = self.batch_sharding.addressable_devices_indices_map((B, 1)).values()
        self.local_rows = np.unique(np.concatenate([np.arange(B)[index[0]] for index in held]))
        # Every leaf of the state lives on the mesh: Adam's moments shaped and sharded like the weights, scalars
        # (step counts) replicated. Left to themselves, jit puts constant outputs on one device, which a step over
        # several devices (or processes) refuses.
        replicated = NamedSharding(mesh, PartitionSpec())
        opt_shardings = optax.tree_map_params(
            self.optimizer,
            lambda _, sharding: sharding,
            jax.eval_shape(self.optimizer.init, params),
            jax.tree.map(lambda p: p.sharding, params),
            transform_non_params=lambda _: replicated,
        )
        opt_state = jax.jit(self.optimizer.init, out_shardings=opt_shardings)(params)
        step = to_global(np.zeros((), np.int32), replicated)
        self.initial_state = {"params": params, "opt_state": opt_state, "step": step}
        self.state_shardings = jax.tree.map(lambda x: x.sharding, self.initial_state)
        self._step = jax.jit(
            self._train_step,
            in_shardings=(self.state_shardings, target_shardings, dict.fromkeys(self.batch_keys, self.batch_sharding)),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
        )

    def loss(self, params, target_weights: Weights, batch: dict, step: jax.Array, totals):
        """The draft's loss and metrics of one (micro)batch (stored features, or the frozen target run here), in the
        compute dtype; `totals`: the draft's divisors of the whole batch."""
        params = jax.tree.map(lambda x: x.astype(self.compute_dtype), params)
        rows = {k: batch[k] for k in ROW_KEYS}
        if "features" in batch:
            features = batch["features"].astype(target_weights.embed.dtype)
        else:
            features = target_features(target_weights, self.target_cfg, self.feature_layers, rows)
        return self.draft.loss(params, target_weights, rows, features, step, totals)

    def _train_step(self, state: dict, target_weights: Weights, batch: dict):
        """One optimizer update from the summed gradients of `training.grad_accumulation` microbatches, run one
        after another; microbatch m holds rows m, m + N, ..., so each device's rows feed every microbatch."""
        n = self.cfg.training.grad_accumulation
        args = state["step"], self.draft.totals({k: batch[k] for k in ROW_KEYS})
        grad_fn = jax.value_and_grad(self.loss, has_aux=True)
        parts = jax.tree.map(lambda x: x.reshape(-1, n, *x.shape[1:]).swapaxes(0, 1), batch)

        def accumulate(sums, part):
            (loss, aux), grads = grad_fn(state["params"], target_weights, part, *args)
            return jax.tree.map(jnp.add, sums, (loss, aux, grads)), None

        first = jax.tree.map(lambda x: x[0], parts)
        shapes = jax.eval_shape(grad_fn, state["params"], target_weights, first, *args)
        (loss, aux), grads = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        (loss, aux, grads), _ = jax.lax.scan(accumulate, (loss, aux, grads), parts)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(params)]))
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "param_max": largest, **aux}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def step(self, state: dict, batch: dict[str, np.ndarray]) -> tuple[dict, dict]:
        """One update from this process's rows (`local_rows`) of the global batch."""
        rows = np.arange(self.cfg.training.batch_size)

        def place(local: np.ndarray) -> jax.Array:
            def device_rows(index):
                return local[np.searchsorted(self.local_rows, rows[index[0]])]

            return jax.make_array_from_callback((len(rows), *local.shape[1:]), self.batch_sharding, device_rows)

        return self._step(state, self.target_weights, {k: place(v) for k, v in batch.items()})

    def export(self, state: dict):
        """The trained draft (`draft.export` of the weights), gathered to host memory."""
        # process_allgather: on several hosts, a sharded weight is not all addressable from one process.
        return self.draft.export(jax.tree.map(lambda x: jnp.asarray(process_allgather(x, tiled=True)), state["params"]))


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drops metric lines past `last_step` (written after the checkpoint a resumed run restarts from), and a last
    line that a full disk cut short (it has no newline); creates the file empty when there is none."""
    complete = path.read_text().split("\n")[:-1] if path.exists() else []
    write_file(path, "".join(line + "\n" for line in complete if json.loads(line)["step"] <= last_step))


def _divergence_message(host: dict, step: int, last_good: int | None) -> str:
    what = (
        f"the loss became {host['loss']}"
        if not math.isfinite(host["loss"])
        else f"a weight reached {host['param_max']:.3g} (beyond {PARAM_LIMIT:g})"
    )
    if last_good is None:
        return f"{what} at step {step}, before any checkpoint; lower training.learning_rate and run again"
    return (
        f"{what} at step {step}; the last good checkpoint (step {last_good}) is intact: run again with the same "
        "output_dir and a lower training.learning_rate to resume from it (optimiser settings may change on resume)"
    )


def checkpoint_manager(trainer: Trainer, run_dir: Path) -> ocp.CheckpointManager:
    """Orbax checkpoints under run_dir/checkpoints: atomic (written aside, then renamed), the last k kept; what an
    interrupted save left aside is removed when the next run starts."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=trainer.cfg.checkpoint.keep, create=True, cleanup_tmp_directories=True
    )
    return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options)


def refused_write(error: BaseException) -> str | None:
    """Why the disk refused a checkpoint write ("No space left on device"), from orbax's OSError or tensorstore's
    ValueError("... [os_error_code='28']"); None for any other error."""
    if isinstance(error, OSError):
        return error.strerror or str(error)
    code = re.search(r"os_error_code='(\d+)'", str(error)) if isinstance(error, ValueError) else None
    return os.strerror(int(code[1])) if code else None


class _RefusedWriteEchoes(logging.Filter):
    """Drops the log records in which orbax's threads report a refused write themselves (absl's, and asyncio's
    "exception was never retrieved")."""

    loggers = ("absl", "asyncio")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and refused_write(record.exc_info[1]))


@contextlib.contextmanager
def refused_checkpoint_writes(folder: Path):
    """Turns a checkpoint write the disk refuses (full, read-only) into one OutputError line naming `folder`.

    Orbax saves in background threads: a refused write surfaces at the next save or at `wait_until_finished`, and
    the threads report it in tracebacks of their own (logs, and tensorstore's callbacks into the event loop they
    closed). Those are held back while the block runs, and for the rest of the process once a write was refused:
    the failed save's threads go on reporting it as they wind down."""
    echoes, unraisable = _RefusedWriteEchoes(), sys.unraisablehook
    for name in echoes.loggers:
        logging.getLogger(name).addFilter(echoes)
    sys.unraisablehook = lambda u: None if "Event loop is closed" in str(u.exc_value) else unraisable(u)
    refused = None
    try:
        yield
    except (OSError, ValueError) as e:
        refused = refused_write(e)
        if refused is None:
            raise
        raise OutputError(
            f"cannot write a checkpoint in {folder}: {refused}; the checkpoints already written are intact: free "
            "space (or make the disk writable) and run again to resume"
        ) from None
    finally:
        if refused is None:
            for name in echoes.loggers:
                logging.getLogger(name).removeFilter(echoes)
            sys.unraisablehook = unraisable


def restore_latest(trainer: Trainer, manager: ocp.CheckpointManager) -> dict:
    """The train state of the newest intact checkpoint, placed with the run's shardings; the initial state if none.

    A checkpoint that does not restore (corrupt or missing files) or holds non-finite weights is moved aside to
    `corrupt-checkpoints/STEP` (or STEP.N) beside `checkpoints/`, with one line saying so, and the next older one
    is tried.
    Raises CheckpointError when checkpoints exist but none is intact.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), trainer.initial_state
    )
    steps = sorted(manager.all_steps(), reverse=True)
    for step in steps:
        try:
            state = manager.restore(step, args=ocp.args.StandardRestore(abstract))
            intact = all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(state["params"]))
            reason = "non-finite weights"
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore fail in many ways on damaged files
            intact, reason = False, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if intact:
            print(f"restored the checkpoint of step {step}", file=sys.stderr)
            return state
        aside = Path(manager.directory).parent / "corrupt-checkpoints" / str(step)
        aside = next(p for n in range(1000) if not (p := aside.with_name(f"{step}.{n}" if n else str(step))).exists())
        if jax.process_index() == 0:
            try:
                aside.parent.mkdir(exist_ok=True)
                os.replace(Path(manager.directory) / str(step), aside)
            except OSError as e:
                raise OutputError(f"cannot move the damaged checkpoint of step {step} aside: {e.strerror}") from None
        print(f"the checkpoint of step {step} is damaged ({reason}); moved it to {aside}", file=sys.stderr)
        manager.reload()
    if steps:
        raise CheckpointError(
            f"no intact checkpoint in {manager.directory} (damaged ones were moved to corrupt-checkpoints/); "
            "delete the train folder to start training again"
        )
    return trainer.initial_state


def train(
    trainer: Trainer,
    source: BatchSource,
    run_dir: Path,
    on_step: Callable[[int, dict], None] | None = None,
    stop_after: int | None = None,
) -> dict:
    """Runs (or resumes) training to `training.steps`.

    Args:
      trainer: the Trainer.
      source: the batches.
      run_dir: the stage folder: checkpoints/ and metrics.jsonl go here.
      on_step: optional callback(step, host metrics) after each step (tests use it).
      stop_after: stop after this step (checkpointing as usual), as if interrupted; for tests and partial runs.
    Returns:
      The final train state.
    Raises:
      OutputError when the disk refuses a metrics line or a checkpoint; the checkpoints before it are intact.
    """
    cfg = trainer.cfg
    manager = checkpoint_manager(trainer, run_dir)
    state = restore_latest(trainer, manager)
    metrics_path = run_dir / "metrics.jsonl"
    if jax.process_index() == 0:  # one writer: the other processes of a multi-host run share this folder
        truncate_metrics(metrics_path, int(state["step"]))
    start = int(state["step"])
    end = cfg.training.steps if stop_after is None else min(cfg.training.steps, stop_after)
    tokens_per_step = cfg.training.batch_size * cfg.training.seq_len
    bar = tqdm(
        range(start, end),
        initial=start,
        total=cfg.training.steps,
        desc="train",
        file=sys.stderr,
        disable=jax.process_index() != 0,
    )
    with bar, refused_checkpoint_writes(Path(manager.directory)):
        try:
            t0 = time.perf_counter()
            for step in bar:
                state, metrics = trainer.step(state, source.batch(step, trainer.local_rows))
                host = jax.tree.map(lambda x: np.asarray(x).tolist(), jax.device_get(metrics))
                if not (math.isfinite(host["loss"]) and host["param_max"] <= PARAM_LIMIT):  # NaN fails both
                    raise TrainingDiverged(_divergence_message(host, step + 1, manager.latest_step()))
                done = step + 1
                rate = tokens_per_step / (time.perf_counter() - t0)
                t0 = time.perf_counter()
                bar.set_postfix(loss=f"{host['loss']:.3f}", acc0=f"{host['acc_k'][0]:.2f}", tok_s=f"{rate:.0f}")
                if (done % cfg.logging.every == 0 or done == end) and jax.process_index() == 0:
                    record = {
                        "step": done,
                        "loss": host["loss"],
                        "loss_k": host["loss_k"],
                        "acc_k": host["acc_k"],
                        "grad_norm": host["grad_norm"],
                        "tokens_per_s": rate,
                    }
                    append_text(metrics_path, json.dumps(record) + "\n")
                if on_step is not None:
                    on_step(done, host)
                if done % cfg.checkpoint.every == 0 or done == end:
                    manager.save(done, args=ocp.args.StandardSave(state))
        finally:
            # Also on an error (divergence, interrupt): a checkpoint being written in the background is completed,
            # so the newest checkpoint on disk is whole and the next run resumes from it.
            try:
                manager.wait_until_finished()
            finally:
                manager.close()
    return state
