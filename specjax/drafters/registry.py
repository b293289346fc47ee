"""Drafters by name: the command-line specs (`drafter_from_spec`) and the drafts shipped inside the package."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specjax.config import ModelConfig
from specjax.drafters.base import Drafter
from specjax.drafters.dflash import load_dflash_drafter
from specjax.drafters.eagle3 import load_eagle3_drafter
from specjax.drafters.model import LayerSkipDrafter, ModelDrafter
from specjax.drafters.ngram import DEFAULT_NGRAM, LookupFirstDrafter, NgramDrafter
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError
from specjax.io.hub import resolve
from specjax.models.llama import Weights

# Drafts shipped inside the package, by kind and name: those specjax trained for the embedded SmolLM2.
SHIPPED_DRAFTS = {
    (kind, "smollm2-135m"): Path(__file__).resolve().parent.parent / "heads" / f"smollm2-135m-{kind}"
    for kind in ("eagle3", "dflash")
}


def draft_folder(kind: str, name_or_path: str) -> Path:
    """The folder of a draft of `kind` ("eagle3" or "dflash"): a shipped one by its name, else the path given, else
    the Hugging Face Hub repo ORG/NAME[@REVISION] (its config and safetensors, downloaded once into the Hub cache)."""
    shipped = SHIPPED_DRAFTS.get((kind, name_or_path))
    return shipped if shipped is not None else resolve(name_or_path, "draft")


SPEC_HELP = (
    f"none, ngram[:N] (N = longest n-gram, default {DEFAULT_NGRAM}), layerskip:N (first N layers), model:PATH, "
    "eagle3:PATH (an EAGLE-3 head folder or Hub repo ORG/NAME[@REVISION], or eagle3:smollm2-135m for the built-in "
    "head; with --tree for tree drafting), dflash:PATH (a DFlash draft folder or Hub repo ORG/NAME[@REVISION], or "
    "dflash:smollm2-135m for the built-in draft), or ngram[:N]+SPEC (prompt lookup where the last N tokens recur, the "
    "chain drafter SPEC elsewhere)"
)


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InputError(f"{what} must be an integer, got {text!r}") from None


def drafter_from_spec(
    spec: str,
    weights: Weights,
    cfg: ModelConfig,
    load: Callable[[str], tuple[ModelConfig, Weights]] | None = None,
    tree: TreeSpec | None = None,
) -> Drafter | None:
    """Builds a drafter from a command-line spec.

    Args:
      spec: "none", "ngram", "ngram:N", "layerskip:N", "model:PATH", "eagle3:PATH", "dflash:PATH", or "ngram+" /
        "ngram:N+" and one of the others (lookup first where the last N tokens recur, that drafter elsewhere).
      weights, cfg: the target model (layer-skip drafts with its own weights; EAGLE-3 shares its embedding).
      load: for "model:PATH", returns (cfg, weights) of the checkpoint at PATH.
      tree: for "eagle3:PATH", draft a dynamic tree of this shape instead of a chain.
    Returns:
      The drafter, or None for "none". Raises InputError on a malformed spec or a value out of range, and
      CheckpointError for an EAGLE-3 head that is missing, corrupt or made for another target.
    """
    lookup, plus, fallback_spec = spec.strip().partition("+")
    lookup_kind, _, lookup_arg = lookup.partition(":")
    if plus and lookup_kind == "ngram":
        if tree is not None:
            raise InputError("lookup-first drafting (ngram+SPEC) drafts chains; drop {tree}", settings={"tree": None})
        fallback = drafter_from_spec(fallback_spec, weights, cfg, load)
        if fallback is None:
            raise InputError("ngram+SPEC needs a fallback drafter, e.g. ngram+eagle3:smollm2-135m")
        return LookupFirstDrafter(fallback, n=_int(lookup_arg, "the n-gram size") if lookup_arg else DEFAULT_NGRAM)
    kind, _, arg = spec.strip().partition(":")
    if tree is not None and kind != "eagle3":
        raise InputError(
            "tree drafting ({tree}) needs an EAGLE-3 head: {drafter}", settings={"tree": None, "drafter": "eagle3:PATH"}
        )
    if kind == "eagle3":
        if not arg:
            raise InputError(
                "EAGLE-3 drafting needs a head folder: eagle3:PATH or eagle3:ORG/NAME (config.json + *.safetensors)"
            )
        return load_eagle3_drafter(str(draft_folder("eagle3", arg)), cfg, weights.embed, tree)
    if kind == "dflash":
        if not arg:
            raise InputError(
                "DFlash drafting needs a draft folder: dflash:PATH or dflash:ORG/NAME (config.json + *.safetensors)"
            )
        return load_dflash_drafter(str(draft_folder("dflash", arg)), cfg, weights)
    if kind == "none" and not arg:
        return None
    if kind == "ngram":
        return NgramDrafter(max_n=_int(arg, "the n-gram size") if arg else DEFAULT_NGRAM)
    if kind == "layerskip":
        if not arg:
            raise InputError(f"layerskip needs a layer count, e.g. layerskip:{LayerSkipDrafter.default_layers(cfg)}")
        return LayerSkipDrafter(weights, cfg, _int(arg, "the layer-skip layer count"))
    if kind == "model":
        if not arg or load is None:
            raise InputError(
                "model drafting needs a checkpoint: model:PATH (a .gguf file, HF folder, Hub repo or built-in name)"
            )
        draft_cfg, draft_weights = load(arg)
        drafter = ModelDrafter(draft_weights, draft_cfg)
        drafter.validate(cfg, 1)
        return drafter
    raise InputError(f"unknown drafter {spec!r}; choose from: {SPEC_HELP}")
