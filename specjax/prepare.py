"""Decoding set up: from a loaded target and a `DecodeConfig`, the drafter, the drafting policy and the memory plan,
checked before anything compiles.

`prepare_decoding` runs the sequence every decoding tool needs (specjax-generate, specjax-bench, specjax-serve;
`serving_engine` makes the server's engine from it):
build the drafter of the spec (a draft that is a whole model is loaded beside the target: `draft_loader`), fix or
check the K its rounds verify, plan the run's memory and refuse a plan the device cannot hold, then, for
`num_draft_tokens="auto"`, calibrate the adaptive menu on this machine (`specjax.measure.calibration`, cached). Its
errors advise in the config's terms (`num_draft_tokens=...`, `mesh=...`); a command line respells them as its flags
(`specjax.errors.SpecjaxError.spelled`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax

from specjax.adaptive import Adaptive, Fixed
from specjax.config import ModelConfig, SamplingConfig, apply_override, build_config, read_config_file
from specjax.decoding.engine import Engine, buckets
from specjax.decoding.speculative import check_inputs
from specjax.drafters import Drafter, drafter_from_spec, with_lookup_tokens
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError
from specjax.host import device_memory, status
from specjax.io.loading import LoadedModel, load_model
from specjax.measure.calibration import auto_max_drafts, calibrated_by_rows
from specjax.measure.memory import MemoryPlan, check_fits, memory_plan
from specjax.models.llama import Weights
from specjax.models.quantize import quantization
from specjax.sharding import mesh_of


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How a run decodes, and the shape its memory is planned for. Load it from YAML or a mapping with
    `load_decode_config` (`sampling.temperature=0.7` overrides), or build it directly."""

    drafter: str = "none"  # a drafter spec (`specjax.drafters.drafter_from_spec`); "none": plain decoding
    # K, drafts per round; "auto": each round picks its draft size, plain steps included, from this machine's measured
    # costs and the acceptance so far (`specjax.adaptive.Adaptive`)
    num_draft_tokens: int | str = "auto"
    lookup_tokens: int | None = None  # lookup-first drafting (ngram+SPEC): tokens the lookup proposes (default K)
    tree: str | None = None  # "depth,topk,budget": an EAGLE-3 head drafts a dynamic tree instead of a chain
    sampling: SamplingConfig = SamplingConfig()  # what adaptive drafting is calibrated for (greedy or sampled)
    rows: int = 1  # rows decoded at once: a batch's prompts times their samples, or an engine's slots
    # the rows are an engine's slots: adaptive drafting is calibrated for each bucket of live rows (`Engine.buckets`)
    engine: bool = False
    prompt_len: int = 512  # the longest prompt, in tokens
    max_new_tokens: int = 128  # the most tokens a row generates
    prefill_chunk: int | None = None  # prompt tokens per prefill forward (None: `specjax.models.llama.chunk_size`)

    def __post_init__(self):
        if self.num_draft_tokens != "auto" and (
            not isinstance(self.num_draft_tokens, int) or isinstance(self.num_draft_tokens, bool)
        ):
            raise InputError(f"num_draft_tokens must be an integer K or 'auto', got {self.num_draft_tokens!r}")
        for name, low in (("rows", 1), ("prompt_len", 0), ("max_new_tokens", 1), ("prefill_chunk", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise InputError(f"{name} must be >= {low}, got {value}")
        if self.tree is not None:
            TreeSpec.parse(self.tree)


def load_decode_config(source: str | Path | Mapping | None = None, overrides: Sequence[str] = ()) -> DecodeConfig:
    """A `DecodeConfig` read as the trainer's config is (`specjax.config.build_config`).

    Args:
      source: a YAML file, a mapping of its keys, or None (the defaults).
      overrides: `key=value` strings (`sampling.key=value` for the sampling section), applied in order.
    Returns:
      The validated DecodeConfig. Raises InputError on an unknown key (naming the valid ones), a wrong type or a
      value out of range.
    """
    if isinstance(source, Mapping):
        raw = dict(source)
    else:
        raw = read_config_file(source) if source is not None else {}
    for override in overrides:
        apply_override(raw, override)
    return build_config(DecodeConfig, raw)


@dataclasses.dataclass(frozen=True)
class Decoding:
    """A run set up: what `specjax.speculative_generate` and `specjax.decoding.engine.Engine` take."""

    drafter: Drafter | None  # None: plain decoding
    # Fixed(K): K a round verifies (lookup first: the larger of the lookup's and the fallback's); Adaptive: the
    # calibrated menu; Fixed(0) for plain decoding
    policy: Fixed | Adaptive
    plan: MemoryPlan  # the run's memory on each device, at the config's rows
    # with `engine`: the policy of each bucket of live rows, `policy` the one at the config's rows (`Engine` takes it)
    by_rows: dict[int, Fixed | Adaptive] = dataclasses.field(default_factory=dict)


def draft_loader(model: LoadedModel) -> Callable[[str], tuple[ModelConfig, Weights]]:
    """The `load` of `drafter_from_spec` for a draft that is a whole model: loaded beside the target, in its dtype, on
    its mesh, with its attention path."""

    def load(path: str) -> tuple[ModelConfig, Weights]:
        draft = load_model(path, model.weights.embed.dtype, mesh_of(model.weights), attention=model.cfg.attention)
        return draft.cfg, draft.weights

    return load


def prepare_decoding(model: LoadedModel, config: DecodeConfig) -> Decoding:
    """Sets a run up: its drafter and policy, checked against the target, and its memory plan, checked against the
    device, before anything compiles; for `num_draft_tokens="auto"`, the adaptive menu calibrated on this machine
    (its estimated costs reported on stderr).

    Args:
      model: the loaded target.
      config: the run's drafting and the shape its memory is planned for.
    Returns:
      The Decoding. Raises InputError (SpecjaxError) on a drafter that cannot serve the target, a draft out of
      range, or a plan the device cannot hold (naming the largest batch, or the smallest larger mesh, that fits).
    """
    drafter, verified, plan_at = _drafting(model, config)
    plan = check_fits(plan_at, config.rows, device_memory(), len(jax.devices()))
    rows = buckets(config.rows) if config.engine else [config.rows]
    if drafter is None or verified != "auto":
        policy = Fixed(0 if drafter is None else verified)
        return Decoding(drafter, policy, plan, dict.fromkeys(rows, policy) if config.engine else {})
    by_rows = calibrated_by_rows(
        model.weights, model.cfg, drafter, auto_max_drafts(drafter), rows=rows, sampling=config.sampling
    )
    for n, adaptive in by_rows.items():
        check_inputs(model.cfg, drafter, adaptive)
        status(f"adaptive drafting, estimated cost of a round of {n} rows in plain steps: {menu_costs(adaptive)}")
    return Decoding(drafter, by_rows[config.rows], plan, by_rows if config.engine else {})


def serving_engine(model: LoadedModel, config: DecodeConfig, max_context: int) -> Engine:
    """A refilling engine of `config.rows` slots for sampled and greedy requests of up to `max_context` tokens, set up
    by `prepare_decoding` (adaptive drafting calibrated for each bucket of live rows) and with every program compiled
    (`Engine.warm`): what specjax-serve serves.

    Args:
      model: the loaded target.
      config: the drafting; its rows are the slots, its prompt and new tokens are planned as halves of the context.
      max_context: the longest prompt + new tokens a request may ask for.
    """
    config = dataclasses.replace(
        config, engine=True, prompt_len=max_context // 2, max_new_tokens=max_context - max_context // 2
    )
    decoding = prepare_decoding(model, config)
    engine = Engine(
        model.weights,
        model.cfg,
        drafter=decoding.drafter,
        num_draft_tokens=decoding.by_rows,
        slots=config.rows,
        max_context=max_context,
        sampled=True,
        eos_ids=model.eos_ids,
        prefill_chunk=config.prefill_chunk,
    )
    status(f"compiling the engine's programs for {config.rows} slots, runs of {engine.buckets} rows")
    engine.warm()
    return engine


def decoding_memory_plan(model: LoadedModel, config: DecodeConfig) -> MemoryPlan:
    """The memory plan `prepare_decoding` checks, at the config's rows, without refusing it or calibrating anything.

    Args:
      model: the loaded target.
      config: the run's drafting and shape.
    Returns:
      The MemoryPlan. Raises InputError on a drafter that cannot serve the target.
    """
    _, _, plan_at = _drafting(model, config)
    return plan_at(config.rows)


def menu_costs(adaptive: Adaptive) -> str:
    """'draft size: cost' for each entry of an adaptive menu."""
    return ", ".join(f"{k}: {c:.2f}" for k, c in zip(adaptive.menu, adaptive.cost.tolist()))


def _drafting(model: LoadedModel, config: DecodeConfig) -> tuple[Drafter | None, int | str, Callable[..., MemoryPlan]]:
    """(drafter, the K its rounds verify or "auto", the run's memory plan as a function of its rows and of a mesh's
    axis sizes, the model's own by default). Adaptive drafting plans for the largest draft it compiles."""
    tree = TreeSpec.parse(config.tree) if config.tree is not None else None
    drafter = drafter_from_spec(config.drafter, model.weights, model.cfg, load=draft_loader(model), tree=tree)
    if drafter is not None and config.num_draft_tokens == "auto":
        if config.lookup_tokens is not None:
            raise InputError(
                "{lookup_tokens} needs a fixed {num_draft_tokens}",
                settings={"lookup_tokens": None, "num_draft_tokens": None},
            )
        if jax.process_count() > 1:
            raise InputError(
                "adaptive drafting times each process's own calls, and the processes of a multi-host run must agree: "
                "give a fixed {num_draft_tokens}",
                settings={"num_draft_tokens": None},
            )
        verified, shape = "auto", drafter.draft_shape(auto_max_drafts(drafter))
    else:
        drafter, verified = with_lookup_tokens(drafter, config.num_draft_tokens, config.lookup_tokens)
        shape = None
        if drafter is not None:
            check_inputs(model.cfg, drafter, Fixed(verified))
            shape = drafter.draft_shape(verified)
    on = mesh_of(model.weights)
    mesh = dict(on.shape) if on is not None else None

    def plan_at(rows: int, on_mesh: dict[str, int] | None = mesh) -> MemoryPlan:
        return memory_plan(
            model.cfg,
            model.weights.embed.dtype,
            batch=rows,
            prompt_len=config.prompt_len,
            max_new_tokens=config.max_new_tokens,
            drafter=drafter,
            draft_shape=shape,
            target_weights=model.weights,
            mesh=on_mesh,
            quantize=quantization(model.weights),
            prefill_chunk=config.prefill_chunk,
        )

    return drafter, verified, plan_at
