import jax
import pytest

from specjax.calibrate import ForwardCosts, forward_costs, round_breakdown
from specjax.config import ModelConfig
from specjax.models.llama import init_weights
from specjax.speedup import expected_tokens_per_round


def test_round_breakdown_splits_time_and_predicts_from_the_model():
    costs = ForwardCosts(step_s=0.020, verify_s=0.030)
    # 10 rounds of 50 ms with K = 4: 30 ms verify + 20 ms drafting = 4 draft steps of 5 ms: c = 0.25.
    b = round_breakdown(costs, seconds=0.5, rounds=10, mean_accepted=3.0, num_draft_tokens=4)
    assert b["round_ms"] == pytest.approx(50) and b["draft_ms"] == pytest.approx(20)
    assert b["cost_ratio"] == pytest.approx(0.25) and b["verify_ratio"] == pytest.approx(1.5)
    assert expected_tokens_per_round(b["alpha"], 4) == pytest.approx(3.0, rel=1e-6)
    assert b["predicted_speedup"] == pytest.approx(3.0 / (1.5 + 4 * 0.25))


def test_forward_costs_are_measured():
    cfg = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8)
    costs = forward_costs(init_weights(cfg, jax.random.key(0)), cfg, batch=1, context=16, num_tokens=5, reps=3)
    assert costs.step_s > 0 and costs.verify_s > 0
