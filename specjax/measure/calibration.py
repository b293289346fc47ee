"""Calibration of adaptive menus: what a round of each menu entry costs on this machine, in plain decoding steps.

`calibrated` builds the `Adaptive` menu that `num_draft_tokens="auto"` runs, and `calibrated_by_rows` one per bucket of
an engine's rows: the default draft sizes and their costs, each derived from a few short timings (`round_seconds`: the
target forward by token count, the drafter's round), measured once per machine, model shapes, drafter, batch and
greedy-or-sampled (`specjax.host.cached_measurement`), fitted non-decreasing, and only the entries that are the best
choice at some acceptance rate kept. The estimate leaves out the loop's own work; the calls' timed rounds correct it
(`Adaptive.learn`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np

from specjax.adaptive import ADAPTIVE_MENU, MAX_RATE, Adaptive, menu_depths, menu_shapes, non_decreasing
from specjax.config import ModelConfig, SamplingConfig
from specjax.drafters.base import Drafter
from specjax.drafters.tree import TreeSpec
from specjax.host import cached_measurement, status
from specjax.measure.speedup import expected_tokens_per_round
from specjax.measure.timing import drafter_timer, forward_timers, interleaved_medians
from specjax.models.llama import Weights

CALIBRATION_DRAFT_TOKENS = 8  # the largest K that adaptive drafting drafts with a chain drafter
CALIBRATION_CONTEXT = 256  # committed tokens per row while timing (the costs are ratios; the loop's timing corrects)
PREFILL_PROBE = 64  # tokens of the forward that prices the prefill per prompt token


def auto_max_drafts(drafter: Drafter) -> int:
    """The largest K adaptive drafting drafts: CALIBRATION_DRAFT_TOKENS, or less where the drafter proposes fewer."""
    return min(CALIBRATION_DRAFT_TOKENS, drafter.traits.max_draft_tokens or CALIBRATION_DRAFT_TOKENS)


def useful_entries(menu: Sequence[int], depths: Sequence[int], cost: Sequence[float]) -> list[int]:
    """The entries that are the best choice for some acceptance rate in [0, 1), and the deepest: the others would
    never run, so they are left out of the loop (each entry is compiled). The deepest stays whatever its estimate, so
    the loop can time a drafting round and correct an estimate that was too high (`Adaptive.prices`)."""
    best = {len(menu) - 1}
    for i in range(1000):
        gains = [expected_tokens_per_round(min(i / 1000, MAX_RATE), d) / c for d, c in zip(depths, cost)]
        best.add(max(range(len(menu)), key=gains.__getitem__))
    return sorted(best)


def round_seconds(
    weights: Weights,
    cfg: ModelConfig,
    drafter: Drafter,
    menu: Sequence[int],
    *,
    batch: int,
    sampling: SamplingConfig,
    reps: int = 9,
) -> dict:
    """Seconds of a plain decoding step, of the prefill per prompt token, and of a round of each menu entry, from
    short timings taken in turn (`interleaved_medians`): the target forward over 1 token, over `PREFILL_PROBE` and
    over each entry's draft nodes, and the drafter's round (`drafter_timer`) at the shallowest and deepest drafting
    entries (in between: linear in depth). A round is its verification and its drafting; the loop's own work
    (acceptance, commits, the switch) is left out, and the calls' timed rounds add it (`Adaptive.learn`)."""
    shapes = menu_shapes(drafter, menu)
    counts = sorted({1, PREFILL_PROBE} | {shape.budget for shape in shapes})
    drafting = sorted({shape.depth for shape in shapes if shape.depth})
    drafts = [drafting[0], drafting[-1]] if len(drafting) > 1 else drafting
    sizes = [next(k for k, s in zip(menu, shapes) if s.depth == d) for d in drafts]
    timers = forward_timers(weights, cfg, batch, CALIBRATION_CONTEXT, counts)
    timers += [drafter_timer(drafter, cfg, batch, CALIBRATION_CONTEXT, k, sampling) for k in sizes]
    medians = interleaved_medians(timers, reps)
    forward = dict(zip(counts, medians))
    drafting_s = np.interp([s.depth for s in shapes], drafts, medians[len(counts) :]) if drafts else [0.0] * len(menu)
    step_s = forward[1]
    return {
        "step_s": step_s,
        "prefill_token_s": max(forward[PREFILL_PROBE] - step_s, 0.0) / (PREFILL_PROBE - 1),
        # Verifying more tokens never costs less than one: a lower figure is the machine's noise.
        "round_s": [max(forward[s.budget], step_s) + (d if s.depth else 0.0) for s, d in zip(shapes, drafting_s)],
    }


def calibration_signature(weights: Weights, cfg: ModelConfig, drafter: Drafter, menu, batch: int, greedy: bool):
    """What a calibration depends on: the machine (added by the cache), XLA's flags, the target's shapes and dtypes,
    the drafter, the menu, the batch and greedy-or-sampled; not the prompt or the number of new tokens."""
    return {
        "method": "forward by tokens + drafter round",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "target": repr(cfg),
        "dtype": " ".join(sorted({str(x.dtype) for x in jax.tree.leaves(weights)})),  # "float32"; int8 adds "int8"
        "drafter": repr(jax.tree.structure(drafter)),
        "drafter_leaves": [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(drafter)],
        "menu": list(menu),
        "batch": batch,
        "greedy": greedy,
        "context": CALIBRATION_CONTEXT,
    }


def calibrated(
    weights: Weights,
    cfg: ModelConfig,
    drafter: Drafter,
    max_draft_tokens: int,
    *,
    batch: int,
    sampling: SamplingConfig,
) -> Adaptive:
    """Adaptive drafting's menu for calls of `batch` rows (`calibrated_by_rows`)."""
    return calibrated_by_rows(weights, cfg, drafter, max_draft_tokens, rows=[batch], sampling=sampling)[batch]


def calibrated_by_rows(
    weights: Weights,
    cfg: ModelConfig,
    drafter: Drafter,
    max_draft_tokens: int,
    *,
    rows: Sequence[int],
    sampling: SamplingConfig,
) -> dict[int, Adaptive]:
    """Adaptive drafting's menu for runs of each of `rows` (an engine's buckets): the default menu up to
    `max_draft_tokens` (a tree drafter: a plain step or its tree; no plain step for a drafter that cannot follow one),
    its costs in plain steps of that many rows (`round_seconds`, measured once and then read from
    `$SPECJAX_CACHE/calibration`, fitted `non_decreasing`), and the entries useful at any of them, one menu for all.
    Each keeps the seconds of a plain step and of the prefill, so each call's timing can correct its costs."""
    if drafter.draft_shape(1) != TreeSpec.chain(1):  # a tree drafter: its own tree whatever K, named by its depth
        sizes = [drafter.draft_shape(max_draft_tokens).depth]
    else:
        sizes = sorted({k for k in ADAPTIVE_MENU if k < max_draft_tokens} | {max_draft_tokens})
    menu = ([0] if drafter.traits.plain_rounds else []) + sizes
    depths = menu_depths(drafter, menu)
    timed, cost = {}, {}
    for batch in rows:
        signature = calibration_signature(weights, cfg, drafter, menu, batch, sampling.greedy)

        def measure(batch=batch) -> dict:
            status(f"calibrating adaptive drafting (draft sizes {menu}, batch {batch}): once on this machine")
            return round_seconds(weights, cfg, drafter, menu, batch=batch, sampling=sampling)

        timed[batch] = cached_measurement("calibration", signature, measure)
        cost[batch] = non_decreasing([s / timed[batch]["step_s"] for s in timed[batch]["round_s"]])
    keep = sorted({i for batch in rows for i in useful_entries(menu, depths, cost[batch])})
    return {
        batch: Adaptive.of(
            [menu[i] for i in keep],
            [cost[batch][i] for i in keep],
            regimes=drafter.traits.regimes,
            clock=(timed[batch]["step_s"], timed[batch]["prefill_token_s"]),
        )
        for batch in rows
    }
