"""Tokenizer: HF `tokenizers` plus a sandboxed jinja2 chat template, built from a folder or GGUF metadata."""

from __future__ import annotations

import datetime
import json
import reprlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from specjax.config import MetadataFields
from specjax.errors import CheckpointError, InputError, UnsupportedModelError
from specjax.host import write_file
from specjax.io.hf import read_json

# Split regexes of the byte-level BPE vocabularies, keyed by the llama.cpp `tokenizer.ggml.pre` names that use them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_FAMILIES = {
    "gpt-2": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_level_pipeline(pre: str) -> tuple[Any, Any, bool]:
    """(normalizer, pre-tokenizer, ignore_merges) that llama.cpp applies for the `tokenizer.ggml.pre` value `pre`."""
    family = _PRE_FAMILIES.get(pre)
    if family is None:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_FAMILIES))}); "
            "use the model's HF folder with tokenizer.json instead"
        )
    if family in ("gpt2", "digits"):
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if family == "gpt2":
            return None, byte_level, False
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False
    split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT), behavior="isolated")
    pre_tok = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if family == "llama3":
        return None, pre_tok, True
    return normalizers.NFC(), pre_tok, False


def _special_token(config: MetadataFields, key: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object with `content`."""
    value = config.read(
        key,
        "a string or an object with a string 'content'",
        lambda v: isinstance(v, str) or isinstance(v, dict) and isinstance(v.get("content"), str),
        None,
    )
    return value["content"] if isinstance(value, dict) else value


def _chat_template(config: MetadataFields) -> str | None:
    """tokenizer_config.json's chat_template: a string, or HF's named templates [{"name": ..., "template": ...}],
    whose "default" one is the chat template (as in transformers)."""

    def named(v: Any) -> bool:
        return isinstance(v, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in v
        )

    value = config.read(
        "chat_template",
        'a string or a list of {"name", "template"} objects with a "default" one',
        lambda v: isinstance(v, str) or named(v) and any(t["name"] == "default" for t in v),
        None,
    )
    return next(t["template"] for t in value if t["name"] == "default") if isinstance(value, list) else value


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not readable UTF-8 text ({e}); fix or re-download it") from None


class Tokenizer:
    """Text <-> token ids, and chat-template rendering.

    Args:
      backend: the `tokenizers.Tokenizer` (its post-processor decides whether encode adds BOS).
      chat_template: the jinja2 chat template, or None.
      bos_token: the BOS token text passed to the template, or None.
      eos_token: the EOS token text passed to the template, or None.
      extra_eos_ids: further ids that end a turn (e.g. `<|eot_id|>`), besides `eos_token`.
    """

    def __init__(
        self,
        backend: Backend,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_ids: Sequence[int] = (),
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        eos = [self.token_to_id(eos_token)] if eos_token is not None else []
        self._eos_ids = tuple(dict.fromkeys(i for i in [*eos, *extra_eos_ids] if i is not None))
        self._template: jinja2.Template | None = None

    # -- construction -----------------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Reads tokenizer.json, tokenizer_config.json and, when present, chat_template.jinja / generation_config.json.

        Args:
          folder: an HF model folder.
        Returns:
          The Tokenizer. Raises CheckpointError when tokenizer.json is missing or unreadable, or a value in the other
          files is malformed (naming the file and key).
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{folder} has no tokenizer.json; copy the model's tokenizer files into it")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:
            reason = str(e).partition("\n")[0]
            raise CheckpointError(f"cannot parse {path} ({reason}); re-download it") from None
        config_path = folder / "tokenizer_config.json"
        jinja, generation = folder / "chat_template.jinja", folder / "generation_config.json"
        config = MetadataFields(read_json(config_path) if config_path.is_file() else {}, str(config_path))
        template = _read_text(jinja) if jinja.is_file() else _chat_template(config)
        extra: tuple[int, ...] = ()
        if generation.is_file():
            stops = MetadataFields(read_json(generation), str(generation))
            extra = stops.token_ids("eos_token_id", backend.get_vocab_size(with_added_tokens=True))
        return cls(backend, template, _special_token(config, "bos_token"), _special_token(config, "eos_token"), extra)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "GGUF metadata") -> Tokenizer:
        """Builds a byte-level BPE tokenizer from GGUF `tokenizer.*` metadata (`tokenizer.ggml.model == "gpt2"`).

        Args:
          meta: GGUF key -> value (strings, numbers, lists), as read by `specjax.io.gguf.read_gguf_metadata`.
          source: the GGUF file, named in errors.
        Returns:
          The Tokenizer. Raises CheckpointError naming the key of a missing or malformed value, and
          UnsupportedModelError for other tokenizer models or unknown pre-tokenizers.
        """
        fields = MetadataFields(meta, source, remedy="re-download or re-convert the file")
        model = fields.text("tokenizer.ggml.model", None)
        if model != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
                "use the model's HF folder with tokenizer.json instead"
            )
        tokens = fields.read(
            "tokenizer.ggml.tokens",
            "a non-empty list of strings",
            lambda v: isinstance(v, list) and v and all(isinstance(t, str) for t in v),
        )
        types = fields.integers("tokenizer.ggml.token_type", default=(1,) * len(tokens))
        if len(types) != len(tokens):
            raise fields.error(
                f"tokenizer.ggml.token_type lists {len(types)} types for {len(tokens)} tokens; {fields.remedy}"
            )
        merges = fields.read(
            "tokenizer.ggml.merges",
            "a list of 'left right' strings",
            lambda v: isinstance(v, list) and all(isinstance(m, str) and " " in m for m in v),
            [],
        )
        pre = fields.text("tokenizer.ggml.pre", "default")
        normalizer, pre_tok, ignore_merges = _byte_level_pipeline(pre)

        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        unknown = [" ".join(p) for p in pairs if not (p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab)]
        if unknown:  # the tokenizers library would panic on it
            raise fields.error(
                f"tokenizer.ggml.merges holds {unknown[0]!r}, whose parts or result are not in tokenizer.ggml.tokens; "
                f"{fields.remedy}"
            )
        backend = Backend(BPE(vocab, pairs, ignore_merges=ignore_merges))
        backend.normalizer = normalizer
        backend.pre_tokenizer = pre_tok
        backend.decoder = decoders.ByteLevel()
        added = [
            AddedToken(tok, special=t == _CONTROL, normalized=False)
            for tok, t in zip(tokens, types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
        backend.add_special_tokens([a for a in added if a.special])
        backend.add_tokens([a for a in added if not a.special])

        def token_id(kind: str) -> int | None:
            return fields.integer(f"tokenizer.ggml.{kind}_token_id", 0, len(tokens), default=None)

        bos_id, eos_id = token_id("bos"), token_id("eos")
        bos = None if bos_id is None else tokens[bos_id]
        eos = None if eos_id is None else tokens[eos_id]
        single, specials = ["$A:0"], {}
        if fields.flag("tokenizer.ggml.add_bos_token", _PRE_FAMILIES.get(pre) == "llama3") and bos is not None:
            single.insert(0, f"{bos}:0")
            specials[bos] = bos_id
        if fields.flag("tokenizer.ggml.add_eos_token", False) and eos is not None:
            single.append(f"{eos}:0")
            specials[eos] = eos_id
        if specials:
            backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=list(specials.items()))
        extra = [i for i in (token_id("eot"), token_id("eom")) if i is not None]
        return cls(backend, fields.text("tokenizer.chat_template", None), bos, eos, extra)

    def to_folder(self, folder: str | Path) -> None:
        """Writes tokenizer.json, tokenizer_config.json and (with more than one stop id) generation_config.json.

        Args:
          folder: an existing folder.
        """
        folder = Path(folder)
        write_file(folder / "tokenizer.json", self.backend.to_str(pretty=True))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        write_file(folder / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False))
        if len(self._eos_ids) > 1:
            write_file(folder / "generation_config.json", json.dumps({"eos_token_id": list(self._eos_ids)}))

    # -- encoding ---------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_start|>`) map to their ids.

        Args:
          text: the text.
          add_special_tokens: add what the tokenizer's post-processor adds (e.g. BOS).
        Returns:
          The ids. Raises InputError for what is not text (see `check_text`).
        """
        return self.backend.encode(check_text(text), add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`.

        Args:
          ids: token ids.
          skip_special_tokens: drop special (control) tokens from the text.
        Returns:
          The decoded text.
        """
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token's text, or None."""
        return self.backend.token_to_id(token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a turn: the EOS token's, then any extra stop ids."""
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends BOS."""
        bos = self.bos_token_id
        return bos is not None and self.backend.encode("", add_special_tokens=True).ids[:1] == [bos]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- chat -------------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """Renders a conversation with the chat template, as transformers' `apply_chat_template(tokenize=False)`.

        Args:
          messages: dicts with "role" and "content".
          add_generation_prompt: end with the header of an assistant turn.
        Returns:
          The prompt text. Raises InputError when there is no template or the template rejects the conversation.
        """
        if self.chat_template is None:
            raise InputError("this model has no chat template; use raw mode (plain-text prompt) instead")
        if self._template is None:
            self._template = _compile(self.chat_template)
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise InputError(f"the chat template rejected the conversation: {e}") from None

    def chat_prompt_ids(self, prompt: str) -> list[int]:
        """Ids of a one-message user conversation plus the generation prompt, as transformers tokenizes it.

        Args:
          prompt: the user's message.
        Returns:
          The prompt ids (special tokens in the rendered text map to their ids; nothing else is added).
        """
        return self.encode(self.apply_chat_template([{"role": "user", "content": check_text(prompt)}]))


def check_text(text: str) -> str:
    """`text`, or InputError naming it when it is not a str or holds a lone surrogate (what Python makes of bytes on a
    command line, or a \\udXXX escape in JSON, that are not valid UTF-8)."""
    if not isinstance(text, str):
        raise InputError(f"expected text (a str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        shown = reprlib.repr(text)
        raise InputError(
            f"the text {shown} is not valid Unicode: character {e.start} is a lone surrogate "
            f"({text[e.start]!r}), as undecodable bytes become; give it as UTF-8 text"
        ) from None
    return text


def _compile(template: str) -> jinja2.Template:
    """Compiles a chat template in the sandbox, with the globals and filters HF chat templates rely on."""

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"the model's chat template does not parse ({e}); use raw mode instead") from None
