"""Several specjax-bench runs side by side: one table row per run and mode, one chart of the speedups.

    python decode/compare.py RUN_DIR [RUN_DIR ...] --out OUT

reads each RUN_DIR/bench.json and writes OUT.md and OUT.png, never inside a RUN_DIR. A run is named by its setting:
prompt set, batch size and temperature (e.g. "humaneval b8 T1").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from specjax.cli import common as cli
from specjax.errors import InputError
from specjax.host import write_file


def setting(config: dict) -> str:
    prompts = config.get("prompt_set", "prompts")  # reports older than --prompt-set do not name theirs
    return f"{prompts} b{config['batch_size']} T{config['temperature']:g}"


def load_runs(folders: Sequence[str]) -> list[tuple[str, list[dict]]]:
    """(setting, mode rows) of each run folder, in the order given."""
    runs = []
    for folder in map(Path, folders):
        path = folder / "bench.json"
        try:
            report = json.loads(path.read_text())
            runs.append((setting(report["config"]), report["modes"]))
        except FileNotFoundError:
            raise InputError(f"{path} does not exist; give folders that specjax-bench wrote (--out-dir)") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path} is not a specjax-bench report ({e!r})") from None
    return runs


def markdown_table(runs: Sequence[tuple[str, list[dict]]]) -> str:
    """Per run and mode: tokens/s, speedup, mean accepted length and the drafter's own time per round."""

    def fmt(x, suffix=""):
        return "–" if x is None else f"{x:.2f}{suffix}"

    lines = [
        "| setting | mode | tokens/s (median) | speedup vs ar | mean accepted | drafter ms / round | identical to ar |",
        "|---|---|---:|---:|---:|---:|:---:|",
    ]
    for name, rows in runs:
        for r in rows:
            same = {None: "–", True: "yes", False: "no"}[r["identical_to_ar"]]
            drafter_ms = (r.get("breakdown") or {}).get("drafter_ms")
            lines.append(
                f"| {name} | {r['mode']} | {r['tokens_per_s']:.1f} | {fmt(r['speedup_vs_ar'], 'x')} | "
                f"{fmt(r['mean_accepted'])} | {fmt(drafter_ms)} | {same} |"
            )
    return "\n".join(lines) + "\n"


def plot(runs: Sequence[tuple[str, list[dict]]], path: Path, title: str) -> None:
    """Grouped bars: one group per run, one bar per speculative mode, its speedup over ar in that run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for _, rows in runs for r in rows if r["mode"] != "ar"))
    width = 0.8 / max(len(modes), 1)
    fig, ax = plt.subplots(figsize=(max(5.5, 2.0 + 1.6 * len(runs)), 3.8))
    for j, mode in enumerate(modes):
        xs, ys = [], []
        for i, (_, rows) in enumerate(runs):
            r = next((r for r in rows if r["mode"] == mode), None)
            if r is not None and r["speedup_vs_ar"] is not None:
                xs.append(i + (j - (len(modes) - 1) / 2) * width)
                ys.append(r["speedup_vs_ar"])
        bars = ax.bar(xs, ys, width, label=mode)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="#777", lw=0.8, ls="--")
    ax.set_xticks(range(len(runs)), [name for name, _ in runs], fontsize=8)
    ax.set_ylabel("speedup vs ar (median over batches)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncols=min(len(modes), 3), loc="upper left")
    ax.set_ylim(0, max([1.0] + [r["speedup_vs_ar"] or 0 for _, rows in runs for r in rows]) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.ArgumentParser(prog="python decode/compare.py", description=__doc__)
    p.add_argument("runs", nargs="+", help="folders written by specjax-bench --out-dir (only read)")
    p.add_argument("--out", required=True, type=Path, help="output path without suffix: OUT.md and OUT.png are written")
    p.add_argument("--title", default="speedup over autoregressive decoding measured in the same run")
    args = p.parse_args(argv)
    out = args.out
    inside = [run for run in args.runs if Path(run).resolve() in out.resolve().parents]  # OUT.md beside a bench.md
    if inside:
        raise InputError(f"--out {out} lies inside the run folder {inside[0]}; write the comparison elsewhere")
    table_path, chart_path = cli.check_output_file(out.with_name(out.name + ".md")), out.with_name(out.name + ".png")
    runs = load_runs(args.runs)
    table = markdown_table(runs)
    write_file(table_path, table)
    write_file(chart_path, lambda tmp: plot(runs, tmp, args.title))
    print(table)
    print(f"wrote {table_path}, {chart_path}", file=sys.stderr)


def entry(argv: Sequence[str] | None = None) -> None:
    cli.run(main, "python decode/compare.py", argv)


if __name__ == "__main__":
    entry()
