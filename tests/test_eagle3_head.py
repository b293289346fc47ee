"""EAGLE-3 head forward: parity with an independent PyTorch implementation written from docs/eagle3-head.md,
section 2."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specjax.config import ModelConfig, RopeScaling
from specjax.io.eagle3_checkpoint import head_to_hf
from specjax.models import llama
from specjax.models.eagle3 import Eagle3Config, Eagle3Head, param_specs, vocab_map_from_ids

TARGET = ModelConfig(
    "llama",
    vocab_size=96,
    hidden_size=24,
    intermediate_size=40,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=6,
    rope_theta=50000.0,
)


def head_config(own_embedding: bool) -> Eagle3Config:
    """GQA (4 heads over 2), head_dim * heads != hidden, a reduced vocabulary, RoPE settings unlike the target's."""
    return Eagle3Config(
        hidden_size=24 if not own_embedding else 32,
        intermediate_size=48,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=TARGET.vocab_size,
        draft_vocab_size=40,
        target_num_layers=TARGET.num_layers,
        target_hidden_size=TARGET.hidden_size,
        rms_norm_eps=1e-5,
        rope_theta=700.0,
        rope_scaling=RopeScaling("linear", 2.0) if own_embedding else None,
    )


def random_head(cfg: Eagle3Config, seed: int = 0, own_embedding: bool | None = None) -> Eagle3Head:
    """A head whose weights (norms included) and draft vocabulary are all random."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, spec in param_specs(cfg).items():
        base = 1.0 if len(spec.shape) == 1 else 0.0
        weights[name] = (base + 0.15 * rng.standard_normal(spec.shape)).astype(np.float32)
    if cfg.needs_own_embedding if own_embedding is None else own_embedding:
        weights["embed"] = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    used = rng.choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False)
    weights["d2t"], _ = vocab_map_from_ids(used.tolist(), cfg.vocab_size)
    return Eagle3Head(cfg, weights=weights)


# ---------------------------------------------------------------------------------------------------------------
# The reference: plain PyTorch over the published [out, in] tensors, full attention over all rows seen so far.


class TorchEagle3:
    def __init__(self, cfg: Eagle3Config, tensors: dict[str, np.ndarray]):
        self.cfg = cfg
        self.w = {k: torch.from_numpy(np.asarray(v).copy()) for k, v in tensors.items()}
        self.past_k = self.past_v = None

    def rms(self, x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps))

    def rope(self, x, pos):  # x [B, heads, T, hd], pos [B, T]
        c, hd = self.cfg, self.cfg.head_dim
        inv, scale = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)), 1.0
        if c.rope_scaling is not None:  # transformers' frequencies and cos/sin factor for the head's config
            hf = transformers.LlamaConfig(
                hidden_size=c.hidden_size,
                num_attention_heads=c.num_heads,
                head_dim=hd,
                rope_theta=c.rope_theta,
                max_position_embeddings=c.max_position_embeddings,
                rope_scaling=c.rope_scaling.to_hf(),
            )
            inv, scale = ROPE_INIT_FUNCTIONS[c.rope_scaling.rope_type](hf)
        ang = pos.double()[..., None] * inv.double()  # [B, T, hd/2]
        emb = torch.cat([ang, ang], -1)[:, None]
        cos, sin = (emb.cos() * scale).float(), (emb.sin() * scale).float()
        half = hd // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def fc(self, taps):
        return taps @ self.w["fc.weight"].T

    def __call__(self, e, g, pos):
        """Appends T rows (causal among themselves, seeing every earlier row); returns (logits, next g).

        The next g is the pre-norm output (EAGLE-3) or, with norm_output, the post-norm one (EAGLE-3.1).
        """
        c, w = self.cfg, self.w
        B, T, _ = e.shape
        p = "midlayer."
        x = torch.cat([self.rms(e, w[p + "input_layernorm.weight"]), self.rms(g, w[p + "hidden_norm.weight"])], -1)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = self.rope(q, pos), self.rope(k, pos)
        if self.past_k is not None:
            k, v = torch.cat([self.past_k, k], 2), torch.cat([self.past_v, v], 2)
        self.past_k, self.past_v = k, v
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        P = k.shape[2] - T
        allowed = torch.ones(T, P + T, dtype=torch.bool)
        allowed[:, P:] = torch.tril(torch.ones(T, T, dtype=torch.bool))
        scores = (q @ k.transpose(-1, -2)) / c.head_dim**0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
        residual = self.rms(g, w[p + "hidden_norm.weight"]) if c.norm_before_residual else g
        h1 = residual + attn @ w[p + "self_attn.o_proj.weight"].T
        n = self.rms(h1, w[p + "post_attention_layernorm.weight"])
        act = torch.nn.functional.silu(n @ w[p + "mlp.gate_proj.weight"].T) * (n @ w[p + "mlp.up_proj.weight"].T)
        h2 = h1 + act @ w[p + "mlp.down_proj.weight"].T
        normed = self.rms(h2, w["norm.weight"])
        return normed @ w["lm_head.weight"].T, normed if c.norm_output else h2


@nnx.jit
def jit_step(head, embed, g, positions, cache, new_mask=None):
    return head.step(embed, g, positions, cache, new_mask)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


VARIANTS = {
    "eagle3": {},
    "eagle3.1-norm-output": {"norm_output": True},
    "norm-before-residual": {"norm_before_residual": True},
}


HEADS = {  # (own embedding, rope scaling)
    "shared-embedding": (False, None),
    "own-embedding-Ht!=H-linear-rope": (True, RopeScaling("linear", 2.0)),
    "shared-embedding-yarn-rope": (False, RopeScaling("yarn", 4.0, original_max_position_embeddings=64)),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", HEADS)
def test_forward_parity_with_torch_prefix_then_cached_steps(kind, variant):
    own_embedding, rope_scaling = HEADS[kind]
    cfg = dataclasses.replace(head_config(own_embedding), rope_scaling=rope_scaling, **VARIANTS[variant])
    head = random_head(cfg, seed=1)
    tensors = {k: np.asarray(v) for k, v in head_to_hf(head).items()}
    ref = TorchEagle3(cfg, tensors)
    rng = np.random.default_rng(2)
    B, T, steps = 2, 5, 3
    target_embed = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    ref_embed = tensors.get("embed_tokens.weight", target_embed)
    ids = rng.integers(0, cfg.vocab_size, (B, T + 1))
    taps = rng.standard_normal((B, T, 3 * cfg.target_hidden_size)).astype(np.float32)
    offset = np.array([[0], [3000]])  # row 1 sits far beyond max_position_embeddings: no rotary table to overflow

    # Prefix pass: row j pairs the feature of token j with the embedding of token j+1, at position j.
    pos = np.arange(T)[None] + offset
    e = head.embed_tokens(jnp.asarray(ids[:, 1:]), jnp.asarray(target_embed))
    g = head.fuse(jnp.asarray(taps))
    cache = head.empty_cache(B, 16)
    logits, out, cache = head.step(e, g, jnp.asarray(pos), cache)
    cache = cache.advance(jnp.full((B,), T))
    t_e = torch.from_numpy(ref_embed[ids[:, 1:]])
    t_logits, t_out = ref(t_e, ref.fc(torch.from_numpy(taps)), torch.from_numpy(pos))
    assert logits.shape == (B, T, cfg.draft_vocab_size) and logits.dtype == jnp.float32
    assert rel_err(g, ref.fc(torch.from_numpy(taps)).numpy()) <= 1e-4
    assert rel_err(logits, t_logits.numpy()) <= 1e-4
    assert rel_err(out, t_out.numpy()) <= 1e-4

    # Draft steps k = 1..: the drafted token (mapped through d2t), g = the parent's next g, position + 1.
    d2t = tensors["d2t"]
    last_pos = pos[:, -1:]
    for k in range(1, steps + 1):
        draft = np.asarray(jnp.argmax(logits[:, -1], -1))
        assert np.array_equal(draft, t_logits[:, -1].argmax(-1).numpy())
        token = draft + d2t[draft]
        assert np.array_equal(np.asarray(head.target_ids_of_draft_vocab()[jnp.asarray(draft)]), token)
        step_pos = last_pos + k
        e = head.embed_tokens(jnp.asarray(token[:, None]), jnp.asarray(target_embed))
        logits, out, cache = head.step(e, out[:, -1:], jnp.asarray(step_pos), cache)
        cache = cache.advance(jnp.ones((B,), jnp.int32))
        t_logits, t_out = ref(torch.from_numpy(ref_embed[token[:, None]]), t_out[:, -1:], torch.from_numpy(step_pos))
        assert rel_err(logits, t_logits.numpy()) <= 1e-4, k
        assert rel_err(out, t_out.numpy()) <= 1e-4, k
    assert np.array_equal(np.asarray(cache.lengths), [T + steps] * B)


def test_steps_jit_inside_a_loop_after_split_merge():
    """The head runs inside lax.fori_loop after nnx.split / nnx.merge, and agrees with eager steps."""
    cfg = head_config(False)
    head = random_head(cfg, seed=3)
    rng = np.random.default_rng(4)
    B, T, steps = 2, 4, 3
    target_embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)))
    taps = jnp.asarray(rng.standard_normal((B, T, 3 * cfg.target_hidden_size)), jnp.float32)
    graphdef, state = nnx.split(head)

    @jax.jit
    def draft(state, ids, taps, embed):
        h = nnx.merge(graphdef, state)
        cache = h.empty_cache(B, 12)
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        logits, out, cache = h.step(h.embed_tokens(ids, embed), h.fuse(taps), pos, cache)
        cache = cache.advance(jnp.full((B,), T))

        def body(k, carry):
            logits, g, cache, drafted = carry
            token = h.target_ids_of_draft_vocab()[jnp.argmax(logits[:, -1], -1)][:, None]
            logits, out, cache = h.step(h.embed_tokens(token, embed), g, jnp.full((B, 1), T - 1) + k + 1, cache)
            return logits, out, cache.advance(jnp.ones((B,), jnp.int32)), drafted.at[:, k].set(token[:, 0])

        init = (logits[:, -1:], out[:, -1:], cache, jnp.zeros((B, steps), jnp.int32))
        return jax.lax.fori_loop(0, steps, body, init)

    logits, g, cache, drafted = draft(state, ids, taps, target_embed)

    e_cache = head.empty_cache(B, 12)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    e_logits, e_out, e_cache = head.step(head.embed_tokens(ids, target_embed), head.fuse(taps), pos, e_cache)
    e_cache = e_cache.advance(jnp.full((B,), T))
    for k in range(steps):
        token = head.target_ids_of_draft_vocab()[jnp.argmax(e_logits[:, -1], -1)]
        assert np.array_equal(np.asarray(drafted[:, k]), np.asarray(token))
        e_logits, e_out, e_cache = head.step(
            head.embed_tokens(token[:, None], target_embed), e_out[:, -1:], jnp.full((B, 1), T + k), e_cache
        )
        e_cache = e_cache.advance(jnp.ones((B,), jnp.int32))
    np.testing.assert_allclose(logits, e_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cache.k, e_cache.k, rtol=1e-5, atol=1e-6)


def test_tree_mask_rows_equal_separate_single_steps():
    """k sibling nodes fed at once with a diagonal mask equal k separate single-row steps (tree expansion)."""
    cfg = head_config(False)
    head = random_head(cfg, seed=5)
    rng = np.random.default_rng(6)
    B, T, k = 1, 4, 3
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)), jnp.float32)
    cache = head.empty_cache(B, 16)
    pos = jnp.arange(T)[None]
    e = head.embed_tokens(jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T))), embed)
    g = head.fuse(jnp.asarray(rng.standard_normal((B, T, 3 * cfg.target_hidden_size)), jnp.float32))
    _, out, cache = jit_step(head, e, g, pos, cache)
    cache = cache.advance(jnp.array([T]))
    nodes = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, k)))
    parent_g = jnp.broadcast_to(out[:, -1:], (B, k, cfg.hidden_size))
    tree_logits, _, _ = jit_step(
        head, head.embed_tokens(nodes, embed), parent_g, jnp.full((B, k), T), cache, jnp.eye(k, dtype=bool)[None]
    )
    for i in range(k):
        single, _, _ = jit_step(
            head, head.embed_tokens(nodes[:, i : i + 1], embed), out[:, -1:], jnp.full((B, 1), T), cache
        )
        np.testing.assert_allclose(tree_logits[:, i], single[:, 0], rtol=1e-5, atol=1e-6)


def test_vocabulary_mapping():
    cfg = head_config(False)
    head = random_head(cfg, seed=7)
    d2t = np.asarray(head.d2t[...])
    target_ids = np.arange(cfg.draft_vocab_size) + d2t
    assert np.all(np.diff(target_ids) > 0) and target_ids.max() < cfg.vocab_size
    assert np.array_equal(np.flatnonzero(np.asarray(head.t2d[...])), target_ids)


def test_fuse_reads_the_verifier_taps():
    """The verifier returns the default taps (inputs of layers 2, N//2, N-3) in the width fc expects."""
    cfg = Eagle3Config.default_for(TARGET, draft_vocab_size=32)
    assert cfg.tap_layers == (2, 4, 5) and cfg.fc_in_features == 3 * TARGET.hidden_size
    weights = llama.init_weights(TARGET, jax.random.key(0))
    head = Eagle3Head(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray([[1, 2, 3, 4]])
    cache = llama.KVCache.empty(TARGET, 1, 8)
    _, taps, _ = jax.jit(llama.forward, static_argnames=("cfg", "tap_layers"))(
        weights, TARGET, tokens, jnp.arange(4)[None], cache, tap_layers=cfg.tap_layers
    )
    g = head.fuse(taps)
    assert g.shape == (1, 4, cfg.hidden_size)
    e = head.embed_tokens(tokens, weights.embed)
    logits, out, hcache = jit_step(head, e, g, jnp.arange(4)[None], head.empty_cache(1, 8))
    assert logits.shape == (1, 4, 32) and hcache.k.shape == (1, 1, 8, cfg.num_kv_heads, cfg.head_dim)


def test_trainable_params_exclude_buffers():
    cfg = head_config(True)
    head = Eagle3Head(cfg, rngs=nnx.Rngs(0))
    _, params, rest = nnx.split(head, nnx.Param, ...)
    names = {str(p[0]) for p, _ in nnx.to_flat_state(params)}
    assert names == set(param_specs(cfg)), names
    rest_names = {str(p[0]) for p, _ in nnx.to_flat_state(rest)}
    assert rest_names == {"d2t", "t2d", "embed"}
