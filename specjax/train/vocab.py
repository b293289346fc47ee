"""Stage 2 (vocab): the draft vocabulary is the target tokens the assistant uses most, as `d2t` / `t2d` buffers.

`d2t[i]` is the offset from draft id i to its target id (target = i + d2t[i]); `t2d[j]` says whether target token j
is in the draft vocabulary. This is the layout of published EAGLE-3 heads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from specjax.errors import InputError
from specjax.train.store import write_npz


def draft_vocab(samples: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int, draft_vocab_size: int):
    """Builds the mapping from token frequencies in assistant spans (loss_mask == 1).

    Args:
      samples: (tokens, loss_mask) pairs.
      vocab_size: V, the target vocabulary size.
      draft_vocab_size: Vd <= V.
    Returns:
      (d2t int64 [Vd], t2d bool [V], share of assistant tokens the draft vocabulary covers).
    """
    return vocab_from_counts(assistant_token_counts(samples, vocab_size), draft_vocab_size)


def assistant_token_counts(samples: Iterable[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """int64 [V]: how often each target token occurs in assistant spans (loss_mask == 1)."""
    counts = np.zeros(vocab_size, np.int64)
    for tokens, mask in samples:
        np.add.at(counts, tokens[mask.astype(bool)], 1)
    return counts


def vocab_from_counts(counts: np.ndarray, draft_vocab_size: int):
    """`draft_vocab` from precomputed token counts (several sizes from one counting pass)."""
    vocab_size = len(counts)
    if not 0 < draft_vocab_size <= vocab_size:
        raise InputError(f"draft_vocab_size must be in 1..{vocab_size}, got {draft_vocab_size}")
    # Most frequent first; ties (and never-seen tokens, which pad a small corpus) by ascending id.
    order = np.lexsort((np.arange(vocab_size), -counts))
    used = np.sort(order[:draft_vocab_size])
    t2d = np.zeros(vocab_size, bool)
    t2d[used] = True
    d2t = (used - np.arange(draft_vocab_size)).astype(np.int64)
    coverage = counts[used].sum() / max(counts.sum(), 1)
    return d2t, t2d, float(coverage)


def coverage(samples: Iterable[tuple[np.ndarray, np.ndarray]], t2d: np.ndarray) -> float:
    """The share of assistant tokens (loss_mask == 1) that a draft vocabulary (`t2d`) holds."""
    hits = total = 0
    for tokens, mask in samples:
        written = tokens[mask.astype(bool)]
        hits, total = hits + int(t2d[written].sum()), total + len(written)
    return hits / max(total, 1)


def save_vocab(path: Path, d2t: np.ndarray, t2d: np.ndarray) -> None:
    write_npz(path, d2t=d2t, t2d=t2d)


def load_vocab(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise InputError(f"{path} does not exist; run the vocab stage first")
    with np.load(path, allow_pickle=False) as z:
        return z["d2t"], z["t2d"]
