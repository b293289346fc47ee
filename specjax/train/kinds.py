"""The kinds of draft a run trains (`model.drafter`): one `DraftKind` record each, holding everything that differs
between them, from the draft's shape to the lines of its model card.

`draft_kind` is the one place a kind is looked up by name; the pipeline (specjax/train/run.py) and the model card
(specjax/train/model_card.py) call the record's pieces and never compare names. Between the stages a draft travels in
its exported form: an Eagle3Head, or a DFlash (config, weights) pair with the draft vocabulary in `weights.vocab_ids`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import ModelConfig
from specjax.drafters import DFlashDrafter, Eagle3Drafter
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError
from specjax.io.dflash_checkpoint import load_dflash, save_dflash
from specjax.io.eagle3_checkpoint import load_eagle3, save_eagle3
from specjax.models.dflash import DFlashConfig, init_dflash
from specjax.models.eagle3 import Eagle3Config, Eagle3Head
from specjax.models.llama import Weights
from specjax.train.config import DRAFTERS, EVAL_DRAFT_TOKENS, EVAL_TREE, TrainConfig
from specjax.train.drafts import DFlashTraining, Eagle3Training

# One drafting mode of the evaluate stage: (name, description, drafter, K).
EvaluationDrafter = tuple[str, str, Any, int]


@dataclasses.dataclass(frozen=True)
class DraftKind:
    """What one kind of draft is, how it starts, trains, exports, is evaluated and is described."""

    name: str  # the value of model.drafter, and the kind `specjax.drafters.base.draft_folder` takes
    section: str | None  # the config section of the kind's own settings (None: model and training hold them all)
    # The draft config a run trains, from the run's config and the target's, checked against the target.
    draft_config: Callable[[TrainConfig, ModelConfig], Any]
    # What a `training.init_from` draft must share with that config (attribute paths; "draft_vocab_size" is read
    # with `vocab_size`).
    shape_fields: tuple[str, ...]
    # Initial weights: a random draft of a draft config, seed and the vocab stage's (d2t, t2d).
    fresh: Callable[[Any, int, np.ndarray, np.ndarray], Any]
    load: Callable[[Path, ModelConfig], Any]  # an exported draft from its folder, made for the target
    config: Callable[[Any], Any]  # a draft's config
    vocab_size: Callable[[Any, ModelConfig], int]  # the number of target tokens a draft scores
    training: Callable[[Any, TrainConfig, ModelConfig], Any]  # a draft under its loss (specjax/train/drafts.py)
    check_rows: Callable[[TrainConfig, dict], None]  # raises InputError for training rows the kind cannot learn
    export: Callable[[Path, Any], None]  # writes a draft's folder (config.json + model.safetensors) in bfloat16
    evaluation_drafters: Callable[[Any, Weights], list[EvaluationDrafter]]  # the evaluate stage's modes
    # Model card: the title and draft sections (run config, draft config, the coverage and taps phrases), the
    # objective, how the standard-library answers are labelled, and notes after the data lines.
    card_draft: Callable[[TrainConfig, Any, str, str], list[str]]
    card_objective: Callable[[TrainConfig], str]
    card_source_labels: str
    card_notes: tuple[str, ...]


def _no_check(cfg: TrainConfig, rows: dict) -> None:
    """Every training row serves."""


# -- EAGLE-3: a head under the training-time-test loss, exported as LlamaForCausalLMEagle3 --------------------------


def _eagle3_config(cfg: TrainConfig, target_cfg: ModelConfig) -> Eagle3Config:
    base = Eagle3Config.default_for(target_cfg, cfg.model.draft_vocab_size)
    overrides = {"norm_output": cfg.model.norm_output, "norm_before_residual": cfg.model.norm_before_residual}
    if cfg.model.tap_layers is not None:
        overrides["tap_layers"] = cfg.model.tap_layers
    if cfg.model.intermediate_size is not None:
        overrides["intermediate_size"] = cfg.model.intermediate_size
    return dataclasses.replace(base, **overrides)


def _eagle3_fresh(draft_cfg: Eagle3Config, seed: int, d2t: np.ndarray, t2d: np.ndarray) -> Eagle3Head:
    head = Eagle3Head(draft_cfg, rngs=nnx.Rngs(seed))
    head.d2t[...] = jnp.asarray(d2t, jnp.int32)
    head.t2d[...] = jnp.asarray(t2d)
    return head


def _eagle3_drafters(head: Eagle3Head, target: Weights) -> list[EvaluationDrafter]:
    return [
        ("chain", f"K={EVAL_DRAFT_TOKENS}", Eagle3Drafter.create(head, target.embed, None), EVAL_DRAFT_TOKENS),
        (
            "tree",
            f"tree {EVAL_TREE}",
            Eagle3Drafter.create(head, target.embed, TreeSpec.parse(EVAL_TREE)),
            EVAL_DRAFT_TOKENS,
        ),
    ]


def _eagle3_card(cfg: TrainConfig, head_cfg: Eagle3Config, covers: str, taps: str) -> list[str]:
    return [
        f"# EAGLE-3 draft head for `{cfg.model.target}`",
        "",
        "Trained with specjax (`specjax-train`). Layout: `LlamaForCausalLMEagle3` (config.json + model.safetensors",
        "with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), readable by vLLM, SGLang and the EAGLE repository.",
        "",
        "## Head",
        f"- hidden {head_cfg.hidden_size}, {head_cfg.num_heads} heads / {head_cfg.num_kv_heads} KV heads, MLP "
        f"{head_cfg.intermediate_size}, draft vocabulary {head_cfg.draft_vocab_size} of {head_cfg.vocab_size}{covers}",
        taps,
        "- the token embedding is the target's (not stored)",
        "",
    ]


EAGLE3 = DraftKind(
    name="eagle3",
    section=None,
    draft_config=_eagle3_config,
    shape_fields=(
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "draft_vocab_size",
        "tap_layers",
        "norm_output",
        "norm_before_residual",
    ),
    fresh=_eagle3_fresh,
    load=lambda folder, target_cfg: load_eagle3(folder, target_cfg)[1],
    config=lambda head: head.cfg,
    vocab_size=lambda head, target_cfg: head.cfg.draft_vocab_size,
    training=lambda head, cfg, target_cfg: Eagle3Training(head, target_cfg, cfg.training),
    check_rows=_no_check,
    export=lambda folder, head: save_eagle3(folder, head.cfg, head, dtype=jnp.bfloat16),
    evaluation_drafters=_eagle3_drafters,
    card_draft=_eagle3_card,
    card_objective=lambda cfg: (
        f"training-time test over {cfg.training.ttt_length} steps (loss weights {cfg.training.step_decay}^k)"
    ),
    card_source_labels="labelled by the target",
    card_notes=(
        "- the loss mask is shifted together with the labels (a row counts when the token it predicts is",
        "  assistant content); the EAGLE and SpecForge trainers leave it unshifted",
    ),
)


# -- DFlash: a block-diffusion draft under the block loss, exported in the published DFlash layout ----------------


DFlashDraft = tuple[DFlashConfig, Any]  # (config, DFlashWeights)


def _dflash_config(cfg: TrainConfig, target_cfg: ModelConfig) -> DFlashConfig:
    d = cfg.dflash
    ids = None if cfg.model.tap_layers is None else tuple(t - 1 for t in cfg.model.tap_layers)
    draft = DFlashConfig.default_for(
        target_cfg, d.mask_token_id, num_layers=d.num_layers, block_size=d.block_size, target_layer_ids=ids
    )
    draft.check_target(target_cfg)
    return draft


def _dflash_fresh(draft_cfg: DFlashConfig, seed: int, d2t: np.ndarray, t2d: np.ndarray) -> DFlashDraft:
    return draft_cfg, init_dflash(draft_cfg, jax.random.key(seed), vocab_ids=np.flatnonzero(t2d))


def _dflash_check_rows(cfg: TrainConfig, rows: dict) -> None:
    mask = cfg.dflash.mask_token_id
    written = np.count_nonzero(rows["tokens"][rows["loss_mask"] > 0] == mask)
    if written:
        raise InputError(
            f"dflash.mask_token_id {mask} occurs {written} times in the responses; choose a token the target never "
            "writes (an unused special token)"
        )


def _dflash_drafters(draft: DFlashDraft, target: Weights) -> list[EvaluationDrafter]:
    draft_cfg, weights = draft
    drafter = DFlashDrafter.for_target(weights, draft_cfg, target)
    return [("chain", f"block of {draft_cfg.block_size}, K={draft_cfg.max_drafts}", drafter, draft_cfg.max_drafts)]


def _dflash_card(cfg: TrainConfig, d: DFlashConfig, covers: str, taps: str) -> list[str]:
    stack = d.layers
    return [
        f"# DFlash draft for `{cfg.model.target}`",
        "",
        "Trained with specjax (`specjax-train`). Layout: the published DFlash draft (config.json with",
        "`dflash_config` + model.safetensors with `fc`, `hidden_norm`, `layers.*`, `norm`), plus specjax's",
        "`vocab_ids` (the draft vocabulary) when it scores fewer tokens than the target's.",
        "",
        "## Draft",
        f"- {stack.num_layers} decoder layer(s), hidden {stack.hidden_size}, {stack.num_heads} heads / "
        f"{stack.num_kv_heads} KV heads, MLP {stack.intermediate_size}; block size {d.block_size} (up to "
        f"{d.max_drafts} drafts a round), mask token {d.mask_token_id}",
        f"- draft vocabulary {cfg.model.draft_vocab_size} of {stack.vocab_size}{covers}",
        taps,
        "- the token embedding and LM head are the target's (not stored)",
        "",
    ]


def _dflash_objective(cfg: TrainConfig) -> str:
    d = cfg.dflash
    return (
        f"block loss over {d.num_anchors} random anchors per row (position weights exp(-(k-1)/{d.loss_decay:g})), "
        "labels the target's own tokens"
    )


DFLASH = DraftKind(
    name="dflash",
    section="dflash",
    draft_config=_dflash_config,
    shape_fields=(
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "layers.num_layers",
        "layers.intermediate_size",
        "draft_vocab_size",
    ),
    fresh=_dflash_fresh,
    load=load_dflash,
    config=lambda draft: draft[0],
    vocab_size=lambda draft, target_cfg: (
        target_cfg.vocab_size if draft[1].vocab_ids is None else len(draft[1].vocab_ids)
    ),
    training=lambda draft, cfg, target_cfg: DFlashTraining(*draft, target_cfg, cfg.dflash, cfg.training.seed),
    check_rows=_dflash_check_rows,
    export=lambda folder, draft: save_dflash(folder, *draft, dtype=jnp.bfloat16),
    evaluation_drafters=_dflash_drafters,
    card_draft=_dflash_card,
    card_objective=_dflash_objective,
    card_source_labels="their own tokens the labels",
    card_notes=(),
)

DRAFT_KINDS = {kind.name: kind for kind in (EAGLE3, DFLASH)}
assert DRAFT_KINDS.keys() == DRAFTERS.keys(), "specjax/train/config.py's DRAFTERS names the kinds of DRAFT_KINDS"


def draft_kind(cfg: TrainConfig) -> DraftKind:
    """The kind of draft `cfg` trains (model.drafter)."""
    return DRAFT_KINDS[cfg.model.drafter]
