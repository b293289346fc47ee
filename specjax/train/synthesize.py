"""Stage `synthesize`: user prompts the target writes itself (Magpie-style self-instruct).

The chat template is rendered up to the start of a user turn, and the target samples the user's message until the
end of the turn. A short system hint (a domain and a topic, from the table below) steers each row, so the prompts
cover every domain in turn. The raw generations are stored per batch in the content-addressed store
(specjax/train/store.py); the filters (specjax/train/filters.py) then keep prompts in batch order until
`synthesize.num_prompts` are kept, generating further batches only when the stored ones do not suffice. Output:
`prompts/synthetic.jsonl` and `prompts/manifest.json` (what was generated, kept, and why the rest was dropped).
"""

from __future__ import annotations

import collections
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from specjax.config import SamplingConfig
from specjax.decoding.autoregressive import generate
from specjax.errors import InputError
from specjax.host import write_file
from specjax.io.loading import LoadedModel
from specjax.train.config import SynthesizeSection
from specjax.train.filters import NearDuplicates, degeneracy_issue, language_issue
from specjax.train.store import Store, content_key, target_fingerprint

# Domain -> topics. A row's system hint names its domain's description and one topic.
DOMAINS: dict[str, tuple[str, tuple[str, ...]]] = {
    "code": (
        "a programming task or question",
        (
            "a Python function",
            "fixing a bug in their code",
            "an SQL query",
            "JavaScript in a web page",
            "an algorithm or data structure",
            "a shell command",
            "a regular expression",
            "classes and objects",
            "unit tests",
            "reading a CSV or JSON file",
            "a command-line tool",
            "code review of a snippet",
        ),
    ),
    "math": (
        "a math problem to solve step by step",
        (
            "arithmetic word problems",
            "percentages and discounts",
            "algebra equations",
            "geometry",
            "probability",
            "statistics",
            "fractions",
            "unit conversion",
            "sequences and series",
            "rates and speed",
        ),
    ),
    "reasoning": (
        "a logic or reasoning question",
        (
            "a logic puzzle",
            "a riddle",
            "cause and effect",
            "comparing two options",
            "planning a schedule",
            "finding the flaw in an argument",
            "ordering events",
            "a what-if scenario",
        ),
    ),
    "writing": (
        "a writing task",
        (
            "a short story",
            "a poem",
            "an email to a colleague",
            "a product description",
            "a cover letter",
            "a blog post outline",
            "a speech",
            "rewriting a paragraph more clearly",
            "a social media post",
            "a summary",
        ),
    ),
    "stem": (
        "an explanation of a science or technology topic",
        (
            "physics",
            "chemistry",
            "biology",
            "astronomy",
            "computer networks",
            "machine learning",
            "medicine",
            "climate and weather",
            "electricity",
            "how a common device works",
            "history of science",
            "economics",
        ),
    ),
    "extraction": (
        "extracting or reformatting information from a text they include",
        (
            "turning notes into a table",
            "extracting names and dates as JSON",
            "listing the key points of a paragraph",
            "classifying customer reviews",
            "converting a list to CSV",
            "pulling numbers out of a report",
            "filling a template from a description",
            "sorting items into categories",
        ),
    ),
    "roleplay": (
        "a role play in which you play a character",
        (
            "a job interview",
            "a customer service call",
            "a fantasy adventure",
            "a historical figure",
            "a travel guide",
            "a detective story",
            "a teacher and student",
            "a doctor's appointment",
        ),
    ),
    "everyday": (
        "an everyday practical question",
        (
            "cooking and recipes",
            "travel planning",
            "personal finance",
            "health and exercise",
            "home repair",
            "gardening",
            "learning a language",
            "gift ideas",
            "productivity",
            "pets",
            "moving to a new city",
        ),
    ),
}

_SENTINEL = "\x00user-turn\x00"


def user_turn_prefix(tokenizer, system: str | None) -> list[int]:
    """The ids of a conversation rendered up to where the user's message begins (optionally after a system turn)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    return tokenizer.encode(text[: text.index(_SENTINEL)])


def hint(domain: str, topic: str) -> str:
    return f"You are a helpful AI assistant. The user's next message asks for {DOMAINS[domain][0]}, about {topic}."


def _row_hints(cfg: SynthesizeSection, batch: int) -> list[tuple[str, str]]:
    """(domain, system hint) of each row of one batch: domains in turn, topics drawn with the batch's seed."""
    rng = random.Random(cfg.seed * 1_000_003 + batch)
    domains = cfg.domains
    rows = []
    for j in range(cfg.batch_size):
        domain = domains[(batch * cfg.batch_size + j) % len(domains)]
        rows.append((domain, hint(domain, rng.choice(DOMAINS[domain][1]))))
    return rows


def _raw_batches(model: LoadedModel, cfg: SynthesizeSection, store: Store) -> Iterator[list[dict]]:
    """The raw generations of batch 0, 1, ... (read from the store, or generated and stored)."""
    tok = model.tokenizer
    eos = model.eos_ids
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p)
    target = target_fingerprint(model)
    batch = 0
    while True:
        rows = _row_hints(cfg, batch)
        key = content_key(
            {
                "kind": "synth",
                "target": target,
                "hints": [h for _, h in rows],
                "seed": cfg.seed * 1_000_003 + batch,
                "temperature": cfg.temperature,
                "top_p": cfg.top_p,
                "max_tokens": cfg.max_tokens,
            }
        )
        if not store.has(key):
            prompts = [user_turn_prefix(tok, h) for _, h in rows]
            out = generate(
                model.weights,
                model.cfg,
                prompts,
                max_new_tokens=cfg.max_tokens,
                sampling=sampling,
                seed=cfg.seed * 1_000_003 + batch,
                eos_ids=eos,
            )
            records = [
                {"domain": d, "text": tok.decode(c.output_ids), "tokens": len(c.output_ids), "finish": c.finish_reason}
                for (d, _), c in zip(rows, out.completions)
            ]
            store.write_text(key, "".join(json.dumps(r) + "\n" for r in records))
        yield [json.loads(line) for line in store.path(key).read_text(encoding="utf-8").splitlines()]
        batch += 1


def drop_reason(record: dict, cfg: SynthesizeSection, dedup: NearDuplicates) -> str | None:
    """Why a raw generation is not kept as a prompt (None: kept)."""
    text = record["text"].strip()
    if record["finish"] != "stop":
        return "truncated"
    if record["tokens"] < cfg.min_tokens or not text:
        return "too short"
    return language_issue(text) or degeneracy_issue(text) or dedup.check(text)


def synthesize(model: LoadedModel, cfg: SynthesizeSection, store_root: Path, folder: Path, evaluation: list[str]):
    """Writes `folder/synthetic.jsonl` ({"prompt", "domain"} per line) and `folder/manifest.json`.

    Args:
      model: the target.
      cfg: the synthesize section of the config.
      store_root: the content-addressed store (raw generations are read from and written to `store_root/synth`).
      folder: where the kept prompts and the manifest go.
      evaluation: prompts never to be resembled (held-out and evaluation sets).
    """
    unknown = sorted(set(cfg.domains) - set(DOMAINS))
    if unknown:
        raise InputError(f"unknown synthesize.domains {unknown}; choose from {', '.join(DOMAINS)}")
    store = Store(store_root, "synth", ".jsonl")
    dedup = NearDuplicates(cfg.dedup_threshold, evaluation)
    kept, dropped, generated = [], collections.Counter(), 0
    with tqdm(total=cfg.num_prompts, desc="synthesize", unit="prompt", file=sys.stderr) as bar:
        for records in _raw_batches(model, cfg, store):
            for record in records:
                if len(kept) == cfg.num_prompts:
                    break
                generated += 1
                reason = drop_reason(record, cfg, dedup)
                if reason:
                    dropped[reason] += 1
                else:
                    kept.append({"prompt": record["text"].strip(), "domain": record["domain"]})
                    bar.update()
            if len(kept) == cfg.num_prompts:
                break
            if generated >= cfg.max_generations:
                raise InputError(
                    f"synthesize: {len(kept)} prompts kept of {generated} generated ({dict(dropped)}); "
                    f"raise synthesize.max_generations or lower synthesize.num_prompts"
                )
    write_file(folder / "synthetic.jsonl", "".join(json.dumps(k) + "\n" for k in kept))
    manifest = {
        "generated": generated,
        "kept": len(kept),
        "dropped": dict(dropped.most_common()),
        "kept_by_domain": dict(collections.Counter(k["domain"] for k in kept)),
    }
    write_file(folder / "manifest.json", json.dumps(manifest, indent=1))
    print(f"synthesize: kept {len(kept)} of {generated} generations; dropped {dict(dropped)}", file=sys.stderr)
