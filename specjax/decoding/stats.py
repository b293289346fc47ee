"""What a speculative call returns to the host: its completions and what the drafts bought.

Row-rounds count each running row once per round; an acceptance histogram counts the row-rounds that accepted
0..D drafts (D: the deepest draft of the call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specjax.decoding.batch import Completion


def acceptance(hist: Sequence[int]) -> tuple[float, list[float]]:
    """(tokens emitted per row-round, counting the correction or bonus token; the fraction of row-rounds whose draft
    i was accepted, for i in 0..D-1) of an acceptance histogram."""
    hist = [int(h) for h in hist]
    total = max(sum(hist), 1)
    mean = sum((i + 1) * h for i, h in enumerate(hist)) / total
    return mean, [sum(hist[i + 1 :]) / total for i in range(len(hist) - 1)]


@dataclasses.dataclass(frozen=True)
class SpecStats:
    """What the drafts bought."""

    rounds: int  # loop iterations (verification passes of the whole batch)
    mean_accepted: float  # tokens emitted per row-round, counting the correction / bonus token (before EOS cuts)
    acceptance_by_position: list[float]  # [D] fraction of row-rounds whose draft i was accepted
    accepted_histogram: list[int]  # [D + 1] row-rounds that accepted 0..D drafts
    new_tokens: int
    tokens_per_s: float
    rounds_by_drafts: dict[int, int] = dataclasses.field(default_factory=dict)  # rounds of each menu entry
    # Adaptive drafting: (accepted drafts, tried depths) per kind of round, what `Adaptive.learn` pools into the prior.
    acceptance_evidence: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    plain_steps: int = 0  # steps plain decoding takes for these outputs: the longest, less the prefill's token
    prompt_tokens: int = 0  # tokens the prefill ran per row (what `Adaptive.learn` takes out of the time)
    seconds: float = 0.0  # wall time of the call's decoding, its prefill included

    @classmethod
    def from_histogram(cls, rounds: int, hist: Sequence[int], new_tokens: int, seconds: float) -> SpecStats:
        mean, by_position = acceptance(hist)
        tokens_per_s = new_tokens / seconds if seconds > 0 else 0.0
        return cls(int(rounds), mean, by_position, [int(h) for h in hist], new_tokens, tokens_per_s, seconds=seconds)


@dataclasses.dataclass(frozen=True)
class SpecResult:
    completions: list[Completion]
    seconds: float  # wall time of the decoding itself
    compile_seconds: float  # tracing and compilation, 0 when the executable was cached
    stats: SpecStats

    @property
    def new_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.completions)
