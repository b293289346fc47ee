"""The training config schema: frozen dataclasses, read from YAML with `section.key=value` overrides
(`specjax.config.build_config`), and the trainer's fixed settings.

Unknown keys, values of the wrong type or out of range, and a draft kind without its required keys are errors that
say what is valid.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specjax.config import apply_override, build_config, read_config_file
from specjax.errors import InputError
from specjax.sharding import Rules, merged_rules

# model.drafter's values (the kinds of specjax/train/kinds.py), each with the keys a run of that kind must set.
DRAFTERS = {
    "eagle3": {},
    "dflash": {"dflash.mask_token_id": "a token id the target never writes (an unused special token)"},
}

COMPUTE_DTYPES = ("auto", "bfloat16", "float32")  # training.compute_dtype's values

# The evaluate stage's drafting with an EAGLE-3 head: a chain of EVAL_DRAFT_TOKENS drafts, and the tree EVAL_TREE
# ("depth,topk,budget", `specjax.drafters.tree.TreeSpec.parse`).
EVAL_DRAFT_TOKENS = 5
EVAL_TREE = "5,4,24"


@dataclasses.dataclass(frozen=True)
class ModelSection:
    target: str = "smollm2-135m"  # built-in name, .gguf file or HF folder
    drafter: str = "eagle3"  # what to train: a kind of DRAFTERS (an EAGLE-3 head, or a DFlash draft)
    # Target layers whose *input* residual stream feeds the draft. None: (2, N//2, N-3), the EAGLE-3 default; for
    # DFlash, one layer per draft layer spread over the target (docs/dflash.md), i.e. its target_layer_ids + 1.
    tap_layers: tuple[int, ...] | None = None
    draft_vocab_size: int = 8192
    intermediate_size: int | None = None  # head MLP width; None = the target's
    norm_output: bool = False  # EAGLE-3.1: the next draft step reads the post-norm output
    norm_before_residual: bool = False  # the midlayer's residual is hidden_norm(g) (vLLM speculators' variant)


@dataclasses.dataclass(frozen=True)
class DFlashSection:
    """The DFlash draft and its loss (docs/dflash.md); read when model.drafter names DFlash."""

    block_size: int = 8  # Bs: the anchor and Bs - 1 mask tokens, so at most Bs - 1 drafts a round
    num_layers: int = 1  # draft decoder layers (shaped like the target's)
    mask_token_id: int | None = None  # a token the target never writes (e.g. an unused special token); required
    num_anchors: int = 64  # blocks per training row (anchors drawn anew every step)
    gamma: float | None = None  # position weight exp(-(k-1)/gamma); None: `loss_decay`'s default

    @property
    def loss_decay(self) -> float:
        """gamma, or the default of docs/dflash.md: 7 for 16-row blocks, 4 for 8 rows or fewer, 5 between."""
        if self.gamma is not None:
            return self.gamma
        return 7.0 if self.block_size >= 16 else 4.0 if self.block_size <= 8 else 5.0


@dataclasses.dataclass(frozen=True)
class SynthesizeSection:
    """Prompts the target writes itself (specjax/train/synthesize.py); the data source `synthetic` reads them."""

    num_prompts: int = 0  # prompts to keep (0: the stage does nothing)
    domains: tuple[str, ...] = ("code", "math", "reasoning", "writing", "stem", "extraction", "roleplay", "everyday")
    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 96  # a user message longer than this is dropped as truncated
    min_tokens: int = 6
    batch_size: int = 64
    dedup_threshold: float = 0.6  # MinHash Jaccard over word 3-grams above which a prompt is a near-duplicate
    max_generations: int = 100_000  # give up (one clear error) after this many generations
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class DataSection:
    # Prompt sources, in order: "builtin" (specjax's own code prompts), "synthetic" (the synthesize stage's output),
    # or JSONL files of {"prompt": ...}, ShareGPT {"conversations": [{"from", "value"}]} or {"messages": [{"role",
    # "content"}]} lines. A single string is one source.
    prompts: str | tuple[str, ...] = "builtin"
    # The content-addressed store of generated data; None: output_dir/store. A relative path in a config file is
    # relative to that file's folder (one given as an override, to the working directory).
    store: str | None = None
    regenerate: bool = True  # False: train on the files' own assistant turns instead of the target's
    samples_per_prompt: int = 0  # sampled responses per prompt, beside the greedy one
    sample_temperature: float = 1.0
    sample_top_p: float = 0.95

    @property
    def prompt_sources(self) -> tuple[str, ...]:
        return (self.prompts,) if isinstance(self.prompts, str) else self.prompts

    num_prompts: int = 1024  # training prompts (the held-out ones come on top)
    eval_prompts: int = 16  # held out for the evaluate stage
    max_prompt_tokens: int = 256
    max_new_tokens: int = 256  # response length the target regenerates
    temperature: float = 0.0  # sampling temperature of the regeneration (0 = greedy)
    batch_size: int = 16  # regeneration slots: conversations decoded together, a finished one replaced at once
    seed: int = 0
    source_tokens: int = 0  # answer tokens of standard-library source added as further samples (not regenerated)


@dataclasses.dataclass(frozen=True)
class TrainingSection:
    steps: int = 1000
    # When set, steps = ceil(epochs x packed rows / batch_size): runs on nested subsets of the data keep the same
    # steps per token (the scaling curve).
    epochs: float | None = None
    # An exported draft of the run's kind (a folder of config.json + safetensors, or a shipped draft's name:
    # smollm2-135m) whose weights and draft vocabulary the run starts from instead of random ones; the optimiser
    # starts afresh.
    init_from: str | None = None
    # Train on this fraction of the packed rows, a seeded subset nested in every larger fraction (the scaling curve).
    data_fraction: float = 1.0
    batch_size: int = 8  # sequences per step (global, over all devices)
    seq_len: int = 512  # samples are packed into rows of this many tokens (longer ones truncated)
    features: str = "stored"  # target features: "stored" (computed once by the features stage) or "online" (per step)
    # Where the stored features live; None: output_dir/features. Runs on the same data with the same taps (e.g. an
    # EAGLE-3 and a DFlash draft) can share one folder: its manifest names the rows and layers it holds.
    features_dir: str | None = None
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    final_lr_ratio: float = 0.05  # cosine decay to learning_rate * this
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_length: int = 7  # training-time-test unroll K
    step_decay: float = 0.8  # loss weight of unroll step k is step_decay**k
    # Recompute each TTT step's activations (its [B, N, T, T] attention scores) in the backward pass instead of
    # keeping all K steps' (EAGLE-3): the same loss and gradients in less memory, for about one more forward.
    remat: bool = True
    # Microbatches per step: batch_size / N rows each, their gradients summed into one optimizer update per step
    # (EAGLE-3; the same update as one batch, up to float rounding).
    grad_accumulation: int = 1
    # The dtype of the forward and backward passes: "bfloat16", "float32", or "auto" (bfloat16 on GPU and TPU,
    # float32 on the CPU). The weights, their gradients and Adam's moments stay float32.
    compute_dtype: str = "auto"
    seed: int = 0
    stop_after: int | None = None  # end the train stage after this step, keeping the schedule of `steps`


@dataclasses.dataclass(frozen=True)
class EvaluationSection:
    """The evaluate stage: greedy speculative decoding with the trained draft on each set (an EAGLE-3 head: chain
    and tree; a DFlash draft: its whole block)."""

    sets: tuple[str, ...] = ("heldout",)  # from: heldout (data.eval_prompts), chat (specjax's chat set), humaneval
    num_prompts: int | None = None  # the first N prompts of each set; None: all
    max_new_tokens: int | None = None  # None: data.max_new_tokens
    batch_size: int = 8  # prompts decoded together; acceptance is per row, so the figures equal batch-1 decoding


@dataclasses.dataclass(frozen=True)
class MeshSection:
    data: int = -1  # -1: all remaining devices
    fsdp: int = 1
    tensor: int = 1
    # Logical axis -> mesh axis, a list of them, or null (replicated), over `specjax.sharding.DEFAULT_RULES`: e.g.
    # {vocab: null} keeps the vocabulary of the embedding and LM heads whole on every device.
    rules: dict[str, str | tuple[str, ...] | None] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        """Refuses unknown logical or mesh axes in `rules` when the config is read (InputError)."""
        _ = self.sharding_rules

    @property
    def axes(self) -> dict[str, int]:
        """The mesh's axis sizes, as `specjax.sharding.make_mesh` takes them."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}

    @property
    def sharding_rules(self) -> Rules:
        """The run's logical-axis rules: `rules` merged over the default table. Raises InputError."""
        try:
            return merged_rules(self.rules, tuple(self.axes))
        except InputError as e:
            raise InputError(f"mesh.rules: {e}") from None


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = 100  # steps between checkpoints
    keep: int = 3  # most recent checkpoints kept


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    every: int = 10  # steps between metric lines in metrics.jsonl


@dataclasses.dataclass(frozen=True)
class DistributedSection:
    """Multi-host: set these, or leave them empty and let `jax.distributed.initialize` read the environment."""

    coordinator: str | None = None  # e.g. "10.0.0.1:1234"
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    output_dir: str = "runs/eagle3"
    model: ModelSection = ModelSection()
    dflash: DFlashSection = DFlashSection()
    synthesize: SynthesizeSection = SynthesizeSection()
    data: DataSection = DataSection()
    training: TrainingSection = TrainingSection()
    evaluation: EvaluationSection = EvaluationSection()
    mesh: MeshSection = MeshSection()
    checkpoint: CheckpointSection = CheckpointSection()
    logging: LoggingSection = LoggingSection()
    distributed: DistributedSection = DistributedSection()

    def __post_init__(self):
        bad = [
            f"{key}={value} (must be {rule})"
            for rule, keys in _RANGES.items()
            for key in keys
            if (value := self.get(key)) is not None and not _RULES[rule](value)
        ]
        if bad:
            raise InputError(f"out of range: {'; '.join(bad)}")
        unknown_sets = sorted(set(self.evaluation.sets) - {"heldout", "chat", "humaneval"})
        if unknown_sets or not self.evaluation.sets:
            raise InputError(f"evaluation.sets must name some of heldout, chat, humaneval; got {self.evaluation.sets}")
        if self.model.drafter not in DRAFTERS:
            raise InputError(f"model.drafter must be {' or '.join(map(repr, DRAFTERS))}, got {self.model.drafter!r}")
        for key, what in DRAFTERS[self.model.drafter].items():
            if self.get(key) is None:
                raise InputError(f"{key} is required: {what}")
        t = self.training
        if t.features not in ("stored", "online"):
            raise InputError(f"training.features must be 'stored' or 'online', got {t.features!r}")
        if t.compute_dtype not in COMPUTE_DTYPES:
            raise InputError(f"training.compute_dtype must be {', '.join(COMPUTE_DTYPES)}; got {t.compute_dtype!r}")
        if t.batch_size % t.grad_accumulation:
            raise InputError(
                f"training.batch_size={t.batch_size} does not split into training.grad_accumulation="
                f"{t.grad_accumulation} microbatches; make it a multiple"
            )
        if t.grad_accumulation > 1 and self.model.drafter != "eagle3":
            raise InputError("training.grad_accumulation applies to EAGLE-3 heads (model.drafter: eagle3) only")

    def get(self, key: str) -> Any:
        """The value of a dotted key, e.g. "training.learning_rate"."""
        node = self
        for part in key.split("."):
            node = getattr(node, part)
        return node

    @property
    def output_path(self) -> Path:
        return Path(self.output_dir)

    @property
    def evaluation_max_new_tokens(self) -> int:
        """The evaluate stage's response length: evaluation.max_new_tokens, else data.max_new_tokens."""
        return self.evaluation.max_new_tokens or self.data.max_new_tokens


# Every numeric key and its range (None is allowed where the key is optional). NaN fails every rule.
_RULES = {
    ">= 2": lambda v: v >= 2,
    ">= 1": lambda v: v >= 1,
    ">= 0": lambda v: v >= 0,
    "> 0": lambda v: v > 0,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
}
_RANGES = {
    ">= 2": ("dflash.block_size",),
    ">= 1": (
        "data.num_prompts",
        "data.max_prompt_tokens",
        "data.max_new_tokens",
        "data.batch_size",
        "model.draft_vocab_size",
        "synthesize.max_tokens",
        "synthesize.batch_size",
        "synthesize.max_generations",
        "training.steps",
        "training.batch_size",
        "training.seq_len",
        "training.ttt_length",
        "training.stop_after",
        "training.grad_accumulation",
        "evaluation.num_prompts",
        "evaluation.max_new_tokens",
        "evaluation.batch_size",
        "checkpoint.every",
        "checkpoint.keep",
        "logging.every",
        "dflash.num_layers",
        "dflash.num_anchors",
    ),
    ">= 0": (
        "synthesize.num_prompts",
        "synthesize.min_tokens",
        "data.eval_prompts",
        "data.samples_per_prompt",
        "data.source_tokens",
        "training.warmup_steps",
        "training.weight_decay",
        "dflash.mask_token_id",
    ),
    "> 0": (
        "synthesize.temperature",
        "data.sample_temperature",
        "training.learning_rate",
        "training.grad_clip",
        "training.epochs",
        "dflash.gamma",
    ),
    "in (0, 1]": (
        "synthesize.top_p",
        "synthesize.dedup_threshold",
        "data.sample_top_p",
        "training.step_decay",
        "training.data_fraction",
    ),
    "in [0, 1]": ("training.final_lr_ratio",),
}


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Reads a YAML training config and applies overrides.

    Args:
      path: the YAML file (None: defaults only).
      overrides: `section.key=value` strings, applied in order.
    Returns:
      The validated TrainConfig, with a relative `data.store` of the file made absolute against the file's folder,
      so that a config finds its store from any working directory. Raises InputError on a missing file, bad YAML,
      unknown keys or wrong types.
    """
    raw = read_config_file(path) if path is not None else {}
    data = raw.get("data") if isinstance(raw, dict) else None
    if isinstance(data, dict) and isinstance(data.get("store"), str):
        data["store"] = os.path.abspath(Path(path).parent / data["store"])
    for override in overrides:
        apply_override(raw, override)
    return build_config(TrainConfig, raw)


def config_to_dict(cfg: TrainConfig) -> dict:
    """A plain dict of the config (tuples as lists), for YAML/JSON records of a run."""

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))
