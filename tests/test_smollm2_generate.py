"""Greedy decoding of the embedded SmolLM2 reproduces HF transformers' greedy `generate` token for token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.decoding.autoregressive import generate
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France?",
    "Translate into French: The weather is lovely today and we are going to the beach.",
    "hi",
    "Qu'est-ce que l'apprentissage automatique ? Réponds brièvement.",
    "def fibonacci(n):\n    # complete this function\n",
    "A train leaves at 3pm travelling at 60 km/h. How far has it gone by 5:30pm? Show your reasoning step by step.",
]


# 16 tokens of each prompt in CI; 48, where a small rounding difference has more room to change a token, with -m slow.
@pytest.mark.parametrize("max_new_tokens", [16, pytest.param(48, marks=pytest.mark.slow)])
def test_greedy_batch_matches_transformers_generate(smollm2, hf_smollm2, max_new_tokens):
    tok = smollm2.tokenizer
    prompt_ids = [tok.chat_prompt_ids(p) for p in PROMPTS]
    assert len({len(p) for p in prompt_ids}) > 5  # a batch of mixed lengths
    eos = tuple(tok.eos_token_ids)
    ours = generate(smollm2.weights, smollm2.cfg, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos)
    for ids, completion in zip(prompt_ids, ours.completions):
        with torch.no_grad():
            out = hf_smollm2.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=list(eos),
                pad_token_id=eos[0],
            )
        expected = out[0, len(ids) :].tolist()
        assert completion.output_ids == expected, tok.decode(ids)


def test_step_by_step_decode_logits_match_transformers(smollm2, hf_smollm2):
    ids = smollm2.tokenizer.chat_prompt_ids(PROMPTS[0]) + smollm2.tokenizer.encode("```python\ndef is_prime(n):")
    with torch.no_grad():
        expected = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
    run = jax.jit(forward, static_argnums=1)
    cfg, P = smollm2.cfg, 20
    cache = KVCache.empty(cfg, 1, len(ids))
    logits, _, cache = run(smollm2.weights, cfg, jnp.asarray([ids[:P]]), jnp.arange(P)[None], cache)
    steps = [np.asarray(logits[0])]
    cache = cache.advance(jnp.array([P]))
    for t in range(P, len(ids)):
        logits, _, cache = run(smollm2.weights, cfg, jnp.asarray([[ids[t]]]), jnp.asarray([[t]]), cache)
        cache = cache.advance(jnp.array([1]))
        steps.append(np.asarray(logits[0]))
    ours = np.concatenate(steps)
    assert np.abs(ours - expected).max() / np.abs(expected).max() <= 1e-4
