"""Drafters by name: one entry per kind of drafter (`specjax.drafters.entry.DrafterEntry`), the command-line specs they
spell (`drafter_from_spec`), the help that lists them (`spec_help`), and the drafts shipped inside the package.

Each drafter module defines its entry beside its drafter; this module imports the drafter modules and registers their
entries (`BUILT_IN`, in the order the help lists them). The arrows point one way, registry -> drafter modules ->
entry, so no drafter module imports this one and there is no circle. Adding a drafter is its module plus its line in
`BUILT_IN`; `register` adds one from outside the package (a test's), and the specs, the help, specjax-bench's modes
and the shared tests then include it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from specjax.config import ModelConfig
from specjax.drafters.base import Drafter
from specjax.drafters.dflash import DFLASH
from specjax.drafters.eagle3 import EAGLE3
from specjax.drafters.entry import DrafterEntry, DraftTarget
from specjax.drafters.model import LAYER_SKIP, MODEL
from specjax.drafters.ngram import LOOKUP_FIRST, NGRAM
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError
from specjax.io.hub import resolve
from specjax.models.llama import Weights

BUILT_IN = (NGRAM, LAYER_SKIP, MODEL, EAGLE3, DFLASH, LOOKUP_FIRST)
_ENTRIES: dict[str, DrafterEntry] = {}

# Drafts shipped inside the package, by kind and name: those specjax trained for the embedded SmolLM2.
SHIPPED_DRAFTS = {
    (kind, "smollm2-135m"): Path(__file__).resolve().parent.parent / "heads" / f"smollm2-135m-{kind}"
    for kind in ("eagle3", "dflash")
}


def register(entry: DrafterEntry) -> DrafterEntry:
    """Adds a kind of drafter to every spec, help text, bench mode and shared test.

    Returns:
      The entry. Raises InputError for a name already taken, "none", or one a spec cannot spell.
    """
    kind = entry.kind
    if entry.name in _ENTRIES or kind == "none" or not kind or any(c in kind for c in ":+, "):
        raise InputError(f"cannot register a drafter named {entry.name!r}: taken, reserved or not a spec's kind")
    _ENTRIES[entry.name] = entry
    return entry


for _entry in BUILT_IN:
    register(_entry)


def entries() -> tuple[DrafterEntry, ...]:
    """Every registered kind of drafter, those that wrap another last."""
    return tuple(sorted(_ENTRIES.values(), key=lambda entry: entry.wraps))


def spec_help() -> str:
    """The specs `drafter_from_spec` reads, for the tools' --drafter help."""
    specs = ["none", *(f"{e.spec} ({e.help})" if e.help else e.spec for e in entries())]
    return ", ".join(specs[:-1]) + ", or " + specs[-1]


def tree_specs() -> str:
    """The specs of the drafters that draft trees, e.g. for a --tree help."""
    return " or ".join(e.spec for e in entries() if e.trees)


def draft_folder(kind: str, name_or_path: str) -> Path:
    """The folder of a draft of `kind` (an entry's name, e.g. of a shipped draft's kind): a shipped one by its name,
    else the path given, else the Hugging Face Hub repo ORG/NAME[@REVISION] (its config and safetensors, downloaded
    once into the Hub cache)."""
    shipped = SHIPPED_DRAFTS.get((kind, name_or_path))
    return shipped if shipped is not None else resolve(name_or_path, "draft")


def drafter_from_spec(
    spec: str,
    weights: Weights,
    cfg: ModelConfig,
    load: Callable[[str], tuple[ModelConfig, Weights]] | None = None,
    tree: TreeSpec | None = None,
) -> Drafter | None:
    """Builds a drafter from a command-line spec.

    Args:
      spec: "none", or a registered kind with its argument (`spec_help`): "ngram", "ngram:N", "layerskip:N",
        "model:PATH", "eagle3:PATH", "dflash:PATH", ..., or a wrapping kind before another spec ("ngram+SPEC",
        "ngram:N+SPEC": lookup first where the last N tokens recur, that drafter elsewhere).
      weights, cfg: the target model (layer-skip drafts with its own weights; EAGLE-3 shares its embedding).
      load: for "model:PATH", returns (cfg, weights) of the checkpoint at PATH.
      tree: for a drafter that drafts trees ("eagle3:PATH"), draft a dynamic tree of this shape instead of a chain.
    Returns:
      The drafter, or None for "none". Raises InputError on a malformed spec or a value out of range, and
      CheckpointError for a draft that is missing, corrupt or made for another target.
    """
    text = spec.strip()
    if text == "none":
        return None
    head, plus, rest = text.partition("+")
    kind, _, arg = head.partition(":")
    entry = _ENTRIES.get(kind + plus)
    if entry is None:
        raise InputError(f"unknown drafter {spec!r}; choose from: {spec_help()}")
    if tree is not None and not entry.trees:
        raise InputError(
            f"{entry.spec} drafts chains: drop {{tree}}, or draft trees with {tree_specs()}", settings={"tree": None}
        )
    if entry.checkpoint is not None:
        if not arg:
            raise InputError(
                f"{kind} drafting needs {entry.checkpoint}: {kind}:PATH or {kind}:ORG/NAME "
                "(config.json + *.safetensors)"
            )
        arg = str(draft_folder(kind, arg))
    value = entry.parse(arg, cfg)
    target = DraftTarget(weights, cfg, load, tree)
    if entry.wraps:
        fallback = drafter_from_spec(rest, weights, cfg, load)
        if fallback is None:
            chains = ", ".join(e.spec for e in entries() if not e.wraps)
            raise InputError(f"{entry.spec} needs a fallback drafter SPEC after the '+', one of: {chains}")
        target = dataclasses.replace(target, fallback=fallback)
    return entry.build(value, target)
