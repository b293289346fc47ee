"""Every registered drafter as a test case (`specjax.drafters.registry`): the shared exactness and engine tests
parametrize over `drafter_params()`, so a newly registered drafter is tested with no edit to them.

A case is an entry's untrained example (`DrafterEntry.example`) for the test's own toy target: NAME for a chain
drafter; NAME-chain and NAME-tree for one that drafts trees (the tree `TREE`); NAME+FALLBACK for one that wraps
another, around the first registered drafter of a draft checkpoint (a learned drafter with its own state, taps and
commit, which the wrapper must carry)."""

import dataclasses

import pytest

from specjax.drafters import DrafterEntry, DraftTarget, TreeSpec, entries

TREE = TreeSpec(3, 2, 6)  # depth 3, 2 children per expanded node, 6 nodes including the root


@dataclasses.dataclass(frozen=True)
class DrafterCase:
    """A registered drafter as the shared tests run it."""

    name: str
    entry: DrafterEntry
    tree: TreeSpec | None = None
    fallback: DrafterEntry | None = None

    def build(self, weights, cfg, seed: int = 1):
        """The untrained drafter for this target (`seed` for its random weights)."""
        target = DraftTarget(weights, cfg, tree=self.tree)
        if self.fallback is not None:
            target = dataclasses.replace(target, fallback=self.fallback.example(target, seed))
        return self.entry.example(target, seed)


def drafter_cases() -> dict[str, DrafterCase]:
    """Every registered drafter's cases, by name."""
    registered = entries()
    learned = next(e for e in registered if e.checkpoint is not None and not e.wraps)
    cases = []
    for entry in registered:
        if entry.wraps:
            cases.append(DrafterCase(entry.name + learned.name, entry, fallback=learned))
        elif entry.trees:
            cases += [DrafterCase(f"{entry.name}-chain", entry), DrafterCase(f"{entry.name}-tree", entry, TREE)]
        else:
            cases.append(DrafterCase(entry.name, entry))
    return {case.name: case for case in cases}


def drafter_params(slow: dict[str, str] | None = None) -> list:
    """`pytest.param`s of every case, id'd by name; those in `slow` (name: which CI test covers its contract
    instead) marked slow."""
    slow = slow or {}
    return [
        pytest.param(case, id=name, marks=[pytest.mark.slow] if name in slow else [])
        for name, case in drafter_cases().items()
    ]
