"""The training config schema: YAML + overrides, unknown keys and wrong types are errors that say what is valid."""

from pathlib import Path

import pytest
import yaml

from specjax.config import build_config
from specjax.errors import InputError
from specjax.train.config import TrainConfig, config_to_dict, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMOKE = CONFIGS / "smoke.yaml"


def test_smoke_config_and_overrides():
    cfg = load_config(SMOKE, ["training.steps=5", "model.tap_layers=[0, 1, 2]", "output_dir=/tmp/x"])
    assert cfg.training.steps == 5 and cfg.model.tap_layers == (0, 1, 2) and cfg.output_dir == "/tmp/x"
    assert cfg.model.target == "tiny-random" and cfg.training.learning_rate == 3e-3
    assert load_config(None) == TrainConfig()


def test_float_fields_accept_ints_and_exponent_strings():
    # PyYAML reads `1e-4` (no dot) as a string: it must still be a learning rate.
    cfg = load_config(None, ["training.learning_rate=1e-4", "training.grad_clip=1"])
    assert cfg.training.learning_rate == 1e-4 and cfg.training.grad_clip == 1.0
    assert isinstance(cfg.training.grad_clip, float)


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(InputError, match=r"training\.stpes.*valid keys in training: .*steps"):
        load_config(SMOKE, ["training.stpes=3"])
    with pytest.raises(InputError, match="unknown config key.*valid keys: .*training"):
        load_config(None, ["trainnig.steps=3"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.steps=ten", "training.steps must be int"),
        ("training.steps=2.5", "training.steps must be int"),
        ("training.steps=true", "training.steps must be int"),
        ("training.batch_size=1099511627776", r"training.batch_size must be an integer below 2\*\*31"),
        ("training.seed=1208925819614629174706176", r"training.seed must be an integer below 2\*\*31"),
        ("training.learning_rate=fast", "training.learning_rate must be float"),
        ("model.tap_layers=3", "model.tap_layers must be a list"),
        ("model.tap_layers=[1, x]", r"model.tap_layers\[1\] must be int"),
        ("training=3", "training must be a mapping"),
        ("training.steps=0", r"training.steps=0 \(must be >= 1\)"),
        ("training.learning_rate=-1.0", r"training.learning_rate=-1.0 \(must be > 0\)"),
        ("training.learning_rate=.nan", r"training.learning_rate=nan \(must be > 0\)"),
        ("data.eval_prompts=-3", r"data.eval_prompts=-3 \(must be >= 0\)"),
        ("training.grad_clip=-1", r"training.grad_clip=-1.0 \(must be > 0\)"),
        ("training.warmup_steps=-4", r"training.warmup_steps=-4 \(must be >= 0\)"),
        ("training.final_lr_ratio=2", r"training.final_lr_ratio=2.0 \(must be in \[0, 1\]\)"),
        ("training.steps", "not of the form section.key=value"),
        ("training.compute_dtype=float16", "training.compute_dtype must be auto, bfloat16, float32; got 'float16'"),
        ("training.grad_accumulation=0", r"training.grad_accumulation=0 \(must be >= 1\)"),
        ("training.grad_accumulation=3", "batch_size=4 does not split into training.grad_accumulation=3 microbatches"),
        ("training.remat=3", "training.remat must be bool"),
        ("mesh.rules=3", "mesh.rules must be a mapping"),
        ("mesh.rules.vocab=3", "mesh.rules.vocab must be str"),
        ("mesh.rules.vocabulary=null", "mesh.rules: sharding rules name an unknown logical axis 'vocabulary'"),
        (
            "mesh.rules.vocab=model",
            r"mesh.rules: .*unknown mesh axis 'model' \(for vocab\).*mesh axes: data, fsdp, tensor",
        ),
    ],
)
def test_wrong_values_are_errors(override, message):
    with pytest.raises(InputError, match=message):
        load_config(SMOKE, [override])


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(InputError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [1,\n")
    with pytest.raises(InputError, match="not valid YAML"):
        load_config(bad)


def test_round_trip_through_dict():
    cfg = load_config(SMOKE, ["model.tap_layers=[0, 1, 2]", "mesh.rules.mlp=[tensor, fsdp]"])
    raw = config_to_dict(cfg)
    assert raw["model"]["tap_layers"] == [0, 1, 2]
    assert build_config(TrainConfig, yaml.safe_load(yaml.safe_dump(raw))) == cfg


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    cfg = load_config(path)  # the schema only: the target (a Hub name, for the 8B recipes) is not loaded here
    assert cfg.model.target and cfg.output_dir.startswith("runs/")
    if cfg.data.store:
        assert Path(cfg.data.store).is_dir(), cfg.data.store  # a committed store, found from the config's folder


def test_a_relative_store_is_relative_to_the_config_file(tmp_path, monkeypatch):
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "run.yaml").write_text("data:\n  store: ../stores/a\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_config(folder / "run.yaml").data.store == str(tmp_path / "stores" / "a")
    assert load_config(Path("../recipes/run.yaml")).data.store == str(tmp_path / "stores" / "a")
    (folder / "abs.yaml").write_text(f"data:\n  store: {tmp_path / 'b'}\n")
    assert load_config(folder / "abs.yaml").data.store == str(tmp_path / "b")
    # On the command line a path is the user's, relative to the working directory; unset, output_dir/store.
    assert load_config(folder / "run.yaml", ["data.store=s"]).data.store == "s"
    assert load_config(None).data.store is None


def test_a_moved_store_does_not_make_a_run_another_run(tmp_path):
    from specjax.train.run import check_record, record_config

    record_config(load_config(SMOKE, [f"output_dir={tmp_path}", "data.store=/old/store"]))
    check_record(load_config(SMOKE, [f"output_dir={tmp_path}", "data.store=/new/store"]))
    with pytest.raises(InputError, match="different data settings"):
        check_record(load_config(SMOKE, [f"output_dir={tmp_path}", "data.num_prompts=17"]))


def test_gradient_accumulation_is_for_eagle3_heads():
    with pytest.raises(InputError, match="training.grad_accumulation applies to EAGLE-3 heads"):
        load_config(SMOKE, ["model.drafter=dflash", "dflash.mask_token_id=5", "training.grad_accumulation=2"])
