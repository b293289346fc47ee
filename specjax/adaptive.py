"""The drafting policy of the speculative loop: how much each round drafts, chosen on device, from a static menu.

A policy holds a menu of draft sizes (0: a plain decoding step) and, inside the loop, a state of its own. Every round
it `choose`s a menu entry from its state, then `observe`s what the round accepted. `Fixed(K)` is the menu of one
entry and no state. `Adaptive` picks, per round, the entry that ends the batch soonest at the estimated costs
(`specjax.measure.calibration`) and at each row's acceptance estimate and pace, and between calls `learn`s the
acceptance and, from the call's wall time, the costs; docs/adaptive.md specifies it.

Invariant (exactness): a choice depends only on the prior, the costs, the committed text and past rounds, so it is
fixed before the round draws anything; every round is an exact speculative round of its own shape.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError

# The draft sizes a chain drafter's default menu offers (up to its largest K), a row's acceptance rate before it has
# drafted and how many tried depths that guess counts as when earlier calls' evidence is pooled with it; what the
# prior counts as in a row's own running figures (tried depths in its tally, emitted tokens in its pace), and the
# share of those figures a round keeps: about 1 / (1 - memory) rounds.
ADAPTIVE_MENU = (1, 2, 3, 5)
ADAPTIVE_PRIOR = 0.6
PRIOR_WEIGHT = 20.0
ROW_PRIOR_WEIGHT = 4.0
ROW_MEMORY = 0.8
PACE_MEMORY = 0.95

MAX_RATE = 0.999  # the geometric model's sum diverges at r = 1
# How far one call's timing may move the costs (a factor either way): a call's time also holds what the estimate of
# its prefill missed, so one call is evidence, not proof.
MAX_RETIME = 4.0


class Policy(Protocol):
    """What the loop asks of a drafting policy (a pytree whose menu is static)."""

    menu: tuple[int, ...]  # draft sizes, ascending; 0: a plain decoding step

    def start(self, depths: Sequence[int], batch: int, regimes: int) -> Any:
        """The policy's state before the first round (inside the jit); `depths`: each entry's draft depth."""

    def choose(self, state: Any, depths: Sequence[int], regime_b: jax.Array, remaining_b: jax.Array) -> jax.Array:
        """int32 []: the menu entry of the next round, from the state, each row's kind of round (`Drafter.regime`) and
        the tokens each row may still generate (0: finished)."""

    def observe(self, state: Any, entry: int, depth: int, regime_b, n_b, count_b, running_b) -> Any:
        """The state after a round of `entry` (static), `depth` deep, that accepted n_b drafts and emitted count_b
        tokens in each row; running_b: the rows that ran it."""

    def evidence(self, state: Any) -> list[tuple[float, float]]:
        """(accepted drafts, tried depths) per kind of round of a finished call (host side)."""

    def never_drafts(self, depths: Sequence[int]) -> bool:
        """Whether plain decoding would serve the call as well (host side, before it runs)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fixed:
    """Every round drafts the drafter's `draft_shape(k)`: the menu of one entry, no state."""

    k: int = dataclasses.field(metadata=dict(static=True))

    @property
    def menu(self) -> tuple[int, ...]:
        return (self.k,)

    def start(self, depths: Sequence[int], batch: int, regimes: int) -> tuple:
        return ()

    def choose(self, state: tuple, depths: Sequence[int], regime_b: jax.Array, remaining_b: jax.Array) -> jax.Array:
        return jnp.int32(0)

    def observe(self, state: tuple, entry: int, depth: int, regime_b, n_b, count_b, running_b) -> tuple:
        return state

    def evidence(self, state: tuple) -> list[tuple[float, float]]:
        return []

    def never_drafts(self, depths: Sequence[int]) -> bool:
        return False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveState:
    """An `Adaptive` policy's state inside the loop."""

    tally_brc: jax.Array  # [B, R, 2] float32 each row's decayed accepted drafts and tried depths per kind of round
    pace_b2: jax.Array  # [B, 2] float32 each row's decayed steps and emitted tokens
    evidence_r2: jax.Array  # [R, 2] float32 accepted drafts and tried depths of the call per kind of round (`learn`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adaptive:
    """A menu whose entry each round chooses: the menu (static), what its entries cost and the prior (data: another
    calibration or prior reuses the executable)."""

    cost: jax.Array  # float32 [M]: a round of each entry, in plain decoding steps of the same batch
    prior: jax.Array  # float32 [R]: a row's acceptance rate before it has drafted, per kind of round
    seen: jax.Array  # float32 [R]: the tried depths pooled into the prior beyond PRIOR_WEIGHT (`learn`)
    track_record: jax.Array  # float32 [2]: the learned calls' plain decoding steps, and what their loops cost
    # float32 [2]: seconds of a plain decoding step and of the prefill per prompt token, which measured costs are
    # relative to (zeros: costs given, which no call's timing corrects)
    clock: jax.Array
    timed: jax.Array  # float32 [M]: rounds of each entry that learned calls ran (`learn`)
    menu: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))  # draft sizes; 0: plain step

    @classmethod
    def of(
        cls,
        menu: Sequence[int],
        cost: Sequence[float],
        prior: float = ADAPTIVE_PRIOR,
        regimes: int = 1,
        clock: tuple[float, float] = (0.0, 0.0),
    ) -> Adaptive:
        """Validates the menu (distinct sizes >= 0, ascending) and one finite positive cost per entry; `regimes`: the
        drafter's kinds of round (`traits.regimes`), each starting at `prior`; `clock`: for measured costs, the
        seconds of a plain step and of the prefill per prompt token (`clock`)."""
        menu = tuple(int(k) for k in menu)
        if not menu or list(menu) != sorted(set(menu)) or menu[0] < 0:
            raise InputError(f"an adaptive menu lists distinct draft sizes >= 0 in ascending order, got {menu}")
        if len(cost) != len(menu) or not all(math.isfinite(c) and c > 0 for c in cost):
            raise InputError(f"an adaptive menu needs one finite cost > 0 per entry, got {list(cost)} for {menu}")
        if not 0 <= prior <= 1:
            raise InputError(f"the prior acceptance rate must be in [0, 1], got {prior}")
        zeros = jnp.zeros((regimes,), jnp.float32)
        return cls(
            jnp.asarray(cost, jnp.float32),
            zeros + prior,
            zeros,
            jnp.zeros((2,), jnp.float32),
            jnp.asarray(clock, jnp.float32),
            jnp.zeros((len(menu),), jnp.float32),
            menu,
        )

    @property
    def prices(self) -> jax.Array:
        """float32 [M]: the costs a choice weighs. Measured costs are an estimate until a call's timing has checked a
        drafting round, and an estimate too high would never be checked (no round would draft); so until then a
        drafting entry is priced at most one plain step, the least any round costs, and the first call drafts."""
        drafting = jnp.asarray([k > 0 for k in self.menu])
        unchecked = (self.clock[0] > 0) & ~jnp.any(drafting & (self.timed > 0))
        return jnp.where(unchecked & drafting, jnp.minimum(self.cost, 1.0), self.cost)

    @classmethod
    def forcing(cls, menu: Sequence[int], entry: int, regimes: int = 1) -> Adaptive:
        """`menu` with every entry but `entry` priced out: the loop compiled for the menu runs that entry alone (the
        costs are data, so one executable serves every entry)."""
        cost = jnp.where(jnp.arange(len(menu)) == entry, 1.0, 1e30).astype(jnp.float32)
        return dataclasses.replace(cls.of(menu, [1.0] * len(menu), regimes=regimes), cost=cost)

    def start(self, depths: Sequence[int], batch: int, regimes: int) -> AdaptiveState:
        """Every row at the prior of each of the drafter's `regimes` kinds of round, and at the prior's pace."""
        at_regimes = dataclasses.replace(self, prior=jnp.broadcast_to(self.prior, (regimes,)))
        return AdaptiveState(
            tally_brc=jnp.zeros((batch, regimes, 2), jnp.float32),
            pace_b2=first_pace(at_regimes, depths, batch),
            evidence_r2=jnp.zeros((regimes, 2), jnp.float32),
        )

    def choose(
        self, state: AdaptiveState, depths: Sequence[int], regime_b: jax.Array, remaining_b: jax.Array
    ) -> jax.Array:
        """The entry that ends the batch soonest (`soonest_entry`), at each row's estimate for its kind of round."""
        rate_b = jnp.take_along_axis(rates(self, state.tally_brc), regime_b[:, None], axis=1)[:, 0]
        pace_b = paces(state.pace_b2)
        if 0 in self.menu:  # a row can always go on in plain steps: its pace ahead is no slower than theirs
            pace_b = jnp.minimum(pace_b, self.prices[self.menu.index(0)])
        return soonest_entry(self, depths, rate_b, pace_b, remaining_b)

    def observe(self, state: AdaptiveState, entry: int, depth: int, regime_b, n_b, count_b, running_b) -> AdaptiveState:
        """The state after a round of menu entry `entry` (static), `depth` deep, that accepted n_b drafts and emitted
        count_b tokens in each running row."""
        return AdaptiveState(
            tally_brc=tallied(state.tally_brc, regime_b, depth, n_b, running_b),
            pace_b2=step_pace(state.pace_b2, self.prices[entry], count_b, running_b),
            evidence_r2=state.evidence_r2 + round_evidence(regime_b, depth, n_b, running_b, state.evidence_r2.shape[0]),
        )

    def evidence(self, state: AdaptiveState) -> list[tuple[float, float]]:
        """The call's accepted drafts and tried depths per kind of round, what `learn` pools into the prior."""
        return [(float(a), float(t)) for a, t in jax.device_get(state.evidence_r2)]

    def never_drafts(self, depths: Sequence[int]) -> bool:
        """Whether plain decoding should replace the loop (`drafting_never_pays`)."""
        return drafting_never_pays(self, depths)

    def learn(self, stats: Any) -> Adaptive:
        """This menu after a call (its `SpecStats`): each kind's prior pooled with the call's accepted drafts and tried
        depths, the call added to the track record, and, for measured costs, the costs or the plain step corrected by
        the call's wall time (`retimed`). A call that ran plain decoding only times the plain step."""
        adaptive, loop_steps = retimed(self, stats)
        if not stats.acceptance_evidence:
            return adaptive
        accepted, tried = jnp.asarray(stats.acceptance_evidence, jnp.float32).T
        weight = PRIOR_WEIGHT + self.seen
        prior = (self.prior * weight + accepted) / (weight + tried)
        track_record = self.track_record + jnp.asarray([stats.plain_steps, loop_steps], jnp.float32)
        return dataclasses.replace(adaptive, prior=prior, seen=self.seen + tried, track_record=track_record)

    def summary(self) -> dict:
        """What was learned: the prior per kind of round, the costs, and the loop's gain over plain decoding (None
        before it ran)."""
        plain_steps, loop_steps = self.track_record.tolist()
        return {
            "prior": [round(p, 3) for p in self.prior.tolist()],
            "cost": {k: round(c, 3) for k, c in zip(self.menu, self.cost.tolist())},
            "loop_gain": round(plain_steps / loop_steps, 3) if loop_steps else None,
        }


def retimed(adaptive: Adaptive, stats: Any) -> tuple[Adaptive, float]:
    """The menu after a call's timing, and the plain decoding steps the call's loop took.

    The call's wall time less its prefill (`clock`'s estimate) is its decoding time. Plain decoding (no acceptance
    evidence) times the plain step: the clock moves halfway to it (in log). A loop's time against what its rounds
    were estimated to cost gives a factor f (within 1/MAX_RETIME..MAX_RETIME) by which those estimates were off; an
    entry that ran moves by f to the power of its share of the rounds that timed it, and a drafting entry that no
    call has timed moves by f (it shares the error's causes). The costs stay `non_decreasing`. Without a clock (given
    costs), nothing is timed and the steps are the rounds at their costs (none under a plain step)."""
    rounds = np.asarray([stats.rounds_by_drafts.get(k, 0) for k in adaptive.menu], np.float64)
    cost, timed = np.asarray(adaptive.cost, np.float64), np.asarray(adaptive.timed, np.float64)
    step_s, token_s = np.asarray(adaptive.clock, np.float64)
    if step_s <= 0 or stats.seconds <= 0:
        return adaptive, float(np.sum(rounds * np.maximum(cost, 1.0)))
    prefill_s = step_s + max(stats.prompt_tokens - 1, 0) * token_s if stats.prompt_tokens else 0.0  # 0: an engine run
    decode_s = max(stats.seconds - prefill_s, stats.seconds / 10)
    if not stats.acceptance_evidence:
        measured = decode_s / max(stats.plain_steps, 1)
        clock = jnp.asarray([np.sqrt(step_s * measured), token_s], jnp.float32)
        return dataclasses.replace(adaptive, clock=clock), float(stats.plain_steps)
    f = float(np.clip(decode_s / (step_s * np.sum(rounds * cost)), 1 / MAX_RETIME, MAX_RETIME))
    drafting = np.asarray([k > 0 for k in adaptive.menu])
    power = np.where(rounds > 0, rounds / np.maximum(rounds + timed, 1), (timed == 0) & drafting)
    cost = non_decreasing(cost * f**power)
    adaptive = dataclasses.replace(
        adaptive, cost=jnp.asarray(cost, jnp.float32), timed=jnp.asarray(timed + rounds, jnp.float32)
    )
    return adaptive, decode_s / step_s


def non_decreasing(cost: Sequence[float]) -> list[float]:
    """The non-decreasing costs nearest to the given ones (least squares, by pooling adjacent violators).

    A menu's entries are ascending and each round does all the work of a shallower one (a plain step is part of
    every round), so its true costs never fall; measured ones do where the machine's noise exceeds the step between
    two entries (a chain of 8 timed below a chain of 5), and a choice would follow that noise. Pooling the entries
    that break the order into their mean keeps what the measurement says and drops what it cannot.
    """
    blocks: list[list[float]] = []  # [sum, count] of pooled entries, means ascending
    for c in cost:
        blocks.append([float(c), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def expected_tokens(rate_b: jax.Array, depth: int) -> jax.Array:
    """Tokens a round of drafts `depth` deep is expected to emit per row, the correction or bonus included."""
    r = jnp.clip(rate_b, 0.0, MAX_RATE)
    return (1 - r ** (depth + 1)) / (1 - r)


def soonest_entry(
    adaptive: Adaptive, depths: Sequence[int], rate_b: jax.Array, pace_b: jax.Array, remaining_b: jax.Array
):
    """The menu entry that would end the batch soonest (int32 []): least cost of the round plus the steps its slowest
    row would still need after it: its tokens left at its pace, the last of them at no less than a whole round (the
    cheapest entry), since a row whose pace is a fraction of a step still takes a round to finish.

    Args:
      adaptive: the menu and its costs.
      depths: each entry's draft depth (`menu_depths`).
      rate_b: float32 [B] the rows' acceptance estimates for the kind of round each is in (`rates`).
      pace_b: float32 [B] the rows' steps per emitted token so far (`paces`).
      remaining_b: [B] tokens each row may still generate; 0 for a finished row, which does not count.
    """
    prices = adaptive.prices
    cheapest = jnp.min(prices)

    def after(depth):
        left_b = jnp.maximum(remaining_b - expected_tokens(rate_b, depth), 0)
        return jnp.max(pace_b * left_b + jnp.maximum(cheapest - pace_b, 0) * jnp.minimum(left_b, 1))

    return jnp.argmin(prices + jnp.stack([after(d) for d in depths])).astype(jnp.int32)


def menu_shapes(drafter: Any, menu: Sequence[int]) -> list[TreeSpec]:
    """Each menu entry's draft: the drafter's `draft_shape(k)`, and for 0 the plain step, `TreeSpec.chain(0)`."""
    return [drafter.draft_shape(k) if k else TreeSpec.chain(0) for k in menu]


def menu_depths(drafter: Any, menu: Sequence[int]) -> list[int]:
    """The depth of each menu entry's draft (0: the plain step)."""
    return [shape.depth for shape in menu_shapes(drafter, menu)]


def drafting_never_pays(adaptive: Adaptive, depths: Sequence[int]) -> bool:
    """Whether plain decoding should replace the loop: the loop's earlier calls did not beat plain decoding (its track
    record, `Adaptive.learn`), or, at the priors, where every row starts, no drafting entry is
    expected to cost less per token than a plain decoding step (the costs' unit) and than the loop's own plain step.
    Where the loop's choice there is its plain step, no round would ever draft (a plain step moves the estimates
    toward the prior, so they stay there); where it is a drafting entry that costs more per token than plain
    decoding, the loop is expected to lose from its first round."""
    plain_steps, loop_steps = adaptive.track_record.tolist()
    if loop_steps and plain_steps <= loop_steps:
        return True
    prior = jnp.max(adaptive.prior)  # drafting pays at the highest prior if at any
    per_token = [float(c / expected_tokens(prior, d)) for c, d in zip(adaptive.prices, depths)]
    drafting = [p for p, d in zip(per_token, depths) if d]
    return not drafting or min(drafting) >= min([1.0] + [p for p, d in zip(per_token, depths) if not d])


def counts(depth: int, n_b: jax.Array) -> jax.Array:
    """float32 [B, 2]: a round's accepted drafts and tried depths per row (n, and n + 1 or `depth` when all were
    accepted); zeros for a plain step."""
    return jnp.stack([n_b, jnp.minimum(n_b + 1, depth)], axis=1).astype(jnp.float32)


def rates(adaptive: Adaptive, tally_brc: jax.Array) -> jax.Array:
    """float32 [B, R]: each row's acceptance estimate per kind of round, its tally [B, R, (accepted, tried)] pooled
    with the prior."""
    return (adaptive.prior * ROW_PRIOR_WEIGHT + tally_brc[..., 0]) / (ROW_PRIOR_WEIGHT + tally_brc[..., 1])


def first_pace(adaptive: Adaptive, depths: Sequence[int], batch: int) -> jax.Array:
    """float32 [B, 2]: every row's pace before its first round, as (steps, tokens) counting ROW_PRIOR_WEIGHT tokens:
    the fewest steps per token an entry is expected to take at the priors, pooled as `learn` weighed them."""
    weight = PRIOR_WEIGHT + adaptive.seen * jnp.ones_like(adaptive.prior)
    prior = jnp.sum(adaptive.prior * weight) / jnp.sum(weight)
    pace = jnp.min(jnp.stack([c / expected_tokens(prior, d) for c, d in zip(adaptive.prices, depths)]))
    return jnp.broadcast_to(jnp.stack([pace, 1.0]) * ROW_PRIOR_WEIGHT, (batch, 2))


def paces(pace_b2: jax.Array) -> jax.Array:
    """float32 [B]: each row's steps per emitted token, from its running (steps, tokens)."""
    return pace_b2[:, 0] / pace_b2[:, 1]


def step_pace(pace_b2: jax.Array, cost: jax.Array, count_b: jax.Array, running_b: jax.Array) -> jax.Array:
    """The running rows' (steps, tokens) after a round of `cost` steps that emitted count_b tokens in each: PACE_MEMORY
    of the figures before it, plus the round's."""
    moved = PACE_MEMORY * pace_b2 + jnp.stack([jnp.broadcast_to(cost, count_b.shape), count_b], axis=1)
    return jnp.where(running_b[:, None], moved, pace_b2)


def tallied(tally_brc: jax.Array, regime_b: jax.Array, depth: int, n_b: jax.Array, running_b: jax.Array) -> jax.Array:
    """The tallies after a round `depth` deep (static) in which the running rows, each in its kind of round regime_b,
    accepted n_b drafts: that kind's tally keeps ROW_MEMORY of itself and adds the round's counts."""
    here = running_b[:, None] & (jnp.arange(tally_brc.shape[1])[None, :] == regime_b[:, None])
    moved = ROW_MEMORY * tally_brc + counts(depth, n_b)[:, None, :]
    return jnp.where(here[..., None], moved, tally_brc)


def round_evidence(regime_b: jax.Array, depth: int, n_b: jax.Array, running_b: jax.Array, regimes: int) -> jax.Array:
    """float32 [R, 2]: a round's accepted drafts and tried depths per kind of round, over its running rows
    (`Adaptive.learn`)."""
    return jax.ops.segment_sum(counts(depth, n_b) * running_b[:, None], regime_b, num_segments=regimes)
