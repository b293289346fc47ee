"""train/scaling.py's plumbing: the whole data set first (it stores the features), then each fraction on the same
features in its own output folder, one curve point per run in order of size, and one-line errors."""

import json
from pathlib import Path

import pytest
from conftest import load_script

scaling = load_script("train/scaling.py")


SMOKE = Path(__file__).resolve().parent.parent / "configs" / "smoke.yaml"


def test_full_run_first_then_subsets_on_its_features(tmp_path, monkeypatch):
    calls = []

    def fake_run(cfg, stages):  # what the stages would leave behind, sized by the fraction
        t = cfg.training
        calls.append((cfg.output_dir, t.data_fraction, t.epochs, t.features_dir, stages))
        cfg.output_path.mkdir(parents=True)
        rows = {
            "data_fraction": t.data_fraction,
            "rows": int(64 * t.data_fraction),
            "samples": 1,
            "assistant_tokens": int(1000 * t.data_fraction),
        }
        (cfg.output_path / "training_rows.json").write_text(json.dumps(rows))
        mean = {"chain": {"mean_accepted": 1 + t.data_fraction}, "tree": {"mean_accepted": 2 + t.data_fraction}}
        (cfg.output_path / "eval.json").write_text(json.dumps({"step": 3, "sets": {"heldout": mean}}))

    monkeypatch.setattr(scaling, "run", fake_run)
    base = tmp_path / "run"
    out = tmp_path / "docs" / "scaling"
    scaling.main(
        ["--config", str(SMOKE), "--fractions", "0.5,1,0.25", "--epochs", "2", "--out", str(out), f"output_dir={base}"]
    )
    assert calls == [
        (str(base), 1.0, 2.0, None, scaling.FULL_STAGES),
        (f"{base}-scaling-0.5", 0.5, 2.0, str(base / "features"), scaling.SUBSET_STAGES),
        (f"{base}-scaling-0.25", 0.25, 2.0, str(base / "features"), scaling.SUBSET_STAGES),
    ]
    report = json.loads(out.with_suffix(".json").read_text())
    assert [p["assistant_tokens"] for p in report["points"]] == [250, 500, 1000]
    assert [p["sets"]["heldout"]["tree"]["mean_accepted"] for p in report["points"]] == [2.25, 2.5, 3.0]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("fractions", ["0.5,0.25", "0,1", "1,2", "half,1"])
def test_fractions_must_include_the_whole_set_and_lie_in_0_1(fractions, capsys):
    with pytest.raises(SystemExit) as exit_info:
        scaling.main(["--config", str(SMOKE), "--fractions", fractions, "--epochs", "1", "--out", "x"])
    assert exit_info.value.code == 2
    assert "--fractions" in capsys.readouterr().err
