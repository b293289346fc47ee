"""What a kind of drafter tells the registry (`specjax.drafters.registry`): its name in command-line specs, how its
argument parses, how it is built, its help, what it can draft, and how to make a small untrained one for tests.

Each drafter module defines its entry beside its drafter; the registry imports the modules and registers their
entries, so a drafter module never imports the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from specjax.config import ModelConfig
from specjax.drafters.base import Drafter
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError


@dataclasses.dataclass(frozen=True)
class DraftTarget:
    """What a drafter is built for: the target model, and what the spec and the tools' options add to it.

    Attributes:
      weights, cfg: the target's `specjax.models.llama.Weights` and config.
      load: returns (cfg, weights) of a model checkpoint by its path or name (a separate draft model), or None.
      tree: the dynamic tree to draft (`--tree`), for an entry that drafts trees; None: chains.
      fallback: for an entry that wraps another drafter (`NAME+SPEC`), the drafter of SPEC.
    """

    weights: Any
    cfg: ModelConfig
    load: Callable[[str], tuple[ModelConfig, Any]] | None = None
    tree: TreeSpec | None = None
    fallback: Drafter | None = None


@dataclasses.dataclass(frozen=True)
class BenchOption:
    """An integer option of specjax-bench (`--FLAG N`) that gives a drafter's ARG in its modes.

    Attributes:
      flag: the option's name without its dashes; entries that share an option name the same flag.
      help: what it sets.
      default: its value when it is not given (None: `arg` chooses).
      arg: (its value, the target's config) -> the spec's ARG.
    """

    flag: str
    help: str
    default: int | None
    arg: Callable[[int | None, ModelConfig], str] = lambda value, cfg: str(value)


@dataclasses.dataclass(frozen=True)
class DrafterEntry:
    """One kind of drafter, by the name its command-line spec starts with.

    Attributes:
      name: the spec is `NAME` or `NAME:ARG`; a name ending in "+" wraps another drafter: `NAME[:ARG]+SPEC`.
      spec: how its spec is spelled in the tools' help, e.g. "ngram[:N]" or "eagle3:PATH".
      help: what the spec means, said after it in the help, e.g. "N = longest n-gram, default 3" ("" for nothing).
      build: (the parsed ARG, the `DraftTarget`) -> the drafter; raises InputError / CheckpointError.
      example: (a `DraftTarget`, a seed) -> a small untrained drafter for that target (random weights where it
        has any, its tree where the target has one), so that tests and device checks can run every registered
        drafter on a toy or random target.
      parse: (the spec's ARG, "" where there is none; the target's config) -> what `build` takes; raises InputError
        saying what a good ARG is. The default takes ARG as it is.
      trees: it drafts a dynamic tree where the target's `tree` is set, else chains.
      checkpoint: where ARG names a draft checkpoint, what it is (e.g. "an EAGLE-3 head folder"): ARG is then a
        shipped draft's name, a folder or a Hub repo ORG/NAME[@REVISION], resolved to its folder before `parse`, and
        specjax-bench takes it as `--NAME PATH`.
      bench: the specjax-bench option that gives ARG otherwise. An entry with neither has no bench mode.
    """

    name: str
    spec: str
    help: str
    build: Callable[[Any, DraftTarget], Drafter]
    example: Callable[[DraftTarget, int], Drafter]
    parse: Callable[[str, ModelConfig], Any] = lambda arg, cfg: arg
    trees: bool = False
    checkpoint: str | None = None
    bench: BenchOption | None = None

    @property
    def wraps(self) -> bool:
        """Its spec is `NAME[:ARG]+SPEC`: it drafts with the drafter of SPEC (`DraftTarget.fallback`)."""
        return self.name.endswith("+")

    @property
    def kind(self) -> str:
        """The name as a spec spells it before its ARG (without the "+" of a wrapping entry)."""
        return self.name.removesuffix("+")


def integer(text: str, what: str) -> int:
    """A spec's ARG as an integer; raises InputError naming `what` it is."""
    try:
        return int(text)
    except ValueError:
        raise InputError(f"{what} must be an integer, got {text!r}") from None
