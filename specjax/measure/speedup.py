"""What speculative decoding can buy: the expected-value model of Leviathan et al. (2023), section 3.

Assume each draft token is accepted independently with probability `alpha` (the acceptance rate) and that one
draft step costs `cost_ratio` (c) times one target forward, while verifying K+1 positions costs one target forward.
Then a round of K drafts emits on average (1 - alpha^(K+1)) / (1 - alpha) tokens (the accepted drafts plus the
correction / bonus token) and costs 1 + K c target forwards, so the expected speedup over autoregressive decoding
is the ratio of the two.
"""

from __future__ import annotations

from specjax.errors import InputError


def _check(alpha: float, num_draft_tokens: int | None = None, cost_ratio: float | None = None) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise InputError(f"the acceptance rate alpha must be in [0, 1], got {alpha}")
    if num_draft_tokens is not None and num_draft_tokens < 0:
        raise InputError(f"the number of draft tokens must be >= 0, got {num_draft_tokens}")
    if cost_ratio is not None and not cost_ratio >= 0.0:
        raise InputError(f"the draft/target cost ratio must be >= 0, got {cost_ratio}")


def expected_tokens_per_round(alpha: float, num_draft_tokens: int) -> float:
    """Expected tokens emitted per round, counting the correction / bonus token.

    Args:
      alpha: per-token acceptance rate in [0, 1].
      num_draft_tokens: K >= 0.
    Returns:
      (1 - alpha^(K+1)) / (1 - alpha); K + 1 when alpha = 1.
    """
    _check(alpha, num_draft_tokens)
    if alpha == 1.0:
        return float(num_draft_tokens + 1)
    return (1.0 - alpha ** (num_draft_tokens + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, num_draft_tokens: int, cost_ratio: float) -> float:
    """Expected wall-time speedup over autoregressive decoding.

    Args:
      alpha: per-token acceptance rate in [0, 1].
      num_draft_tokens: K >= 0.
      cost_ratio: c, the cost of one draft step relative to one target forward (>= 0).
    Returns:
      expected_tokens_per_round(alpha, K) / (1 + K c).
    """
    _check(alpha, num_draft_tokens, cost_ratio)
    return expected_tokens_per_round(alpha, num_draft_tokens) / (1.0 + num_draft_tokens * cost_ratio)


def optimal_num_draft_tokens(alpha: float, cost_ratio: float, max_draft_tokens: int = 32) -> int:
    """The K in 1..max_draft_tokens with the highest expected speedup (the smallest such K on ties).

    When even the best K gives a speedup below 1, speculation does not pay: check `expected_speedup` of the result.
    """
    _check(alpha, None, cost_ratio)
    if max_draft_tokens < 1:
        raise InputError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
    best_k, best = 1, expected_speedup(alpha, 1, cost_ratio)
    for k in range(2, max_draft_tokens + 1):
        s = expected_speedup(alpha, k, cost_ratio)
        if s > best * (1 + 1e-12):
            best_k, best = k, s
    return best_k


def acceptance_rate_from_mean(mean_accepted: float, num_draft_tokens: int) -> float:
    """Inverts `expected_tokens_per_round`: the alpha whose expected tokens per round is `mean_accepted`.

    Args:
      mean_accepted: measured tokens per round counting the bonus, in [1, K + 1].
      num_draft_tokens: K >= 1.
    Returns:
      alpha in [0, 1] (by bisection; the function is increasing in alpha).
    """
    if num_draft_tokens < 1:
        raise InputError(f"the number of draft tokens must be >= 1, got {num_draft_tokens}")
    if not 1.0 <= mean_accepted <= num_draft_tokens + 1:
        raise InputError(f"mean accepted tokens per round must be in [1, {num_draft_tokens + 1}], got {mean_accepted}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, num_draft_tokens) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
