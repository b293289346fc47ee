"""The data-scaling curve: one head per nested subset of a config's training rows, the same steps per token, and
held-out mean accepted length against training tokens.

  python train/scaling.py --config configs/smollm2-eagle3.yaml --fractions 0.125,0.25,0.5,1 --epochs 1.2 \\
      --out docs/bench/scaling [section.key=value ...]

The whole data set runs first, in the config's OUTPUT_DIR (so the head the config trains is the curve's last point),
from synthesize to evaluate; each fraction F < 1 then trains and evaluates in OUTPUT_DIR-scaling-F on the seeded
subset `training.data_fraction=F` of the same packed rows, reading the full run's stored features. Every run takes
training.epochs=E. The draft vocabulary is the full data's in every run. Writes OUT.json and OUT.png (one line per
evaluation set and drafting mode).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from specjax.cli import common as cli
from specjax.host import write_file
from specjax.train.config import load_config
from specjax.train.run import run

FULL_STAGES = ["synthesize", "regenerate", "vocab", "features", "train", "evaluate"]
SUBSET_STAGES = ["synthesize", "regenerate", "vocab", "train", "evaluate"]


def fractions(text: str) -> list[float]:
    """An argparse type: comma-separated fractions in (0, 1], which must include 1 (the whole data set)."""
    try:
        values = sorted({float(x) for x in text.split(",")}, reverse=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if values[0] != 1 or values[-1] <= 0:
        raise argparse.ArgumentTypeError(f"expected fractions in (0, 1] including 1, got {text!r}")
    return values


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
    p = cli.ArgumentParser(prog="python train/scaling.py", description=__doc__, formatter_class=cli.RawDescription)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--fractions", type=fractions, required=True, help="fractions of the training rows, e.g. 0.25,1")
    p.add_argument("--epochs", type=float, required=True, help="epochs of every run (the same steps per token)")
    p.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.png are written")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    args = p.parse_args(argv)
    base = load_config(args.config, [*args.overrides, f"training.epochs={args.epochs}"])
    features = base.training.features_dir or str(base.output_path / "features")
    points = []
    for f in args.fractions:
        subset = [] if f == 1 else [f"output_dir={base.output_dir}-scaling-{f:g}", f"training.features_dir={features}"]
        cfg = load_config(
            args.config, [*args.overrides, f"training.epochs={args.epochs}", f"training.data_fraction={f}", *subset]
        )
        print(f"== scaling: fraction {f:g} -> {cfg.output_dir}", file=sys.stderr)
        run(cfg, FULL_STAGES if f == 1 else SUBSET_STAGES)
        trained = json.loads((cfg.output_path / "training_rows.json").read_text())
        evaluation = json.loads((cfg.output_path / "eval.json").read_text())
        points.append({**trained, "steps": evaluation["step"], "sets": evaluation["sets"]})
    points.reverse()
    cli.write_results(args.out.with_suffix(".json"), json.dumps({"epochs": args.epochs, "points": points}, indent=1))
    title = f"{args.config.name}: {args.epochs} epochs per run"
    write_file(args.out.with_suffix(".png"), lambda tmp: plot(points, tmp, title))
    for point in points:
        summary = ", ".join(
            f"{s} {m} {r[m]['mean_accepted']:.2f}" for s, r in point["sets"].items() for m in ("chain", "tree")
        )
        print(f"{point['assistant_tokens']:>9} tokens ({point['samples']} samples): {summary}")


if __name__ == "__main__":
    cli.run(main, "python train/scaling.py")
