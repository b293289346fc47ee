"""decode/device_bench.py end to end on the CPU with its shrunk target (--tiny): the JSON and Markdown it writes."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "decode" / "device_bench.py"


@pytest.fixture()
def device_bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("device_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "VERIFY_TOKENS", (2, 5))  # each count compiles a forward
    monkeypatch.setattr(module, "device_bandwidth", lambda: (1e10, "measured"))
    return module


def test_tiny_run_writes_json_and_tables(device_bench, tmp_path, capsys):
    device_bench.main(
        ["--tiny", "--out-dir", str(tmp_path), "--batches", "1,2", "--context", "16", "--max-new-tokens", "8"]
    )
    report = json.loads((tmp_path / "llama3-8b.json").read_text())
    assert report["config"]["target"] == "tiny" and report["config"]["bandwidth_bytes_per_s"] == 1e10
    assert [r["tokens"] for r in report["verification"]] == [2, 5] and report["one_step_ms"] > 0
    assert [r["batch"] for r in report["decoding"]] == [1, 2]
    for r in report["decoding"]:
        assert r["tokens_per_s"] > 0 and r["of_roofline"] == pytest.approx(
            r["tokens_per_s"] / r["roofline_tokens_per_s"]
        )
    # On the CPU the loop reads the cache ("auto"), its step is the one timed; the TPU kernel does not apply here.
    attention = report["attention"]
    assert attention["choice"] == "auto" and attention["ran"] == "blocks" and attention["pallas_step_ms"] is None
    assert attention["blocks_step_ms"] == report["one_step_ms"]
    assert "the Pallas kernel does not apply on cpu" in attention["pallas_note"]
    # Batch 2 reads the weights once per step for two rows: twice the roofline of batch 1, less the extra KV reads.
    ratio = report["decoding"][1]["roofline_tokens_per_s"] / report["decoding"][0]["roofline_tokens_per_s"]
    assert 1.5 < ratio < 2
    table = (tmp_path / "llama3-8b.md").read_text()
    assert "Attention: blocks ran (--attention auto); one step (batch 1) by path: blocks " in table
    assert "| 5 |" in table and "| 2 |" in table and "Memory plan, batch 2" in table and "| total |" in table
    assert table in capsys.readouterr().out


def test_a_bad_context_is_one_line_and_exit_2(device_bench, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        device_bench.cli.run(
            device_bench.main, "device_bench.py", ["--tiny", "--out-dir", str(tmp_path), "--context", "0"]
        )
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err == "device_bench.py: error: --context must be >= 1, got 0"
