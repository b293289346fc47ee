"""Training conversations from every prompt source, in one shape: a list of {"role", "content"} messages.

Sources (`data.prompts`): `builtin` (specjax's code prompts), `synthetic` (the synthesize stage's output), or a JSONL
file whose lines are any of
  {"prompt": "..."}                                              one user turn
  {"conversations": [{"from": "human", "value": "..."}, ...]}    ShareGPT (human/user, gpt/assistant, system)
  {"messages": [{"role": "user", "content": "..."}, ...]}        chat messages (user, assistant, system)
Multi-turn conversations keep every turn: the target regenerates each assistant turn given the conversation so
far, or, with `data.regenerate: false`, the file's own assistant turns are trained on.
"""

from __future__ import annotations

from pathlib import Path

from specjax.errors import InputError
from specjax.io.jsonl import read_jsonl
from specjax.train.prompts import builtin_prompts

Conversation = list[dict[str, str]]

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}
_ROLES = {"user", "assistant", "system"}


def _messages(record: object, where: str) -> Conversation:
    """One JSONL record as messages; raises InputError naming `where` (file:line) for a malformed record."""
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record["prompt"]}]
    if isinstance(record, dict) and isinstance(record.get("conversations"), list):
        turns, role_key, text_key, roles = record["conversations"], "from", "value", _SHAREGPT_ROLES
    elif isinstance(record, dict) and isinstance(record.get("messages"), list):
        turns, role_key, text_key, roles = record["messages"], "role", "content", {r: r for r in _ROLES}
    else:
        raise InputError(f'{where}: expected an object with "prompt", "conversations" or "messages"')
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str) or turn.get(role_key) not in roles:
            raise InputError(
                f'{where}: turn {i} needs "{role_key}" (one of {", ".join(sorted(roles))}) and a "{text_key}" string'
            )
        messages.append({"role": roles[turn[role_key]], "content": turn[text_key]})
    users = [m for m in messages if m["role"] == "user"]
    first = next((m for m in messages if m["role"] != "system"), None)
    if not users or first["role"] != "user":
        raise InputError(f"{where}: a conversation must start (after any system turn) with a user turn")
    return messages


def read_conversations(path: Path) -> list[Conversation]:
    """The conversations of a JSONL file, with one clear error (file:line) for the first malformed line."""
    return [_messages(record, f"{path}:{number}") for number, record in read_jsonl(path)]


def source_conversations(source: str, seed: int, synthetic_path: Path) -> list[Conversation]:
    """The conversations of one `data.prompts` source."""
    if source == "builtin":
        return [[{"role": "user", "content": p}] for p in builtin_prompts(seed)]
    if source == "synthetic":
        if not synthetic_path.is_file():
            raise InputError(f"the synthetic prompt source needs {synthetic_path}; run the synthesize stage first")
        return read_conversations(synthetic_path)
    return read_conversations(Path(source))


def first_user_text(conversation: Conversation) -> str:
    return next(m["content"] for m in conversation if m["role"] == "user")
