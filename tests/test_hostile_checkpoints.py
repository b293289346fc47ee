"""Hostile checkpoint metadata: every malformed, out-of-range or inconsistent value a loader reads is refused in one
line that names the file and the key, through the loader API and through the CLI (exit 2, no traceback).

One good checkpoint of each format is written per module; each case links its files into a fresh folder and
replaces the one file it corrupts.
"""

import json
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from flax import nnx

from specjax.cli.generate import entry
from specjax.errors import SpecjaxError
from specjax.io.dflash_checkpoint import load_dflash, save_dflash
from specjax.io.eagle3_checkpoint import load_eagle3, save_eagle3
from specjax.io.gguf import read_gguf
from specjax.io.hf import load_hf
from specjax.io.tokenizer import Tokenizer
from specjax.models.dflash import DFlashConfig, init_dflash
from specjax.models.eagle3 import Eagle3Config, Eagle3Head

DROP = object()  # a config override that removes the key


@pytest.fixture(scope="module")
def target(tmp_path_factory, save_tiny_llama):
    """(folder, config) of a tiny random 4-layer llama with SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("target")
    return folder, save_tiny_llama(folder, 4)


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory, target):
    folder = tmp_path_factory.mktemp("eagle3")
    cfg = Eagle3Config.default_for(target[1], draft_vocab_size=64)
    save_eagle3(folder, cfg, Eagle3Head(cfg, rngs=nnx.Rngs(0)), dtype=np.float32)
    return folder


@pytest.fixture(scope="module")
def dflash_draft(tmp_path_factory, target):
    folder = tmp_path_factory.mktemp("dflash")
    cfg = DFlashConfig.default_for(target[1], mask_token_id=0, block_size=4)
    save_dflash(folder, cfg, init_dflash(cfg, jax.random.key(1)), dtype=np.float32)
    return folder


def corrupted(good: Path, where: Path, file: str, change) -> Path:
    """A folder at `where` with links to `good`'s files, except `file`: `change` as bytes, or a dict of JSON keys to
    override in it (DROP removes one)."""
    where.mkdir()
    for f in good.iterdir():
        (where / f.name).symlink_to(f)
    (where / file).unlink(missing_ok=True)
    if isinstance(change, bytes):
        (where / file).write_bytes(change)
    else:
        data = json.loads((good / file).read_text()) if (good / file).is_file() else {}
        data = {k: v for k, v in {**data, **change}.items() if v is not DROP}
        (where / file).write_text(json.dumps(data))
    return where


def assert_one_line(error: pytest.ExceptionInfo, *names: str) -> None:
    message = str(error.value)
    assert isinstance(error.value, SpecjaxError), type(error.value)
    assert "\n" not in message, message
    for name in names:
        assert name in message, (name, message)


def assert_cli_refuses(capsys, argv: list[str], *names: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        entry([*argv, "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("specjax-generate: error:"), err
    for name in names:
        assert name in err, (name, err)


def test_the_good_checkpoints_load(target, eagle3_head, dflash_draft):
    folder, cfg = target
    assert load_hf(folder)[0] == cfg
    assert load_eagle3(eagle3_head, cfg)[0].draft_vocab_size == 64
    assert load_dflash(dflash_draft, cfg)[0].block_size == 4


# ---------------------------------------------------------------------------------------------------------------
# HF config.json: each case is (overrides, the key the message names).

CONFIG_CASES = {
    "zero heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "negative layers": ({"num_hidden_layers": -1}, "num_hidden_layers"),
    "string size": ({"hidden_size": "wide"}, "hidden_size"),
    "fractional size": ({"hidden_size": 16.5}, "hidden_size"),
    "huge vocabulary": ({"vocab_size": 2**40}, "vocab_size"),
    "bool size": ({"intermediate_size": True}, "intermediate_size"),
    "null required key": ({"num_attention_heads": None}, "num_attention_heads"),
    "missing required key": ({"hidden_size": DROP}, "hidden_size"),
    "list size": ({"num_key_value_heads": [1]}, "num_key_value_heads"),
    "heads not a multiple of kv heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "zero head_dim": ({"head_dim": 0}, "head_dim"),
    "zero max positions": ({"max_position_embeddings": 0}, "max_position_embeddings"),
    "negative rms eps": ({"rms_norm_eps": -1e-5}, "rms_norm_eps"),
    "nan rope theta": ({"rope_theta": float("nan")}, "rope_theta"),
    "string rope theta in rope_parameters": ({"rope_parameters": {"rope_theta": "big"}}, "rope_parameters.rope_theta"),
    "rope_scaling a string": ({"rope_scaling": "linear"}, "rope_scaling"),
    "rope_scaling a list": ({"rope_scaling": [8.0]}, "rope_scaling"),
    "negative rope factor": ({"rope_scaling": {"rope_type": "linear", "factor": -2}}, "rope_scaling.factor"),
    "llama3 low factor above high": (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4, "high_freq_factor": 1}},
        "rope_scaling.low_freq_factor",
    ),
    "dynamic rope scaling": ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    "unknown rope type": ({"rope_parameters": {"type": "longrope", "factor": 2.0}}, "rope_parameters.type"),
    "zero yarn beta_fast": (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 0}},
        "rope_scaling.beta_fast",
    ),
    "string yarn truncate": (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4, "truncate": "no"}},
        "rope_scaling.truncate",
    ),
    "string eos id": ({"eos_token_id": "abc"}, "eos_token_id"),
    "eos id outside the vocabulary": ({"eos_token_id": [2, 10**9]}, "eos_token_id"),
    "negative bos id": ({"bos_token_id": -1}, "bos_token_id"),
    "string flag": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    "negative sliding window": ({"model_type": "mistral", "sliding_window": -4}, "sliding_window"),
    "model_type not a string": ({"model_type": ["llama"]}, "model_type"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_hostile_config_json(case, target, tmp_path):
    overrides, key = CONFIG_CASES[case]
    folder = corrupted(target[0], tmp_path / "model", "config.json", overrides)
    with pytest.raises(SpecjaxError) as error:
        load_hf(folder)
    assert_one_line(error, str(folder / "config.json"), key)


# Config values that are well-formed but disagree with the weights: (overrides, tensor, stored, expected shape).
SHAPE_CASES = {
    "hidden size": ({"hidden_size": 32}, "model.embed_tokens.weight", "[49152, 16]", "[49152, 32]"),
    "vocabulary": ({"vocab_size": 50000}, "model.embed_tokens.weight", "[49152, 16]", "[50000, 16]"),
    "mlp width": ({"intermediate_size": 48}, "model.layers.0.mlp.gate_proj.weight", "[32, 16]", "[48, 16]"),
    "head dim": ({"head_dim": 4}, "model.layers.0.self_attn.q_proj.weight", "[16, 16]", "[8, 16]"),
    "layer count": ({"num_hidden_layers": 5}, "model.layers.4.input_layernorm.weight", "lacks", "[16]"),
}


@pytest.mark.parametrize("case", SHAPE_CASES)
def test_config_that_disagrees_with_the_weights(case, target, tmp_path):
    overrides, *names = SHAPE_CASES[case]
    folder = corrupted(target[0], tmp_path / "model", "config.json", overrides)
    with pytest.raises(SpecjaxError) as error:
        load_hf(folder)
    assert_one_line(error, str(folder), *names)


def test_config_json_errors_through_the_cli(target, tmp_path, capsys):
    zero_heads = corrupted(target[0], tmp_path / "zero", "config.json", {"num_attention_heads": 0})
    assert_cli_refuses(capsys, ["--model", str(zero_heads)], "config.json", "num_attention_heads")
    wide = corrupted(target[0], tmp_path / "wide", "config.json", {"hidden_size": 32})
    assert_cli_refuses(capsys, ["--model", str(wide)], "model.embed_tokens.weight", "[49152, 16]", "[49152, 32]")


# ---------------------------------------------------------------------------------------------------------------
# generation_config.json, tokenizer_config.json, chat_template.jinja: (file, change, the key named).

TOKENIZER_CASES = {
    "string eos id": ("generation_config.json", {"eos_token_id": "abc"}, "eos_token_id"),
    "negative eos id": ("generation_config.json", {"eos_token_id": [2, -1]}, "eos_token_id"),
    "eos id outside the vocabulary": ("generation_config.json", {"eos_token_id": 10**9}, "eos_token_id"),
    "float eos ids": ("generation_config.json", {"eos_token_id": [2.0]}, "eos_token_id"),
    "chat template a list of strings": ("tokenizer_config.json", {"chat_template": ["{{ x }}"]}, "chat_template"),
    "named chat templates without a default": (
        "tokenizer_config.json",
        {"chat_template": [{"name": "tool_use", "template": "{{ x }}"}]},
        "chat_template",
    ),
    "chat template a number": ("tokenizer_config.json", {"chat_template": 42}, "chat_template"),
    "bos token a number": ("tokenizer_config.json", {"bos_token": 5}, "bos_token"),
    "eos token content a number": ("tokenizer_config.json", {"eos_token": {"content": 5}}, "eos_token"),
    "chat_template.jinja not UTF-8": ("chat_template.jinja", b"\xff\xfe{{ messages }}", "chat_template.jinja"),
}


@pytest.mark.parametrize("case", TOKENIZER_CASES)
def test_hostile_tokenizer_files(case, target, tmp_path):
    file, change, key = TOKENIZER_CASES[case]
    folder = corrupted(target[0], tmp_path / "model", file, change)
    with pytest.raises(SpecjaxError) as error:
        Tokenizer.from_folder(folder)
    assert_one_line(error, str(folder / file), key)


def test_named_chat_templates_use_the_default(target, tmp_path):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ 'plain' }}"}]
    folder = corrupted(target[0], tmp_path / "model", "tokenizer_config.json", {"chat_template": templates})
    assert Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "hi"}]) == "plain"


def test_tokenizer_file_errors_through_the_cli(target, tmp_path, capsys):
    bad_stop = corrupted(target[0], tmp_path / "stop", "generation_config.json", {"eos_token_id": "abc"})
    assert_cli_refuses(capsys, ["--model", str(bad_stop)], "generation_config.json", "eos_token_id")
    latin1 = corrupted(target[0], tmp_path / "jinja", "chat_template.jinja", b"\xe9t\xe9 {{ messages }}")
    assert_cli_refuses(capsys, ["--model", str(latin1)], "chat_template.jinja", "UTF-8")


# ---------------------------------------------------------------------------------------------------------------
# GGUF metadata: a tiny GGUF without tensors (the metadata is read before any tensor).

GOOD_GGUF = {
    "general.architecture": "llama",
    "llama.block_count": 2,
    "llama.context_length": 64,
    "llama.embedding_length": 16,
    "llama.feed_forward_length": 32,
    "llama.attention.head_count": 2,
    "llama.attention.head_count_kv": 1,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 10000.0,
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt-2",
    "tokenizer.ggml.tokens": ["a", "b", "ab", "<s>", "</s>"],
    "tokenizer.ggml.token_type": [1, 1, 1, 3, 3],
    "tokenizer.ggml.merges": ["a b"],
    "tokenizer.ggml.bos_token_id": 3,
    "tokenizer.ggml.eos_token_id": 4,
}


def write_gguf(path: Path, meta: dict) -> Path:
    writer = gguf.GGUFWriter(str(path), meta["general.architecture"])
    for key, value in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            (writer.add_int64 if value < 0 else writer.add_uint64)(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_CASES = {
    "zero heads": {"llama.attention.head_count": 0},
    "string width": {"llama.embedding_length": "wide"},
    "negative layers": {"llama.block_count": -3},
    "zero rms eps": {"llama.attention.layer_norm_rms_epsilon": 0.0},
    "missing rms eps": {"llama.attention.layer_norm_rms_epsilon": DROP},
    "eos id outside the vocabulary": {"tokenizer.ggml.eos_token_id": 99},
    "tokens a string": {"tokenizer.ggml.tokens": "ab"},
    "merge of unknown tokens": {"tokenizer.ggml.merges": ["a c"]},
    "merge without a space": {"tokenizer.ggml.merges": ["ab"]},
    "token types of another length": {"tokenizer.ggml.token_type": [1, 1]},
    "string add_bos flag": {"tokenizer.ggml.add_bos_token": "yes"},
}


def test_the_good_gguf_reads(tmp_path):
    cfg, tensors, tokenizer = read_gguf(write_gguf(tmp_path / "good.gguf", GOOD_GGUF))
    assert (cfg.vocab_size, cfg.num_heads, cfg.eos_token_ids, tensors) == (5, 2, (4,), {})
    assert tokenizer.encode("ab") == [2]


@pytest.mark.parametrize("case", GGUF_CASES)
def test_hostile_gguf_metadata(case, tmp_path):
    change = GGUF_CASES[case]
    meta = {k: v for k, v in {**GOOD_GGUF, **change}.items() if v is not DROP}
    path = write_gguf(tmp_path / "bad.gguf", meta)
    with pytest.raises(SpecjaxError) as error:
        read_gguf(path)
    assert_one_line(error, str(path), next(iter(change)))


def test_gguf_metadata_errors_through_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "bad.gguf", {**GOOD_GGUF, "llama.attention.head_count": 0})
    assert_cli_refuses(capsys, ["--model", str(path)], str(path), "llama.attention.head_count")


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-3 head config.json: (overrides, the key named).

EAGLE3_CASES = {
    "zero heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "string width": ({"hidden_size": "16"}, "hidden_size"),
    "negative draft vocabulary": ({"draft_vocab_size": -1}, "draft_vocab_size"),
    "draft vocabulary above the target's": ({"draft_vocab_size": 10**6}, "draft_vocab_size"),
    "zero rms eps": ({"rms_norm_eps": 0}, "rms_norm_eps"),
    "heads not a multiple of kv heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "tap ids a string": ({"eagle_aux_hidden_state_layer_ids": "1,2,3"}, "eagle_aux_hidden_state_layer_ids"),
    "nested tap id a string": (
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, "x"]}},
        "eagle_config.eagle_aux_hidden_state_layer_ids",
    ),
    "variant flag a string": ({"norm_output": "yes"}, "norm_output"),
    "eos id outside the vocabulary": ({"eos_token_id": [1, 10**9]}, "eos_token_id"),
    "architectures a string": ({"architectures": "LlamaForCausalLMEagle3"}, "architectures"),
    "string rope factor": ({"rope_scaling": {"rope_type": "linear", "factor": "8"}}, "rope_scaling.factor"),
    "layer config a list": ({"transformer_layer_config": []}, "transformer_layer_config"),
    "mlp width unlike the weights": ({"intermediate_size": 48}, "midlayer.mlp.gate_proj.weight has shape"),
}


@pytest.mark.parametrize("case", EAGLE3_CASES)
def test_hostile_eagle3_head_config(case, target, eagle3_head, tmp_path):
    overrides, key = EAGLE3_CASES[case]
    folder = corrupted(eagle3_head, tmp_path / "head", "config.json", overrides)
    with pytest.raises(SpecjaxError) as error:
        load_eagle3(folder, target[1])
    assert_one_line(error, str(folder), key)


def test_eagle3_head_config_errors_through_the_cli(target, eagle3_head, tmp_path, capsys):
    head = corrupted(eagle3_head, tmp_path / "head", "config.json", {"num_attention_heads": 0})
    argv = ["--model", str(target[0]), "--drafter", f"eagle3:{head}"]
    assert_cli_refuses(capsys, argv, str(head / "config.json"), "num_attention_heads")


# ---------------------------------------------------------------------------------------------------------------
# DFlash draft config.json: (overrides, the key named).

DFLASH_CASES = {
    "zero heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "string block size": ({"block_size": "8"}, "block_size"),
    "block of one": ({"block_size": 1}, "block_size"),
    "negative mask token": ({"dflash_config": {"mask_token_id": -1}}, "dflash_config.mask_token_id"),
    "dflash_config a string": ({"dflash_config": "x"}, "dflash_config"),
    "fractional target layer": ({"dflash_config": {"target_layer_ids": [2.5]}}, "dflash_config.target_layer_ids"),
    "mlp width unlike the weights": ({"intermediate_size": 48}, "layers.0.mlp.gate_proj.weight"),
}


@pytest.mark.parametrize("case", DFLASH_CASES)
def test_hostile_dflash_config(case, target, dflash_draft, tmp_path):
    overrides, key = DFLASH_CASES[case]
    folder = corrupted(dflash_draft, tmp_path / "draft", "config.json", overrides)
    with pytest.raises(SpecjaxError) as error:
        load_dflash(folder, target[1])
    assert_one_line(error, str(folder), key)


def test_dflash_config_errors_through_the_cli(target, dflash_draft, tmp_path, capsys):
    draft = corrupted(dflash_draft, tmp_path / "draft", "config.json", {"block_size": "8"})
    argv = ["--model", str(target[0]), "--drafter", f"dflash:{draft}"]
    assert_cli_refuses(capsys, argv, str(draft / "config.json"), "block_size")
