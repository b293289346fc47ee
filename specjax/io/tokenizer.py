"""Tokenizer: HF `tokenizers` plus a sandboxed jinja2 chat template, built from a folder or GGUF metadata."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from specjax.errors import CheckpointError, InputError, UnsupportedModelError
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


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


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
          The Tokenizer. Raises CheckpointError when tokenizer.json is missing or unreadable.
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
        config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: the "default" one is the chat template
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        extra: list[int] = []
        if (folder / "generation_config.json").is_file():
            eos = read_json(folder / "generation_config.json").get("eos_token_id")
            extra = [int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])]
        return cls(
            backend,
            template if isinstance(template, str) else None,
            _token_text(config.get("bos_token")),
            _token_text(config.get("eos_token")),
            extra,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Builds a byte-level BPE tokenizer from GGUF `tokenizer.*` metadata (`tokenizer.ggml.model == "gpt2"`).

        Args:
          meta: GGUF key -> value (strings, numbers, lists), as read by `specjax.io.gguf.read_gguf_metadata`.
        Returns:
          The Tokenizer. Raises UnsupportedModelError for other tokenizer models or unknown pre-tokenizers.
        """
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
                "use the model's HF folder with tokenizer.json instead"
            )
        tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise CheckpointError("GGUF has no tokenizer.ggml.tokens; re-download or re-convert the file")
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        normalizer, pre_tok, ignore_merges = _byte_level_pipeline(meta.get("tokenizer.ggml.pre", "default"))

        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = Backend(BPE(vocab, merges, ignore_merges=ignore_merges))
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

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = token("bos"), token("eos")
        add_bos = meta.get(
            "tokenizer.ggml.add_bos_token", _PRE_FAMILIES.get(meta.get("tokenizer.ggml.pre")) == "llama3"
        )
        single, specials = ["$A:0"], {}
        if add_bos and bos is not None:
            single.insert(0, f"{bos}:0")
            specials[bos] = meta["tokenizer.ggml.bos_token_id"]
        if meta.get("tokenizer.ggml.add_eos_token") and eos is not None:
            single.append(f"{eos}:0")
            specials[eos] = meta["tokenizer.ggml.eos_token_id"]
        if specials:
            backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=list(specials.items()))
        extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        return cls(backend, meta.get("tokenizer.chat_template"), bos, eos, extra)

    def to_folder(self, folder: str | Path) -> None:
        """Writes tokenizer.json, tokenizer_config.json and (with more than one stop id) generation_config.json.

        Args:
          folder: an existing folder.
        """
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), "utf-8")
        if len(self._eos_ids) > 1:
            (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(self._eos_ids)}), "utf-8")

    # -- encoding ---------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_start|>`) map to their ids.

        Args:
          text: the text.
          add_special_tokens: add what the tokenizer's post-processor adds (e.g. BOS).
        Returns:
          The ids.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

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
        return self.encode(self.apply_chat_template([{"role": "user", "content": prompt}]))


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
