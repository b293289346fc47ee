"""specjax-generate: decode prompts with a Llama-family model and print (or save as JSON) the results."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence

import jax
from tqdm import tqdm

from specjax.adaptive import Adaptive
from specjax.cli import common as cli
from specjax.decoding import speculative
from specjax.decoding.autoregressive import generate
from specjax.decoding.batch import compilation_summary, compilations
from specjax.decoding.engine import Engine
from specjax.decoding.stats import acceptance
from specjax.drafters import LOOKUP_TOKENS_HELP, spec_help, tree_specs
from specjax.errors import InputError
from specjax.host import device_memory, status
from specjax.models.attention import attention_path
from specjax.models.llama import chunk_size
from specjax.prepare import DecodeConfig, decoding_memory_plan, menu_costs, prepare_decoding

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="specjax-generate", description=__doc__)
    cli.add_model_args(p)
    cli.add_sampling_args(p)
    p.add_argument("--drafter", default="none", help=f"speculative drafter: {spec_help()}")
    p.add_argument(
        "--num-draft-tokens",
        type=cli.draft_tokens,
        default="auto",
        help="K, draft tokens per round (with --drafter); 'auto' (the default): every round picks its draft size, "
        "plain decoding included, from this machine's measured costs and the acceptance so far",
    )
    p.add_argument(
        "--lookup-tokens",
        type=cli.integer,
        default=None,
        help=LOOKUP_TOKENS_HELP,
    )
    p.add_argument(
        "--compare-ar",
        action="store_true",
        help="also decode the same prompts autoregressively and report the speedup (with --drafter)",
    )
    p.add_argument(
        "--tree",
        default=None,
        metavar="DEPTH,TOPK,BUDGET",
        help=f"with --drafter {tree_specs()}: draft a dynamic tree (BUDGET nodes including the root) instead of a "
        "chain",
    )
    p.add_argument(
        "--num-samples",
        type=cli.integer,
        default=1,
        help="N samples of each prompt, decoded in one batch whose N rows share the prompt's prefill",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="print the tokens of one prompt as the rounds accept them (through the engine: specjax.decoding.engine)",
    )
    p.add_argument("--json", dest="json_out", help="write the results to this JSON file")
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the run's memory plan (weights, KV cache, drafter, activations) and the device's memory, then exit",
    )
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sampling = cli.sampling_from_args(args)
    cli.check_positive("--max-new-tokens", args.max_new_tokens)
    cli.check_positive("--batch-size", args.batch_size)
    cli.check_positive("--num-samples", args.num_samples)
    cli.check_positive("--prefill-chunk", args.prefill_chunk)
    json_out = cli.check_output_file(args.json_out) if args.json_out else None
    requests = cli.gather_requests(args, default=[DEFAULT_PROMPT])
    if args.stream and (len(requests) > 1 or args.num_samples > 1 or args.compare_ar or json_out or args.plan):
        raise InputError(
            "--stream prints one prompt as it is decoded: give one prompt, without --num-samples, "
            "--compare-ar, --json or --plan"
        )
    prompts, limits = [p for p, _ in requests], [n for _, n in requests]
    samples = args.num_samples
    rows = args.batch_size or (min(samples, 64) if samples > 1 else 8)
    per_call = max(1, min(rows // samples, len(prompts)))  # prompts per batch (more would decode padding rows)
    batch_size = per_call * samples
    decode_config = DecodeConfig(
        drafter=args.drafter,
        num_draft_tokens=args.num_draft_tokens,
        lookup_tokens=args.lookup_tokens,
        tree=args.tree,
        sampling=sampling,
        rows=batch_size,
        max_new_tokens=max(limits),
        prefill_chunk=args.prefill_chunk,
    )
    model = cli.load_target(args)
    prompt_ids = cli.encode_prompts(model.tokenizer, prompts, args.raw)
    decode_config = dataclasses.replace(decode_config, prompt_len=max(map(len, prompt_ids)))
    if args.plan:  # at the batch asked for, even where these prompts would fill fewer rows
        plan = decoding_memory_plan(model, dataclasses.replace(decode_config, rows=args.batch_size or batch_size))
        print(plan.table(device_memory()), end="")
        return
    decoding = prepare_decoding(model, decode_config)
    drafter, verified = decoding.drafter, decoding.policy
    speaks = jax.process_index() == 0  # on a multi-host run, process 0 prints and writes
    if args.stream:
        stream(model, drafter, verified, prompts[0], prompt_ids[0], limits[0], sampling, args)
        return

    if samples == 1 and len(prompts) > 1:  # a stream of requests through slots that refill
        results = through_engine(model, drafter, verified, prompts, prompt_ids, limits, sampling, batch_size, args)
    else:
        results, verified = in_batches(model, drafter, verified, prompts, prompt_ids, limits, sampling, per_call, args)
    if isinstance(verified, Adaptive):
        status(f"adaptive drafting, cost of a round after the timed calls: {menu_costs(verified)}")
    status(compilation_summary())
    if json_out and speaks:
        config = {
            "model": args.model,
            "source": model.source,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "seed": args.seed,
            "batch_size": batch_size,
            "raw": args.raw,
            "drafter": args.drafter,
            "num_draft_tokens": args.num_draft_tokens if drafter is not None and args.tree is None else None,
            "draft_sizes": list(verified.menu) if isinstance(verified, Adaptive) else None,
            "lookup_tokens": args.lookup_tokens,
            "tree": args.tree,
            "num_samples": args.num_samples,
            "prefill_chunk": chunk_size(args.prefill_chunk),
            "attention": args.attention,
            "attention_path": attention_path(args.attention),
        }
        report = {"config": config, "compilations": compilations(), "results": results}
        cli.write_results(json_out, json.dumps(report, indent=1, ensure_ascii=False))
        print(f"wrote {len(results)} results to {json_out}", file=sys.stderr)


def in_batches(model, drafter, verified, prompts, prompt_ids, limits, sampling, per_call, args):
    """Static batches of `per_call` prompts (each of `args.num_samples` rows), one after another; prints each batch's
    results unless --json. Returns (results, the adaptive menu as the batches left it)."""
    tok, eos, samples = model.tokenizer, model.eos_ids, args.num_samples
    results = []
    for start in range(0, len(prompts), per_call):
        group = prompt_ids[start : start + per_call]
        kw = dict(
            max_new_tokens=limits[start : start + per_call],
            sampling=sampling,
            seed=args.seed + start,
            eos_ids=eos,
            batch_size=per_call,
            num_samples=samples,
            prefill_chunk=args.prefill_chunk,
        )
        if drafter is None:
            out = generate(model.weights, model.cfg, group, **kw)
            spec_stats = {}
        else:
            out = speculative.speculative_generate(
                model.weights,
                model.cfg,
                group,
                drafter=drafter,
                num_draft_tokens=verified,
                **kw,
            )
            if isinstance(verified, Adaptive):  # later batches start from what this one accepted
                verified = verified.learn(out.stats)
            # Acceptance statistics are per batch: every result of a batch carries its batch's figures.
            spec_stats = {
                "mean_accepted": out.stats.mean_accepted,
                "rounds": out.stats.rounds,
                "acceptance_by_position": out.stats.acceptance_by_position,
                "rounds_by_drafts": out.stats.rounds_by_drafts,
            }
            if args.compare_ar:
                ar = generate(model.weights, model.cfg, group, **kw)
                spec_stats["ar_tokens_per_s"] = ar.new_tokens / ar.seconds
                spec_stats["speedup_vs_ar"] = (out.new_tokens / out.seconds) / spec_stats["ar_tokens_per_s"]
                if sampling.greedy:
                    same = [c.output_ids for c in ar.completions] == [c.output_ids for c in out.completions]
                    spec_stats["identical_to_ar"] = same
        first = len(results)
        for i, c in enumerate(out.completions):
            n = len(c.output_ids)
            results.append(
                {
                    "prompt": prompts[start + i // samples],
                    "prompt_ids": c.prompt_ids,
                    "output_ids": c.output_ids,
                    "text": tok.decode(c.output_ids),
                    "finish_reason": c.finish_reason,
                    # `seconds` is the wall time of the batch this prompt ran in.
                    "stats": {"new_tokens": n, "seconds": out.seconds, "tokens_per_s": n / out.seconds, **spec_stats},
                }
            )
        if jax.process_index() == 0 and not args.json_out:
            for r in results[first:]:
                s = r["stats"]
                print(f"\n>>> {r['prompt']}\n{r['text']}")
                accepted = f", mean accepted length {s['mean_accepted']:.2f}" if "mean_accepted" in s else ""
                if len(s.get("rounds_by_drafts", ())) > 1:
                    accepted += f", rounds by draft size {s['rounds_by_drafts']}"
                print(
                    f"[{s['new_tokens']} tokens, {r['finish_reason']}; batch of {len(out.completions)}: "
                    f"{out.new_tokens / out.seconds:.1f} tok/s{accepted}]"
                )
                if "speedup_vs_ar" in s:
                    print_comparison(s, "same prompt and run")
    return results, verified


def through_engine(model, drafter, verified, prompts, prompt_ids, limits, sampling, slots: int, args) -> list[dict]:
    """The prompts through `slots` slots that refill as rows finish (specjax.decoding.engine), under a progress bar;
    with --compare-ar, again through a plain engine. Prints the results unless --json."""
    speaks = jax.process_index() == 0

    def decode(drafter, desc):
        engine = Engine(
            model.weights,
            model.cfg,
            drafter=drafter,
            num_draft_tokens=verified,
            slots=slots,
            max_context=max(len(p) + n for p, n in zip(prompt_ids, limits)),
            sampled=not sampling.greedy,
            eos_ids=model.eos_ids,
            prefill_chunk=args.prefill_chunk,
            seed=args.seed,
        )
        ids = [engine.submit(p, n, sampling) for p, n in zip(prompt_ids, limits)]
        done, t0, compiling = {}, time.perf_counter(), engine.compile_seconds

        def elapsed():  # compilation left out
            return time.perf_counter() - t0 - (engine.compile_seconds - compiling)

        with tqdm(total=len(ids), desc=desc, unit="prompt", file=sys.stderr, disable=not speaks) as bar:
            for event in engine.events():
                if event.completion is not None:
                    done[event.request] = event.completion, elapsed()
                    bar.update()
        seconds = elapsed()
        return [done[i] for i in ids], sum(len(c.output_ids) for c, _ in done.values()) / seconds, engine

    out, tokens_per_s, engine = decode(drafter, "decode")
    run_stats = {"slots": slots, "tokens_per_s": tokens_per_s, "idle_slot_share": engine.idle_share()}
    if drafter is not None:
        run_stats["mean_accepted"], run_stats["acceptance_by_position"] = acceptance(engine.state.accepted_hist)
        run_stats["rounds"] = int(engine.state.rounds)
        if args.compare_ar:
            ar, run_stats["ar_tokens_per_s"], _ = decode(None, "autoregressive")
            run_stats["speedup_vs_ar"] = tokens_per_s / run_stats["ar_tokens_per_s"]
            if sampling.greedy:
                run_stats["identical_to_ar"] = [c.output_ids for c, _ in ar] == [c.output_ids for c, _ in out]
    results = [
        {
            "prompt": prompt,
            "prompt_ids": c.prompt_ids,
            "output_ids": c.output_ids,
            "text": model.tokenizer.decode(c.output_ids),
            "finish_reason": c.finish_reason,
            # `seconds`: from the start of the run to this prompt's last token; the rest is the run's.
            "stats": {
                "new_tokens": len(c.output_ids),
                "seconds": t,
                "tokens_per_s": len(c.output_ids) / t,
                **run_stats,
            },
        }
        for prompt, (c, t) in zip(prompts, out)
    ]
    if speaks and not args.json_out:
        for r in results:
            print(f"\n>>> {r['prompt']}\n{r['text']}\n[{r['stats']['new_tokens']} tokens, {r['finish_reason']}]")
        accepted = f", mean accepted length {run_stats['mean_accepted']:.2f}" if drafter is not None else ""
        print(
            f"[{len(results)} prompts through {slots} slots that refill: {tokens_per_s:.1f} tok/s{accepted}; slots "
            f"idle {run_stats['idle_slot_share']:.0%} of the time]"
        )
        if "speedup_vs_ar" in run_stats:
            print_comparison(run_stats, "same prompts and slots")
    return results


def print_comparison(stats: dict, how: str) -> None:
    """The --compare-ar line: plain decoding's tokens/s, the speedup, and whether the outputs matched."""
    same = {True: ", identical output", False: ", different output", None: ""}
    print(
        f"[autoregressive, {how}: {stats['ar_tokens_per_s']:.1f} tok/s; speedup "
        f"{stats['speedup_vs_ar']:.2f}x{same[stats.get('identical_to_ar')]}]"
    )


def stream(model, drafter, num_draft_tokens, prompt: str, ids: list[int], limit: int, sampling, args) -> None:
    """Decodes one prompt through a one-slot engine, a round at a time, printing its text as it grows."""
    engine = Engine(
        model.weights,
        model.cfg,
        drafter=drafter,
        num_draft_tokens=num_draft_tokens,
        slots=1,
        max_context=len(ids) + limit,
        sampled=not sampling.greedy,
        eos_ids=model.eos_ids,
        prefill_chunk=args.prefill_chunk,
        seed=args.seed,
    )
    engine.submit(ids, limit, sampling)
    print(f"\n>>> {prompt}")
    out, shown, completion = [], "", None
    for event in engine.events(max_rounds=1):
        out += event.new_ids
        text = model.tokenizer.decode(out)
        if not text.endswith("\ufffd"):  # not in the middle of a character's bytes
            print(text[len(shown) :], end="", flush=True)
            shown = text
        completion = event.completion or completion
    print(model.tokenizer.decode(out)[len(shown) :])
    mean_accepted, _ = acceptance(engine.state.accepted_hist)
    accepted = f", mean accepted length {mean_accepted:.2f}" if drafter is not None else ""
    print(f"[{len(out)} tokens, {completion.finish_reason}{accepted}]")


def entry(argv: Sequence[str] | None = None) -> None:
    cli.prefer_onednn_dots()
    cli.run(main, "specjax-generate", argv)


if __name__ == "__main__":
    entry()
