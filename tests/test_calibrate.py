import jax
import pytest
from flax import nnx

from specjax.config import ModelConfig, SamplingConfig
from specjax.drafters import Eagle3Drafter, LayerSkipDrafter, LookupFirstDrafter, NgramDrafter
from specjax.drafters.tree import TreeSpec
from specjax.measure.speedup import expected_tokens_per_round
from specjax.measure.timing import ForwardCosts, drafter_seconds, forward_costs, forward_timers, round_breakdown
from specjax.models.eagle3 import Eagle3Config, Eagle3Head
from specjax.models.llama import init_weights


def test_round_breakdown_splits_time_and_predicts_from_the_model():
    costs = ForwardCosts(step_s=0.020, verify_s=0.030)
    # 10 rounds of 50 ms with K = 4: 30 ms verify + 20 ms drafting = 4 draft steps of 5 ms: c = 0.25.
    b = round_breakdown(costs, seconds=0.5, rounds=10, mean_accepted=3.0, num_draft_tokens=4)
    assert b["round_ms"] == pytest.approx(50) and b["draft_ms"] == pytest.approx(20)
    assert b["cost_ratio"] == pytest.approx(0.25) and b["verify_ratio"] == pytest.approx(1.5)
    assert expected_tokens_per_round(b["alpha"], 4) == pytest.approx(3.0, rel=1e-6)
    assert b["predicted_speedup"] == pytest.approx(3.0 / (1.5 + 4 * 0.25))
    assert "drafter_ms" not in b
    # The drafter's own work measured at 12 ms: the other 8 ms are the loop's.
    b = round_breakdown(costs, seconds=0.5, rounds=10, mean_accepted=3.0, num_draft_tokens=4, drafter_s=0.012)
    assert b["drafter_ms"] == pytest.approx(12) and b["rest_ms"] == pytest.approx(8)
    # The same rounds after 100 ms of prefills: those are taken out before the split.
    b = round_breakdown(costs, seconds=0.6, rounds=10, mean_accepted=3.0, num_draft_tokens=4, prefill_s=0.1)
    assert b["prefill_ms"] == pytest.approx(100) and b["round_ms"] == pytest.approx(50)


def test_forward_costs_are_measured():
    cfg = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8)
    costs = forward_costs(init_weights(cfg, jax.random.key(0)), cfg, batch=1, context=16, num_tokens=5, reps=3)
    assert costs.step_s > 0 and costs.verify_s > 0


def test_timed_forwards_return_no_cache():
    # A timed forward that returned the written cache would time a copy of all of it, as a round never does.
    cfg = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8)
    one, five = forward_timers(init_weights(cfg, jax.random.key(0)), cfg, batch=2, context=40, token_counts=(1, 5))
    slots = 40 + 5
    for out, t in ((one(), 1), (five(), 5)):
        shapes = [x.shape for x in jax.tree.leaves(out)]
        assert (2, t, cfg.vocab_size) in shapes
        assert not any(slots in shape for shape in shapes)


@pytest.mark.parametrize("kind", ["ngram", "layerskip", "eagle3-chain", "eagle3-tree", "lookup-first"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)])
def test_drafter_seconds_runs_one_round_of_every_drafter(kind, sampling):
    cfg = ModelConfig("llama", 64, 32, 64, 4, 4, 2, 8, max_position_embeddings=128)
    weights = init_weights(cfg, jax.random.key(0))
    head = Eagle3Head(Eagle3Config.default_for(cfg), rngs=nnx.Rngs(1))
    tree = TreeSpec(3, 2, 6)
    drafter = {
        "ngram": lambda: NgramDrafter(3),
        "layerskip": lambda: LayerSkipDrafter(weights, cfg, 2),
        "eagle3-chain": lambda: Eagle3Drafter.create(head, weights.embed),
        "eagle3-tree": lambda: Eagle3Drafter.create(head, weights.embed, tree),
        "lookup-first": lambda: LookupFirstDrafter(Eagle3Drafter.create(head, weights.embed), fallback_tokens=2),
    }[kind]()
    k = tree.depth if kind == "eagle3-tree" else 4
    assert drafter_seconds(drafter, cfg, batch=2, context=20, num_draft_tokens=k, sampling=sampling, reps=2) > 0
