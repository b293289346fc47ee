"""The data-scaling curve: one head per nested subset of a config's data, the same steps per token, and held-out mean
accepted length against training tokens.

  python -m train.scaling --config configs/smollm2-eagle3.yaml --prompts 256,512,1024,2048 --epochs 6 \\
      --out docs/bench/scaling [section.key=value ...]

Each size N runs the config's stages from regenerate to evaluate into OUTPUT_DIR-scaling-N with data.num_prompts=N
and training.epochs=E; the config's own size runs in OUTPUT_DIR itself, so the head the config trains is the curve's
last point. Units of the store are shared, so sizes that are multiples of 256 generate nothing that the
full run has. Writes OUT.json and OUT.png (one line per evaluation set and drafting mode).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from decode import cli
from train.config import load_config
from train.run import run

STAGES = ["regenerate", "vocab", "features", "train", "evaluate"]


def plot(points: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for set_name in points[0]["sets"]:
        for mode, style in (("tree", "-o"), ("chain", "--s")):
            ys = [p["sets"][set_name][mode]["mean_accepted"] for p in points]
            ax.plot([p["assistant_tokens"] for p in points], ys, style, label=f"{set_name}, {mode}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training tokens (assistant, all responses)")
    ax.set_ylabel("mean accepted length (held out)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.ArgumentParser(prog="python -m train.scaling", description=__doc__, formatter_class=cli.RawDescription)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--prompts", type=cli.positive_ints, required=True, help="training prompt counts, e.g. 256,512")
    p.add_argument("--epochs", type=float, required=True, help="epochs of every run (the same steps per token)")
    p.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.png are written")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    args = p.parse_args(argv)
    points = []
    for n in sorted(args.prompts):
        base = load_config(args.config, args.overrides)
        output_dir = base.output_dir if n == base.data.num_prompts else f"{base.output_dir}-scaling-{n}"
        cfg = load_config(
            args.config,
            [*args.overrides, f"output_dir={output_dir}", f"data.num_prompts={n}", f"training.epochs={args.epochs}"],
        )
        print(f"== scaling: {n} prompts -> {cfg.output_dir}", file=sys.stderr)
        run(cfg, STAGES)
        manifest = json.loads((cfg.output_path / "data" / "manifest.json").read_text())
        evaluation = json.loads((cfg.output_path / "eval.json").read_text())
        points.append({"prompts": n, "samples": manifest["samples"], "assistant_tokens": manifest["assistant_tokens"],
                       "steps": evaluation["step"], "sets": evaluation["sets"]})  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"epochs": args.epochs, "points": points}, indent=1))
    plot(points, args.out.with_suffix(".png"), f"{args.config.name}: {args.epochs} epochs per run")
    for point in points:
        summary = ", ".join(f"{s} {m} {r[m]['mean_accepted']:.2f}" for s, r in point["sets"].items()
                            for m in ("chain", "tree"))  # fmt: skip
        print(f"{point['assistant_tokens']:>9} tokens ({point['prompts']} prompts): {summary}")


if __name__ == "__main__":
    cli.run(main, "python -m train.scaling")
