"""specjax-train writes only inside its output_dir, never through a symbolic link, and a full or read-only disk stops
a run with one line, the finished work intact, resumed by the next run."""

import errno
import json
import os
import resource
import shutil
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

from specjax import host
from specjax.cli.train import entry
from specjax.errors import InputError, OutputError
from specjax.train.run import exclusive_output_dir, refuse_links_inside
from specjax.train.trainer import truncate_metrics

SMOKE = Path(__file__).resolve().parent.parent / "configs" / "smoke.yaml"
# A small pipeline: 8 prompts with a greedy and a sampled response each (two store units), 4 steps.
TINY = (
    "data.num_prompts=8",
    "data.samples_per_prompt=1",
    "data.source_tokens=0",
    "training.steps=4",
    "checkpoint.every=2",
    "logging.every=1",
)
STAGES = ("--stages", "regenerate,vocab,features,train")
OUTSIDE = b"a file outside output_dir\n"


def train_cli(output_dir: Path, *args: str) -> int:
    """specjax-train on output_dir with the tiny settings: its exit code."""
    try:
        entry(["--config", str(SMOKE), f"output_dir={output_dir}", *TINY, *args])
    except SystemExit as e:
        return e.code
    return 0


def error_line(capsys) -> str:
    """The run's one error line: the last on stderr, the only one of its kind, and no traceback."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("specjax-train: error: ")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]) and "Traceback" not in err, err[-3000:]
    return errors[0]


def snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()
    }


def full_disk(after: int, code: int = errno.ENOSPC):
    """An os.replace that works `after` times, then fails as a full (or read-only) disk does."""
    replace, calls = os.replace, []

    def refusing(src, dst, **kwargs):
        calls.append(dst)
        if len(calls) > after:
            raise OSError(code, os.strerror(code))
        return replace(src, dst, **kwargs)

    return refusing


def link_file(out: Path, name: str, outside: Path) -> Path:
    """Replaces output_dir/name with a link to an outside file that holds known bytes."""
    outside.write_bytes(OUTSIDE)
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(outside)
    return outside


def link_folder(out: Path, name: str, outside: Path) -> Path:
    """Moves output_dir/name outside and leaves a link to it in its place."""
    shutil.move(out / name, outside)
    (out / name).symlink_to(outside)
    return outside


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The tiny pipeline run without a fault."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train_cli(out, *STAGES) == 0
    return out


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


# -- the write primitives -----------------------------------------------------------------------------------------


def test_write_file_replaces_a_link_and_leaves_its_target_alone(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(OUTSIDE)
    link = tmp_path / "out" / "config.json"
    link.parent.mkdir()
    link.symlink_to(outside)
    host.write_file(link, "new")
    assert not link.is_symlink() and link.read_text() == "new" and outside.read_bytes() == OUTSIDE
    host.write_file(link, lambda tmp: Path(tmp).write_bytes(b"by name"))  # a writer given the temporary file name
    assert link.read_bytes() == b"by name" and sorted(os.listdir(link.parent)) == ["config.json"]


def test_append_text_refuses_a_link(tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(OUTSIDE)
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(outside)
    with pytest.raises(OutputError, match=f"{link} is a symbolic link"):
        host.append_text(link, "{}\n")
    assert outside.read_bytes() == OUTSIDE
    host.append_text(tmp_path / "own.jsonl", "a\n")
    host.append_text(tmp_path / "own.jsonl", "b\n")
    assert (tmp_path / "own.jsonl").read_text() == "a\nb\n"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_write_file_on_a_refusing_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch, code):
    path = tmp_path / "manifest.json"
    path.write_text("old")
    monkeypatch.setattr(os, "replace", full_disk(0, code))
    with pytest.raises(OutputError, match=f"cannot write {path}: {os.strerror(code)}"):
        host.write_file(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["manifest.json"]  # no temporary file left


# -- links in output_dir --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "plant",
    [
        lambda out, elsewhere: link_file(out, ".lock", elsewhere / "lock"),
        lambda out, elsewhere: link_file(out, "config.json", elsewhere / "config.json"),
        lambda out, elsewhere: link_folder(out, "train/checkpoints", elsewhere / "checkpoints"),
        lambda out, elsewhere: link_file(out, "train/checkpoints/4/_CHECKPOINT_METADATA", elsewhere / "metadata"),
    ],
    ids=["lock", "config.json", "checkpoints-folder", "deep-file"],
)
def test_a_link_inside_output_dir_is_refused_before_anything_is_written(run_copy, tmp_path, capsys, plant):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = plant(run_copy, elsewhere)
    link = next(p for p in run_copy.rglob("*") if p.is_symlink())
    outside, inside = snapshot(elsewhere), snapshot(run_copy)
    capsys.readouterr()
    assert train_cli(run_copy, "--stages", "train", "training.steps=6") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"specjax-train: error: {link} is a symbolic link to {target}"), err
    assert snapshot(elsewhere) == outside and snapshot(run_copy) == inside


def test_the_lock_is_never_opened_through_a_link(tmp_path):
    (tmp_path / "run").mkdir()
    outside = link_file(tmp_path / "run", ".lock", tmp_path / "lock")
    with pytest.raises(InputError, match=r"\.lock in it is a symbolic link; remove the link"):
        with exclusive_output_dir(tmp_path / "run"):
            pass
    assert outside.read_bytes() == OUTSIDE


def test_output_dir_itself_may_be_a_link(tmp_path):
    (tmp_path / "real" / "train").mkdir(parents=True)
    (tmp_path / "run").symlink_to(tmp_path / "real")
    refuse_links_inside(tmp_path / "run")  # followed once: nothing inside is a link
    (tmp_path / "real" / "train" / "data").symlink_to(tmp_path)
    with pytest.raises(OutputError, match=f"{tmp_path / 'run' / 'train' / 'data'} is a symbolic link to {tmp_path}"):
        refuse_links_inside(tmp_path / "run")


# -- a full or read-only disk ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, after, refused",
    [(errno.ENOSPC, 3, "store/responses/"), (errno.EROFS, 4, "data/manifest.json")],
    ids=["full-at-the-second-unit", "read-only-at-the-manifest"],
)
def test_a_refusing_disk_stops_a_stage_in_one_line_and_the_rerun_resumes(
    finished, tmp_path, capsys, monkeypatch, code, after, refused
):
    # The regenerate stage writes config.json, eval_prompts.jsonl, the greedy unit, the sampled unit, the manifest.
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", full_disk(after, code))
        assert train_cli(out, "--stages", "regenerate") == 2
    line = error_line(capsys)
    assert line.startswith(f"specjax-train: error: cannot write {out}/{refused}") and line.endswith(os.strerror(code))
    units = sorted((out / "store" / "responses").iterdir())
    assert len(units) == after - 2 and not list(out.rglob(".*.tmp"))  # the finished units, no partial file
    before = snapshot(out / "store")

    assert train_cli(out, "--stages", "regenerate") == 0
    assert snapshot(out / "store").items() >= before.items()  # kept as they were, not written again
    manifest, reference = (json.loads((run / "data" / "manifest.json").read_text()) for run in (out, finished))
    assert manifest["shards"] == reference["shards"] and manifest["samples"] == reference["samples"]
    for unit in units:
        with np.load(unit) as got, np.load(finished / "store" / "responses" / unit.name) as want:
            assert all(np.array_equal(got[k], want[k]) for k in want)


def losses(run: Path) -> dict[int, float]:
    records = map(json.loads, (run / "train" / "metrics.jsonl").read_text().splitlines())
    return {record["step"]: record["loss"] for record in records}


@pytest.fixture
def file_size_limit():
    """Sets RLIMIT_FSIZE (a write past it fails with EFBIG, as a full disk fails with ENOSPC) for the block. The run's
    persistent compilation cache takes no new entry meanwhile: the limit would cut it short for every later reader."""
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    min_compile_seconds = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    yield lambda size: resource.setrlimit(resource.RLIMIT_FSIZE, (size, limits[1]))
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    signal.signal(signal.SIGXFSZ, handler)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)


def test_a_refused_checkpoint_stops_training_in_one_line_and_the_rerun_resumes(run_copy, capfd, file_size_limit):
    """Orbax writes checkpoints in background threads, through tensorstore: a real refused write, not a mock. What
    the threads print themselves is held back too (capfd: everything the process writes to stderr)."""
    checkpoints = run_copy / "train" / "checkpoints"
    before = snapshot(checkpoints)
    capfd.readouterr()
    file_size_limit(32 << 10)  # the metrics and records pass; a checkpoint's arrays do not
    assert train_cli(run_copy, "--stages", "train", "training.steps=6") == 2
    file_size_limit(resource.RLIM_INFINITY)
    assert error_line(capfd) == (
        f"specjax-train: error: cannot write a checkpoint in {checkpoints}: File too large; the checkpoints already "
        "written are intact: free space (or make the disk writable) and run again to resume"
    )
    assert snapshot(checkpoints).items() >= before.items()
    interrupted = losses(run_copy)  # steps 5 and 6 ran; only their checkpoint failed

    assert train_cli(run_copy, "--stages", "train", "training.steps=6") == 0
    assert "restored the checkpoint of step 4" in capfd.readouterr().err
    assert sorted(os.listdir(checkpoints)) == ["4", "6"]  # the interrupted save's leftovers removed
    assert losses(run_copy) == interrupted and list(interrupted) == [1, 2, 3, 4, 5, 6]


def test_a_metrics_line_cut_short_by_a_full_disk_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')
    truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
