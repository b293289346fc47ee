"""JSONL files of prompts and conversations: one JSON value a line, and one clear InputError for what cannot be read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from specjax.errors import InputError


def read_jsonl(path: Path) -> list[tuple[int, object]]:
    """(line number, parsed object) for every non-blank line; one clear InputError for an unreadable file, text that
    is not UTF-8, or a line that is not JSON."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise InputError(f"cannot read prompts file {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text (byte {e.start})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{number}: not valid JSON ({e.msg})") from None
    if not records:
        raise InputError(f"{path} holds no prompts")
    return records


class PromptRecord(NamedTuple):
    prompt: str
    max_new_tokens: int | None  # the line's own limit, None where it gives none


def read_prompt_records(path: Path) -> list[PromptRecord]:
    """Prompts from a JSONL file: one object per line with a "prompt" string and, optionally, a positive integer
    "max_new_tokens"; other fields are ignored."""
    records = []
    for number, record in read_jsonl(path):
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise InputError(f'{path}:{number}: expected an object with a "prompt" string')
        limit = record.get("max_new_tokens")
        if limit is not None and (type(limit) is not int or not 1 <= limit < 2**31):
            raise InputError(f'{path}:{number}: "max_new_tokens" must be a positive integer below 2**31, got {limit!r}')
        records.append(PromptRecord(record["prompt"], limit))
    return records


def read_prompts_file(path: Path) -> list[str]:
    """The prompts of `read_prompt_records`."""
    return [r.prompt for r in read_prompt_records(path)]
