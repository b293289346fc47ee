"""decode/compare.py on two real specjax-bench reports: one table row per run and mode, a chart, one-line errors."""

import json
import shutil
from pathlib import Path

import pytest
from conftest import load_script

compare = load_script("decode/compare.py")


DOCS = Path(__file__).resolve().parent.parent / "docs" / "bench"


def _run(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(DOCS / f"{name}.json", folder / "bench.json")
    return folder


def test_compare_writes_one_row_per_run_and_mode_and_a_chart(tmp_path, capsys):
    runs = [_run(tmp_path, "humaneval-b1"), _run(tmp_path, "humaneval-b8")]  # reports without a prompt_set
    compare.main([*map(str, runs), "--out", str(tmp_path / "out" / "both")])
    reports = [json.loads((r / "bench.json").read_text()) for r in runs]
    table = (tmp_path / "out" / "both.md").read_text().splitlines()
    assert len(table) == 2 + sum(len(r["modes"]) for r in reports)
    first = reports[0]["modes"][1]
    assert table[3].startswith(f"| prompts b1 T0 | {first['mode']} | {first['tokens_per_s']:.1f} | ")
    assert any(line.startswith("| prompts b8 T0 | ar |") for line in table)
    assert (tmp_path / "out" / "both.png").read_bytes()[:4] == b"\x89PNG"
    assert "| setting | mode |" in capsys.readouterr().out


@pytest.mark.parametrize("content", [None, "{not json", '{"modes": []}'])
def test_a_missing_or_foreign_report_is_one_line_and_exit_2(tmp_path, capsys, content):
    folder = tmp_path / "run"
    folder.mkdir()
    if content is not None:
        (folder / "bench.json").write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        compare.entry([str(folder), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bench.json" in err
    assert not (tmp_path / "out.md").exists()


def test_the_output_is_a_flag_and_never_lands_in_a_run_folder(tmp_path, capsys):
    runs = [_run(tmp_path, "humaneval-b1"), _run(tmp_path, "humaneval-b8")]
    before = {r: sorted(p.name for p in r.iterdir()) for r in runs}
    with pytest.raises(SystemExit) as exit_info:  # the old spelling: the first folder is not taken as the output
        compare.entry(list(map(str, runs)))
    assert exit_info.value.code == 2 and "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        compare.entry([*map(str, runs), "--out", str(runs[1] / "bench")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "inside the run folder" in err
    assert {r: sorted(p.name for p in r.iterdir()) for r in runs} == before
