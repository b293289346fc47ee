"""GGUF (llama.cpp) checkpoints: dequantized once into an HF folder in a cache, then loaded from there.

Architectures: `llama` (also Mistral), `qwen2`, `qwen3`. Tensors are dequantized to float32 with the `gguf` package.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from specjax.config import REQUIRED, MetadataFields, ModelConfig
from specjax.errors import CheckpointError, OutputError, UnsupportedModelError
from specjax.host import cache_dir, log, status
from specjax.io.hf import load_hf, write_hf_tensors
from specjax.io.tokenizer import Tokenizer
from specjax.models.llama import Weights, rope_inv_freq, weights_from_hf
from specjax.sharding import DEFAULT_RULES, MeshChoice, Rules

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # GGUF architecture -> HF model_type
_CACHE_FORMAT = 1  # bump when the conversion changes, so stale cache folders are not reused

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's precomputed llama3 rope-scaling divisors


def hf_name(gguf_name: str) -> str:
    """The HF tensor name of a GGUF tensor name, e.g. `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`.

    Args:
      gguf_name: the GGUF tensor name.
    Returns:
      The HF name. Raises UnsupportedModelError for a tensor specjax has no place for (e.g. MoE experts).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in specjax's Llama-family model")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's row permutation of a Q or K projection (interleaved rotary pairs -> HF rotate-half).

    Args:
      w: [n_heads * head_dim, ...] weight or bias as stored in a `llama` GGUF.
      n_heads: query heads for Q, kv heads for K.
    Returns:
      The rows in HF order.
    """
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def converted_folder(path: str | os.PathLike) -> Path:
    """Where the HF conversion of a GGUF file lives in the cache, keyed by its absolute path, size and mtime.

    Args:
      path: the GGUF file.
    Returns:
      The folder (it exists only once a conversion has completed).
    """
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{_CACHE_FORMAT}\n{path}\n{st.st_size}\n{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def _open(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:
        raise CheckpointError(f"{path} is not a readable GGUF file ({_one_line(e)}); re-download it") from None


def _one_line(e: Exception) -> str:
    first = str(e).partition("\n")[0]
    return f"{type(e).__name__}: {first}"


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All metadata of a GGUF file as plain Python values (strings, numbers, lists); no tensor is read.

    Args:
      path: the GGUF file.
    Returns:
      key -> value. Raises CheckpointError for a damaged file.
    """
    return _metadata(_open(Path(path)), Path(path))


def _metadata(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    try:
        return {key: field.contents() for key, field in reader.fields.items()}
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable GGUF metadata ({_one_line(e)}); re-download it") from None


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str], source: str = "GGUF metadata") -> dict[str, Any]:
    """The HF config.json dict described by GGUF metadata, each value read through `MetadataFields`.

    Args:
      meta: the GGUF metadata.
      tensor_names: the GGUF tensor names (they decide tied embeddings and q/k/v biases).
      source: the GGUF file, named in errors.
    Returns:
      The config dict. Raises CheckpointError naming the key of a missing or malformed value, and
      UnsupportedModelError for unsupported architectures or features.
    """
    fields = MetadataFields(meta, source, remedy="re-download or re-convert the file")
    arch = fields.text("general.architecture")
    if arch not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; specjax runs {', '.join(_MODEL_TYPES)} GGUF files"
        )

    def key(name: str) -> str:
        return f"{arch}.{name}"

    if fields.integer(key("expert_count"), 0, default=0):
        raise UnsupportedModelError("mixture-of-experts GGUF files are not supported; use a dense Llama-family model")
    for name in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        if isinstance(meta.get(key(name)), list):
            raise UnsupportedModelError(f"GGUF {key(name)} varies per layer; specjax needs uniform layers")
    hidden, heads = fields.integer(key("embedding_length")), fields.integer(key("attention.head_count"))
    head_dim = fields.integer(key("attention.key_length"), default=hidden // heads)
    if fields.integer(key("rope.dimension_count"), default=head_dim) != head_dim:
        raise UnsupportedModelError("partial rotary embeddings (rope.dimension_count < head_dim) are not supported")
    tokens = fields.strings("tokenizer.ggml.tokens", default=[])
    vocab = fields.integer(key("vocab_size"), default=len(tokens) or REQUIRED)
    stops = [fields.integer(f"tokenizer.ggml.{k}_token_id", 0, vocab, default=None) for k in ("eos", "eot", "eom")]
    hf: dict[str, Any] = {
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": fields.integer(key("feed_forward_length")),
        "num_hidden_layers": fields.integer(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": fields.integer(key("attention.head_count_kv"), default=heads),
        "head_dim": head_dim,
        "rms_norm_eps": _decimal(fields.positive(key("attention.layer_norm_rms_epsilon"))),
        "rope_theta": _decimal(fields.positive(key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": fields.integer(key("context_length"), default=4096),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "use_sliding_window": False,
        "bos_token_id": fields.integer("tokenizer.ggml.bos_token_id", 0, vocab, default=None),
        "eos_token_id": list(dict.fromkeys(i for i in stops if i is not None)),
    }
    scaling = fields.text(key("rope.scaling.type"), "none")
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": fields.positive(key("rope.scaling.factor"))}
    elif scaling != "none":
        raise UnsupportedModelError(
            f"GGUF rope scaling {scaling!r} is not supported; specjax implements llama3, linear"
        )
    return hf


def _decimal(x: float) -> float:
    """The shortest decimal that GGUF's float32 `x` came from (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _llama3_scaling(hf: dict[str, Any], divisors: np.ndarray, source: str) -> dict[str, Any]:
    """The llama3 `rope_scaling` whose frequencies match llama.cpp's `rope_freqs` divisors, or UnsupportedModelError."""
    scaling = {
        "rope_type": "llama3",
        "factor": float(divisors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain = rope_inv_freq(ModelConfig.from_hf({**hf, "rope_scaling": None}, source))
    scaled = rope_inv_freq(ModelConfig.from_hf({**hf, "rope_scaling": scaling}, source))
    if divisors.shape != plain.shape or not np.allclose(scaled, plain / divisors, rtol=1e-4):
        raise UnsupportedModelError("GGUF rope_freqs do not match llama3 rope scaling (factor, 1, 4, 8192)")
    return scaling


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """Reads and dequantizes a GGUF file into HF-named float32 tensors (PyTorch [out, in] layout).

    Args:
      path: the GGUF file.
    Returns:
      (config, HF name -> tensor, tokenizer). Raises CheckpointError for a damaged file and
      UnsupportedModelError for an architecture, tensor type or tokenizer specjax does not support.
    """
    path = Path(path)
    reader = _open(path)
    meta = _metadata(reader, path)
    hf = hf_config_from_gguf(meta, {t.name for t in reader.tensors}, str(path))
    tokenizer = Tokenizer.from_gguf_metadata(meta, str(path))
    permute = (
        {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}
        if hf["model_type"] == "llama"
        else {}
    )
    tensors: dict[str, np.ndarray] = {}
    show = sys.stderr.isatty()
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor", disable=not show, leave=False):
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest-first
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"GGUF tensor type {t.tensor_type.name} ({t.name}) cannot be dequantized"
            ) from None
        except (ValueError, IndexError, TypeError) as e:
            raise CheckpointError(f"{path}: tensor {t.name} is unreadable ({_one_line(e)}); re-download it") from None
        if w.size != math.prod(shape):
            raise CheckpointError(f"{path}: tensor {t.name} holds {w.size} values, expected {shape}; re-download it")
        w = w.reshape(shape)
        if t.name == _ROPE_FREQS:
            hf["rope_scaling"] = _llama3_scaling(hf, w, str(path))
            continue
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind in permute and w.shape[0] % (2 * permute[kind]) == 0:  # weights_from_hf names a mis-shaped one
            w = unpermute_qk(w, permute[kind])
        tensors[hf_name(t.name)] = w
    return ModelConfig.from_hf(hf, str(path)), tensors, tokenizer


def load_gguf(
    path: str | os.PathLike,
    dtype=jnp.float32,
    mesh: MeshChoice = None,
    quantize: str = "none",
    rules: Rules = DEFAULT_RULES,
) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Loads a GGUF file, converting it once into an HF folder in the cache (see `converted_folder`).

    The conversion is written to a temporary folder and renamed into place, so an interrupted one is never used.

    Args:
      path: the GGUF file.
      dtype: the dtype of the returned weights.
      mesh: where the weights go, split by their logical axes (`specjax.models.llama.weights_from_hf`).
      quantize: "int8" for int8 matrices, each quantized as it is read; "none".
      rules: the logical-axis rules that split them (`specjax.sharding.merged_rules`).
    Returns:
      (config, weights, tokenizer).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; pass a .gguf file")
    folder = converted_folder(path)
    if folder.is_dir():
        try:
            cfg, weights = load_hf(folder, dtype, mesh, quantize, rules)
            return cfg, weights, Tokenizer.from_folder(folder)
        except CheckpointError as e:
            log.warning(f"warning: the cached conversion is damaged ({e}); converting again")
            shutil.rmtree(folder, ignore_errors=True)
    status(f"converting {path.name} to safetensors in {folder.parent} (once)")
    cfg, tensors, tokenizer = read_gguf(path)
    weights = weights_from_hf(
        cfg, tensors.__getitem__, dtype, mesh, str(path), quantize, rules
    )  # checked before caching
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            write_hf_tensors(tmp, cfg.to_hf(), tensors)
            tokenizer.to_folder(tmp)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, OutputError) as e:
        if not folder.is_dir():  # else a concurrent conversion that finished first is as good as ours
            log.warning(f"warning: cannot cache the conversion in {folder.parent} ({e}); the next run converts again")
    return cfg, weights, tokenizer
