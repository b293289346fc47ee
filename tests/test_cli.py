"""specjax-generate end to end: JSON output, few compilations over many requests, and one clear line with exit code 2
for every kind of bad input."""

import json

import numpy as np
import pytest

from specjax.cli.generate import entry
from specjax.decoding import batch
from specjax.decoding.autoregressive import generate
from specjax.io.loading import embedded_gguf, load_model
from specjax.io.tokenizer import Tokenizer


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        entry(list(argv))
    err = capsys.readouterr().err.strip()
    return exit_info.value.code, err


def test_json_output(tiny_folder, tmp_path, capsys):
    out = tmp_path / "out.json"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Hello there", "id": 1}\n\n{"prompt": "Count to three."}\n')
    entry(
        [
            "--model",
            str(tiny_folder),
            "--prompt",
            "Hi",
            "--prompts-file",
            str(prompts),
            "--max-new-tokens",
            "5",
            "--json",
            str(out),
            "--batch-size",
            "2",
        ]
    )
    data = json.loads(out.read_text())
    assert data["config"]["max_new_tokens"] == 5 and data["config"]["batch_size"] == 2
    assert [r["prompt"] for r in data["results"]] == ["Hi", "Hello there", "Count to three."]
    for r in data["results"]:
        assert 1 <= len(r["output_ids"]) <= 5 and r["finish_reason"] in ("stop", "length")
        assert r["prompt_ids"][0] == 1  # the chat template's <|im_start|>
        assert r["stats"]["new_tokens"] == len(r["output_ids"]) and r["stats"]["tokens_per_s"] > 0
        assert r["finish_reason"] == ("stop" if r["output_ids"][-1] == 2 else "length")


def test_attention_pallas_runs_the_kernel_interpreted_and_decodes_as_blocks(tiny_folder, tmp_path):
    """--attention pallas on the CPU: the TPU kernel, interpreted, gives the block loop's tokens; the JSON says which
    path read the cache."""
    reports = {}
    for choice in ("blocks", "pallas"):
        out = tmp_path / f"{choice}.json"
        argv = ["--model", str(tiny_folder), "--raw", "--prompt", "def f(x):", "--max-new-tokens", "4"]
        entry([*argv, "--prefill-chunk", "8", "--attention", choice, "--json", str(out)])
        reports[choice] = json.loads(out.read_text())
    ran = {c: (r["config"]["attention"], r["config"]["attention_path"]) for c, r in reports.items()}
    assert ran == {"blocks": ("blocks", "blocks"), "pallas": ("pallas", "pallas")}
    blocks, pallas = (r["results"][0]["output_ids"] for r in reports.values())
    assert len(blocks) == 4 and pallas == blocks


def test_raw_prompt_skips_the_chat_template(tiny_folder, tmp_path):
    out = tmp_path / "raw.json"
    entry(["--model", str(tiny_folder), "--raw", "--prompt", "def f(x):", "--max-new-tokens", "2", "--json", str(out)])
    result = json.loads(out.read_text())["results"][0]
    assert result["prompt_ids"] == Tokenizer.from_folder(tiny_folder).encode("def f(x):")


def write_corrupt_safetensors(folder, tiny_folder):
    folder.mkdir()
    (folder / "config.json").write_text((tiny_folder / "config.json").read_text())
    data = (tiny_folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


BAD = {
    "missing path": (lambda tmp, tiny: ["--model", str(tmp / "nope")], "nope"),
    "no config.json": (lambda tmp, tiny: ["--model", str(tmp)], "config.json"),
    "unsupported model_type": (
        lambda tmp, tiny: (
            tmp.joinpath("config.json").write_text(json.dumps({"model_type": "gpt_neox"})),
            ["--model", str(tmp)],
        )[1],
        "gpt_neox",
    ),
    "truncated safetensors": (
        lambda tmp, tiny: (write_corrupt_safetensors(tmp / "m", tiny), ["--model", str(tmp / "m")])[1],
        "safetensors",
    ),
    "truncated gguf": (
        lambda tmp, tiny: (
            tmp.joinpath("m.gguf").write_bytes(embedded_gguf("smollm2-135m").read_bytes()[:100_000]),
            ["--model", str(tmp / "m.gguf")],
        )[1],
        "gguf",
    ),
    "prompt too long": (lambda tmp, tiny: ["--model", str(tiny), "--prompt", "word " * 200], "maximum length"),
    "negative temperature": (lambda tmp, tiny: ["--model", str(tiny), "--temperature", "-1"], "temperature"),
    "top-p 0": (lambda tmp, tiny: ["--model", str(tiny), "--top-p", "0"], "top_p"),
    "top-p 1.5": (lambda tmp, tiny: ["--model", str(tiny), "--top-p", "1.5"], "top_p"),
    "missing prompts file": (
        lambda tmp, tiny: ["--model", str(tiny), "--prompts-file", str(tmp / "x.jsonl")],
        "x.jsonl",
    ),
    "prompts file without prompt field": (
        lambda tmp, tiny: (
            tmp.joinpath("p.jsonl").write_text('{"text": "hi"}\n'),
            ["--model", str(tiny), "--prompts-file", str(tmp / "p.jsonl")],
        )[1],
        "prompt",
    ),
    "prompts file not UTF-8": (
        lambda tmp, tiny: (
            tmp.joinpath("p.jsonl").write_bytes(b"\xff\xfe\n"),
            ["--model", str(tiny), "--prompts-file", str(tmp / "p.jsonl")],
        )[1],
        "not UTF-8",
    ),
    "json output is a folder": (lambda tmp, tiny: ["--model", str(tiny), "--json", str(tmp)], "is a folder"),
    "json output unwritable": (
        lambda tmp, tiny: ["--model", str(tiny), "--json", "/proc/specjax/out.json"],
        "cannot create the output folder",
    ),
    "zero new tokens": (lambda tmp, tiny: ["--model", str(tiny), "--max-new-tokens", "0"], "max-new-tokens"),
    "zero prefill chunk": (lambda tmp, tiny: ["--model", str(tiny), "--prefill-chunk", "0"], "--prefill-chunk"),
    "prompts file with a bad max_new_tokens": (
        lambda tmp, tiny: (
            tmp.joinpath("p.jsonl").write_text('{"prompt": "hi", "max_new_tokens": 0}\n'),
            ["--model", str(tiny), "--prompts-file", str(tmp / "p.jsonl")],
        )[1],
        "max_new_tokens",
    ),
    "unknown flag": (lambda tmp, tiny: ["--model", str(tiny), "--frobnicate"], "frobnicate"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(case, tiny_folder, tmp_path, capsys):
    make_argv, needle = BAD[case]
    code, err = run_cli(capsys, *make_argv(tmp_path, tiny_folder))
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("specjax-generate: error:") and needle.lower() in err.lower(), err


def test_the_batch_is_capped_at_the_number_of_prompts(tiny_folder, tmp_path):
    entry(
        [
            "--model",
            str(tiny_folder),
            "--batch-size",
            "1000",
            "--prompt",
            "a",
            "--prompt",
            "b",
            "--max-new-tokens",
            "4",
            "--json",
            str(tmp_path / "out.json"),
        ]
    )
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["config"]["batch_size"] == 2 and len(report["results"]) == 2


def test_outputs_are_reproducible_with_a_seed(tiny_folder, tmp_path):
    runs = []
    for name in ("a", "b", "c"):
        seed = "1" if name != "c" else "2"
        entry(
            [
                "--model",
                str(tiny_folder),
                "--prompt",
                "Tell me a story",
                "--temperature",
                "1.0",
                "--top-k",
                "50",
                "--seed",
                seed,
                "--max-new-tokens",
                "12",
                "--json",
                str(tmp_path / name),
            ]
        )
        runs.append(json.loads((tmp_path / name).read_text())["results"][0]["output_ids"])
    assert runs[0] == runs[1] != runs[2]
    assert np.all(np.array(runs[0]) < Tokenizer.from_folder(tiny_folder).vocab_size)


def test_num_samples_gives_each_prompt_its_samples_in_one_batch(tiny_folder, tmp_path):
    entry(
        [
            "--model",
            str(tiny_folder),
            "--prompt",
            "a",
            "--prompt",
            "b",
            "--num-samples",
            "3",
            "--temperature",
            "1",
            "--batch-size",
            "6",
            "--max-new-tokens",
            "6",
            "--json",
            str(tmp_path / "out.json"),
        ]
    )
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["config"]["batch_size"] == 6
    assert [r["prompt"] for r in report["results"]] == ["a"] * 3 + ["b"] * 3
    assert len({tuple(r["output_ids"]) for r in report["results"][:3]}) > 1  # three samples, not one copied


def test_drafting_is_adaptive_by_default(tiny_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    common = ["--model", str(tiny_folder), "--prompt", "a b a b a b", "--max-new-tokens", "10"]
    entry([*common, "--json", str(tmp_path / "ar.json")])
    entry([*common, "--drafter", "ngram", "--json", str(tmp_path / "auto.json")])
    ar, auto = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ar", "auto"))
    # The menu keeps the measured-useful entries of {plain step, 1, 2, 3, 5, 8}: which ones depends on the timings.
    assert auto["config"]["num_draft_tokens"] == "auto" and set(auto["config"]["draft_sizes"]) <= {0, 1, 2, 3, 5, 8}
    assert any(auto["config"]["draft_sizes"])
    assert auto["results"][0]["output_ids"] == ar["results"][0]["output_ids"]
    stats = auto["results"][0]["stats"]
    assert sum(stats["rounds_by_drafts"].values()) == stats["rounds"]
    code, err = run_cli(capsys, *common, "--drafter", "ngram+layerskip:1", "--lookup-tokens", "4")
    assert code == 2 and "--lookup-tokens needs a fixed --num-draft-tokens" in err


def test_the_clis_add_onednn_dots_unless_xla_flags_set_that_option(monkeypatch):
    from specjax.cli import common as cli

    monkeypatch.setattr(cli.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    cli.prefer_onednn_dots()
    assert cli.os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {cli.ONEDNN_DOTS}=dot"
    monkeypatch.setenv("XLA_FLAGS", f"{cli.ONEDNN_DOTS}=")
    cli.prefer_onednn_dots()
    assert cli.os.environ["XLA_FLAGS"] == f"{cli.ONEDNN_DOTS}="
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(cli.platform, "machine", lambda: "aarch64")
    cli.prefer_onednn_dots()
    assert "XLA_FLAGS" not in cli.os.environ


WORDS = "the quick brown fox jumps over a lazy dog while seven red birds sing".split()


def test_many_requests_compile_few_programs_and_decode_as_each_alone(save_tiny_llama, tmp_path, caplog):
    """20 requests of 5..290 prompt tokens and 2..12 new tokens through 4 slots that refill, in one process: a few
    programs per mode and bucket of slots (the engine's), and each request's greedy output is what it gets alone."""
    folder = tmp_path / "model"
    save_tiny_llama(folder, 2, max_len=1024)
    lines = [
        {"prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(5 + 15 * i)), "max_new_tokens": 2 + 7 * i % 11}
        for i in range(20)
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    model = load_model(str(folder))
    for drafter in ("none", "ngram"):
        before = batch.compilations()
        out = tmp_path / f"{drafter}.json"
        compare = ["--compare-ar"] if drafter == "ngram" else []  # the same prompts through a plain engine too
        entry(
            [
                "--model",
                str(folder),
                "--raw",
                "--prompts-file",
                str(prompts),
                "--batch-size",
                "4",
                "--drafter",
                drafter,
                "--num-draft-tokens",
                "3",
                "--prefill-chunk",
                "32",
                "--json",
                str(out),
                *compare,
            ]
        )
        report = json.loads(out.read_text())
        new = {name: n - before.get(name, 0) for name, n in batch.compilations().items()}
        assert report["compilations"] == batch.compilations()
        new = {name: n for name, n in new.items() if n}
        # a run and an insert per bucket of slots (1, 2, 4) at most, resizes between them
        assert new.pop("run") <= 3 and new.pop("insert") <= 3 and new.pop("resize", 0) <= 6
        assert new == {"empty_state": 1, "begin": 1, "prefill": 1}
        stats = report["results"][0]["stats"]
        assert stats["slots"] == 4 and 0 <= stats["idle_slot_share"] < 1
        assert stats.get("identical_to_ar", True) and (drafter == "none") == ("speedup_vs_ar" not in stats)
        each = ", ".join(f"{name} x{n}" for name, n in batch.compilations().items())
        assert f"compiled {sum(batch.compilations().values())} programs ({each}) in" in caplog.messages[-1]
        results = report["results"]
        lengths = [len(r["prompt_ids"]) for r in results]
        assert min(lengths) <= 8 and max(lengths) > 256
        for line, r in zip(lines, results):
            alone = generate(
                model.weights,
                model.cfg,
                [r["prompt_ids"]],
                max_new_tokens=line["max_new_tokens"],
                eos_ids=model.eos_ids,
            )
            assert r["output_ids"] == alone.completions[0].output_ids


def test_stream_prints_the_text_that_decoding_it_whole_gives(tiny_folder, tmp_path, capsys):
    argv = ["--model", str(tiny_folder), "--prompt", "Count to three.", "--max-new-tokens", "12"]
    entry([*argv, "--json", str(tmp_path / "whole.json")])
    whole = json.loads((tmp_path / "whole.json").read_text())["results"][0]
    capsys.readouterr()
    entry([*argv, "--drafter", "ngram", "--num-draft-tokens", "2", "--stream"])
    printed = capsys.readouterr().out
    assert printed.startswith("\n>>> Count to three.\n" + whole["text"] + "\n")
    assert printed.rstrip().splitlines()[-1].startswith(f"[{len(whole['output_ids'])} tokens, {whole['finish_reason']}")
    code, err = run_cli(capsys, *argv, "--prompt", "Hi", "--stream")
    assert code == 2 and err.splitlines()[-1].startswith("specjax-generate: error: --stream prints one prompt")
