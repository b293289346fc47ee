"""EAGLE-3 head checkpoints: the published LlamaForCausalLMEagle3 layout, renamings, validation, round trips."""

import json
import struct
import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from specjax.config import ModelConfig, RopeScaling
from specjax.errors import CheckpointError, UnsupportedModelError
from specjax.io.eagle3_checkpoint import check_eagle3, head_to_hf, hf_tensor_specs, load_eagle3, save_eagle3
from specjax.models.eagle3 import Eagle3Config, Eagle3Head, param_specs, vocab_map_from_ids

# Llama-3.1-8B and its published head (docs/eagle3-head.md, section 6), written out by hand from the spec.
LLAMA31_8B = ModelConfig(
    "llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
)
PUBLISHED_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 1,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
    "pad_token_id": 0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}
PUBLISHED_TENSORS = {
    "fc.weight": ([4096, 12288], "F16"),
    "midlayer.input_layernorm.weight": ([4096], "F16"),
    "midlayer.hidden_norm.weight": ([4096], "F16"),
    "midlayer.post_attention_layernorm.weight": ([4096], "F16"),
    "midlayer.self_attn.q_proj.weight": ([4096, 8192], "F16"),
    "midlayer.self_attn.k_proj.weight": ([1024, 8192], "F16"),
    "midlayer.self_attn.v_proj.weight": ([1024, 8192], "F16"),
    "midlayer.self_attn.o_proj.weight": ([4096, 4096], "F16"),
    "midlayer.mlp.gate_proj.weight": ([14336, 4096], "F16"),
    "midlayer.mlp.up_proj.weight": ([14336, 4096], "F16"),
    "midlayer.mlp.down_proj.weight": ([4096, 14336], "F16"),
    "norm.weight": ([4096], "F16"),
    "lm_head.weight": ([32000, 4096], "F16"),
    "d2t": ([32000], "I64"),
    "t2d": ([128256], "BOOL"),
}
ST_DTYPE = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "I64": np.int64, "BOOL": np.bool_}

TARGET = ModelConfig(
    "llama", vocab_size=80, hidden_size=16, intermediate_size=32, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=4
)


def header_only_safetensors(path, tensors: dict[str, tuple[list[int], str]]) -> None:
    """A safetensors file whose header lists the tensors but whose data is absent (never read by validation)."""
    header, offset = {}, 0
    for name, (shape, dt) in tensors.items():
        size = int(np.prod(shape)) * np.dtype(ST_DTYPE[dt]).itemsize
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def read_header(path) -> dict[str, tuple[list[int], str]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return {k: (v["shape"], v["dtype"]) for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"}


def small_cfg(**overrides) -> Eagle3Config:
    fields = dict(
        hidden_size=16,
        intermediate_size=24,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=80,
        draft_vocab_size=30,
        target_num_layers=8,
        rope_theta=1000.0,
    )
    return Eagle3Config(**{**fields, **overrides})


def small_head(cfg: Eagle3Config, seed: int = 0) -> Eagle3Head:
    rng = np.random.default_rng(seed)
    weights = {}
    for name, spec in param_specs(cfg).items():
        weights[name] = ((len(spec.shape) == 1) + 0.2 * rng.standard_normal(spec.shape)).astype(np.float32)
    if cfg.needs_own_embedding:
        weights["embed"] = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    weights["d2t"], _ = vocab_map_from_ids(
        rng.choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False).tolist(), cfg.vocab_size
    )
    return Eagle3Head(cfg, weights=weights)


@nnx.jit
def _draft(head, embed, ids, taps):
    B, T = ids.shape
    logits, out, cache = head.step(
        head.embed_tokens(ids, embed), head.fuse(taps), jnp.arange(T)[None] + 9, head.empty_cache(B, T + 1)
    )
    cache = cache.advance(jnp.full((B,), T))
    token = head.target_ids_of_draft_vocab()[jnp.argmax(logits[:, -1:], -1)]
    logits2, _, _ = head.step(head.embed_tokens(token, embed), out[:, -1:], jnp.full((B, 1), T + 9), cache)
    return logits, logits2


def draft_logits(head: Eagle3Head):
    """Logits of a prefix pass and one cached draft step, on fixed random inputs."""
    rng = np.random.default_rng(99)
    cfg = head.cfg
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)))
    taps = jnp.asarray(rng.standard_normal((2, 5, cfg.fc_in_features)), jnp.float32)
    return [np.asarray(x) for x in _draft(head, embed, ids, taps)]


# ---------------------------------------------------------------------------------------------------------------
# The published layout.


def test_llama31_8b_head_has_the_published_keys_shapes_and_dtypes():
    cfg = Eagle3Config.from_hf(PUBLISHED_CONFIG, LLAMA31_8B)
    assert cfg.tap_layers == (2, 16, 29) and cfg.target_hidden_size == 4096 and cfg.head_dim == 128
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.draft_vocab_size) == (10000.0, None, 32000)
    spec = hf_tensor_specs(cfg, np.float16)
    assert {k: (list(s), d) for k, (s, d) in spec.items()} == {
        k: (s, np.dtype(ST_DTYPE[d])) for k, (s, d) in PUBLISHED_TENSORS.items()
    }
    # What the conversion of a real head produces, traced abstractly (no 0.85 GB materialised).
    shapes = nnx.eval_shape(lambda: head_to_hf(Eagle3Head(cfg, rngs=nnx.Rngs(0), dtype=jnp.float16)))
    assert {k: list(v.shape) for k, v in shapes.items()} == {k: s for k, (s, _) in PUBLISHED_TENSORS.items()}
    assert (
        sum(int(np.prod(s)) for k, (s, _) in PUBLISHED_TENSORS.items() if k not in ("d2t", "t2d")) == 424_689_664
    )  # "about 424.7M"


def test_published_head_validates_from_headers_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_CONFIG))
    header_only_safetensors(tmp_path / "model.safetensors", PUBLISHED_TENSORS)
    cfg = check_eagle3(tmp_path, LLAMA31_8B)
    assert cfg == Eagle3Config.from_hf(PUBLISHED_CONFIG, LLAMA31_8B)
    # The same head as vLLM renames it: model. prefixes, layers.0, fused projections, draft_id_to_target_id, no t2d.
    renamed = {}
    for name, (shape, dt) in PUBLISHED_TENSORS.items():
        if name == "t2d" or any(p in name for p in ("k_proj", "v_proj", "up_proj")):
            continue
        if name == "midlayer.self_attn.q_proj.weight":
            name, shape = "midlayer.self_attn.qkv_proj.weight", [4096 + 2 * 1024, 8192]
        if name == "midlayer.mlp.gate_proj.weight":
            name, shape = "midlayer.mlp.gate_up_proj.weight", [2 * 14336, 4096]
        name = {"d2t": "draft_id_to_target_id"}.get(name, name).replace("midlayer.", "layers.0.")
        renamed[name if name == "lm_head.weight" else "model." + name] = (shape, dt)
    header_only_safetensors(tmp_path / "model.safetensors", renamed)
    assert check_eagle3(tmp_path, LLAMA31_8B) == cfg


def test_save_writes_exactly_the_spec_and_config(tmp_path):
    cfg = small_cfg()
    head = small_head(cfg)
    save_eagle3(tmp_path, cfg, head)  # bfloat16 by default
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    spec = hf_tensor_specs(cfg, ml_dtypes.bfloat16)
    names = {np.dtype(v): k for k, v in ST_DTYPE.items()}
    assert read_header(tmp_path / "model.safetensors") == {k: (list(s), names[d]) for k, (s, d) in spec.items()}
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["model_type"] == "llama"
    assert (hf["num_hidden_layers"], hf["draft_vocab_size"], hf["vocab_size"]) == (1, 30, 80)
    assert hf["torch_dtype"] == "bfloat16" and hf["tie_word_embeddings"] is False
    assert "target_hidden_size" not in hf and "eagle_aux_hidden_state_layer_ids" not in hf and "eagle_config" not in hf
    stored = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    d2t = np.asarray(head.d2t[...])
    assert np.array_equal(stored["d2t"], d2t) and np.array_equal(np.flatnonzero(stored["t2d"]), d2t + np.arange(30))


def test_round_trip_gives_identical_logits(tmp_path):
    cfg = small_cfg()
    head = small_head(cfg, seed=1)
    save_eagle3(tmp_path, cfg, head, dtype=np.float32)
    cfg2, head2 = load_eagle3(tmp_path, TARGET)
    assert cfg2 == cfg and head2.embed is None
    for a, b in zip(draft_logits(head), draft_logits(head2)):
        np.testing.assert_array_equal(a, b)
    assert np.array_equal(np.asarray(head2.t2d[...]), np.asarray(head.t2d[...]))


def test_bfloat16_round_trip_and_own_embedding(tmp_path):
    cfg = small_cfg(hidden_size=24, target_hidden_size=16, tap_layers=(1, 3, 6))
    head = small_head(cfg, seed=2)
    save_eagle3(tmp_path, cfg, head, dtype=jnp.bfloat16)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["target_hidden_size"] == 16 and "embed_tokens.weight" in read_header(tmp_path / "model.safetensors")
    cfg2, head2 = load_eagle3(tmp_path, TARGET)
    assert cfg2 == cfg and head2.embed is not None
    # Loading what was written is exact: the loaded head equals the original rounded to bfloat16.
    state = nnx.to_pure_dict(nnx.state(head))
    rounded = {
        k: v if k in ("d2t", "t2d") else np.asarray(v, ml_dtypes.bfloat16).astype(np.float32) for k, v in state.items()
    }
    rounded = Eagle3Head(cfg, weights=rounded)
    for a, b in zip(draft_logits(rounded), draft_logits(head2)):
        np.testing.assert_array_equal(a, b)


def test_renamed_and_fused_keys_load(tmp_path):
    cfg = small_cfg()
    head = small_head(cfg, seed=3)
    hf = {k: np.asarray(v) for k, v in head_to_hf(head).items()}
    p = "midlayer."
    qkv = np.concatenate([hf.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
    gate_up = np.concatenate([hf.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    hf[p + "self_attn.qkv_proj.weight"], hf[p + "mlp.gate_up_proj.weight"] = qkv, gate_up
    hf["draft_id_to_target_id"] = hf.pop("d2t").astype(np.int64)
    del hf["t2d"]
    renamed = {
        (k if k == "lm_head.weight" else "model." + k.replace("midlayer.", "layers.0.")): v for k, v in hf.items()
    }
    safetensors.numpy.save_file(renamed, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    _, head2 = load_eagle3(tmp_path, TARGET)
    for a, b in zip(draft_logits(head), draft_logits(head2)):
        np.testing.assert_array_equal(a, b)


def test_every_missing_extra_and_misshaped_tensor_is_named(tmp_path):
    cfg = small_cfg()
    hf = {k: np.asarray(v) for k, v in head_to_hf(small_head(cfg)).items()}
    del hf["norm.weight"], hf["midlayer.hidden_norm.weight"], hf["d2t"]
    hf["lm_head.weight"] = hf["lm_head.weight"][:20]
    hf["midlayer.self_attn.o_proj.weight"] = hf["midlayer.self_attn.o_proj.weight"].T.copy()
    hf["midlayer.mlp.gate_proj.weight"] = hf["midlayer.mlp.gate_proj.weight"].astype(np.int32)
    hf["layers.1.mlp.up_proj.weight"] = hf["midlayer.mlp.up_proj.weight"]
    hf["fc.bias"] = np.zeros(16, np.float32)
    safetensors.numpy.save_file(hf, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(CheckpointError) as err:
        load_eagle3(tmp_path, TARGET)
    msg = str(err.value)
    assert "\n" not in msg
    for name in (
        "norm.weight",
        "midlayer.hidden_norm.weight",
        "d2t",
        "layers.1.mlp.up_proj.weight",
        "fc.bias",
        "lm_head.weight has shape [20, 16], expected [30, 16]",
        "o_proj.weight has shape [32, 16]",
        "gate_proj.weight has dtype I32",
    ):
        assert name in msg, (name, msg)


def test_head_for_another_target_is_refused(tmp_path):
    cfg = small_cfg()
    save_eagle3(tmp_path, cfg, small_head(cfg), dtype=np.float32)
    for wrong, what in (
        (ModelConfig(**{**TARGET.__dict__, "hidden_size": 32}), "hidden size"),
        (ModelConfig(**{**TARGET.__dict__, "vocab_size": 81}), "vocab"),
    ):
        with pytest.raises(CheckpointError, match=what) as err:
            load_eagle3(tmp_path, wrong)
        assert "\n" not in str(err.value)
    custom = small_cfg(tap_layers=(1, 3, 6))
    save_eagle3(tmp_path, custom, small_head(custom), dtype=np.float32)
    shallow = ModelConfig(**{**TARGET.__dict__, "num_layers": 4})  # has no layer 6 to tap
    with pytest.raises(CheckpointError, match="tap layers") as err:
        load_eagle3(tmp_path, shallow)
    assert "\n" not in str(err.value)


def test_inconsistent_vocab_buffers_and_bad_variants_are_refused(tmp_path):
    cfg = small_cfg()
    hf = {k: np.asarray(v) for k, v in head_to_hf(small_head(cfg)).items()}
    hf["d2t"] = hf["d2t"].astype(np.int64)
    t2d = hf["t2d"].copy()
    t2d[np.flatnonzero(t2d)[0]] = False
    safetensors.numpy.save_file({**hf, "t2d": t2d}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(CheckpointError, match="t2d and d2t"):
        load_eagle3(tmp_path, TARGET)
    for flag in (
        {"num_hidden_layers": 2},
        {"fc_norm": True},
        {"architectures": ["LlamaForCausalLM"]},
        {"tie_word_embeddings": True},
    ):
        with pytest.raises(UnsupportedModelError) as err:
            Eagle3Config.from_hf({**cfg.to_hf(), **flag}, TARGET)
        assert next(iter(flag)) in str(err.value) or "architectures" in flag


@pytest.mark.parametrize("variant", [{"norm_output": True}, {"norm_before_residual": True}])
def test_variant_flags_are_read_written_and_change_the_drafts(tmp_path, variant):
    """EAGLE-3.1's norm_output and speculators' norm_before_residual round-trip and take effect (the torch parity
    of each is in test_eagle3_head); false is EAGLE-3 itself, and a flag that is not a bool is refused."""
    cfg = small_cfg(**variant)
    head = small_head(cfg, seed=3)
    save_eagle3(tmp_path, cfg, head, dtype=np.float32)
    assert json.loads((tmp_path / "config.json").read_text())[next(iter(variant))] is True
    cfg2, head2 = load_eagle3(tmp_path, TARGET)
    assert cfg2 == cfg
    standard = Eagle3Head(small_cfg(), weights=nnx.to_pure_dict(nnx.state(head)))
    assert not np.allclose(draft_logits(head2)[1], draft_logits(standard)[1])
    flat = {**cfg.to_hf(), "norm_output": False, "norm_before_residual": False}
    assert Eagle3Config.from_hf(flat, TARGET) == small_cfg()
    with pytest.raises(CheckpointError, match="must be true or false"):
        Eagle3Config.from_hf({**cfg.to_hf(), **{k: "yes" for k in variant}}, TARGET)


def speculators_config(cfg: Eagle3Config) -> dict:
    """The config as vLLM's speculators library writes it: the layer's fields nest in transformer_layer_config."""
    flat = cfg.to_hf()
    top = ("draft_vocab_size", "norm_before_residual", "norm_output", "eagle_aux_hidden_state_layer_ids")
    layer = {k: v for k, v in flat.items() if k not in top}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "target_hidden_size": None,
        **{k: flat[k] for k in top if k in flat},
        "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"speculative_tokens": 3}],
            "verifier": {"name_or_path": "some/target"},
        },
    }


def test_speculators_format_configs_load(tmp_path):
    cfg = small_cfg(norm_before_residual=True, tap_layers=(1, 4, 6))
    head = small_head(cfg, seed=4)
    save_eagle3(tmp_path, cfg, head, dtype=np.float32)
    (tmp_path / "config.json").write_text(json.dumps(speculators_config(cfg)))
    cfg2, head2 = load_eagle3(tmp_path, TARGET)
    assert cfg2 == cfg
    for a, b in zip(draft_logits(head), draft_logits(head2)):
        np.testing.assert_array_equal(a, b)
    broken = {**speculators_config(cfg), "transformer_layer_config": "llama"}
    with pytest.raises(CheckpointError, match="transformer_layer_config"):
        Eagle3Config.from_hf(broken, TARGET)


def test_a_head_with_nan_weights_is_refused(tmp_path):
    cfg = small_cfg()
    hf = {k: np.asarray(v) for k, v in head_to_hf(small_head(cfg)).items()}
    hf["fc.weight"] = hf["fc.weight"].copy()
    hf["fc.weight"][3, 2] = np.nan
    safetensors.numpy.save_file(hf, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(CheckpointError, match="fc.weight holds NaN or infinite values") as err:
        load_eagle3(tmp_path, TARGET)
    assert "\n" not in str(err.value)


def test_pickled_weights_are_refused_with_a_conversion_hint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(small_cfg().to_hf()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="safetensors") as err:
        load_eagle3(tmp_path, TARGET)
    assert "pickle" in str(err.value) and "\n" not in str(err.value)


def test_rope_scaling_round_trips():
    """to_hf writes each rope type's own fields, and from_hf reads them back as they were."""
    linear = small_cfg(rope_scaling=RopeScaling("linear", 2.0))
    assert linear.to_hf()["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=32, beta_slow=2.0, mscale=1.0, truncate=False)
    for cfg in (linear, small_cfg(rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32)), small_cfg(rope_scaling=yarn)):
        assert Eagle3Config.from_hf(cfg.to_hf(), TARGET) == cfg


def test_tap_layer_conventions_round_trip():
    default = small_cfg()
    assert default.tap_layers == (2, 4, 5)
    hf = default.to_hf()
    assert "eagle_aux_hidden_state_layer_ids" not in hf and "eagle_config" not in hf
    assert Eagle3Config.from_hf(hf, TARGET) == default

    custom = small_cfg(tap_layers=(1, 3, 6))  # inputs of layers 1, 3, 6 = outputs of layers 0, 2, 5
    hf = custom.to_hf()
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # vLLM: inputs of layers
    assert hf["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}  # SGLang: outputs of layers
    assert Eagle3Config.from_hf(hf, TARGET) == custom
    only_vllm = {k: v for k, v in hf.items() if k != "eagle_config"}
    only_sglang = {k: v for k, v in hf.items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert Eagle3Config.from_hf(only_vllm, TARGET).tap_layers == (1, 3, 6)
    assert Eagle3Config.from_hf(only_sglang, TARGET).tap_layers == (1, 3, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixed = Eagle3Config.from_hf({**hf, "eagle_aux_hidden_state_layer_ids": [0, 2, 5]}, TARGET)
    assert mixed.tap_layers == (1, 3, 6) and any("disagree" in str(w.message) for w in caught)


def test_default_for_and_head_defaults():
    cfg = Eagle3Config.default_for(LLAMA31_8B, draft_vocab_size=32000)
    assert (cfg.tap_layers, cfg.fc_in_features, cfg.num_layers) == ((2, 16, 29), 3 * 4096, 1)
    assert cfg.rope_theta == LLAMA31_8B.rope_theta and not cfg.needs_own_embedding
    head = Eagle3Head(small_cfg(draft_vocab_size=80), rngs=nnx.Rngs(0))
    assert np.all(np.asarray(head.d2t[...]) == 0) and np.all(np.asarray(head.t2d[...]))
    assert head.embed is None


def test_full_vocabulary_head_without_buffers_and_zero_embedding_loads(tmp_path):
    """Vd == V heads may omit d2t/t2d (EAGLE deletes them); an all-zero stored embedding means "share the target's"."""
    cfg = small_cfg(draft_vocab_size=80)
    head = small_head(cfg, seed=4)
    hf = {k: np.asarray(v) for k, v in head_to_hf(head).items() if k not in ("d2t", "t2d")}
    hf["embed_tokens.weight"] = np.zeros((80, 16), np.float32)
    safetensors.numpy.save_file(hf, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_hf(), "draft_vocab_size": None}))
    cfg2, head2 = load_eagle3(tmp_path, TARGET)
    assert cfg2 == cfg and head2.embed is None
    assert np.array_equal(np.asarray(head2.target_ids_of_draft_vocab()), np.arange(80))
    for a, b in zip(draft_logits(head), draft_logits(head2)):
        np.testing.assert_array_equal(a, b)
