"""Adaptive drafting: every round chooses how much to draft, from a menu compiled into the one loop.

The menu holds draft sizes k, ascending; 0 is a plain decoding step (no drafts, one target token per row). Entry k
drafts the drafter's `draft_shape(k)`: a chain of k, or a tree drafter's own tree. The loop compiles one round per
entry and `lax.switch`es between them each round, so the shapes stay fixed and nothing compiles again.

The choice (`choose`). Each row keeps a running estimate r_b of its acceptance rate per draft depth. A round whose
draft is d deep is expected to emit E_b = (1 - r^(d+1)) / (1 - r) tokens in row b (the model of Leviathan et al.
2023, `specjax.measure.speedup`), and costs `cost[entry]` steps of plain decoding at this batch: whole rounds of the compiled
loop, measured on this machine (`menu_costs`). A batch is done when its slowest row is, so the round takes the entry
that ends the batch soonest, looking one round ahead: its cost, plus the most steps a row would still need after
it, (R_b - E_b)+ x pace_b. R_b is the tokens row b may still generate; pace_b its steps per emitted token so far
(`paces`: running sums of the rounds' costs and the row's tokens, each round keeping PACE_MEMORY of them, started at
the best entry's steps per token at the prior). At batch 1 this is policy improvement for the rate of tokens per
step: a round drafts deeper only where the extra tokens it expects are worth more, at the pace so far, than the
extra steps; where the pace is the best entry's, that entry is the one with the most expected tokens per unit of
cost. Near a row's end it drafts no deeper than what is left. In a batch it drafts as deep as the row furthest from
its end gains from, since deeper drafts for rows that are ahead do not end the batch sooner (measured at batch 8: a
chain of 5 needed 72 rounds where its rows' mean was 51); and it is the pace, not the kind of round a row is in now,
that says which row is behind: one that copies text now but mostly drafts with a model will fall behind again.

The estimates (`observe`, `rates`). A drafter tells kinds of round apart (`Drafter.regime`, a function of the
committed text: whether prompt lookup matched, say), and each row keeps a tally per kind: the drafts it accepted and
the depths it tried (n and min(n + 1, d) after a round d deep that accepted n), each round keeping ROW_MEMORY of the
tally before it. Its estimate is the tally pooled with the prior, counted as ROW_PRIOR_WEIGHT tried depths: a
ratio of sums, so a rejected first draft counts as one failed depth, not as a rate of 0 (an average of per-round
shares n / min(n + 1, d) reads 0.31-0.38 where the rate is 0.5 and d is 2-5). A round reads and moves the tally of
the kind each row is in; a plain step only forgets, so the estimate returns toward the prior and a drafter that
stopped paying is tried again now and then.

The prior (`Adaptive.learn`). Every row starts at the prior of each kind: ADAPTIVE_PRIOR, counted as PRIOR_WEIGHT
tried depths, pooled with the depths tried and accepted in every earlier call it learned from (the loop returns
them, `SpecStats.acceptance_evidence`). So a drafter that seldom pays for this traffic (sampled text for prompt
lookup) stops being tried, and one that pays starts drafting from its first round. `learn` also keeps the loop's
track record: the steps plain decoding would have taken for the calls' outputs, against what the loop's rounds cost
(no round costing less than a plain decoding step). A loop that did not beat plain decoding by its own measure is not
run again (`never_drafts`): its plain steps cost more than plain decoding's, so it can only lose.

Exactness. The choice is a function of the estimates and the paces, which are functions of the prior and the costs
(fixed before the call), the committed text and past rounds' entries and acceptances: it is fixed before the round
draws anything. Given the past, every round is an exact speculative round of its own shape (a plain step is a round
of no drafts), so by induction over rounds the output is distributed as target sampling, and greedy output is
identical to greedy decoding (docs/speculative-decoding.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig, SamplingConfig
from specjax.defaults import ADAPTIVE_MENU, ADAPTIVE_PRIOR, PACE_MEMORY, PRIOR_WEIGHT, ROW_MEMORY, ROW_PRIOR_WEIGHT
from specjax.drafters.base import Drafter
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError
from specjax.io.gguf import cache_dir
from specjax.measure.speedup import expected_tokens_per_round
from specjax.models.llama import Weights

if TYPE_CHECKING:
    from specjax.decoding.speculative import SpecStats

_MAX_RATE = 0.999  # the geometric model's sum diverges at r = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adaptive:
    """The menu (static), what its entries cost and the prior (data: another calibration or prior reuses the
    executable)."""

    cost: jax.Array  # float32 [S]: a round of each entry, in plain decoding steps of the same batch
    prior: jax.Array  # float32 [R]: a row's acceptance rate before it has drafted, per kind of round
    seen: jax.Array  # float32 [R]: the tried depths pooled into the prior beyond PRIOR_WEIGHT (`learn`)
    track_record: jax.Array  # float32 [2]: the learned calls' plain decoding steps, and what their loops cost
    menu: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))  # draft sizes; 0: plain step

    @classmethod
    def of(
        cls, menu: Sequence[int], cost: Sequence[float], prior: float = ADAPTIVE_PRIOR, regimes: int = 1
    ) -> Adaptive:
        """Validates the menu (distinct sizes >= 0, ascending) and one finite positive cost per entry; `regimes`: the
        drafter's `num_regimes`, each starting at `prior`."""
        menu = tuple(int(k) for k in menu)
        if not menu or list(menu) != sorted(set(menu)) or menu[0] < 0:
            raise InputError(f"an adaptive menu lists distinct draft sizes >= 0 in ascending order, got {menu}")
        if len(cost) != len(menu) or not all(math.isfinite(c) and c > 0 for c in cost):
            raise InputError(f"an adaptive menu needs one finite cost > 0 per entry, got {list(cost)} for {menu}")
        if not 0 <= prior <= 1:
            raise InputError(f"the prior acceptance rate must be in [0, 1], got {prior}")
        zeros = jnp.zeros((regimes,), jnp.float32)
        return cls(jnp.asarray(cost, jnp.float32), zeros + prior, zeros, jnp.zeros((2,), jnp.float32), menu)

    @classmethod
    def forcing(cls, menu: Sequence[int], entry: int, regimes: int = 1) -> Adaptive:
        """`menu` with every entry but `entry` priced out: the loop compiled for the menu runs that entry alone (the
        costs are data, so one executable serves every entry)."""
        cost = jnp.where(jnp.arange(len(menu)) == entry, 1.0, 1e30).astype(jnp.float32)
        return dataclasses.replace(cls.of(menu, [1.0] * len(menu), regimes=regimes), cost=cost)

    def learn(self, stats: SpecStats) -> Adaptive:
        """This menu after a call (`SpecStats`): each kind's prior pooled with the call's accepted drafts and tried
        depths, and the call added to the track record. A call that ran plain decoding leaves it as it was."""
        if not stats.acceptance_evidence:
            return self
        accepted, tried = jnp.asarray(stats.acceptance_evidence, jnp.float32).T
        weight = PRIOR_WEIGHT + self.seen
        prior = (self.prior * weight + accepted) / (weight + tried)
        rounds = jnp.asarray([stats.rounds_by_drafts[k] for k in self.menu], jnp.float32)
        loop_steps = jnp.sum(rounds * jnp.maximum(self.cost, 1.0))
        track_record = self.track_record + jnp.stack([jnp.float32(stats.plain_steps), loop_steps])
        return dataclasses.replace(self, prior=prior, seen=self.seen + tried, track_record=track_record)

    def summary(self) -> dict:
        """What was learned: the prior per kind of round, and the loop's gain over plain decoding by its own costs
        (None before it ran)."""
        plain_steps, loop_steps = self.track_record.tolist()
        return {
            "prior": [round(p, 3) for p in self.prior.tolist()],
            "loop_gain": round(plain_steps / loop_steps, 3) if loop_steps else None,
        }


def expected_tokens(rate_b: jax.Array, depth: int) -> jax.Array:
    """Tokens a round of drafts `depth` deep is expected to emit per row, the correction or bonus included."""
    r = jnp.clip(rate_b, 0.0, _MAX_RATE)
    return (1 - r ** (depth + 1)) / (1 - r)


def choose(adaptive: Adaptive, depths: Sequence[int], rate_b: jax.Array, pace_b: jax.Array, remaining_b: jax.Array):
    """The menu entry that would end the batch soonest (int32 []): least cost of the round plus the steps its slowest
    row would still need after it, at that row's pace.

    Args:
      adaptive: the menu and its costs.
      depths: each entry's draft depth (`menu_depths`).
      rate_b: float32 [B] the rows' acceptance estimates for the kind of round each is in (`rates`).
      pace_b: float32 [B] the rows' steps per emitted token so far (`paces`).
      remaining_b: [B] tokens each row may still generate; 0 for a finished row, which does not count.
    """
    after = [jnp.max(pace_b * jnp.maximum(remaining_b - expected_tokens(rate_b, d), 0)) for d in depths]
    return jnp.argmin(adaptive.cost + jnp.stack(after)).astype(jnp.int32)


def menu_depths(drafter: Drafter, menu: Sequence[int]) -> list[int]:
    """The depth of each menu entry's draft (0: the plain step)."""
    return [drafter.draft_shape(k).depth if k else 0 for k in menu]


def never_drafts(adaptive: Adaptive, depths: Sequence[int]) -> bool:
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
    per_token = [float(c / expected_tokens(prior, d)) for c, d in zip(adaptive.cost, depths)]
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
    pace = jnp.min(jnp.stack([c / expected_tokens(prior, d) for c, d in zip(adaptive.cost, depths)]))
    return jnp.broadcast_to(jnp.stack([pace, 1.0]) * ROW_PRIOR_WEIGHT, (batch, 2))


def paces(pace_b2: jax.Array) -> jax.Array:
    """float32 [B]: each row's steps per emitted token, from its running (steps, tokens)."""
    return pace_b2[:, 0] / pace_b2[:, 1]


def step_pace(pace_b2: jax.Array, cost: jax.Array, count_b: jax.Array, running_b: jax.Array) -> jax.Array:
    """The running rows' (steps, tokens) after a round of `cost` steps that emitted count_b tokens in each: PACE_MEMORY
    of the figures before it, plus the round's."""
    moved = PACE_MEMORY * pace_b2 + jnp.stack([jnp.broadcast_to(cost, count_b.shape), count_b], axis=1)
    return jnp.where(running_b[:, None], moved, pace_b2)


def observe(tally_brc: jax.Array, regime_b: jax.Array, depth: int, n_b: jax.Array, running_b: jax.Array) -> jax.Array:
    """The tallies after a round `depth` deep (static) in which the running rows, each in its kind of round regime_b,
    accepted n_b drafts: that kind's tally keeps ROW_MEMORY of itself and adds the round's counts."""
    here = running_b[:, None] & (jnp.arange(tally_brc.shape[1])[None, :] == regime_b[:, None])
    moved = ROW_MEMORY * tally_brc + counts(depth, n_b)[:, None, :]
    return jnp.where(here[..., None], moved, tally_brc)


def evidence(regime_b: jax.Array, depth: int, n_b: jax.Array, running_b: jax.Array, regimes: int) -> jax.Array:
    """float32 [R, 2]: a round's accepted drafts and tried depths per kind of round, over its running rows
    (`Adaptive.learn`)."""
    return jax.ops.segment_sum(counts(depth, n_b) * running_b[:, None], regime_b, num_segments=regimes)


def useful_entries(menu: Sequence[int], depths: Sequence[int], cost: Sequence[float]) -> list[int]:
    """The entries that are the best choice for some acceptance rate in [0, 1): the others would never run, so they
    are left out of the loop (each entry is compiled)."""
    best = set()
    for i in range(1000):
        gains = [expected_tokens_per_round(min(i / 1000, _MAX_RATE), d) / c for d, c in zip(depths, cost)]
        best.add(max(range(len(menu)), key=gains.__getitem__))
    return sorted(best)


# The vector extensions that decide a CPU's matmul speed. Cloud CPUs often share one model name ("AMD EPYC")
# across generations that differ 2-3x per token, so the key names them too.
CPU_ISA_MARKERS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "asimd", "sve")


def machine(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The device this process computes on, as calibration keys it: the accelerator kind, or the CPU model, core
    count and vector extensions."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return f"{device.platform}:{device.device_kind}"
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            info = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in f)}
    except OSError:
        info = {}
    model = info.get("model name") or platform.processor() or platform.machine()
    flags = set(info.get("flags", info.get("Features", "")).split())  # x86 / ARM
    isa = ",".join(m for m in CPU_ISA_MARKERS if m in flags)
    return f"cpu:{model}:{os.cpu_count()}:{isa}"


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
    from specjax.measure.timing import loop_seconds

    signature = {
        "method": "loop rounds",
        "machine": machine(),
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
    key = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_dir() / "calibration" / f"{key}.json"
    if path.is_file():
        return non_decreasing(json.loads(path.read_text())["cost"])
    step_s, round_s = loop_seconds(
        weights, cfg, drafter, menu, batch=batch, context=context, sampling=sampling, new_tokens=new_tokens, reps=reps
    )
    cost = [s / step_s for s in round_s]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**signature, "cost": cost}, indent=1))
    os.replace(tmp, path)
    return non_decreasing(cost)


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
    menu = ([0] if drafter.allows_plain_rounds else []) + sizes
    cost = menu_costs(weights, cfg, drafter, menu, batch=batch, context=context, sampling=sampling)
    keep = useful_entries(menu, menu_depths(drafter, menu), cost)
    return Adaptive.of([menu[i] for i in keep], [cost[i] for i in keep], regimes=drafter.num_regimes)
