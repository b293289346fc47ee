"""JSONL files of prompts and conversations: one JSON value a line, and one clear InputError for what cannot be read."""

from __future__ import annotations

import json
from pathlib import Path

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


def read_prompts_file(path: Path) -> list[str]:
    """Prompts from a JSONL file: one object per line with a "prompt" string; other fields are ignored."""
    prompts = []
    for number, record in read_jsonl(path):
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise InputError(f'{path}:{number}: expected an object with a "prompt" string')
        prompts.append(record["prompt"])
    return prompts
