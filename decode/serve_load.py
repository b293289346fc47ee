"""A short load test of specjax-serve's app: the server started in this process on 127.0.0.1, then chat requests
from the chat prompt set at 1, 4 and 16 concurrent clients (the official `openai` client), with plain decoding and
with a drafter. Bounded: `--requests` per level (at least the level's clients), and a level stops taking new requests
after `--seconds`. Prints a Markdown table of requests/s, p50 and p99 latency and output tokens/s, and writes JSON.

Usage: python decode/serve_load.py [--model smollm2-135m] [--drafter ngram+eagle3:smollm2-135m] [--slots 8]
                                   [--max-tokens 32] [--requests 16] [--seconds 120] [--out serve_load.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specjax.decoding.engine import Engine  # noqa: E402
from specjax.drafters import drafter_from_spec  # noqa: E402
from specjax.evalsets import chat_prompts  # noqa: E402
from specjax.host import machine  # noqa: E402
from specjax.io.loading import load_model  # noqa: E402
from specjax.serving import build_app, running_in_thread  # noqa: E402

LEVELS = (1, 4, 16)


def level(base: str, clients: int, prompts: list[str], max_tokens: int, requests: int, seconds: float) -> dict:
    api = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    deadline = time.perf_counter() + seconds
    latencies, tokens = [], []

    def one(i: int) -> None:
        if time.perf_counter() > deadline:
            return
        t0 = time.perf_counter()
        reply = api.chat.completions.create(
            model="served",
            messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
            max_tokens=max_tokens,
            temperature=0,
        )
        latencies.append(time.perf_counter() - t0)
        tokens.append(reply.usage.completion_tokens)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(max(requests, clients))))
    wall = time.perf_counter() - t0
    return {
        "clients": clients,
        "requests": len(latencies),
        "seconds": wall,
        "requests_per_s": len(latencies) / wall,
        "p50_s": statistics.median(latencies),
        "p99_s": float(np.percentile(latencies, 99)),
        "tokens_per_s": sum(tokens) / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="ngram+eagle3:smollm2-135m")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--out", type=Path, default=Path("serve_load.json"))
    args = p.parse_args()
    model = load_model(args.model)
    prompts = chat_prompts()
    rows = []
    for spec in ("none", args.drafter):
        drafter = drafter_from_spec(spec, model.weights, model.cfg)
        engine = Engine(
            model.weights,
            model.cfg,
            drafter=drafter,
            num_draft_tokens=args.num_draft_tokens,
            slots=args.slots,
            max_context=1024,
            sampled=True,
            eos_ids=model.eos_ids,
        )
        with running_in_thread(build_app(engine, model.tokenizer, "served", args.max_tokens)) as base:
            level(f"{base}/v1", args.slots, prompts, 2, args.slots, args.seconds)  # compiles every program
            for clients in LEVELS:
                row = level(f"{base}/v1", clients, prompts, args.max_tokens, args.requests, args.seconds)
                rows.append({"drafter": spec, **row})
                print(rows[-1], file=sys.stderr)
    args.out.write_text(
        json.dumps({"machine": machine(), "slots": args.slots, "max_tokens": args.max_tokens, "rows": rows}, indent=1)
    )
    print("| drafter | clients | requests | requests/s | p50 (s) | p99 (s) | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['drafter']} | {r['clients']} | {r['requests']} | {r['requests_per_s']:.2f} | {r['p50_s']:.2f} | "
            f"{r['p99_s']:.2f} | {r['tokens_per_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
