"""Attention by blocks up to the live length equals dense softmax attention, and equals transformers at 1-4k tokens
for chunked prefills, one-token steps, chains and trees; the TPU kernel that reads the target's cache, interpreted on
this CPU, equals both; and the attention switch: "pallas" decodes the tokens "blocks" does, "auto" falls back to the
loop with one warning where the kernel fails its check, "pallas" refuses."""

import dataclasses
import functools
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import fake_devices

from specjax import host
from specjax.config import ModelConfig
from specjax.errors import InputError
from specjax.models import attention
from specjax.models.attention import CachedKeys, attend, slots_below, slots_where
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, forward_new_kv, init_weights, weights_from_hf


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


@pytest.mark.parametrize("block,tail", [(16, 16), (48, 8), (48, 32), (512, 8)])
@pytest.mark.parametrize("T", [1, 5])
def test_blocks_up_to_the_live_length_equal_dense_attention(monkeypatch, block, tail, T):
    """Rows of different lengths, blocks and tail blocks that do not divide the buffer (the last one overlaps the one
    before), chain and tree masks; and slots past the live blocks are never read (NaN there changes nothing)."""
    monkeypatch.setattr(attention, "KV_BLOCK", block)
    monkeypatch.setattr(attention, "KV_TAIL", tail)
    rng = np.random.default_rng(block + T)
    B, S = 2, 100
    q, k_cache, v_cache, k_new, v_new = random_qkv(rng, B, T, S)
    lengths = np.array([37, 71], np.int32)
    tree = np.tril(rng.random((B, T, T)) < 0.5) | np.eye(T, dtype=bool)  # a node sees itself and some before it
    cache_mask = np.broadcast_to(np.arange(S)[None, None, :] < lengths[:, None, None], (B, T, S))
    expected = dense(q, k_cache, v_cache, k_new, v_new, cache_mask, tree)

    size = min(block, S)
    if size == S:  # one block: read whole
        unread = S
    else:  # the first slot past the whole blocks and the tail blocks that hold the live length
        whole = lengths.max() // size * size
        unread = whole + -(-(lengths.max() - whole) // min(tail, size)) * min(tail, size)
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
    stacked = CachedKeys(
        jnp.stack([k_cache * 0, k_cache]), jnp.stack([v_cache * 0, v_cache]), slots_where(mask), layer=jnp.int32(1)
    )
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


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "block,T,tree,window", [(16, 1, False, None), (48, 5, False, None), (16, 5, True, 30), (512, 5, True, None)]
)
def test_fused_kernel_equals_the_block_loop(monkeypatch, dtype, block, T, tree, window):
    """The Pallas kernel, interpreted, against the pure-JAX loop and dense attention: rows of length 0, partial and a
    full buffer, blocks that do not divide it, G = 2 queries per KV head, a chain or a tree of new tokens, a sliding
    window, a stacked cache read at layer 1 (layer 0 all NaN); and NaN in every block a row does not see (each row's
    own blocks, the kernel's skipping, stricter than the loop's longest row)."""
    monkeypatch.setattr(attention, "KV_BLOCK", block)
    rng = np.random.default_rng(block + T)
    B, S, size = 4, 100, min(block, 100)
    q, k_cache, v_cache, k_new, v_new = random_qkv(rng, B, T, S)
    lengths = np.array([0, 37, 71, S], np.int32)
    new_mask = np.tril(rng.random((B, T, T)) < 0.5 if tree else np.ones((B, T, T), bool)) | np.eye(T, dtype=bool)
    first = None if window is None else lengths[:, None] + np.arange(T) - window + 1
    slots = np.arange(S)[None, None, :]
    cache_mask = (slots < lengths[:, None, None]) & (slots >= (0 if first is None else first[..., None]))
    cache_mask = np.broadcast_to(cache_mask, (B, T, S))
    expected = dense(*(x.astype(dtype) for x in (q, k_cache, v_cache, k_new, v_new)), cache_mask, new_mask)

    def run(k, v, read):
        args = [jnp.asarray(x, dtype) for x in (q, k_new, v_new, k, v)]
        cached = CachedKeys.below(*args[3:], lengths, first, jnp.int32(1))
        return attention.attend_reading(read, *args[:3], jnp.asarray(new_mask), cached)

    stacked = [np.stack([np.full_like(x, np.nan), x]) for x in (k_cache, v_cache)]
    loop = run(*stacked, attention.read_blocks)
    lows = np.zeros(B, int) if first is None else np.maximum(first.min(1), 0) // size * size
    poisoned = [x.copy() for x in stacked]
    for x in poisoned:
        for b in range(B):
            x[1, b, : lows[b]] = x[1, b, -(-lengths[b] // size) * size :] = np.nan
    fused = run(*poisoned, functools.partial(attention.read_fused, interpret=True))
    tol = 2e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(fused, np.float32), expected, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(loop, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_kernel_lowers_to_mosaic_for_tpu(dtype):
    """Lowered for TPU on this CPU (TPU block-shape rules, scalar prefetch, strided and bit-cast loads into Mosaic
    operations) at a Llama-3-8B layer's shapes: 8 KV heads of 4 queries, head size 128, 5 new tokens, a sliding window,
    1600 slots (a last partial block). Mosaic's own compilation needs a TPU."""
    B, T, S, K, G, H = 2, 5, 1600, 8, 4, 128
    shape = jax.ShapeDtypeStruct
    cache, stat, index = shape((2, B, S, K, H), dtype), shape((B, K, G, T), jnp.float32), shape((B,), jnp.int32)
    state = (stat, stat, shape((B, K, G, T, H), jnp.float32))

    def read(q, k, v, lengths, first, state, layer):
        return attention.read_fused(q, CachedKeys.below(k, v, lengths, first, layer), state, dtype)

    args = shape((B, T, K, G, H), dtype), cache, cache, index, shape((B, T), jnp.int32), state, shape((), jnp.int32)
    lowered = jax.jit(read).trace(*args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()


MESH_RUN = """
import jax, jax.numpy as jnp, numpy as np
from specjax.models import attention
from specjax.models.attention import CachedKeys, attend
from specjax.sharding import CACHE_AXES, make_mesh, named_sharding
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(2, 3, 2, 2, 8), (2, 2, 40, 2, 8), (2, 2, 40, 2, 8)])
new, mask = rng.standard_normal((2, 3, 2, 8)).astype(np.float32), np.tril(np.ones((2, 3, 3), bool))
attention.KV_BLOCK = 16
cached = lambda k, v: CachedKeys.below(k, v, jnp.array([37, 5]), layer=jnp.int32(1))
loop = attend(q, new, new, mask, cached(k, v), "blocks")
run = jax.jit(lambda k, v: attend(q, new, new, mask, cached(k, v), "pallas"))
mesh = make_mesh({"data": 2, "tensor": 2})
with jax.set_mesh(mesh):
    k, v = (jax.device_put(x, named_sharding(CACHE_AXES, x.shape, mesh)) for x in (k, v))
    fused = run(k, v)
    gathers = "all-gather" in run.lower(k, v).compile().as_text()
print(float(np.abs(np.asarray(fused) - np.asarray(loop)).max()), gathers)
"""


def test_fused_kernel_on_a_mesh_reads_each_devices_shard():
    """On a data=2,tensor=2 mesh of fake CPU devices, each device runs the kernel (interpreted) on its rows and KV
    heads of the cache: the loop's output, and the cache is never gathered. The kernel's check, run while the forward
    is traced on the mesh, runs off it on one device."""
    env = {
        **os.environ,
        "XLA_FLAGS": fake_devices(4),
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run([sys.executable, "-c", MESH_RUN], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    error, gathers = proc.stdout.split()
    assert float(error) <= 1e-5 and gathers == "False", proc.stdout


LONG = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=10000.0,
)


@pytest.mark.parametrize("window", [None, 24])
def test_target_forward_with_the_fused_kernel(monkeypatch, window):
    """`forward_new_kv`, a chain of 4 tokens after rows of 20 and 50 cached tokens (a Mistral sliding window or
    none), gives the loop's logits with the kernel (interpreted) reading the cache."""
    monkeypatch.setattr(attention, "KV_BLOCK", 16)
    hf = {**LONG, "model_type": "llama" if window is None else "mistral", "sliding_window": window}
    cfg = ModelConfig.from_hf(hf)
    weights = init_weights(cfg, jax.random.key(0), scale=0.2)
    rng = np.random.default_rng(1)
    cache = KVCache.empty(cfg, 2, 64)
    cache = KVCache(
        *(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (cache.k, cache.v)),
        jnp.array([20, 50], jnp.int32),
    )
    positions = cache.lengths[:, None] + jnp.arange(4)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 4)), jnp.int32)
    loop, _, _, _ = forward_new_kv(weights, dataclasses.replace(cfg, attention="blocks"), tokens, positions, cache)
    fused, _, _, _ = forward_new_kv(weights, dataclasses.replace(cfg, attention="pallas"), tokens, positions, cache)
    assert rel_err(fused, loop) <= 1e-5


TOY = ModelConfig.from_hf({**LONG, "model_type": "llama"})
PROMPTS = [[5, 17, 3], [41, 8, 90]]


def greedy(attention_choice: str, new_tokens: int = 3) -> list[list[int]]:
    """A short greedy decode of a toy model, one token per row per forward (the prompt's too: one program), jitted
    anew on each call: the attention path is chosen, and the kernel checked, as that forward is traced."""
    cfg = dataclasses.replace(TOY, attention=attention_choice)
    weights = init_weights(cfg, jax.random.key(0), scale=0.2)
    step = jax.jit(lambda token, position, cache: forward(weights, cfg, token, position, cache))
    prompts, out = np.asarray(PROMPTS, np.int32), []
    B, P = prompts.shape
    cache = KVCache.empty(cfg, B, 16)
    for i in range(P + new_tokens - 1):
        token = prompts[:, i : i + 1] if i < P else out[-1]
        logits, _, cache = step(token, jnp.full((B, 1), i), cache)
        cache = cache.advance(jnp.ones(B))
        if i >= P - 1:
            out.append(np.asarray(jnp.argmax(logits, -1), np.int32))
    return np.concatenate(out, 1).tolist()


@functools.cache
def loop_tokens() -> list[list[int]]:
    return greedy("blocks")


@pytest.fixture()
def kernel_runs(monkeypatch, caplog):
    """A process where the kernel has not been checked yet and "auto" considers it on this CPU (where it runs
    interpreted), the specjax logger's warnings going to caplog. Returns the list `cache_partials` (the kernel)
    appends to each time a forward or a check traces it."""
    monkeypatch.setattr(attention, "KERNEL_CHECKS", {})
    monkeypatch.setattr(attention, "KERNEL_PLATFORMS", ("tpu", "cpu"))
    monkeypatch.setattr(host.log, "propagate", True)
    runs, kernel = [], attention.cache_partials
    monkeypatch.setattr(attention, "cache_partials", lambda *a, **kw: runs.append(1) or kernel(*a, **kw))
    return runs


def warnings_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "specjax" and r.levelno == logging.WARNING]


def test_pallas_and_auto_decode_the_tokens_of_blocks(kernel_runs, caplog):
    """On the CPU "pallas" runs the kernel interpreted, and "auto" (made to consider it here) checks it, passes and
    runs it: both decode the loop's tokens, without a warning."""
    expected = greedy("blocks")
    assert not kernel_runs and attention.attention_path("blocks") == "blocks" and expected == loop_tokens()
    assert greedy("pallas") == expected and kernel_runs
    assert list(attention.KERNEL_CHECKS.values()) == [None]  # checked once
    kernel_runs.clear()
    assert greedy("auto") == expected and kernel_runs and attention.attention_path("auto") == "pallas"
    assert not warnings_logged(caplog)


def compile_fails(fn, *args):
    raise RuntimeError("Mosaic failed to compile the kernel (injected)\nmore lines of the compiler")


def wrong_result(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    return lambda *a: np.asarray(compiled(*a)) + 0.5


@pytest.mark.parametrize(
    "probe,why",
    [(compile_fails, "RuntimeError: Mosaic failed to compile the kernel (injected))"), (wrong_result, "off the block")],
    ids=["compile-failure", "wrong-result"],
)
def test_auto_falls_back_to_the_loop_with_one_warning(kernel_runs, caplog, monkeypatch, probe, why):
    """A kernel that fails to compile, or computes a wrong result, on its first use: "auto" warns once, decodes by
    the loop (the same tokens) and never checks or runs the kernel again in the process."""
    monkeypatch.setattr(attention, "compile_probe", probe)
    assert greedy("auto") == loop_tokens() and greedy("auto") == loop_tokens()
    (warning,) = warnings_logged(caplog)
    assert "the Pallas attention kernel failed its check on cpu" in warning and why in warning, warning
    assert "pure-JAX block loop" in warning and "\n" not in warning
    assert len(attention.KERNEL_CHECKS) == 1 and attention.attention_path("auto") == "blocks"
    assert len(kernel_runs) == (1 if probe is wrong_result else 0)  # the check's own run only


def test_pallas_refuses_where_the_kernel_fails(kernel_runs, caplog, monkeypatch):
    """ "pallas" where the kernel fails its check: an InputError naming the failure and the way around it."""
    monkeypatch.setattr(attention, "compile_probe", compile_fails)
    with pytest.raises(InputError, match="attention 'pallas': the Pallas attention kernel failed its check on cpu "):
        greedy("pallas")
    with pytest.raises(InputError, match=r"\(injected\)\); choose attention 'auto' or 'blocks'"):
        greedy("pallas")  # and again: the failure is kept, not forgotten
    assert not warnings_logged(caplog) and not kernel_runs


def test_the_attention_choice_is_checked():
    with pytest.raises(InputError, match="attention must be one of auto, blocks, pallas; got 'flash'"):
        dataclasses.replace(TOY, attention="flash")


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
        weights,
        cfg,
        jnp.asarray(nodes),
        jnp.asarray(lengths[:, None] + depths[None, :]),
        cache,
        new_mask_btt=jnp.asarray(np.broadcast_to(ancestors, (B, 6, 6))),
    )
    for b in range(B):
        for i in range(6):
            path = nodes[b, np.flatnonzero(ancestors[i])]  # the node's ancestors in depth order, then itself
            text = np.concatenate([ids[b, : lengths[b]], path])[None]
            with torch.no_grad():
                want = model(torch.tensor(text)).logits.numpy()[0, -1]
            assert rel_err(logits[b, i], want) <= 1e-4, (b, i)
