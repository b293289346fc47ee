"""The speculative loop on tiny random models: greedy identity with autoregressive decoding for every drafter,
the target distribution at temperature > 0 (and a broken rule that misses it), cache state, tracing, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters_fixture import drafter_params

import specjax.decoding.speculative as spec
from specjax.adaptive import Fixed
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding import acceptance
from specjax.decoding.autoregressive import generate as ar_generate
from specjax.decoding.batch import pack_prompts
from specjax.decoding.stats import SpecResult
from specjax.drafters import ChainDrafter, LayerSkipDrafter, ModelDrafter, NgramDrafter
from specjax.drafters.tree import DraftTree
from specjax.errors import InputError
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, init_weights
from specjax.sampling import Sampling, probabilities

CFG = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=128, eos_token_ids=(1,))
WEIGHTS = init_weights(CFG, jax.random.key(0), scale=0.3)
OTHER = init_weights(CFG, jax.random.key(1), scale=0.3)  # an unrelated draft model: its first draft is mostly wrong
PROMPTS = [[5, 6, 7], list(range(10, 31)), [42], [3, 9, 27, 17, 51, 25, 11]]
MAX_NEW = 20

DRAFTERS = {
    "ngram": NgramDrafter(max_n=2),
    "layerskip": LayerSkipDrafter(WEIGHTS, CFG, 1),
    "same_model": ModelDrafter(WEIGHTS, CFG),  # every draft is accepted
    "other_model": ModelDrafter(OTHER, CFG),  # shares the compilation of same_model and of the registered model drafter
}


def outputs(result):
    return [c.output_ids for c in result.completions]


def row_keys(seed, rows):
    """Typed PRNG keys [rows], one per row."""
    return jax.random.split(jax.random.key(seed), rows)


@pytest.fixture(scope="module")
def ar_batch():
    return outputs(ar_generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=()))


def check_greedy_batch_identical_to_autoregressive(drafter, k: int, expected) -> SpecResult:
    """Greedy speculative decoding of PROMPTS with `drafter` drafting K (or its own tree) gives `expected`, plain
    greedy decoding's tokens, with a histogram of 0..depth accepted drafts. Returns the result."""
    result = spec.speculative_generate(
        WEIGHTS, CFG, PROMPTS, drafter=drafter, num_draft_tokens=k, max_new_tokens=MAX_NEW, eos_ids=()
    )
    assert outputs(result) == expected
    depth = drafter.draft_shape(k).depth
    assert len(result.stats.accepted_histogram) == depth + 1 and len(result.stats.acceptance_by_position) == depth
    return result


# Registered drafters whose case here CI leaves to -m slow, with the CI test that checks the same identity.
SLOW = {
    "eagle3-chain": "test_eagle3_decoding.py::test_greedy_batch_identical_to_autoregressive[chain]",
    "eagle3-tree": "test_eagle3_decoding.py::test_greedy_batch_identical_to_autoregressive[tree]",
    "ngram+eagle3": "test_eagle3_decoding.py::test_greedy_batch_identical_to_autoregressive[lookup]",
    "dflash": "test_dflash.py::test_greedy_identical_to_autoregressive_with_a_fresh_context_cache",
}


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("case", drafter_params(SLOW))
def test_greedy_batch_identical_to_autoregressive(case, k, ar_batch):
    """Every registered drafter (`drafters_fixture`), untrained, on this target: at K = 1 (a single draft) and 5; a
    tree drafter at its own tree, once."""
    drafter = case.build(WEIGHTS, CFG)
    if case.tree is not None and k != 1:
        pytest.skip("a tree's round is its own whatever K is: run once")
    if k > (drafter.traits.max_draft_tokens or k):
        pytest.skip(f"{case.name} drafts at most {drafter.traits.max_draft_tokens} tokens a round")
    check_greedy_batch_identical_to_autoregressive(drafter, k, ar_batch)


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_greedy_with_the_target_as_its_own_draft_model_accepts_every_draft_and_with_another_model_few(k, ar_batch):
    result = check_greedy_batch_identical_to_autoregressive(DRAFTERS["same_model"], k, ar_batch)
    hist = result.stats.accepted_histogram
    assert hist[:k] == [0] * k and result.stats.mean_accepted == k + 1
    assert result.stats.rounds == -(-(MAX_NEW - 1) // (k + 1))
    other = check_greedy_batch_identical_to_autoregressive(DRAFTERS["other_model"], k, ar_batch)
    hist = other.stats.accepted_histogram
    assert hist[0] > sum(hist) / 2  # another model's first draft is mostly rejected, and the output still identical


@pytest.mark.parametrize("name", ["ngram", "layerskip", "other_model"])
def test_greedy_batch_of_one_identical_to_autoregressive(name, ar_batch):
    kw = dict(drafter=DRAFTERS[name], num_draft_tokens=5, max_new_tokens=MAX_NEW, eos_ids=())
    alone_hist = np.zeros(6, np.int64)
    for prompt, expected in zip(PROMPTS, ar_batch):
        result = spec.speculative_generate(WEIGHTS, CFG, [prompt], **kw)
        assert outputs(result) == [expected]
        alone_hist += result.stats.accepted_histogram
    # Acceptance is per row: a batch's row-round histogram is the sum of its prompts' histograms alone.
    assert list(alone_hist) == spec.speculative_generate(WEIGHTS, CFG, PROMPTS, **kw).stats.accepted_histogram


def test_rows_stop_at_eos_and_limit_independently(ar_batch):
    eos = ar_batch[1][3]  # a token row 1 emits mid-way; other rows may emit it too, or never
    ar = outputs(ar_generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=[eos]))
    # Every draft is accepted, so EOS often lands inside an accepted run: the row is cut right after it.
    result = spec.speculative_generate(
        WEIGHTS, CFG, PROMPTS, drafter=DRAFTERS["same_model"], num_draft_tokens=5, max_new_tokens=MAX_NEW, eos_ids=[eos]
    )
    assert outputs(result) == ar
    for c in result.completions:
        assert c.finish_reason == ("stop" if eos in c.output_ids else "length")
        assert eos not in c.output_ids[:-1] and len(c.output_ids) <= MAX_NEW
    assert len(ar[1]) == 4


def test_cache_equals_fresh_prefill_and_traces_once(monkeypatch):
    traces = []
    original = spec.begin_prefill
    monkeypatch.setattr(spec, "begin_prefill", lambda *a, **k: traces.append(1) or original(*a, **k))
    spec.speculative_decode.clear_cache()
    sampling = Sampling.of(SamplingConfig(temperature=1.0, top_k=20), 4)
    drafter = DRAFTERS["other_model"]
    tokens, lengths = pack_prompts(PROMPTS, 4, 128)
    limits = np.full(4, 15, np.int32)
    static = dict(cfg=CFG, eos_ids=(), prefill_chunk=8)
    first = spec.speculative_decode(
        WEIGHTS, drafter, Fixed(3), tokens, lengths, limits, row_keys(0, 4), sampling, **static
    )
    # Other prompts and limits, and other sampling values in every row (mixed, one greedy): the same executable.
    tokens2, lengths2 = pack_prompts(PROMPTS[::-1], 4, 128)
    mixed = [SamplingConfig(0.7, 5, 0.9), SamplingConfig(), SamplingConfig(1.5), SamplingConfig(1.0, top_p=0.5)]
    spec.speculative_decode(
        WEIGHTS, drafter, Fixed(3), tokens2, lengths2, limits - 2, row_keys(1, 4), Sampling.of(mixed, 4), **static
    )
    assert len(traces) == 1

    state = first.state
    hist = np.asarray(state.accepted_hist)
    assert hist[0] > 0 and hist[1:].sum() > 0  # both rejections and acceptances happened
    length = np.asarray(state.length_b)
    assert np.all(length == lengths + 15) and np.all(np.asarray(state.cache.lengths) == length - 1)
    committed = np.asarray(state.tokens_bs)[:, : length.max() - 1]
    B, T = committed.shape
    _, _, fresh = forward(
        WEIGHTS, CFG, jnp.asarray(committed), jnp.broadcast_to(jnp.arange(T), (B, T)), KVCache.empty(CFG, B, T)
    )
    for b in range(B):
        n = length[b] - 1
        np.testing.assert_allclose(state.cache.k[:, b, :n], fresh.k[:, b, :n], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(state.cache.v[:, b, :n], fresh.v[:, b, :n], rtol=1e-4, atol=1e-5)


def test_generate_reuses_the_executable():
    kw = dict(drafter=DRAFTERS["ngram"], num_draft_tokens=3, max_new_tokens=6)
    first = spec.speculative_generate(WEIGHTS, CFG, PROMPTS, seed=0, sampling=SamplingConfig(0.8), **kw)
    second = spec.speculative_generate(
        WEIGHTS, CFG, PROMPTS[::-1], seed=1, sampling=SamplingConfig(0.3, top_p=0.9), **kw
    )
    again = spec.speculative_generate(WEIGHTS, CFG, PROMPTS, seed=0, sampling=SamplingConfig(0.8), **kw)
    assert second.compile_seconds == 0 and again.compile_seconds == 0  # a new temperature compiles nothing
    assert outputs(again) == outputs(first)
    assert first.stats.tokens_per_s > 0 and first.stats.rounds >= 1


# CI: the n-gram drafter; plain decoding's seeds are tested in test_generate.py and every drafter's through shared
# slots in test_engine.py.
@pytest.mark.parametrize(
    "name",
    [pytest.param("plain", marks=pytest.mark.slow), "ngram", pytest.param("other_model", marks=pytest.mark.slow)],
)
def test_a_seeded_prompt_samples_the_same_tokens_in_any_batch(name):
    """Every row draws from a key of its own: a prompt with its seed samples the same tokens alone, among other
    prompts in any order, and with padding rows; the same call again gives them again; other seeds give others. One
    int seed keys prompt i by its index."""
    prompts, seeds = [PROMPTS[0], PROMPTS[1], PROMPTS[3]], [11, 22, 33]

    def run(prompts, seed, **kw):
        kw = dict(max_new_tokens=MAX_NEW, sampling=SamplingConfig(temperature=1.0), seed=seed, eos_ids=()) | kw
        if name == "plain":
            return outputs(ar_generate(WEIGHTS, CFG, prompts, **kw))
        return outputs(
            spec.speculative_generate(WEIGHTS, CFG, prompts, drafter=DRAFTERS[name], num_draft_tokens=3, **kw)
        )

    batched = run(prompts, seeds)
    for prompt, seed, output in zip(prompts, seeds, batched):
        assert run([prompt], [seed]) == [output]
    # Another order, padding rows, and two samples per prompt: sample 0 is the prompt's one sample.
    assert run(prompts[::-1], seeds[::-1], batch_size=4, num_samples=2)[:6:2] == batched[::-1]
    assert run(prompts, seeds) == batched
    assert all(a != b for a, b in zip(run(prompts, [12, 23, 34]), batched))
    assert run(prompts, 5)[0] == run(prompts[:1], 5)[0]  # prompt 0 of one seed: fold_in(key(5), 0) either way


# ---------------------------------------------------------------------------------------------------------------
# Distribution: the first 3 tokens of many rows against the target's exact joint distribution.

TOY = ModelConfig("llama", 8, 16, 32, 2, 2, 1, 8, max_position_embeddings=64)
TOY_TARGET = init_weights(TOY, jax.random.key(10), scale=0.5)
TOY_DRAFT = ModelDrafter(init_weights(TOY, jax.random.key(11), scale=0.5), TOY)
TOY_PROMPT = [3, 5]
SAMPLES = 32768


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ClaimedProbs(ChainDrafter):
    """Samples drafts from its model but reports other draft_probs: "one_hot" (the draft as certain — still exact,
    it only accepts less) or "uniform" (not the distribution the draft came from — broken)."""

    inner: ModelDrafter
    claim: str = dataclasses.field(metadata=dict(static=True))

    def init(self, *a):
        return self.inner.init(*a)

    def propose_chain(self, state, tokens_bs, length_b, key, *, num_draft_tokens, vocab_size, sampling):
        tokens, _, state = self.inner.propose_chain(
            state,
            tokens_bs,
            length_b,
            key,
            num_draft_tokens=num_draft_tokens,
            vocab_size=vocab_size,
            sampling=sampling,
        )
        if self.claim == "one_hot":
            return tokens, jax.nn.one_hot(tokens, vocab_size), state
        return tokens, jnp.full(tokens.shape + (vocab_size,), 1.0 / vocab_size), state


def exact_joint(sampling):
    """P(t1, t2, t3 | prompt) under target sampling, by enumeration: [V, V, V]."""
    V = TOY.vocab_size
    t1, t2 = np.meshgrid(np.arange(V), np.arange(V), indexing="ij")
    seqs = np.stack([np.full(V * V, TOY_PROMPT[0]), np.full(V * V, TOY_PROMPT[1]), t1.ravel(), t2.ravel()], 1)
    B, T = seqs.shape
    logits, _, _ = jax.jit(forward, static_argnums=1)(
        TOY_TARGET, TOY, jnp.asarray(seqs, jnp.int32), jnp.broadcast_to(jnp.arange(T), (B, T)), KVCache.empty(TOY, B, T)
    )
    probs = np.asarray(probabilities(logits, Sampling.of(sampling)), np.float64).reshape(V, V, T, V)
    p1 = probs[0, 0, 1]  # [V]
    p2 = probs[:, 0, 2]  # [t1, V]
    p3 = probs[:, :, 3]  # [t1, t2, V]
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_outputs(sampling, drafter, k=2, seed=0):
    """The first 3 tokens of SAMPLES rows as one index into [V, V, V]; `sampling` is one setting or one per row."""
    tokens, lengths = pack_prompts([TOY_PROMPT], 1, TOY.max_position_embeddings)
    rows = Sampling.of(sampling, None if isinstance(sampling, SamplingConfig) else SAMPLES)
    out = spec.speculative_decode(
        TOY_TARGET,
        drafter,
        Fixed(k),
        tokens,
        lengths,
        np.full(SAMPLES, 3, np.int32),
        row_keys(seed, SAMPLES),
        rows,
        cfg=TOY,
        eos_ids=(),
        num_samples=SAMPLES,
        prefill_chunk=2,
    ).out_bn  # SAMPLES rows that share the prompt's prefill
    V = TOY.vocab_size
    return np.asarray(out)[:, :3] @ np.array([V * V, V, 1])


def joint(flat):
    V = TOY.vocab_size
    return np.bincount(flat, minlength=V**3).reshape(V, V, V) / len(flat)


def sampled_joint(sampling, drafter, k=2, seed=0):
    return joint(sampled_outputs(sampling, drafter, k, seed))


def tv_bound(exact, samples=SAMPLES):
    """About 2x the expected total variation of `samples` draws from `exact` (sampling noise alone)."""
    p = exact.ravel()
    return 2.0 * 0.5 * np.sum(np.sqrt(2 * p * (1 - p) / (np.pi * samples)))


def tv(a, b):
    return 0.5 * np.abs(a - b).sum()


SAMPLINGS = {
    "t1": SamplingConfig(temperature=1.0),
    "top_k": SamplingConfig(temperature=1.0, top_k=3),
    "top_p": SamplingConfig(temperature=1.0, top_p=0.8),
}


# CI: temperature 1; top-k and top-p rows are checked against their own laws in CI by the mixed-rows test below.
@pytest.mark.parametrize("name", [n if n == "t1" else pytest.param(n, marks=pytest.mark.slow) for n in SAMPLINGS])
def test_sampled_distribution_equals_target(name):
    sampling = SAMPLINGS[name]
    exact = exact_joint(sampling)
    assert abs(exact.sum() - 1) < 1e-5
    empirical = sampled_joint(sampling, TOY_DRAFT)
    assert tv(empirical, exact) < tv_bound(exact), (tv(empirical, exact), tv_bound(exact))


@pytest.mark.slow  # the rule's exactness for any q is what t1 checks in CI; this is one more q
def test_treating_the_drafts_as_certain_is_exact_too():
    """q = 1 for the drawn draft (not the distribution it came from): still exact, it only accepts less."""
    exact = exact_joint(SAMPLINGS["t1"])
    one_hot = sampled_joint(SAMPLINGS["t1"], ClaimedProbs(TOY_DRAFT, "one_hot"))
    assert tv(one_hot, exact) < tv_bound(exact), (tv(one_hot, exact), tv_bound(exact))


def test_mixed_rows_each_follow_their_own_setting():
    """One batch, four settings in turn (one greedy): every row is distributed as target sampling with its own."""
    settings = [SAMPLINGS["top_k"], SamplingConfig(temperature=0.6, top_p=0.7), SamplingConfig(), SAMPLINGS["t1"]]
    flat = sampled_outputs([settings[i % 4] for i in range(SAMPLES)], TOY_DRAFT)
    for i, setting in enumerate(settings):
        exact = exact_joint(setting)
        if setting.greedy:
            assert len(set(flat[i::4])) == 1 and exact.ravel()[flat[i]] == 1.0  # the argmax path, every time
        else:
            empirical = joint(flat[i::4])
            assert tv(empirical, exact) < tv_bound(exact, SAMPLES // 4), (setting, tv(empirical, exact))


@pytest.mark.slow  # the statistic's power, not the code's exactness: run with -m slow when the statistic changes
def test_broken_rules_miss_the_target_distribution(monkeypatch):
    sampling = SAMPLINGS["top_k"]
    exact = exact_joint(sampling)
    bound = tv_bound(exact)
    # 1. draft_probs that are not the distribution the draft was drawn from.
    liar = sampled_joint(sampling, ClaimedProbs(TOY_DRAFT, "uniform"))
    assert tv(liar, exact) > 2 * bound, (tv(liar, exact), bound)
    # 2. Resampling from the target after a rejection instead of the residual max(0, target - draft).
    monkeypatch.setattr(acceptance, "residual_probs", lambda target_probs, draft_probs: target_probs)
    spec.speculative_decode.clear_cache()  # jit caches traces per function: retrace with the broken rule
    try:
        wrong = sampled_joint(sampling, TOY_DRAFT)
    finally:
        spec.speculative_decode.clear_cache()
    assert tv(wrong, exact) > 2 * bound, (tv(wrong, exact), bound)


def chain(draft_tokens_bk, draft_probs_bkv):
    """The drafts as a round's draft tree, after a pending token 0."""
    return DraftTree.chain(jnp.zeros(draft_tokens_bk.shape[:1], jnp.int32), draft_tokens_bk, draft_probs_bkv)


def test_acceptance_rules_on_fixed_distributions():
    target = jnp.array([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])  # [B=1, K+1=2, V=3]
    draft = jnp.array([[[0.0, 0.0, 1.0]]])  # the draft proposes token 2, which the target never emits
    n, nxt, _ = acceptance.recursive_rejection(row_keys(0, 1), chain(jnp.array([[2]]), draft), target)
    assert int(n[0]) == 0 and int(nxt[0]) in (0, 1)
    same = jnp.array([[[0.5, 0.5, 0.0]]])
    keys = row_keys(1, 200)
    accepted = jax.vmap(lambda k: acceptance.recursive_rejection(k[None], chain(jnp.array([[1]]), same), target)[0])
    ns = jax.jit(accepted)(keys)
    assert np.all(np.asarray(ns) == 1)  # draft == target: always accepted, bonus drawn from the last position
    np.testing.assert_allclose(acceptance.residual_probs(target[:, 0], draft[:, 0]), [[0.5, 0.5, 0.0]])
    np.testing.assert_allclose(acceptance.residual_probs(same[:, 0], same[:, 0]), same[:, 0])  # 0 residual: defined
    drafts = jnp.array([[4, 7, 9], [4, 2, 9]])
    n, nxt, _ = acceptance.greedy_accept(chain(drafts, jax.nn.one_hot(drafts, 10)), jnp.array([[4, 7, 9, 3]] * 2))
    assert n.tolist() == [3, 1] and nxt.tolist() == [3, 7]


# ---------------------------------------------------------------------------------------------------------------
# Bad input.


def test_bad_input():
    def run(**kw):
        args = dict(drafter=DRAFTERS["ngram"], num_draft_tokens=3, max_new_tokens=4) | kw
        return spec.speculative_generate(WEIGHTS, CFG, [[2, 3]], **args)

    for k in (0, -1, spec.MAX_DRAFT_TOKENS + 1):
        with pytest.raises(InputError, match="draft tokens"):
            run(num_draft_tokens=k)
    small_vocab = dataclasses.replace(TOY, vocab_size=32)
    with pytest.raises(InputError, match="vocabulary"):
        run(drafter=ModelDrafter(init_weights(small_vocab, jax.random.key(0)), small_vocab))
    with pytest.raises(InputError, match="n-gram"):
        NgramDrafter(max_n=0)
    for n in (0, 2, -1):
        with pytest.raises(InputError, match="layer-skip"):
            LayerSkipDrafter(WEIGHTS, CFG, n)
    with pytest.raises(InputError, match="max_new_tokens"):
        run(max_new_tokens=0)
    with pytest.raises(InputError, match="maximum length"):
        run(max_new_tokens=127)
    with pytest.raises(InputError, match="not a drafter"):
        run(drafter=object())


def test_batch_padding_rows_do_not_change_results_or_statistics(ar_batch):
    kw = dict(drafter=DRAFTERS["ngram"], num_draft_tokens=3, max_new_tokens=MAX_NEW, eos_ids=())
    a = spec.speculative_generate(WEIGHTS, CFG, PROMPTS[1:2], **kw)
    b = spec.speculative_generate(WEIGHTS, CFG, PROMPTS[1:2], batch_size=4, **kw)
    assert outputs(a) == outputs(b) == [ar_batch[1]]
    assert a.stats.accepted_histogram == b.stats.accepted_histogram and a.stats.rounds == b.stats.rounds
