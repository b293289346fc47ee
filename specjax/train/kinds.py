"""The kinds of draft a run trains (`model.drafter`): one `DraftKind` class each, holding everything that differs
between them, from the draft's shape to its evaluation, and the text its model card adds (specjax/train/model_card.py).

`draft_kind` is the one place a kind is looked up by name; the pipeline (specjax/train/run.py) calls the kind's
methods and never compares names. Between the stages a draft travels in its exported form: an Eagle3Head, or a DFlash
(config, weights) pair with the draft vocabulary in `weights.vocab_ids`.
"""

from __future__ import annotations

import abc
import dataclasses
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
from specjax.train.model_card import CardText, DFlashCard, Eagle3Card

# One drafting mode of the evaluate stage: (name, description, drafter, K).
EvaluationDrafter = tuple[str, str, Any, int]


class DraftKind(abc.ABC):
    """What one kind of draft is, how it starts, trains, exports and is evaluated, and what its model card adds.

    A draft is in its exported form throughout (the kind's own type: see the subclasses)."""

    name: str  # the value of model.drafter, and the kind `specjax.drafters.registry.draft_folder` takes
    section: str | None  # the config section of the kind's own settings (None: model and training hold them all)
    # What a `training.init_from` draft must share with the run's draft config (attribute paths of the config;
    # "draft_vocab_size" is read with `draft_vocab_size`).
    shape_fields: tuple[str, ...]
    card: CardText  # the model card's lines of this kind

    @abc.abstractmethod
    def draft_config(self, cfg: TrainConfig, target_cfg: ModelConfig) -> Any:
        """The draft config a run trains, from the run's config and the target's; raises InputError when it does not
        fit the target."""

    @abc.abstractmethod
    def random_draft(self, draft_cfg: Any, seed: int, d2t: np.ndarray, t2d: np.ndarray) -> Any:
        """A draft of `draft_cfg` with random weights (from `seed`) over the vocab stage's draft vocabulary."""

    @abc.abstractmethod
    def load_draft(self, folder: Path, target_cfg: ModelConfig) -> Any:
        """An exported draft from its folder, made for the target. Raises CheckpointError / InputError."""

    @abc.abstractmethod
    def config_of(self, draft: Any) -> Any:
        """A draft's config."""

    @abc.abstractmethod
    def draft_vocab_size(self, draft: Any, target_cfg: ModelConfig) -> int:
        """The number of target tokens a draft scores."""

    @abc.abstractmethod
    def trainable(self, draft: Any, cfg: TrainConfig, target_cfg: ModelConfig) -> Any:
        """A draft under its loss, what the trainer trains (specjax/train/drafts.py)."""

    @abc.abstractmethod
    def check_training_rows(self, cfg: TrainConfig, rows: dict) -> None:
        """Raises InputError for training rows the kind cannot learn from."""

    @abc.abstractmethod
    def export_draft(self, folder: Path, draft: Any) -> None:
        """Writes a draft's folder (config.json + model.safetensors) in bfloat16."""

    @abc.abstractmethod
    def evaluation_drafters(self, draft: Any, target: Weights) -> list[EvaluationDrafter]:
        """The evaluate stage's drafting modes of a draft on the target."""


class Eagle3Kind(DraftKind):
    """EAGLE-3: a head (an Eagle3Head) under the training-time-test loss, exported as LlamaForCausalLMEagle3."""

    name = "eagle3"
    section = None
    shape_fields = (
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "draft_vocab_size",
        "tap_layers",
        "norm_output",
        "norm_before_residual",
    )
    card = Eagle3Card()

    def draft_config(self, cfg: TrainConfig, target_cfg: ModelConfig) -> Eagle3Config:
        base = Eagle3Config.default_for(target_cfg, cfg.model.draft_vocab_size)
        overrides = {"norm_output": cfg.model.norm_output, "norm_before_residual": cfg.model.norm_before_residual}
        if cfg.model.tap_layers is not None:
            overrides["tap_layers"] = cfg.model.tap_layers
        if cfg.model.intermediate_size is not None:
            overrides["intermediate_size"] = cfg.model.intermediate_size
        return dataclasses.replace(base, **overrides)

    def random_draft(self, draft_cfg: Eagle3Config, seed: int, d2t: np.ndarray, t2d: np.ndarray) -> Eagle3Head:
        head = Eagle3Head(draft_cfg, rngs=nnx.Rngs(seed))
        head.d2t[...] = jnp.asarray(d2t, jnp.int32)
        head.t2d[...] = jnp.asarray(t2d)
        return head

    def load_draft(self, folder: Path, target_cfg: ModelConfig) -> Eagle3Head:
        return load_eagle3(folder, target_cfg)[1]

    def config_of(self, draft: Eagle3Head) -> Eagle3Config:
        return draft.cfg

    def draft_vocab_size(self, draft: Eagle3Head, target_cfg: ModelConfig) -> int:
        return draft.cfg.draft_vocab_size

    def trainable(self, draft: Eagle3Head, cfg: TrainConfig, target_cfg: ModelConfig) -> Eagle3Training:
        return Eagle3Training(draft, target_cfg, cfg.training)

    def check_training_rows(self, cfg: TrainConfig, rows: dict) -> None:
        """Every training row serves."""

    def export_draft(self, folder: Path, draft: Eagle3Head) -> None:
        save_eagle3(folder, draft.cfg, draft, dtype=jnp.bfloat16)

    def evaluation_drafters(self, draft: Eagle3Head, target: Weights) -> list[EvaluationDrafter]:
        """A chain of EVAL_DRAFT_TOKENS drafts, and the tree EVAL_TREE."""
        tree = TreeSpec.parse(EVAL_TREE)
        return [
            ("chain", f"K={EVAL_DRAFT_TOKENS}", Eagle3Drafter.create(draft, target.embed, None), EVAL_DRAFT_TOKENS),
            ("tree", f"tree {EVAL_TREE}", Eagle3Drafter.create(draft, target.embed, tree), EVAL_DRAFT_TOKENS),
        ]


DFlashDraft = tuple[DFlashConfig, Any]  # (config, DFlashWeights)


class DFlashKind(DraftKind):
    """DFlash: a block-diffusion draft (a (config, weights) pair) under the block loss, exported in the published
    DFlash layout."""

    name = "dflash"
    section = "dflash"
    shape_fields = (
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "layers.num_layers",
        "layers.intermediate_size",
        "draft_vocab_size",
    )
    card = DFlashCard()

    def draft_config(self, cfg: TrainConfig, target_cfg: ModelConfig) -> DFlashConfig:
        d = cfg.dflash
        ids = None if cfg.model.tap_layers is None else tuple(t - 1 for t in cfg.model.tap_layers)
        draft = DFlashConfig.default_for(
            target_cfg, d.mask_token_id, num_layers=d.num_layers, block_size=d.block_size, target_layer_ids=ids
        )
        draft.check_target(target_cfg)
        return draft

    def random_draft(self, draft_cfg: DFlashConfig, seed: int, d2t: np.ndarray, t2d: np.ndarray) -> DFlashDraft:
        return draft_cfg, init_dflash(draft_cfg, jax.random.key(seed), vocab_ids=np.flatnonzero(t2d))

    def load_draft(self, folder: Path, target_cfg: ModelConfig) -> DFlashDraft:
        return load_dflash(folder, target_cfg)

    def config_of(self, draft: DFlashDraft) -> DFlashConfig:
        return draft[0]

    def draft_vocab_size(self, draft: DFlashDraft, target_cfg: ModelConfig) -> int:
        vocab_ids = draft[1].vocab_ids
        return target_cfg.vocab_size if vocab_ids is None else len(vocab_ids)

    def trainable(self, draft: DFlashDraft, cfg: TrainConfig, target_cfg: ModelConfig) -> DFlashTraining:
        return DFlashTraining(*draft, target_cfg, cfg.dflash, cfg.training.seed)

    def check_training_rows(self, cfg: TrainConfig, rows: dict) -> None:
        """Refuses responses that write the mask token: the draft could not tell them from the blocks' masks."""
        mask = cfg.dflash.mask_token_id
        written = np.count_nonzero(rows["tokens"][rows["loss_mask"] > 0] == mask)
        if written:
            raise InputError(
                f"dflash.mask_token_id {mask} occurs {written} times in the responses; choose a token the target "
                "never writes (an unused special token)"
            )

    def export_draft(self, folder: Path, draft: DFlashDraft) -> None:
        save_dflash(folder, *draft, dtype=jnp.bfloat16)

    def evaluation_drafters(self, draft: DFlashDraft, target: Weights) -> list[EvaluationDrafter]:
        """The whole block: K = the block's drafts."""
        draft_cfg, weights = draft
        drafter = DFlashDrafter.for_target(weights, draft_cfg, target)
        return [("chain", f"block of {draft_cfg.block_size}, K={draft_cfg.max_drafts}", drafter, draft_cfg.max_drafts)]


DRAFT_KINDS: dict[str, DraftKind] = {kind.name: kind for kind in (Eagle3Kind(), DFlashKind())}
assert DRAFT_KINDS.keys() == DRAFTERS.keys(), "specjax/train/config.py's DRAFTERS names the kinds of DRAFT_KINDS"


def draft_kind(cfg: TrainConfig) -> DraftKind:
    """The kind of draft `cfg` trains (model.drafter)."""
    return DRAFT_KINDS[cfg.model.drafter]
