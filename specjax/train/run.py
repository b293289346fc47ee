"""The training pipeline's stages, each runnable alone and resumable, all writing under `output_dir`:

synthesize -> prompts/   prompts the target writes itself (kept when they pass the filters), with a manifest
regenerate -> data/      the target's own responses to the prompts (token arrays + assistant-only loss masks)
vocab      -> vocab.npz  the draft vocabulary (d2t / t2d) from the frequencies of the tokens the target wrote
features   -> features/  the packed training rows with the target's features (skipped when training.features=online)
train      -> train/     orbax checkpoints + metrics.jsonl
evaluate   -> eval.json  mean accepted length on held-out prompts, by real speculative decoding
export     -> export/    the draft's folder (config.json + model.safetensors + README.md)

output_dir/config.json records the run's settings; a later run on the same folder must agree with them
(`check_record`). What differs between the kinds of draft (`model.drafter`) comes from the run's `DraftKind`
(specjax/train/kinds.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import operator
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from specjax.decoding import speculative
from specjax.decoding.stats import acceptance
from specjax.drafters.registry import draft_folder
from specjax.errors import InputError, OutputError, SpecjaxError
from specjax.evalsets import chat_prompts, humaneval_prompts
from specjax.host import start_distributed, write_file
from specjax.io.jsonl import read_prompts_file
from specjax.io.loading import LoadedModel, load_model
from specjax.sharding import make_mesh
from specjax.train.batches import BatchSource, nested_subset, pack
from specjax.train.config import TrainConfig, config_to_dict
from specjax.train.conversations import read_conversations
from specjax.train.data import load_prompts, load_samples, reference_responses, regenerate
from specjax.train.features import compute_features, feature_layers, load_features
from specjax.train.kinds import DRAFT_KINDS, draft_kind
from specjax.train.model_card import model_card
from specjax.train.store import read_manifest
from specjax.train.synthesize import synthesize
from specjax.train.trainer import Trainer, checkpoint_manager, restore_latest, train
from specjax.train.vocab import assistant_token_counts, coverage, load_vocab, save_vocab, vocab_from_counts

STAGES = ("synthesize", "regenerate", "vocab", "features", "train", "evaluate", "export")
# Sections that define what a run has already produced: a resumed run must agree on them (training.steps may grow).
# The training sections bind only once the train stage has started.
_DATA_SECTIONS = ("model", "data")
# Training settings a resumed run may change: its length, the optimiser's schedule and clipping (the optimiser's
# state carries over), where the stored features are read, and how a step is computed (remat, microbatches, dtype).
# Everything else in `training`, `mesh` and the kinds' own sections shapes the state or the data order.
RESUMABLE_TRAINING_KEYS = (
    "steps",
    "stop_after",
    "epochs",
    "learning_rate",
    "warmup_steps",
    "final_lr_ratio",
    "grad_clip",
    "weight_decay",
    "features_dir",
    "remat",
    "grad_accumulation",
    "compute_dtype",
)
_TRAIN_SECTIONS = ("training", "mesh", *(kind.section for kind in DRAFT_KINDS.values() if kind.section))


def check_record(cfg: TrainConfig) -> None:
    """Raises InputError when output_dir holds a run made with other data (or, once trained, training) settings."""
    path = cfg.output_path / "config.json"
    if not path.exists():
        return
    previous, current = json.loads(path.read_text()), config_to_dict(cfg)
    defaults = config_to_dict(TrainConfig())  # a key added since the record was written reads as its default
    trained = (cfg.output_path / "train").exists()
    for section in _DATA_SECTIONS + (_TRAIN_SECTIONS if trained else ()):
        a, b = {**defaults[section], **previous.get(section, {})}, dict(current[section])
        if section == "data":  # the store is content-addressed: where it lives does not change what a run read
            a.pop("store"), b.pop("store")
        if section == "training":
            changed = {k: (a.get(k), b[k]) for k in RESUMABLE_TRAINING_KEYS if a.get(k) != b[k]}
            if trained and changed:
                print(f"resuming with changed training settings: {changed}", file=sys.stderr)
            for key in RESUMABLE_TRAINING_KEYS:
                a.pop(key, None), b.pop(key, None)
        if a != b:
            raise InputError(
                f"{cfg.output_dir} holds a run made with different {section} settings; "
                "choose another output_dir or restore the original config"
            )


def record_config(cfg: TrainConfig) -> None:
    """Writes output_dir/config.json, or checks that an existing run there was made with the same settings."""
    check_record(cfg)
    path = cfg.output_path / "config.json"
    text = json.dumps(config_to_dict(cfg), indent=1)
    if path.exists() and path.read_text() == text:
        return  # the same run: leave the record (and its mtime) alone
    write_file(path, text)


def init_from_folder(cfg: TrainConfig) -> Path:
    """The folder of the `training.init_from` draft: a path, or the name of a draft shipped with specjax."""
    return draft_folder(draft_kind(cfg).name, cfg.training.init_from)


def initial_draft(cfg: TrainConfig, model: LoadedModel) -> tuple[Any, Any]:
    """The `training.init_from` draft, which must have the run's shape (raises InputError): (its config, the
    draft in its exported form, specjax/train/kinds.py)."""
    kind = draft_kind(cfg)
    try:
        draft = kind.load_draft(init_from_folder(cfg), model.cfg)
    except SpecjaxError as e:
        raise InputError(f"training.init_from: {e}") from None
    found, want = kind.config_of(draft), kind.draft_config(cfg, model.cfg)

    def shape(config, draft_vocab: int) -> dict:  # the draft vocabulary: a field of EAGLE-3's config, not DFlash's
        return {
            name: draft_vocab if name == "draft_vocab_size" else operator.attrgetter(name)(config)
            for name in kind.shape_fields
        }

    have, need = shape(found, kind.draft_vocab_size(draft, model.cfg)), shape(want, cfg.model.draft_vocab_size)
    differ = [f"{name} {have[name]} (run: {need[name]})" for name in have if have[name] != need[name]]
    if differ:
        raise InputError(f"training.init_from {cfg.training.init_from} has another shape: {', '.join(differ)}")
    return found, draft


def validate(cfg: TrainConfig, model: LoadedModel, stages: list[str]) -> None:
    """Checks everything that can be checked before any stage writes: the mesh against the devices, the batch
    against the mesh, the draft against the target, the prompts file. Raises InputError; writes nothing, so these
    mistakes surface before a regeneration that may take hours.
    """
    if "regenerate" in stages and "synthesize" not in stages:
        # A missing or malformed prompts file, or too few prompts.
        load_prompts(cfg.data, synthetic_path(cfg), evaluation_prompts())
    else:
        for source in cfg.data.prompt_sources:
            if source not in ("builtin", "synthetic"):
                read_conversations(Path(source))  # a missing or malformed prompts file
    draft_kind(cfg).draft_config(cfg, model.cfg)  # tap layers / vocabulary sizes against the target
    if cfg.training.init_from:
        initial_draft(cfg, model)
    if {"train", "evaluate", "export"} & set(stages):
        mesh = make_mesh(cfg.mesh.axes)
        replicas = mesh.shape["data"] * mesh.shape["fsdp"]
        n = cfg.training.grad_accumulation
        if cfg.training.batch_size % (replicas * n):
            raise InputError(
                f"training.batch_size={cfg.training.batch_size} does not divide over mesh data x fsdp = {replicas} "
                f"devices{f' in each of {n} microbatches' if n > 1 else ''}; make it a multiple"
            )
    check_record(cfg)  # output_dir holds another run


def store_root(cfg: TrainConfig) -> Path:
    return Path(cfg.data.store) if cfg.data.store else cfg.output_path / "store"


def synthetic_path(cfg: TrainConfig) -> Path:
    return cfg.output_path / "prompts" / "synthetic.jsonl"


def evaluation_prompts() -> list[str]:
    """Prompts that training data must never resemble: HumanEval and the chat set (the held-out prompts are kept
    apart by the regenerate stage)."""
    return humaneval_prompts() + chat_prompts()


def stage_synthesize(cfg: TrainConfig, model: LoadedModel) -> None:
    if cfg.synthesize.num_prompts == 0:
        print("skipped: synthesize.num_prompts is 0", file=sys.stderr)
        return
    synthesize(model, cfg.synthesize, store_root(cfg), synthetic_path(cfg).parent, evaluation_prompts())


def stage_regenerate(cfg: TrainConfig, model: LoadedModel) -> None:
    regenerate(model, cfg.data, cfg.output_path / "data", store_root(cfg), evaluation_prompts())


VOCAB_SIZES = (4096, 8192, 16384)  # the sizes whose coverage the vocab stage reports beside the configured one


def stage_vocab(cfg: TrainConfig, model: LoadedModel) -> None:
    """The draft vocabulary, and the share of the target's tokens it covers, for several sizes: on the training
    responses, and on the target's greedy responses to each evaluation set (which never enter the counts)."""
    samples = load_samples(cfg.output_path / "data", regenerated_only=True)
    counts = assistant_token_counts(samples, model.cfg.vocab_size)
    d2t, t2d, covered = vocab_from_counts(counts, cfg.model.draft_vocab_size)
    save_vocab(cfg.output_path / "vocab.npz", d2t, t2d)
    data = dataclasses.replace(
        cfg.data, max_new_tokens=cfg.evaluation_max_new_tokens, max_prompt_tokens=model.cfg.max_position_embeddings
    )
    held_out = {
        name: reference_responses(model, evaluation_set(cfg, name)[: cfg.evaluation.num_prompts], data, store_root(cfg))
        for name in cfg.evaluation.sets
    }
    by_size = {}
    for size in sorted({*VOCAB_SIZES, cfg.model.draft_vocab_size}):
        _, size_t2d, training_coverage = vocab_from_counts(counts, min(size, model.cfg.vocab_size))
        by_size[size] = {"training": training_coverage}
        by_size[size].update({name: coverage(s, size_t2d) for name, s in held_out.items()})
    report = {"draft_vocab_size": len(d2t), "coverage": covered, "coverage_by_size": by_size}
    write_file(cfg.output_path / "vocab.json", json.dumps(report, indent=1))
    print(f"draft vocabulary: {len(d2t)} tokens cover {covered:.2%} of the tokens the target wrote", file=sys.stderr)
    for size, row in by_size.items():
        print(f"  {size:>6}: " + ", ".join(f"{k} {v:.2%}" for k, v in row.items()), file=sys.stderr)


def packed_rows(cfg: TrainConfig) -> dict:
    """The regenerated samples packed into training rows (specjax/train/batches.py)."""
    return pack(load_samples(cfg.output_path / "data"), cfg.training.seq_len)


def stage_features(cfg: TrainConfig, model: LoadedModel) -> None:
    if cfg.training.features == "online":
        print("skipped: training.features=online computes them in every step", file=sys.stderr)
        return
    compute_features(model.weights, model.cfg, stored_layers(cfg, model), packed_rows(cfg), features_dir(cfg))


def features_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.training.features_dir) if cfg.training.features_dir else cfg.output_path / "features"


def stored_layers(cfg: TrainConfig, model: LoadedModel) -> tuple[int, ...]:
    """The target layers whose residual streams the features stage stores: the draft's taps, then the last."""
    return feature_layers(draft_kind(cfg).draft_config(cfg, model.cfg).tap_layers, model.cfg)


def build_trainer(cfg: TrainConfig, model: LoadedModel) -> Trainer:
    """The trainer of the run's draft: the `training.init_from` draft (its weights and its own draft vocabulary), or
    random weights over the vocab stage's vocabulary."""
    kind = draft_kind(cfg)
    if cfg.training.init_from:
        _, draft = initial_draft(cfg, model)
    else:
        d2t, t2d = load_vocab(cfg.output_path / "vocab.npz")
        draft = kind.random_draft(kind.draft_config(cfg, model.cfg), cfg.training.seed, d2t, t2d)
    training = kind.trainable(draft, cfg, model.cfg)
    return Trainer(cfg, model.cfg, model.weights, training, make_mesh(cfg.mesh.axes))


def stage_train(cfg: TrainConfig, model: LoadedModel) -> None:
    t = cfg.training
    if t.features == "stored":
        rows = load_features(features_dir(cfg), stored_layers(cfg, model), t.seq_len)
    else:
        rows = packed_rows(cfg)
    draft_kind(cfg).check_training_rows(cfg, rows)
    if t.data_fraction < 1:
        keep = nested_subset(len(rows["tokens"]), t.data_fraction, t.seed)
        rows = {key: value[keep] for key, value in rows.items()}
    if jax.process_index() == 0:  # what the draft is trained on, for the scaling curve
        write_file(
            cfg.output_path / "training_rows.json",
            json.dumps(
                {
                    "data_fraction": t.data_fraction,
                    "rows": len(rows["tokens"]),
                    "samples": int(rows["segments"].max(1).sum()),
                    "assistant_tokens": int(rows["loss_mask"].sum()),
                }
            ),
        )
    if t.epochs is not None:
        steps = max(1, math.ceil(t.epochs * len(rows["tokens"]) / t.batch_size))
        print(f"training.epochs={t.epochs}: {steps} steps over {len(rows['tokens'])} rows", file=sys.stderr)
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(t, steps=steps))
    trainer = build_trainer(cfg, model)
    train(trainer, BatchSource(rows, t.batch_size, t.seed), cfg.output_path / "train", stop_after=t.stop_after)


def evaluation_set(cfg: TrainConfig, name: str) -> list[str]:
    if name == "heldout":
        return read_prompts_file(cfg.output_path / "data" / "eval_prompts.jsonl")
    return chat_prompts() if name == "chat" else humaneval_prompts()


def trained_draft(cfg: TrainConfig, model: LoadedModel) -> tuple[int, Any]:
    """(step, draft) of the latest intact checkpoint, the draft in its exported form (specjax/train/kinds.py) gathered
    to host memory. Before any checkpoint, a run with `training.init_from` gives its starting draft (step 0), so the
    evaluate stage measures the draft it continues with the run's own settings."""
    trainer = build_trainer(cfg, model)
    manager = checkpoint_manager(trainer, cfg.output_path / "train")
    try:
        state = restore_latest(trainer, manager)
    finally:
        manager.close()
    if int(state["step"]) == 0 and not cfg.training.init_from:
        raise InputError(f"{cfg.output_dir}/train holds no checkpoint; run the train stage first")
    return int(state["step"]), trainer.export(state)  # every process takes part in the gather


def stage_evaluate(cfg: TrainConfig, model: LoadedModel) -> dict:
    """Mean accepted length (tokens per target forward, bonus included) of the latest checkpoint on each evaluation
    set, by greedy speculative decoding in each of the kind's evaluation modes (EAGLE-3: chain with K =
    EVAL_DRAFT_TOKENS and tree EVAL_TREE; DFlash: the whole block); written to eval.json.

    Prompts run `evaluation.batch_size` at a time, in order of length (one compilation per padded length). Each row
    drafts, verifies and accepts on its own, and the histogram counts row-rounds, so the figures are those of
    decoding each prompt alone."""
    step, draft = trained_draft(cfg, model)
    drafters = draft_kind(cfg).evaluation_drafters(draft, model.weights)
    eos = model.eos_ids
    max_new = cfg.evaluation_max_new_tokens
    size = cfg.evaluation.batch_size
    report = {"step": step, "max_new_tokens": max_new, "sets": {}}
    for set_name in cfg.evaluation.sets:
        prompts = evaluation_set(cfg, set_name)[: cfg.evaluation.num_prompts]
        ids = sorted((model.tokenizer.chat_prompt_ids(p) for p in prompts), key=len)
        batches = [ids[i : i + size] for i in range(0, len(ids), size)]
        result = {"prompts": len(ids)}
        for name, description, drafter, k in drafters:
            hist = None
            for batch in tqdm(batches, desc=f"evaluate {set_name} {name}", unit="batch", file=sys.stderr):
                out = speculative.speculative_generate(
                    model.weights,
                    model.cfg,
                    batch,
                    drafter=drafter,
                    num_draft_tokens=k,
                    max_new_tokens=max_new,
                    eos_ids=eos,
                    batch_size=size,
                )
                h = out.stats.accepted_histogram
                hist = h if hist is None else [a + b for a, b in zip(hist, h)]
            mean_accepted, by_position = acceptance(hist)
            result[name] = {
                "drafts": description,
                "mean_accepted": mean_accepted,
                "acceptance_by_position": by_position,
            }
            print(f"{set_name} {name}: mean accepted length {mean_accepted:.2f}", file=sys.stderr)
        report["sets"][set_name] = result
    if jax.process_index() == 0:
        write_file(cfg.output_path / "eval.json", json.dumps(report, indent=1))
    return report


def stage_export(cfg: TrainConfig, model: LoadedModel) -> Path:
    """Writes the latest checkpoint's draft to export/ in bfloat16, with its model card."""
    kind = draft_kind(cfg)
    _, draft = trained_draft(cfg, model)
    folder = cfg.output_path / "export"
    if jax.process_index() == 0:  # one writer
        kind.export_draft(folder, draft)
        out = cfg.output_path
        manifest = read_manifest(out / "data", "holds no finished dataset; run the regenerate stage first")
        vocab = _json_if_present(out / "vocab.json")
        coverage = vocab["coverage"] if vocab else None
        evaluation = _json_if_present(out / "eval.json")
        synthetic = _json_if_present(out / "prompts" / "manifest.json")
        start = init_from_folder(cfg) / "README.md" if cfg.training.init_from else None
        start_card = start.read_text() if start and start.is_file() else None
        card = model_card(cfg, kind.card, kind.config_of(draft), manifest, synthetic, coverage, evaluation, start_card)
        write_file(folder / "README.md", card)
    return folder


def _json_if_present(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def run(cfg: TrainConfig, stages: list[str]) -> None:
    """Runs the given stages (names from STAGES, or ["all"]) in pipeline order, after checking what can be checked
    before anything is written."""
    if list(stages) == ["all"]:
        stages = list(STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise InputError(f"unknown stage(s) {unknown}; choose from {', '.join(STAGES)} or all")
    refuse_links_inside(cfg.output_path)
    start_distributed(cfg.distributed.coordinator, cfg.distributed.num_processes, cfg.distributed.process_id)
    # One copy of the target for every stage, each weight read straight into its shards on the run's mesh (by the
    # run's rules, so the trainer keeps it as it is).
    model = load_model(cfg.model.target, mesh=make_mesh(cfg.mesh.axes), rules=cfg.mesh.sharding_rules)
    validate(cfg, model, stages)
    with exclusive_output_dir(cfg.output_path) if jax.process_index() == 0 else contextlib.nullcontext():
        record_config(cfg)
        for stage in (s for s in STAGES if s in stages):
            print(f"== {stage}", file=sys.stderr)
            STAGE_FUNCTIONS[stage](cfg, model)


def refuse_links_inside(output_dir: Path) -> None:
    """Refuses, in one OutputError line, a symbolic link anywhere inside output_dir, so that a run writes nothing
    outside it (output_dir itself may be a link: the user's choice, followed once). Checked before anything is
    written; an outside data.store or training.features_dir is named in the config instead."""
    for folder, subfolders, files in os.walk(output_dir):
        for name in (*subfolders, *files):
            path = Path(folder, name)
            if path.is_symlink():
                raise OutputError(
                    f"{path} is a symbolic link to {os.readlink(path)}; specjax-train writes only inside output_dir, "
                    "never through links: remove the link"
                )


@contextlib.contextmanager
def exclusive_output_dir(path: Path):
    """Holds an OS lock (flock on output_dir/.lock) for the whole run: a second run on the same output_dir is
    refused with one line naming the holder, instead of both writing the same checkpoints and metrics."""
    if path.exists() and not path.is_dir():
        raise InputError(f"output_dir {str(path)!r} is a file; choose a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        reason = ".lock in it is a symbolic link; remove the link" if e.errno == errno.ELOOP else e.strerror
        raise InputError(f"cannot use output_dir {str(path)!r}: {reason}") from None
    with os.fdopen(fd, "r+", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise InputError(
                f"{path} is in use by another specjax-train run ({lock.read().strip() or 'holder unknown'}); "
                "wait for it to end or choose another output_dir"
            ) from None
        try:
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
            lock.flush()
        except OSError as e:
            raise OutputError(f"cannot write {path / '.lock'}: {e.strerror}") from None
        yield


STAGE_FUNCTIONS = {
    "synthesize": stage_synthesize,
    "regenerate": stage_regenerate,
    "vocab": stage_vocab,
    "features": stage_features,
    "train": stage_train,
    "evaluate": stage_evaluate,
    "export": stage_export,
}
