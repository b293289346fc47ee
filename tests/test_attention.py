"""Attention by blocks up to the live length equals dense softmax attention, and equals transformers at 1-4k tokens
for chunked prefills, one-token steps, chains and trees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from specjax.config import ModelConfig
from specjax.models import attention
from specjax.models.attention import CachedKeys, attend, slots_below, slots_where
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, forward_new_kv, weights_from_hf


def dense(q, k_cache, v_cache, k_new, v_new, cache_mask, new_mask):
    """Softmax over the concatenated cache and new keys, in float64 numpy: [B, T, K, G, H]."""
    q, k, v = (
        np.asarray(x, np.float64) for x in (q, np.concatenate([k_cache, k_new], 1), np.concatenate([v_cache, v_new], 1))
    )
    s = np.einsum("btkgh,bskh->bkgts", q, k) / np.sqrt(q.shape[-1])
    seen = np.concatenate([cache_mask, new_mask], axis=2)[:, None, None]
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bkgts,bskh->btkgh", p / p.sum(-1, keepdims=True), v)


def random_qkv(rng, B, T, S, K=2, G=2, H=8):
    draw = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return draw(B, T, K, G, H), draw(B, S, K, H), draw(B, S, K, H), draw(B, T, K, H), draw(B, T, K, H)


@pytest.mark.parametrize("block", [16, 48, 512])
@pytest.mark.parametrize("T", [1, 5])
def test_blocks_up_to_the_live_length_equal_dense_attention(monkeypatch, block, T):
    """Rows of different lengths, blocks that do not divide the buffer (the last one overlaps the one before), chain
    and tree masks; and slots past the live blocks are never read (NaN there changes nothing)."""
    monkeypatch.setattr(attention, "KV_BLOCK", block)
    rng = np.random.default_rng(block + T)
    B, S = 2, 100
    q, k_cache, v_cache, k_new, v_new = random_qkv(rng, B, T, S)
    lengths = np.array([37, 71], np.int32)
    tree = np.tril(rng.random((B, T, T)) < 0.5) | np.eye(T, dtype=bool)  # a node sees itself and some before it
    cache_mask = np.broadcast_to(np.arange(S)[None, None, :] < lengths[:, None, None], (B, T, S))
    expected = dense(q, k_cache, v_cache, k_new, v_new, cache_mask, tree)

    unread = -(-lengths.max() // min(block, S)) * min(block, S)  # first slot of the blocks past the live length
    k_poisoned, v_poisoned = k_cache.copy(), v_cache.copy()
    k_poisoned[:, unread:] = v_poisoned[:, unread:] = np.nan

    @jax.jit
    def run(q, k_new, v_new, tree, k_cache, v_cache, lengths):  # the live length traced: a loop of data-long trips
        cached = CachedKeys(k_cache, v_cache, slots_below(lengths), jnp.max(lengths))
        return attend(q, k_new, v_new, tree, cached)

    got = run(q, k_new, v_new, tree, k_poisoned, v_poisoned, lengths)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)

    # A mask given whole, every block read (training's form), on a stacked cache read at a layer.
    mask = rng.random((B, T, S)) < 0.3
    expected = dense(q, k_cache, v_cache, k_new, v_new, mask, tree)
    stacked = CachedKeys(jnp.stack([k_cache * 0, k_cache]), jnp.stack([v_cache * 0, v_cache]), slots_where(mask),
                         layer=jnp.int32(1))  # fmt: skip
    got = attend(q, k_new, v_new, jnp.asarray(tree), stacked)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def test_an_empty_cache_reads_no_block(monkeypatch):
    """A prefill's first chunk: live 0, nothing read (NaN everywhere in the cache changes nothing)."""
    rng = np.random.default_rng(0)
    q, k_cache, v_cache, k_new, v_new = random_qkv(rng, 2, 6, 64)
    causal = np.broadcast_to(np.tril(np.ones((6, 6), bool)), (2, 6, 6))
    nan = jnp.full(k_cache.shape, jnp.nan)
    got = attend(q, k_new, v_new, jnp.asarray(causal), CachedKeys(nan, nan, slots_below(jnp.zeros(2, jnp.int32)), 0))
    expected = dense(q, k_cache[:, :0], v_cache[:, :0], k_new, v_new, np.zeros((2, 6, 0), bool), causal)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


LONG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0)  # fmt: skip


def long_pair(config_cls, **extra):
    hf_cfg = config_cls(**LONG, **extra)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    return model, cfg, weights_from_hf(cfg, state.__getitem__)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize(
    "config_cls,extra",
    [(transformers.LlamaConfig, {}), (transformers.MistralConfig, dict(sliding_window=700, head_dim=16))],
    ids=["llama", "mistral-sliding-window"],
)
def test_long_context_matches_transformers(config_cls, extra):
    """~1.5k tokens: a prefill in chunks of 512 (the last one partial), then from each row's own length (rows of
    different lengths share the buffer) a one-token step, a chain of 4 and a 6-node tree, each only reading the
    cache, against transformers' logits of the same text."""
    model, cfg, weights = long_pair(config_cls, **extra)
    rng = np.random.default_rng(3)
    B, N, S, C = 2, 1500, 1600, 512
    ids = rng.integers(0, cfg.vocab_size, size=(B, N))
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.numpy()
    run, read = jax.jit(forward, static_argnums=1), jax.jit(forward_new_kv, static_argnums=1)
    positions = np.broadcast_to(np.arange(N), (B, N))

    cache, chunks = KVCache.empty(cfg, B, S), []
    for start in range(0, N, C):
        part = slice(start, min(start + C, N))
        logits, _, cache = run(weights, cfg, jnp.asarray(ids[:, part]), jnp.asarray(positions[:, part]), cache)
        cache = cache.advance(jnp.full((B,), part.stop - start))
        chunks.append(logits)
    assert rel_err(jnp.concatenate(chunks, axis=1), expected) <= 1e-4

    lengths = np.array([1400, 1100], np.int32)
    cache = cache.at_lengths(lengths)
    at = lengths[:, None] + np.arange(4)[None, :]
    chain = np.take_along_axis(ids, at, axis=1)
    logits, _, _, _ = read(weights, cfg, jnp.asarray(chain), jnp.asarray(at), cache)
    want = np.stack([expected[b, at[b]] for b in range(B)])
    assert rel_err(logits, want) <= 1e-4
    step, _, _, _ = read(weights, cfg, jnp.asarray(chain[:, :1]), jnp.asarray(at[:, :1]), cache)
    assert rel_err(step, want[:, :1]) <= 1e-4

    # A tree: root r, children a, b of r, c of a, d of b, e of c (parents [-, 0, 0, 1, 2, 3]).
    parents, depths = [-1, 0, 0, 1, 2, 3], np.array([0, 1, 1, 2, 2, 3])
    ancestors = np.eye(6, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            ancestors[i] |= ancestors[p]
    nodes = rng.integers(0, cfg.vocab_size, size=(B, 6))
    logits, _, _, _ = read(
        weights, cfg, jnp.asarray(nodes), jnp.asarray(lengths[:, None] + depths[None, :]), cache,
        new_mask_btt=jnp.asarray(np.broadcast_to(ancestors, (B, 6, 6))),
    )  # fmt: skip
    for b in range(B):
        for i in range(6):
            path = nodes[b, np.flatnonzero(ancestors[i])]  # the node's ancestors in depth order, then itself
            text = np.concatenate([ids[b, : lengths[b]], path])[None]
            with torch.no_grad():
                want = model(torch.tensor(text)).logits.numpy()[0, -1]
            assert rel_err(logits[b, i], want) <= 1e-4, (b, i)
