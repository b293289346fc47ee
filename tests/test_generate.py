"""The autoregressive loop on a tiny random model: batching, stopping, compilation, and agreement with a plain loop."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding import autoregressive as gen
from specjax.decoding import batch, speculative
from specjax.drafters import NgramDrafter
from specjax.errors import InputError
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, init_weights

CFG = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=128, eos_token_ids=(1,))
WEIGHTS = init_weights(CFG, jax.random.key(0), scale=0.3)
PROMPTS = [[5, 6, 7], list(range(10, 31)), [42], [3, 9, 27, 17, 51, 25, 11]]


@jax.jit
def full_logits(ids_1t):
    T = ids_1t.shape[1]
    return forward(WEIGHTS, CFG, ids_1t, jnp.arange(T)[None], KVCache.empty(CFG, 1, T))[0][0]


def naive_greedy(prompt, n):
    """Recomputes the whole (right-padded, causal) sequence every step, no cache reuse: an independent reference."""
    ids = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, 64), np.int32)
        padded[0, : len(ids)] = ids
        ids.append(int(jnp.argmax(full_logits(jnp.asarray(padded))[len(ids) - 1])))
    return ids[len(prompt) :]


def test_greedy_matches_full_recomputation_and_rows_are_independent():
    batched = gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=12, eos_ids=())
    for prompt, completion in zip(PROMPTS, batched.completions):
        assert completion.output_ids == naive_greedy(prompt, 12)
        alone = gen.generate(WEIGHTS, CFG, [prompt], max_new_tokens=12, eos_ids=())
        assert alone.completions[0].output_ids == completion.output_ids
        assert completion.finish_reason == "length"


def test_rows_stop_at_eos_independently():
    free = gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=10, eos_ids=())
    # Declare a token that some row emits mid-way an EOS: that row stops there, the others go on unchanged.
    emitted = free.completions[1].output_ids
    eos = emitted[3]
    stopped = gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=10, eos_ids=[eos])
    for a, b in zip(free.completions, stopped.completions):
        cut = a.output_ids.index(eos) + 1 if eos in a.output_ids else len(a.output_ids)
        assert b.output_ids == a.output_ids[:cut]
        assert b.finish_reason == ("stop" if eos in a.output_ids else "length")
    assert len(stopped.completions[1].output_ids) <= 4


def test_compiles_once_per_shape(monkeypatch):
    traces = []
    original = gen.prefill_prompts
    monkeypatch.setattr(gen, "prefill_prompts", lambda *a, **k: traces.append(1) or original(*a, **k))
    batch._EXECUTABLES.clear()
    gen.decode.clear_cache()
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    first = gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=6, sampling=sampling, seed=3)
    second = gen.generate(WEIGHTS, CFG, PROMPTS[::-1], max_new_tokens=6, sampling=sampling, seed=3)
    assert len(traces) == 1 and second.compile_seconds == 0
    other_values = [SamplingConfig(0.5), SamplingConfig(), SamplingConfig(1.0, top_k=4), SamplingConfig(2.0)]
    mixed = gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=6, sampling=other_values, seed=3)
    assert len(traces) == 1 and mixed.compile_seconds == 0  # new values, one per row: data, not a new program
    assert (
        mixed.completions[1].output_ids
        == gen.generate(WEIGHTS, CFG, PROMPTS[1:2], max_new_tokens=6).completions[0].output_ids
    )  # the greedy row of the mixed batch
    again = gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=6, sampling=sampling, seed=3)
    assert [c.output_ids for c in again.completions] == [c.output_ids for c in first.completions]
    other_seed = gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=6, sampling=sampling, seed=4)
    assert [c.output_ids for c in other_seed.completions] != [c.output_ids for c in first.completions]


def test_batch_padding_rows_do_not_change_results():
    a = gen.generate(WEIGHTS, CFG, PROMPTS[:3], max_new_tokens=5, eos_ids=())
    b = gen.generate(WEIGHTS, CFG, PROMPTS[:3], max_new_tokens=5, eos_ids=(), batch_size=8)
    assert [c.output_ids for c in a.completions] == [c.output_ids for c in b.completions]


def test_bad_input():
    with pytest.raises(InputError, match="maximum length"):
        gen.generate(WEIGHTS, CFG, [[2] * 100], max_new_tokens=40)
    with pytest.raises(InputError, match="at least one token"):
        gen.generate(WEIGHTS, CFG, [[]], max_new_tokens=4)
    with pytest.raises(InputError, match="max_new_tokens"):
        gen.generate(WEIGHTS, CFG, [[2]], max_new_tokens=0)
    with pytest.raises(InputError, match=f"token id {10**7} is outside the model's vocabulary 0..{CFG.vocab_size - 1}"):
        gen.generate(WEIGHTS, CFG, [[2], [10**7]], max_new_tokens=4)
    with pytest.raises(InputError, match="token id -1 is outside"):
        speculative.speculative_generate(
            WEIGHTS, CFG, [[-1]], drafter=NgramDrafter(2), num_draft_tokens=2, max_new_tokens=4
        )
    with pytest.raises(InputError, match="1 seeds for 2 prompts; give one, or one per prompt"):
        gen.generate(WEIGHTS, CFG, [[2], [3]], max_new_tokens=4, seed=[1])
    for seed in ([1, -1], [1, 2**63], [1, 2.0], "12"):
        with pytest.raises(InputError, match=r"seed must be an integer in 0\.\.2\*\*63-1"):
            speculative.speculative_generate(
                WEIGHTS, CFG, [[2], [3]], drafter=NgramDrafter(2), num_draft_tokens=2, max_new_tokens=4, seed=seed
            )


def test_requests_share_one_width_a_power_of_two_of_prompt_and_new_tokens():
    long = dataclasses.replace(CFG, max_position_embeddings=4096)
    assert [batch.num_slots(long, n) for n in (1, 256, 257, 500, 4000)] == [256, 256, 512, 512, 4096]
    assert batch.num_slots(CFG, 20) == 128  # within the model's length
    tokens, lengths = batch.pack_prompts([[1] * 17, [2]], batch=3, width=128)
    assert tokens.shape == (3, 128) and lengths.tolist() == [17, 1, 17]
    assert np.all(tokens[1, 1:] == 0)
    req = batch.prepare_batch(CFG, PROMPTS[:2], [3, 9], (), 3, SamplingConfig(), num_samples=2)
    assert req.tokens.shape == (3, 128) and req.max_new.tolist() == [3, 3, 9, 9, 3, 3]
    with pytest.raises(InputError, match="2 max_new_tokens for 4 prompts"):
        gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=[3, 4])


def test_max_new_tokens_per_row_and_prefill_chunks_are_data_and_exact():
    """Each row's own limit, and any prefill chunk, give what each request decoded alone gives; limits and prompt
    lengths compile nothing new."""
    limits = [3, 12, 1, 7]
    before = batch.compilations().get("decode", 0)
    mixed = gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=limits, eos_ids=(), prefill_chunk=4)
    for prompt, n, completion in zip(PROMPTS, limits, mixed.completions):
        alone = gen.generate(WEIGHTS, CFG, [prompt], max_new_tokens=n, eos_ids=(), batch_size=4, prefill_chunk=4)
        assert completion.output_ids == alone.completions[0].output_ids == naive_greedy(prompt, n)
    assert batch.compilations()["decode"] - before <= 1
    whole = gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=limits, eos_ids=(), prefill_chunk=128)
    assert [c.output_ids for c in whole.completions] == [c.output_ids for c in mixed.completions]
    with pytest.raises(InputError, match="prefill_chunk must be >= 1"):
        gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=2, prefill_chunk=0)


def test_samples_of_a_prompt_share_one_prefill(monkeypatch):
    """num_samples rows per prompt: the target prefills each prompt once, and its KV serves every sample."""
    prefilled_rows = []
    original = gen.prefill_prompts
    monkeypatch.setattr(
        gen, "prefill_prompts", lambda w, c, t, *a, **k: prefilled_rows.append(t.shape[0]) or original(w, c, t, *a, **k)
    )
    gen.decode.clear_cache()
    batch._EXECUTABLES.clear()
    greedy = gen.generate(WEIGHTS, CFG, PROMPTS[:2], max_new_tokens=8, eos_ids=(), num_samples=3)
    assert prefilled_rows == [2]
    alone = gen.generate(WEIGHTS, CFG, PROMPTS[:2], max_new_tokens=8, eos_ids=())
    expected = [c.output_ids for c in alone.completions for _ in range(3)]
    assert [c.output_ids for c in greedy.completions] == expected
    assert [c.prompt_ids for c in greedy.completions] == [p for p in PROMPTS[:2] for _ in range(3)]
    sampled = gen.generate(
        WEIGHTS, CFG, PROMPTS[:1], max_new_tokens=8, eos_ids=(), num_samples=6, sampling=SamplingConfig(temperature=1.0)
    )
    assert len({tuple(c.output_ids) for c in sampled.completions}) > 1  # independent samples, not one copied
    with pytest.raises(InputError, match="num_samples must be >= 1"):
        gen.generate(WEIGHTS, CFG, PROMPTS, max_new_tokens=4, num_samples=0)
