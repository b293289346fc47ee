"""Fixed-shape training batches, a pure function of the step: resuming at step s yields exactly the same data."""

from __future__ import annotations

import numpy as np

from specjax.errors import InputError


class BatchSource:
    """Samples truncated/padded to `seq_len`, served in a per-epoch shuffled order derived from (seed, epoch)."""

    def __init__(self, samples: list[tuple[np.ndarray, np.ndarray]], batch_size: int, seq_len: int, seed: int):
        usable = [(t, m) for t, m in samples if m[:seq_len].any()]
        if len(usable) < batch_size:
            raise InputError(
                f"the dataset has {len(usable)} usable samples, fewer than training.batch_size={batch_size}"
            )
        self.tokens = np.zeros((len(usable), seq_len), np.int32)
        self.loss_mask = np.zeros((len(usable), seq_len), np.int32)
        for i, (t, m) in enumerate(usable):
            n = min(len(t), seq_len)
            self.tokens[i, :n], self.loss_mask[i, :n] = t[:n], m[:n]
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = len(usable) // batch_size

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The global batch of `step`: {"tokens", "loss_mask"} int32 [batch_size, seq_len]."""
        epoch, index = divmod(step, self.batches_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.tokens))
        rows = order[index * self.batch_size : (index + 1) * self.batch_size]
        return {"tokens": self.tokens[rows], "loss_mask": self.loss_mask[rows]}
