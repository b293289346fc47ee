import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import SamplingConfig
from specjax.errors import InputError
from specjax.sampling import (
    Sampling,
    categorical_rows,
    gumbel_rows,
    probabilities,
    process_logits,
    sample,
    split_rows,
    top_k_mask,
    top_p_mask,
    uniform_rows,
)

LOGITS = jnp.array([[2.0, 1.0, 0.5, -1.0, 3.0], [0.0, 0.0, 0.0, 0.0, 5.0]])


def kept(x):
    return np.isfinite(np.asarray(x)).tolist()


def test_top_k_keeps_exactly_the_k_largest():
    assert kept(top_k_mask(LOGITS, 2)) == [[True, False, False, False, True], [True, True, True, True, True]]
    assert kept(top_k_mask(LOGITS[:1], 1)) == [[False, False, False, False, True]]
    assert kept(top_k_mask(LOGITS, 0)) == [[True] * 5] * 2


def test_top_p_keeps_the_smallest_nucleus():
    probs = np.asarray(jax.nn.softmax(LOGITS[0]))  # order: 4, 0, 1, 2, 3
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    p = float(cum[1]) + 1e-3  # needs the third most likely token (index 1) to reach p
    assert kept(top_p_mask(LOGITS[:1], p)) == [[True, True, False, False, True]]
    p = float(cum[1]) - 1e-3  # two tokens suffice
    assert kept(top_p_mask(LOGITS[:1], p)) == [[True, False, False, False, True]]
    assert kept(top_p_mask(LOGITS[:1], 1e-6)) == [[False, False, False, False, True]]


def test_temperature_then_top_k_then_top_p():
    cfg = Sampling.of(SamplingConfig(temperature=0.5, top_k=3, top_p=0.9))
    expected = top_p_mask(top_k_mask(LOGITS / 0.5, 3), 0.9)
    np.testing.assert_array_equal(process_logits(LOGITS, cfg), expected)
    probs = probabilities(LOGITS, cfg)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
    assert (np.asarray(probs)[np.isinf(np.asarray(expected))] == 0).all()


def row_keys(seed, rows):
    return jax.random.split(jax.random.key(seed), rows)


def test_greedy_is_argmax_and_sampling_is_reproducible():
    assert sample(row_keys(0, 2), LOGITS, Sampling.of(SamplingConfig())).tolist() == [4, 4]
    cfg = Sampling.of(SamplingConfig(temperature=1.0))
    logits = jnp.zeros((64, 50))
    a = sample(row_keys(7, 64), logits, cfg)
    b = sample(row_keys(7, 64), logits, cfg)
    c = sample(row_keys(8, 64), logits, cfg)
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


def test_each_row_draws_from_its_own_key_alone():
    """A row's draws depend on its key and logits only: not on the other rows, their number or its place."""
    logits = jnp.asarray(np.random.default_rng(4).normal(0, 1, (5, 3, 40)), jnp.float32)
    keys = row_keys(3, 5)
    cfg = Sampling.of(SamplingConfig(temperature=1.0))
    draw = jax.jit(sample)
    batch = np.asarray(draw(keys, logits, cfg))
    alone = [np.asarray(draw(keys[b : b + 1], logits[b : b + 1], cfg))[0] for b in range(5)]
    np.testing.assert_array_equal(np.stack(alone), batch)
    np.testing.assert_array_equal(draw(keys[::-1], logits[::-1], cfg), batch[::-1])
    split = split_rows(keys, 3)  # [3, 5]: entry [i, b] = split(keys[b], 3)[i]
    assert split.shape == (3, 5)
    np.testing.assert_array_equal(jax.random.key_data(split[:, 1]), jax.random.key_data(jax.random.split(keys[1], 3)))
    u = np.asarray(uniform_rows(keys, (4,)))
    np.testing.assert_array_equal(uniform_rows(keys[2:3], (4,))[0], u[2])
    assert categorical_rows(keys, logits).shape == (5, 3) and gumbel_rows(keys, (2, 7)).shape == (5, 2, 7)


def test_sampled_frequencies_follow_the_processed_distribution():
    cfg = Sampling.of(SamplingConfig(temperature=0.7, top_k=4))
    logits = jnp.broadcast_to(LOGITS[0], (200_000, 5))
    draws = np.asarray(sample(row_keys(1, len(logits)), logits, cfg))
    freq = np.bincount(draws, minlength=5) / len(draws)
    np.testing.assert_allclose(freq, np.asarray(probabilities(LOGITS[0], cfg)), atol=5e-3)
    assert freq[3] == 0  # masked by top-k


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_values_are_refused(kw):
    with pytest.raises(InputError):
        SamplingConfig(**kw)


def test_top_p_bisection_matches_a_sorted_nucleus():
    """The sort-free threshold keeps exactly the tokens a sorted cumulative sum keeps, ties and -inf included."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (64, 1000)).astype(np.float32)
    logits[:8, ::3] = logits[:8, :1]  # ties with the boundary
    logits[8:16, 500:] = -np.inf  # masked by top-k before
    for p in (0.05, 0.5, 0.9, 0.999):
        got = np.isfinite(np.asarray(top_p_mask(jnp.asarray(logits), p)))
        probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1), np.float64)
        for row, prob in zip(got, probs):
            above = np.array([prob[prob > v].sum() for v in prob])  # mass strictly more likely than each token
            np.testing.assert_array_equal(row, above < p)


def test_top_k_bisection_matches_a_sort_for_every_k():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (8, 300)).astype(np.float32)
    logits[:2, ::5] = logits[:2, :1]  # ties with the k-th
    logits[2:4, 100:] = -np.inf
    for k in (1, 2, 7, 60, 299, 300, 301):
        kth = np.sort(logits, axis=-1)[:, ::-1][:, min(k, 300) - 1 : min(k, 300)]
        expected = np.where(logits >= kth, logits, -np.inf)
        np.testing.assert_array_equal(np.asarray(top_k_mask(jnp.asarray(logits), k)), expected)


def test_rows_of_a_batch_each_get_their_own_setting():
    """Per-row values: each row is processed exactly as its setting alone would process it; a greedy row keeps
    only its argmax."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(0, 2, (5, 3, 40)).astype(np.float32))  # [B, nodes, V]
    settings = [
        SamplingConfig(0.5, 3, 0.9),
        SamplingConfig(),
        SamplingConfig(1.3),
        SamplingConfig(1.0, 0, 0.4),
        SamplingConfig(0.9, 12, 1.0),
    ]
    rows = Sampling.of(settings, 5)
    assert not rows.greedy and Sampling.of([SamplingConfig()] * 2, 3).greedy
    got = np.asarray(probabilities(logits, rows))
    for b, setting in enumerate(settings):
        alone = np.asarray(probabilities(logits[b], Sampling.of(setting)))
        np.testing.assert_allclose(got[b], alone, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[1], np.asarray(jax.nn.one_hot(jnp.argmax(logits[1], -1), 40)))
    drawn = np.asarray(sample(row_keys(0, 5), logits, rows))
    assert drawn[1].tolist() == np.asarray(jnp.argmax(logits[1], -1)).tolist()
    with pytest.raises(InputError, match="3 sampling settings for a batch of 2"):
        Sampling.of(settings[:3], 2)
