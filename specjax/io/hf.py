"""HF checkpoint folders: config.json plus safetensors (single file, indexed shards, or any *.safetensors)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from safetensors import SafetensorError, safe_open

from specjax.config import MetadataFields, ModelConfig
from specjax.errors import CheckpointError, UnsupportedModelError
from specjax.host import write_file
from specjax.models.llama import Weights, weights_from_hf, weights_to_hf
from specjax.sharding import DEFAULT_RULES, MeshChoice, Rules


def read_json(path: Path) -> dict[str, Any]:
    """Reads a JSON object file, or raises CheckpointError naming it.

    Args:
      path: the file.
    Returns:
      The parsed object.
    """
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; point at a complete checkpoint folder")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download it") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object; re-download it")
    return data


def read_config(folder: Path) -> ModelConfig:
    """The ModelConfig of a folder's config.json.

    Args:
      folder: the checkpoint folder.
    Returns:
      The config. Raises CheckpointError for a missing/bad file, UnsupportedModelError for an unsupported model.
    """
    path = folder / "config.json"
    hf = read_json(path)
    if "quantization_config" in hf:
        quant = hf["quantization_config"]
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UnsupportedModelError(
            f"{path} describes a {method}-quantized checkpoint; use its float (bf16/fp16/fp32) release or a GGUF"
        )
    return ModelConfig.from_hf(hf, str(path))


def _safetensors_files(folder: Path) -> list[Path]:
    """model.safetensors, else the shards named by model.safetensors.index.json, else every *.safetensors.
    Pickled PyTorch weights are refused with the one-line conversion (unpickling runs code)."""
    if not any(folder.glob("*.safetensors")) and not (folder / "model.safetensors.index.json").is_file():
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        if pickled:
            raise CheckpointError(
                f"{folder} holds only pickled PyTorch weights ({', '.join(pickled)}), which specjax does not load "
                '(unpickling runs code); convert once with: python -c "import torch, safetensors.torch as st; '
                f"st.save_file(torch.load('{folder / pickled[0]}', weights_only=True), "
                f"'{folder / 'model.safetensors'}')\""
            )
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = MetadataFields(read_json(index), str(index)).read(
            "weight_map",
            "a non-empty object mapping tensor names to shard file names in the folder",
            lambda v: isinstance(v, dict) and v and all(isinstance(f, str) and Path(f).name == f for f in v.values()),
        )
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} listed in {index.name} is missing from {folder}; re-download it")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights; point at a complete checkpoint folder")
    return files


@contextlib.contextmanager
def open_tensors(folder: Path):
    """Opens a folder's safetensors lazily (memory-mapped).

    Args:
      folder: the checkpoint folder.
    Yields:
      get(name) -> np.ndarray, which raises KeyError for an absent tensor; bf16 comes back as ml_dtypes.bfloat16.
    """
    with contextlib.ExitStack() as stack:
        where: dict[str, Any] = {}
        for path in _safetensors_files(folder):
            try:
                handle = stack.enter_context(safe_open(str(path), framework="numpy"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path} is truncated or corrupt ({e}); re-download it") from None
            for name in handle.keys():
                where.setdefault(name, (handle, path))

        def get(name: str) -> np.ndarray:
            handle, path = where[name]
            try:
                return handle.get_tensor(name)
            except (SafetensorError, OSError, TypeError) as e:
                raise CheckpointError(f"cannot read tensor {name!r} from {path} ({e}); re-download it") from None

        yield get


def load_hf(
    folder: str | os.PathLike,
    dtype=jnp.float32,
    mesh: MeshChoice = None,
    quantize: str = "none",
    rules: Rules = DEFAULT_RULES,
) -> tuple[ModelConfig, Weights]:
    """Loads an HF checkpoint folder.

    Args:
      folder: holds config.json and model.safetensors, or shards listed by model.safetensors.index.json, or any
        *.safetensors files.
      dtype: the dtype of the returned weights.
      mesh: where the weights go, split by their logical axes (`specjax.models.llama.weights_from_hf`).
      quantize: "int8" for int8 matrices, each quantized as it is read; "none".
      rules: the logical-axis rules that split them (`specjax.sharding.merged_rules`).
    Returns:
      (config, weights). Raises CheckpointError for a missing, corrupt or incomplete checkpoint and
      UnsupportedModelError for an architecture specjax does not run.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; pass a folder with config.json and *.safetensors")
    cfg = read_config(folder)
    with open_tensors(folder) as get:
        weights = weights_from_hf(cfg, get, dtype, mesh, str(folder), quantize, rules)
    return cfg, weights


def write_hf_tensors(
    folder: str | os.PathLike, hf_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], dtype=np.float32
) -> None:
    """Writes config.json and model.safetensors, each atomically.

    Args:
      folder: the destination (created if needed).
      hf_config: the config.json dict.
      tensors: HF-named tensors in PyTorch layout.
      dtype: the stored dtype of the float tensors (e.g. np.float32, np.float16, ml_dtypes.bfloat16); integer
        tensors keep theirs.
    """
    folder = Path(folder)
    arrays = {name: np.asarray(t) for name, t in tensors.items()}
    stored = {
        name: np.ascontiguousarray(t.astype(dtype) if np.issubdtype(t.dtype, np.floating) else t)
        for name, t in arrays.items()
    }
    write_file(folder / "model.safetensors", lambda tmp: safetensors.numpy.save_file(stored, tmp, {"format": "pt"}))
    text = json.dumps(dict(hf_config), indent=2)
    write_file(folder / "config.json", text)


def save_hf(folder: str | os.PathLike, cfg: ModelConfig, weights: Weights, dtype=np.float32) -> None:
    """Saves weights as an HF folder (config.json + model.safetensors) that `load_hf` and transformers read.

    Args:
      folder: the destination (created if needed).
      cfg: the model config.
      weights: the weights.
      dtype: the stored dtype (e.g. np.float32, ml_dtypes.bfloat16).
    """
    write_hf_tensors(folder, cfg.to_hf(), weights_to_hf(cfg, weights), dtype)
