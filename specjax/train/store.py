"""A content-addressed store of generated data: one file per unit of work, named by the hash of everything that
determines its content (the target, the inputs, the generation settings).

A run skips every unit whose file exists, so an interrupted run resumes where it stopped, a larger run reuses the
units of a smaller one, and a store committed beside a config lets a later run retrain without generating again.
Files are written atomically (`host.write_file`: temporary file, then rename): a killed run or a full disk never
leaves a partial unit. A stage's output folder is finished when it holds its manifest.json (`read_manifest`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from specjax.errors import InputError
from specjax.host import write_file
from specjax.io.loading import LoadedModel


def content_key(fields: dict[str, Any]) -> str:
    """A short hash of a JSON-able description of a unit of work."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


def target_fingerprint(model: LoadedModel) -> str:
    """Identifies the target's weights: its config and the bytes of a slice of its embedding table."""
    sample = np.asarray(model.weights.embed[:64], np.float32).tobytes()
    return hashlib.sha256(json.dumps(model.cfg.to_hf(), sort_keys=True).encode() + sample).hexdigest()[:20]


class Store:
    """Files of one kind of unit (`synth` prompts, `responses` token shards) under a root folder."""

    def __init__(self, root: Path, kind: str, suffix: str):
        self.folder = Path(root) / kind
        self.suffix = suffix

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{self.suffix}"

    def has(self, key: str) -> bool:
        return self.path(key).exists()

    def write_text(self, key: str, text: str) -> None:
        write_file(self.path(key), text)

    def write_arrays(self, key: str, **arrays: np.ndarray) -> None:
        write_npz(self.path(key), compressed=True, **arrays)


def write_npz(path: Path, compressed: bool = False, **arrays: np.ndarray) -> None:
    """Writes arrays to an `.npz` file atomically (`host.write_file`)."""

    def save(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file, not a name: np.savez would add ".npz" to the temporary name
            (np.savez_compressed if compressed else np.savez)(f, **arrays)

    write_file(path, save)


def read_manifest(folder: Path, missing: str) -> dict:
    """The manifest.json of a finished stage's folder; InputError "{folder} {missing}" when it has none."""
    path = folder / "manifest.json"
    if not path.is_file():
        raise InputError(f"{folder} {missing}")
    return json.loads(path.read_text())
