"""The tokenizer built from GGUF metadata against transformers' tokenizer of the same file."""

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers

from specjax.errors import CheckpointError, InputError, UnsupportedModelError
from specjax.io.gguf import read_gguf_metadata
from specjax.io.loading import embedded_gguf
from specjax.io.tokenizer import Tokenizer

SMOLLM2 = embedded_gguf("smollm2-135m")

TEXTS = [
    "",
    "Hello world",
    "café naïve résumé façade Ångström",
    "日本語のテキスト、中文文本。한국어",
    "emoji 🎉🚀 👨‍👩‍👧 ❤️",
    "def f(x):\n    if x:\n        return x  +  y\n\n\n\tpass\n",
    "a   b\t\tc\n\n\n d   \r\n  ",
    "   leading and trailing   ",
    "I'm sure they'LL say it's fine",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|><|im_start|><|im_end|>",
    "<im_start> <|im_star <|IM_END|>",
    "<repo_name>specjax<file_sep>io.py",
]
# Digits next to whitespace: SmolLM2 splits every digit off before the GPT-2 regex (its tokenizer.json pre-tokenizer
# is Sequence[Digits(individual_digits), ByteLevel], llama.cpp's "smollm" pre-tokenizer does the same), a step
# transformers' GGUF tokenizer omits.
DIGIT_TEXTS = ["x  +  1", "x=123456 7.89", "Arabic-Indic ١٢٣ and full-width １２", "v2.0  3\n4"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Autumn moonlight—\na worm digs silently\ninto the chestnut."},
        {"role": "user", "content": "Another, about code:\n\n    x = 1"},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
]


@pytest.fixture(scope="module")
def meta():
    return read_gguf_metadata(SMOLLM2)


@pytest.fixture(scope="module")
def ours(meta):
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def ref():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, ref, text):
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text == ref.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens(ours, ref):
    assert ours.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert ours.decode([1, 4093, 2]) == "user"
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1 == ref.bos_token_id
    assert ours.vocab_size == len(ref) == 49152
    assert not ours.add_bos and ours.encode("hi", add_special_tokens=True) == ours.encode("hi")


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_digits_split_like_smollm2(ours, ref, text):
    original = Backend.from_str(ref.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert ours.encode(text) == original.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode(text)) == text
    if text == "x  +  1":  # "  " before a digit stays one whitespace token, as in llama.cpp
        assert [ours.decode([i]) for i in ours.encode(text)] == ["x", " ", " +", "  ", "1"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_other_pre_tokenizers_match_transformers(meta, pre):
    """The Llama 3 and Qwen2 split regexes, on SmolLM2's vocabulary, against transformers' GGUF tokenizer builder."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tokenizer_dict, _ = get_gguf_tokenizer(str(SMOLLM2))
    ref_backend, _ = convert_gguf_tokenizer(arch, {**tokenizer_dict, "pre_tokenizer_type": pre})
    ours = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": False})
    for text in TEXTS + DIGIT_TEXTS:
        assert ours.encode(text) == ref_backend.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system+user", "multi-turn", "system+multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, ref, messages, add_generation_prompt):
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    expected = ref.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ours.encode(text) == list(expected)


def test_chat_prompt_ids(ours, ref):
    prompt = "Write a Python function that checks whether a number is prime."
    expected = ref.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = ours.chat_prompt_ids(prompt)
    assert ids == list(expected if isinstance(expected, list) else expected["input_ids"])
    assert ours.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_template_features_match_transformers(ours, ref):
    """bos/eos tokens, tojson (no HTML escaping, unicode kept), loop controls and raise_exception."""
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{{ m['role'] | tojson }}: {{ m | tojson }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    messages = CONVERSATIONS[2]
    custom = Tokenizer(ours.backend, template, ours.bos_token, ours.eos_token)
    text = custom.apply_chat_template(messages)
    assert text == ref.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    assert "—" in text and text.count("<|im_end|>") == 2
    with pytest.raises(InputError, match="no tools"):
        custom.apply_chat_template([{"role": "tool", "content": "x"}])


def test_folder_round_trip(ours, tmp_path):
    ours.to_folder(tmp_path)
    again = Tokenizer.from_folder(tmp_path)
    for text in TEXTS + DIGIT_TEXTS:
        assert again.encode(text) == ours.encode(text)
    assert again.chat_template == ours.chat_template
    assert (again.bos_token_id, again.eos_token_ids, again.vocab_size) == (1, (2,), 49152)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)


def test_hf_folder_conventions(ours, meta, tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; generation_config.json adds stop ids; add_bos_token."""
    ours.to_folder(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    again = Tokenizer.from_folder(tmp_path)
    assert again.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"
    assert again.eos_token_ids == (2, 0)

    llama3_style = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.add_bos_token": True})
    assert llama3_style.add_bos and llama3_style.encode("hi", add_special_tokens=True) == [1, *ours.encode("hi")]


def test_errors(ours, meta, tmp_path):
    with pytest.raises(InputError, match="raw mode"):
        Tokenizer(ours.backend).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(CheckpointError, match="does not parse"):
        Tokenizer(ours.backend, "{% for %}").apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'tekken'"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "tekken"})
    with pytest.raises(UnsupportedModelError, match="tokenizer model 'llama'"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="cannot parse") as info:
        Tokenizer.from_folder(tmp_path)
    assert "\n" not in str(info.value)
