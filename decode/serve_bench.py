"""A serving benchmark in the manner of `vllm bench serve`: streamed requests from the `openai` client at each number
of concurrent clients, against a plain-decoding server measured in the same run as the baseline.

Each mode is a server (started here on 127.0.0.1, as specjax-serve makes it: every bucket calibrated and compiled
first), `none` (plain decoding) or `DRAFTER@K` with K a number of draft tokens or `auto` (adaptive drafting, the
default). Every server is started first, then each level runs against each server in turn, `--repeats` times, so the
servers compared at a level are measured minutes apart at most on a machine whose speed drifts; the table gives each
mode's median ratio to the plain server over the repeats. `--url` benchmarks a server that is already running
instead. Per level: requests/s, output tokens/s, and the
p50/p90/p99 of time to first token (TTFT), time per output token after it (TPOT), inter-token latency (ITL: between two
streamed chunks, each chunk's tokens sharing its gap) and end-to-end latency; mean accepted length and acceptance by
position from the server's /metrics. With `--one-shot`, each mode's prompts are also decoded one at a time in this
process, as specjax-generate decodes them, for the server's single-client figure to compare with.

Bounded: each level sends `--requests` requests (at least its clients) and takes no new one after `--seconds`. The
JSON is rewritten after every level, so a stopped run keeps what it measured; then a Markdown table and a plot.

Usage: python decode/serve_bench.py [--model smollm2-135m] [--modes none,ngram+eagle3:smollm2-135m@auto]
           [--prompt-set chat|code] [--clients 1,4,16] [--requests 16] [--seconds 300] [--max-tokens 64] [--slots 8]
           [--repeats 1] [--url http://127.0.0.1:8000] [--one-shot] [--out serve_bench.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specjax.config import SamplingConfig  # noqa: E402
from specjax.decoding.autoregressive import generate  # noqa: E402
from specjax.decoding.speculative import speculative_generate  # noqa: E402
from specjax.evalsets import chat_prompts, humaneval_prompts  # noqa: E402
from specjax.host import machine  # noqa: E402
from specjax.io.loading import load_model  # noqa: E402
from specjax.prepare import DecodeConfig, prepare_decoding, serving_engine  # noqa: E402
from specjax.serving import build_app, running_in_thread  # noqa: E402

PROMPT_SETS = {"chat": chat_prompts, "code": humaneval_prompts}
QUANTILES = (50, 90, 99)


def parse_mode(mode: str) -> tuple[str, int | str]:
    """'none', 'DRAFTER' (adaptive) or 'DRAFTER@K' -> (drafter spec, K or 'auto')."""
    spec, _, k = mode.partition("@")
    return spec, ("auto" if k in ("", "auto") else int(k))


def spread(values: list[float]) -> dict:
    return {f"p{q}": float(np.percentile(values, q)) for q in QUANTILES} if values else {}


def scrape(base: str) -> dict[str, float]:
    """The server's /metrics as {name, or name/position for a position's series: value}."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        families = text_string_to_metric_families(response.read().decode())
    return {
        s.name + (f"/{s.labels['position']}" if "position" in s.labels else ""): s.value
        for family in families
        for s in family.samples
    }


def acceptance_between(before: dict, after: dict) -> dict:
    """Mean accepted length (tokens per row-round, the bonus included) and acceptance by position over a level."""
    rounds = after.get("specjax:row_rounds_total", 0) - before.get("specjax:row_rounds_total", 0)
    by_position = []
    while (key := f"specjax:spec_decode_num_accepted_tokens_per_pos_total/{len(by_position)}") in after:
        by_position.append((after[key] - before.get(key, 0)) / rounds if rounds else 0.0)
    return {"mean_accepted": 1 + sum(by_position), "acceptance_by_position": by_position} if rounds else {}


def one_request(api: openai.OpenAI, prompt: str, chat: bool, max_tokens: int) -> dict:
    """A streamed request: when each chunk of text arrived, and the completion's tokens."""
    t0 = time.perf_counter()
    common = dict(model="served", max_tokens=max_tokens, temperature=0, stream=True)
    common["stream_options"] = {"include_usage": True}
    if chat:
        stream = api.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        stream = api.completions.create(prompt=prompt, **common)
    arrivals, tokens = [], 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and ((chunk.choices[0].delta.content if chat else chunk.choices[0].text) or ""):
            arrivals.append(time.perf_counter() - t0)
    return {"arrivals": arrivals, "tokens": tokens, "seconds": time.perf_counter() - t0}


def level(base: str, clients: int, prompts: list[str], chat: bool, args) -> dict:
    """One level of concurrency: its requests' latencies and the server's throughput."""
    api = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    deadline = time.perf_counter() + args.seconds
    done: list[dict] = []

    def one(i: int) -> None:
        if time.perf_counter() < deadline:
            done.append(one_request(api, prompts[i % len(prompts)], chat, args.max_tokens))

    before = scrape(base)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(max(args.requests, clients))))
    wall = time.perf_counter() - t0
    after = scrape(base)
    ttft = [r["arrivals"][0] for r in done if r["arrivals"]]
    tpot = [(r["seconds"] - r["arrivals"][0]) / (r["tokens"] - 1) for r in done if r["arrivals"] and r["tokens"] > 1]
    itl = []
    for r in done:  # a chunk of n tokens: n gaps of 1/n of the wait for it
        per_chunk = r["tokens"] / max(len(r["arrivals"]), 1)
        for a, b in zip(r["arrivals"], r["arrivals"][1:]):
            itl += [(b - a) / per_chunk] * max(round(per_chunk), 1)
    tokens = sum(r["tokens"] for r in done)
    return {
        "clients": clients,
        "requests": len(done),
        "seconds": wall,
        "requests_per_s": len(done) / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_s": spread(ttft),
        "tpot_s": spread(tpot),
        "itl_s": spread(itl),
        "e2e_s": spread([r["seconds"] for r in done]),
        **acceptance_between(before, after),
        "compiled_programs": after.get("specjax:compiled_programs"),
    }


def one_shot(model, mode: tuple[str, int | str], prompts: list[str], chat: bool, args) -> dict:
    """The level's prompts decoded one at a time in this process, as specjax-generate does: output tokens/s."""
    spec, k = mode
    decoding = prepare_decoding(model, DecodeConfig(drafter=spec, num_draft_tokens=k, max_new_tokens=args.max_tokens))
    ids = [model.tokenizer.chat_prompt_ids(p) if chat else model.tokenizer.encode(p) for p in prompts]
    policy, tokens, seconds = decoding.policy, 0, 0.0
    for i in range(-1, max(args.requests, 1)):  # the first (i = -1) compiles, untimed
        prompt = ids[max(i, 0) % len(ids)]
        kw = dict(max_new_tokens=args.max_tokens, eos_ids=model.eos_ids)
        if decoding.drafter is None:
            out = generate(model.weights, model.cfg, [prompt], **kw)
        else:
            out = speculative_generate(
                model.weights, model.cfg, [prompt], drafter=decoding.drafter, num_draft_tokens=policy, **kw
            )
            policy = policy.learn(out.stats) if hasattr(policy, "learn") else policy
        if i >= 0:
            tokens, seconds = tokens + out.new_tokens, seconds + out.seconds
    return {"clients": "one-shot", "requests": max(args.requests, 1), "output_tokens_per_s": tokens / seconds}


@contextlib.contextmanager
def server(model, mode: tuple[str, int | str], args):
    """A server of `mode` on 127.0.0.1, as specjax-serve makes it; yields (base URL, programs compiled at start)."""
    spec, k = mode
    config = DecodeConfig(drafter=spec, num_draft_tokens=k, sampling=SamplingConfig(temperature=1.0), rows=args.slots)
    engine = serving_engine(model, config, args.max_context)
    with running_in_thread(build_app(engine, model.tokenizer, "served", args.max_tokens)) as base:
        yield base, engine.compiled_programs


def plain_by_level(rows: list[dict]) -> dict[tuple, float]:
    """The plain server's output tokens/s per (clients, repeat)."""
    return {(r["clients"], r.get("repeat")): r["output_tokens_per_s"] for r in rows if r["mode"] == "none"}


def ratios(rows: list[dict]) -> dict[tuple[str, int], float]:
    """Each (mode, clients): the median over the repeats of its output tokens/s over the plain server's in the same
    repeat."""
    plain = plain_by_level(rows)
    by_level: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if (r["clients"], r.get("repeat")) in plain and r["mode"] != "none":
            ratio = r["output_tokens_per_s"] / plain[r["clients"], r.get("repeat")]
            by_level.setdefault((r["mode"], r["clients"]), []).append(ratio)
    return {level: float(np.median(values)) for level, values in by_level.items()}


def table(rows: list[dict]) -> str:
    """Markdown: each row's throughput against the plain server's at the same clients and repeat, and its latencies;
    then each mode's median ratio over the repeats."""
    plain = plain_by_level(rows)
    out = [
        "| mode | clients | requests | req/s | output tok/s | vs plain | TTFT p50 | TPOT p50 | ITL p50 | e2e p50 / p99 "
        "| accepted |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        base = plain.get((r["clients"], r.get("repeat")))
        ratio = f"{r['output_tokens_per_s'] / base:.2f}x" if base else "-"
        ms = {k: f"{1000 * r[k]['p50']:.0f} ms" if r.get(k) else "-" for k in ("ttft_s", "tpot_s", "itl_s")}
        e2e = f"{r['e2e_s']['p50']:.2f} / {r['e2e_s']['p99']:.2f} s" if r.get("e2e_s") else "-"
        accepted = f"{r['mean_accepted']:.2f}" if "mean_accepted" in r else "-"
        per_s = f"{r['requests_per_s']:.3f}" if "requests_per_s" in r else "-"
        out.append(
            f"| {r['mode']} | {r['clients']} | {r['requests']} | {per_s} | "
            f"{r['output_tokens_per_s']:.1f} | {ratio} | {ms['ttft_s']} | {ms['tpot_s']} | {ms['itl_s']} | {e2e} | "
            f"{accepted} |"
        )
    medians = ratios(rows)
    if medians:
        out += ["", "| mode | clients | median vs plain |", "|---|---:|---:|"]
        out += [f"| {mode} | {clients} | {ratio:.2f}x |" for (mode, clients), ratio in medians.items()]
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):  # the median over the repeats at each level
        mine = [r for r in rows if r["mode"] == mode and isinstance(r["clients"], int)]
        clients = sorted({r["clients"] for r in mine})
        at = [[r for r in mine if r["clients"] == c] for c in clients]
        a.plot(clients, [np.median([r["output_tokens_per_s"] for r in rs]) for rs in at], marker="o", label=mode)
        tpot = [np.median([r["tpot_s"].get("p50", 0) * 1000 for r in rs]) for rs in at]
        b.plot(clients, tpot, marker="o", label=mode)
    for ax, what in ((a, "output tokens/s"), (b, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(what)
    a.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", default="none,ngram+eagle3:smollm2-135m@auto")
    p.add_argument("--prompt-set", choices=tuple(PROMPT_SETS), default="chat")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=1, help="each level against each server this many times in turn")
    p.add_argument("--url", default=None, help="a running server to benchmark instead (one mode: what it serves)")
    p.add_argument("--one-shot", action="store_true", help="also decode each mode's prompts one at a time here")
    p.add_argument("--out", type=Path, default=Path("serve_bench.json"))
    args = p.parse_args()
    chat = args.prompt_set == "chat"
    prompts = PROMPT_SETS[args.prompt_set]()
    levels = [int(c) for c in args.clients.split(",")]
    model = None if args.url else load_model(args.model)
    modes = ["served"] if args.url else ["none"] + [m for m in args.modes.split(",") if m != "none"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "prompt_set": args.prompt_set, "max_tokens": args.max_tokens, "slots": args.slots}
    rows = report["rows"] = []
    with contextlib.ExitStack() as servers:
        bases = {
            mode: servers.enter_context(server(model, parse_mode(mode), args)) if model else (args.url, None)
            for mode in modes
        }
        for clients in levels:
            for repeat in range(args.repeats):
                for mode, (base, compiled) in bases.items():
                    measured = level(base, clients, prompts, chat, args)
                    rows.append({"mode": mode, "repeat": repeat, **measured, "compiled_at_start": compiled})
                    print(json.dumps(rows[-1]), file=sys.stderr)
                    args.out.write_text(json.dumps(report, indent=1))
    for mode in modes if args.one_shot and model is not None else ():
        rows.append({"mode": mode, **one_shot(model, parse_mode(mode), prompts, chat, args)})
        args.out.write_text(json.dumps(report, indent=1))
    print(table(rows))
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
