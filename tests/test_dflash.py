"""DFlash drafting on a tiny random target with untrained random drafts: the block forward against the independent
PyTorch reference (tests/dflash_reference.py) through a saved checkpoint, greedy identity with autoregressive
decoding, the draft's context cache against a fresh prefill, the exact target distribution when sampling, and the
checkpoint layout's round trip and refusals."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.decoding.speculative as spec
from specjax.adaptive import Fixed
from specjax.config import ModelConfig, RopeScaling, SamplingConfig
from specjax.decoding.autoregressive import generate as ar_generate
from specjax.decoding.batch import pack_prompts
from specjax.drafters import DFlashDrafter, drafter_from_spec
from specjax.errors import CheckpointError, InputError
from specjax.io.dflash_checkpoint import load_dflash, save_dflash
from specjax.measure.calibration import auto_max_drafts
from specjax.models.dflash import DFlashConfig, context_kv, default_target_layer_ids, init_dflash
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, init_weights
from specjax.sampling import Sampling, probabilities

# A small vocabulary, so that random drafts are often right and acceptance at every depth gets exercised.
TARGET_CFG = ModelConfig("llama", 8, 16, 32, 4, 4, 2, 8, max_position_embeddings=64, eos_token_ids=())
TARGET = init_weights(TARGET_CFG, jax.random.key(0), scale=0.5)
CFG = DFlashConfig.default_for(TARGET_CFG, mask_token_id=7, num_layers=2, block_size=5, target_layer_ids=(0, 2))
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], [4], [3, 1, 7, 2, 6]]
MAX_NEW = 16


def random_draft(key, vocab_ids=None):
    """Random weights, norms included (a norm of ones would hide a missing or misplaced one)."""
    weights = init_dflash(CFG, jax.random.key(key), vocab_ids, scale=0.3)
    leaves, treedef = jax.tree.flatten(weights)
    keys = jax.random.split(jax.random.key(key + 100), len(leaves))
    noisy = [w if w.dtype == jnp.int32 else w * (1 + 0.2 * jax.random.normal(k, w.shape)) for w, k in zip(leaves, keys)]
    return treedef.unflatten(noisy)


DRAFT = DFlashDrafter.for_target(random_draft(1), CFG, TARGET)


def test_config_conventions():
    assert CFG.tap_layers == (1, 3)  # DFlash ids are layer outputs; specjax taps are layer inputs
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    assert default_target_layer_ids(30, 1) == (15,)
    assert DFlashConfig.from_hf(CFG.to_hf(), TARGET_CFG) == CFG
    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.5)
    yarn_draft = dataclasses.replace(CFG, layers=dataclasses.replace(CFG.layers, rope_scaling=yarn))
    assert DFlashConfig.from_hf(yarn_draft.to_hf(), TARGET_CFG) == yarn_draft


def test_block_forward_matches_the_pytorch_reference(tmp_path):
    """Context of two rows of different lengths committed through the drafter, then one block: logits equal the
    reference's, which reads the saved checkpoint with safetensors and config.json on its own."""
    torch = pytest.importorskip("torch")
    from dflash_reference import block_forward
    from safetensors.torch import load_file

    save_dflash(tmp_path, CFG, DRAFT.weights, dtype=np.float32)
    ref_weights = load_file(str(tmp_path / "model.safetensors"))
    ref_config = json.loads((tmp_path / "config.json").read_text())

    tokens, lengths = pack_prompts(PROMPTS[:2], 2, 64)
    lengths = np.asarray(lengths)
    B, P = tokens.shape
    _, taps, _ = forward(
        TARGET,
        TARGET_CFG,
        jnp.asarray(tokens),
        jnp.broadcast_to(jnp.arange(P), (B, P)),
        KVCache.empty(TARGET_CFG, B, P),
        tap_layers=CFG.tap_layers,
    )
    # Context: every prompt position but the last, whose token is the block's anchor (pending).
    cache = DRAFT.commit(
        DRAFT.init(tokens, lengths, 16), jnp.asarray(tokens[:, 1:]), taps[:, :-1], jnp.asarray(lengths - 1)
    )
    pending = jnp.asarray(tokens[np.arange(B), lengths - 1])
    ours = np.asarray(DRAFT.block_logits(cache, pending, CFG.max_drafts))

    embed, head = (torch.from_numpy(np.asarray(w)) for w in (TARGET.embed, TARGET.lm_head.T))  # an untied target
    for b in range(B):
        n = int(lengths[b]) - 1
        block = torch.tensor([[int(pending[b])] + [CFG.mask_token_id] * CFG.max_drafts])
        feats = torch.from_numpy(np.asarray(taps[b : b + 1, :n]))
        ref, _ = block_forward(ref_weights, ref_config, embed, head, feats, torch.arange(n), block, n)
        ref = ref[0, 1:].numpy()
        assert np.abs(ours[b] - ref).max() <= 1e-4 * np.abs(ref).max(), np.abs(ours[b] - ref).max()


@pytest.mark.parametrize("k,vocab", [(4, None), (1, [0, 2, 3, 5])])
def test_greedy_identical_to_autoregressive_with_a_fresh_context_cache(k, vocab):
    """Greedy output equals plain decoding (full draft vocabulary and a subset), and the draft's context cache
    equals the context a fresh target prefill of the committed text gives."""
    drafter = DRAFT if vocab is None else DFlashDrafter.for_target(random_draft(1, vocab), CFG, TARGET)
    expected = ar_generate(TARGET, TARGET_CFG, PROMPTS, max_new_tokens=MAX_NEW, eos_ids=()).completions
    tokens, lengths = pack_prompts(PROMPTS, len(PROMPTS), TARGET_CFG.max_position_embeddings)
    out = spec.speculative_decode(
        TARGET,
        drafter,
        Fixed(k),
        tokens,
        lengths,
        np.full(len(PROMPTS), MAX_NEW, np.int32),
        jax.random.split(jax.random.key(0), len(PROMPTS)),
        Sampling.of(SamplingConfig(), len(PROMPTS)),
        cfg=TARGET_CFG,
        eos_ids=(),
        prefill_chunk=4,
    )
    assert np.asarray(out.out_bn)[:, :MAX_NEW].tolist() == [c.output_ids for c in expected]
    hist = np.asarray(out.state.accepted_hist)
    assert hist[0] > 0 and hist[1:].sum() > 0  # rejections and acceptances both happened

    state = out.state
    for b in range(len(PROMPTS)):
        n = int(state.length_b[b]) - 1  # the pending token is in neither cache
        assert int(state.draft_state.lengths[b]) == int(state.cache.lengths[b]) == n
        text = jnp.asarray(state.tokens_bs[b : b + 1, :n])
        _, taps, _ = forward(
            TARGET, TARGET_CFG, text, jnp.arange(n)[None], KVCache.empty(TARGET_CFG, 1, n), tap_layers=CFG.tap_layers
        )
        k_ctx, v_ctx = context_kv(drafter.weights, CFG, taps, jnp.arange(n)[None])
        np.testing.assert_allclose(state.draft_state.k[:, b, :n], k_ctx[:, 0], atol=2e-5)
        np.testing.assert_allclose(state.draft_state.v[:, b, :n], v_ctx[:, 0], atol=2e-5)


# ---------------------------------------------------------------------------------------------------------------
# Distribution: the first three tokens of many rows against the target's exact joint distribution.

DIST_PROMPT = [3, 5]
SAMPLES = 16384


def exact_joint(sampling: SamplingConfig) -> np.ndarray:
    V = TARGET_CFG.vocab_size
    t1, t2 = np.meshgrid(np.arange(V), np.arange(V), indexing="ij")
    seqs = np.stack([np.full(V * V, DIST_PROMPT[0]), np.full(V * V, DIST_PROMPT[1]), t1.ravel(), t2.ravel()], 1)
    B, T = seqs.shape
    logits, _, _ = forward(
        TARGET,
        TARGET_CFG,
        jnp.asarray(seqs, jnp.int32),
        jnp.broadcast_to(jnp.arange(T), (B, T)),
        KVCache.empty(TARGET_CFG, B, T),
    )
    probs = np.asarray(probabilities(logits, Sampling.of(sampling)), np.float64).reshape(V, V, T, V)
    return probs[0, 0, 1][:, None, None] * probs[:, 0, 2][:, :, None] * probs[:, :, 3]


def sampled_joint(sampling: SamplingConfig, drafter, k: int) -> np.ndarray:
    tokens, lengths = pack_prompts([DIST_PROMPT], 1, TARGET_CFG.max_position_embeddings)
    out = spec.speculative_decode(
        TARGET,
        drafter,
        Fixed(k),
        tokens,
        lengths,
        np.full(SAMPLES, 3, np.int32),
        jax.random.split(jax.random.key(0), SAMPLES),
        Sampling.of(sampling),
        cfg=TARGET_CFG,
        eos_ids=(),
        num_samples=SAMPLES,
        prefill_chunk=2,
    )
    V = TARGET_CFG.vocab_size
    flat = np.asarray(out.out_bn)[:, :3] @ np.array([V * V, V, 1])
    return np.bincount(flat, minlength=V**3).reshape(V, V, V) / SAMPLES


@pytest.mark.parametrize(
    "sampling,vocab",
    [(SamplingConfig(temperature=1.0), None), (SamplingConfig(temperature=0.8, top_p=0.8), [0, 2, 3, 5, 6])],
)
def test_sampled_distribution_equals_the_target(sampling, vocab):
    """Drafts drawn in parallel from their rows' distributions (over a draft vocabulary too) keep the target's."""
    drafter = DRAFT if vocab is None else DFlashDrafter.for_target(random_draft(2, vocab), CFG, TARGET)
    exact = exact_joint(sampling)
    empirical = sampled_joint(sampling, drafter, k=3)
    bound = np.sum(np.sqrt(2 * exact * (1 - exact) / (np.pi * SAMPLES)))  # ~2x the noise of SAMPLES draws
    assert 0.5 * np.abs(empirical - exact).sum() < bound


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints.


def test_checkpoint_round_trip_and_published_names(tmp_path):
    save_dflash(tmp_path / "bf16", CFG, DRAFT.weights)
    cfg, weights = load_dflash(tmp_path / "bf16", TARGET_CFG)
    assert cfg == CFG
    for ours, saved in zip(jax.tree.leaves(DRAFT.weights), jax.tree.leaves(weights)):
        np.testing.assert_allclose(saved, ours, rtol=1e-2, atol=1e-2)  # bfloat16 on disk
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert len(names) == 3 + 11 * CFG.layers.num_layers
    hf = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert hf["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [0, 2]} and hf["block_size"] == 5

    save_dflash(tmp_path / "subset", CFG, random_draft(3, [0, 2, 5]))  # specjax's draft vocabulary travels along
    assert load_dflash(tmp_path / "subset", TARGET_CFG)[1].vocab_ids.tolist() == [0, 2, 5]

    # A "model." prefix and DFlash keys at the top level (third-party layouts) read the same.
    from safetensors.numpy import load_file, save_file

    (tmp_path / "prefixed").mkdir()
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    save_file({"model." + k: v for k, v in tensors.items()}, str(tmp_path / "prefixed" / "model.safetensors"))
    flat = {k: v for k, v in hf.items() if k != "dflash_config"} | hf["dflash_config"]
    (tmp_path / "prefixed" / "config.json").write_text(json.dumps(flat))
    cfg2, weights2 = load_dflash(tmp_path / "prefixed", TARGET_CFG)
    assert cfg2 == CFG
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(weights2)))


def test_bad_drafts_are_refused(tmp_path):
    save_dflash(tmp_path, CFG, DRAFT.weights, dtype=np.float32)
    other = dataclasses.replace(TARGET_CFG, hidden_size=32)
    with pytest.raises(InputError, match="width"):
        load_dflash(tmp_path, other)
    with pytest.raises(InputError, match="at most 4 tokens"):
        DRAFT.validate(TARGET_CFG, 5)
    with pytest.raises(InputError, match="draft folder"):
        drafter_from_spec("dflash:", TARGET, TARGET_CFG)
    with pytest.raises(CheckpointError, match="not a folder"):
        drafter_from_spec(f"dflash:{tmp_path / 'missing'}", TARGET, TARGET_CFG)
    # Adaptive drafting stays within the block, alone and behind prompt lookup.
    lookup_first = drafter_from_spec(f"ngram+dflash:{tmp_path}", TARGET, TARGET_CFG)
    assert auto_max_drafts(DRAFT) == auto_max_drafts(lookup_first) == CFG.max_drafts == 4

    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | {"layer_types": ["sliding_attention"] * 2}))
    with pytest.raises(CheckpointError, match="full-attention"):
        load_dflash(tmp_path, TARGET_CFG)
    (tmp_path / "config.json").write_text(json.dumps(hf))

    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight"):
        load_dflash(tmp_path, TARGET_CFG)
