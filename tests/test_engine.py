"""The refilling engine: each request's greedy output through slots that refill (random arrivals, mixed lengths,
partial runs) equals plain greedy decoding of its prompt alone, for every drafter; streamed tokens add up to the
completion; a handful of programs serve any number of requests; bad requests are refused in one line."""

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters_fixture import drafter_cases, drafter_params

from specjax.adaptive import Adaptive
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding import batch, speculative
from specjax.decoding import engine as engine_module
from specjax.decoding.autoregressive import generate
from specjax.decoding.engine import Engine
from specjax.drafters import ModelDrafter, NgramDrafter
from specjax.errors import InputError
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, init_weights
from specjax.sampling import Sampling, probabilities

# A small vocabulary, so that random drafts are often right and rows accept different numbers of drafts; EOS ends
# some rows early.
CFG = ModelConfig("llama", 8, 16, 32, 4, 4, 2, 8, max_position_embeddings=64, eos_token_ids=(1,))
WEIGHTS = init_weights(CFG, jax.random.key(0), scale=0.5)


def requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(2, 8) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 24)) for _ in range(n)]


DRAFTERS = drafter_cases()
# Registered drafters whose run here CI leaves to -m slow, with the CI test that covers their contract instead.
SLOW = {
    "eagle3-chain": "the ngram+eagle3 case, whose rows the lookup does not match, drafts with an EAGLE-3 chain",
    "model": "test_a_refilled_slot_samples_exactly_the_targets_distribution: a draft model through refilled slots",
    "layerskip": "the same drafting and state as the model drafter (specjax.drafters.model)",
}


def plain_or(case):
    """Plain decoding (None) or a registered drafter's case."""
    return None if case is None else case.build(WEIGHTS, CFG)


@pytest.mark.parametrize("case", [pytest.param(None, id="plain"), *drafter_params(SLOW)])
def test_greedy_output_through_refilled_slots_equals_each_prompt_alone(case):
    """Plain decoding and every registered drafter (`drafters_fixture`), untrained."""
    name = "plain" if case is None else case.name
    engine = Engine(
        WEIGHTS, CFG, drafter=plain_or(case), num_draft_tokens=3, slots=3, max_context=64, prefill_chunk=8
    )  # prompts of 1 to 4 chunks, prefilled a chunk per round beside running rows
    work = requests(10, seed=len(name))
    rng = random.Random(0)
    ids, completions, streamed = {}, {}, {}
    while work or engine.busy or engine.queued:
        for _ in range(rng.randrange(0, 3)):  # arrivals between steps
            if work:
                prompt, limit = work.pop()
                ids[engine.submit(prompt, limit)] = (prompt, limit)
        for event in engine.step(max_rounds=rng.randrange(1, 5)):
            streamed.setdefault(event.request, []).extend(event.new_ids)
            if event.completion is not None:
                completions[event.request] = event.completion
    assert sorted(completions) == sorted(ids) and engine.busy == 0
    for i, (prompt, limit) in ids.items():
        alone = generate(WEIGHTS, CFG, [prompt], max_new_tokens=limit).completions[0]
        assert completions[i].output_ids == alone.output_ids == streamed[i], (name, prompt, limit)
        assert completions[i].finish_reason == alone.finish_reason
    assert engine.slot_rounds["running"] > 0 and len(engine.runs_by_rows) > 1  # the live bucket grew and shrank
    if name != "plain":
        assert engine.state.accepted_hist[1:].sum() > 0  # drafts were accepted, some rows more than others


@pytest.mark.parametrize("name", ["plain", "eagle3-tree"])
def test_a_seeded_request_samples_the_same_tokens_whoever_shares_the_slots(name, monkeypatch):
    """Temperature 1 (the tree's drafts sampled too): each request's tokens, by its own seed, are those it gets
    alone: from `speculative_generate([prompt], seed=[seed])` with the drafter (the same loop, no engine), from a
    one-slot engine for plain decoding (whose rounds split their keys as the speculative loop does, not as
    `generate`'s steps). Greedy requests between them decode as greedy decoding does, by the greedy program
    wherever every running row is greedy, the sampled one beside sampled rows."""
    hot = SamplingConfig(temperature=1.0)
    drafter = plain_or(DRAFTERS.get(name))
    shared = Engine(WEIGHTS, CFG, drafter=drafter, num_draft_tokens=3, slots=2, max_context=64, sampled=True)
    alone = Engine(WEIGHTS, CFG, drafter=drafter, num_draft_tokens=3, slots=1, max_context=64, sampled=True)
    calls, call = [], shared._call
    monkeypatch.setattr(
        shared, "_call", lambda fn, *args, **static: calls.append((fn, args)) or call(fn, *args, **static)
    )
    work = requests(6, seed=11)
    cold = {shared.submit(p, n): (p, n) for p, n in requests(3, seed=12)}
    ids = {shared.submit(p, n, hot, seed=100 + i): (p, n, 100 + i) for i, (p, n) in enumerate(work)}
    cold |= {shared.submit(p, n): (p, n) for p, n in requests(3, seed=13)}
    done = {e.request: e.completion for e in shared.events(max_rounds=2) if e.completion is not None}
    for i, (prompt, limit) in cold.items():
        assert done[i].output_ids == generate(WEIGHTS, CFG, [prompt], max_new_tokens=limit).completions[0].output_ids
    assert {args[4].greedy for fn, args in calls if fn is engine_module.run} == {True, False}
    for i, (prompt, limit, seed) in ids.items():
        if drafter is None:
            expected = alone.complete([prompt], limit, hot, seeds=[seed])[0].output_ids
        else:
            expected = (
                speculative.speculative_generate(
                    WEIGHTS,
                    CFG,
                    [prompt],
                    drafter=drafter,
                    num_draft_tokens=3,
                    max_new_tokens=limit,
                    sampling=hot,
                    seed=[seed],
                )
                .completions[0]
                .output_ids
            )
        assert done[i].output_ids == expected, (prompt, seed)
    greedy = [generate(WEIGHTS, CFG, [p], max_new_tokens=n).completions[0].output_ids for p, n in work]
    assert [done[i].output_ids for i in ids] != greedy  # sampling, not greedy decoding


def test_a_refilled_slot_samples_exactly_the_targets_distribution():
    """Requests of one prompt share 8 slots with longer requests of other prompts, so nearly every one lands in a
    slot another request left (its cache, drafter state and policy state behind it). Their first two tokens, drafted
    by a small model and verified at temperature 1, follow P(t1, t2 | prompt) enumerated from the target."""
    hot, prompt, samples = SamplingConfig(temperature=1.0), [3, 5], 2048
    drafter = ModelDrafter(init_weights(CFG, jax.random.key(11), scale=0.5), CFG)
    engine = Engine(WEIGHTS, CFG, drafter=drafter, num_draft_tokens=2, slots=8, max_context=64, sampled=True)
    others = requests(samples // 8, seed=3)
    ids = []
    for i in range(samples):
        ids.append(engine.submit(prompt, 2, hot))
        if i % 8 == 0:
            engine.submit(*others[i // 8], hot)
    done = {e.request: e.completion.output_ids for e in engine.events() if e.completion is not None}
    V = CFG.vocab_size
    # A row whose first token is EOS ends there: it counts as (EOS, EOS), where the enumeration puts P(t1 = EOS).
    pairs = np.array([(out + [CFG.eos_token_ids[0]])[:2] for out in (done[i] for i in ids)])
    empirical = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V) / samples

    seqs = jnp.array([prompt + [t] for t in range(V)], jnp.int32)
    logits, _, _ = forward(WEIGHTS, CFG, seqs, jnp.broadcast_to(jnp.arange(3), (V, 3)), KVCache.empty(CFG, V, 3))
    probs = np.asarray(probabilities(logits, Sampling.of(hot)), np.float64)  # [t1, position, V]
    exact = probs[0, 1][:, None] * probs[:, 2]
    eos = CFG.eos_token_ids[0]
    exact[eos] = np.eye(V)[eos] * probs[0, 1, eos]
    bound = 2.0 * 0.5 * np.sum(np.sqrt(2 * exact * (1 - exact) / (np.pi * samples)))  # ~2x sampling noise's TV
    tv = 0.5 * np.abs(empirical - exact).sum()
    assert tv < bound, (tv, bound)
    assert engine.slot_rounds["running"] > 0 and engine.state.accepted_hist[1:].sum() > 0


def test_a_stream_of_requests_compiles_a_few_programs_per_bucket_and_static_batches_idle_more():
    work = requests(12, seed=5)
    prompts, limits = [p for p, _ in work], [n for _, n in work]
    before = batch.compilations()
    refilling = Engine(WEIGHTS, CFG, drafter=NgramDrafter(max_n=2), num_draft_tokens=3, slots=4, max_context=64)
    out = refilling.complete(prompts, limits)
    compiled = {k: n - before.get(k, 0) for k, n in batch.compilations().items() if n != before.get(k, 0)}
    buckets = refilling.buckets
    assert buckets == [1, 2, 4] and compiled.pop("run") == len(refilling.runs_by_rows)  # one per bucket that ran
    assert compiled.pop("insert") <= len(buckets) and compiled.pop("resize") <= len(buckets) * (len(buckets) - 1)
    assert compiled == {"empty_state": 1, "begin": 1, "prefill": 1}
    static = Engine(
        WEIGHTS, CFG, drafter=NgramDrafter(max_n=2), num_draft_tokens=3, slots=4, max_context=64, refill=False
    )
    assert [c.output_ids for c in static.complete(prompts, limits)] == [c.output_ids for c in out]

    assert refilling.idle_share() < static.idle_share()


class RoundClock:
    """A stand-in for the engine's `time`: each round of a run costs `draft_s` seconds where the run drafted, one
    second where it ran plain steps; nothing else takes time. `runs`: each run's way (True drafts) and rounds."""

    def __init__(self, engine: Engine, draft_s: float, monkeypatch):
        self.engine, self.draft_s, self.now, self.rounds, self.ways, self.runs = engine, draft_s, 0.0, 0, [], []
        pick = engine._decoder
        monkeypatch.setattr(engine, "_decoder", lambda rows: self.ways.append(pick(rows)) or self.ways[-1])
        monkeypatch.setattr(engine_module, "time", self)

    def perf_counter(self) -> float:
        rounds, self.rounds = self.rounds, int(self.engine.state.rounds)
        if self.rounds > rounds:
            self.runs.append((self.ways[-1].drafting, self.rounds - rounds))
        self.now += (self.rounds - rounds) * (self.draft_s if self.ways[-1].drafting else 1.0)
        return self.now


@pytest.mark.parametrize("draft_s,drafts", [(5.0, False), (0.5, True)], ids=["drafting-loses", "drafting-wins"])
def test_each_bucket_runs_what_its_timed_runs_show_faster_drafting_or_plain_steps(draft_s, drafts, monkeypatch):
    """A clock that prices a drafting round at 5 plain steps makes drafting lose (a round emits at most 4 tokens a
    row), so the bucket turns to plain steps without the drafter; at half a step drafting wins and goes on. Either
    way the other way is re-checked now and then, within a small share of the time, a drafting run after plain steps
    is one round (it catches the drafter up), and each greedy output is the prompt's alone. What bucket 1 learned of
    the acceptance is every bucket's prior; the costs stay each bucket's own."""
    engine = Engine(
        WEIGHTS,
        CFG,
        drafter=NgramDrafter(max_n=2),
        num_draft_tokens=Adaptive.of([0, 3], [1.0, 1.2]),
        slots=2,
        max_context=64,
    )
    clock = RoundClock(engine, draft_s, monkeypatch)
    for prompt, limit in requests(12, seed=3):  # one at a time: bucket 1
        engine.submit(prompt, limit + 16)
        out = next(e.completion for e in engine.events(max_rounds=4) if e.completion is not None)
        assert out.output_ids == generate(WEIGHTS, CFG, [prompt], max_new_tokens=limit + 16).completions[0].output_ids
    duel = engine.duels[1]
    assert min(duel.seen.values()) >= engine_module.DUEL_EVIDENCE and engine.runs_by_rows.keys() == {1}
    assert (duel.per_token(True) < duel.per_token(False)) is drafts
    tail = clock.ways[len(clock.ways) // 2 :]  # the runs after both ways were timed
    assert sum(d.drafting is not drafts for d in tail) <= 0.1 * len(tail)
    catch_ups = [rounds for (before, _), (drafted, rounds) in zip(clock.runs, clock.runs[1:]) if drafted and not before]
    assert catch_ups and set(catch_ups) == {1}
    one, two = engine.policies[1], engine.policies[2]
    assert np.array_equal(one.prior, two.prior) and not np.allclose(one.prior, 0.6)  # it moved
    assert float(one.track_record.sum()) > 0 and float(two.track_record.sum()) == 0  # a bucket's own calls


def test_a_duel_loses_at_most_its_share_to_re_checks_and_follows_a_change_in_the_traffic():
    """Synthetic runs of 8 tokens, as the engine records them (a drafting run after plain steps catches the drafter up
    and is not counted): drafting at 1.25 s a token against plain steps at 1 s, then the traffic changes and drafting
    costs 0.5 s. Re-checking the slower way loses at most DUEL_SHARE of the time (its first evidence aside); after the
    change the duel turns to drafting within a few re-checks, then re-checks plain steps seldom."""
    duel, cost, drafted = engine_module.Duel(), {True: 1.25, False: 1.0}, True
    spent, lost, ways, drafting_leads = {True: 0.0, False: 0.0}, 0.0, [], []
    for run in range(3000):
        if run == 2000:
            assert lost <= engine_module.DUEL_SHARE * sum(spent.values()) + engine_module.DUEL_EVIDENCE * 0.25
            cost[True] = 0.5
        way = duel.pick()
        if drafted or not way:
            duel.record(way, 8 * cost[way], 1, 8)
        drafted, spent[way], lost = way, spent[way] + 8 * cost[way], lost + 8 * (cost[way] - min(cost.values()))
        ways.append(way)
        drafting_leads.append(run > 16 and duel.per_token(True) < duel.per_token(False))  # both timed by then
    switched = drafting_leads.index(True, 2000)
    assert not any(drafting_leads[:2000]) and switched < 2100 and all(drafting_leads[switched:])
    assert ways[switched:].count(False) <= 0.03 * len(ways[switched:])


def test_rows_that_ran_plain_steps_without_the_drafter_decode_exactly_when_they_draft_again(monkeypatch):
    """Plain steps without the drafter (`speculative.plain_round`) leave its state behind the rows; a row that drafts
    again from there still decodes exactly. Here every other run leaves out an EAGLE-3 head behind
    a lookup (which drafts what it can, the head the rest)."""
    drafter = DRAFTERS["ngram+eagle3"].build(WEIGHTS, CFG)
    engine = Engine(
        WEIGHTS, CFG, drafter=drafter, num_draft_tokens=Adaptive.forcing([0, 3], 1), slots=2, max_context=64
    )
    runs = iter(range(10**6))
    monkeypatch.setattr(
        engine, "_decoder", lambda rows: dataclasses.replace(engine.decoder, drafting=next(runs) % 2 == 0)
    )
    work = requests(6, seed=5)
    ids = [engine.submit(prompt, limit) for prompt, limit in work]
    done = {e.request: e.completion.output_ids for e in engine.events(max_rounds=2) if e.completion is not None}
    for i, (prompt, limit) in zip(ids, work):
        assert done[i] == generate(WEIGHTS, CFG, [prompt], max_new_tokens=limit).completions[0].output_ids
    plain, drafting = engine.state.menu_rounds.tolist()
    assert plain > 0 and drafting > 0 and engine.state.accepted_hist[1:].sum() > 0


def test_a_long_prompt_is_prefilled_a_chunk_per_round_beside_the_running_rows():
    engine = Engine(WEIGHTS, CFG, slots=2, max_context=64, prefill_chunk=8, eos_ids=())
    running = engine.submit([3], 40)
    engine.step(max_rounds=1)
    long = engine.submit([2, 3, 4, 5] * 10, 4)  # 5 chunks of 8
    beside = 0
    while long not in (events := {e.request: e for e in engine.step()}):
        assert len(events[running].new_ids) == 1  # one round between two chunks
        beside += 1
    assert beside == 4  # chunks 1 to 4, each beside a round; the 5th is inserted and runs
    alone = generate(WEIGHTS, CFG, [[2, 3, 4, 5] * 10], max_new_tokens=4, eos_ids=()).completions[0].output_ids
    assert events[long].new_ids == alone[: len(events[long].new_ids)]


def test_bad_requests_are_refused_in_one_line():
    engine = Engine(WEIGHTS, CFG, slots=2, max_context=64)
    for args, needle in [
        (([3] * 60, 10), "exceeds the engine's context of 64 tokens"),
        (([3, 9], 4), "token id 9 is outside the model's vocabulary 0..7"),
        (([], 4), "at least one token"),
        (([3], 0), "max_new_tokens must be >= 1"),
    ]:
        with pytest.raises(InputError, match=needle):
            engine.submit(*args)
    with pytest.raises(InputError, match="sampled=True"):
        engine.submit([3], 4, SamplingConfig(temperature=1.0))
    with pytest.raises(InputError, match="max_context must be in 1..64"):
        Engine(WEIGHTS, CFG, max_context=65)
    assert engine.queued == 0 and engine.busy == 0
