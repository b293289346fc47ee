"""Functional Llama-family verifier: a weights pytree and a pure `forward`.

One abstract declaration (`weight_specs`) gives every weight its shape and logical axes; it drives random init,
sharding and loading. Shape letters: B batch, T new tokens, S cache slots, D hidden, N query heads, K kv heads,
G query heads per kv head, H head dim, F MLP width, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig, RopeScaling
from specjax.errors import CheckpointError, InputError
from specjax.host import GIB, device_memory
from specjax.models.attention import CachedKeys, attend
from specjax.models.kv_cache import KVCache
from specjax.models.quantize import (
    CONTRACTED,
    Int8Matrix,
    embed_rows,
    map_matrices,
    quantization,
    quantize_matrix,
    weight_einsum,
)
from specjax.sharding import (
    DEFAULT_RULES,
    ArraySpec,
    MeshChoice,
    Rules,
    larger_meshes,
    mesh_for,
    place,
    shard_fraction,
    shardings_of,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """All decoder layers, stacked on a leading L axis so the forward can scan over them."""

    attn_norm: jax.Array  # [L, D]
    q: jax.Array  # [L, D, N, H]
    k: jax.Array  # [L, D, K, H]
    v: jax.Array  # [L, D, K, H]
    o: jax.Array  # [L, N, H, D]
    mlp_norm: jax.Array  # [L, D]
    gate: jax.Array  # [L, D, F]
    up: jax.Array  # [L, D, F]
    down: jax.Array  # [L, F, D]
    q_bias: jax.Array | None = None  # [L, N, H] (Qwen2)
    k_bias: jax.Array | None = None  # [L, K, H]
    v_bias: jax.Array | None = None  # [L, K, H]
    q_norm: jax.Array | None = None  # [L, H] (Qwen3)
    k_norm: jax.Array | None = None  # [L, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    embed: jax.Array  # [V, D]
    layers: LayerWeights
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [D, V]; None when tied to `embed`


def weight_specs(cfg: ModelConfig, quantize: str = "none") -> Weights:
    """The abstract weights of `cfg`: a Weights pytree whose leaves are ArraySpecs; with quantize "int8" its matrices
    are Int8Matrix pairs (`specjax.models.quantize`): int8 values on the weight's axes, scales on the same axes with
    the contracted ones of size 1, so both split along the output axes alike."""
    L, D, N, K, H, F, V = (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    bias = cfg.attention_bias
    layers = LayerWeights(
        attn_norm=ArraySpec((L, D), ("layers", "embed")),
        q=ArraySpec((L, D, N, H), ("layers", "embed", "heads", "head_dim")),
        k=ArraySpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        v=ArraySpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        o=ArraySpec((L, N, H, D), ("layers", "heads", "head_dim", "embed")),
        mlp_norm=ArraySpec((L, D), ("layers", "embed")),
        gate=ArraySpec((L, D, F), ("layers", "embed", "mlp")),
        up=ArraySpec((L, D, F), ("layers", "embed", "mlp")),
        down=ArraySpec((L, F, D), ("layers", "mlp", "embed")),
        q_bias=ArraySpec((L, N, H), ("layers", "heads", "head_dim")) if bias else None,
        k_bias=ArraySpec((L, K, H), ("layers", "kv_heads", "head_dim")) if bias else None,
        v_bias=ArraySpec((L, K, H), ("layers", "kv_heads", "head_dim")) if bias else None,
        q_norm=ArraySpec((L, H), ("layers", "head_dim")) if cfg.qk_norm else None,
        k_norm=ArraySpec((L, H), ("layers", "head_dim")) if cfg.qk_norm else None,
    )
    specs = Weights(
        embed=ArraySpec((V, D), ("vocab", "embed")),
        layers=layers,
        final_norm=ArraySpec((D,), ("embed",)),
        lm_head=None if cfg.tie_word_embeddings else ArraySpec((D, V), ("embed", "vocab")),
    )
    if quantize == "none":
        return specs

    def int8(spec: ArraySpec, contracted: tuple[int, ...]) -> Int8Matrix:
        n = len(spec.shape)
        scale_shape = tuple(1 if i - n in contracted else size for i, size in enumerate(spec.shape))
        return Int8Matrix(dataclasses.replace(spec, dtype=jnp.int8), ArraySpec(scale_shape, spec.axes))

    return map_matrices(specs, int8)


def _is_spec(x) -> bool:
    return isinstance(x, ArraySpec)


def is_norm_scale(spec: ArraySpec) -> bool:
    """Whether a weight is a norm's scale: one vector over the hidden or head dimension (per layer, or global)."""
    return spec.axes[-1] in ("embed", "head_dim") and len(spec.axes) - (spec.axes[0] == "layers") == 1


def init_weights(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Weights:
    """Random weights, e.g. for tests and benchmarks of untrained shapes: matrices normal(0, scale), norms 1 + noise."""
    leaves, treedef = jax.tree.flatten(weight_specs(cfg), is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))

    def make(spec: ArraySpec, k: jax.Array) -> jax.Array:
        noise = scale * jax.random.normal(k, spec.shape, jnp.float32)
        return (1.0 + noise if is_norm_scale(spec) else noise).astype(dtype)

    return treedef.unflatten([make(s, k) for s, k in zip(leaves, keys)])


def weight_shardings(
    cfg: ModelConfig, mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES, quantize: str = "none"
) -> Weights:
    """A Weights pytree of NamedShardings for `cfg` on `mesh`, by the weights' logical axes under `rules`."""
    return shardings_of(weight_specs(cfg, quantize), mesh, rules)


def shard_weights(weights: Weights, cfg: ModelConfig, mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES) -> Weights:
    """Places existing weights (float or int8) onto the mesh."""
    return place(weights, weight_specs(cfg, quantization(weights)), mesh, rules)


def weight_bytes(
    cfg: ModelConfig,
    dtype,
    mesh: Mapping[str, int] | None = None,
    quantize: str = "none",
    rules: Rules = DEFAULT_RULES,
) -> int:
    """Bytes of the target's weights in `dtype` (`weight_specs`: tied heads, biases and q/k norms included; with
    quantize "int8" its matrices' int8 values and their scales), on each device of a mesh of these axis sizes when
    given (each weight split by its logical axes under `rules`)."""
    specs = jax.tree.leaves(weight_specs(cfg, quantize), is_leaf=_is_spec)
    split = (lambda s: shard_fraction(s.axes, s.shape, mesh, rules)) if mesh else (lambda s: 1)
    return sum(math.prod(s.shape) // split(s) * jnp.dtype(s.dtype or dtype).itemsize for s in specs)


def check_weights_fit(
    cfg: ModelConfig,
    dtype,
    mesh: jax.sharding.Mesh | None,
    quantize: str,
    source: str,
    rules: Rules = DEFAULT_RULES,
) -> None:
    """Refuses, before a tensor is read, weights that alone exceed a device's memory (split under `rules`):
    InputError naming the first larger mesh of the devices there are (`specjax.sharding.larger_meshes`) or the int8
    weights that would fit."""
    sizes = dict(mesh.shape) if mesh is not None else None
    need, available = weight_bytes(cfg, dtype, sizes, quantize, rules), device_memory()
    if need <= available:
        return
    used = mesh.size if mesh is not None else 1
    fits = [
        m for m in larger_meshes(used, len(jax.devices())) if weight_bytes(cfg, dtype, m, quantize, rules) <= available
    ]
    advice = ["{mesh} would hold them"] if fits else []
    if quantize == "none" and weight_bytes(cfg, dtype, sizes, "int8", rules) <= available:
        advice.append("{quantize} would")
    raise InputError(
        f"{source}: the weights need {need / GIB:.2f} GiB on each device but one holds {available / GIB:.2f} GiB; "
        + (", or ".join(advice) if advice else "no mesh of the devices here holds them: run on more devices"),
        settings={"mesh": fits[0] if fits else None, "quantize": "int8"},
    )


# ---------------------------------------------------------------------------------------------------------------
# Conversion from the HF naming and [out, in] layout. Every loader (safetensors, GGUF, converted cache) lands here.


def hf_fetcher(
    get: Callable[[str], np.ndarray], source: str = "checkpoint"
) -> Callable[[str, tuple[int, ...]], np.ndarray]:
    """fetch(name, shape): the named tensor as float32 numpy, or CheckpointError naming `source` when it is absent or
    its shape is not the one its config gives: the one check that the weights and the config agree."""

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        try:
            t = get(name)
        except KeyError:
            raise CheckpointError(f"{source} lacks tensor {name!r} (expected shape {list(shape)})") from None
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(t.shape)}, but its config gives {list(shape)}; "
                "the weights do not match their config, re-download the checkpoint"
            )
        return np.asarray(t, np.float32)

    return fetch


def layers_from_hf(
    cfg: ModelConfig,
    fetch: Callable[[str, tuple[int, ...]], np.ndarray],
    prefix: str = "model.layers.",
    place: Callable[[str, np.ndarray], jax.Array | np.ndarray] = lambda field, w: w,
) -> LayerWeights:
    """`cfg`'s decoder layers, stacked, from HF tensors under `{prefix}{i}.`: float32 numpy in the JAX layout, or
    what `place(field, stacked)` makes of each as soon as it is stacked (so one stacked tensor is on the host at a
    time)."""
    D, N, K, H, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size

    def proj_in(heads):  # [heads*H, D] -> [D, heads, H]
        return lambda w: w.T.reshape(D, heads, H)

    def same(w):
        return w

    # LayerWeights field: (HF tensor of each layer, its shape, to the JAX layout)
    fields = {
        "attn_norm": ("input_layernorm.weight", (D,), same),
        "q": ("self_attn.q_proj.weight", (N * H, D), proj_in(N)),
        "k": ("self_attn.k_proj.weight", (K * H, D), proj_in(K)),
        "v": ("self_attn.v_proj.weight", (K * H, D), proj_in(K)),
        "o": ("self_attn.o_proj.weight", (D, N * H), lambda w: w.T.reshape(N, H, D)),
        "mlp_norm": ("post_attention_layernorm.weight", (D,), same),
        "gate": ("mlp.gate_proj.weight", (F, D), lambda w: w.T),
        "up": ("mlp.up_proj.weight", (F, D), lambda w: w.T),
        "down": ("mlp.down_proj.weight", (D, F), lambda w: w.T),
    }
    if cfg.attention_bias:
        fields["q_bias"] = ("self_attn.q_proj.bias", (N * H,), lambda b: b.reshape(N, H))
        fields["k_bias"] = ("self_attn.k_proj.bias", (K * H,), lambda b: b.reshape(K, H))
        fields["v_bias"] = ("self_attn.v_proj.bias", (K * H,), lambda b: b.reshape(K, H))
    if cfg.qk_norm:
        fields["q_norm"] = ("self_attn.q_norm.weight", (H,), same)
        fields["k_norm"] = ("self_attn.k_norm.weight", (H,), same)

    def stacked(field: str) -> jax.Array | np.ndarray:
        suffix, shape, to_jax = fields[field]
        return place(field, np.stack([to_jax(fetch(f"{prefix}{i}.{suffix}", shape)) for i in range(cfg.num_layers)]))

    return LayerWeights(**{field: stacked(field) for field in fields})


def weights_from_hf(
    cfg: ModelConfig,
    get: Callable[[str], np.ndarray],
    dtype=jnp.float32,
    mesh: MeshChoice = None,
    source: str = "checkpoint",
    quantize: str = "none",
    rules: Rules = DEFAULT_RULES,
) -> Weights:
    """Builds Weights from tensors in HF naming and PyTorch [out, in] layout, each placed (in `dtype`, on its
    shards) as soon as it is read, so the host never holds more than one stacked tensor in float32.

    Args:
      cfg: the model config.
      get: returns the named tensor as a numpy array; raises KeyError when absent.
      dtype: the dtype of the returned weights.
      mesh: where to place them (`specjax.sharding.mesh_for`): None for the default device, "auto" for every local
        device, a Mesh or its axis sizes; each weight is split by its logical axes.
      source: the checkpoint's folder or file, named in errors.
      quantize: "int8" quantizes each matrix on the host as it is read, before it is placed
        (`specjax.models.quantize`); "none" keeps them in `dtype`.
      rules: the logical-axis rules that split them (`specjax.sharding.merged_rules`).
    Returns:
      The Weights. Raises CheckpointError naming any missing or mis-shaped tensor, and InputError before reading
      any when the weights would not fit the devices (`check_weights_fit`).
    """
    D = cfg.hidden_size
    fetch = hf_fetcher(get, source)
    specs = weight_specs(cfg, quantize)
    on = mesh_for(mesh, cfg.num_kv_heads)
    check_weights_fit(cfg, dtype, on, quantize, source, rules)
    shardings = weight_shardings(cfg, on, rules, quantize) if on is not None else None

    def placer(spec_of: Callable[[Weights], object]):
        def put(field: str, w: np.ndarray) -> jax.Array | Int8Matrix:
            spec = getattr(spec_of(specs), field)
            if isinstance(spec, Int8Matrix):
                _check_shape(spec.values, w)
                w = quantize_matrix(w, CONTRACTED[field], dtype)
            else:
                _check_shape(spec, w)
                w = w.astype(dtype, copy=False)
            if shardings is None:
                return jax.tree.map(jax.device_put, w)
            return jax.tree.map(jax.device_put, w, getattr(spec_of(shardings), field))

        return put

    top = placer(lambda tree: tree)
    return Weights(
        embed=top("embed", fetch("model.embed_tokens.weight", (cfg.vocab_size, D))),
        layers=layers_from_hf(cfg, fetch, place=placer(lambda tree: tree.layers)),
        final_norm=top("final_norm", fetch("model.norm.weight", (D,))),
        lm_head=None if cfg.tie_word_embeddings else top("lm_head", fetch("lm_head.weight", (cfg.vocab_size, D)).T),
    )


def weights_to_hf(cfg: ModelConfig, weights: Weights) -> dict[str, np.ndarray]:
    """The inverse of `weights_from_hf`: float32 numpy tensors in HF naming and layout."""
    w = jax.tree.map(lambda x: np.asarray(x, np.float32), weights)
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm}
    if w.lm_head is not None:
        out["lm_head.weight"] = np.ascontiguousarray(w.lm_head.T)
    return out | layers_to_hf(cfg, w.layers)


def layers_to_hf(cfg: ModelConfig, layers: LayerWeights, prefix: str = "model.layers.") -> dict[str, np.ndarray]:
    """The inverse of `layers_from_hf`: float32 numpy tensors in HF naming and layout."""
    lw, D = jax.tree.map(lambda x: np.asarray(x, np.float32), layers), cfg.hidden_size
    out = {}
    for i in range(cfg.num_layers):
        p = f"{prefix}{i}."
        out[p + "input_layernorm.weight"] = lw.attn_norm[i]
        out[p + "post_attention_layernorm.weight"] = lw.mlp_norm[i]
        for name, arr in (("q", lw.q), ("k", lw.k), ("v", lw.v)):
            out[p + f"self_attn.{name}_proj.weight"] = np.ascontiguousarray(arr[i].reshape(D, -1).T)
        out[p + "self_attn.o_proj.weight"] = np.ascontiguousarray(lw.o[i].reshape(-1, D).T)
        for name, arr in (("gate", lw.gate), ("up", lw.up), ("down", lw.down)):
            out[p + f"mlp.{name}_proj.weight"] = np.ascontiguousarray(arr[i].T)
        if cfg.attention_bias:
            for name, arr in (("q", lw.q_bias), ("k", lw.k_bias), ("v", lw.v_bias)):
                out[p + f"self_attn.{name}_proj.bias"] = arr[i].reshape(-1)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = lw.q_norm[i]
            out[p + "self_attn.k_norm.weight"] = lw.k_norm[i]
    return out


def _check_shape(spec: ArraySpec, w: np.ndarray) -> None:
    if tuple(w.shape) != spec.shape:  # a bug in a converter, not a user error
        raise AssertionError(f"converted weight has shape {w.shape}, expected {spec.shape}")


# ---------------------------------------------------------------------------------------------------------------
# Forward.


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """LlamaRMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale * normed.astype(x.dtype)


class RopeFields(Protocol):
    """What `rope_inv_freq` and `Rotary.of` read: ModelConfig and the EAGLE-3 head's Eagle3Config both have them."""

    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None


def rope_inv_freq(cfg: RopeFields) -> np.ndarray:
    """Inverse rotary frequencies [H/2], with linear / llama3 / yarn scaling applied (transformers' formulas).

    Each scaling keeps a share of each frequency and divides the rest by `factor`: linear none, llama3 by wavelength
    (the waves that turn more than high_freq_factor times over the original context keep it all, those below
    low_freq_factor none), yarn by dimension (`_yarn_divided_share`).

    Args:
      cfg: any config with head_dim, rope_theta and rope_scaling (ModelConfig, Eagle3Config).
    Returns:
      float32 numpy [head_dim / 2].
    """
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32)
    if rs.rope_type == "linear":
        kept = np.zeros_like(inv_freq)
    elif rs.rope_type == "llama3":
        turns = rs.original_max_position_embeddings * inv_freq / (2 * np.pi)
        kept = np.clip((turns - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor), 0, 1)
    else:
        kept = 1 - _yarn_divided_share(cfg.head_dim, cfg.rope_theta, rs)
    return (kept * inv_freq + (1 - kept) * inv_freq / rs.factor).astype(np.float32)


def _yarn_divided_share(head_dim: int, theta: float, rs: RopeScaling) -> np.ndarray:
    """YaRN's share of each frequency that is divided by `factor` [H/2]: 0 up to the dimension whose wave turns
    beta_fast times over the original context, 1 from the one that turns beta_slow times, linear in between."""

    def dim_turning(turns: float) -> float:
        return head_dim * math.log(rs.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(rs.beta_fast), dim_turning(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: a ramp of one dimension
    return np.clip((np.arange(head_dim // 2) - low) / (high - low), 0, 1)


def rope_attention_factor(rs: RopeScaling | None) -> float:
    """The factor on cos and sin: 1 but for yarn, whose `attention_factor` defaults to m(1), or to
    m(mscale) / m(mscale_all_dim) when both are set, where m(s) = 0.1 s ln(factor) + 1 (1 for a factor <= 1)."""
    if rs is None or rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor

    def m(s: float) -> float:
        return 0.1 * s * math.log(rs.factor) + 1.0 if rs.factor > 1 else 1.0

    return m(rs.mscale) / m(rs.mscale_all_dim) if rs.mscale and rs.mscale_all_dim else m(1.0)


class Rotary(NamedTuple):
    """A config's rotary embedding, constant at trace time: inverse frequencies [H/2] (float32 numpy) and the factor
    on cos and sin (`rope_attention_factor`)."""

    inv_freq: np.ndarray
    attention_factor: float

    @classmethod
    def of(cls, cfg: RopeFields) -> Rotary:
        return cls(rope_inv_freq(cfg), rope_attention_factor(cfg.rope_scaling))


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, rope: Rotary) -> jax.Array:
    """Rotary embedding in the HF (rotate-half) layout, cos and sin scaled by the attention factor."""
    angles = positions_bt[..., None].astype(jnp.float32) * rope.inv_freq  # [B, T, H/2]
    cos = (jnp.cos(angles) * rope.attention_factor)[:, :, None, :].astype(x_btnh.dtype)
    sin = (jnp.sin(angles) * rope.attention_factor)[:, :, None, :].astype(x_btnh.dtype)
    x1, x2 = jnp.split(x_btnh, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def queries(lw: LayerWeights, h_btd: jax.Array, positions_bt: jax.Array, rope: Rotary, eps: float):
    """One layer's rotated queries [B, T, N, H] from its normed input (bias and q-norm where the family has them)."""
    q = weight_einsum("btd,dnh->btnh", h_btd, lw.q)
    if lw.q_bias is not None:
        q = q + lw.q_bias
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, eps)
    return apply_rope(q, positions_bt, rope)


def keys_values(lw: LayerWeights, h_btd: jax.Array, positions_bt: jax.Array, rope: Rotary, eps: float):
    """One layer's rotated keys and values [B, T, K, H] from its normed input."""
    k = weight_einsum("btd,dkh->btkh", h_btd, lw.k)
    v = weight_einsum("btd,dkh->btkh", h_btd, lw.v)
    if lw.k_bias is not None:
        k, v = k + lw.k_bias, v + lw.v_bias
    if lw.k_norm is not None:
        k = rms_norm(k, lw.k_norm, eps)
    return apply_rope(k, positions_bt, rope), v


def mlp_block(lw: LayerWeights, x_btd: jax.Array, eps: float) -> jax.Array:
    """The residual stream after one layer's SwiGLU MLP."""
    h = rms_norm(x_btd, lw.mlp_norm, eps)
    mlp = jax.nn.silu(weight_einsum("btd,df->btf", h, lw.gate)) * weight_einsum("btd,df->btf", h, lw.up)
    return x_btd + weight_einsum("btf,fd->btd", mlp, lw.down)


def forward_new_kv(
    weights: Weights,
    cfg: ModelConfig,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    cache: KVCache,
    new_mask_btt: jax.Array | None = None,
    tap_layers: tuple[int, ...] = (),
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array]:
    """Runs the decoder on T new tokens per row against a KV cache, which it only reads (`forward` writes).

    The caller writes what it keeps of the new keys and values: the speculative loop writes only a round's accepted
    path, outside the branch that chose the round's shape, so the cache is never copied between branches.

    Args:
      weights: the model weights.
      cfg: the static model config.
      tokens_bt: int32 token ids [B, T].
      positions_bt: int32 rotary positions [B, T].
      cache: the KV cache; its first `lengths[b]` slots of row b are attended to.
      new_mask_btt: bool [B, T, T], which new tokens each new token attends to; causal when None.
      tap_layers: ids of layers whose *input* residual stream is returned (EAGLE-3 taps); id `num_layers` is the
        final residual stream (before the final norm).
      logits_at: optional int32 [B, R] indices into T; logits are computed only there (e.g. the last prompt token).
    Returns:
      (logits [B, T or R, V] float32, taps [B, T, len(tap_layers) * D] or None, the new tokens' keys and values,
      each [L, B, T, K, H]).
    """
    B, T = tokens_bt.shape
    if new_mask_btt is None:
        new_mask_btt = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    window = cfg.sliding_window
    first_bt = None  # the oldest cached slot each new token sees, where a sliding window bounds it
    if window is not None:
        new_mask_btt &= positions_bt[:, None, :] > positions_bt[:, :, None] - window
        first_bt = positions_bt - window + 1
    cached = CachedKeys.below(cache.k, cache.v, cache.lengths, first_bt)  # read at each layer
    rope = Rotary.of(cfg)
    K, G = cfg.num_kv_heads, cfg.group_size
    x_btd = embed_rows(weights.embed, tokens_bt)
    eps = cfg.rms_norm_eps

    taps0 = jnp.zeros((len(tap_layers), B, T, cfg.hidden_size), x_btd.dtype)

    def layer(carry, lw):
        x_btd, taps, i = carry
        taps = jnp.stack([jnp.where(i == t, x_btd, taps[j]) for j, t in enumerate(tap_layers)]) if tap_layers else taps
        h = rms_norm(x_btd, lw.attn_norm, eps)
        q = queries(lw, h, positions_bt, rope, eps)
        k, v = keys_values(lw, h, positions_bt, rope, eps)
        attn = attend(
            q.reshape(B, T, K, G, -1), k, v, new_mask_btt, dataclasses.replace(cached, layer=i), cfg.attention
        )
        x_btd = x_btd + weight_einsum("btnh,nhd->btd", attn.reshape(B, T, cfg.num_heads, -1), lw.o)
        return (mlp_block(lw, x_btd, eps), taps, i + 1), (k, v)

    (x_btd, taps, _), (k_new, v_new) = jax.lax.scan(layer, (x_btd, taps0, jnp.int32(0)), weights.layers)
    if cfg.num_layers in tap_layers:
        taps = jnp.stack([x_btd if t == cfg.num_layers else taps[j] for j, t in enumerate(tap_layers)])
    if logits_at is not None:
        x_btd = jnp.take_along_axis(x_btd, logits_at[:, :, None], axis=1)
    logits = lm_logits(weights, cfg, x_btd)
    taps_out = jnp.moveaxis(taps, 0, 2).reshape(B, T, -1) if tap_layers else None
    return logits, taps_out, k_new, v_new


def forward(
    weights: Weights,
    cfg: ModelConfig,
    tokens_bt: jax.Array,
    positions_bt: jax.Array,
    cache: KVCache,
    new_mask_btt: jax.Array | None = None,
    tap_layers: tuple[int, ...] = (),
    logits_at: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """`forward_new_kv`, then the new tokens' keys and values written to cache slots `cache.lengths + arange(T)`.

    `cache.lengths` is left for the caller to advance (by the number of tokens it accepts), so rolling back is only
    not advancing it. Returns (logits, taps, the cache with the new KV written).
    """
    logits, taps, k_new, v_new = forward_new_kv(
        weights, cfg, tokens_bt, positions_bt, cache, new_mask_btt, tap_layers, logits_at
    )
    return logits, taps, cache.write(k_new, v_new)


# Prompt tokens per prefill forward by default: few on the CPU, where small chunks cost little; enough on
# accelerators to fill their matrix units.
CPU_PREFILL_CHUNK, ACCELERATOR_PREFILL_CHUNK = 64, 512


def chunk_size(prefill_chunk: int | None, width: int | None = None) -> int:
    """Prompt tokens per prefill forward: the number asked for, else the platform's default; at most `width`, the
    prompts'. Raises InputError below 1."""
    if prefill_chunk is not None and prefill_chunk < 1:
        raise InputError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    chunk = prefill_chunk or (CPU_PREFILL_CHUNK if jax.default_backend() == "cpu" else ACCELERATOR_PREFILL_CHUNK)
    return min(chunk, width or chunk)


def chunked_prefill(
    weights: Weights,
    cfg: ModelConfig,
    tokens_bw: jax.Array,
    lengths_b: jax.Array,
    cache: KVCache,
    chunk: int,
    tap_layers: tuple[int, ...] = (),
    see_chunk: Callable[[Any, jax.Array, jax.Array | None], Any] | None = None,
    seen: Any = None,
) -> tuple[jax.Array, Any, KVCache]:
    """Runs right-padded prompts [B, W] into an empty cache `chunk` tokens at a time, for as many chunks as the longest
    row needs (ceil(max(lengths_b) / chunk), a traced trip count): prefill work follows the real prompt lengths, not
    the padded width. Every row writes every chunk (a row's padding lands past its length and is never committed).

    `see_chunk(seen, start, taps)`, when given, sees each chunk as it is made: its first position and its taps
    [B, chunk, F] (None without tap layers), and returns the new `seen` (a drafter's commit of those positions), so no
    buffer of the whole prompt's taps is ever held.

    Returns:
      (float32 logits at each row's last prompt token [B, V], `seen` after the last chunk, the cache with lengths =
      lengths_b).
    """
    B, W = tokens_bw.shape
    carry = (jnp.zeros((B, cfg.vocab_size), jnp.float32), seen, cache)
    chunk = chunk_size(chunk, W)
    logits_bv, seen, cache = prefill_chunks(
        weights, cfg, tokens_bw, lengths_b, carry, 0, num_chunks(lengths_b, chunk), chunk, tap_layers, see_chunk
    )
    return logits_bv, seen, cache.at_lengths(lengths_b)


def num_chunks(lengths_b: jax.Array, chunk: int) -> jax.Array:
    """Chunks the longest row needs."""
    return -(-jnp.max(lengths_b) // chunk)


def prefill_chunks(
    weights: Weights,
    cfg: ModelConfig,
    tokens_bw: jax.Array,
    lengths_b: jax.Array,
    carry: tuple[jax.Array, Any, KVCache],
    first: jax.Array | int,
    end: jax.Array | int,
    chunk: int,
    tap_layers: tuple[int, ...] = (),
    see_chunk: Callable[[Any, jax.Array, jax.Array | None], Any] | None = None,
) -> tuple[jax.Array, Any, KVCache]:
    """Chunks `first` to `end` (exclusive) of `chunked_prefill`, from `carry` = (logits at the last prompt tokens so
    far [B, V], `seen`, the cache holding the chunks before `first`): a prefill can be run a few chunks at a time, other
    work in between. The cache returned holds every slot up to the end of chunk `end - 1`."""
    B = tokens_bw.shape[0]
    offsets = jnp.arange(chunk, dtype=jnp.int32)
    last_b = lengths_b - 1

    def run_chunk(i, carry):
        logits_bv, seen, cache = carry
        start = i * chunk
        tokens_bc = jnp.take(tokens_bw, start + offsets, axis=1, mode="clip")  # past W: past every prompt
        positions = jnp.broadcast_to(start + offsets, (B, chunk))
        at = jnp.clip(last_b - start, 0, chunk - 1)[:, None]
        logits, taps, cache = forward(weights, cfg, tokens_bc, positions, cache, None, tap_layers, at)
        here = (last_b >= start) & (last_b < start + chunk)
        logits_bv = jnp.where(here[:, None], logits[:, 0], logits_bv)
        seen = seen if see_chunk is None else see_chunk(seen, start, taps)
        return logits_bv, seen, cache.at_lengths(jnp.full((B,), start + chunk, jnp.int32))

    return jax.lax.fori_loop(first, end, run_chunk, carry)


def head_rows(weights: Weights) -> jax.Array | Int8Matrix:
    """The LM head as [V, D] rows (the embedding when tied), int8 where the weights are."""
    return weights.embed if weights.lm_head is None else weights.lm_head.T


def lm_logits(weights: Weights, cfg: ModelConfig, x_btd: jax.Array, vocab_ids: jax.Array | None = None) -> jax.Array:
    """Final norm and LM head (tied or untied), float32 logits [B, T, V], or [B, T, len(vocab_ids)] over only the
    given token ids (a draft vocabulary)."""
    h = rms_norm(x_btd, weights.final_norm, cfg.rms_norm_eps)
    head_vd = head_rows(weights)
    if vocab_ids is not None:
        head_vd = head_vd[vocab_ids]
    return weight_einsum("btd,vd->btv", h, head_vd, preferred_element_type=jnp.float32)
