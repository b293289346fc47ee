"""Prompt filters for training data: length, language, degeneracy, near-duplicates and overlap with evaluation sets.

Each check returns the reason a prompt is dropped, or None; the stages count the reasons in their manifests.
Near-duplicates are found with MinHash LSH (datasketch) over word 3-gram shingles.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from datasketch import MinHash, MinHashLSH

_NUM_PERM = 64
_WORD = re.compile(r"[A-Za-z0-9_']+")
_RUN = re.compile(r"(\S)\1{9,}")  # one character ten times in a row
# Frequent English words: a text of five or more words with none of them is taken for another language or noise.
_COMMON = frozenset(
    "the a an of to and in is it you that for on with as are this be can what how i my me your do does or if not "
    "from by at have has was which who why when where write explain give make please tell about should would".split()
)


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _shingles(text: str) -> set[str]:
    w = words(text)
    return {" ".join(w[i : i + 3]) for i in range(max(1, len(w) - 2))}


def _minhash(text: str) -> MinHash:
    m = MinHash(num_perm=_NUM_PERM, seed=1)
    m.update_batch([s.encode() for s in _shingles(text)])
    return m


def language_issue(text: str) -> str | None:
    """'not English' for text that is mostly non-ASCII or, from five words on, has no common English word."""
    chars = [c for c in text if not c.isspace()]
    if not chars or sum(c.isascii() for c in chars) < 0.95 * len(chars):
        return "not English"
    w = words(text)
    if len(w) >= 5 and not _COMMON.intersection(w):
        return "not English"
    return None


def degeneracy_issue(text: str) -> str | None:
    """'degenerate' for repeated word 3-grams (under 70% distinct, from 12 words on) or a character run of ten."""
    w = words(text)
    grams = [tuple(w[i : i + 3]) for i in range(len(w) - 2)]
    if len(w) >= 12 and len(set(grams)) < 0.7 * len(grams):
        return "degenerate"
    if _RUN.search(text):
        return "degenerate"
    return None


class NearDuplicates:
    """Keeps one prompt of each group of near-duplicates, and none that resembles an evaluation prompt."""

    def __init__(self, threshold: float | None, evaluation: Iterable[str] = (), eval_threshold: float = 0.5):
        """threshold: Jaccard similarity from which a prompt is a near-duplicate of a kept one (None: keep all)."""
        self._seen = MinHashLSH(threshold=threshold, num_perm=_NUM_PERM) if threshold is not None else None
        self._evaluation = MinHashLSH(threshold=eval_threshold, num_perm=_NUM_PERM)
        for i, text in enumerate(evaluation):
            self._evaluation.insert(f"eval-{i}", _minhash(text))
        self._count = 0

    def check(self, text: str) -> str | None:
        """The reason to drop `text`, or None after recording it as seen."""
        m = _minhash(text)
        if self._evaluation.query(m):
            return "overlaps evaluation"
        if self._seen is not None:
            if self._seen.query(m):
                return "near-duplicate"
            self._seen.insert(f"kept-{self._count}", m)
            self._count += 1
        return None
