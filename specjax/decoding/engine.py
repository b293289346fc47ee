"""Slots that refill: continuous batching on the speculative loop's fixed shapes.

An `Engine` has B slots of S KV slots each and a queue of requests. A new request takes the lowest free slot; the
device state (`SpecState`) holds the first P slots, P the smallest bucket (1, 2, 4, ... up to B) that holds every live
row, so one request computes one row. Device programs, each compiled once per (bucket, S, drafter options, greedy or
sampled), all taking the `Decoder` (weights, drafter, policy):
  begin, prefill  a new request's prompt, a few chunks at a time, into a one-row prefill of its own (target cache,
                  the drafter's commits);
  insert          its first token sampled, handed out at once, and that row (cache, drafter state, the policy's
                  per-row state) written over its slot;
  run             rounds of the loop (`speculative.next_round`) until a running row finishes, or `max_rounds` pass;
                  the rows' new tokens come back packed (`Emitted`); or plain steps without the drafter's upkeep
                  (`speculative.plain_round`), a program of its own, where they serve the bucket faster (`Duel`);
  resize          the state moved to another bucket when the live rows outgrow it or leave it.
Between programs the host streams each row's new tokens, takes finished rows' completions, inserts queued requests
into the freed slots (JetStream's prefill / insert / generate split) and lets each bucket's adaptive policy learn from
its timed run (the costs its own, the acceptance every bucket's), and its `Duel` from the run's time. While rows are
running, a new prompt is prefilled one chunk per round of theirs, so a long prompt never stalls them for its whole
prefill. Only the buckets' programs exist, so nothing compiles again as requests come and go once each has run
(`Engine.warm` compiles them first). Rows do not interact: a row's tokens depend on its own request alone (its prompt,
limit, sampling values and key), so greedy output equals the prompt decoded alone. Plain decoding is the same loop
with every round a plain step (`Fixed(0)`, a drafter that never drafts).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.adaptive import Adaptive, Fixed, Policy, menu_shapes
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding import speculative
from specjax.decoding.batch import (
    Completion,
    checked_seed,
    compiled,
    num_slots,
    on_mesh,
    pack_prompts,
    row_keys,
    to_host,
)
from specjax.decoding.stats import SpecStats
from specjax.drafters.base import ChainDrafter, Drafter
from specjax.errors import InputError
from specjax.models.llama import Weights, chunk_size
from specjax.sampling import Sampling

DEFAULT_ROUNDS = 64  # rounds per `run` at most: how often a streaming client hears from a long row
STEP_TOKENS = 128  # new tokens per row one `run` hands the host at most (`Emitted`)
# A bucket's duel between drafting and plain steps (`Duel`): the tokens each way is timed over before the two are
# compared, how much of a way's pooled timings a new run of it keeps, and the most of the time that re-checking the
# slower way may lose (at the gap measured).
DUEL_EVIDENCE = 32
DUEL_MEMORY = 0.8
DUEL_SHARE = 0.01


@dataclasses.dataclass
class Duel:
    """Which serves a bucket faster, its drafting runs (the policy's rounds) or plain steps without the drafter
    (`speculative.plain_round`): judged by each way's own timed runs, as a plain server would be timed (host side).

    A way's figure is its seconds per token of a row: a run's seconds x the rows that ran, over the tokens they
    emitted, pooled over its runs with the earlier ones weighed down by DUEL_MEMORY at each new one. Each way first
    runs until it holds DUEL_EVIDENCE tokens, plain steps first (they time the plain step, the clock of the policy's
    costs, before a drafting run is measured against it: `Adaptive.learn`); then the faster runs, and the other runs
    again once the faster has run for as long as keeps the re-check's cost within DUEL_SHARE of the time (the re-
    check's run time x the gap / DUEL_SHARE), so a change in the traffic (prompts that draft better, more rows)
    shows. A drafting run right after plain steps is one round and not counted (`Engine`): it catches the drafter up
    with the rows, whose state stays behind during plain steps, so re-checking drafting takes two runs (the budget
    prices the round as a whole run).
    """

    seconds: dict[bool, float] = dataclasses.field(default_factory=lambda: {True: 0.0, False: 0.0})  # x rows, pooled
    tokens: dict[bool, float] = dataclasses.field(default_factory=lambda: {True: 0.0, False: 0.0})  # pooled
    seen: dict[bool, int] = dataclasses.field(default_factory=lambda: {True: 0, False: 0})  # tokens counted in all
    last_s: dict[bool, float] = dataclasses.field(default_factory=lambda: {True: 0.0, False: 0.0})  # latest run's
    lead_s: float = 0.0  # the faster way's seconds since the other was last counted

    def per_token(self, drafting: bool) -> float:
        return self.seconds[drafting] / self.tokens[drafting]

    def pick(self) -> bool:
        """The way of the next run: True drafts."""
        for drafting in (False, True):  # plain steps first: they time the clock that drafting's costs are relative to
            if self.seen[drafting] < DUEL_EVIDENCE:
                return drafting
        lead = self.per_token(True) <= self.per_token(False)
        gap = self.per_token(not lead) / self.per_token(lead) - 1
        runs = 1 if lead else 2  # drafting after plain steps: a round that catches the drafter up, then the run counted
        return (not lead) if self.lead_s >= runs * self.last_s[not lead] * gap / DUEL_SHARE else lead

    def record(self, drafting: bool, seconds: float, rows: int, tokens: int) -> None:
        """Counts a run of `rows` running rows that emitted `tokens` in `seconds`."""
        if min(self.seen.values()) >= DUEL_EVIDENCE and self.per_token(drafting) <= self.per_token(not drafting):
            self.lead_s += seconds
        else:
            self.lead_s = 0.0
        self.seconds[drafting] = DUEL_MEMORY * self.seconds[drafting] + seconds * rows
        self.tokens[drafting] = DUEL_MEMORY * self.tokens[drafting] + tokens
        self.seen[drafting] += tokens
        self.last_s[drafting] = seconds


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlainSteps(ChainDrafter):
    """The drafter of plain decoding in the engine: the policy's one menu entry is the plain step, so it never drafts
    and has nothing to keep."""


def row_axes(one_row, two_rows):
    """Each leaf's row axis: the one where a state of one row and a state of two differ; None for a leaf of the whole
    batch (counters, the loop's key)."""

    def axis(a, b):
        return next((i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n), None)

    return jax.tree.map(axis, one_row, two_rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decoder:
    """What every engine program reads: the target's weights, the drafter and the policy (data; a learned policy or
    another bucket's reuses the executable), and the options the programs compile for (static). `drafting` False: a
    run's rounds are plain steps that leave the drafter alone (`speculative.plain_round`)."""

    weights: Weights
    drafter: Drafter
    policy: Policy
    cfg: ModelConfig = dataclasses.field(metadata=dict(static=True))
    eos_ids: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    prefill_chunk: int = dataclasses.field(metadata=dict(static=True))
    drafting: bool = dataclasses.field(default=True, metadata=dict(static=True))

    @property
    def capacity(self) -> int:
        """Slots past S each row holds for the menu's largest draft (`speculative.Loop.capacity`)."""
        return max(shape.capacity for shape in menu_shapes(self.drafter, self.policy.menu))

    def loop(self, sampling: Sampling, max_new_b: jax.Array) -> speculative.Loop:
        shapes = tuple(menu_shapes(self.drafter, self.policy.menu))
        return speculative.Loop(
            self.weights,
            self.drafter,
            self.policy,
            sampling,
            self.cfg,
            shapes,
            max_new_b,
            self.eos_ids,
            self.prefill_chunk,
        )

    def state_axes(self, width: int):
        """The row axis of each leaf of a state whose prompts are `width` tokens wide (`row_axes`)."""

        def shape_of(rows):
            tokens, lengths = jnp.zeros((rows, width), jnp.int32), jnp.ones((rows,), jnp.int32)
            loop = self.loop(Sampling.of(SamplingConfig(), rows), lengths)
            keys = row_keys([0] * rows, rows, rows)
            return jax.eval_shape(lambda: speculative.start(loop, tokens, lengths, keys, None, 1)[0])

        return row_axes(shape_of(1), shape_of(2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prompt:
    """A new request as the prefill programs take it: one row."""

    tokens_1s: jax.Array  # [1, S] its prompt, right-padded
    length_1: jax.Array  # [1] the prompt's tokens
    max_new_1: jax.Array  # [1] its most new tokens
    sampling_1: Sampling


def take_rows(state, axes, rows: int):
    """The first `rows` rows of `state`; whole-batch leaves as they are."""

    def take(x, axis):
        return x if axis is None else jax.lax.slice_in_dim(x, 0, rows, axis=axis)

    return jax.tree.map(take, state, axes)


def put_rows(state, part, axes, first, whole_from_part: bool = False):
    """`state` with the rows from `first` on replaced by `part`'s; whole-batch leaves (counters, the policy's
    evidence) are `part`'s if `whole_from_part`, else `state`'s."""

    def put(full, rows, axis):
        if axis is None:
            return rows if whole_from_part else full
        return jax.lax.dynamic_update_slice_in_dim(full, rows, first, axis)

    return jax.tree.map(put, state, part, axes)


@jax.jit
def empty_state(decoder: Decoder, tokens_bs, keys_b, sampling):
    """The state of B free slots (every row finished) over S = tokens_bs.shape[1] slots."""
    B = tokens_bs.shape[0]
    loop = decoder.loop(sampling, jnp.ones((B,), jnp.int32))
    state, _ = speculative.start(loop, tokens_bs, jnp.ones((B,), jnp.int32), keys_b, jnp.zeros((B,), bool), 1)
    return state


@jax.jit
def begin(decoder: Decoder, prompt: Prompt) -> speculative.Prefilled:
    """A new request's prefill before its first chunk: one row, apart from the batch (`speculative.begin_prefill`)."""
    loop = decoder.loop(prompt.sampling_1, prompt.max_new_1)
    return speculative.begin_prefill(loop, prompt.tokens_1s, prompt.length_1, 1)


@functools.partial(jax.jit, donate_argnames=("prefilled",))
def prefill(decoder: Decoder, prefilled: speculative.Prefilled, prompt: Prompt, first, end) -> speculative.Prefilled:
    """Chunks `first` to `end` (exclusive) of a new request's prompt."""
    loop = decoder.loop(prompt.sampling_1, prompt.max_new_1)
    return speculative.prefill_and_commit(loop, prefilled, prompt.tokens_1s, prompt.length_1, 1, first, end)


@functools.partial(jax.jit, donate_argnames=("state",))
def insert(decoder: Decoder, state, prefilled: speculative.Prefilled, prompt: Prompt, key_data_1, fold_1, row):
    """`state` with slot `row` holding a new request whose every chunk is prefilled: its first token sampled, its
    fresh row (cache, drafter and policy state) written over the slot; and that token (`Emitted`, one row). The row
    draws from its key, `fold_in(key_data_1, fold_1)` [1], from then on.
    """
    keys_1 = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data_1), fold_1)
    loop = decoder.loop(prompt.sampling_1, prompt.max_new_1)
    one, _ = speculative.after_prefill(loop, prefilled, prompt.tokens_1s, prompt.length_1, keys_1, None, 1)
    first = jnp.take_along_axis(one.tokens_bs, prompt.length_1[:, None], axis=1)
    state = put_rows(state, one, decoder.state_axes(prompt.tokens_1s.shape[1]), row)
    return state, Emitted(first, one.num_new_b, one.done_b)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Emitted:
    """What one `run` hands the host (JetStream's ResultTokens): each row's new tokens, packed, not its buffer."""

    tokens_pw: jax.Array  # [P, STEP_TOKENS] the tokens each row generated from its `streamed_p` on (pad after count)
    count_p: jax.Array  # [P] how many
    done_p: jax.Array  # [P] the row is finished


@functools.partial(jax.jit, donate_argnames=("state",))
def run(decoder: Decoder, state, streamed_p, max_new_p, sampling_p, max_rounds):
    """Rounds over the state's P rows until a row running at the start finishes (or every one is finished),
    `max_rounds` pass, or another round could take a row past STEP_TOKENS tokens since its `streamed_p` [P]; the state
    and what the rows emitted (`Emitted`)."""
    loop = decoder.loop(sampling_p, max_new_p)
    done_at_start = state.done_b

    def going(carry):
        s, rounds = carry
        room = jnp.max(jnp.where(s.done_b, 0, s.num_new_b - streamed_p)) + loop.depth + 1 <= STEP_TOKENS
        return ~jnp.any(s.done_b & ~done_at_start) & ~jnp.all(s.done_b) & (rounds < max_rounds) & room

    def step(carry):
        s, rounds = carry
        return (speculative.next_round if decoder.drafting else speculative.plain_round)(loop, s), rounds + 1

    state, _ = jax.lax.while_loop(going, step, (state, jnp.int32(0)))
    at = (state.length_b - state.num_new_b + streamed_p)[:, None] + jnp.arange(STEP_TOKENS)[None, :]
    tokens = jnp.take_along_axis(state.tokens_bs, jnp.minimum(at, state.tokens_bs.shape[1] - 1), axis=1)
    return state, Emitted(tokens, state.num_new_b - streamed_p, state.done_b)


@functools.partial(jax.jit, static_argnames=("rows",))  # no donation: the shapes change
def resize(decoder: Decoder, state, free_1, *, rows: int):
    """The state of `rows` rows: the state's first rows, then copies of the free slot `free_1` (a state of one row);
    its whole-batch counters kept."""
    axes = decoder.state_axes(free_1.tokens_bs.shape[1] - decoder.capacity)
    have = state.done_b.shape[0]
    if rows <= have:
        return take_rows(state, axes, rows)

    def grown(x, free, axis):
        return x if axis is None else jnp.concatenate([x, jnp.repeat(free, rows - have, axis=axis)], axis=axis)

    return jax.tree.map(grown, state, free_1, axes)


def buckets(slots: int) -> list[int]:
    """The row counts a `run` computes: the powers of two below `slots`, and `slots`."""
    return [1 << i for i in range((slots - 1).bit_length()) if 1 << i < slots] + [slots]


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request got from one `Engine.step`: its new tokens, and its completion when it finished."""

    request: int
    new_ids: list[int]
    completion: Completion | None = None


@dataclasses.dataclass
class _Request:
    id: int
    prompt: list[int]
    max_new: int
    sampling: SamplingConfig
    key: tuple[np.ndarray, int]  # its row's PRNG key: fold_in(key data, index)
    output: list[int] = dataclasses.field(default_factory=list)  # tokens handed out in events so far


@dataclasses.dataclass
class _Prefill:
    """A request being prefilled into a slot, chunk by chunk."""

    request: _Request
    slot: int
    prompt: Prompt
    prefilled: speculative.Prefilled  # so far (device arrays)
    next_chunk: int
    chunks: int


class Engine:
    """Decodes a stream of requests in B slots that refill as rows finish (module docstring).

    Args:
      weights, cfg: the target.
      drafter: any `Drafter`; None: plain decoding.
      num_draft_tokens: K or an adaptive menu, as `speculative_generate` takes (with a drafter); or one policy per
        bucket of rows (`buckets(slots)`), each with the same menu. An `Adaptive` policy learns from the bucket's
        timed runs as a one-shot call's does (`Adaptive.learn`), and the bucket runs plain steps without the drafter
        where its timed runs show them faster than its drafting runs (`Duel`).
      slots: B, rows decoded together: each `run` computes the smallest bucket of slots, from the first, that holds
        every live row, and a new request takes the lowest free slot.
      max_context: the longest prompt + max_new_tokens a request may ask for (S is the power of two above it).
      sampled: False: every request greedy (the greedy program); True: per-request sampling values (a request with
        temperature 0 is greedy inside it; a run whose rows are all greedy takes the greedy program).
      eos_ids: tokens that end a row; defaults to the config's EOS ids.
      prefill_chunk: prompt tokens per prefill forward; defaults to the platform's.
      seed: where a request gives no seed of its own, request i's key is folded from this seed's and i.
      refill: False: a new request waits until every slot is free (static batches, for comparison).
    """

    def __init__(
        self,
        weights: Weights,
        cfg: ModelConfig,
        *,
        drafter: Drafter | None = None,
        num_draft_tokens: int | Policy | Mapping[int, Policy] = 1,
        slots: int = 8,
        max_context: int = 2048,
        sampled: bool = False,
        eos_ids: Sequence[int] | None = None,
        prefill_chunk: int | None = None,
        seed: int = 0,
        refill: bool = True,
    ):
        if slots < 1:
            raise InputError(f"slots must be >= 1, got {slots}")
        if not 1 <= max_context <= cfg.max_position_embeddings:
            raise InputError(f"max_context must be in 1..{cfg.max_position_embeddings}, got {max_context}")
        self.buckets = buckets(slots)
        if drafter is None:
            drafter, num_draft_tokens = PlainSteps(), Fixed(0)
        policies = (
            num_draft_tokens if isinstance(num_draft_tokens, Mapping) else dict.fromkeys(self.buckets, num_draft_tokens)
        )
        if sorted(policies) != self.buckets:
            raise InputError(f"give one policy for each bucket of rows {self.buckets}, got {sorted(policies)}")
        self.policies = {rows: speculative.as_policy(p) for rows, p in policies.items()}
        if len({p.menu for p in self.policies.values()}) > 1:
            raise InputError(
                f"every bucket's policy needs the same menu, got {[p.menu for p in self.policies.values()]}"
            )
        if not isinstance(drafter, PlainSteps):
            for policy in self.policies.values():
                speculative.check_inputs(cfg, drafter, policy)
        self.cfg, self.slots, self.sampled, self.refill = cfg, slots, sampled, refill
        self.num_slots = num_slots(cfg, max_context)
        eos_ids = tuple(int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids))
        self.decoder = Decoder(weights, drafter, self.policies[slots], cfg, eos_ids, chunk_size(prefill_chunk))
        self._seed_key = np.asarray(jax.random.key_data(row_keys([seed], 1, 1)))
        self.compile_seconds = 0.0  # spent compiling this engine's programs
        self.compiled_programs = 0  # and how many it compiled
        self._ids = 0
        self.duels = {rows: Duel() for rows in self.buckets}  # whether each bucket drafts (`_decoder`)
        self.reset()

    def reset(self) -> None:
        """Every slot free and nothing queued (request ids go on counting)."""
        tokens = jnp.zeros((1, self.num_slots), jnp.int32)
        free = (self.decoder, tokens, row_keys([0], 1, 1), self._sampling([SamplingConfig()]))
        self._free = self._call(empty_state, *free)  # one free slot, what a growing state adds
        self.state = self._call(empty_state, *free)  # the first `self.rows` slots; the others are free
        self._queue: collections.deque[_Request] = collections.deque()
        self._rows: list[_Request | None] = [None] * self.slots
        self._prefill: _Prefill | None = None
        self._counts = to_host(self._counters(self.state))
        # {"running": row-rounds of live rows, "idle": of free slots inside the bucket that ran}
        self.slot_rounds = collections.Counter()
        self.runs_by_rows = collections.Counter()  # `run` calls per bucket
        self._drafted = True  # the latest run drafted

    @property
    def _may_stop_drafting(self) -> bool:
        """Whether a bucket may run plain steps without the drafter (`Duel`): an adaptive menu with the plain step."""
        policy = self.decoder.policy
        return isinstance(policy, Adaptive) and 0 in policy.menu and not isinstance(self.decoder.drafter, PlainSteps)

    @property
    def rows(self) -> int:
        """The slots the device state holds now, a bucket: every live row is among them."""
        return int(self.state.done_b.shape[0])

    def _resize(self, rows: int) -> None:
        if rows != self.rows:
            self.state = self._call(resize, self.decoder, self.state, self._free, rows=rows)

    def _call(self, fn, *args, **static):
        args = on_mesh(args)
        executable, seconds = compiled(fn, args, static)  # on a mesh, once per sharding the state takes
        self.compile_seconds += seconds
        self.compiled_programs += seconds > 0
        return executable(*args)

    def warm(self) -> None:
        """Compiles every program a stream of requests runs, so none compiles while it is served: each bucket's `run`
        (called for no round over free slots; with its plain-step run where drafting may be turned off) and `insert` (a
        one-token request that ends at its first token), the prefill programs, and the resizes between buckets. Call it
        before any request."""
        for rows in self.buckets:
            for other in self.buckets:  # the resizes from `rows` to every other bucket and back
                self._resize(rows)
                self._resize(other)
            self._resize(rows)
            nothing = np.zeros((rows,), np.int32)
            sampling = self._sampling([SamplingConfig()] * rows)
            for greedy in {True, sampling.greedy}:  # a sampled engine's rows may all be greedy (`step`)
                for drafting in (True, False) if self._may_stop_drafting else (True,):
                    decoder = dataclasses.replace(self.decoder, drafting=drafting)
                    args = (nothing, nothing + 1, dataclasses.replace(sampling, greedy=greedy), np.int32(0))
                    self.state, _ = self._call(run, decoder, self.state, *args)
            self.complete([[0]], 1)  # prefills and inserts over slot 0, then ends at its first token

    @staticmethod
    def _counters(state) -> tuple:
        """The whole-batch figures a run's learning compares before and after (small)."""
        return state.rounds, state.menu_rounds, state.accepted_hist, state.policy_state

    def _sampling(self, settings: Sequence[SamplingConfig], by_rows: bool = False) -> Sampling:
        """The rows' sampling values, run by the engine's program (greedy unless `sampled`); with `by_rows`, by the
        greedy one where every row is greedy: the same tokens, without the sampled program's work."""
        sampling = Sampling.of(list(settings), len(settings))
        return dataclasses.replace(sampling, greedy=not self.sampled or (by_rows and sampling.greedy))

    def idle_share(self) -> float:
        """The share of the row-rounds computed so far whose slot was free (its row finished, or nothing queued to
        refill it)."""
        return self.slot_rounds["idle"] / max(1, self.slot_rounds["idle"] + self.slot_rounds["running"])

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> int:
        """Slots holding a request (running, or being prefilled)."""
        return sum(r is not None for r in self._rows) + (self._prefill is not None)

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig = SamplingConfig(),
        seed: int | None = None,
    ) -> int:
        """Queues a request; returns its id. Its sampled tokens come from its key alone: with a `seed`, the key
        `generate([prompt], seed=[seed])` gives its row, so they are those of that call whoever shares the slots.
        Raises InputError for a request the engine cannot serve."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise InputError("every prompt must contain at least one token")
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.num_slots:
            raise InputError(
                f"a prompt of {len(prompt)} tokens plus {max_new_tokens} new tokens exceeds the engine's context "
                f"of {self.num_slots} tokens"
            )
        if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.cfg.vocab_size)
            raise InputError(f"token id {bad} is outside the model's vocabulary 0..{self.cfg.vocab_size - 1}")
        if not self.sampled and not sampling.greedy:
            raise InputError("this engine decodes greedily: make it with sampled=True for sampling values")
        if seed is None:
            key = self._seed_key, self._ids
        else:  # generate's key for a prompt with its own seed: fold_in(key(seed), 0)
            key = np.asarray(jax.random.key_data(jax.random.key(checked_seed(seed))))[None], 0
        self._ids += 1
        self._queue.append(_Request(self._ids, prompt, int(max_new_tokens), sampling, key))
        return self._ids

    def step(self, max_rounds: int = DEFAULT_ROUNDS) -> list[Event]:
        """Fills free slots from the queue, runs rounds until a row finishes (at most `max_rounds`) and returns each
        running request's new tokens, with the completions of those that finished."""
        firsts = self._fill()
        running = [i for i, r in enumerate(self._rows) if r is not None]
        if firsts or not running:
            return firsts  # a new request's first token goes out before any round
        rows = next(b for b in self.buckets if b > running[-1])
        decoder = self._decoder(rows)
        # one round between two chunks of a prompt being prefilled; one round that catches the drafter up (`Duel`)
        if self._prefill is not None or (decoder.drafting and not self._drafted):
            max_rounds = 1
        self._resize(rows)
        live = self._rows[:rows]
        streamed = np.array([len(r.output) if r else 0 for r in live], np.int32)
        max_new = np.array([r.max_new if r else 1 for r in live], np.int32)
        sampling = self._sampling([r.sampling if r else SamplingConfig() for r in live], by_rows=True)
        jax.block_until_ready((self.state, self._prefill and self._prefill.prefilled))  # the time is the run's alone
        t0 = time.perf_counter()
        self.state, emitted = self._call(run, decoder, self.state, streamed, max_new, sampling, np.int32(max_rounds))
        emitted, counts = to_host((emitted, self._counters(self.state)))
        seconds = time.perf_counter() - t0
        self._learn(rows, seconds, counts, emitted.count_p[running])
        if self._may_stop_drafting and (self._drafted or not decoder.drafting):  # else it catches the drafter up
            self.duels[rows].record(decoder.drafting, seconds, len(running), int(emitted.count_p[running].sum()))
        self._drafted = decoder.drafting
        ran = int(counts[0] - self._counts[0])
        self._counts = counts
        self.runs_by_rows[rows] += 1
        self.slot_rounds["running"] += ran * len(running)
        self.slot_rounds["idle"] += ran * (rows - len(running))
        return [self._emit(i, emitted, i) for i in running]

    def _emit(self, slot: int, emitted: Emitted, row: int) -> Event:
        """The event of the request in `slot` from its `row` of `emitted`; a finished request leaves its slot."""
        r = self._rows[slot]
        new = [int(t) for t in emitted.tokens_pw[row, : emitted.count_p[row]]]
        r.output += new
        completion = None
        if emitted.done_p[row]:
            reason = "stop" if r.output[-1] in self.decoder.eos_ids else "length"
            completion = Completion(r.prompt, r.output, reason)
            self._rows[slot] = None
        return Event(r.id, new, completion)

    def _decoder(self, rows: int) -> Decoder:
        """What a run of `rows` rows decodes with: the bucket's policy, or plain steps without the drafter's upkeep
        where the bucket's `Duel` says that they serve it faster."""
        drafting = self.duels[rows].pick() if self._may_stop_drafting else True
        return dataclasses.replace(self.decoder, policy=self.policies[rows], drafting=drafting)

    def _learn(self, rows: int, seconds: float, counts: tuple, count_p: np.ndarray) -> None:
        """The bucket's policy after a run that took `seconds` (`Adaptive.learn`, as a one-shot call learns from its
        call): a run of plain steps alone times the plain step (the clock its costs are relative to)."""
        (rounds, by_entry, hist, policy_state), (rounds0, by_entry0, hist0, policy_state0) = counts, self._counts
        policy = self.policies[rows]
        if not isinstance(policy, Adaptive) or rounds == rounds0:
            return  # a fixed K, or no round
        by_entry = dict(zip(policy.menu, (by_entry - by_entry0).tolist()))
        evidence = np.asarray(policy.evidence(policy_state)) - np.asarray(policy.evidence(policy_state0))
        drafted = any(n for k, n in by_entry.items() if k)  # else the run times the plain step alone
        stats = dataclasses.replace(
            SpecStats.from_histogram(int(rounds - rounds0), hist - hist0, int(count_p.sum()), seconds),
            rounds_by_drafts=by_entry,
            acceptance_evidence=[tuple(e) for e in evidence.tolist()] if drafted else [],
            # what plain decoding would take here: the engine's own plain steps, at their learned cost
            plain_steps=int(count_p.max()) * (float(policy.cost[policy.menu.index(0)]) if 0 in policy.menu else 1.0),
        )
        learned = policy.learn(stats)
        # acceptance is the traffic's, not the bucket's: every bucket drafts from the rates any of them learned
        for other, p in self.policies.items():
            if isinstance(p, Adaptive):
                self.policies[other] = (
                    learned if other == rows else dataclasses.replace(p, prior=learned.prior, seen=learned.seen)
                )

    def cancel(self, request: int) -> bool:
        """Drops a queued request, or ends a running one and frees its slot (its row finishes where it is). Whether
        the request was still there."""
        for r in self._queue:
            if r.id == request:
                self._queue.remove(r)
                return True
        if self._prefill is not None and self._prefill.request.id == request:
            self._prefill = None
            return True
        for i, r in enumerate(self._rows):
            if r is not None and r.id == request:
                self.state = dataclasses.replace(self.state, done_b=self.state.done_b.at[i].set(True))
                self._rows[i] = None
                return True
        return False

    def _fill(self) -> list[Event]:
        """Prefills queued requests into free slots: whole while no row runs, else one chunk per call. The events of
        the requests it inserted: each one's first token."""
        firsts = []
        if not self.refill and self.busy:
            return firsts  # static batches: a new batch once every slot is free, prefilled whole
        while True:
            running = self.busy - (self._prefill is not None)
            if self._prefill is None:
                free = [i for i, r in enumerate(self._rows) if r is None]
                if not free or not self._queue:
                    return firsts
                self._prefill = self._begin(self._queue.popleft(), free[0])
            p = self._prefill
            end = p.chunks if not running or not self.refill else p.next_chunk + 1
            p.prefilled = self._call(
                prefill, self.decoder, p.prefilled, p.prompt, np.int32(p.next_chunk), np.int32(end)
            )
            p.next_chunk = end
            if end < p.chunks:
                return firsts
            key_data, fold = p.request.key
            fold = np.array([fold], np.int32)
            self._resize(max(self.rows, next(b for b in self.buckets if b > p.slot)))
            self.state, first = self._call(
                insert, self.decoder, self.state, p.prefilled, p.prompt, key_data, fold, np.int32(p.slot)
            )
            self._rows[p.slot], self._prefill = p.request, None
            firsts.append(self._emit(p.slot, to_host(first), 0))

    def _begin(self, r: _Request, slot: int) -> _Prefill:
        tokens, length = pack_prompts([r.prompt], 1, self.num_slots)
        prompt = Prompt(tokens, length, np.array([r.max_new], np.int32), self._sampling([r.sampling]))
        chunks = -(-len(r.prompt) // chunk_size(self.decoder.prefill_chunk, self.num_slots))
        return _Prefill(r, slot, prompt, self._call(begin, self.decoder, prompt), 0, chunks)

    def events(self, max_rounds: int = DEFAULT_ROUNDS) -> Iterator[Event]:
        """Steps until the queue is empty and every slot free, yielding each step's events."""
        while self._queue or self.busy:
            yield from self.step(max_rounds)

    def complete(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
        seeds: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Decodes the prompts through the slots (`seeds`: one per prompt, or none); their completions in prompt
        order."""
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        settings = [sampling] * len(prompts) if isinstance(sampling, SamplingConfig) else list(sampling)
        seeds = [None] * len(prompts) if seeds is None else list(seeds)
        if not len(limits) == len(settings) == len(seeds) == len(prompts):
            raise InputError(
                f"give one max_new_tokens and one sampling setting, or one per prompt, and a seed per prompt or none "
                f"({len(prompts)} prompts)"
            )
        ids = [self.submit(*request) for request in zip(prompts, limits, settings, seeds)]
        done = {e.request: e.completion for e in self.events() if e.completion is not None}
        return [done[i] for i in ids]
