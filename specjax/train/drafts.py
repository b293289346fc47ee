"""What the trainer trains: a draft's trainable weights, their logical axes, its loss, and the draft they export to.

The trainer (specjax/train/trainer.py) owns the mesh, the optimizer, the step and the checkpoints; a draft here only
says what its weights are and how a batch scores them. Both losses read the target's features at the draft's taps
followed by the target's final residual stream (specjax/train/features.py), stored or computed in the step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.config import ModelConfig
from specjax.models.dflash import DFlashConfig, DFlashWeights, weight_specs_of
from specjax.models.eagle3 import Eagle3Head, param_specs
from specjax.models.llama import Weights, head_rows, lm_logits
from specjax.train.config import DFlashSection, TrainingSection
from specjax.train.dflash_loss import block_loss, pick_anchors
from specjax.train.ttt import ttt_counts, ttt_loss


class Eagle3Training:
    """An EAGLE-3 head under the training-time-test loss (specjax/train/ttt.py)."""

    def __init__(self, head: Eagle3Head, target_cfg: ModelConfig, training: TrainingSection):
        self.graphdef, self.params, self.buffers = nnx.split(head, nnx.Param, ...)
        self.cfg, self.target_cfg, self.training = head.cfg, target_cfg, training
        self.tap_layers = head.cfg.tap_layers

    def specs(self) -> Any:
        """ArraySpecs in the structure of `params`."""
        by_name = param_specs(self.cfg)
        return jax.tree_util.tree_map_with_path(lambda path, _: by_name[path[0].key], self.params)

    def head(self, params: Any) -> Eagle3Head:
        """The head with these weights, computing in their dtype."""
        head = nnx.merge(self.graphdef, params, self.buffers)
        head.dtype = head.fc[...].dtype
        return head

    def totals(self, rows: dict) -> jax.Array:
        """What the loss of a part of `rows` is divided by so that the parts' losses add up to the whole's."""
        return ttt_counts(rows, self.training.ttt_length)

    def loss(self, params, target_weights: Weights, rows: dict, features: jax.Array, step: jax.Array, totals):
        head = self.head(params)
        D = self.target_cfg.hidden_size
        logits = lm_logits(target_weights, self.target_cfg, features[..., -D:], head.target_ids_of_draft_vocab())
        t = self.training
        return ttt_loss(
            head,
            target_weights.embed,
            rows,
            features[..., :-D],
            logits,
            t.ttt_length,
            t.step_decay,
            remat=t.remat,
            counts=totals,
        )

    def export(self, params) -> Eagle3Head:
        return self.head(params)


class DFlashTraining:
    """A DFlash draft under the block loss (specjax/train/dflash_loss.py); `export` gives (config, weights), the draft
    vocabulary in `weights.vocab_ids` as it came in."""

    def __init__(
        self, cfg: DFlashConfig, weights: DFlashWeights, target_cfg: ModelConfig, section: DFlashSection, seed: int
    ):
        self.cfg, self.target_cfg, self.section, self.seed = cfg, target_cfg, section, seed
        self.params = dataclasses.replace(weights, vocab_ids=None)  # the draft vocabulary is data, not a weight
        self.vocab_ids = None if weights.vocab_ids is None else np.asarray(weights.vocab_ids, np.int32)
        index = np.arange(target_cfg.vocab_size, dtype=np.int32)
        if self.vocab_ids is not None:
            index = np.full(target_cfg.vocab_size, -1, np.int32)
            index[self.vocab_ids] = np.arange(len(self.vocab_ids), dtype=np.int32)
        self.draft_index = index
        self.tap_layers = cfg.tap_layers

    def specs(self) -> DFlashWeights:
        return weight_specs_of(self.cfg)

    def totals(self, rows: dict) -> None:
        """None: a DFlash step is one batch (training.grad_accumulation is EAGLE-3's)."""

    def loss(
        self,
        params: DFlashWeights,
        target_weights: Weights,
        rows: dict,
        features: jax.Array,
        step: jax.Array,
        totals: None,
    ):
        D = self.target_cfg.hidden_size
        w = dataclasses.replace(params, vocab_ids=None if self.vocab_ids is None else jnp.asarray(self.vocab_ids))
        anchors, ok = pick_anchors(rows, jax.random.fold_in(jax.random.key(self.seed), step), self.section.num_anchors)
        return block_loss(
            w,
            self.cfg,
            target_weights.embed,
            head_rows(target_weights),
            jnp.asarray(self.draft_index),
            rows,
            features[..., :-D],
            anchors,
            ok,
            self.section.loss_decay,
        )

    def export(self, params: DFlashWeights) -> tuple[DFlashConfig, DFlashWeights]:
        ids = None if self.vocab_ids is None else jnp.asarray(self.vocab_ids)
        return self.cfg, dataclasses.replace(params, vocab_ids=ids)
