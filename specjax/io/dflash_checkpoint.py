"""DFlash draft checkpoints in the published layout (docs/dflash.md, section 7): config.json and safetensors with
`fc.weight`, `hidden_norm.weight`, `norm.weight` and `layers.{i}.*` (Qwen3 layer names, PyTorch [out, in] layout),
read with or without a leading `model.`. specjax's drafts with a reduced vocabulary add the tensor `vocab_ids` (int64
[Vd], the ascending target ids the draft scores).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.errors import CheckpointError
from specjax.io.hf import open_tensors, read_json, write_hf_tensors
from specjax.models.dflash import DFlashConfig, DFlashWeights
from specjax.models.llama import hf_fetcher, layers_from_hf, layers_to_hf

LAYER_PREFIX = "layers."


def load_dflash(
    folder: str | os.PathLike, target_cfg: ModelConfig, dtype=jnp.float32
) -> tuple[DFlashConfig, DFlashWeights]:
    """Loads a DFlash draft made for `target_cfg`.

    Returns:
      (config, weights). Raises CheckpointError for a missing, corrupt or incomplete checkpoint, UnsupportedModelError
      for a variant specjax does not run, and InputError for a draft made for another target.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; pass a DFlash draft folder (config.json + *.safetensors)")
    cfg = DFlashConfig.from_hf(read_json(folder / "config.json"), target_cfg, str(folder / "config.json"))
    cfg.check_target(target_cfg)
    D, F = cfg.layers.hidden_size, len(cfg.target_layer_ids) * target_cfg.hidden_size
    with open_tensors(folder) as stored:

        def get(name: str) -> np.ndarray:
            try:
                return stored(name)
            except KeyError:
                return stored("model." + name)

        fetch = hf_fetcher(get, str(folder))
        host = DFlashWeights(
            fc=fetch("fc.weight", (D, F)).T,
            hidden_norm=fetch("hidden_norm.weight", (D,)),
            layers=layers_from_hf(cfg.layers, fetch, LAYER_PREFIX),
            norm=fetch("norm.weight", (D,)),
        )
        try:
            vocab_ids = np.asarray(get("vocab_ids")).astype(np.int64)
        except KeyError:
            vocab_ids = None
    for leaf in jax.tree.leaves(host):
        if not np.isfinite(leaf).all():
            raise CheckpointError(f"{folder} holds NaN or infinite weights; the draft is corrupt, retrain it")
    if vocab_ids is not None and (
        vocab_ids.ndim != 1
        or not 0 < vocab_ids.size <= cfg.layers.vocab_size
        or vocab_ids.min() < 0
        or vocab_ids.max() >= cfg.layers.vocab_size
        or np.any(np.diff(vocab_ids) <= 0)
    ):
        raise CheckpointError(
            f"{folder}: vocab_ids must be distinct ascending token ids in 0..{cfg.layers.vocab_size - 1}"
        )
    weights = jax.tree.map(lambda w: jnp.asarray(w, dtype), host)
    return cfg, DFlashWeights(
        weights.fc,
        weights.hidden_norm,
        weights.layers,
        weights.norm,
        None if vocab_ids is None else jnp.asarray(vocab_ids, jnp.int32),
    )


def dflash_to_hf(cfg: DFlashConfig, weights: DFlashWeights) -> dict[str, np.ndarray]:
    """The draft's tensors under the published names, PyTorch layout (float32; vocab_ids int64)."""
    out = {
        "fc.weight": np.ascontiguousarray(np.asarray(weights.fc, np.float32).T),
        "hidden_norm.weight": np.asarray(weights.hidden_norm, np.float32),
        "norm.weight": np.asarray(weights.norm, np.float32),
        **layers_to_hf(cfg.layers, weights.layers, LAYER_PREFIX),
    }
    if weights.vocab_ids is not None:
        out["vocab_ids"] = np.asarray(weights.vocab_ids, np.int64)
    return out


def save_dflash(folder: str | os.PathLike, cfg: DFlashConfig, weights: DFlashWeights, dtype=jnp.bfloat16) -> None:
    """Writes config.json + model.safetensors in the published layout, each file atomically."""
    hf = cfg.to_hf() | {"torch_dtype": np.dtype(dtype).name}
    write_hf_tensors(folder, hf, dflash_to_hf(cfg, weights), dtype)
