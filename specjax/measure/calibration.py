"""Calibration of adaptive menus: what a round of each menu entry costs on this machine, in plain decoding steps.

`calibrated` builds the `Adaptive` menu that `--num-draft-tokens auto` runs: the default draft sizes, each timed as
whole rounds of the compiled loop (`specjax.measure.timing.loop_seconds`), measured once per machine, model shapes,
drafter, batch, context and greedy-or-sampled (`specjax.host.cached_measurement`), fitted non-decreasing, and only
the entries that are the best choice at some acceptance rate kept.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

from specjax.adaptive import ADAPTIVE_MENU, MAX_RATE, Adaptive, menu_depths
from specjax.config import ModelConfig, SamplingConfig
from specjax.drafters.base import Drafter
from specjax.drafters.tree import TreeSpec
from specjax.host import cached_measurement
from specjax.measure.speedup import expected_tokens_per_round
from specjax.measure.timing import loop_seconds
from specjax.models.llama import Weights

CALIBRATION_DRAFT_TOKENS = 8  # the largest K that `--num-draft-tokens auto` drafts with a chain drafter


def useful_entries(menu: Sequence[int], depths: Sequence[int], cost: Sequence[float]) -> list[int]:
    """The entries that are the best choice for some acceptance rate in [0, 1): the others would never run, so they
    are left out of the loop (each entry is compiled)."""
    best = set()
    for i in range(1000):
        gains = [expected_tokens_per_round(min(i / 1000, MAX_RATE), d) / c for d, c in zip(depths, cost)]
        best.add(max(range(len(menu)), key=gains.__getitem__))
    return sorted(best)


def menu_costs(
    weights: Weights,
    cfg: ModelConfig,
    drafter: Drafter,
    menu: Sequence[int],
    *,
    batch: int,
    context: int,
    sampling: SamplingConfig,
    new_tokens: int = 32,
    reps: int = 9,
) -> list[float]:
    """The cost of a round of each menu entry in steps of plain decoding: whole rounds of the compiled loop, each
    entry forced in turn, against the steps of the plain decoding loop (`specjax.measure.timing.loop_seconds`), measured
    once per machine, model shapes, drafter, batch, context and greedy-or-sampled, then read from
    `$SPECJAX_CACHE/calibration` (which keeps the measurement), and fitted `non_decreasing`."""
    signature = {
        "method": "loop rounds",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "target": repr(cfg),
        "dtype": str(weights.embed.dtype),
        "drafter": repr(jax.tree.structure(drafter)),
        "drafter_leaves": [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(drafter)],
        "menu": list(menu),
        "batch": batch,
        "context": context,
        "greedy": sampling.greedy,
        "new_tokens": new_tokens,
        "reps": reps,
    }

    def measure() -> list[float]:
        step_s, round_s = loop_seconds(
            weights, cfg, drafter, menu, batch=batch, context=context, sampling=sampling, new_tokens=new_tokens,
            reps=reps,
        )  # fmt: skip
        return [s / step_s for s in round_s]

    return non_decreasing(cached_measurement("calibration", signature, measure))


def non_decreasing(cost: Sequence[float]) -> list[float]:
    """The non-decreasing costs nearest to the measured ones (least squares, by pooling adjacent violators).

    A menu's entries are ascending and each round does all the work of a shallower one (a plain step is part of
    every round), so its true costs never fall; measured ones do where the machine's noise exceeds the step between
    two entries (a chain of 8 timed below a chain of 5), and a choice would follow that noise. Pooling the entries
    that break the order into their mean keeps what the measurement says and drops what it cannot.
    """
    blocks: list[list[float]] = []  # [sum, count] of pooled entries, means ascending
    for c in cost:
        blocks.append([c, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def calibrated(
    weights: Weights,
    cfg: ModelConfig,
    drafter: Drafter,
    max_draft_tokens: int,
    *,
    batch: int,
    context: int,
    sampling: SamplingConfig,
) -> Adaptive:
    """`--num-draft-tokens auto`: the default menu up to `max_draft_tokens` (a tree drafter: a plain step or its
    tree; no plain step for a drafter that cannot follow one), its measured costs, and only the useful entries."""
    if drafter.draft_shape(1) != TreeSpec.chain(1):  # a tree drafter: its own tree whatever K, named by its depth
        sizes = [drafter.draft_shape(max_draft_tokens).depth]
    else:
        sizes = sorted({k for k in ADAPTIVE_MENU if k < max_draft_tokens} | {max_draft_tokens})
    menu = ([0] if drafter.traits.plain_rounds else []) + sizes
    cost = menu_costs(weights, cfg, drafter, menu, batch=batch, context=context, sampling=sampling)
    keep = useful_entries(menu, menu_depths(drafter, menu), cost)
    return Adaptive.of([menu[i] for i in keep], [cost[i] for i in keep], regimes=drafter.traits.regimes)
