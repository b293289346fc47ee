"""Adaptive drafting: the menu follows the costs and the acceptance (per kind of round), greedy output stays
identical, sampled output keeps the target's distribution with plain steps among the rounds, the prior learns from
earlier calls without compiling again, and calibration is measured once per machine."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.adaptive as adaptive_mod
import specjax.decoding.speculative as spec
from specjax.adaptive import Adaptive, first_pace, paces, rates, soonest_entry, step_pace, tallied
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.autoregressive import generate as ar_generate
from specjax.decoding.batch import pack_prompts, prepare_batch
from specjax.decoding.stats import SpecStats
from specjax.drafters import LookupFirstDrafter, ModelDrafter, NgramDrafter
from specjax.errors import InputError
from specjax.host import machine
from specjax.measure.calibration import calibrated, non_decreasing, useful_entries
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, init_weights
from specjax.sampling import Sampling, probabilities

CFG = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=128, eos_token_ids=(1,))
WEIGHTS = init_weights(CFG, jax.random.key(0), scale=0.3)
# Prompts whose continuations repeat: lookups are often right, so drafting pays in some rows and rounds.
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(10, 31)), [42, 42, 42], [3, 9, 27, 17, 3, 9, 27]]
MAX_NEW = 24
MENU = (0, 1, 2, 3, 5)


def run(cost, prompts=PROMPTS, prior=0.6, sampling=SamplingConfig(), seed=0):
    return spec.speculative_generate(
        WEIGHTS,
        CFG,
        prompts,
        drafter=NgramDrafter(max_n=2),
        num_draft_tokens=Adaptive.of(MENU, cost, prior),
        max_new_tokens=MAX_NEW,
        eos_ids=(),
        sampling=sampling,
        seed=seed,
    )


@pytest.fixture(scope="module")
def ar_batch():
    return [c.output_ids for c in ar_generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=()).completions]


@pytest.mark.parametrize(
    "cost, expect",
    [
        ([1, 50, 60, 70, 90], "plain"),  # drafting never pays: every round is a plain step
        ([9, 1, 1, 1, 1], "deepest"),  # drafts are free and plain steps dear: deep drafts, never a plain step
        ([1, 1.25, 1.45, 1.6, 2.0], "mixed"),  # costs like a CPU's: the size follows the acceptance
    ],
)
def test_greedy_output_is_identical_whatever_the_menu_picks(cost, expect, ar_batch):
    result = run(cost)
    assert [c.output_ids for c in result.completions] == ar_batch
    by_size = result.stats.rounds_by_drafts
    assert list(by_size) == list(MENU) and sum(by_size.values()) == result.stats.rounds
    if expect == "plain":
        assert by_size[0] == result.stats.rounds == MAX_NEW - 1  # one token per round after the prefill's
    elif expect == "deepest":  # (at an acceptance near 0 all depths emit about one token: ties go shallow)
        assert by_size[0] == 0 and by_size[5] > result.stats.rounds / 2
    else:
        assert by_size[0] < result.stats.rounds and sum(1 for r in by_size.values() if r) >= 2


def test_where_drafting_cannot_pay_at_the_prior_plain_decoding_runs_instead_of_the_loop(ar_batch, monkeypatch):
    """drafting_never_pays: the loop itself would take the plain step in every round, so plain decoding replaces it."""
    cost = [1, 50, 60, 70, 90]
    assert adaptive_mod.drafting_never_pays(Adaptive.of(MENU, cost), [0, 1, 2, 3, 5])
    assert not adaptive_mod.drafting_never_pays(Adaptive.of(MENU, [1, 1.25, 1.45, 1.6, 2.0]), [0, 1, 2, 3, 5])
    assert not adaptive_mod.drafting_never_pays(Adaptive.of((1, 2), [1.0, 1.2]), [1, 2])  # 0.63 steps a token: it pays
    # The loop's plain step costs 1.3 plain decoding steps (its bookkeeping): at the prior (E = 1.96 tokens for 2
    # drafts) the loop would draft, but a round of 2.2 steps is 1.12 a token, so plain decoding beats it.
    prior_pace = jnp.array([2.2 / 1.96])
    assert (
        int(soonest_entry(Adaptive.of((0, 2), [1.3, 2.2]), [0, 2], jnp.array([0.6]), prior_pace, jnp.array([100]))) == 1
    )
    assert adaptive_mod.drafting_never_pays(Adaptive.of((0, 2), [1.3, 2.2]), [0, 2])
    assert adaptive_mod.drafting_never_pays(Adaptive.of((2,), [2.2]), [2])  # likewise without a plain step in the menu
    assert not adaptive_mod.drafting_never_pays(Adaptive.of((0, 2), [1.3, 1.8]), [0, 2])  # 0.92 a token: the loop pays
    monkeypatch.setattr(Adaptive, "never_drafts", lambda *args: False)
    looped = run(cost)
    assert looped.stats.rounds_by_drafts == {0: MAX_NEW - 1, 1: 0, 2: 0, 3: 0, 5: 0}  # the premise, in the loop
    monkeypatch.undo()

    def no_loop(*args, **kwargs):
        raise AssertionError("the speculative loop ran")

    monkeypatch.setattr(spec, "speculative_decode", no_loop)
    result = run(cost)
    assert [c.output_ids for c in result.completions] == ar_batch
    assert result.stats.rounds_by_drafts == looped.stats.rounds_by_drafts
    assert result.stats.rounds == looped.stats.rounds and result.stats.mean_accepted == 1.0


def test_a_menu_of_plain_steps_alone_is_plain_decoding(ar_batch):
    """Calibration keeps only plain steps where drafting never pays: plain decoding then runs."""
    result = spec.speculative_generate(
        WEIGHTS,
        CFG,
        PROMPTS,
        drafter=NgramDrafter(max_n=2),
        num_draft_tokens=Adaptive.of((0,), [1.0]),
        max_new_tokens=MAX_NEW,
        eos_ids=(),
    )
    assert [c.output_ids for c in result.completions] == ar_batch
    assert result.stats.rounds_by_drafts == {0: MAX_NEW - 1}


def test_the_choice_follows_the_measured_acceptance():
    """Over 64 new tokens, the target drafting for itself (every draft accepted) climbs to the deepest entry (near
    its end, a shallower one emits what is left); an unrelated model of the same shape (first drafts mostly wrong)
    settles on the shallowest."""
    menu = Adaptive.of((1, 2, 3, 5), [1.25, 1.45, 1.6, 2.0])

    def favourite(draft_weights):
        result = spec.speculative_generate(
            WEIGHTS,
            CFG,
            PROMPTS,
            drafter=ModelDrafter(draft_weights, CFG),
            num_draft_tokens=menu,
            max_new_tokens=64,
            eos_ids=(),
        )
        return max(result.stats.rounds_by_drafts.items(), key=lambda kv: kv[1])[0]

    assert favourite(WEIGHTS) == 5
    assert favourite(init_weights(CFG, jax.random.key(1), scale=0.3)) == 1


def test_the_cache_is_not_copied_through_the_switch():
    """With two menu entries the compiled loop copies the target cache as often as with one (only where it is made):
    a round only reads it, and the loop writes the accepted path after `lax.switch`. Written inside the branches, it
    was copied in and out of them every round, which cost about 0.4 of a plain step at batch 8."""
    req = prepare_batch(CFG, PROMPTS, MAX_NEW, (), None, SamplingConfig())

    def cache_copies(menu: Adaptive) -> int:
        args = (
            WEIGHTS,
            NgramDrafter(max_n=2),
            menu,
            jnp.asarray(req.tokens),
            jnp.asarray(req.lengths),
            jnp.asarray(req.max_new),
            req.keys,
            req.sampling,
            jnp.asarray(req.active),
        )
        hlo = spec.speculative_decode.lower(*args, cfg=CFG, eos_ids=(), prefill_chunk=64)
        slots = req.tokens.shape[1] + max(menu.menu) + 1  # the cache's: S, and a round's draft
        cache = f"f32[{CFG.num_layers},{len(PROMPTS)},{slots},{CFG.num_kv_heads},{CFG.head_dim}]"
        return len(re.findall(rf"= {re.escape(cache)}{{[^}}]*}} copy\(", hlo.compile().as_text()))

    assert cache_copies(Adaptive.of((0, 5), [1.0, 1.5])) == cache_copies(Adaptive.of((0,), [1.0])) <= 2  # k and v


def test_sampled_output_keeps_the_target_distribution_with_plain_steps_among_the_rounds():
    """Exact enumeration on an 8-token model: after a first round of two drafts, the measured acceptance sends the
    rows to plain steps; the first three tokens are distributed as target sampling."""
    toy = ModelConfig("llama", 8, 16, 32, 2, 2, 1, 8, max_position_embeddings=64)
    weights = init_weights(toy, jax.random.key(10), scale=0.5)
    prompt, samples, V = [3, 5], 32768, 8
    sampling = SamplingConfig(temperature=1.0)
    menu = Adaptive.of((0, 2), [1.0, 1.9])  # at the prior 0.6 two drafts pay (1.96 / 1.9 > 1); below ~0.58 not
    tokens, lengths = pack_prompts([prompt], 1, toy.max_position_embeddings)
    out = spec.speculative_decode(
        weights,
        NgramDrafter(max_n=1),
        menu,
        tokens,
        lengths,
        np.full(samples, 4, np.int32),
        jax.random.split(jax.random.key(0), samples),
        Sampling.of(sampling),
        cfg=toy,
        eos_ids=(),
        num_samples=samples,
        prefill_chunk=2,
    )
    by_entry = np.asarray(out.state.menu_rounds)
    assert by_entry[0] > 0 and by_entry[1] > 0  # both kinds of round ran
    t1, t2 = np.meshgrid(np.arange(V), np.arange(V), indexing="ij")
    seqs = np.stack([np.full(V * V, prompt[0]), np.full(V * V, prompt[1]), t1.ravel(), t2.ravel()], 1)
    logits = forward(
        weights,
        toy,
        jnp.asarray(seqs, jnp.int32),
        jnp.broadcast_to(jnp.arange(4), seqs.shape),
        KVCache.empty(toy, len(seqs), 4),
    )[0]
    probs = np.asarray(probabilities(logits, Sampling.of(sampling)), np.float64).reshape(V, V, 4, V)
    exact = probs[0, 0, 1][:, None, None] * probs[:, 0, 2][:, :, None] * probs[:, :, 3]
    flat = np.asarray(out.out_bn)[:, :3] @ np.array([V * V, V, 1])
    empirical = np.bincount(flat, minlength=V**3).reshape(V, V, V) / samples
    bound = np.sum(np.sqrt(2 * exact * (1 - exact) / (np.pi * samples)))  # about twice the noise alone
    assert 0.5 * np.abs(empirical - exact).sum() < bound


def test_a_batch_drafts_as_deep_as_its_slowest_row_gains():
    """A round costs its entry and leaves each row its remaining tokens less those the round is expected to emit,
    which take the row its pace (steps per token so far): the entry that ends the batch soonest wins. A row that
    accepts nothing makes drafting useless for the batch however well the others accept; a finished row, or one near
    its end, does not hold the batch back; a row that accepts nothing in this kind of round but has been fast
    (copied text elsewhere) lets the batch draft deep for a slower one. A row's last token takes a whole round,
    however fast its pace."""
    menu, depths, rate = Adaptive.of((0, 5), [1.0, 1.5]), [0, 5], jnp.array([0.9, 0.0])
    pace = jnp.array([1.5 / 4.69, 1.0])  # each row's best entry at its rate: 5 drafts (E = 4.69), plain steps
    assert int(soonest_entry(menu, depths, rate, pace, jnp.array([100, 100]))) == 0
    assert (
        int(soonest_entry(menu, depths, rate[:1], pace[:1], jnp.array([100]))) == 1
    )  # alone, the row that accepts drafts
    assert int(soonest_entry(menu, depths, rate, pace, jnp.array([100, 0]))) == 1  # the other row is done
    assert (
        int(soonest_entry(menu, depths, rate, pace, jnp.array([100, 2]))) == 1
    )  # 2 tokens to go: 100 x 0.32 is longer
    assert int(soonest_entry(menu, depths, rate, jnp.array([0.6, 0.3]), jnp.array([100, 100]))) == 1
    assert int(soonest_entry(menu, depths, rate[:1], pace[:1], jnp.array([1]))) == 0  # its last token: no drafts
    # 2 tokens to go at 0.32 steps a token: a plain step leaves one, which still takes a whole round (1 + 1 > 1.5)
    assert int(soonest_entry(menu, depths, rate[:1], pace[:1], jnp.array([2]))) == 1


def test_a_rows_pace_starts_at_the_prior_and_follows_its_rounds():
    """The pace starts at the best entry's steps per token at the prior (counted as ROW_PRIOR_WEIGHT = 4 tokens);
    each round keeps PACE_MEMORY = 0.95 of a running row's (steps, tokens) and adds its cost and the row's tokens."""
    menu = Adaptive.of((0, 2), [1.0, 1.5], prior=0.5)  # 2 drafts at 0.5: 1.75 tokens for 1.5 steps
    start = first_pace(menu, [0, 2], 2)
    assert np.allclose(start, [[4 * 1.5 / 1.75, 4]] * 2) and np.allclose(paces(start), 1.5 / 1.75)
    moved = step_pace(start, jnp.float32(1.5), jnp.array([3, 1]), jnp.array([True, False]))
    assert np.allclose(moved, [[0.95 * 4 * 1.5 / 1.75 + 1.5, 0.95 * 4 + 3], start[1]])


def test_prompt_lookup_tells_rounds_apart_by_the_tail_it_matched():
    tokens = jnp.asarray([[5, 6, 7, 5, 6, 0], [1, 2, 3, 0, 0, 0], [1, 2, 1, 0, 0, 0]], jnp.int32)
    lengths = jnp.asarray([5, 3, 3], jnp.int32)
    assert NgramDrafter(max_n=2).traits.regimes == 3
    assert NgramDrafter(max_n=2).regime((), tokens, lengths).tolist() == [2, 0, 1]  # "5 6" recurs, nothing, "1"
    lookup_first = LookupFirstDrafter(NgramDrafter(max_n=1), n=2)
    assert lookup_first.traits.regimes == 2 and lookup_first.regime((), tokens, lengths).tolist() == [1, 0, 0]
    assert ModelDrafter(WEIGHTS, CFG).regime((), tokens, lengths).tolist() == [0, 0, 0]  # one kind of round


def test_a_round_moves_the_tally_of_each_rows_kind_alone():
    """Each row's estimate is its tally (accepted, tried) pooled with the prior as ROW_PRIOR_WEIGHT = 4 depths; a
    round keeps ROW_MEMORY = 0.8 of the tally of each running row's kind and adds its counts, a plain step only
    forgets."""
    menu = Adaptive.of((0, 3), [1.0, 1.5], prior=0.6, regimes=2)
    tally = jnp.asarray([[[1.0, 2.0], [5.0, 6.0]]] * 3)
    assert np.allclose(rates(menu, tally)[0], [(2.4 + 1) / 6, (2.4 + 5) / 10])
    regime, running = jnp.asarray([0, 1, 1]), jnp.asarray([True, True, False])
    drafted = tallied(tally, regime, 3, jnp.asarray([3, 0, 0]), running)  # counts (3, 3) and (0, 1)
    assert np.allclose(drafted, [[[3.8, 4.6], [5, 6]], [[1, 2], [4, 5.8]], [[1, 2], [5, 6]]])
    plain = tallied(tally, regime, 0, jnp.zeros(3, jnp.int32), running)
    assert np.allclose(plain, [[[0.8, 1.6], [5, 6]], [[1, 2], [4, 4.8]], [[1, 2], [5, 6]]])
    rejected_first = rates(menu, tallied(jnp.zeros((1, 2, 2)), regime[:1], 5, jnp.asarray([0]), running[:1]))
    assert np.isclose(rejected_first[0, 0], 2.4 / 5)  # one failed depth, not a rate of 0


def test_the_loop_counts_the_depths_it_tried_and_accepted():
    """A round of K drafts in which a row accepted n tried min(n + 1, K) of them: summed over the kinds of round, the
    loop's counts agree with its histogram of accepted drafts."""
    kw = dict(drafter=NgramDrafter(max_n=2), max_new_tokens=MAX_NEW, eos_ids=())
    for entry, k in ((1, 1), (3, 3)):
        stats = spec.speculative_generate(
            WEIGHTS, CFG, PROMPTS, num_draft_tokens=Adaptive.forcing(MENU, entry, 3), **kw
        ).stats
        hist = stats.accepted_histogram
        accepted, tried = np.sum(stats.acceptance_evidence, axis=0)
        assert len(stats.acceptance_evidence) == 3 and sum(hist) >= stats.rounds > 0  # rows still running
        assert accepted == sum(n * h for n, h in enumerate(hist)) > 0
        assert tried == sum(min(n + 1, k) * h for n, h in enumerate(hist))


def test_the_prior_and_the_track_record_learn_from_earlier_calls_without_compiling_again(ar_batch):
    """`learn` pools each kind's depths tried and accepted with the prior (counted as PRIOR_WEIGHT = 20 depths), and
    adds the call's plain decoding steps and the cost of its rounds (none under a plain step's) to the track record;
    both are data, so the next call reuses the executable. A loop that did not beat plain decoding, or a drafter that
    is never right, is then not run at all."""
    menu = Adaptive.of((0, 1, 2), [0.9, 1.2, 1.4], prior=0.6, regimes=2)

    def call(evidence, rounds, plain_steps):
        stats = SpecStats.from_histogram(sum(rounds), [1], 1, 1.0)
        return dataclasses.replace(
            stats, acceptance_evidence=evidence, rounds_by_drafts=dict(zip(menu.menu, rounds)), plain_steps=plain_steps
        )

    learned = menu.learn(call([(2, 10), (0, 0)], [4, 3, 3], 12))
    assert np.allclose(learned.prior, [(12 + 2) / 30, 0.6]) and np.allclose(learned.seen, [10, 0])
    assert np.allclose(learned.track_record, [12, 4 * 1.0 + 3 * 1.2 + 3 * 1.4])  # 12 steps against 11.8: it paid
    assert not adaptive_mod.drafting_never_pays(learned, [0, 1, 2])
    again = learned.learn(call([(0, 10), (0, 0)], [10, 0, 0], 9))  # plain steps alone: 10 against 9 steps
    assert np.allclose(again.prior, [(12 + 2) / 40, 0.6])  # pooled: 2 of 20 tried
    assert np.allclose(again.track_record, [21, 21.8]) and adaptive_mod.drafting_never_pays(again, [0, 1, 2])
    assert again.summary() == {"prior": [0.35, 0.6], "cost": {0: 0.9, 1: 1.2, 2: 1.4}, "loop_gain": round(21 / 21.8, 3)}
    assert menu.learn(call([], [5, 0, 0], 5)) is menu  # plain decoding ran: nothing tried, no loop

    kw = dict(drafter=NgramDrafter(max_n=2), max_new_tokens=MAX_NEW, eos_ids=())
    menu = Adaptive.of(MENU, [1, 1.25, 1.45, 1.6, 2.0], regimes=3)
    first = spec.speculative_generate(WEIGHTS, CFG, PROMPTS, num_draft_tokens=menu, **kw)
    menu = menu.learn(first.stats)
    assert not np.allclose(menu.prior, 0.6)
    second = spec.speculative_generate(WEIGHTS, CFG, PROMPTS, num_draft_tokens=menu, **kw)
    assert second.compile_seconds == 0 and [c.output_ids for c in second.completions] == ar_batch

    wrong = ModelDrafter(init_weights(CFG, jax.random.key(1), scale=0.3), CFG)  # an unrelated model
    menu = Adaptive.of((1, 2), [1.2, 1.5])  # a round of 1 draft at the prior 0.6: 0.75 steps a token
    assert not adaptive_mod.drafting_never_pays(menu, [1, 2])
    for _ in range(3):
        menu = menu.learn(
            spec.speculative_generate(
                WEIGHTS, CFG, PROMPTS, drafter=wrong, num_draft_tokens=menu, max_new_tokens=MAX_NEW, eos_ids=()
            ).stats
        )
    assert adaptive_mod.drafting_never_pays(menu, [1, 2]) and float(menu.prior[0]) < 0.2


def test_calibration_times_each_entry_alone_in_the_loop_decoding_compiles(monkeypatch):
    """`Adaptive.forcing` prices out every entry but one; the costs are data, so one executable runs each entry."""
    monkeypatch.setattr(Adaptive, "never_drafts", lambda *args: False)  # the forced plain step runs in the loop too
    kw = dict(drafter=NgramDrafter(max_n=2), max_new_tokens=MAX_NEW, eos_ids=())
    results = [
        spec.speculative_generate(WEIGHTS, CFG, PROMPTS, num_draft_tokens=Adaptive.forcing(MENU, e), **kw)
        for e in range(5)
    ]
    for k, result in zip(MENU, results):
        assert result.stats.rounds_by_drafts[k] == result.stats.rounds > 0
        assert sum(result.stats.rounds_by_drafts.values()) == result.stats.rounds
    assert all(result.compile_seconds == 0 for result in results[1:])  # compiled at most once, for the first


def test_only_entries_that_can_win_are_kept():
    assert useful_entries((0, 1, 2), (0, 1, 2), [1.0, 5.0, 1.2]) == [0, 2]  # one draft never beats both
    assert useful_entries((0, 3), (0, 3), [1.0, 1.5]) == [0, 1]
    assert useful_entries((0, 1, 3), (0, 1, 3), [1.0, 5.0, 4.5]) == [0, 2]  # neither wins, but the deepest stays:
    # a round of it is timed, which corrects an estimate that was too high


def test_measured_costs_are_fitted_non_decreasing():
    assert non_decreasing([1.0, 1.3, 1.5]) == [1.0, 1.3, 1.5]  # already in order: kept
    assert non_decreasing([0.94, 1.26, 1.18, 1.36, 1.51, 1.41]) == pytest.approx([0.94, 1.22, 1.22, 1.36, 1.46, 1.46])
    assert non_decreasing([2.0, 1.0, 0.0]) == pytest.approx([1.0, 1.0, 1.0])  # one pool: the mean


def test_calibration_is_measured_once_per_machine_batch_and_menu_then_read(tmp_path, monkeypatch):
    """Seconds of a plain step, of the prefill per token and of each entry's round; costs in plain steps; keyed by
    what changes them (the batch, XLA's flags), not by the prompt or the tokens to generate."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    drafter = NgramDrafter(max_n=2)
    kw = dict(batch=2, sampling=SamplingConfig())
    first = calibrated(WEIGHTS, CFG, drafter, 5, **kw)
    (record,) = tmp_path.glob("calibration/*.json")
    measured = json.loads(record.read_text())
    timed = measured["value"]
    assert measured["menu"] == [0, 1, 2, 3, 5] and len(timed["round_s"]) == 5
    assert timed["round_s"][0] == timed["step_s"] > 0 and min(timed["round_s"]) >= timed["step_s"]
    assert first.menu and set(first.menu) <= set(measured["menu"]) and first.menu[-1] == 5  # the deepest stays
    assert np.allclose(first.clock, [timed["step_s"], timed["prefill_token_s"]])
    import specjax.measure.calibration as calibration

    def measured_again(*a, **k):
        raise RuntimeError("measured again")

    monkeypatch.setattr(calibration, "interleaved_medians", measured_again)
    again = calibrated(WEIGHTS, CFG, drafter, 5, **kw)
    assert again.menu == first.menu and np.allclose(again.cost, first.cost)
    with pytest.raises(RuntimeError, match="measured again"):  # another batch size is another cost: measured
        calibrated(WEIGHTS, CFG, drafter, 5, batch=3, sampling=SamplingConfig())
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    with pytest.raises(RuntimeError, match="measured again"):  # so is another XLA setting
        calibrated(WEIGHTS, CFG, drafter, 5, **kw)


def timed_call(rounds: dict, seconds: float, evidence=((0.0, 1.0),), plain_steps: int = 60, prompt_tokens: int = 64):
    """The statistics `learn` reads of a call that ran `rounds` of each menu entry in `seconds`."""
    stats = SpecStats.from_histogram(sum(rounds.values()), [1], 1, seconds)
    return dataclasses.replace(
        stats,
        rounds_by_drafts=rounds,
        acceptance_evidence=list(evidence),
        plain_steps=plain_steps,
        prompt_tokens=prompt_tokens,
    )


def test_measured_costs_are_checked_by_a_drafting_call_then_follow_the_timed_rounds():
    """Estimates 3x too high would keep every round plain, so nothing would ever time a drafting round: until one is
    timed, drafting entries are priced at one plain step and the first call drafts. Its wall time, less the prefill,
    against its rounds' estimates moves the costs; an entry that did not run moves with it."""
    step_s, token_s = 0.01, 0.001
    menu = Adaptive.of((0, 2, 5), [1.0, 3.3, 4.5], clock=(step_s, token_s))  # the rounds truly cost 1.1 and 1.5
    depths = [0, 2, 5]
    assert np.allclose(menu.prices, [1.0, 1.0, 1.0]) and not adaptive_mod.drafting_never_pays(menu, depths)
    assert adaptive_mod.drafting_never_pays(
        Adaptive.of((0, 2, 5), [1.0, 3.3, 4.5]), depths
    )  # given costs: taken as given
    prefill_s = step_s + 63 * token_s
    learned = menu.learn(timed_call({0: 0, 2: 0, 5: 20}, prefill_s + 20 * 1.5 * step_s))
    assert np.allclose(learned.cost, [1.0, 1.1, 1.5], rtol=1e-5) and np.allclose(learned.timed, [0, 0, 20])
    assert np.allclose(learned.prices, learned.cost)  # checked: the costs as they are
    assert np.allclose(learned.track_record, [60, 30], rtol=1e-5)  # 60 plain steps' tokens in 30 steps' time
    steady = learned.learn(timed_call({0: 4, 2: 10, 5: 10}, prefill_s + (4 * 1.0 + 10 * 1.1 + 10 * 1.5) * step_s))
    assert np.allclose(steady.cost, learned.cost, rtol=1e-4)  # rounds that cost what was estimated: no change
    slower = learned.learn(timed_call({0: 0, 2: 0, 5: 20}, prefill_s + 20 * 2.0 * step_s))
    assert slower.cost[2] == pytest.approx(1.5 * (2.0 / 1.5) ** 0.5, rel=1e-4)  # half its rounds say 2.0
    assert slower.cost[1] == pytest.approx(1.1 * 2.0 / 1.5, rel=1e-5)  # never run itself: it follows the call
    wild = menu.learn(timed_call({0: 0, 2: 0, 5: 20}, 1000.0))
    assert wild.cost[2] == pytest.approx(4.5 * adaptive_mod.MAX_RETIME)  # one call moves a cost 4x at most
    plain = menu.learn(timed_call({0: 60, 2: 0, 5: 0}, prefill_s + 60 * 2 * step_s, evidence=()))
    assert plain.clock[0] == pytest.approx(step_s * 2**0.5) and np.allclose(plain.cost, menu.cost)  # the unit


# The first call's choice is deterministic; how the learned costs move depends on this machine's timing of the call,
# so that part runs with -m slow (the arithmetic of learning is checked without a clock above).
@pytest.mark.parametrize("timed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_costs_cached_10x_too_high_still_draft_in_the_first_call_and_move_toward_its_rounds(
    tmp_path, monkeypatch, timed
):
    """Timed for real: 10x leaves room for a machine that slows down between the calibration and the call."""
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    drafter, kw = NgramDrafter(max_n=2), dict(batch=len(PROMPTS), sampling=SamplingConfig())
    honest = calibrated(WEIGHTS, CFG, drafter, 5, **kw)
    (record,) = tmp_path.glob("calibration/*.json")
    measured = json.loads(record.read_text())
    first, *drafting = measured["value"]["round_s"]
    measured["value"]["round_s"] = [first] + [10 * s for s in drafting]
    record.write_text(json.dumps(measured))
    menu = calibrated(WEIGHTS, CFG, drafter, 5, **kw)
    # The deepest entry stays, priced far above its honest cost (a middle one it now dominates may drop out).
    assert menu.menu[-1] == honest.menu[-1] and menu.cost[-1] > 5 * honest.cost[-1]
    out = spec.speculative_generate(
        WEIGHTS, CFG, PROMPTS, drafter=drafter, num_draft_tokens=menu, max_new_tokens=MAX_NEW, eos_ids=()
    )
    assert sum(r for k, r in out.stats.rounds_by_drafts.items() if k) > 0  # drafted
    if timed:
        learned = menu.learn(out.stats)
        assert all(learned.cost[1:] < menu.cost[1:])  # toward the rounds as timed


def test_the_machine_key_names_the_cpu_model_and_its_vector_extensions(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    for flags, isa in (
        ("fpu sse2 avx avx2 fma", "avx2"),
        ("avx avx2 avx512f avx512bw avx512_bf16", "avx2,avx512f,avx512_bf16"),
    ):
        cpuinfo.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\n")
        assert machine(str(cpuinfo)) == f"cpu:AMD EPYC:{os.cpu_count()}:{isa}"


def test_bad_menus_are_refused():
    for menu, cost in [((2, 1), [1, 1]), ((0, 0), [1, 1]), ((0, 1), [1]), ((0, 1), [1, float("nan")]), ((), [])]:
        with pytest.raises(InputError):
            Adaptive.of(menu, cost)
    with pytest.raises(InputError, match="cannot follow plain decoding steps"):
        spec.check_inputs(CFG, ModelDrafter(WEIGHTS, CFG), Adaptive.of((0, 2), [1, 1.5]))
    with pytest.raises(InputError, match="priors for 2 kinds of round, the drafter tells 3 apart"):
        spec.check_inputs(CFG, NgramDrafter(max_n=2), Adaptive.of((0, 2), [1, 1.5], regimes=2))
