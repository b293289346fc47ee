"""Packing and stored target features: every sample packed once and isolated from its row neighbours, features equal
to the target run on each sample alone, and a step on stored features equal to one that runs the target itself."""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_tiny  # noqa: E402

from specjax.errors import InputError  # noqa: E402
from specjax.models.kv_cache import KVCache  # noqa: E402
from specjax.models.llama import forward  # noqa: E402
from specjax.train.batches import BatchSource, nested_subset, pack  # noqa: E402
from specjax.train.features import compute_features, feature_layers, load_features  # noqa: E402


def test_pack_places_every_sample_once_with_its_own_positions():
    samples = train_tiny.samples(40)
    T = 24
    rows = pack(samples, T)
    assert all(v.shape == rows["tokens"].shape and v.dtype == np.int32 for v in rows.values())
    found = []
    for r in range(len(rows["tokens"])):
        seg = rows["segments"][r]
        for s in range(1, seg.max() + 1):
            span = np.nonzero(seg == s)[0]
            assert (np.diff(span) == 1).all()  # contiguous
            np.testing.assert_array_equal(rows["positions"][r, span], np.arange(len(span)))
            found.append((tuple(rows["tokens"][r, span]), tuple(rows["loss_mask"][r, span])))
        assert (rows["tokens"][r, seg == 0] == 0).all() and (rows["loss_mask"][r, seg == 0] == 0).all()
    expected = [(tuple(t[:T]), tuple(m[:T].astype(np.int32))) for t, m in samples]
    assert sorted(found) == sorted(expected)
    # First fit, longest first, uses at most 11/9 of the optimal number of rows, plus one.
    assert len(rows["tokens"]) <= 11 / 9 * sum(len(t) for t, _ in found) / T + 1
    assert pack(samples, T)["tokens"].tobytes() == rows["tokens"].tobytes()  # deterministic


def test_batches_are_a_function_of_the_step():
    rows = pack(train_tiny.samples(40), 24)
    a, b = BatchSource(rows, 4, seed=3), BatchSource(rows, 4, seed=3)
    for step in (0, 5, 17):
        for key, value in a.batch(step).items():
            np.testing.assert_array_equal(value, b.batch(step)[key])
    with pytest.raises(InputError, match="fewer than training.batch_size"):
        BatchSource(rows, len(rows["tokens"]) + 1, seed=0)


def test_data_fractions_are_nested_seeded_subsets():
    subsets = {f: nested_subset(1000, f, seed=0) for f in (0.125, 0.25, 0.5, 1.0)}
    assert [len(s) for s in subsets.values()] == [125, 250, 500, 1000]
    assert set(subsets[0.125]) < set(subsets[0.25]) < set(subsets[0.5]) < set(subsets[1.0]) == set(range(1000))
    assert all((np.diff(s) > 0).all() for s in subsets.values())  # sorted, no repeats
    np.testing.assert_array_equal(nested_subset(1000, 0.25, seed=0), subsets[0.25])
    assert not np.array_equal(nested_subset(1000, 0.25, seed=1), subsets[0.25])
    assert len(nested_subset(10, 0.01, seed=0)) == 1  # never empty


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """(rows with stored features, layers, target) of the tiny setup, in rows of 48 tokens (up to 4 samples)."""
    cfg = train_tiny.config(["training.seq_len=48"])
    target_cfg, weights = train_tiny.target()
    rows = pack(train_tiny.samples(), cfg.training.seq_len)
    layers = feature_layers(cfg.model.tap_layers, target_cfg)
    folder = tmp_path_factory.mktemp("features")
    compute_features(weights, target_cfg, layers, rows, folder)
    return load_features(folder, layers, cfg.training.seq_len), layers, (target_cfg, weights)


def test_packed_features_equal_each_sample_alone(stored):
    rows, layers, (cfg, weights) = stored
    assert rows["features"].dtype == jnp.bfloat16
    assert rows["features"].shape == (*rows["tokens"].shape, len(layers) * cfg.hidden_size)
    T = rows["tokens"].shape[1]
    spans = [
        (r, np.nonzero(rows["segments"][r] == s)[0])
        for r in range(len(rows["tokens"]))
        for s in range(1, rows["segments"][r].max() + 1)
    ]
    assert len(spans) > len(rows["tokens"])  # some rows hold several samples
    # Every sample alone in a row of its own, padded after its end (causal: the padding changes nothing before it).
    alone_tokens = np.zeros((len(spans), T), np.int32)
    for i, (r, span) in enumerate(spans):
        alone_tokens[i, : len(span)] = rows["tokens"][r, span]
    positions = jnp.broadcast_to(jnp.arange(T), alone_tokens.shape)
    _, alone, _ = forward(
        weights, cfg, jnp.asarray(alone_tokens), positions, KVCache.empty(cfg, len(spans), T), tap_layers=layers
    )
    for i, (r, span) in enumerate(spans):
        got = np.asarray(rows["features"][r, span], np.float32)
        np.testing.assert_allclose(got, np.asarray(alone[i, : len(span)]), rtol=1e-2, atol=1e-2)  # bfloat16 storage


def test_a_step_on_stored_features_equals_one_running_the_target(stored):
    rows, _, _ = stored
    _, online, _ = train_tiny.build()
    _, offline, _ = train_tiny.build(["training.features=stored"])
    batch = BatchSource(rows, 8, seed=0).batch(0)
    _, m_online = online.step(online.initial_state, {k: v for k, v in batch.items() if k != "features"})
    _, m_stored = offline.step(offline.initial_state, batch)
    np.testing.assert_allclose(float(m_stored["loss"]), float(m_online["loss"]), rtol=2e-2)
    np.testing.assert_array_equal(np.asarray(m_stored["rows_k"]), np.asarray(m_online["rows_k"]))


def test_features_of_other_rows_are_refused(stored, tmp_path):
    rows, layers, (cfg, weights) = stored
    compute_features(weights, cfg, layers, {k: v[:8] for k, v in rows.items() if k != "features"}, tmp_path)
    with pytest.raises(InputError, match="other rows or layers"):
        compute_features(weights, cfg, layers, {k: v[:16] for k, v in rows.items() if k != "features"}, tmp_path)
    with pytest.raises(InputError, match="run the features stage again"):
        load_features(tmp_path, layers, seq_len=24)
