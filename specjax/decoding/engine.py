"""Slots that refill: continuous batching on the speculative loop's fixed shapes.

An `Engine` holds one decode state (`SpecState`) of B rows, its slots, of S KV slots each, and a queue of requests.
Device programs, each compiled once per (B, S, drafter options, greedy or sampled):
  begin, prefill  a new request's prompt, a few chunks at a time, into a one-row prefill of its own (target cache,
                  the drafter's commits);
  insert          its first token sampled and that row (cache, drafter state, the policy's per-row state) written
                  over a free slot of the batch state;
  run             rounds of the loop (`speculative.next_round`) until a running row finishes, or `max_rounds` pass.
Between programs the host streams each row's new tokens, takes finished rows' completions and inserts queued
requests into the freed slots (JetStream's prefill / insert / generate split). While rows are running, a new prompt
is prefilled one chunk per round of theirs, so a long prompt never stalls them for its whole prefill. Shapes never
change, so nothing compiles again as requests come and go. Rows do not interact: a row's tokens depend on its own
request alone (its prompt, limit, sampling values and key), so greedy output equals the prompt decoded alone. Plain
decoding is the same loop with every round a plain step (`Fixed(0)`, a drafter that never drafts).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.adaptive import Fixed, Policy, menu_shapes
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
from specjax.drafters.base import ChainDrafter, Drafter
from specjax.errors import InputError
from specjax.models.llama import Weights, chunk_size
from specjax.sampling import Sampling

DEFAULT_ROUNDS = 64  # rounds per `run` at most: how often a streaming client hears from a long row


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


def put_row(state, one_row, axes, row: jax.Array):
    """`state` with row `row` replaced by the one-row state's; whole-batch leaves keep `state`'s."""

    def put(full, one, axis):
        return full if axis is None else jax.lax.dynamic_update_slice_in_dim(full, one, row, axis)

    return jax.tree.map(put, state, one_row, axes)


def _loop(weights, drafter, policy, sampling, max_new_b, cfg, eos_ids, prefill_chunk) -> speculative.Loop:
    shapes = tuple(menu_shapes(drafter, policy.menu))
    return speculative.Loop(weights, drafter, policy, sampling, cfg, shapes, max_new_b, eos_ids, prefill_chunk)


STATIC = ("cfg", "eos_ids", "prefill_chunk")


@functools.partial(jax.jit, static_argnames=STATIC)
def empty_state(weights, drafter, policy, tokens_bs, keys_b, sampling, *, cfg, eos_ids, prefill_chunk):
    """The state of B free slots (every row finished) over S = tokens_bs.shape[1] slots."""
    B = tokens_bs.shape[0]
    loop = _loop(weights, drafter, policy, sampling, jnp.ones((B,), jnp.int32), cfg, eos_ids, prefill_chunk)
    state, _ = speculative.start(loop, tokens_bs, jnp.ones((B,), jnp.int32), keys_b, jnp.zeros((B,), bool), 1)
    return state


@functools.partial(jax.jit, static_argnames=STATIC)
def begin(weights, drafter, policy, tokens_1s, length_1, max_new_1, sampling_1, *, cfg, eos_ids, prefill_chunk):
    """A new request's prefill before its first chunk: one row, apart from the batch (`speculative.begin_prefill`)."""
    loop = _loop(weights, drafter, policy, sampling_1, max_new_1, cfg, eos_ids, prefill_chunk)
    return speculative.begin_prefill(loop, tokens_1s, length_1, 1)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("prefilled",))
def prefill(
    weights,
    drafter,
    policy,
    prefilled,
    tokens_1s,
    length_1,
    max_new_1,
    sampling_1,
    first,
    end,
    *,
    cfg,
    eos_ids,
    prefill_chunk,
):
    """Chunks `first` to `end` (exclusive) of a new request's prompt [1, S] of `length_1` tokens."""
    loop = _loop(weights, drafter, policy, sampling_1, max_new_1, cfg, eos_ids, prefill_chunk)
    return speculative.prefill_and_commit(loop, prefilled, tokens_1s, length_1, 1, first, end)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("state",))
def insert(
    weights,
    drafter,
    policy,
    state,
    prefilled,
    tokens_1s,
    length_1,
    max_new_1,
    key_data_1,
    fold_1,
    sampling_1,
    row,
    *,
    cfg,
    eos_ids,
    prefill_chunk,
):
    """`state` with slot `row` holding a new request whose every chunk is prefilled: its first token sampled, its
    fresh row (cache, drafter and policy state) written over the slot. The row draws from its key, `fold_in(key_data_1,
    fold_1)` [1], from then on.
    """
    keys_1 = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data_1), fold_1)
    loop = _loop(weights, drafter, policy, sampling_1, max_new_1, cfg, eos_ids, prefill_chunk)
    one, _ = speculative.after_prefill(loop, prefilled, tokens_1s, length_1, keys_1, None, 1)

    def shape_of(rows):
        tokens, lengths = jnp.zeros((rows, tokens_1s.shape[1]), jnp.int32), jnp.ones((rows,), jnp.int32)
        sampling, keys = jax.tree.map(lambda x: jnp.repeat(x, rows, axis=0), (sampling_1, keys_1))
        lo = _loop(weights, drafter, policy, sampling, lengths, cfg, eos_ids, prefill_chunk)
        return jax.eval_shape(lambda: speculative.start(lo, tokens, lengths, keys, None, 1)[0])

    return put_row(state, one, row_axes(shape_of(1), shape_of(2)), row)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("state",))
def run(weights, drafter, policy, state, max_new_b, sampling, max_rounds, *, cfg, eos_ids, prefill_chunk):
    """Rounds until a row running at the start finishes (or every row is finished), at most `max_rounds`."""
    loop = _loop(weights, drafter, policy, sampling, max_new_b, cfg, eos_ids, prefill_chunk)
    done_at_start = state.done_b

    def going(carry):
        s, rounds = carry
        return ~jnp.any(s.done_b & ~done_at_start) & ~jnp.all(s.done_b) & (rounds < max_rounds)

    def step(carry):
        s, rounds = carry
        return speculative.next_round(loop, s), rounds + 1

    state, _ = jax.lax.while_loop(going, step, (state, jnp.int32(0)))
    return state


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
    streamed: int = 0  # tokens handed out in events so far


@dataclasses.dataclass
class _Prefill:
    """A request being prefilled into a slot, chunk by chunk."""

    request: _Request
    slot: int
    inputs: tuple  # its tokens [1, S], length [1], max_new [1], sampling: what every prefill program takes
    prefilled: tuple  # the one-row prefill so far (device arrays)
    next_chunk: int
    chunks: int


class Engine:
    """Decodes a stream of requests in B slots that refill as rows finish (module docstring).

    Args:
      weights, cfg: the target.
      drafter: any `Drafter`; None: plain decoding.
      num_draft_tokens: K or an adaptive menu, as `speculative_generate` takes (with a drafter).
      slots: B, rows decoded together.
      max_context: the longest prompt + max_new_tokens a request may ask for (S is the power of two above it).
      sampled: False: every request greedy (the greedy program); True: per-request sampling values (a request with
        temperature 0 is greedy inside it).
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
        num_draft_tokens: int | Policy = 1,
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
        if drafter is None:
            drafter, policy = PlainSteps(), Fixed(0)
        else:
            policy = speculative.as_policy(num_draft_tokens)
            speculative.check_inputs(cfg, drafter, policy)
        self.cfg, self.slots, self.sampled, self.refill = cfg, slots, sampled, refill
        self.num_slots = num_slots(cfg, max_context)
        self.static = dict(
            cfg=cfg,
            eos_ids=tuple(int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids)),
            prefill_chunk=chunk_size(prefill_chunk),
        )
        self.model = on_mesh((weights, drafter, policy))
        self._seed_key = np.asarray(jax.random.key_data(row_keys([seed], 1, 1)))
        self.compile_seconds = 0.0  # spent compiling this engine's programs
        self._ids = 0
        self.reset()

    def reset(self) -> None:
        """Every slot free and nothing queued (request ids go on counting)."""
        tokens = jnp.zeros((self.slots, self.num_slots), jnp.int32)
        keys = row_keys([0] * self.slots, self.slots, self.slots)
        self.state = self._call(empty_state, tokens, keys, self._sampling([SamplingConfig()] * self.slots))
        self._queue: collections.deque[_Request] = collections.deque()
        self._rows: list[_Request | None] = [None] * self.slots
        self._prefill: _Prefill | None = None
        self.slot_rounds = collections.Counter()  # {"running": row-rounds of live rows, "idle": of free slots}

    def _call(self, fn, *args):
        args = on_mesh((*self.model, *args))
        executable, seconds = compiled(fn, args, self.static)  # on a mesh, once per sharding the state takes
        self.compile_seconds += seconds
        return executable(*args)

    def _sampling(self, settings: Sequence[SamplingConfig]) -> Sampling:
        sampling = Sampling.of(list(settings), len(settings))
        return dataclasses.replace(sampling, greedy=not self.sampled)

    def idle_share(self) -> float:
        """The share of slot-rounds so far that slots sat free (rows finished, or nothing queued to refill them)."""
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
        self._fill()
        running = [i for i, r in enumerate(self._rows) if r is not None]
        if not running:
            return []
        if self._prefill is not None:  # a prompt is being prefilled: one round between two of its chunks
            max_rounds = 1
        max_new = np.array([r.max_new if r else 1 for r in self._rows], np.int32)
        sampling = self._sampling([r.sampling if r else SamplingConfig() for r in self._rows])
        rounds_before = int(self.state.rounds)
        self.state = self._call(run, self.state, max_new, sampling, np.int32(max_rounds))
        tokens, length, num_new, done, rounds = to_host(
            (self.state.tokens_bs, self.state.length_b, self.state.num_new_b, self.state.done_b, self.state.rounds)
        )
        ran = int(rounds) - rounds_before
        self.slot_rounds["running"] += ran * len(running)
        self.slot_rounds["idle"] += ran * (self.slots - len(running))
        events = []
        for i in running:
            r = self._rows[i]
            start = length[i] - num_new[i]
            new = [int(t) for t in tokens[i, start + r.streamed : start + num_new[i]]]
            r.streamed = int(num_new[i])
            completion = None
            if done[i]:
                ids = [int(t) for t in tokens[i, start : start + num_new[i]]]
                reason = "stop" if ids and ids[-1] in self.static["eos_ids"] else "length"
                completion = Completion(r.prompt, ids, reason)
                self._rows[i] = None
            events.append(Event(r.id, new, completion))
        return events

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

    def _fill(self) -> None:
        """Prefills queued requests into free slots: whole while no row runs, else one chunk per call."""
        if not self.refill and self.busy:
            return  # static batches: a new batch once every slot is free, prefilled whole
        while True:
            running = self.busy - (self._prefill is not None)
            if self._prefill is None:
                free = [i for i, r in enumerate(self._rows) if r is None]
                if not free or not self._queue:
                    return
                self._prefill = self._begin(self._queue.popleft(), free[0])
            p = self._prefill
            end = p.chunks if not running or not self.refill else p.next_chunk + 1
            p.prefilled = self._call(prefill, p.prefilled, *p.inputs, np.int32(p.next_chunk), np.int32(end))
            p.next_chunk = end
            if end < p.chunks:
                return
            key_data, fold = p.request.key
            tokens, length, max_new, sampling = p.inputs
            self.state = self._call(
                insert,
                self.state,
                p.prefilled,
                tokens,
                length,
                max_new,
                key_data,
                np.array([fold], np.int32),
                sampling,
                np.int32(p.slot),
            )
            self._rows[p.slot], self._prefill = p.request, None

    def _begin(self, r: _Request, slot: int) -> _Prefill:
        tokens, length = pack_prompts([r.prompt], 1, self.num_slots)
        inputs = (tokens, length, np.array([r.max_new], np.int32), self._sampling([r.sampling]))
        chunks = -(-len(r.prompt) // chunk_size(self.static["prefill_chunk"], self.num_slots))
        return _Prefill(r, slot, inputs, self._call(begin, *inputs), 0, chunks)

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
