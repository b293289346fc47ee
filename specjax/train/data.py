"""Stage `regenerate`: the target writes the assistant turns itself; and the dataset those turns form.

The training conversations (specjax/train/conversations.py) are taken from the sources in turn and each source's
are cut, in order, into units of `UNIT` conversations. Each unit yields one shard per response: the greedy one, then
`data.samples_per_prompt` sampled ones. A shard holds token arrays with assistant-only loss masks (compressed
`.npz`, no pickle) and lives in the content-addressed store (specjax/train/store.py) under the hash of the target, the
unit's conversations and the generation settings: a run resumes at the first missing shard, a run with more prompts
reuses the shards of a smaller one, and a committed store lets a later run retrain without generating.
`output_dir/data/manifest.json` lists the shards a run uses, with counts.

Multi-turn conversations are regenerated turn by turn, batched over conversations: turn t's prompt is the
conversation so far (with the target's own earlier replies) through the chat template. A conversation whose reply
was cut at `data.max_new_tokens`, or whose next prompt exceeds `data.max_prompt_tokens`, ends there.

With `data.source_tokens`, blocks of the standard library's source follow as further shards, framed as assistant
answers: text the target did not write, labelled by the target's own predictions (the features stage computes them).
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specjax.config import SamplingConfig
from specjax.decoding.engine import Engine
from specjax.errors import InputError
from specjax.host import write_file
from specjax.io.loading import LoadedModel
from specjax.train.config import DataSection
from specjax.train.conversations import Conversation, first_user_text, source_conversations
from specjax.train.filters import NearDuplicates
from specjax.train.prompts import humaneval_entry_points, stdlib_source_answers, stub_names
from specjax.train.store import Store, content_key, read_manifest, target_fingerprint

UNIT = 256  # conversations per shard: the granularity of resuming and of nested subsets

Sample = tuple[np.ndarray, np.ndarray]  # (token ids, loss mask)


def load_prompts(
    data: DataSection, synthetic_path: Path, evaluation: Sequence[str]
) -> tuple[list[list[Conversation]], list[str], int]:
    """(training conversations per source, held-out evaluation prompts, conversations dropped).

    The first `data.eval_prompts` conversations of the first source are held out (their first user turn).
    Conversations whose first user turn resembles a held-out or `evaluation` prompt are dropped; of the rest,
    `data.num_prompts` train, taken from the sources in turn, `UNIT` at a time, each source in its own order. So a
    smaller run is a prefix of a larger one, with the same mix of sources and the same full units.
    """
    pools = [source_conversations(source, data.seed, synthetic_path) for source in data.prompt_sources]
    held_out = [first_user_text(c) for c in pools[0][: data.eval_prompts]]
    pools[0] = pools[0][data.eval_prompts :]
    overlap = NearDuplicates(threshold=None, evaluation=[*evaluation, *held_out])
    kept: list[list[Conversation]] = [[] for _ in pools]
    scanned, need = [0] * len(pools), data.num_prompts
    while need and any(n < len(pool) for n, pool in zip(scanned, pools)):
        for i, pool in enumerate(pools):
            goal = len(kept[i]) + min(UNIT, need)
            while len(kept[i]) < goal and scanned[i] < len(pool):
                conversation = pool[scanned[i]]
                scanned[i] += 1
                if overlap.check(first_user_text(conversation)) != "overlaps evaluation":
                    kept[i].append(conversation)
            need = data.num_prompts - sum(map(len, kept))
    if need or len(held_out) < data.eval_prompts:
        raise InputError(
            f"{', '.join(data.prompt_sources)}: {sum(map(len, kept))} usable prompts besides {len(held_out)} held "
            f"out, but data.num_prompts + data.eval_prompts = {data.num_prompts + data.eval_prompts}; lower them"
        )
    return [k for k in kept if k], held_out, sum(scanned) - sum(map(len, kept))


class _Builder:
    """One conversation's token ids and loss mask, grown turn by turn."""

    def __init__(self, conversation: Conversation):
        self.pending = list(conversation)  # messages not yet consumed
        self.history: Conversation = []
        self.ids: list[int] = []
        self.mask: list[int] = []

    def next_prompt(self, tokenizer) -> list[int] | None:
        """The ids of the conversation up to the next assistant turn, or None when no user turn is left."""
        while self.pending and self.pending[0]["role"] != "user":
            message = self.pending.pop(0)
            if message["role"] == "system" and not self.history:
                self.history.append(message)
        if not self.pending:
            return None
        self.history.append(self.pending.pop(0))
        return tokenizer.encode(tokenizer.apply_chat_template(self.history))

    def file_reply(self) -> str | None:
        """The file's own reply to the last user turn (for data.regenerate = false)."""
        if self.pending and self.pending[0]["role"] == "assistant":
            return self.pending.pop(0)["content"]
        return None

    def add_turn(self, prompt: list[int], reply: list[int], reply_text: str) -> bool:
        """Appends one turn; False when the prompt does not extend the earlier turns' ids (the template re-tokenized
        them), in which case the earlier turns lose their loss mask."""
        extends = prompt[: len(self.ids)] == self.ids
        self.mask = (self.mask if extends else [0] * len(self.ids)) + [0] * (len(prompt) - len(self.ids))
        self.ids = prompt + reply
        self.mask += [1] * len(reply)
        self.history.append({"role": "assistant", "content": reply_text})
        return extends


def _sample_arrays(samples: Sequence[Sample], vocab_size: int) -> dict[str, np.ndarray]:
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    return {
        "tokens": np.concatenate([t for t, _ in samples]).astype(dtype),
        "loss_mask": np.concatenate([m for _, m in samples]).astype(np.int8),
        "lengths": np.asarray([len(t) for t, _ in samples], np.int32),
    }


def respond(
    model: LoadedModel,
    conversations: Sequence[Conversation],
    data: DataSection,
    sampling: SamplingConfig,
    seed: int,
    reply: Callable[[list[list[int]], SamplingConfig, list[int], Callable[[int], object]], list[tuple[list[int], bool]]]
    | None = None,
    progress: Callable[[int], object] = lambda n: None,
) -> tuple[list[Sample], collections.Counter]:
    """The samples of a unit of conversations, and counts of what was cut or dropped.

    Args:
      model: the target.
      conversations: the unit.
      data: the data section (max_prompt_tokens, max_new_tokens, batch_size, regenerate).
      sampling: the regeneration's sampling settings.
      seed: the unit's seed (sampled responses).
      reply: (prompts, sampling, a seed per prompt, done) -> (reply ids, cut at max_new_tokens) per prompt, calling
        done(n) as n replies finish; default: the target, through `data.batch_size` slots that refill.
      progress: called with the number of conversations whose first reply is written, as they are.
    """
    tok = model.tokenizer
    engines = {}

    def target_reply(prompts, sampling, seeds, done):
        if sampling.greedy not in engines:
            engines[sampling.greedy] = Engine(
                model.weights,
                model.cfg,
                slots=data.batch_size,
                sampled=not sampling.greedy,
                eos_ids=model.eos_ids,
                max_context=min(data.max_prompt_tokens + data.max_new_tokens, model.cfg.max_position_embeddings),
            )
        engine, out = engines[sampling.greedy], {}
        ids = [engine.submit(p, data.max_new_tokens, sampling, seed=s) for p, s in zip(prompts, seeds)]
        for event in engine.events():
            if event.completion is not None:
                out[event.request] = event.completion
                done(1)
        return [(out[i].output_ids, out[i].finish_reason == "length") for i in ids]

    reply = reply or target_reply
    builders = [_Builder(c) for c in conversations]
    active, counts, turn = list(range(len(builders))), collections.Counter(), 0
    while active:
        prompts = {}
        for i in active:
            prompt = builders[i].next_prompt(tok)
            if prompt is None:
                continue
            if len(prompt) > data.max_prompt_tokens:
                counts["prompt over max_prompt_tokens" if turn == 0 else "conversation cut: long context"] += 1
                continue
            prompts[i] = prompt
        if data.regenerate:
            rows = sorted(prompts)
            seeds = [int(content_key({"seed": seed, "turn": turn, "conversation": i})[:15], 16) for i in rows]
            out = reply([prompts[i] for i in rows], sampling, seeds, progress if turn == 0 else lambda n: None)
            replies = {i: (ids, cut, tok.decode(ids)) for i, (ids, cut) in zip(rows, out)}
        else:
            replies = {}
            for i, prompt in prompts.items():
                text = builders[i].file_reply()
                if text is not None:
                    full = tok.encode(
                        tok.apply_chat_template(builders[i].history + [{"role": "assistant", "content": text}], False)
                    )
                    replies[i] = (full[len(prompt) :], False, text)
        active = []
        for i, (ids, cut, text) in replies.items():
            if not builders[i].add_turn(prompts[i], list(ids), text):
                counts["earlier turns re-tokenized"] += 1
            if not cut:
                active.append(i)
                continue
            counts["reply cut at max_new_tokens"] += 1
            if any(m["role"] == "user" for m in builders[i].pending):
                counts["conversation cut: reply at max_new_tokens"] += 1
        turn += 1
    samples = [(np.asarray(b.ids, np.int32), np.asarray(b.mask, np.int8)) for b in builders if any(b.mask)]
    return samples, counts


def _unit_key(target: str, unit: Sequence[Conversation], data: DataSection, sampling: SamplingConfig, seed: int):
    return content_key(
        {
            "kind": "responses",
            "target": target,
            "conversations": list(unit),
            "regenerate": data.regenerate,
            "sampling": [sampling.temperature, sampling.top_k, sampling.top_p],
            "seed": seed,
            "max_prompt_tokens": data.max_prompt_tokens,
            "max_new_tokens": data.max_new_tokens,
        }
    )


def _write_shard(model, unit, data, sampling, seed, store: Store, key: str, progress=lambda n: None) -> None:
    samples, counts = respond(model, unit, data, sampling, seed, progress=progress)
    if not samples:
        raise InputError(f"regenerate: no sample left in a unit ({dict(counts)}); raise data.max_prompt_tokens")
    store.write_arrays(key, **_sample_arrays(samples, model.cfg.vocab_size), counts=np.asarray(json.dumps(counts)))


def read_shard(path: Path) -> list[Sample]:
    with np.load(path, allow_pickle=False) as z:
        starts = np.r_[0, np.cumsum(z["lengths"])]
        tokens, mask = z["tokens"].astype(np.int32), z["loss_mask"]
        return [(tokens[a:b], mask[a:b]) for a, b in zip(starts[:-1], starts[1:])]


def reference_responses(model: LoadedModel, prompts: list[str], data: DataSection, store_root: Path) -> list[Sample]:
    """The target's greedy responses to evaluation prompts (one shard in the store, generated once)."""
    unit = [[{"role": "user", "content": p}] for p in prompts]
    store, sampling = Store(store_root, "responses", ".npz"), SamplingConfig()
    key = _unit_key(target_fingerprint(model), unit, data, sampling, 0)
    if not store.has(key):
        with tqdm(total=len(unit), desc="reference responses", unit="prompt", file=sys.stderr) as bar:
            _write_shard(model, unit, data, sampling, 0, store, key, bar.update)
    return read_shard(store.path(key))


def regenerate(model: LoadedModel, data: DataSection, folder: Path, store_root: Path, evaluation: list[str]) -> None:
    """Writes the dataset's manifest (the shards it uses, generated now or found in the store) into `folder`, with
    the held-out prompts (`eval_prompts.jsonl`).

    Args:
      model: the target.
      data: the data section of the config.
      folder: the dataset folder (output_dir/data).
      store_root: the content-addressed store.
      evaluation: prompts training must not resemble; conversations whose first user turn does are dropped.
    """
    per_source, held_out, dropped = load_prompts(data, folder.parent / "prompts" / "synthetic.jsonl", evaluation)
    write_file(folder / "eval_prompts.jsonl", "".join(json.dumps({"prompt": p}) + "\n" for p in held_out))
    # A unit never spans two sources: growing one leaves the others' units alone.
    units = [kept[i : i + UNIT] for kept in per_source for i in range(0, len(kept), UNIT)]
    store, target = Store(store_root, "responses", ".npz"), target_fingerprint(model)
    settings = [SamplingConfig(temperature=data.temperature)] + [
        SamplingConfig(temperature=data.sample_temperature, top_p=data.sample_top_p)
    ] * data.samples_per_prompt
    # Greedy shards first, then each sampled response. A unit's seed follows from its content, not its position.
    work = []
    for r, sampling in enumerate(settings):
        for u, unit in enumerate(units):
            seed = int(content_key({"unit": unit, "response": r, "seed": data.seed})[:7], 16)
            work.append((u, r, seed, _unit_key(target, unit, data, sampling, seed)))
    todo = [w for w in work if not store.has(w[3])]
    with tqdm(
        total=sum(len(units[w[0]]) for w in todo), desc="regenerate", unit="conversation", file=sys.stderr
    ) as bar:
        for u, r, seed, key in todo:
            _write_shard(model, units[u], data, settings[r], seed, store, key, bar.update)
    shards = [w[3] for w in work]
    source = _source_shards(model, data, stub_names(held_out), store, target) if data.source_tokens else []
    totals, sizes = collections.Counter(), {}
    for kind, keys in (("", shards), ("source_", source)):
        for key in keys:
            with np.load(store.path(key), allow_pickle=False) as z:
                totals.update(json.loads(str(z["counts"])))
                sizes[kind + "samples"] = sizes.get(kind + "samples", 0) + len(z["lengths"])
                sizes[kind + "tokens"] = sizes.get(kind + "tokens", 0) + int(z["loss_mask"].sum())
    manifest = {
        "store": str(store_root),
        "shards": shards,
        "source_shards": source,
        "conversations": sum(len(u) for u in units),
        "dropped_overlapping_evaluation": dropped,
        "responses_per_prompt": len(settings),
        "samples": sizes["samples"],
        "assistant_tokens": sizes["tokens"],
        "source_samples": sizes.get("source_samples", 0),
        "source_tokens": sizes.get("source_tokens", 0),
        "cut_or_dropped": dict(totals),
        "python": sys.version.split()[0],
    }
    write_file(folder / "manifest.json", json.dumps(manifest, indent=1))
    print(
        f"regenerate: {sizes['samples']} samples, {sizes['tokens']} assistant tokens in {len(shards)} shards",
        file=sys.stderr,
    )


def _source_shards(model: LoadedModel, data: DataSection, held_out_names: set[str], store: Store, target: str):
    """Shards of standard-library source answers (question ids, answer ids) holding `data.source_tokens` tokens."""
    key = content_key(
        {
            "kind": "source",
            "target": target,
            "tokens": data.source_tokens,
            "seed": data.seed,
            "python": sys.version.split()[0],
            "held_out": sorted(held_out_names),
        }
    )
    if not store.has(key):
        tok, samples, total = model.tokenizer, [], 0
        for question, answer in stdlib_source_answers(held_out_names | humaneval_entry_points(), data.seed):
            if total >= data.source_tokens:
                break
            q, a = tok.chat_prompt_ids(question), tok.encode(answer)
            samples.append((np.asarray(q + a, np.int32), np.r_[np.zeros(len(q), np.int8), np.ones(len(a), np.int8)]))
            total += len(a)
        store.write_arrays(key, **_sample_arrays(samples, model.cfg.vocab_size), counts=np.asarray("{}"))
    return [key]


def load_samples(folder: Path, regenerated_only: bool = False) -> list[Sample]:
    """The (tokens, loss_mask) samples of a dataset, in shard order: all, or only those the target wrote.

    Args:
      folder: the dataset folder (its manifest names the store and the shards).
      regenerated_only: leave out the standard-library source shards.
    """
    manifest = read_manifest(folder, "holds no finished dataset; run the regenerate stage first")
    store = Store(Path(manifest["store"]), "responses", ".npz")
    keys = manifest["shards"] + ([] if regenerated_only else manifest["source_shards"])
    samples = []
    for key in keys:
        if not store.has(key):
            raise InputError(f"{store.path(key)} is missing; run the regenerate stage again")
        samples += read_shard(store.path(key))
    return samples
