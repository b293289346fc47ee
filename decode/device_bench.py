"""A randomly initialised Llama-3-8B-shaped target on this device, or split over a mesh of the devices present
(`--mesh auto`): memory plan, one-step latency, what verifying T tokens per row costs (T = K + 1 = 2..16 for chains,
tree budgets up to 64), and autoregressive tokens/s against the memory-bandwidth roofline (each device reading its
share of the weights and of the KV cache); which attention path read the cache (`--attention`) and one step's time
with each path (the Pallas kernel's where it applies: on TPU). Writes llama3-8b.json and llama3-8b.md to --out-dir.

Random weights decode at the speed of real ones: every step reads every weight and the KV written so far, whatever
their values. `--tiny` shrinks the target (2 layers, hidden 256) so that the whole script runs on a CPU.

Usage: python decode/device_bench.py --out-dir OUT [--tiny] [--mesh auto] [--batches 1,8] [--context 512]
       [--max-new-tokens 128] [--attention auto]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specjax.cli import common as cli  # noqa: E402
from specjax.config import ATTENTION_CHOICES, ModelConfig  # noqa: E402
from specjax.decoding.autoregressive import generate  # noqa: E402
from specjax.errors import InputError  # noqa: E402
from specjax.host import device_memory  # noqa: E402
from specjax.measure.bandwidth import device_bandwidth  # noqa: E402
from specjax.measure.memory import check_fits, memory_plan  # noqa: E402
from specjax.measure.timing import forward_seconds  # noqa: E402
from specjax.models.attention import KERNEL_PLATFORMS, attention_path  # noqa: E402
from specjax.models.llama import init_weights, weight_bytes, weight_shardings  # noqa: E402
from specjax.sharding import CACHE_AXES, mesh_for, parse_mesh, shard_fraction  # noqa: E402

LLAMA3_8B = ModelConfig(
    "llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
TINY = ModelConfig(
    "llama",
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=896,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
# Tokens per row one verification runs: chains of K = 1..15 drafts (T = K + 1), then tree budgets up to 64 nodes.
VERIFY_TOKENS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)


def parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="device_bench.py", description=__doc__, formatter_class=cli.RawDescription)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="2 layers, hidden 256, vocabulary 8192: runs on a CPU")
    p.add_argument("--batches", type=cli.positive_ints, default=[1, 8], help="batch sizes of the decode (1,8)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per row (512)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--mesh", default="none", help="none (one device), auto (every device) or data=D,tensor=T")
    p.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto", help="how the KV cache is read (auto)")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    cli.check_positive("--context", args.context)
    cli.check_positive("--max-new-tokens", args.max_new_tokens)
    out_dir = cli.check_output_dir(args.out_dir)
    cfg = dataclasses.replace(TINY if args.tiny else LLAMA3_8B, attention=args.attention)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16  # as specjax.io.loading.load_model
    choice = None if args.mesh == "none" else "auto" if args.mesh == "auto" else parse_mesh(args.mesh)
    mesh = mesh_for(choice, cfg.num_kv_heads)
    sizes = dict(mesh.shape) if mesh is not None else None
    available = device_memory()
    plans = {
        b: check_fits(
            lambda rows: memory_plan(
                cfg, dtype, batch=rows, prompt_len=args.context, max_new_tokens=args.max_new_tokens, mesh=sizes
            ),
            b,
            available,
        )
        for b in args.batches
    }
    bandwidth, bandwidth_source = device_bandwidth()
    t0 = time.perf_counter()
    # Each device draws its own shards: the whole target never lands on one device.
    init = jax.jit(init_weights, static_argnums=(0, 2), out_shardings=mesh and weight_shardings(cfg, mesh))
    weights = jax.block_until_ready(init(cfg, jax.random.key(0), dtype))
    init_s = time.perf_counter() - t0
    size = weight_bytes(cfg, dtype, sizes)  # on each device
    kv_split = shard_fraction(CACHE_AXES, (cfg.num_layers, 8, 1, cfg.num_kv_heads, cfg.head_dim), sizes or {})
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize / kv_split

    step_s, *verify_s = forward_seconds(weights, cfg, 1, args.context, (1, *VERIFY_TOKENS))
    verification = [{"tokens": t, "ms": 1000 * s, "target_steps": s / step_s} for t, s in zip(VERIFY_TOKENS, verify_s)]
    decoding = []
    rng = np.random.default_rng(0)
    for b in args.batches:
        prompts = rng.integers(0, cfg.vocab_size, (b, args.context)).tolist()
        result = generate(weights, cfg, prompts, max_new_tokens=args.max_new_tokens, eos_ids=())
        tokens_per_s = result.new_tokens / result.seconds
        # Every step reads each device's weights once and, per row, its KV of the context so far (at mid-decode).
        step_bytes = size + b * (args.context + args.max_new_tokens // 2) * kv_per_token
        roofline = b * bandwidth / step_bytes
        decoding.append(
            {
                "batch": b,
                "tokens_per_s": tokens_per_s,
                "compile_s": result.compile_seconds,
                "step_latency_ms": 1000 * forward_seconds(weights, cfg, b, args.context, (1,))[0],
                "roofline_tokens_per_s": roofline,
                "of_roofline": tokens_per_s / roofline,
                "memory_plan_bytes": plans[b].total,
            }
        )

    report = {
        "config": {
            "target": "tiny" if args.tiny else "llama3-8b-shaped (random weights)",
            "model": repr(cfg),
            "dtype": jnp.dtype(dtype).name,
            "device": jax.devices()[0].device_kind,
            "mesh": sizes,
            "context": args.context,
            "max_new_tokens": args.max_new_tokens,
            "weight_bytes": size,
            "bandwidth_bytes_per_s": bandwidth,
            "bandwidth_source": bandwidth_source,
            "device_memory_bytes": available,
            "init_seconds": init_s,
            "date": time.strftime("%Y-%m-%d"),
        },
        "one_step_ms": 1000 * step_s,
        "verification": verification,
        "decoding": decoding,
        "attention": attention_steps(weights, cfg, args.context, step_s),
    }
    (out_dir / "llama3-8b.json").write_text(json.dumps(report, indent=1))
    largest = max(args.batches)
    plan = f"\nMemory plan, batch {largest}:\n\n{plans[largest].table(available)}"
    (out_dir / "llama3-8b.md").write_text(markdown(report) + plan)
    print(markdown(report) + plan)


def attention_steps(weights, cfg: ModelConfig, context: int, step_s: float) -> dict:
    """Which attention path read the cache with `cfg.attention` (after the runs: "auto" has checked the kernel by
    then), and one target step's ms (batch 1) with each path: the one that ran took `step_s`; the other is timed
    here, the Pallas kernel only where it applies (KERNEL_PLATFORMS), else `pallas_note` says why it has no time."""
    ran = attention_path(cfg.attention)
    steps = {"choice": cfg.attention, "ran": ran, "blocks_step_ms": None, "pallas_step_ms": None, "pallas_note": None}
    steps[f"{ran}_step_ms"] = 1000 * step_s
    other = "pallas" if ran == "blocks" else "blocks"
    if other == "pallas" and jax.default_backend() not in KERNEL_PLATFORMS:
        steps["pallas_note"] = f"the Pallas kernel does not apply on {jax.default_backend()} (it is compiled for TPU)"
        return steps
    try:
        steps[f"{other}_step_ms"] = (
            1000 * forward_seconds(weights, dataclasses.replace(cfg, attention=other), 1, context, (1,))[0]
        )
    except InputError as e:  # the kernel failed its check on this device
        steps["pallas_note"] = str(e)
    return steps


def markdown(report: dict) -> str:
    c, a = report["config"], report["attention"]
    times = ", ".join(
        f"{path} {a[f'{path}_step_ms']:.2f} ms" for path in ("blocks", "pallas") if a[f"{path}_step_ms"] is not None
    )
    mesh = f" x {math.prod(c['mesh'].values())} ({c['mesh']})" if c["mesh"] else ""
    lines = [
        f"{c['target']}, {c['dtype']}, on {c['device']}{mesh}: weights {c['weight_bytes'] / 2**30:.2f} GiB a device, "
        f"bandwidth {c['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s ({c['bandwidth_source']}), context {c['context']}.",
        "",
        f"One target step (batch 1): {report['one_step_ms']:.2f} ms.",
        "",
        f"Attention: {a['ran']} ran (--attention {a['choice']}); one step (batch 1) by path: {times}"
        + (f"; pallas: {a['pallas_note']}." if a["pallas_note"] else "."),
        "",
        "| tokens per row | forward (ms) | target steps |",
        "|---:|---:|---:|",
        *(f"| {r['tokens']} | {r['ms']:.2f} | {r['target_steps']:.2f} |" for r in report["verification"]),
        "",
        "| batch | tokens/s | roofline tokens/s | of roofline | step (ms) | compile (s) |",
        "|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['batch']} | {r['tokens_per_s']:.1f} | {r['roofline_tokens_per_s']:.1f} | "
            f"{100 * r['of_roofline']:.1f}% | {r['step_latency_ms']:.2f} | {r['compile_s']:.1f} |"
            for r in report["decoding"]
        ),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    cli.run(main, "device_bench.py")
