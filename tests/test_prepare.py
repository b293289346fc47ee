"""Decoding set up in the library (`specjax.prepare`): the config read like the trainer's, the drafter, policy and
memory plan of a fixed K, lookup first and adaptive drafting, and refusals whose advice is in the config's terms (and
in flags on the command line)."""

import json
import logging

import jax.numpy as jnp
import pytest

from specjax import host, prepare
from specjax.adaptive import Adaptive, Fixed
from specjax.cli import common as cli
from specjax.cli import generate as generate_cli
from specjax.config import ModelConfig, SamplingConfig
from specjax.drafters import LookupFirstDrafter, ModelDrafter, NgramDrafter
from specjax.errors import InputError
from specjax.io.loading import tiny_random_model
from specjax.measure import calibration
from specjax.measure.memory import memory_plan
from specjax.models import llama
from specjax.prepare import DecodeConfig, Decoding, decoding_memory_plan, load_decode_config, prepare_decoding

MODEL = tiny_random_model()
SHAPE = dict(rows=2, prompt_len=8, max_new_tokens=8)


def test_the_config_reads_like_the_trainers(tmp_path):
    path = tmp_path / "decode.yaml"
    path.write_text("drafter: ngram\nnum_draft_tokens: 3\nsampling:\n  temperature: 0.7\n")
    config = load_decode_config(path, ["rows=4", "sampling.top_p=0.9"])
    assert config == DecodeConfig(
        drafter="ngram", num_draft_tokens=3, sampling=SamplingConfig(temperature=0.7, top_p=0.9), rows=4
    )
    assert load_decode_config({"num_draft_tokens": "auto", "tree": "3,2,6"}).tree == "3,2,6"
    assert load_decode_config() == DecodeConfig()
    with pytest.raises(
        InputError, match=r"unknown config key\(s\) drafterr; valid keys: .*drafter, engine, lookup_tokens"
    ):
        load_decode_config({"drafterr": "ngram"})
    with pytest.raises(InputError, match=r"unknown config key\(s\) sampling\.temp; valid keys in sampling: "):
        load_decode_config(None, ["sampling.temp=1"])
    with pytest.raises(InputError, match="num_draft_tokens must be an integer K or 'auto', got 'many'"):
        load_decode_config({"num_draft_tokens": "many"})
    with pytest.raises(InputError, match="rows must be >= 1, got 0"):
        DecodeConfig(rows=0)
    with pytest.raises(InputError, match="^tree takes depth,topk,budget"):
        DecodeConfig(tree="3,2")


def test_a_fixed_k_gives_its_drafter_policy_and_plan():
    decoding = prepare_decoding(MODEL, DecodeConfig(drafter="ngram", num_draft_tokens=3, **SHAPE))
    assert isinstance(decoding.drafter, NgramDrafter) and decoding.policy == Fixed(3)
    expected = memory_plan(
        MODEL.cfg,
        jnp.float32,
        batch=2,
        prompt_len=8,
        max_new_tokens=8,
        drafter=decoding.drafter,
        draft_shape=decoding.drafter.draft_shape(3),
        target_weights=MODEL.weights,
    )
    assert decoding.plan == expected
    assert prepare_decoding(MODEL, DecodeConfig(**SHAPE)) == Decoding(
        None,
        Fixed(0),
        memory_plan(MODEL.cfg, jnp.float32, batch=2, prompt_len=8, max_new_tokens=8, target_weights=MODEL.weights),
    )


def test_lookup_first_verifies_the_larger_of_its_two_drafts_and_a_model_draft_loads_beside_the_target():
    config = DecodeConfig(drafter="ngram+model:tiny-random", num_draft_tokens=2, lookup_tokens=4, **SHAPE)
    decoding = prepare_decoding(MODEL, config)
    assert isinstance(decoding.drafter, LookupFirstDrafter) and decoding.policy == Fixed(4)
    assert decoding.drafter.fallback_tokens == 2 and isinstance(decoding.drafter.fallback, ModelDrafter)
    assert decoding.drafter.fallback.weights.embed.dtype == MODEL.weights.embed.dtype


def test_auto_calibrates_the_menu_once_and_reports_its_costs(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(host.log, "propagate", True)  # the status lines, to caplog
    caplog.set_level(logging.INFO, logger="specjax")
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))

    # Round times of 1 + 0.2 K plain steps, as calibration would measure them (tests/test_adaptive.py measures them).
    def timed(weights, cfg, drafter, menu, **kw):
        return {"step_s": 0.01, "prefill_token_s": 1e-4, "round_s": [0.01 + 0.002 * k for k in menu]}

    monkeypatch.setattr(calibration, "round_seconds", timed)
    decoding = prepare_decoding(MODEL, DecodeConfig(drafter="ngram", num_draft_tokens="auto", **SHAPE))
    assert isinstance(decoding.policy, Adaptive) and decoding.policy.menu[0] == 0
    # Planned for the deepest draft the menu may compile.
    deepest = DecodeConfig(drafter="ngram", num_draft_tokens=calibration.auto_max_drafts(decoding.drafter), **SHAPE)
    assert decoding.plan == prepare_decoding(MODEL, deepest).plan
    costs = prepare.menu_costs(decoding.policy)
    rows = SHAPE.get("rows", 1)
    assert f"adaptive drafting, estimated cost of a round of {rows} rows in plain steps: {costs}" in caplog.messages
    assert costs.startswith("0: 1.00, ") and decoding.by_rows == {}

    # An engine's buckets, each calibrated: here a draft token costs as much more as the rows it is drafted for.
    def timed_by_rows(weights, cfg, drafter, menu, *, batch, **kw):
        return {"step_s": 0.01, "prefill_token_s": 1e-4, "round_s": [0.01 + 0.0005 * k * batch for k in menu]}

    monkeypatch.setattr(calibration, "round_seconds", timed_by_rows)
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "engine"))
    engine = prepare_decoding(MODEL, DecodeConfig(drafter="ngram", **{**SHAPE, "rows": 4, "engine": True}))
    assert sorted(engine.by_rows) == [1, 2, 4] and engine.policy is engine.by_rows[4]
    assert len({p.menu for p in engine.by_rows.values()}) == 1  # one menu: the engine's programs share it
    assert float(engine.by_rows[1].cost[-1]) < float(engine.by_rows[2].cost[-1]) < float(engine.by_rows[4].cost[-1])
    with pytest.raises(InputError, match="^lookup_tokens needs a fixed num_draft_tokens$"):
        prepare_decoding(MODEL, DecodeConfig(drafter="ngram+layerskip:1", lookup_tokens=4, **SHAPE))


def test_a_plan_that_does_not_fit_is_refused_in_the_configs_terms_and_on_the_command_line_in_flags(monkeypatch, capsys):
    monkeypatch.setattr(prepare, "device_memory", lambda: 2**10)
    config = DecodeConfig(drafter="ngram", num_draft_tokens=3, **SHAPE)
    with pytest.raises(InputError, match=r"the device holds 0\.00 GiB; not even one row fits: lower max_new_tokens$"):
        prepare_decoding(MODEL, config)
    assert decoding_memory_plan(MODEL, config).batch == 2  # the plan alone is not refused
    with pytest.raises(SystemExit) as exit_info:
        generate_cli.entry(
            ["--model", "tiny-random", "--prompt", "Hi", "--drafter", "ngram", "--num-draft-tokens", "3"]
        )
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.endswith("not even one row fits: lower --max-new-tokens"), err


def test_weights_that_do_not_fit_advise_int8_in_the_configs_terms_and_on_the_command_line_in_flags(
    monkeypatch, capsys, tiny_folder
):
    cfg = ModelConfig.from_hf(json.loads((tiny_folder / "config.json").read_text()))
    monkeypatch.setattr(llama, "device_memory", lambda: llama.weight_bytes(cfg, jnp.float32, quantize="int8"))
    with pytest.raises(InputError, match=r"^tiny: the weights need .* GiB; quantize='int8' would$"):
        llama.weights_from_hf(cfg, lambda name: pytest.fail("read"), jnp.float32, source="tiny")
    with pytest.raises(SystemExit) as exit_info:
        generate_cli.entry(["--model", str(tiny_folder), "--prompt", "Hi"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.endswith("GiB; --quantize int8 would"), err


def test_the_command_line_spells_each_setting_as_its_flag():
    error = InputError(
        "{mesh} would, or lower {max_new_tokens}", {"mesh": {"data": 1, "tensor": 4}, "max_new_tokens": None}
    )
    assert str(error) == "mesh={'data': 1, 'tensor': 4} would, or lower max_new_tokens"
    assert error.spelled(cli.flag_spelling) == "--mesh data=1,tensor=4 would, or lower --max-new-tokens"
    assert InputError("{num_draft_tokens}, {x}", {"num_draft_tokens": 9}).spelled(cli.flag_spelling) == (
        "--num-draft-tokens 9, {x}"
    )
