"""Drafters alone: prompt lookup on hand-made texts, layer-skip = the truncated target, real draft_probs, specs, the
registry."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters_fixture import drafter_cases
from repeat_drafter import REPEAT, RepeatLastDrafter

from specjax.cli.generate import entry
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.autoregressive import generate as ar_generate
from specjax.decoding.batch import pack_prompts
from specjax.drafters import (
    Drafter,
    LayerSkipDrafter,
    LookupFirstDrafter,
    ModelDrafter,
    NgramDrafter,
    drafter_from_spec,
    draw,
    entries,
    ngram_lookup,
    ngram_proposal,
    register,
    spec_help,
)
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError
from specjax.io.hf import save_hf
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, init_weights
from specjax.sampling import Sampling, probabilities

CFG = ModelConfig("llama", 64, 32, 64, 3, 4, 2, 8, max_position_embeddings=128, eos_token_ids=(1,))
WEIGHTS = init_weights(CFG, jax.random.key(0), scale=0.3)


def lookup(text, k, max_n, min_n=1, slack=6):
    tokens = np.zeros((1, len(text) + slack), np.int32)
    tokens[0, : len(text)] = text
    tokens[0, len(text) :] = 99  # stale slots must never be read
    return ngram_proposal(jnp.asarray(tokens), jnp.array([len(text)]), k, max_n, min_n)[0].tolist()


def test_ngram_proposes_what_followed_the_most_recent_match():
    # Tail [7, 8] occurred at 1..2 (followed by 9, 10) and at 5..6 (followed by 11, 12): the most recent wins.
    assert lookup([6, 7, 8, 9, 10, 7, 8, 11, 12, 13, 7, 8], 3, max_n=2) == [11, 12, 13]
    # A longer matching tail beats a more recent shorter one: [5, 7, 8] matched at 0..2.
    assert lookup([5, 7, 8, 9, 4, 7, 8, 3, 5, 7, 8], 2, max_n=3) == [9, 4]
    # With min_n = 3 the single-token tail match does not count.
    assert lookup([1, 2, 3, 4, 9, 9, 4], 2, max_n=3, min_n=3) == [4, 4]  # no match: the last token repeated
    assert lookup([1, 2, 3, 4, 9, 9, 4], 2, max_n=3, min_n=1) == [9, 9]
    # The matched tail length comes with the proposal (0 without a match).
    matched = [
        int(ngram_lookup(jnp.asarray([text]), jnp.array([len(text)]), 2, 3, min_n)[1][0])
        for text, min_n in (
            ([5, 7, 8, 9, 4, 7, 8, 3, 5, 7, 8], 1),
            ([1, 2, 3, 4, 9, 9, 4], 1),
            ([1, 2, 3, 4, 9, 9, 4], 3),
        )
    ]
    assert matched == [3, 1, 0]


def test_ngram_continuation_runs_periodically_into_the_tail():
    # A repetition loop [a b c] [a b c] [a b]: the match ends one period back; the loop is predicted to go on.
    assert lookup([1, 2, 3, 1, 2, 3, 1, 2], 5, max_n=2) == [3, 1, 2, 3, 1]
    assert lookup([4, 4, 4], 4, max_n=3) == [4, 4, 4, 4]


def test_ngram_rows_are_independent_and_probs_are_one_hot():
    tokens, lengths = pack_prompts([[1, 2, 3, 1, 2], [5, 6, 5], [9]], 3, 64)
    drafter = NgramDrafter(max_n=2)
    keys_b = jax.random.split(jax.random.key(0), 3)
    draft, probs, state = drafter.propose_chain(
        drafter.init(tokens, lengths, 64),
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        keys_b,
        num_draft_tokens=3,
        vocab_size=16,
        sampling=Sampling.of(SamplingConfig(0.7)),
    )
    assert draft.tolist() == [[3, 1, 2], [6, 5, 6], [9, 9, 9]]
    np.testing.assert_array_equal(probs, jax.nn.one_hot(draft, 16))
    assert isinstance(drafter, Drafter)


def truncated(n):
    cfg = dataclasses.replace(CFG, num_layers=n)
    return cfg, dataclasses.replace(WEIGHTS, layers=jax.tree.map(lambda a: a[:n], WEIGHTS.layers))


@functools.partial(jax.jit, static_argnames=("k",))
def propose(drafter, tokens_bs, length_b, seed, k, sampling):
    state = drafter.init(tokens_bs, length_b - 1, tokens_bs.shape[1] + k + 2)
    keys_b = jax.random.split(jax.random.key(seed), tokens_bs.shape[0])
    return drafter.propose_chain(
        state, tokens_bs, length_b, keys_b, num_draft_tokens=k, vocab_size=64, sampling=sampling
    )[:2]


@pytest.mark.parametrize(
    "setting",
    [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.0, top_k=3), dict(temperature=1.3, top_p=0.6)],
)
def test_a_draw_in_a_draft_vocabulary_is_the_draw_over_target_logits_masked_outside_it(setting):
    V, vocab_ids = 40, jnp.asarray([2, 5, 6, 11, 17, 23, 30, 39], jnp.int32)
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, len(vocab_ids))) * 2, jnp.float32)
    full_logits = jnp.full((2, 3, V), -jnp.inf).at[..., vocab_ids].set(logits)
    rows = Sampling.of([SamplingConfig(**setting), SamplingConfig(**setting)])
    token, probs = draw(jax.random.split(jax.random.key(4), 2), logits, rows, vocab_ids, V)
    np.testing.assert_allclose(probs, probabilities(full_logits, rows), rtol=1e-6, atol=1e-7)
    assert probs.shape == (2, 3, V) and np.all(np.isin(np.asarray(token), np.asarray(vocab_ids)))
    assert np.all(np.take_along_axis(np.asarray(probs), np.asarray(token)[..., None], -1) > 0)
    if rows.greedy:
        assert np.array_equal(token, jnp.argmax(full_logits, -1))


def test_layer_skip_drafts_like_the_truncated_target():
    prompts = [[5, 6, 7, 8], [42, 3]]
    small_cfg, small_weights = truncated(2)
    # The committed text is the prompt plus one token; the drafter continues it greedily.
    tokens, lengths = pack_prompts(prompts, 2, 64)
    expected = [
        c.output_ids for c in ar_generate(small_weights, small_cfg, prompts, max_new_tokens=5, eos_ids=()).completions
    ]
    for i in range(2):
        tokens[i, lengths[i]] = expected[i][0]
    drafter = LayerSkipDrafter(WEIGHTS, CFG, 2)
    draft, probs = propose(drafter, jnp.asarray(tokens), jnp.asarray(lengths + 1), 0, 4, Sampling.of(SamplingConfig()))
    assert draft.tolist() == [e[1:5] for e in expected]
    np.testing.assert_array_equal(probs, jax.nn.one_hot(draft, 64))
    # At temperature > 0 the first draft's probs are the truncated model's processed distribution.
    sampling = Sampling.of(SamplingConfig(temperature=0.7, top_k=10))
    _, probs = propose(drafter, jnp.asarray(tokens), jnp.asarray(lengths + 1), 0, 2, sampling)
    for i, prompt in enumerate(prompts):
        ids = jnp.asarray([prompt + expected[i][:1]])
        T = ids.shape[1]
        logits = forward(small_weights, small_cfg, ids, jnp.arange(T)[None], KVCache.empty(small_cfg, 1, T))[0]
        want = jax.nn.softmax(
            jnp.where(
                logits[0, -1] / 0.7 < jax.lax.top_k(logits[0, -1] / 0.7, 10)[0][-1], -jnp.inf, logits[0, -1] / 0.7
            )
        )
        np.testing.assert_allclose(probs[i, 0], want, atol=1e-5)
        assert np.count_nonzero(np.asarray(probs[i, 1])) == 10 and np.isclose(float(probs[i, 1].sum()), 1, atol=1e-5)


def test_drafter_from_spec():
    assert drafter_from_spec("none", WEIGHTS, CFG) is None
    assert drafter_from_spec("ngram", WEIGHTS, CFG) == NgramDrafter(3)
    assert drafter_from_spec("ngram:5", WEIGHTS, CFG) == NgramDrafter(5)
    skip = drafter_from_spec("layerskip:2", WEIGHTS, CFG)
    assert isinstance(skip, LayerSkipDrafter) and skip.num_layers == 2
    model = drafter_from_spec("model:x", WEIGHTS, CFG, load=lambda path: (CFG, WEIGHTS))
    assert isinstance(model, ModelDrafter)
    lookup = drafter_from_spec("ngram+layerskip:2", WEIGHTS, CFG)
    assert isinstance(lookup, LookupFirstDrafter) and lookup.n == 3 and lookup.fallback.num_layers == 2
    other = dataclasses.replace(CFG, vocab_size=32)
    bad = {
        "ngram:0": "n-gram",
        "ngram:x": "integer",
        "layerskip": "layer count",
        "layerskip:0": "layer-skip",
        "layerskip:3": "layer-skip",
        "model": "checkpoint",
        "eagle": "unknown drafter",
        "ngram+none": "fallback",
        "ngram+layerskip:0": "layer-skip",
    }
    for spec, message in bad.items():
        with pytest.raises(InputError, match=message):
            drafter_from_spec(spec, WEIGHTS, CFG, load=lambda path: (CFG, WEIGHTS))
    with pytest.raises(InputError, match="vocabulary"):
        drafter_from_spec("model:x", WEIGHTS, CFG, load=lambda path: (other, init_weights(other, jax.random.key(0))))
    with pytest.raises(InputError, match="drafts chains: drop tree, "):
        drafter_from_spec("ngram+eagle3:x", WEIGHTS, CFG, tree=TreeSpec(3, 2, 4))


def test_a_drafter_added_by_registration_alone_is_in_every_spec_help_and_shared_test():
    """The tests' own drafter (`repeat_drafter`, registered by the conftest and by nothing else) is built from its
    spec, listed in the help, and a case of the shared parametrization, which the greedy exactness test
    (test_speculative.py) and the refilled-slots test (test_engine.py) run; a taken name is refused."""
    drafter = drafter_from_spec("repeat", WEIGHTS, CFG)
    assert isinstance(drafter, RepeatLastDrafter)
    lookup_first = drafter_from_spec("ngram:2+repeat", WEIGHTS, CFG)
    assert isinstance(lookup_first, LookupFirstDrafter) and isinstance(lookup_first.fallback, RepeatLastDrafter)
    assert "repeat (the last token, K times)" in spec_help() and REPEAT in entries()
    assert drafter_cases()["repeat"].entry is REPEAT
    assert drafter_cases()["repeat"].build(WEIGHTS, CFG) == RepeatLastDrafter()
    with pytest.raises(InputError, match="cannot register"):
        register(REPEAT)
    with pytest.raises(InputError, match="drafts chains"):
        drafter_from_spec("repeat", WEIGHTS, CFG, tree=TreeSpec(3, 2, 4))


# ---------------------------------------------------------------------------------------------------------------
# specjax-generate --drafter: JSON statistics, identity with plain decoding, one-line errors.


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory, smollm2):
    """A tiny random llama with SmolLM2's tokenizer, and one with a smaller vocabulary (an unusable draft model)."""
    folders = []
    for name, vocab in (("tiny", smollm2.tokenizer.vocab_size), ("small_vocab", 1000)):
        folder = tmp_path_factory.mktemp(name)
        cfg = ModelConfig("llama", vocab, 16, 32, 2, 2, 1, 8, max_position_embeddings=256, eos_token_ids=(2,))
        save_hf(folder, cfg, init_weights(cfg, jax.random.key(0), scale=0.5))
        smollm2.tokenizer.to_folder(folder)
        folders.append(folder)
    return folders


def test_cli_speculative_json(tiny_folders, tmp_path):
    tiny = str(tiny_folders[0])
    base = ["--model", tiny, "--prompt", "Say hello", "--prompt", "Count", "--max-new-tokens", "12"]
    entry([*base, "--json", str(tmp_path / "ar.json")])
    entry([*base, "--drafter", "ngram:2", "--num-draft-tokens", "3", "--json", str(tmp_path / "ng.json")])
    ar, ng = (json.loads((tmp_path / f).read_text()) for f in ("ar.json", "ng.json"))
    assert [r["output_ids"] for r in ng["results"]] == [r["output_ids"] for r in ar["results"]]
    stats = ng["results"][0]["stats"]
    assert stats["rounds"] >= 1 and 1 <= stats["mean_accepted"] <= 4 and len(stats["acceptance_by_position"]) == 3
    assert ng["config"]["drafter"] == "ngram:2" and "mean_accepted" not in ar["results"][0]["stats"]
    out = tmp_path / "samples.json"
    entry(
        [
            "--model",
            tiny,
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "4",
            "--temperature",
            "1",
            "--num-samples",
            "3",
            "--drafter",
            f"model:{tiny}",
            "--num-draft-tokens",
            "2",
            "--json",
            str(out),
        ]
    )
    results = json.loads(out.read_text())["results"]
    assert [r["prompt"] for r in results] == ["Hi"] * 3 and results[0]["stats"]["mean_accepted"] == 3.0


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--drafter", "ngram", "--num-draft-tokens", "0"], "draft tokens"),
        (["--drafter", "ngram", "--num-draft-tokens", "1000"], "draft tokens"),
        (["--drafter", "ngram:0"], "n-gram"),
        (["--drafter", "layerskip:2"], "layer-skip"),
        (["--drafter", "medusa"], "unknown drafter"),
        (["--drafter", "model:SMALL_VOCAB"], "vocabulary"),
        (["--num-samples", "0"], "num-samples"),
        (["--lookup-tokens", "8"], "lookup-first"),
    ],
)
def test_cli_bad_drafter_input_is_one_line_and_exit_2(flags, needle, tiny_folders, capsys):
    flags = [f.replace("SMALL_VOCAB", str(tiny_folders[1])) for f in flags]
    with pytest.raises(SystemExit) as exit_info:
        entry(["--model", str(tiny_folders[0]), "--max-new-tokens", "2", *flags])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and needle in err, err
