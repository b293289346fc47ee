"""specjax-bench end to end on the tiny random model: JSON, table and plot written, modes interleaved per batch,
greedy speculative outputs identical to autoregressive ones, speedups paired per batch."""

import dataclasses
import json
import logging
import statistics

import pytest

from specjax import host
from specjax.cli import bench
from specjax.errors import InputError
from specjax.io.loading import tiny_random_model
from specjax.measure import bandwidth, calibration


def test_bench_writes_json_table_and_plot(tmp_path, capsys, caplog, monkeypatch):
    monkeypatch.setattr(host.log, "propagate", True)  # the status lines, to caplog
    caplog.set_level(logging.INFO, logger="specjax")
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bandwidth, "copy_bandwidth", lambda: 1e10)

    # Round times of 1 + 0.2 K plain steps, as calibration would measure them (tests/test_adaptive.py measures them).
    def timed(weights, cfg, drafter, menu, **kw):
        return {"step_s": 0.01, "prefill_token_s": 1e-4, "round_s": [0.01 + 0.002 * k for k in menu]}

    monkeypatch.setattr(calibration, "round_seconds", timed)
    prompts = ["Write a function.", "Name three rivers.", "Count to ten.", "Hello!"]
    argv = [
        "--model",
        "tiny-random",
        "--modes",
        "ar,ngram,ngram:2,ngram:auto,layerskip",
        "--max-new-tokens",
        "12",
        "--num-draft-tokens",
        "3",
        "--draft-layers",
        "1",
        "--forward-costs",
        "1,4",
        "--out-dir",
        str(tmp_path),
    ]
    for p in prompts:
        argv += ["--prompt", p]
    bench.main(argv)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["config"]["prompts"] == 4 and report["config"]["batch_size"] == 1
    assert report["config"]["prompt_set"] == "given"
    assert report["config"]["num_draft_tokens"] == 3 and report["config"]["draft_layers"] == 1
    rows = {r["mode"]: r for r in report["modes"]}
    assert list(rows) == ["ar", "ngram", "ngram:2", "ngram:auto", "layerskip"]
    assert len(rows["ngram"]["acceptance_by_position"]) == 3 and len(rows["ngram:2"]["acceptance_by_position"]) == 2
    for mode in ("ngram", "ngram:2", "ngram:auto", "layerskip"):
        r = rows[mode]
        assert r["identical_to_ar"] is True
        assert 1.0 <= r["mean_accepted"] <= 9.0
        assert r["total_tokens"] == rows["ar"]["total_tokens"]
        if mode != "ngram:auto":  # a fixed K: its round's time split; adaptive rounds have no one K to split
            assert r["breakdown"]["verify_ratio"] > 0 and r["breakdown"]["drafter_ms"] > 0
            assert r["breakdown"]["prefill_ms"] > 0  # the 4 batches' prefills, out of the rounds' time
    assert "breakdown" not in rows["ngram:auto"]
    by_size = rows["ngram:auto"]["rounds_by_drafts"]  # the menu entries that win at some rate, of 0, 1, 2, 3, 5, 8
    assert set(by_size) <= {"0", "1", "2", "3", "5", "8"} and len(by_size) > 1 and sum(by_size.values()) > 0
    learned = rows["ngram:auto"]["learned"]  # over the batches: a prior per matched tail length, 0..3
    assert len(learned["prior"]) == 4 and all(0 <= p <= 1 for p in learned["prior"]) and learned["prior"] != [0.6] * 4
    assert learned["loop_gain"] > 0
    assert rows["ar"]["speedup_vs_ar"] == pytest.approx(1.0) and rows["ar"]["decode_speedup_vs_ar"] == pytest.approx(
        1.0
    )
    assert all(r["decode_speedup_vs_ar"] > 0 for r in rows.values())
    # Weights read: one forward per token of ar (batch 1), fewer for a speculative mode; against the bandwidth.
    config = report["config"]
    assert config["bandwidth_bytes_per_s"] == 1e10 and config["bandwidth_source"] == "measured"
    weights_read = {m: r["weight_bytes_per_s"] * r["total_seconds"] for m, r in rows.items()}
    assert weights_read["ar"] == pytest.approx(config["weight_bytes"] * rows["ar"]["total_tokens"])
    assert weights_read["ar"] > weights_read["ngram"] > config["weight_bytes"] * len(prompts)
    for r in rows.values():
        assert r["bandwidth_fraction"] == pytest.approx(r["weight_bytes_per_s"] / 1e10)
    table = (tmp_path / "bench.md").read_text()
    assert [r["tokens"] for r in report["forward_costs"]] == [1, 4]
    assert all(r["ms"] > 0 and r["target_steps"] > 0 for r in report["forward_costs"])
    assert table.count("\n") == (2 + 5) + 1 + (2 + 2) + 2 + 2 and "| ngram:auto |" in table and "| 4 |" in table
    assert config["attention"] == "auto" and config["attention_path"] == "blocks"  # the CPU's path
    assert "\nAttention: blocks (--attention auto).\n" in table
    assert report["compilations"]["speculative_decode"] >= 4 and report["compilations"]["decode"] >= 1
    assert table.rstrip().splitlines()[-1].startswith(f"compiled {sum(report['compilations'].values())} programs (")
    header, _, *mode_lines = table.splitlines()[:7]
    assert header.endswith("| identical to ar | weights read (GB/s) | of bandwidth |")
    assert all(line.count("|") == 12 and line.endswith("% |") for line in mode_lines)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    out, err = capsys.readouterr()
    assert "| layerskip |" in out
    progress = [m for m in caplog.messages if m.startswith("bench ")]  # a line before every long step
    assert progress[0] == "bench 1/5 ar: preparing" and "bench 4/5 ngram:auto: preparing" in progress
    assert (
        "calibrating adaptive drafting (draft sizes [0, 1, 2, 3, 5, 8], batch 1): once on this machine"
        in caplog.messages
    )
    assert "bench 5/5 layerskip: compiling (a warm-up batch)" in progress
    assert "bench timing 5 modes on 4 batches, interleaved" in progress


def test_context_costs_time_each_long_context_shape_the_model_holds():
    """Each `LONG_CONTEXT` forward timed, each against the one-token step at its live length; a shape past the
    model's maximum length is left out."""
    tiny = tiny_random_model()
    model = dataclasses.replace(tiny, cfg=dataclasses.replace(tiny.cfg, max_position_embeddings=8192))
    rows = bench.context_cost_sweep(model, batch=1)
    assert [(r["tokens"], r["live"], r["slots"], r["tree"]) for r in rows] == [
        (1, 300, 512, False),
        (1, 300, 8192, False),
        (1, 4096, 8192, False),
        (10, 4096, 8192, True),
    ]
    assert rows[0]["target_steps"] == 1.0 and rows[2]["target_steps"] == 1.0
    assert rows[1]["target_steps"] == pytest.approx(rows[1]["ms"] / rows[0]["ms"])
    assert rows[3]["target_steps"] == pytest.approx(rows[3]["ms"] / rows[2]["ms"]) and all(r["ms"] > 0 for r in rows)
    assert [r["slots"] for r in bench.context_cost_sweep(tiny, batch=1)] == [512]  # tiny holds 2048 positions


def test_measure_interleaves_modes_and_pairs_speedups():
    calls = []

    def runner(name, seconds):
        def run(group, max_new_tokens, seed):
            calls.append((name, max_new_tokens))
            return [[1] * max_new_tokens for _ in group], seconds[len([c for c in calls if c[0] == name]) - 1]

        return run

    # ar: 10 tokens in 1 s then 2 s (the machine slowed down); fast: twice ar's rate on each batch.
    runs = bench.measure(
        {"ar": runner("ar", [9, 1.0, 2.0]), "fast": runner("fast", [9, 0.5, 1.0])}, [[0], [1]], 10, seed=0
    )
    # A warm-up each, then batch 1 from the first mode, batch 2 from the second: no mode always runs first.
    assert calls == [("ar", 10), ("fast", 10), ("ar", 10), ("fast", 10), ("fast", 10), ("ar", 10)]
    summary = runs["fast"].summary(runs["ar"], greedy=True, weight_bytes=100, bandwidth=1e4, prefills=[0.0, 0.0])
    assert summary["speedup_vs_ar"] == pytest.approx(2.0) and summary["decode_speedup_vs_ar"] == pytest.approx(2.0)
    assert summary["tokens_per_s"] == pytest.approx(statistics.median([20.0, 10.0]))
    # A 0.25 s prefill in every batch of both: the decoding alone is faster still (0.75 / 0.25 s, 1.75 / 0.75 s).
    summary = runs["fast"].summary(runs["ar"], greedy=True, weight_bytes=100, bandwidth=1e4, prefills=[0.25, 0.25])
    assert summary["speedup_vs_ar"] == pytest.approx(2.0)
    assert summary["decode_speedup_vs_ar"] == pytest.approx(statistics.median([3.0, 1.75 / 0.75]))


def test_repeats_time_every_batch_again_and_keep_one_pass_of_outputs():
    calls = []

    def run(group, max_new_tokens, seed):
        calls.append((group[0], seed))
        return [[group[0]] * 4], [9.0, 1.0, 2.0, 3.0, 4.0][len(calls) - 1]  # warm-up, then 2 batches x 2 repeats

    (only,) = bench.measure({"ar": lambda *a: run(*a)}, [[5], [6]], 4, seed=3, repeats=2).values()
    assert calls == [(5, 3), (5, 3), (6, 4), (5, 3), (6, 4)]  # each repeat: the same batches with the same seeds
    assert only.outputs == [[5] * 4, [6] * 4] and only.repeats == 2
    assert only.batch_seconds == [1.0, 2.0, 3.0, 4.0] and only.batch_tokens == [4] * 4
    calls.clear()
    bench.measure({"ar": lambda *a: run(*a)}, [[5], [6]], 4, seed=3, repeats=2, fresh_samples=True)
    assert calls == [(5, 3), (5, 3), (6, 4), (5, 5), (6, 6)]  # sampled: every repeat draws new samples


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--repeats", "0"], ">= 1"),
        (["--forward-costs", "0,4"], ">= 1"),
        (["--forward-costs", "a"], "integers"),
        (["--modes", "x"], "unknown mode 'x'"),
        (["--modes", "ar:3"], "unknown mode 'ar:3'"),
        (["--modes", "ngram:0"], "unknown mode 'ngram:0'"),
        (["--modes", "eagle3-tree:4"], "a chain one with ':K'"),
    ],
)
def test_bad_bench_input_is_one_line_and_exit_2(flags, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.entry(["--model", "tiny-random", "--prompt", "Hi", *flags])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_the_modes_come_from_the_registered_drafters():
    """A drafter of trees gives NAME-chain and NAME-tree; one of a draft checkpoint its --NAME option and, behind
    lookup first, NAME+FALLBACK; the layer-skip drafter its --draft-layers; the model and test drafters, which no bench
    option sets, none."""
    modes = bench.speculative_modes()
    assert list(modes) == [
        "ngram",
        "layerskip",
        "eagle3-chain",
        "eagle3-tree",
        "dflash",
        "ngram+eagle3",
        "ngram+dflash",
    ]
    assert modes["eagle3-tree"].tree and not modes["eagle3-chain"].tree and modes["ngram+dflash"].entry.wraps
    options = {"ngram": 4, "draft_layers": None, "eagle3": "HEAD", "dflash": None}
    cfg = tiny_random_model().cfg
    assert modes["ngram+eagle3"].spec(cfg, options) == "ngram:4+eagle3:HEAD"
    assert modes["layerskip"].spec(cfg, options) == f"layerskip:{max(1, cfg.num_layers // 4)}"
    with pytest.raises(InputError, match="mode ngram\\+dflash needs a DFlash draft folder: --dflash PATH"):
        modes["ngram+dflash"].spec(cfg, options)
    args = bench.parser().parse_args(["--eagle3", "HEAD"])
    assert bench.drafter_options(args) == {"dflash": None, "draft_layers": None, "eagle3": "HEAD", "ngram": 3}


def test_lookup_first_is_spelled_as_in_generate_and_the_old_spelling_warns(capsys):
    assert bench.parse_mode("ngram+eagle3:4") == ("ngram+eagle3", 4)
    assert bench.respelled("ngram+eagle3:auto") == "ngram+eagle3:auto" and not capsys.readouterr().err
    assert bench.respelled("ngram-eagle3:auto") == "ngram+eagle3:auto"
    assert capsys.readouterr().err == "specjax-bench: mode 'ngram-eagle3:auto' is now spelled 'ngram+eagle3:auto'\n"
    with pytest.raises(SystemExit) as exit_info:  # read as ngram+eagle3, which needs its head
        bench.entry(["--model", "tiny-random", "--prompt", "Hi", "--modes", "ar,ngram-eagle3"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "is now spelled 'ngram+eagle3'" in err
    assert "mode ngram+eagle3 needs an EAGLE-3 head folder" in err


def test_bench_runs_the_chat_set(tmp_path):
    bench.main(
        [
            "--model",
            "tiny-random",
            "--modes",
            "ar",
            "--prompt-set",
            "chat",
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "4",
            "--out-dir",
            str(tmp_path),
        ]
    )
    config = json.loads((tmp_path / "bench.json").read_text())["config"]
    assert config["prompt_set"] == "chat" and config["prompts"] == 2


def test_an_unwritable_output_is_refused_before_any_work(monkeypatch):
    from specjax.errors import InputError

    monkeypatch.setattr(bench.cli, "load_target", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(InputError, match="cannot create the output folder '/proc/specjax'"):
        bench.main(["--model", "tiny-random", "--modes", "ar", "--out-dir", "/proc/specjax"])


def test_bandwidth_comes_from_the_data_sheet_or_one_cached_measurement(tmp_path, monkeypatch):
    class Device:
        platform, device_kind = "gpu", "NVIDIA H200"

    monkeypatch.setattr(bandwidth.jax, "devices", lambda: [Device()])
    assert bandwidth.device_bandwidth() == (4.8e12, "data sheet")
    Device.device_kind = "Some New Accelerator"
    measurements = []
    monkeypatch.setattr(bandwidth, "copy_bandwidth", lambda: measurements.append(1) or 5e11)
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    assert bandwidth.device_bandwidth() == bandwidth.device_bandwidth() == (5e11, "measured")
    assert len(measurements) == 1


def test_copy_bandwidth_is_plausible():
    assert 1e8 < bandwidth.copy_bandwidth(16 * 2**20, reps=3) < 1e13
