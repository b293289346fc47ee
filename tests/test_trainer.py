"""The EAGLE-3 trainer: sharded and multi-process steps equal single-device ones, exact resume after SIGKILL,
divergence stops with the last checkpoint intact, bad CLI input is one line and writes nothing, the smoke pipeline."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import COMPILE_FAST

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import train_tiny  # noqa: E402

from specjax.cli.train import entry  # noqa: E402
from specjax.errors import SpecjaxError  # noqa: E402
from specjax.train.data import load_samples  # noqa: E402
from specjax.train.trainer import TrainingDiverged, checkpoint_manager, restore_latest, to_global, train  # noqa: E402
from specjax.train.vocab import draft_vocab  # noqa: E402

SMOKE = ROOT / "configs" / "smoke.yaml"


_CACHE: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    """Subprocesses that compile the same step (kill, resume, uninterrupted) share a fresh persistent cache."""
    _CACHE.append(tmp_path_factory.mktemp("jax-cache"))
    yield
    _CACHE.clear()


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = COMPILE_FAST  # without the parent's device count or oneDNN dots
    if _CACHE:
        env.update(
            JAX_COMPILATION_CACHE_DIR=str(_CACHE[0]),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
        )
    return env


def _script(name: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE / name), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )


def _finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- 3. fake devices ---------------------------------------------------------------------------------------------


SHARDED_STEPS = 20


@pytest.fixture(scope="module")
def single_device_losses():
    """The first SHARDED_STEPS losses of the tiny setup on one device (this process)."""
    _, trainer, source = train_tiny.build(mesh_axes={"data": 1, "fsdp": 1, "tensor": 1})
    return train_tiny.first_losses(trainer, source, SHARDED_STEPS)


@pytest.mark.parametrize("mesh", ["2,2,2,2", pytest.param("8,1,1", marks=pytest.mark.slow)])
def test_sharded_meshes_equal_single_device(single_device_losses, mesh):
    """8 fake CPU devices, meshes data x fsdp x tensor = 2x2x2 (in two microbatches a step) and 8x1x1, the target
    loaded from its files into its shards and run in the step (features online): 20 losses equal a single device's
    (the script also asserts that the trainer keeps the loaded target, that weights, Adam moments and batches really
    are split, and that the loaded target decodes as the unsharded one)."""
    out = _finish(_script("train_sharded.py", SHARDED_STEPS, mesh))
    (line,) = [line.split() for line in out.splitlines() if line.startswith("losses")]
    assert line[1:4] == mesh.split(",")[:3], out
    if mesh == "2,2,2,2":
        assert "q" in line[-3].split(",")  # the head's q projection is split
        assert line[-1] == "tensor"  # the default rules split the vocabulary over the tensor axis
    np.testing.assert_allclose(json.loads(line[4]), single_device_losses, rtol=1e-5)


def test_the_configs_mesh_rules_move_a_weight_and_keep_the_losses(single_device_losses):
    """mesh.rules.vocab=null on a 2x2x2 mesh: the target (loaded with the run's rules) and the trainer keep the
    vocabulary whole on every device instead of split over "tensor", and the first losses equal a single device's."""
    steps = 4
    out = _finish(_script("train_sharded.py", steps, "2,2,2", "mesh.rules.vocab=null"))
    (line,) = [line.split() for line in out.splitlines() if line.startswith("losses")]
    assert line[-2:] == ["vocabulary:", "none"], out
    np.testing.assert_allclose(json.loads(line[4]), single_device_losses[:steps], rtol=1e-5)


def test_gradient_accumulation_gives_the_update_of_one_batch():
    """training.grad_accumulation=2 (two microbatches of 4 rows with unequal numbers of supervised rows): one step
    gives the weights, Adam state and metrics of one batch of 8."""
    states = {}
    for n in (1, 2):
        _, trainer, source = train_tiny.build([f"training.grad_accumulation={n}"])
        states[n] = trainer.step(trainer.initial_state, source.batch(0))
    mask = source.batch(0)["loss_mask"]
    assert mask[0::2].sum() != mask[1::2].sum()  # the microbatches weigh differently: a plain mean would differ
    for a, b in zip(jax.tree.leaves(states[2]), jax.tree.leaves(states[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)


def test_bfloat16_compute_trains_float32_master_weights():
    """training.compute_dtype=bfloat16 on the CPU: the step's matmuls run in bfloat16, the loss on the batch it
    trains on falls, and the weights and Adam's moments stay float32."""
    _, trainer, source = train_tiny.build(
        ["training.compute_dtype=bfloat16", "training.steps=12", "training.learning_rate=0.03"]
    )
    batch = source.batch(0)
    placed = {k: to_global(v, trainer.batch_sharding) for k, v in batch.items()}
    hlo = trainer._step.lower(trainer.initial_state, trainer.target_weights, placed).as_text()
    assert re.search(r"dot_general.*bf16", hlo)
    state, losses = trainer.initial_state, []
    for _ in range(12):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.3 and all(np.isfinite(losses)), losses
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.float32)}
    adam = state["opt_state"][1][0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.float32)}


# -- 4. two processes --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_and_resume_exactly_after_sigkill(tmp_path, single_device_losses):
    """jax.distributed on localhost with gloo CPU collectives, one device per process, mesh data=2, each process
    building only its own rows of every batch: both processes are SIGKILLed after step 4 (checkpoint 3 on disk), two
    new ones resume at step 4 and finish step 6. The losses are one device's; checkpoints and metrics are written
    once, without duplicate steps, and both processes export the same head."""

    def pair(*args):
        port = _free_port()
        return [_script("train_multiprocess.py", port, 2, i, tmp_path, 6, *args) for i in range(2)]

    def losses(lines):
        return {int(line.split()[1]): float(line.split()[2]) for line in lines if line.startswith("loss ")}

    victims, seen = pair("--hang-after=4"), []
    try:
        for victim in victims:
            seen.append([])
            for line in victim.stdout:
                if line.strip() == "hanging":
                    break
                seen[-1].append(line)
            else:
                pytest.fail(f"the run ended before step 4: {victim.stderr.read()[-3000:]}")
    finally:
        for victim in victims:
            victim.kill()
            victim.communicate()
    assert [victim.returncode for victim in victims] == [-signal.SIGKILL] * 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]
    outs = [_finish(p) for p in pair()]

    def field(out, name):
        return json.loads(next(line for line in out.splitlines() if line.startswith(name + " "))[len(name) + 1 :])

    for before, after in zip(seen, outs):
        assert sorted(losses(before)) == [1, 2, 3, 4] and sorted(losses(after.splitlines())) == [4, 5, 6]
        found = losses(before) | losses(after.splitlines())
        np.testing.assert_allclose([found[s] for s in range(1, 7)], single_device_losses[:6], rtol=1e-5)
        assert losses(before)[4] == losses(after.splitlines())[4]  # the resumed step 4 is the killed run's, exactly
    assert field(outs[0], "head") == field(outs[1], "head")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3", "6"]
    assert [m["step"] for m in _metrics(tmp_path)] == list(range(1, 7))


# -- 5. SIGKILL and resume ---------------------------------------------------------------------------------------


def test_sigkill_between_checkpoints_then_resume_is_exact(tmp_path):
    steps = 8
    victim = _script("train_tiny.py", tmp_path / "killed", steps, "--hang-after=4")
    try:
        for line in victim.stdout:
            if line.strip() == "hanging":  # after step 4, once checkpoint 3 is on disk
                break
        else:
            pytest.fail(f"the run ended before step 4: {victim.stderr.read()[-3000:]}")
        # Step 4 is logged and the process is between checkpoints 3 and 6.
        assert [m["step"] for m in _metrics(tmp_path / "killed")] == [1, 2, 3, 4]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
    finally:
        victim.kill()
        victim.communicate()
    assert victim.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["3"]

    # The resumed run and an uninterrupted one, side by side (both reuse the victim's compiled step).
    resumed = _script("train_tiny.py", tmp_path / "killed", steps)
    uninterrupted = _script("train_tiny.py", tmp_path / "whole", steps)
    resumed_out = _finish(resumed)
    assert resumed_out.splitlines()[0] == "step 4"  # restarted after checkpoint 3
    _finish(uninterrupted)

    def comparable(records):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]

    killed, whole = _metrics(tmp_path / "killed"), _metrics(tmp_path / "whole")
    assert [m["step"] for m in killed] == list(range(1, steps + 1))  # no duplicate or missing steps
    assert comparable(killed) == comparable(whole)  # bit for bit: exact floats


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys):
    _, trainer, source = train_tiny.build(["training.steps=6", "checkpoint.every=2", "checkpoint.keep=3"])
    train(trainer, source, tmp_path, stop_after=4)
    rng = np.random.default_rng(0)
    for path in (tmp_path / "checkpoints" / "4").rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(rng.bytes(path.stat().st_size))  # every file of step 4 is garbage
    manager = checkpoint_manager(trainer, tmp_path)
    state = restore_latest(trainer, manager)
    manager.close()
    err = capsys.readouterr().err
    assert int(state["step"]) == 2 and "the checkpoint of step 4 is damaged" in err
    assert (tmp_path / "corrupt-checkpoints" / "4").is_dir()
    final = train(trainer, source, tmp_path)  # training goes on from step 2, and saves step 4 again
    assert int(final["step"]) == 6 and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2", "4", "6"]
    assert [m["step"] for m in _metrics(tmp_path)] == list(range(1, 7))
    for step in ("2", "4", "6"):  # now every checkpoint is damaged: one clear error
        for path in (tmp_path / "checkpoints" / step).rglob("*"):
            if path.is_file() and "metadata" in path.name.lower():
                path.unlink()
    with pytest.raises(SpecjaxError, match="no intact checkpoint in .*; delete the train folder"):
        restore_latest(trainer, checkpoint_manager(trainer, tmp_path))


# -- 6. divergence -----------------------------------------------------------------------------------------------


def test_divergence_before_any_checkpoint_says_to_start_again(tmp_path):
    _, trainer, source = train_tiny.build(
        ["training.learning_rate=1e30", "training.warmup_steps=0", "training.steps=4", "checkpoint.every=1"]
    )
    with pytest.raises(TrainingDiverged, match="at step 1, before any checkpoint; lower training.learning_rate"):
        train(trainer, source, tmp_path)  # the first update already throws the weights far past PARAM_LIMIT
    assert checkpoint_manager(trainer, tmp_path).latest_step() is None and _metrics(tmp_path) == []


def test_a_diverged_run_resumes_from_its_last_good_checkpoint_with_a_lower_learning_rate(tmp_path):
    base = ["training.warmup_steps=0", "training.steps=6", "checkpoint.every=1", "checkpoint.keep=2"]
    _, trainer, source = train_tiny.build(base)
    train(trainer, source, tmp_path, stop_after=3)
    _, trainer, source = train_tiny.build([*base, "training.learning_rate=1e30"])  # the same run, a wild rate
    with pytest.raises(TrainingDiverged) as info:
        train(trainer, source, tmp_path)
    assert isinstance(info.value, SpecjaxError)
    message = str(info.value)
    assert "at step 4; the last good checkpoint (step 3) is intact: run again with the same output_dir" in message
    assert "(beyond 10000)" in message or "the loss became" in message
    manager = checkpoint_manager(trainer, tmp_path)
    state = restore_latest(trainer, manager)
    manager.close()
    assert int(state["step"]) == 3  # "last good" means finite loss and finite, bounded weights
    assert all(bool(jnp.abs(x).max() <= 1e4) for x in jax.tree.leaves(state["params"]))
    # As the message says: the same output_dir and a sane rate resume at step 4 and finish.
    _, trainer, source = train_tiny.build([*base, "training.learning_rate=0.005"])
    final = train(trainer, source, tmp_path)
    assert int(final["step"]) == 6 and [m["step"] for m in _metrics(tmp_path)] == list(range(1, 7))


def test_a_resumed_run_may_change_optimiser_settings_but_not_the_model_or_data(tmp_path, capsys):
    from specjax.train.config import load_config
    from specjax.train.run import check_record, record_config

    first = load_config(SMOKE, [f"output_dir={tmp_path}"])
    record_config(first)
    (tmp_path / "train").mkdir()
    check_record(
        load_config(
            SMOKE,
            [f"output_dir={tmp_path}", "training.learning_rate=1e-4", "training.grad_clip=2.0", "training.steps=50"],
        )
    )
    assert "resuming with changed training settings" in capsys.readouterr().err
    for other in ("training.seq_len=64", "training.ttt_length=2", "data.max_new_tokens=8"):
        with pytest.raises(SpecjaxError, match="holds a run made with different"):
            check_record(load_config(SMOKE, [f"output_dir={tmp_path}", other]))


# -- 7 and 8. the CLI and the smoke pipeline --------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """configs/smoke.yaml run end to end through the CLI into a fresh folder."""
    out = tmp_path_factory.mktemp("smoke") / "run"
    with pytest.raises(SystemExit) as exit_info:
        entry(["--config", str(SMOKE), f"output_dir={out}"])
        raise SystemExit(0)
    assert exit_info.value.code in (0, None)
    return out


def test_smoke_pipeline_exports_a_loadable_head(smoke_run):
    from specjax.io.eagle3_checkpoint import load_eagle3
    from specjax.io.loading import load_model
    from specjax.models.kv_cache import KVCache
    from specjax.models.llama import forward

    out = smoke_run
    for name in (
        "data/manifest.json",
        "vocab.npz",
        "features/manifest.json",
        "train/metrics.jsonl",
        "export/config.json",
        "export/model.safetensors",
        "config.json",
    ):
        assert (out / name).is_file(), name
    steps = [m["step"] for m in _metrics(out / "train")]
    assert steps == sorted(set(steps)) and steps[-1] == 24

    # The standard-library answers follow the regenerated samples; the draft vocabulary counts only the latter.
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    regenerated = load_samples(out / "data", regenerated_only=True)
    assert len(regenerated) == manifest["samples"] == 16 and manifest["source_tokens"] >= 600
    assert len(load_samples(out / "data")) == manifest["samples"] + manifest["source_samples"]
    with np.load(out / "vocab.npz") as z:
        d2t, t2d = z["d2t"], z["t2d"]
    assert d2t.shape == (512,) and t2d.sum() == 512
    by_size = json.loads((out / "vocab.json").read_text())["coverage_by_size"]
    assert list(by_size) == ["512", "4096", "8192", "16384"]  # the configured size and the reported ones
    assert all(
        0 < row["heldout"] <= row_next["heldout"] <= 1
        for row, row_next in zip(by_size.values(), list(by_size.values())[1:])
    )
    assert json.loads((out / "eval.json").read_text())["sets"]["heldout"]["prompts"] == 4
    np.testing.assert_array_equal(np.nonzero(t2d)[0], np.arange(len(d2t)) + d2t)
    target = load_model("tiny-random")
    np.testing.assert_array_equal(draft_vocab(regenerated, target.cfg.vocab_size, 512)[0], d2t)

    head_cfg, head = load_eagle3(out / "export", target.cfg)
    np.testing.assert_array_equal(np.asarray(head.d2t[...]), d2t)
    tokens = jnp.asarray([[1, 5, 9, 13, 40, 77]], jnp.int32)
    positions = jnp.arange(6)[None]
    _, taps, _ = forward(
        target.weights, target.cfg, tokens, positions, KVCache.empty(target.cfg, 1, 8), tap_layers=head_cfg.tap_layers
    )
    embed = head.embed_tokens(jnp.roll(tokens, -1, axis=1), target.weights.embed)
    logits, out_prenorm, _ = head.step(embed, head.fuse(taps), positions, head.empty_cache(1, 8))
    assert logits.shape == (1, 6, 512) and bool(jnp.isfinite(logits).all())
    assert bool(jnp.isfinite(out_prenorm).all())

    # The exported head drafts for real: greedy EAGLE-3 decoding (chain and tree) equals autoregressive decoding.
    from specjax.decoding import speculative
    from specjax.decoding.autoregressive import generate
    from specjax.drafters import load_eagle3_drafter
    from specjax.drafters.tree import TreeSpec

    prompts = [target.tokenizer.chat_prompt_ids(p) for p in ("Hello!", "Write a function that adds two numbers.")]
    expected = [c.output_ids for c in generate(target.weights, target.cfg, prompts, max_new_tokens=16).completions]
    for tree in (None, TreeSpec(3, 2, 6)):
        drafter = load_eagle3_drafter(str(out / "export"), target.cfg, target.weights.embed, tree)
        result = speculative.speculative_generate(
            target.weights, target.cfg, prompts, drafter=drafter, num_draft_tokens=3, max_new_tokens=16
        )
        assert [c.output_ids for c in result.completions] == expected


@pytest.fixture(scope="module")
def dflash_run(smoke_run, tmp_path_factory):
    """configs/smoke.yaml with model.drafter=dflash through the CLI, reading the smoke run's store and features (the
    draft's taps are the head's: DFlash layer ids 1, 1, 0)."""
    out = tmp_path_factory.mktemp("dflash") / "run"
    overrides = [
        f"output_dir={out}",
        f"data.store={smoke_run / 'store'}",
        f"training.features_dir={smoke_run / 'features'}",
        "model.drafter=dflash",
        "model.tap_layers=[2, 2, 1]",
        "dflash.mask_token_id=5",
        "dflash.block_size=4",
        "dflash.num_anchors=16",
        "training.steps=16",
        "evaluation.num_prompts=2",
        "evaluation.max_new_tokens=12",
    ]
    with pytest.raises(SystemExit) as exit_info:
        entry(["--config", str(SMOKE), *overrides])
        raise SystemExit(0)
    assert exit_info.value.code in (0, None)
    return out


def test_dflash_pipeline_trains_and_exports_a_draft_that_decodes_exactly(dflash_run):
    from specjax.decoding import speculative
    from specjax.decoding.autoregressive import generate
    from specjax.drafters import drafter_from_spec
    from specjax.io.loading import load_model

    out = dflash_run
    assert not (out / "features").exists()  # read from the smoke run's
    metrics = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [4, 8, 12, 16] and len(metrics[-1]["acc_k"]) == 3
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    evaluation = json.loads((out / "eval.json").read_text())["sets"]["heldout"]
    assert evaluation["prompts"] == 2 and evaluation["chain"]["drafts"] == "block of 4, K=3"
    assert "# DFlash draft for `tiny-random`" in (out / "export" / "README.md").read_text()

    target = load_model("tiny-random")
    drafter = drafter_from_spec(f"dflash:{out / 'export'}", target.weights, target.cfg)
    assert drafter.weights.vocab_ids.shape == (512,)  # the run's draft vocabulary
    prompts = [target.tokenizer.chat_prompt_ids(p) for p in ("Hello!", "Write a function that adds two numbers.")]
    expected = [c.output_ids for c in generate(target.weights, target.cfg, prompts, max_new_tokens=16).completions]
    result = speculative.speculative_generate(
        target.weights, target.cfg, prompts, drafter=drafter, num_draft_tokens=3, max_new_tokens=16
    )
    assert [c.output_ids for c in result.completions] == expected


def _snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_init_from_starts_at_an_exported_head_and_its_vocabulary(smoke_run, tmp_path):
    from specjax.io.eagle3_checkpoint import load_eagle3
    from specjax.io.loading import load_model
    from specjax.train.config import load_config
    from specjax.train.run import build_trainer

    cfg = load_config(SMOKE, [f"output_dir={tmp_path}", f"training.init_from={smoke_run / 'export'}"])
    model = load_model(cfg.model.target)
    start = build_trainer(cfg, model).draft  # no vocab stage in tmp_path: the head brings its own
    _, exported = load_eagle3(smoke_run / "export", model.cfg)
    head = start.head(start.params)
    for name in ("fc", "q", "down", "final_norm", "lm_head", "d2t", "t2d"):
        np.testing.assert_array_equal(getattr(head, name)[...], getattr(exported, name)[...], err_msg=name)
    assert np.abs(np.asarray(head.lm_head[...])).max() > 0.1  # trained weights, not the 0.02-scale random start


def test_a_dflash_run_can_start_at_an_exported_draft_of_its_shape(dflash_run, tmp_path):
    from specjax.io.dflash_checkpoint import load_dflash
    from specjax.io.loading import load_model
    from specjax.train.config import load_config
    from specjax.train.run import build_trainer, validate

    shape = [
        "model.drafter=dflash",
        "model.tap_layers=[2, 2, 1]",
        "dflash.mask_token_id=5",
        f"training.init_from={dflash_run / 'export'}",
    ]
    cfg = load_config(SMOKE, [f"output_dir={tmp_path}", *shape, "dflash.block_size=4"])
    model = load_model(cfg.model.target)
    start = build_trainer(cfg, model).draft  # no vocab stage in tmp_path: the draft brings its own
    _, exported = load_dflash(dflash_run / "export", model.cfg)
    trained = (exported.fc, exported.hidden_norm, exported.layers, exported.norm)
    for got, want in zip(jax.tree.leaves(start.params), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(start.vocab_ids, exported.vocab_ids)
    other = load_config(SMOKE, [f"output_dir={tmp_path}", *shape, "dflash.block_size=5"])
    with pytest.raises(SpecjaxError, match=r"another shape: block_size 4 \(run: 5\)"):
        validate(other, model, ["train"])


def test_init_from_takes_a_shipped_head_by_name():
    from specjax.drafters.registry import SHIPPED_DRAFTS
    from specjax.io.loading import load_model
    from specjax.train.config import load_config
    from specjax.train.run import initial_draft

    cfg = load_config(ROOT / "configs" / "smollm2-eagle3.yaml", ["training.init_from=smollm2-135m"])
    model = load_model(cfg.model.target)
    with pytest.raises(SpecjaxError, match=r"another shape: draft_vocab_size 4096 \(run: 8192\)"):
        initial_draft(cfg, model)
    cfg = load_config(
        ROOT / "configs" / "smollm2-eagle3.yaml", ["training.init_from=smollm2-135m", "model.draft_vocab_size=4096"]
    )
    assert initial_draft(cfg, model)[0].tap_layers == (2, 15, 27)
    assert all(folder.is_dir() for folder in SHIPPED_DRAFTS.values())


def test_evaluate_before_any_step_measures_the_starting_head_of_an_init_from_run(smoke_run, tmp_path, capsys):
    stages = [
        "--config",
        str(SMOKE),
        "--stages",
        "evaluate",
        "evaluation.sets=[chat]",
        "evaluation.num_prompts=2",
        "evaluation.max_new_tokens=8",
    ]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(smoke_run / "vocab.npz", fresh)  # a vocabulary, but no step trained
    with pytest.raises(SystemExit) as exit_info:
        entry([*stages, f"output_dir={fresh}"])
    assert exit_info.value.code == 2
    assert "train holds no checkpoint; run the train stage first" in capsys.readouterr().err

    out = tmp_path / "continued"
    with pytest.raises(SystemExit) as exit_info:
        entry([*stages, f"output_dir={out}", f"training.init_from={smoke_run / 'export'}"])
        raise SystemExit(0)
    assert exit_info.value.code in (0, None)
    report = json.loads((out / "eval.json").read_text())
    assert report["step"] == 0 and report["sets"]["chat"]["prompts"] == 2
    assert report["sets"]["chat"]["chain"]["mean_accepted"] >= 1


def test_a_continued_head_card_carries_the_starting_heads_data_and_training(smoke_run, tmp_path):
    from specjax.io.eagle3_checkpoint import load_eagle3
    from specjax.io.loading import load_model
    from specjax.train.config import load_config
    from specjax.train.kinds import draft_kind
    from specjax.train.model_card import model_card

    start = (smoke_run / "export" / "README.md").read_text()
    cfg = load_config(SMOKE, [f"output_dir={tmp_path}", f"training.init_from={smoke_run / 'export'}"])
    head_cfg, _ = load_eagle3(smoke_run / "export", load_model("tiny-random").cfg)
    card = draft_kind(cfg).card
    once = model_card(cfg, card, head_cfg, {}, None, None, None, start)
    twice = model_card(cfg, card, head_cfg, {}, None, None, None, once)
    assert "these steps continue the head" in once and "these steps continue the head" not in start
    for card, depth in ((once, 1), (twice, 2)):
        lines = card.splitlines()
        heading = "#" * (depth + 1) + " Starting head"
        assert heading in lines and "#" * (depth + 2) + " Training" in lines
        assert lines.index(heading) < lines.index("## Evaluation")  # inside the part the next card copies
    # The smoke head's 24 steps appear once however deep; each continuation adds its own (here 0: no metrics).
    assert [card.count("- 24 steps of 4 packed rows") for card in (start, once, twice)] == [1, 1, 1]
    assert [card.count("- 0 steps of 4 packed rows") for card in (start, once, twice)] == [0, 1, 2]


def test_a_second_run_on_the_same_output_dir_is_refused(smoke_run, capsys):
    from specjax.train.run import exclusive_output_dir

    with exclusive_output_dir(smoke_run):  # another run holds the folder
        with pytest.raises(SystemExit) as exit_info:
            entry(["--config", str(SMOKE), f"output_dir={smoke_run}", "--stages", "export"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(
        rf"{smoke_run} is in use by another specjax-train run \(pid {os.getpid()} on ", err[0]
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.stpes=3"], r"unknown config key\(s\) training\.stpes; valid keys in training: .*steps"),
        (["training.steps=many"], r"training\.steps must be int, got 'many'"),
        (["data.prompts=/nonexistent/prompts.jsonl"], r"cannot read prompts file '/nonexistent/prompts\.jsonl'"),
        (["mesh.data=-1", "mesh.fsdp=2"], r"does not divide the 1 available devices"),
        (["mesh.data=2"], r"needs 2 devices, but 1 are available"),
        (["model.tap_layers=[1, 2, 9]"], r"tap layers \[1, 2, 9\] must be .* 0\.\.3"),
        (["--stages", "regenerate,vocab", "model.tap_layers=[0, 7]"], r"tap layers \[0, 7\] must be .* 0\.\.3"),
        (["training.seq_len=64"], r"holds a run made with different training settings"),
        (["--stages", "train,evalute"], r"unknown stage"),
        (["output_dir=/proc/specjax-run"], r"cannot use output_dir '/proc/specjax-run'"),
        ([f"output_dir={SMOKE}"], r"output_dir '.*smoke.yaml' is a file; choose a folder"),
        (["training.init_from=/nonexistent/head"], r"training.init_from: .*/nonexistent/head"),
        (
            ["training.init_from=EXPORT", "model.draft_vocab_size=256"],
            r"another shape: draft_vocab_size 512 \(run: 256\)",
        ),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "missing-prompts",
        "mesh-indivisible",
        "mesh-too-big",
        "tap-layers",
        "tap-layers-before-regenerate",
        "other-config",
        "unavailable-stage",
        "output-dir-unusable",
        "output-dir-a-file",
        "init-from-missing",
        "init-from-other-shape",
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(smoke_run, capsys, overrides, message):
    before = _snapshot(smoke_run)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        entry(
            [
                "--config",
                str(SMOKE),
                f"output_dir={smoke_run}",
                *(o.replace("EXPORT", str(smoke_run / "export")) for o in overrides),
            ]
        )
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specjax-train: error: "), err
    assert "Traceback" not in err
    assert re.search(message, lines[0]), lines[0]
    assert _snapshot(smoke_run) == before  # nothing created, changed or touched
