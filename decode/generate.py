"""specjax-generate: decode prompts with a Llama-family model and print (or save as JSON) the results."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from decode import cli
from specjax.generate import generate
from specjax.io.models import load_model

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="specjax-generate", description=__doc__)
    cli.add_model_args(p)
    cli.add_sampling_args(p)
    p.add_argument("--json", dest="json_out", help="write the results to this JSON file")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sampling = cli.sampling_from_args(args)
    cli.check_positive("--max-new-tokens", args.max_new_tokens)
    cli.check_positive("--batch-size", args.batch_size)
    prompts = cli.gather_prompts(args, default=[DEFAULT_PROMPT])
    model = load_model(args.model)
    tok = model.tokenizer
    prompt_ids = cli.encode_prompts(tok, prompts, args.raw)
    eos = tuple(sorted(set(model.cfg.eos_token_ids) | set(tok.eos_token_ids)))
    batch_size = args.batch_size or min(len(prompts), 8)

    results = []
    for start, group in zip(range(0, len(prompts), batch_size), cli.batches(prompt_ids, batch_size)):
        out = generate(
            model.weights,
            model.cfg,
            group,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=args.seed + start,
            eos_ids=eos,
            batch_size=batch_size,
        )
        if out.compile_seconds:
            print(f"[compiled in {out.compile_seconds:.1f} s]", file=sys.stderr)
        for i, c in enumerate(out.completions):
            n = len(c.output_ids)
            results.append(
                {
                    "prompt": prompts[start + i],
                    "prompt_ids": c.prompt_ids,
                    "output_ids": c.output_ids,
                    "text": tok.decode(c.output_ids),
                    "finish_reason": c.finish_reason,
                    # `seconds` is the wall time of the batch this prompt ran in.
                    "stats": {"new_tokens": n, "seconds": out.seconds, "tokens_per_s": n / out.seconds},
                }
            )
        if not args.json_out:
            for r in results[start:]:
                s = r["stats"]
                print(f"\n>>> {r['prompt']}\n{r['text']}")
                print(
                    f"[{s['new_tokens']} tokens, {r['finish_reason']}; batch of {len(group)}: "
                    f"{sum(len(c.output_ids) for c in out.completions) / out.seconds:.1f} tok/s]"
                )
    if args.json_out:
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
        }
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"config": config, "results": results}, f, indent=1, ensure_ascii=False)
        print(f"wrote {len(results)} results to {args.json_out}", file=sys.stderr)


def entry(argv: Sequence[str] | None = None) -> None:
    cli.run(main, "specjax-generate", argv)


if __name__ == "__main__":
    entry()
