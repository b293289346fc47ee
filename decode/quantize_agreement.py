"""How much `--quantize int8` changes a model's greedy output, and the bytes it saves.

Decodes the same chat prompts (one per category of `specjax/evalsets/chat.jsonl` for 8) greedily with the float and
the int8 weights, in the same dtype, and reports:
- the generated tokens identical up to each prompt's first divergence, and position by position overall (a position
  one output lacks counts as different), over the longer output of each prompt;
- top-1 agreement on the float text: where the int8 model's next token equals the float model's, both fed the float
  output (the same context everywhere, so one divergence does not compound);
- the bytes of the weights summed over their arrays: float and int8 (values, scales, the rest) in bfloat16 and in
  the run's dtype.

Usage: python decode/quantize_agreement.py [--model smollm2-135m] [--num-prompts 8] [--max-new-tokens 64]
       [--dtype float32] [--json OUT]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specjax.cli import common as cli  # noqa: E402
from specjax.decoding.autoregressive import generate  # noqa: E402
from specjax.evalsets import chat_prompts  # noqa: E402
from specjax.io.loading import load_model  # noqa: E402
from specjax.models.kv_cache import KVCache  # noqa: E402
from specjax.models.llama import forward  # noqa: E402


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="quantize_agreement.py", description=__doc__, formatter_class=cli.RawDescription)
    p.add_argument("--model", default="smollm2-135m", help="as specjax-generate's --model")
    p.add_argument("--num-prompts", type=cli.integer, default=8, help="chat prompts, spread over the categories (8)")
    p.add_argument("--max-new-tokens", type=cli.integer, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the decoding (float32)")
    p.add_argument("--json", dest="json_out", help="write the figures and every output to this JSON file")
    return p


def nbytes(weights) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(weights))


def next_token_agreement(float_weights, int8_weights, cfg, rows: list[list[int]], prompt_lens: list[int]) -> float:
    """The fraction of generated positions where both models' argmax agree, fed the same (float) text."""
    L = max(map(len, rows))
    tokens = jnp.array([r + [0] * (L - len(r)) for r in rows], jnp.int32)  # right padding: causal, never attended
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), tokens.shape)

    @jax.jit
    def argmax(weights):
        cache = KVCache.empty(cfg, len(rows), L, weights.final_norm.dtype)
        return jnp.argmax(forward(weights, cfg, tokens, positions, cache)[0], axis=-1)

    a, b = np.asarray(argmax(float_weights)), np.asarray(argmax(int8_weights))
    # Position j predicts token j + 1: the generated tokens are predicted from the prompt's last position on.
    same = [a[i, p - 1 : len(r) - 1] == b[i, p - 1 : len(r) - 1] for i, (r, p) in enumerate(zip(rows, prompt_lens))]
    return float(np.concatenate(same).mean())


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    cli.check_positive("--num-prompts", args.num_prompts)
    cli.check_positive("--max-new-tokens", args.max_new_tokens)
    json_out = cli.check_output_file(args.json_out) if args.json_out else None
    dtype = jnp.dtype(args.dtype)
    everything = chat_prompts()
    prompts = everything[:: max(1, len(everything) // args.num_prompts)][: args.num_prompts]
    models = {q: load_model(args.model, dtype, quantize=q) for q in ("none", "int8")}
    tok = models["none"].tokenizer
    ids = [tok.chat_prompt_ids(p) for p in prompts]
    outputs = {}
    for q, model in models.items():
        out = generate(model.weights, model.cfg, ids, max_new_tokens=args.max_new_tokens, eos_ids=model.eos_ids)
        outputs[q] = [c.output_ids for c in out.completions]
    prefix = same = total = 0
    for a, b in zip(outputs["none"], outputs["int8"]):
        n = min(len(a), len(b))
        prefix += next((j for j in range(n) if a[j] != b[j]), n)
        same += sum(x == y for x, y in zip(a, b))
        total += max(len(a), len(b))
    float_rows = [p + o for p, o in zip(ids, outputs["none"])]
    top1 = next_token_agreement(
        models["none"].weights, models["int8"].weights, models["none"].cfg, float_rows, list(map(len, ids))
    )
    weight_bytes = {f"{args.dtype} {q}": nbytes(m.weights) for q, m in models.items()}
    if args.dtype != "bfloat16":
        weight_bytes |= {
            f"bfloat16 {q}": nbytes(load_model(args.model, jnp.bfloat16, quantize=q).weights) for q in ("none", "int8")
        }
    figures = {
        "model": args.model,
        "dtype": args.dtype,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "generated_tokens": total,
        "identical_to_first_divergence": prefix / total,
        "identical_position_by_position": same / total,
        "identical_outputs": sum(a == b for a, b in zip(outputs["none"], outputs["int8"])),
        "top1_agreement_on_float_text": top1,
        "weight_bytes": weight_bytes,
    }
    for name, value in figures.items():
        print(f"{name}: {value:.4f}" if isinstance(value, float) else f"{name}: {value}")
    print(f"int8 / bfloat16 bytes: {weight_bytes['bfloat16 int8'] / weight_bytes['bfloat16 none']:.3f}")
    if json_out:
        texts = {q: [tok.decode(o) for o in out] for q, out in outputs.items()}
        cli.write_results(json_out, json.dumps({**figures, "prompts": prompts, "outputs": texts}, indent=1))


if __name__ == "__main__":
    cli.run(main, "quantize_agreement.py")
