"""specjax-train: train a draft for a target model (an EAGLE-3 head, or a DFlash draft) from a YAML config.

  specjax-train --config configs/smollm2-eagle3.yaml
                [--stages synthesize,regenerate,vocab,features,train,evaluate,export] [section.key=value ...]

Every stage resumes where an interrupted run stopped; everything is written under output_dir.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from specjax.cli import common as cli
from specjax.train.config import load_config
from specjax.train.run import STAGES, run


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="specjax-train", description=__doc__, formatter_class=cli.RawDescription)
    p.add_argument("--config", type=Path, required=True, help="YAML training config")
    p.add_argument("--stages", default="all", help=f"comma-separated from {', '.join(STAGES)}, or all")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (the value is YAML)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_intermixed_args(argv)  # overrides may come before and after --stages
    cfg = load_config(args.config, args.overrides)
    stages = ["all"] if args.stages == "all" else [s.strip() for s in args.stages.split(",") if s.strip()]
    run(cfg, stages)
    print(f"done: {args.stages} -> {cfg.output_dir}", file=sys.stderr)


def entry(argv: Sequence[str] | None = None) -> None:
    cli.run(main, "specjax-train", argv)


if __name__ == "__main__":
    entry()
