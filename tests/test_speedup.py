"""The expected-speedup model: closed forms, limits, the optimal K, and its inverse."""

import math

import pytest

from specjax.errors import InputError
from specjax.measure.speedup import (
    acceptance_rate_from_mean,
    expected_speedup,
    expected_tokens_per_round,
    optimal_num_draft_tokens,
)


def test_tokens_per_round_closed_form_and_limits():
    assert expected_tokens_per_round(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert expected_tokens_per_round(0.8, 4) == pytest.approx(sum(0.8**i for i in range(5)))  # geometric series
    assert expected_tokens_per_round(0.0, 7) == 1.0
    assert expected_tokens_per_round(1.0, 7) == 8.0
    assert expected_tokens_per_round(0.5, 0) == 1.0
    assert expected_tokens_per_round(1 - 1e-9, 3) == pytest.approx(4.0, rel=1e-6)  # continuous at alpha = 1


def test_speedup():
    assert expected_speedup(0.8, 4, 0.0) == pytest.approx(expected_tokens_per_round(0.8, 4))
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert expected_speedup(0.0, 3, 0.1) < 1  # nothing accepted: pure overhead
    # Increasing in alpha, decreasing in c.
    assert expected_speedup(0.9, 5, 0.1) > expected_speedup(0.7, 5, 0.1) > expected_speedup(0.7, 5, 0.2)


def test_optimal_k_matches_brute_force():
    for alpha in (0.3, 0.6, 0.8, 0.9, 0.95):
        for c in (0.0, 0.02, 0.1, 0.3):
            k = optimal_num_draft_tokens(alpha, c, max_draft_tokens=20)
            best = max(expected_speedup(alpha, j, c) for j in range(1, 21))
            assert expected_speedup(alpha, k, c) == pytest.approx(best)
    assert optimal_num_draft_tokens(0.8, 0.0, max_draft_tokens=10) == 10  # free drafts: as many as allowed
    assert optimal_num_draft_tokens(0.5, 0.5) == 1
    # Leviathan et al. (2023), figure 3: alpha = 0.8 and c = 0.05 peaks around K = 8.
    assert 6 <= optimal_num_draft_tokens(0.8, 0.05) <= 9


def test_acceptance_rate_inverse():
    for alpha in (0.0, 0.25, 0.7, 0.99):
        mean = expected_tokens_per_round(alpha, 5)
        assert acceptance_rate_from_mean(mean, 5) == pytest.approx(alpha, abs=1e-9)
    assert acceptance_rate_from_mean(6.0, 5) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_tokens_per_round(1.5, 3),
        lambda: expected_tokens_per_round(-0.1, 3),
        lambda: expected_tokens_per_round(0.5, -1),
        lambda: expected_speedup(0.5, 3, -0.1),
        lambda: expected_speedup(0.5, 3, math.nan),
        lambda: optimal_num_draft_tokens(0.5, 0.1, max_draft_tokens=0),
        lambda: acceptance_rate_from_mean(0.5, 3),
        lambda: acceptance_rate_from_mean(5.0, 3),
        lambda: acceptance_rate_from_mean(2.0, 0),
    ],
)
def test_bad_input(call):
    with pytest.raises(InputError):
        call()
