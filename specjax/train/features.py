"""Stage 3 (features): the frozen target's features of every packed training row, computed once and stored.

A row's features are the target residual streams the draft reads (its tap layers) followed by the final residual
stream, from which the step computes the labels (the target's logits over the draft vocabulary): [T, (n + 1) * D].
They are stored as bfloat16 with the packed rows in numbered chunk files (`.npz`, no pickle), each written
atomically, so an interrupted stage resumes at the first missing chunk, and a manifest naming the rows and layers
they hold. Training then runs the draft alone, without the target's forward; with `training.features: online` the
step computes the same features itself (no disk, for targets whose features would not fit).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from specjax.config import ModelConfig
from specjax.decoding.batch import on_mesh, to_host
from specjax.errors import InputError
from specjax.host import write_file
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Weights, forward
from specjax.train.batches import ROW_KEYS, sample_causal_mask
from specjax.train.store import read_manifest, write_npz

CHUNK_ROWS = 64
FORWARD_ROWS = 8  # rows per target forward


def feature_layers(tap_layers: tuple[int, ...], target_cfg: ModelConfig) -> tuple[int, ...]:
    """The tapped layer ids of a row's features: the head's taps, then the final residual stream."""
    return (*tap_layers, target_cfg.num_layers)


def target_features(
    weights: Weights, cfg: ModelConfig, layers: tuple[int, ...], rows: dict[str, jax.Array]
) -> jax.Array:
    """The target's residual streams at `layers` for packed rows, each sample attending only to itself.

    Args:
      weights, cfg: the target.
      layers: tap ids (`feature_layers`).
      rows: int32 [B, T] "tokens", "positions", "segments" (specjax/train/batches.py).
    Returns:
      [B, T, len(layers) * D] in the target's dtype.
    """
    tokens = rows["tokens"]
    B = tokens.shape[0]
    mask = sample_causal_mask(rows["segments"])
    cache = KVCache.empty(cfg, B, 1, weights.embed.dtype)  # no prefix: lengths 0
    no_logits = jnp.zeros((B, 1), jnp.int32)  # the logits come later, over the draft vocabulary only
    _, features, _ = forward(weights, cfg, tokens, rows["positions"], cache, mask, layers, no_logits)
    return features


def _chunk_path(folder: Path, index: int) -> Path:
    return folder / f"chunk-{index:05d}.npz"


def compute_features(
    weights: Weights, cfg: ModelConfig, layers: tuple[int, ...], rows: dict[str, np.ndarray], folder: Path
) -> None:
    """Writes the features of `rows` into `folder` (manifest.json + chunk files); existing chunks are kept.

    Raises:
      InputError: `folder` holds features of other rows or layers.
    """
    settings = {
        "rows": len(rows["tokens"]),
        "seq_len": rows["tokens"].shape[1],
        "layers": list(layers),
        "tokens_sha1": hashlib.sha1(rows["tokens"].tobytes()).hexdigest(),
    }
    manifest = folder / "manifest.json"
    if manifest.exists() and json.loads(manifest.read_text()) != settings:
        raise InputError(f"{folder} holds features of other rows or layers; delete it to recompute them")
    write_file(manifest, json.dumps(settings))
    run = jax.jit(lambda w, r: target_features(w, cfg, layers, r).astype(jnp.bfloat16))
    chunks = -(-settings["rows"] // CHUNK_ROWS)
    todo = [i for i in range(chunks) if not _chunk_path(folder, i).exists()]
    with tqdm(todo, desc="features", unit="chunk", file=sys.stderr, disable=not todo) as bar:
        for i in bar:
            chunk = {k: v[i * CHUNK_ROWS : (i + 1) * CHUNK_ROWS] for k, v in rows.items()}
            n = len(chunk["tokens"])
            padded = {k: np.pad(v, [(0, -n % FORWARD_ROWS), (0, 0)]) for k, v in chunk.items()}
            parts = [
                to_host(run(*on_mesh((weights, {k: v[j : j + FORWARD_ROWS] for k, v in padded.items()}))))
                for j in range(0, n, FORWARD_ROWS)
            ]
            if jax.process_index() == 0:  # one writer
                write_npz(_chunk_path(folder, i), **chunk, features=np.concatenate(parts)[:n].view(np.uint16))


def load_features(folder: Path, layers: tuple[int, ...], seq_len: int) -> dict[str, np.ndarray]:
    """The packed rows and their features ("features": bfloat16 [R, T, F]) of a finished features stage."""
    settings = read_manifest(folder, "holds no features; run the features stage first")
    if settings["seq_len"] != seq_len or settings["layers"] != list(layers):
        raise InputError(
            f"{folder} holds features for seq_len {settings['seq_len']} and layers {settings['layers']}, "
            f"not {seq_len} and {list(layers)}; run the features stage again"
        )
    paths = [_chunk_path(folder, i) for i in range(-(-settings["rows"] // CHUNK_ROWS))]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise InputError(f"{folder} lacks {len(missing)} chunk(s) ({missing[0]}, ...); run the features stage again")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in (*ROW_KEYS, "features")}
    for path in paths:
        with np.load(path, allow_pickle=False) as z:
            for k in parts:
                parts[k].append(z[k])
    rows = {k: np.concatenate(v) for k, v in parts.items()}
    rows["features"] = rows["features"].view(jnp.bfloat16)
    return rows
