"""Defaults and limits of speculative decoding, named once: the library, the CLIs and the trainer import them.

Tree shapes are written as the command line takes them, "depth,topk,budget" (`specjax.drafters.tree.TreeSpec.parse`).
"""

DEFAULT_DRAFT_TOKENS = 5  # K, drafts per round, of specjax-generate and specjax-bench when none is given
DEFAULT_NGRAM = 3  # the longest tail prompt lookup matches, and the tail lookup first needs to recur
DEFAULT_TREE = "5,3,10"  # specjax-bench's eagle3-tree mode: the fastest of those tried on a 2-core CPU
CALIBRATION_DRAFT_TOKENS = 8  # `--num-draft-tokens auto`: the largest K it drafts

# Adaptive drafting (specjax.adaptive): the draft sizes a chain drafter's menu offers (up to its largest K), a row's
# acceptance rate before it has drafted and how many tried draft positions that guess counts as when earlier calls'
# are pooled with it; what the prior counts as in a row's own running figures (tried depths in its acceptance tally,
# emitted tokens in its pace), and the share of those figures a round keeps: about 1 / (1 - memory) rounds.
ADAPTIVE_MENU = (1, 2, 3, 5)
ADAPTIVE_PRIOR = 0.6
PRIOR_WEIGHT = 20.0
ROW_PRIOR_WEIGHT = 4.0
ROW_MEMORY = 0.8
PACE_MEMORY = 0.95

EVAL_DRAFT_TOKENS = 5  # the train evaluate stage's chain
EVAL_TREE = "5,4,24"  # the train evaluate stage's tree

MAX_DRAFT_TOKENS = 32  # the deepest draft a round verifies: a chain's K, a tree's depth
MAX_TREE_NODES = 64  # a tree's budget (root included): one verification forward over this many tokens
MAX_TREE_TOPK = 16  # children per expanded tree node
