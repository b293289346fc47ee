"""Drafters for the speculative loop, behind one protocol (`Drafter`; chain drafters subclass `ChainDrafter`): the
loop never knows which it runs.

- `NgramDrafter`: prompt lookup over prompt + generated text (one-hot draft_probs).
- `LayerSkipDrafter`: the target's first N layers + final norm + LM head.
- `ModelDrafter`: a separate, smaller checkpoint with the same vocabulary.
- `Eagle3Drafter`: an EAGLE-3 head over the target's hidden states, as a chain or a dynamic tree.
- `DFlashDrafter`: a DFlash block-diffusion draft over the target's hidden states, K drafts in one forward.
- `LookupFirstDrafter`: prompt lookup where the text repeats, another chain drafter elsewhere.

Each kind is registered by name (`specjax.drafters.registry`): `drafter_from_spec` builds one from a command-line
spec, `register` adds another.
"""

from specjax.drafters.base import ChainDrafter, Drafter, Traits, draw, pending_tokens
from specjax.drafters.dflash import DFlashDrafter, load_dflash_drafter
from specjax.drafters.eagle3 import Eagle3Drafter, Eagle3State, load_eagle3_drafter
from specjax.drafters.entry import BenchOption, DrafterEntry, DraftTarget
from specjax.drafters.model import LayerSkipDrafter, ModelDrafter, ModelDraftState
from specjax.drafters.ngram import (
    LOOKUP_TOKENS_HELP,
    LookupFirstDrafter,
    NgramDrafter,
    ngram_lookup,
    ngram_proposal,
    with_lookup_tokens,
)
from specjax.drafters.registry import (
    SHIPPED_DRAFTS,
    draft_folder,
    drafter_from_spec,
    entries,
    register,
    spec_help,
    tree_specs,
)
from specjax.drafters.tree import DraftTree, TreeSpec

__all__ = [
    "LOOKUP_TOKENS_HELP",
    "SHIPPED_DRAFTS",
    "BenchOption",
    "ChainDrafter",
    "DFlashDrafter",
    "DraftTarget",
    "DraftTree",
    "Drafter",
    "DrafterEntry",
    "Eagle3Drafter",
    "Eagle3State",
    "LayerSkipDrafter",
    "LookupFirstDrafter",
    "ModelDraftState",
    "ModelDrafter",
    "NgramDrafter",
    "Traits",
    "TreeSpec",
    "draft_folder",
    "draw",
    "drafter_from_spec",
    "entries",
    "load_dflash_drafter",
    "load_eagle3_drafter",
    "ngram_lookup",
    "ngram_proposal",
    "pending_tokens",
    "register",
    "spec_help",
    "tree_specs",
    "with_lookup_tokens",
]
