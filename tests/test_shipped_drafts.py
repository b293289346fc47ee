"""The drafts shipped with specjax load by name for the embedded SmolLM2, decode greedily exactly as plain decoding
does, and are trained: their drafts are accepted (a random draft's almost never are)."""

import pytest

from specjax.decoding import speculative
from specjax.decoding.autoregressive import generate
from specjax.drafters import drafter_from_spec

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
]


@pytest.fixture(scope="module")
def plain(smollm2):
    """Plain greedy decoding of PROMPTS: (prompt ids, completions)."""
    prompts = [smollm2.tokenizer.chat_prompt_ids(p) for p in PROMPTS]
    return prompts, generate(smollm2.weights, smollm2.cfg, prompts, max_new_tokens=48, eos_ids=()).completions


@pytest.mark.parametrize("spec", ["eagle3:smollm2-135m", "dflash:smollm2-135m"])
def test_a_shipped_draft_decodes_like_plain_greedy_and_is_accepted(smollm2, plain, spec):
    prompts, completions = plain
    drafter = drafter_from_spec(spec, smollm2.weights, smollm2.cfg)
    spec_out = speculative.speculative_generate(
        smollm2.weights, smollm2.cfg, prompts, drafter=drafter, num_draft_tokens=4, max_new_tokens=48, eos_ids=()
    )
    assert [c.output_ids for c in spec_out.completions] == [c.output_ids for c in completions]
    assert spec_out.stats.mean_accepted > 1.3, spec_out.stats
