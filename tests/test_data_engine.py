"""The data engine: prompt sources (single prompts, ShareGPT, chat messages), multi-turn regeneration with exact loss
masks, the content-addressed store (resume, reuse by a larger run), the prompt filters and the synthesize stage."""

import dataclasses
import json

import numpy as np
import pytest

from specjax.errors import InputError
from specjax.evalsets import chat_records, humaneval_prompts
from specjax.io.loading import tiny_random_model
from specjax.train import data as data_module
from specjax.train.config import load_config
from specjax.train.conversations import _messages, read_conversations
from specjax.train.filters import NearDuplicates, degeneracy_issue, language_issue

SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi there"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "Name a colour."},
        {"from": "gpt", "value": "Blue."},
    ]
}
MESSAGES = {"messages": [{"role": "user", "content": "One plus one?"}, {"role": "assistant", "content": "Two."}]}


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model()


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def test_the_three_line_shapes_read_as_conversations(tmp_path):
    path = _write(tmp_path / "mixed.jsonl", [{"prompt": "Say hi."}, SHAREGPT, MESSAGES])
    single, sharegpt, messages = read_conversations(path)
    assert single == [{"role": "user", "content": "Say hi."}]
    assert [m["role"] for m in sharegpt] == ["system", "user", "assistant", "user", "assistant"]
    assert sharegpt[3] == {"role": "user", "content": "Name a colour."}
    assert messages == MESSAGES["messages"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "mixed.jsonl:2: not valid JSON"),
        ({"conversations": [{"from": "robot", "value": "x"}]}, 'mixed.jsonl:2: turn 0 needs "from"'),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "mixed.jsonl:2: a conversation must start"),
        ({"text": "x"}, 'mixed.jsonl:2: expected an object with "prompt", "conversations" or "messages"'),
    ],
)
def test_malformed_lines_name_the_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "mixed.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(InputError, match=message):
        read_conversations(path)


def test_a_file_that_is_not_utf8_is_one_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\xff\xfe\n")
    with pytest.raises(InputError, match="is not UTF-8"):
        read_conversations(path)


def _echo_replies(prompts, sampling, seeds, done):
    """A stand-in target: replies 'ok <number of prompt tokens>' and its end-of-turn token, never cut."""
    return [(TOKENIZER.encode(f"ok {len(p)}") + [TOKENIZER.eos_token_ids[0]], False) for p in prompts]


def test_multi_turn_regeneration_masks_exactly_the_replies(tiny):
    global TOKENIZER
    TOKENIZER = tok = tiny.tokenizer
    data = load_config(None, ["data.max_prompt_tokens=512", "data.batch_size=2"]).data
    conversations = [read_conversations_from(SHAREGPT), read_conversations_from(MESSAGES)]
    samples, counts = data_module.respond(tiny, conversations, data, None, seed=0, reply=_echo_replies)
    assert not counts and len(samples) == 2
    for (ids, mask), conversation in zip(samples, conversations):
        # The sample is the whole conversation, with the stand-in's replies in place of the file's.
        history, expected_replies = [], []
        for m in conversation:
            if m["role"] == "assistant":
                prompt = tok.encode(tok.apply_chat_template(history))
                expected_replies.append(f"ok {len(prompt)}")
                history.append({"role": "assistant", "content": expected_replies[-1]})
            else:
                history.append(m)
        rendered = tok.encode(tok.apply_chat_template(history, add_generation_prompt=False))
        assert ids.tolist() == rendered[: len(ids)]
        # The mask covers each reply's tokens and its end-of-turn token, nothing else.
        assert tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == "".join(
            f"{r}<|im_end|>" for r in expected_replies
        )


def read_conversations_from(record):
    return _messages(record, "test")


def test_training_on_the_files_own_turns_needs_no_target(tiny, tmp_path):
    data = load_config(None, ["data.regenerate=false", "data.max_prompt_tokens=512"]).data
    samples, _ = data_module.respond(tiny, [read_conversations_from(SHAREGPT)], data, None, seed=0, reply=None)
    ((ids, mask),) = samples
    text = tiny.tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert text.startswith("Hello!<|im_end|>") and "Blue.<|im_end|>" in text


def test_the_store_resumes_and_a_larger_run_reuses_the_smaller_runs_shards(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "UNIT", 4)
    calls = []
    real = data_module.respond
    monkeypatch.setattr(data_module, "respond", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    prompts = _write(tmp_path / "p.jsonl", [{"prompt": f"Question number {i} about rivers?"} for i in range(14)])
    base = [
        f"data.prompts={prompts}",
        "data.eval_prompts=2",
        "data.max_new_tokens=4",
        "data.batch_size=4",
        "data.samples_per_prompt=1",
    ]

    def run(num_prompts, folder):
        data = load_config(None, [*base, f"data.num_prompts={num_prompts}"]).data
        data_module.regenerate(tiny, data, tmp_path / folder, tmp_path / "store", evaluation=[])
        return json.loads((tmp_path / folder / "manifest.json").read_text())

    small = run(8, "small")
    assert calls == [4, 4, 4, 4] and small["samples"] == 16 and small["responses_per_prompt"] == 2
    assert run(8, "again")["shards"] == small["shards"] and len(calls) == 4  # nothing generated again
    large = run(12, "large")
    assert len(calls) == 6 and set(small["shards"]) < set(large["shards"])
    held_out = [json.loads(line)["prompt"] for line in (tmp_path / "large" / "eval_prompts.jsonl").open()]
    assert held_out == ["Question number 0 about rivers?", "Question number 1 about rivers?"]
    samples = data_module.load_samples(tmp_path / "large")  # greedy and sampled responses
    assert len(samples) == 24 and all(m.dtype == np.int8 for _, m in samples)


def test_sources_are_taken_in_turn_a_unit_at_a_time_so_smaller_runs_are_prefixes(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "UNIT", 4)
    a = _write(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(12)])
    b = _write(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(6)])

    def texts(num_prompts):
        data = load_config(
            None, [f"data.prompts=[{a}, {b}]", "data.eval_prompts=2", f"data.num_prompts={num_prompts}"]
        ).data
        per_source, held_out, dropped = data_module.load_prompts(data, tmp_path / "unused.jsonl", [])
        assert dropped == 0
        assert held_out == ["a0", "a1"]
        return [[c[0]["content"] for c in source] for source in per_source]

    assert texts(3) == [["a2", "a3", "a4"]]
    assert texts(10) == [["a2", "a3", "a4", "a5", "a6", "a7"], ["b0", "b1", "b2", "b3"]]
    assert texts(16) == [[f"a{i}" for i in range(2, 12)], [f"b{i}" for i in range(6)]]  # b runs out: a goes on
    with pytest.raises(InputError, match="lower them"):
        texts(17)


def test_conversations_resembling_evaluation_prompts_are_dropped(tiny, tmp_path):
    humaneval = humaneval_prompts()[0]
    texts = ["Held out?", humaneval, "What is a river delta?", "Name a lake."]
    prompts = _write(tmp_path / "p.jsonl", [{"prompt": t} for t in texts])
    data = load_config(
        None, [f"data.prompts={prompts}", "data.eval_prompts=1", "data.num_prompts=2", "data.max_new_tokens=2"]
    ).data
    data_module.regenerate(tiny, data, tmp_path / "d", tmp_path / "store", evaluation=[humaneval])
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    # The dropped conversation's place goes to the next one: the run still trains on data.num_prompts.
    assert manifest["dropped_overlapping_evaluation"] == 1 and manifest["samples"] == manifest["conversations"] == 2


def test_filters():
    assert language_issue("Wie geht es dir heute, mein Freund?") == "not English"
    assert language_issue("这是什么意思？请解释。") == "not English"
    assert language_issue("Explain recursion.") is None
    assert degeneracy_issue("buy now " * 10) == "degenerate" and degeneracy_issue("Wait!!!!!!!!!!!!") == "degenerate"
    assert degeneracy_issue("What is the capital of France, and why is it famous for its art?") is None
    evaluation = [r["prompt"] for r in chat_records()]
    dedup = NearDuplicates(0.6, evaluation)
    assert dedup.check(evaluation[5] + " Thanks.") == "overlaps evaluation"
    assert dedup.check("How do I bake bread at home without any yeast at all?") is None
    assert dedup.check("How do I bake bread at home without any yeast at all??") == "near-duplicate"
    assert dedup.check("Which planets in our solar system have rings?") is None


def test_the_chat_set_has_eight_categories_of_twelve():
    records = chat_records()
    counts = {}
    for r in records:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    assert len(records) == 96 and len(counts) == 8 and set(counts.values()) == {12}
    assert len({r["prompt"] for r in records}) == 96


def test_config_rejects_out_of_range_data_engine_values():
    for override in (
        "synthesize.top_p=0",
        "data.samples_per_prompt=-1",
        "synthesize.temperature=-1",
        "synthesize.dedup_threshold=1.5",
    ):
        with pytest.raises(InputError, match=override.split("=")[0]):
            load_config(None, [override])
    assert load_config(None, ["data.prompts=[builtin, synthetic]"]).data.prompt_sources == ("builtin", "synthetic")


def test_synthesize_keeps_filtered_prompts_and_rereads_its_store(smollm2, tmp_path, monkeypatch):
    from specjax.train import synthesize as synth

    cfg = load_config(None, ["synthesize.num_prompts=3", "synthesize.batch_size=8", "synthesize.max_tokens=40"])
    synth.synthesize(smollm2, cfg.synthesize, tmp_path / "store", tmp_path / "prompts", evaluation=[])
    manifest = json.loads((tmp_path / "prompts" / "manifest.json").read_text())
    kept = [json.loads(line) for line in (tmp_path / "prompts" / "synthetic.jsonl").open()]
    assert manifest["kept"] == len(kept) == 3
    assert manifest["generated"] == 3 + sum(manifest["dropped"].values())
    for k in kept:
        assert k["domain"] in synth.DOMAINS and k["prompt"] and language_issue(k["prompt"]) is None
    # The user turn begins right after the rendered prefix: the system hint, then the user header.
    prefix = smollm2.tokenizer.decode(synth.user_turn_prefix(smollm2.tokenizer, "Hint."), skip_special_tokens=False)
    assert prefix.endswith("Hint.<|im_end|>\n<|im_start|>user\n")
    # A second run reads every batch from the store and keeps the same prompts.
    monkeypatch.setattr(synth, "generate", lambda *a, **k: pytest.fail("generated again"))
    synth.synthesize(smollm2, cfg.synthesize, tmp_path / "store", tmp_path / "again", evaluation=[])
    assert (tmp_path / "again" / "synthetic.jsonl").read_text() == (
        tmp_path / "prompts" / "synthetic.jsonl"
    ).read_text()


def test_unit_keys_change_with_every_setting_that_shapes_a_shard():
    data = load_config(None, []).data
    unit = [[{"role": "user", "content": "x"}]]
    base = data_module._unit_key("t", unit, data, data_module.SamplingConfig(), 0)
    variants = [
        data_module._unit_key("u", unit, data, data_module.SamplingConfig(), 0),
        data_module._unit_key("t", [[{"role": "user", "content": "y"}]], data, data_module.SamplingConfig(), 0),
        data_module._unit_key("t", unit, dataclasses.replace(data, max_new_tokens=3), data_module.SamplingConfig(), 0),
        data_module._unit_key("t", unit, data, data_module.SamplingConfig(temperature=1.0), 0),
        data_module._unit_key("t", unit, data, data_module.SamplingConfig(), 1),
    ]
    assert base not in variants and len(set(variants)) == len(variants)


@pytest.mark.parametrize("fraction, rows, steps", [(1.0, 50, 32), (0.5, 25, 16)])  # steps = ceil(2.5 x rows / 4)
def test_epochs_set_the_steps_from_the_packed_rows(monkeypatch, tiny, tmp_path, fraction, rows, steps):
    from specjax.train import run

    seen = {}
    packed = {key: np.ones((50, 8), np.int32) for key in ("tokens", "loss_mask", "positions", "segments")}
    monkeypatch.setattr(run, "load_features", lambda *a: packed)
    monkeypatch.setattr(run, "build_trainer", lambda cfg, model: seen.setdefault("steps", cfg.training.steps))
    monkeypatch.setattr(run, "BatchSource", lambda rows, *a: seen.setdefault("rows", len(rows["tokens"])))
    monkeypatch.setattr(run, "train", lambda *a, **k: None)
    overrides = ["training.epochs=2.5", "training.batch_size=4", f"training.data_fraction={fraction}"]
    run.stage_train(load_config(None, [*overrides, f"output_dir={tmp_path}"]), tiny)
    assert seen == {"steps": steps, "rows": rows}
    record = json.loads((tmp_path / "training_rows.json").read_text())
    assert record == {"data_fraction": fraction, "rows": rows, "samples": rows, "assistant_tokens": 8 * rows}


def test_a_cut_reply_ends_its_conversation(tiny):
    data = load_config(None, ["data.max_prompt_tokens=512"]).data
    cut = lambda prompts, sampling, seeds, done: [(tiny.tokenizer.encode("and so on"), True) for _ in prompts]  # noqa: E731
    samples, counts = data_module.respond(tiny, [read_conversations_from(SHAREGPT)], data, None, seed=0, reply=cut)
    ((ids, mask),) = samples
    assert tiny.tokenizer.decode(ids[mask == 1].tolist()) == "and so on"  # the second user turn never came
    assert counts == {"reply cut at max_new_tokens": 1, "conversation cut: reply at max_new_tokens": 1}
