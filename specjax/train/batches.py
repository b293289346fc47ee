"""Packed, fixed-shape training rows, and batches that are a pure function of the step: resuming at step s yields
exactly the same data."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError

ROW_KEYS = ("tokens", "loss_mask", "positions", "segments")


def pack(samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
    """Packs samples whole into rows of `seq_len` tokens (first fit, longest first; longer samples are truncated).

    Args:
      samples: (tokens, loss_mask) pairs.
      seq_len: T, the row length.
    Returns:
      int32 arrays [R, T]: "tokens", "loss_mask", "positions" (restarting at 0 in every sample) and "segments"
      (1, 2, ... for the samples of a row, 0 for padding). Samples with no loss token within `seq_len` are dropped.
    """
    usable = [(t[:seq_len], m[:seq_len]) for t, m in samples if m[:seq_len].any()]
    order = sorted(range(len(usable)), key=lambda i: (-len(usable[i][0]), i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = len(usable[i][0])
        r = next((r for r, f in enumerate(free) if f >= n), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(seq_len)
        rows[r].append(i)
        free[r] -= n
    out = {key: np.zeros((len(rows), seq_len), np.int32) for key in ROW_KEYS}
    for r, members in enumerate(rows):
        start = 0
        for segment, i in enumerate(members, 1):
            tokens, mask = usable[i]
            span = slice(start, start + len(tokens))
            out["tokens"][r, span], out["loss_mask"][r, span] = tokens, mask
            out["positions"][r, span], out["segments"][r, span] = np.arange(len(tokens)), segment
            start += len(tokens)
    return out


def sample_causal_mask(segments_bt: jax.Array) -> jax.Array:
    """bool [B, T, T]: row t sees the rows s <= t of its own sample (causal attention within packed samples)."""
    T = segments_bt.shape[1]
    return (segments_bt[:, :, None] == segments_bt[:, None, :]) & jnp.tril(jnp.ones((T, T), bool))


def nested_subset(count: int, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of ceil(fraction x count) of `count` rows: a prefix of one seeded permutation, so the subset of
    a smaller fraction lies inside that of every larger one."""
    order = np.random.default_rng([seed, count]).permutation(count)
    return np.sort(order[: math.ceil(fraction * count)])


class BatchSource:
    """Packed rows (plus any per-row arrays, e.g. stored target features) served in a per-epoch shuffled order
    derived from (seed, epoch)."""

    def __init__(self, rows: dict[str, np.ndarray], batch_size: int, seed: int):
        self.rows = rows
        count = len(rows["tokens"])
        if count < batch_size:
            raise InputError(f"the dataset packs into {count} rows, fewer than training.batch_size={batch_size}")
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = count // batch_size

    def __len__(self) -> int:
        return len(self.rows["tokens"])

    def batch(self, step: int, part: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The global batch of `step`: every row array, [batch_size, ...]; or only its rows `part` (a process's)."""
        epoch, index = divmod(step, self.batches_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self))
        picked = np.sort(order[index * self.batch_size : (index + 1) * self.batch_size])
        if part is not None:
            picked = picked[part]
        return {key: value[picked] for key, value in self.rows.items()}
