"""specjax-bench: tokens/s of each decoding mode on one prompt set, all measured in the same run.

Modes: `ar` (specjax autoregressive); where the `dev` extra (transformers + torch) is installed, the peers `hf` and
`hf-pld` (HF transformers `generate` on the same weights, plain and with its prompt lookup); and a speculative mode for
each registered drafter the bench's options can set (`speculative_modes`). Writes a JSON file, a Markdown table and
a PNG plot.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm import tqdm

from specjax.adaptive import Adaptive, Fixed
from specjax.cli import common as cli
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding import speculative
from specjax.decoding.autoregressive import generate
from specjax.decoding.batch import compilation_summary, compilations, num_slots
from specjax.decoding.engine import Engine
from specjax.decoding.stats import SpecStats, acceptance
from specjax.drafters import LOOKUP_TOKENS_HELP, Drafter, DrafterEntry, entries
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError
from specjax.evalsets import chat_prompts, humaneval_prompts
from specjax.host import machine, status, write_file
from specjax.io.loading import LoadedModel
from specjax.measure.bandwidth import device_bandwidth
from specjax.measure.timing import (
    ForwardCosts,
    ForwardShape,
    drafter_timer,
    forward_seconds,
    forward_timers,
    interleaved_medians,
    prefill_timer,
    round_breakdown,
    shape_timers,
)
from specjax.models.attention import attention_path
from specjax.models.llama import chunk_size, weight_bytes
from specjax.prepare import DecodeConfig, prepare_decoding


@dataclasses.dataclass
class ModeRun:
    """Outputs and timings of one mode over all prompts."""

    mode: str
    outputs: list[list[int]]  # generated ids per prompt
    batch_seconds: list[float]
    batch_tokens: list[int]
    histogram: list[int] | None = None  # speculative modes: row-rounds that accepted 0..K drafts, summed
    rounds: int = 0
    rounds_by_drafts: dict[int, int] = dataclasses.field(default_factory=dict)  # speculative modes
    breakdown: dict | None = (
        None  # speculative modes with a fixed K: where a round's time goes (specjax.measure.timing)
    )
    forwards: int = 0  # target forwards, each reading every weight once: the prefill, then a step or a round
    repeats: int = 1  # times every batch was timed; the statistics and outputs are those of one pass
    learned: dict | None = None  # adaptive modes: the prior per kind of round and the loop's gain, after the run

    def summary(
        self, ar: ModeRun | None, greedy: bool, weight_bytes: int, bandwidth: float, prefills: Sequence[float]
    ) -> dict:
        """The mode's figures; weights read per second are weight_bytes x forwards over the total time, and their
        fraction of the device's `bandwidth` (bytes/s). `prefills`: each timed batch's prefill, timed alone (the
        part of its time that is the same in every specjax mode), taken out for the decode speedup."""
        rates = [n / s for n, s in zip(self.batch_tokens, self.batch_seconds)]
        total_tokens, total_seconds = sum(self.batch_tokens), sum(self.batch_seconds)
        tokens_per_s = statistics.median(rates)
        ar_rates = [n / s for n, s in zip(ar.batch_tokens, ar.batch_seconds)] if ar else None

        def decode_rates(run: ModeRun) -> list[float]:  # the floor keeps timing noise from leaving no time at all
            return [n / max(s - p, s / 100) for n, s, p in zip(run.batch_tokens, run.batch_seconds, prefills)]

        decode_speedup = (
            statistics.median(r / a for r, a in zip(decode_rates(self), decode_rates(ar)))
            if ar and self.mode not in PEERS
            else None
        )
        read = weight_bytes * self.forwards / total_seconds if self.forwards else None
        stats = (
            SpecStats.from_histogram(self.rounds, self.histogram, total_tokens, total_seconds)
            if self.histogram
            else None
        )
        return {
            "mode": self.mode,
            "tokens_per_s": tokens_per_s,
            "total_tokens": total_tokens,
            "total_seconds": total_seconds,
            "mean_accepted": stats.mean_accepted if stats else None,
            "acceptance_by_position": stats.acceptance_by_position if stats else None,
            # Per batch against ar on the same batch (measured next to it), then the median: robust to drift.
            "speedup_vs_ar": statistics.median(r / a for r, a in zip(rates, ar_rates)) if ar else None,
            "decode_speedup_vs_ar": decode_speedup,  # the same, each batch's prefill taken out of both
            "identical_to_ar": (self.outputs == ar.outputs) if (ar and greedy) else None,
            "weight_bytes_per_s": read,
            "bandwidth_fraction": None if read is None else read / bandwidth,
            **({"rounds_by_drafts": self.rounds_by_drafts} if len(self.rounds_by_drafts) > 1 else {}),
            **({"learned": self.learned} if self.learned else {}),
            **({"breakdown": self.breakdown} if self.breakdown else {}),
        }


# A mode is prepared once (weights loaded, options bound) into a runner: (prompt ids batch, max new tokens, seed) ->
# (generated ids per prompt, seconds of decoding).
Runner = Callable[[Sequence[Sequence[int]], int, int], tuple[list[list[int]], float]]


def specjax_ar(
    model: LoadedModel, sampling: SamplingConfig, eos: tuple[int, ...], batch_size: int, prefill_chunk: int | None
) -> Runner:
    def run(group, max_new_tokens, seed):
        out = generate(
            model.weights,
            model.cfg,
            group,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            seed=seed,
            eos_ids=eos,
            batch_size=batch_size,
            prefill_chunk=prefill_chunk,
        )
        return [c.output_ids for c in out.completions], out.seconds

    return run


def hf_generate(
    model: LoadedModel, sampling: SamplingConfig, eos: tuple[int, ...], batch_size: int, prompt_lookup: int = 0
) -> Runner:
    """HF transformers `generate` on the same float32 weights (read from the converted HF folder); with
    `prompt_lookup` > 0, its prompt-lookup decoding drafting that many tokens per round."""
    try:
        import torch
        import transformers
    except ImportError:
        raise InputError("mode 'hf' needs the dev extra: pip install -e '.[dev]'") from None
    from specjax.io.gguf import converted_folder

    source = Path(model.source)
    folder = converted_folder(source) if source.suffix == ".gguf" else source
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad = eos[0]
    kwargs = dict(max_new_tokens=0, eos_token_id=list(eos), pad_token_id=pad, do_sample=not sampling.greedy)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)

    def run(group, max_new_tokens, seed):
        width = max(map(len, group))  # left-padded, as HF expects for batched generation
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, **{**kwargs, "max_new_tokens": max_new_tokens})
        seconds = time.perf_counter() - t0
        rows = out[:, width:].tolist()
        return [row[: next((j + 1 for j, t in enumerate(row) if t in eos), len(row))] for row in rows], seconds

    return run


@dataclasses.dataclass
class SpeculativeRunner:
    """A speculative mode, prepared: decodes a batch with its drafter (a `Runner` that also returns the `SpecStats`),
    and tells `add_breakdowns` what its rounds verify and draft. An adaptive menu learns its prior from every batch
    it decodes (`Adaptive.learn`), the warm-up included, as a server would from earlier requests."""

    model: LoadedModel
    drafter: Drafter
    sampling: SamplingConfig
    eos: tuple[int, ...]
    batch_size: int
    num_draft_tokens: int | Adaptive  # K of the loop (the round's draft is `drafter.draft_shape(K)`), or a menu
    draft_steps: int  # drafter steps per round: K, the fallback's K for lookup first, a tree's depth
    prefill_chunk: int | None

    def __call__(self, group, max_new_tokens, seed):
        out = speculative.speculative_generate(
            self.model.weights,
            self.model.cfg,
            group,
            drafter=self.drafter,
            num_draft_tokens=self.num_draft_tokens,
            max_new_tokens=max_new_tokens,
            sampling=self.sampling,
            seed=seed,
            eos_ids=self.eos,
            batch_size=self.batch_size,
            prefill_chunk=self.prefill_chunk,
        )
        if isinstance(self.num_draft_tokens, Adaptive):
            self.num_draft_tokens = self.num_draft_tokens.learn(out.stats)
        return [c.output_ids for c in out.completions], out.seconds, out.stats


@dataclasses.dataclass(frozen=True)
class SpeculativeMode:
    """A speculative mode: a registered drafter and, for one that wraps another (lookup first), the drafter it wraps,
    drafting chains or (`tree`) trees. Its spec comes from the bench's options: `--NAME PATH` for a drafter that takes
    a draft checkpoint, the entry's `BenchOption` otherwise."""

    name: str
    entry: DrafterEntry
    fallback: DrafterEntry | None = None
    tree: bool = False

    @property
    def drafters(self) -> tuple[DrafterEntry, ...]:
        """The entries its spec names, the wrapping one first."""
        return (self.entry, self.fallback) if self.fallback else (self.entry,)

    def spec(self, cfg: ModelConfig, options: dict) -> str:
        """The `drafter_from_spec` spec of this mode; raises InputError where a checkpoint it needs is not given."""
        parts = []
        for entry in self.drafters:
            if entry.checkpoint is not None:
                path = options[option_dest(entry)]
                if not path:
                    raise InputError(f"mode {self.name} needs {entry.checkpoint}: --{option_flag(entry)} PATH")
                parts.append(f"{entry.kind}:{path}")
            else:
                parts.append(f"{entry.kind}:{entry.bench.arg(options[option_dest(entry)], cfg)}")
        return "+".join(parts)


def option_flag(entry: DrafterEntry) -> str:
    """The bench option that gives an entry's ARG: its name for a draft checkpoint, its `BenchOption` otherwise."""
    return entry.name if entry.checkpoint is not None else entry.bench.flag


def option_dest(entry: DrafterEntry) -> str:
    return option_flag(entry).replace("-", "_")


def speculative_modes() -> dict[str, SpeculativeMode]:
    """The speculative modes, from the registered drafters that the bench's options can set (a draft checkpoint or a
    `BenchOption`): NAME, or NAME-chain and NAME-tree for a drafter that drafts trees; and for one that wraps another,
    NAME+FALLBACK over each drafter of a draft checkpoint."""
    benched = [e for e in entries() if e.checkpoint is not None or e.bench is not None]
    modes = {}
    for entry in benched:
        if entry.wraps:
            for fallback in benched:
                if fallback.checkpoint is not None and not fallback.wraps:
                    modes[entry.name + fallback.name] = SpeculativeMode(entry.name + fallback.name, entry, fallback)
        elif entry.trees:
            for shape in ("chain", "tree"):
                modes[f"{entry.name}-{shape}"] = SpeculativeMode(f"{entry.name}-{shape}", entry, tree=shape == "tree")
        else:
            modes[entry.name] = SpeculativeMode(entry.name, entry)
    return modes


def specjax_speculative(mode: SpeculativeMode) -> Callable[..., SpeculativeRunner]:
    """Speculative decoding with the drafter of `mode`, set up by `specjax.prepare.prepare_decoding`."""

    def prepare(model: LoadedModel, sampling: SamplingConfig, eos: tuple[int, ...], batch_size: int, **options):
        tree = (options["tree"] or DEFAULT_TREE) if mode.tree else None
        k = TreeSpec.parse(tree).depth if tree is not None else options["num_draft_tokens"]  # a tree's round is its own
        decoding = prepare_decoding(
            model,
            dataclasses.replace(
                options["decode"],
                drafter=mode.spec(model.cfg, options),
                num_draft_tokens="auto" if options["auto"] else k,
                lookup_tokens=options["lookup_tokens"] if mode.entry.wraps else None,
                tree=tree,
            ),
        )
        policy = decoding.policy
        verified = policy.k if isinstance(policy, Fixed) else policy
        return SpeculativeRunner(
            model,
            decoding.drafter,
            sampling,
            eos,
            batch_size,
            verified,
            draft_steps=k,
            prefill_chunk=options["prefill_chunk"],
        )

    return prepare


# Peers: HF transformers' generate, plain and with its prompt lookup; their prefill is not specjax's.
PEER_MODES: dict[str, Callable[..., Runner]] = {
    "hf": hf_generate,
    "hf-pld": lambda model, sampling, eos, batch_size: hf_generate(model, sampling, eos, batch_size, prompt_lookup=5),
}
PEERS = tuple(PEER_MODES)
DEFAULT_TREE = "5,3,10"  # the tree modes' tree


def mode_names() -> list[str]:
    """Every mode --modes takes without a variant."""
    return ["ar", *PEERS, *speculative_modes()]


def respelled(mode: str) -> str:
    """A --modes entry in the current spelling: a mode whose drafter wraps another is NAME+FALLBACK, as its spec in
    generate; the old NAME-FALLBACK is still read, with a warning."""
    base, sep, variant = mode.partition(":")
    old = {name.replace("+", "-"): name for name, m in speculative_modes().items() if m.fallback is not None}
    if base not in old:
        return mode
    new = old[base] + sep + variant
    print(f"specjax-bench: mode {mode!r} is now spelled {new!r}", file=sys.stderr)
    return new


def parse_mode(mode: str) -> tuple[str, int | str | None]:
    """(mode, its drafting) of a --modes entry: `MODE`; `MODE:auto`, adaptive; `MODE:K`, a chain mode with its own
    K (so one run compares several)."""
    base, _, variant = mode.partition(":")
    speculative = speculative_modes()
    if base in mode_names() and not variant:
        return base, None
    if base in speculative and variant == "auto":
        return base, "auto"
    if base in speculative and not speculative[base].tree and variant.isdigit() and int(variant) > 0:
        return base, int(variant)
    raise InputError(
        f"unknown mode {mode!r}; choose from {', '.join(mode_names())}, a speculative one with ':auto', or a chain one "
        f"with ':K' (e.g. {next(name for name, m in speculative.items() if not m.tree)}:3)"
    )


# Peers that draft: their forwards per token are not known here.
UNCOUNTED_FORWARDS = ("hf-pld",)
PROMPT_SETS = {
    "humaneval": humaneval_prompts,
    "chat": chat_prompts,
    "mixed": lambda: [p for pair in zip(humaneval_prompts(), chat_prompts()) for p in pair],
}


def measure(
    runners: dict[str, Runner], groups, max_new_tokens: int, seed: int, repeats: int = 1, fresh_samples: bool = False
) -> dict[str, ModeRun]:
    """Runs every mode on every batch, interleaved (batch 1 in all modes, then batch 2, ...), so that the machine's
    drift over the run affects all modes alike, and each batch starting one mode further down the list, so that no
    mode always runs first; `repeats` times over, each repeat timed as one more batch (the outputs and statistics
    are kept once). A repeat reuses its batch's seed, unless `fresh_samples` (sampled decoding): then every timed
    batch has a seed of its own, so the repeats draw new samples and the speedups are medians over as many samples
    as timings, not over the first pass's few. Target forwards per batch: the rounds and the prefill of a
    speculative mode, one per token of the batch's longest output otherwise."""
    for i, (mode, runner) in enumerate(runners.items(), 1):
        status(f"bench {i}/{len(runners)} {mode}: compiling (a warm-up batch)")
        runner(groups[0], max_new_tokens, seed)  # warm-up of the very executable timed next: allocator, thread pools
    runs = {mode: ModeRun(mode, [], [], [], repeats=repeats) for mode in runners}
    batches = [(i, group) for _ in range(repeats) for i, group in enumerate(groups)]
    status(f"bench timing {len(runners)} modes on {len(batches)} batches, interleaved")
    for n, (i, group) in enumerate(tqdm(batches, desc="bench", unit="batch", file=sys.stderr)):
        order = list(runners)
        for mode in order[n % len(order) :] + order[: n % len(order)]:
            outputs, seconds, *stats = runners[mode](group, max_new_tokens, seed + (n if fresh_samples else i))
            run = runs[mode]
            run.batch_seconds.append(seconds)
            run.batch_tokens.append(sum(map(len, outputs)))
            if mode not in UNCOUNTED_FORWARDS:
                run.forwards += stats[0].rounds + 1 if stats else max(map(len, outputs))
            if n >= len(groups):  # a repeat
                continue
            run.outputs += outputs
            if stats:
                hist = stats[0].accepted_histogram
                run.histogram = [a + b for a, b in zip(run.histogram, hist)] if run.histogram else list(hist)
                run.rounds += stats[0].rounds
                for size, rounds in stats[0].rounds_by_drafts.items():
                    run.rounds_by_drafts[size] = run.rounds_by_drafts.get(size, 0) + rounds
    return runs


def typical_context(groups, max_new_tokens: int) -> int:
    """Committed tokens per row halfway through a typical decode: the median prompt plus half the new tokens."""
    return int(statistics.median(len(p) for g in groups for p in g)) + max_new_tokens // 2


def forward_cost_sweep(model: LoadedModel, batch: int, context: int, token_counts: Sequence[int]) -> list[dict]:
    """The target forward's median time over T tokens per row, for each T, against one target step."""
    step_s, *times = forward_seconds(model.weights, model.cfg, batch, context, (1, *token_counts))
    return [{"tokens": t, "ms": 1000 * s, "target_steps": s / step_s} for t, s in zip(token_counts, times)]


# A one-token step after 300 tokens in a small and a large buffer (attention reads the live blocks only), and a step
# and a 10-node tree verification after 4096 tokens.
LONG_CONTEXT = (
    ForwardShape(1, 300, 512),
    ForwardShape(1, 300, 8192),
    ForwardShape(1, 4096, 8192),
    ForwardShape(10, 4096, 8192, tree=True),
)


def context_cost_sweep(model: LoadedModel, batch: int) -> list[dict]:
    """The target forward at the `LONG_CONTEXT` shapes (within the model's length), timed in turn; each against the
    first one-token step of its live length."""
    shapes = [s for s in LONG_CONTEXT if s.slots <= model.cfg.max_position_embeddings]
    times = interleaved_medians(shape_timers(model.weights, model.cfg, batch, shapes), reps=7)
    step = {}
    for shape, t in zip(shapes, times):
        step.setdefault(shape.live, t)
    return [
        {**dataclasses.asdict(shape), "ms": 1000 * t, "target_steps": t / step[shape.live]}
        for shape, t in zip(shapes, times)
    ]


def engine_comparison(
    model: LoadedModel,
    runners: dict,
    prompts: Sequence[Sequence[int]],
    limits: Sequence[int],
    slots: int,
    sampling: SamplingConfig,
    eos: tuple[int, ...],
    prefill_chunk: int | None,
    seed: int,
) -> list[dict]:
    """Each specjax mode over the whole prompt set with each prompt's own limit: today's static batches of `slots`
    prompts (`generate` per batch), against the engine whose slots refill as rows finish, and the engine holding
    static batches (`refill=False`) for the share of slot-rounds that rows sat finished. Compilation excluded."""
    context = max(len(p) + n for p, n in zip(prompts, limits))
    rows = []
    for mode, runner in runners.items():
        if mode in PEERS:
            continue
        status(f"bench engine: {mode}")
        speculating = isinstance(runner, SpeculativeRunner)
        drafter, k = (runner.drafter, runner.num_draft_tokens) if speculating else (None, 1)
        static_ids, static_s = [], 0.0
        for at in range(0, len(prompts), slots):
            ids, seconds, *_ = runner(prompts[at : at + slots], limits[at : at + slots], seed + at)
            static_ids, static_s = static_ids + ids, static_s + seconds
        engines = {}
        for refill in (False, True):
            engine = Engine(
                model.weights,
                model.cfg,
                drafter=drafter,
                num_draft_tokens=k,
                slots=slots,
                max_context=context,
                sampled=not sampling.greedy,
                eos_ids=eos,
                prefill_chunk=prefill_chunk,
                seed=seed,
                refill=refill,
            )
            engine.complete(prompts[:slots], 2, sampling)  # compiles its programs
            engine.slot_rounds.clear()
            t0 = time.perf_counter()
            out = engine.complete(prompts, limits, sampling)
            engines[refill] = (engine, [c.output_ids for c in out], time.perf_counter() - t0)
        tokens = sum(map(len, static_ids))
        (static_engine, _, static_engine_s), (refilling, refill_ids, refill_s) = engines[False], engines[True]
        rows.append(
            {
                "mode": mode,
                "prompts": len(prompts),
                "slots": slots,
                "tokens": tokens,
                "static_tokens_per_s": tokens / static_s,
                "static_engine_tokens_per_s": sum(map(len, engines[False][1])) / static_engine_s,
                "refill_tokens_per_s": sum(map(len, refill_ids)) / refill_s,
                "refill_vs_static": (sum(map(len, refill_ids)) / refill_s) / (tokens / static_s),
                "idle_share_static": static_engine.idle_share(),
                "idle_share_refill": refilling.idle_share(),
                "identical": (refill_ids == static_ids == engines[False][1]) if sampling.greedy else None,
            }
        )
    return rows


def prefill_seconds(model: LoadedModel, groups, max_new_tokens: int, prefill_chunk: int | None) -> list[float]:
    """Each batch's prefill (its prompts in rows of S slots, run by chunks up to the longest, as decoding runs them),
    timed alone; the prefills of the distinct (S, chunks) take turns (`interleaved_medians`)."""
    chunk = chunk_size(prefill_chunk)
    longest = [max(map(len, group)) for group in groups]
    shapes = [(num_slots(model.cfg, n + max_new_tokens), -(-n // chunk)) for n in longest]
    sizes = sorted(set(shapes))
    batch = len(groups[0])
    timers = [
        prefill_timer(
            model.weights,
            model.cfg,
            jnp.ones((batch, slots), jnp.int32),
            jnp.full((batch,), min(chunks * chunk, slots), jnp.int32),
            chunk,
        )
        for slots, chunks in sizes
    ]
    prefill_at = dict(zip(sizes, interleaved_medians(timers, reps=5)))
    return [prefill_at[shape] for shape in shapes]


def add_breakdowns(
    runs: dict[str, ModeRun], runners: dict[str, Runner], batch: int, context: int, prefill_s: float
) -> None:
    """Measures the target's step and verification costs and the drafter of every fixed-K speculative mode alone,
    at this shape (`batch` rows, `context` committed tokens), all timed in turn (`interleaved_medians`) so that the
    modes' drafters compare on a shared machine, and splits each such mode's rounds with them, after taking out
    `prefill_s`, one pass's prefills."""
    fixed = {
        mode: runner
        for mode, runner in runners.items()
        if isinstance(runner, SpeculativeRunner) and not isinstance(runner.num_draft_tokens, Adaptive)
    }
    if not fixed:
        return
    status(f"bench timing verification and {len(fixed)} drafters alone, for the round breakdowns")
    model = next(iter(fixed.values())).model
    verified = {mode: r.drafter.draft_shape(r.num_draft_tokens).budget for mode, r in fixed.items()}  # root included
    counts = sorted({1, *verified.values()})
    timers = forward_timers(model.weights, model.cfg, batch, context, counts)
    timers += [
        drafter_timer(r.drafter, model.cfg, batch, context, r.num_draft_tokens, r.sampling) for r in fixed.values()
    ]
    seconds = interleaved_medians(timers, reps=7)
    forward_at = dict(zip(counts, seconds))
    for (mode, runner), drafter_s in zip(fixed.items(), seconds[len(counts) :]):
        run = runs[mode]
        mean_accepted, _ = acceptance(run.histogram)
        run.breakdown = round_breakdown(
            ForwardCosts(forward_at[1], forward_at[verified[mode]]),
            sum(run.batch_seconds) / run.repeats,
            run.rounds,
            mean_accepted,
            runner.draft_steps,
            drafter_s,
            prefill_s,
        )


def markdown_table(rows: Sequence[dict]) -> str:
    def fmt(x, suffix=""):
        return "–" if x is None else f"{x:.2f}{suffix}"

    lines = [
        "| mode | tokens/s (median) | speedup vs ar | decode speedup | mean accepted | draft cost c | verify cost | "
        "predicted speedup | identical to ar | weights read (GB/s) | of bandwidth |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|",
    ]
    for r in rows:
        same = {None: "–", True: "yes", False: "no"}[r["identical_to_ar"]]
        b = r.get("breakdown") or {}
        read = r["weight_bytes_per_s"]
        fraction = r["bandwidth_fraction"]
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:.1f} | {fmt(r['speedup_vs_ar'], 'x')} | "
            f"{fmt(r['decode_speedup_vs_ar'], 'x')} | {fmt(r['mean_accepted'])} | {fmt(b.get('cost_ratio'))} | "
            f"{fmt(b.get('verify_ratio'), 'x')} | {fmt(b.get('predicted_speedup'), 'x')} | {same} | "
            f"{fmt(None if read is None else read / 1e9)} | "
            f"{'–' if fraction is None else f'{100 * fraction:.1f}%'} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(rows), 3.6))
    names = [r["mode"] for r in rows]
    rates = [r["tokens_per_s"] for r in rows]
    bars = ax.bar(names, rates, color=["#777" if n in ("ar", *PEERS) else "#2a7" for n in names])
    for bar, r in zip(bars, rows):
        label = f"{r['tokens_per_s']:.1f}" + (f"\n{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s (median over batches)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, max(rates) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_drafter_options(p: cli.ArgumentParser) -> None:
    """The options that give the speculative modes' drafters their ARG: `--NAME PATH` for a drafter that takes a
    draft checkpoint, the entry's `BenchOption` otherwise (one option for the entries that share it)."""
    users: dict[str, tuple[DrafterEntry, list[str]]] = {}
    for mode in speculative_modes().values():
        for entry in mode.drafters:
            users.setdefault(option_flag(entry), (entry, []))[1].append(mode.name)
    for flag, (entry, modes) in users.items():
        used_by = f"{', '.join(modes)} mode{'s' if len(modes) > 1 else ''}"
        if entry.checkpoint is not None:
            p.add_argument(f"--{flag}", default=None, help=f"{used_by}: {entry.checkpoint}, Hub repo or built-in name")
        else:
            option = entry.bench
            p.add_argument(f"--{flag}", type=cli.integer, default=option.default, help=f"{used_by}: {option.help}")


def drafter_options(args) -> dict:
    """The values of `add_drafter_options`' options, by their names (as the JSON report's config names them)."""
    dests = {option_dest(entry) for mode in speculative_modes().values() for entry in mode.drafters}
    return {dest: getattr(args, dest) for dest in sorted(dests)}


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="specjax-bench", description=__doc__)
    cli.add_model_args(p, batch_default="1")
    cli.add_sampling_args(p)
    chain = next(name for name, mode in speculative_modes().items() if not mode.tree)
    p.add_argument(
        "--modes",
        default="ar,hf",
        help=f"comma-separated, from: {', '.join(mode_names())}; a speculative mode with ':auto' (e.g. {chain}:auto) "
        f"drafts adaptively; a chain mode with ':K' (e.g. {chain}:2) drafts its own fixed K, so one run compares "
        "several",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=cli.draft_tokens,
        default=cli.DEFAULT_DRAFT_TOKENS,
        help="K for the chain modes; 'auto': every speculative mode drafts adaptively (specjax.adaptive)",
    )
    add_drafter_options(p)
    p.add_argument("--lookup-tokens", type=cli.integer, default=None, help=LOOKUP_TOKENS_HELP)
    trees = [name for name, mode in speculative_modes().items() if mode.tree]
    p.add_argument("--tree", default=None, help=f"{', '.join(trees)}: depth,topk,budget (default {DEFAULT_TREE})")
    p.add_argument(
        "--prompt-set",
        choices=tuple(PROMPT_SETS),
        default="humaneval",
        help="the prompts when none are given: HumanEval's 164, specjax's 96 general-chat prompts (8 categories), or "
        "both, alternating",
    )
    p.add_argument("--num-prompts", type=cli.integer, default=None, help="use only the first N prompts")
    p.add_argument(
        "--repeats",
        type=cli.integer,
        default=1,
        help="time every batch this many times (interleaved as before); the speedups are medians over all of them",
    )
    p.add_argument(
        "--forward-costs",
        type=cli.positive_ints,
        default=None,
        metavar="T,T,...",
        help="also time the target forward over T tokens per row (e.g. 1,5,9,16), against one step",
    )
    p.add_argument(
        "--context-costs",
        action="store_true",
        help="also time the target forward at long contexts: a step after 300 tokens in 512 and 8192 slots, a step "
        "and a 10-node tree after 4096 tokens",
    )
    p.add_argument(
        "--engine",
        action="store_true",
        help="also decode every prompt through the engine whose --batch-size slots refill as rows finish, each prompt "
        "with a limit drawn between half --max-new-tokens and it, against static batches of the same prompts",
    )
    p.add_argument("--out-dir", type=Path, default=Path("bench_out"), help="where the JSON, table and plot go")
    p.add_argument("--json", dest="json_out", type=Path, help="JSON path (default OUT_DIR/bench.json)")
    p.add_argument("--plot", type=Path, help="PNG path (default OUT_DIR/bench.png)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sampling = cli.sampling_from_args(args)
    modes = [respelled(m.strip()) for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise InputError(f"--modes is empty; choose from {', '.join(mode_names())}")
    drafting = {mode: parse_mode(mode) for mode in modes}
    for name in ("--max-new-tokens", "--batch-size", "--num-prompts", "--repeats", "--prefill-chunk"):
        cli.check_positive(name, getattr(args, name[2:].replace("-", "_")))
    given = cli.gather_prompts(args)
    prompt_set = "given" if given else args.prompt_set
    prompts = given or PROMPT_SETS[args.prompt_set]()
    prompts = prompts[: args.num_prompts]
    cli.check_output_dir(args.out_dir)
    json_path = cli.check_output_file(args.json_out or args.out_dir / "bench.json")
    plot_path = cli.check_output_file(args.plot or args.out_dir / "bench.png")
    model = cli.load_target(args)
    if jax.process_count() > 1:
        raise InputError("specjax-bench measures one process: run it on one host, whose devices --mesh splits over")
    ids = cli.encode_prompts(model.tokenizer, prompts, args.raw)
    eos = model.eos_ids
    batch_size = args.batch_size or 1
    groups = cli.batches(ids, batch_size)
    if len(groups) > 1 and len(groups[-1]) < batch_size:
        groups = groups[:-1]  # a ragged last batch would time a different shape; drop it
    used = sum(len(g) for g in groups)

    context = typical_context(groups, args.max_new_tokens)
    # The weights and the autoregressive loop, checked before any mode; each speculative mode checks its own drafter.
    decode = DecodeConfig(
        drafter="none",
        sampling=sampling,
        rows=batch_size,
        prompt_len=max(len(p) for g in groups for p in g),
        max_new_tokens=args.max_new_tokens,
        prefill_chunk=args.prefill_chunk,
    )
    prepare_decoding(model, decode)
    options = dict(
        drafter_options(args),
        num_draft_tokens=args.num_draft_tokens,
        lookup_tokens=args.lookup_tokens,
        tree=args.tree,
        decode=decode,
        prefill_chunk=args.prefill_chunk,
    )

    def prepare(mode: str) -> Runner:
        base, variant = drafting[mode]
        if base == "ar":
            return specjax_ar(model, sampling, eos, batch_size, args.prefill_chunk)
        if base in PEER_MODES:
            return PEER_MODES[base](model, sampling, eos, batch_size)
        k = variant if isinstance(variant, int) else options["num_draft_tokens"]
        chosen = dict(options, num_draft_tokens=k, auto=variant == "auto")
        return specjax_speculative(speculative_modes()[base])(model, sampling, eos, batch_size, **chosen)

    runners = {}
    for i, mode in enumerate(modes, 1):
        status(f"bench {i}/{len(modes)} {mode}: preparing")
        runners[mode] = prepare(mode)
    runs = measure(runners, groups, args.max_new_tokens, args.seed, args.repeats, fresh_samples=not sampling.greedy)
    # Only a speculative mode needs the prefills: without one, `ar`'s decode speedup is 1 whatever they are.
    speculating = any(isinstance(r, SpeculativeRunner) for r in runners.values())
    if speculating:
        status("bench timing the prefills alone")
    prefills = (
        prefill_seconds(model, groups, args.max_new_tokens, args.prefill_chunk) if speculating else [0.0] * len(groups)
    )
    add_breakdowns(runs, runners, batch_size, context, sum(prefills))
    for mode, runner in runners.items():
        if isinstance(runner, SpeculativeRunner) and isinstance(runner.num_draft_tokens, Adaptive):
            runs[mode].learned = runner.num_draft_tokens.summary()
    ar = runs.get("ar")
    weights = weight_bytes(model.cfg, model.weights.embed.dtype, quantize=args.quantize)
    bandwidth, bandwidth_source = device_bandwidth()
    timed_prefills = [prefills[n % len(groups)] for n in range(len(groups) * args.repeats)]  # as `measure` timed
    rows = [runs[m].summary(ar, sampling.greedy, weights, bandwidth, timed_prefills) for m in modes]
    if args.forward_costs:
        status(f"bench timing the target forward over {','.join(map(str, args.forward_costs))} tokens per row")
    sweep = forward_cost_sweep(model, batch_size, context, args.forward_costs) if args.forward_costs else []
    if args.context_costs:
        status("bench timing the target forward at long contexts")
    long_context = context_cost_sweep(model, batch_size) if args.context_costs else []
    engine_rows = []
    if args.engine:
        every = [p for g in groups for p in g]
        rng = random.Random(args.seed)
        limits = [rng.randint(max(1, args.max_new_tokens // 2), args.max_new_tokens) for _ in every]
        engine_rows = engine_comparison(
            model, runners, every, limits, batch_size, sampling, eos, args.prefill_chunk, args.seed
        )
    config = {
        "model": args.model,
        "prompt_set": prompt_set,
        "prompts": used,
        "batch_size": batch_size,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "repeats": args.repeats,
        "dtype": str(model.weights.embed.dtype),
        "quantize": args.quantize,
        "date": time.strftime("%Y-%m-%d"),
        "num_draft_tokens": args.num_draft_tokens,
        **drafter_options(args),
        "lookup_tokens": args.lookup_tokens,
        "tree": args.tree or DEFAULT_TREE,
        "prefill_chunk": chunk_size(args.prefill_chunk),
        "attention": args.attention,
        "attention_path": attention_path(args.attention),
        "device": jax.devices()[0].device_kind,
        "machine": machine(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "weight_bytes": weights,
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_source": bandwidth_source,
    }
    table = markdown_table(rows)
    if sweep:
        table += "\n| tokens per row | forward (ms, median) | target steps |\n|---:|---:|---:|\n"
        table += "".join(f"| {r['tokens']} | {r['ms']:.1f} | {r['target_steps']:.2f} |\n" for r in sweep)
    if long_context:
        table += "\n| new tokens | live tokens | slots | forward (ms, median) | steps at that length |\n"
        table += "|---|---:|---:|---:|---:|\n" + "".join(
            f"| {r['tokens']}{' (tree)' if r['tree'] else ''} | {r['live']} | {r['slots']} | {r['ms']:.1f} | "
            f"{r['target_steps']:.2f} |\n"
            for r in long_context
        )
    if engine_rows:
        table += (
            "\n| mode, refilling slots | static batches (tok/s) | refilling (tok/s) | ratio | slot-rounds finished, "
            "static | refilling |\n|---|---:|---:|---:|---:|---:|\n"
        )
        table += "".join(
            f"| {r['mode']} | {r['static_tokens_per_s']:.1f} | {r['refill_tokens_per_s']:.1f} | "
            f"{r['refill_vs_static']:.2f}x | {r['idle_share_static']:.0%} | {r['idle_share_refill']:.0%} |\n"
            for r in engine_rows
        )
    table += f"\nAttention: {config['attention_path']} (--attention {args.attention}).\n\n{compilation_summary()}\n"
    report = {"config": config, "modes": rows, "compilations": compilations()}
    report |= {"forward_costs": sweep} if sweep else {}
    report |= {"context_costs": long_context} if long_context else {}
    report |= {"engine": engine_rows} if engine_rows else {}
    cli.write_results(json_path, json.dumps(report, indent=1))
    write_file(args.out_dir / "bench.md", table)
    title = (
        f"{args.model}, {used} {prompt_set} prompts, batch {batch_size}, {args.max_new_tokens} new tokens, "
        f"T={args.temperature}"
    )
    write_file(plot_path, lambda tmp: plot(rows, tmp, title))
    print(table)
    print(f"wrote {json_path}, {args.out_dir / 'bench.md'}, {plot_path}", file=sys.stderr)


def entry(argv: Sequence[str] | None = None) -> None:
    cli.prefer_onednn_dots()
    cli.run(main, "specjax-bench", argv)


if __name__ == "__main__":
    entry()
