"""Hostile values, text that is not text, and disks that refuse: one line and exit code 2 (the API: InputError or
OutputError), a warning where only a cache is lost, and no result lost."""

import errno
import json
import os
import re

import numpy as np
import pytest

from specjax import host
from specjax.cli import bench
from specjax.cli.generate import entry
from specjax.config import SamplingConfig
from specjax.decoding import autoregressive
from specjax.drafters.ngram import NgramDrafter
from specjax.errors import InputError, OutputError
from specjax.io.tokenizer import Tokenizer


def run_cli(capsys, main, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out = capsys.readouterr()
    return exit_info.value.code, out.err.strip(), out.out


def assert_one_line(code, err, prog, needle):
    """Exit code 2 and one line on stderr besides progress bars (tqdm's "NN%|" lines)."""
    assert code == 2
    err = "\n".join(line for line in err.splitlines() if not re.search(r"\d%\|", line))
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"{prog}: error:") and needle.lower() in err.lower(), err


HUGE = str(2**40)
NUMBERS = {
    "top-k past int64": (["--top-k", "100000000000000000000", "--temperature", "1"], "too large"),
    "top-k 2**31": (["--top-k", str(2**31), "--temperature", "1"], "too large"),
    "seed 2**80": (["--seed", str(2**80)], "seed"),
    "seed -1": (["--seed", "-1"], "seed"),
    "max-new-tokens 2**40": (["--max-new-tokens", HUGE], "too large"),
    "batch-size 2**40": (["--batch-size", HUGE], "too large"),
    "num-samples 2**40": (["--num-samples", HUGE], "too large"),
    "num-draft-tokens 2**40": (["--drafter", "ngram", "--num-draft-tokens", HUGE], "draft tokens"),
    "lookup-tokens 2**40": (
        ["--drafter", "ngram+ngram", "--num-draft-tokens", "3", "--lookup-tokens", HUGE],
        "too large",
    ),
    "ngram size 2**40": (["--drafter", f"ngram:{HUGE}"], "n-gram size"),
    "lookup-first ngram size 2**40": (
        ["--drafter", f"ngram:{HUGE}+layerskip:1", "--num-draft-tokens", "2"],
        "n-gram size",
    ),
    "layerskip 2**40": (["--drafter", f"layerskip:{HUGE}"], "layer"),
    "tree depth 2**40": (["--drafter", "eagle3:smollm2-135m", "--tree", f"{HUGE},2,4"], "depth"),
    "temperature past float32": (["--temperature", "1e39"], "temperature"),
    "temperature not a number": (["--temperature", "warm"], "temperature"),
}


@pytest.mark.parametrize("case", sorted(NUMBERS))
def test_numbers_past_the_arrays_are_one_line(case, tiny_folder, capsys):
    flags, needle = NUMBERS[case]
    code, err, _ = run_cli(
        capsys, entry, "--model", str(tiny_folder), "--prompt", "hi", "--max-new-tokens", "2", *flags
    )
    assert_one_line(code, err, "specjax-generate", needle)


@pytest.mark.parametrize("flag", ["--num-prompts", "--repeats", "--ngram", "--draft-layers", "--top-k"])
def test_bench_numbers_past_the_arrays_are_one_line(flag, capsys):
    code, err, _ = run_cli(capsys, bench.entry, flag, HUGE)
    assert_one_line(code, err, "specjax-bench", "too large")


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: SamplingConfig(temperature=1.0, top_k=2**40), "top_k"),
        (lambda: SamplingConfig(top_k=2.5), "top_k"),
        (lambda: SamplingConfig(temperature=1e39), "temperature"),
        (lambda: NgramDrafter(max_n=10**6), "n-gram"),
    ],
)
def test_the_api_range_checks_what_the_arrays_hold(make, needle):
    with pytest.raises(InputError, match=needle):
        make()


@pytest.mark.parametrize("seed", [2**80, -1, 1.5, True])
def test_the_api_refuses_seeds_the_prng_cannot_take(seed, tiny_folder):
    from specjax.io.loading import load_model

    model = load_model(str(tiny_folder))
    with pytest.raises(InputError, match="seed"):
        autoregressive.generate(model.weights, model.cfg, [[1, 2]], max_new_tokens=2, seed=seed)


# Python hands a command line's undecodable bytes to the program as lone surrogates (U+DC80..U+DCFF).
NOT_TEXT = {
    "invalid UTF-8 byte in argv": os.fsdecode(b"caf\xe9 au lait"),
    "lone high surrogate": "a \ud800 b",
    "lone low surrogate at the end": "tail \udfff",
}


@pytest.mark.parametrize("case", sorted(NOT_TEXT))
def test_a_prompt_that_is_not_text_is_one_line_naming_it(case, tiny_folder, tmp_path, capsys):
    prompt = NOT_TEXT[case]
    code, err, _ = run_cli(capsys, entry, "--model", str(tiny_folder), "--prompt", prompt, "--max-new-tokens", "2")
    assert_one_line(code, err, "specjax-generate", "not valid unicode")
    assert repr(prompt)[1:12] in err  # the prompt is named (escaped) in the line
    code, err, _ = run_cli(capsys, entry, "--model", str(tiny_folder), "--prompt", prompt, "--raw")
    assert_one_line(code, err, "specjax-generate", "not valid unicode")


def test_a_prompts_file_with_an_escaped_lone_surrogate_is_one_line(tiny_folder, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "broken \\ud800 text"}\n')  # valid JSON, not valid text
    code, err, _ = run_cli(capsys, entry, "--model", str(tiny_folder), "--prompts-file", str(path))
    assert_one_line(code, err, "specjax-generate", "not valid unicode")
    assert "broken" in err


@pytest.mark.parametrize("text", ["\udcff", b"bytes", None])
def test_the_tokenizer_api_raises_input_error_for_what_is_not_text(text, tiny_folder):
    tokenizer = Tokenizer.from_folder(tiny_folder)
    with pytest.raises(InputError):
        tokenizer.encode(text)
    with pytest.raises(InputError):
        tokenizer.chat_prompt_ids(text)


def refuse_writes_to(monkeypatch, name: str, code: int = errno.ENOSPC):
    """Makes every atomic write whose target is called `name` fail as a full (or read-only) disk would."""
    replace = os.replace

    def refusing(src, dst, *a, **kw):
        if os.path.basename(dst) == name:
            raise OSError(code, os.strerror(code))
        return replace(src, dst, *a, **kw)

    monkeypatch.setattr(host.os, "replace", refusing)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_results_that_cannot_be_written_go_to_stdout(code, tiny_folder, tmp_path, monkeypatch, capsys):
    refuse_writes_to(monkeypatch, "out.json", code)
    out = tmp_path / "out.json"
    argv = [
        "--model",
        str(tiny_folder),
        "--prompt",
        "hi",
        "--prompt",
        "yo",
        "--max-new-tokens",
        "3",
        "--json",
        str(out),
    ]
    exit_code, err, stdout = run_cli(capsys, entry, *argv)
    assert_one_line(exit_code, err, "specjax-generate", os.strerror(code))
    assert "out.json" in err and "stdout" in err
    results = json.loads(stdout)["results"]
    assert [r["prompt"] for r in results] == ["hi", "yo"] and all(r["output_ids"] for r in results)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.json")]


def test_bench_results_that_cannot_be_written_go_to_stdout(tmp_path, monkeypatch, capsys):
    refuse_writes_to(monkeypatch, "bench.json")
    argv = [
        "--model",
        "tiny-random",
        "--modes",
        "ar",
        "--num-prompts",
        "1",
        "--max-new-tokens",
        "2",
        "--out-dir",
        str(tmp_path / "run"),
    ]
    exit_code, err, stdout = run_cli(capsys, bench.entry, *argv)
    assert_one_line(exit_code, err, "specjax-bench", "no space left on device")
    assert [m["mode"] for m in json.loads(stdout)["modes"]] == ["ar"]


def test_the_write_primitive_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "kept.txt"
    path.write_text("old")
    refuse_writes_to(monkeypatch, "kept.txt")
    with pytest.raises(OutputError, match="kept.txt.*No space left on device"):
        host.write_file(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]


@pytest.mark.parametrize("kind", ["a file", pytest.param("under /proc", marks=pytest.mark.slow)])  # one path
def test_an_unusable_cache_is_a_warning_and_the_run_goes_on(kind, tiny_folder, tmp_path, monkeypatch, caplog):
    if kind == "a file":
        cache = tmp_path / "cache"
        cache.write_text("not a folder")
    else:
        cache = "/proc/specjax-cache"
    monkeypatch.setenv("SPECJAX_CACHE", str(cache))
    monkeypatch.setattr(host.log, "propagate", True)
    out = tmp_path / "out.json"
    entry(
        [
            "--model",
            str(tiny_folder),
            "--drafter",
            "ngram",
            "--prompt",
            "a b a b",
            "--max-new-tokens",
            "4",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["results"][0]["output_ids"]
    warnings = {m for m in caplog.messages if "unusable" in m}
    assert len(warnings) == 1 and str(cache) in warnings.pop()


def test_a_full_cache_is_a_warning_and_a_corrupt_entry_is_measured_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(host.log, "propagate", True)
    calls = []

    def measure():
        calls.append(1)
        return {"seconds": [0.5, 1.5]}

    signature = {"what": "a test figure"}
    value = host.cached_measurement("probe", signature, measure)
    (entry_path,) = (tmp_path / "cache" / "probe").iterdir()
    assert host.cached_measurement("probe", signature, measure) == value and len(calls) == 1  # read back
    for garbage in [b"\x00\xff garbage", b'{"value": ', b"[1, 2]", b'{"no value": 1}']:
        entry_path.write_bytes(garbage)
        assert host.cached_measurement("probe", signature, measure) == value
        assert json.loads(entry_path.read_text())["value"] == value  # rewritten whole
    assert (
        len(calls) == 5
        and f"warning: ignoring the unreadable cache entry {entry_path}; measuring again" in caplog.messages
    )
    refuse_writes_to(monkeypatch, entry_path.name)
    entry_path.unlink()
    assert host.cached_measurement("probe", signature, measure) == value
    assert any("No space left on device" in m and "not cached" in m for m in caplog.messages)
    assert not entry_path.exists()


def test_written_files_never_follow_a_link(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "out.json").symlink_to(outside)
    host.write_file(folder / "out.json", "results")
    assert outside.read_text() == "precious" and not (folder / "out.json").is_symlink()
    (folder / "log.jsonl").symlink_to(outside)
    with pytest.raises(OutputError, match="symbolic link"):
        host.append_text(folder / "log.jsonl", "line\n")
    assert outside.read_text() == "precious"


@pytest.mark.slow  # converts the embedded GGUF three times
def test_a_gguf_conversion_the_cache_refuses_or_that_is_damaged_is_a_warning(tmp_path, monkeypatch, caplog):
    from specjax.io.gguf import converted_folder
    from specjax.io.loading import embedded_gguf, load_model

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(host.log, "propagate", True)
    folder = converted_folder(embedded_gguf("smollm2-135m"))
    with monkeypatch.context() as refusing:
        refuse_writes_to(refusing, "model.safetensors")
        refused = load_model("smollm2-135m")
    assert any("cannot cache the conversion" in m and "No space left on device" in m for m in caplog.messages)
    assert not folder.exists() and not list(folder.parent.iterdir())  # no partial conversion left behind
    converted = load_model("smollm2-135m")  # converts and caches
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    reconverted = load_model("smollm2-135m")
    assert any("cached conversion is damaged" in m for m in caplog.messages)
    for model in (refused, reconverted):
        assert model.cfg == converted.cfg
        assert np.array_equal(np.asarray(model.weights.embed), np.asarray(converted.weights.embed))
    assert load_model("smollm2-135m").cfg == converted.cfg and weights.stat().st_size > 10**6
