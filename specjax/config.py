"""Static configuration: frozen, hashable dataclasses that jit treats as compile-time constants."""

from __future__ import annotations

import dataclasses
import math
import numbers
import reprlib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from specjax.errors import CheckpointError, InputError, UnsupportedModelError

# HF `model_type` -> the features that family uses. Everything else is read from config.json.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

INT32_END = 2**31  # sizes and token ids live in int32 arrays on the device
# How the target's forward reads its KV cache (`specjax.models.attention`): "auto" takes the Pallas kernel on TPU once
# it has compiled and matched the block loop there, "blocks" always the pure-JAX block loop, "pallas" the kernel.
ATTENTION_CHOICES = ("auto", "blocks", "pallas")
REQUIRED: Any = object()  # the default of a key that must be present


class MetadataFields:
    """Typed reads of a checkpoint's metadata: a config.json-style object, or GGUF key/values.

    Every value a loader uses is read through one of these methods, so nothing in a checkpoint is taken on trust:
    each checks the value's type and range and refuses it with one CheckpointError line naming the file and the key.
    A key that is absent or null reads as `default`, which is trusted; with the default REQUIRED it must be present.

    Args:
      data: the parsed object.
      source: the file it came from (or the GGUF path), named in every error.
      prefix: the path of this object inside the file, e.g. "rope_scaling." (see `mapping`).
      remedy: what the user should do about a bad value.
    """

    def __init__(self, data: Mapping[str, Any], source: str, prefix: str = "", remedy: str = "fix or re-download it"):
        self.data, self.source, self.prefix, self.remedy = data, source, prefix, remedy

    def error(self, message: str) -> CheckpointError:
        """A CheckpointError about this metadata: the source, then `message`."""
        return CheckpointError(f"{self.source}: {message}")

    def read(self, key: str, expected: str, valid: Callable[[Any], bool], default: Any = REQUIRED) -> Any:
        """The value of `key` if `valid(value)`; `expected` describes a valid one in the error."""
        value = self.data.get(key)
        if value is None and default is not REQUIRED:
            return default
        if not valid(value):
            got = "nothing" if value is None else reprlib.repr(value)
            raise self.error(f"{self.prefix}{key} must be {expected}, got {got}; {self.remedy}")
        return value

    def integer(self, key: str, low: int = 1, end: int = INT32_END, default: Any = REQUIRED) -> int:
        """An int in [low, end) (a bool is not an int here); the default range is that of a size."""
        return self.read(key, f"an integer in {low}..{end - 1}", lambda v: _is_int(v) and low <= v < end, default)

    def integers(self, key: str, low: int = 0, end: int = INT32_END, default: Any = REQUIRED) -> tuple[int, ...]:
        """A list of ints, each in [low, end), as a tuple (or `default`)."""
        value = self.read(
            key,
            f"a list of integers in {low}..{end - 1}",
            lambda v: isinstance(v, list) and all(_is_int(i) and low <= i < end for i in v),
            default,
        )
        return tuple(value) if isinstance(value, list) else value

    def positive(self, key: str, default: Any = REQUIRED) -> float:
        """A finite number > 0 (an int is accepted), as a float (or `default`)."""
        value = self.read(key, "a finite number > 0", lambda v: _is_number(v) and 0 < v < math.inf, default)
        return value if value is None else float(value)

    def flag(self, key: str, default: Any = REQUIRED) -> bool:
        return self.read(key, "true or false", lambda v: isinstance(v, bool), default)

    def text(self, key: str, default: Any = REQUIRED) -> str:
        return self.read(key, "a string", lambda v: isinstance(v, str), default)

    def strings(self, key: str, default: Any = REQUIRED) -> list[str]:
        return self.read(
            key, "a list of strings", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v), default
        )

    def token_ids(self, key: str, vocab_size: int = INT32_END) -> tuple[int, ...]:
        """HF's `eos_token_id`: one token id or a list of them, each in [0, vocab_size); () when absent."""

        def is_id(v: Any) -> bool:
            return _is_int(v) and 0 <= v < vocab_size

        expected = f"a token id in 0..{vocab_size - 1} or a list of them"
        value = self.read(key, expected, lambda v: is_id(v) or isinstance(v, list) and all(map(is_id, v)), ())
        return (value,) if _is_int(value) else tuple(value)

    def mapping(self, key: str) -> MetadataFields | None:
        """A nested object, read with the same checks (its keys named `key.inner`); None when absent."""
        value = self.read(key, "an object of keys and values", lambda v: isinstance(v, Mapping), None)
        return None if value is None else MetadataFields(value, self.source, f"{self.prefix}{key}.", self.remedy)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A config.json `rope_scaling`: linear, Llama-3 (frequency-dependent) or YaRN scaling of the rotary frequencies.

    Each `rope_type` reads and writes its own fields, those `ROPE_TYPE_FIELDS` names; the others keep their defaults.
    """

    rope_type: str  # "linear", "llama3" or "yarn"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: dimensions turning more than beta_fast times over the original context keep
    beta_slow: float = 1.0  # their frequency, those turning less than beta_slow times are divided by factor
    mscale: float | None = None  # yarn: with mscale_all_dim, sets the attention factor when it is not given
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn: the factor on cos and sin; None: derived from factor (and mscales)
    truncate: bool = True  # yarn: the frequency ramp starts and ends on whole dimensions

    def to_hf(self) -> dict[str, Any]:
        """The config.json `rope_scaling` object (inverse of `rope_scaling_from_hf`)."""
        fields = {name: getattr(self, name) for name in ROPE_TYPE_FIELDS[self.rope_type]}
        return {"rope_type": self.rope_type, **{name: v for name, v in fields.items() if v is not None}}


# The `rope_scaling` types specjax implements besides "default" (none), and the fields each reads.
ROPE_TYPE_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

    Each check is written once: `from_hf` reads every config.json value through `MetadataFields` (its type and
    range, naming the file and key); `__post_init__` checks the relations between fields, for configs built in code
    too, and `from_hf` adds the file's name to its message.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    sliding_window: int | None = None  # Mistral: a query attends to at most this many most recent keys
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention: str = "auto"  # how the cache is read, one of ATTENTION_CHOICES; not in config.json

    def __post_init__(self):
        check_attention(self.attention)
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Builds a config from the dict of an HF `config.json`, every field read through `MetadataFields`.

        Args:
          hf: the parsed config.json (or the dict `specjax.io.gguf.hf_config_from_gguf` builds).
          source: the file it came from, named in errors.
        Returns:
          The ModelConfig. Raises CheckpointError naming the file and key of a missing, mistyped, out-of-range or
          inconsistent field, and UnsupportedModelError for a model type or rope scaling specjax does not implement.
        """
        fields = MetadataFields(hf, source)
        model_type = fields.text("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} is not supported; specjax runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        vocab = fields.integer("vocab_size")
        use_window = fields.flag("use_sliding_window", model_type == "mistral")
        values = dict(
            model_type=model_type,
            vocab_size=vocab,
            **layer_sizes_from_hf(fields),
            num_layers=fields.integer("num_hidden_layers"),
            rms_norm_eps=fields.positive("rms_norm_eps", 1e-6 if model_type.startswith("qwen") else 1e-5),
            **rope_from_hf(fields),
            tie_word_embeddings=fields.flag("tie_word_embeddings", False),
            attention_bias=fields.flag("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            sliding_window=fields.integer("sliding_window", default=None) if use_window else None,
            max_position_embeddings=fields.integer("max_position_embeddings", default=4096),
            bos_token_id=fields.integer("bos_token_id", 0, vocab, default=None),
            eos_token_ids=fields.token_ids("eos_token_id", vocab),
        )
        try:
            return cls(**values)
        except CheckpointError as e:
            raise fields.error(f"{e}; {fields.remedy}") from None

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict of this config (inverse of `from_hf`)."""
        hf: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = self.rope_scaling.to_hf()
        if self.model_type in ("mistral", "qwen2", "qwen3"):
            hf["sliding_window"] = self.sliding_window
            hf["use_sliding_window"] = self.sliding_window is not None
        return hf


def check_attention(attention: str) -> None:
    """Refuses an attention choice that is not one of ATTENTION_CHOICES (InputError)."""
    if attention not in ATTENTION_CHOICES:
        raise InputError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}; got {attention!r}")


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def layer_sizes_from_hf(fields: MetadataFields) -> dict[str, int]:
    """A decoder layer's sizes in a config.json, under ModelConfig's names: hidden_size, intermediate_size, num_heads,
    num_kv_heads (default: num_attention_heads) and head_dim (default: hidden_size // num_attention_heads)."""
    hidden, heads = fields.integer("hidden_size"), fields.integer("num_attention_heads")
    return dict(
        hidden_size=hidden,
        intermediate_size=fields.integer("intermediate_size"),
        num_heads=heads,
        num_kv_heads=fields.integer("num_key_value_heads", default=heads),
        head_dim=fields.integer("head_dim", default=hidden // heads),
    )


def rope_from_hf(fields: MetadataFields) -> dict[str, Any]:
    """rope_theta and rope_scaling of a config.json: top-level `rope_theta` / `rope_scaling`, else the
    `rope_parameters` object (transformers >= 5) that holds both."""
    params = fields.mapping("rope_parameters")
    return dict(
        rope_theta=fields.positive("rope_theta", params.positive("rope_theta", 10000.0) if params else 10000.0),
        rope_scaling=rope_scaling_from_hf(fields.mapping("rope_scaling") or params, fields),
    )


def rope_scaling_from_hf(raw: MetadataFields | None, top: MetadataFields) -> RopeScaling | None:
    """The RopeScaling of a config.json `rope_scaling` (or `rope_parameters`) object: None for none or the default.

    As in transformers, a top-level `original_max_position_embeddings` overrides the object's, which defaults to
    `max_position_embeddings`; a yarn factor defaults to max_position_embeddings / original_max_position_embeddings.

    Args:
      raw: the object, as `MetadataFields.mapping` returns it.
      top: the whole config.json, for the context lengths.
    Returns:
      The scaling. Raises CheckpointError for a malformed field, UnsupportedModelError for a type specjax does not
      implement (naming the types it does).
    """
    if raw is None:
        return None
    type_key = "rope_type" if raw.data.get("rope_type") is not None else "type"
    rope_type = raw.text(type_key, "default")
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", raw.positive("factor"))
    if rope_type not in ROPE_TYPE_FIELDS:
        why = " (dynamic NTK rescales by each forward call's length: its logits depend on how a text is split)"
        raise UnsupportedModelError(
            f"{raw.source}: {raw.prefix}{type_key} {rope_type!r} is not supported"
            f"{why if rope_type == 'dynamic' else ''}; specjax implements {', '.join(['default', *ROPE_TYPE_FIELDS])}"
        )
    max_positions = top.integer("max_position_embeddings", default=None)
    original = top.integer("original_max_position_embeddings", default=None) or raw.integer(
        "original_max_position_embeddings", default=max_positions or REQUIRED
    )
    if rope_type == "yarn":
        return RopeScaling(
            "yarn",
            raw.positive("factor", max_positions / original if max_positions else REQUIRED),
            original_max_position_embeddings=original,
            beta_fast=raw.positive("beta_fast", 32.0),
            beta_slow=raw.positive("beta_slow", 1.0),
            mscale=raw.positive("mscale", None),
            mscale_all_dim=raw.positive("mscale_all_dim", None),
            attention_factor=raw.positive("attention_factor", None),
            truncate=raw.flag("truncate", True),
        )
    low, high = raw.positive("low_freq_factor", 1.0), raw.positive("high_freq_factor", 4.0)
    if low >= high:
        raise raw.error(f"{raw.prefix}low_freq_factor={low} must be below high_freq_factor={high}; {raw.remedy}")
    return RopeScaling("llama3", raw.positive("factor"), low, high, original)


FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy (argmax); top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # The values live in float32 / int32 arrays: a temperature past float32's range would become infinite.
        if not (0 <= self.temperature <= FLOAT32_MAX):
            raise InputError(
                f"temperature must be a number in 0..{FLOAT32_MAX:.3g} (0 = greedy), got {self.temperature}"
            )
        integral = isinstance(self.top_k, numbers.Integral) and not isinstance(self.top_k, bool)
        if not (integral and 0 <= self.top_k < INT32_END):
            raise InputError(f"top_k must be an integer in 0..{INT32_END - 1} (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# ---------------------------------------------------------------------------------------------------------------
# Config files: frozen dataclasses read from YAML or a mapping, with `section.key=value` overrides (the trainer's
# `specjax.train.config`, decoding's `specjax.prepare.DecodeConfig`).


def read_config_file(path: str | Path) -> dict:
    """The raw mapping of a YAML config file. Raises InputError on a file that cannot be read or bad YAML."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise InputError(f"cannot read config {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise InputError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    return raw


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Checks (and lightly coerces: int -> float, list -> tuple) one value against its annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_type(value, option, where)
            except InputError as e:
                errors.append(str(e))
        raise InputError(errors[0])
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise InputError(f"{where} must be a mapping, got {value!r}")
        return {
            _check_type(k, key_hint, f"{where} key"): _check_type(v, value_hint, f"{where}.{k}")
            for k, v in value.items()
        }
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, (list, tuple)):
            raise InputError(f"{where} must be a list, got {value!r}")
        return tuple(_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 (PyYAML) reads "1e-4" (no dot) as a string; accept what Python reads as a finite number.
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            return number
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise InputError(f"{where} must be {hint.__name__}, got {value!r}")
    if hint is int and not -INT32_END <= value < INT32_END:  # counts and seeds land in 32-bit arrays
        raise InputError(f"{where} must be an integer below 2**31 in size, got {value}")
    return value


def build_config(cls: type, raw: Any, where: str = "") -> Any:
    """A config dataclass from a raw mapping (read from YAML, or given), its nested dataclasses built alike.

    Args:
      cls: the frozen dataclass; each field's annotation is what its value is checked against.
      raw: the mapping of field names to values.
      where: the dotted key `raw` sits at, for the messages ("" at the top).
    Returns:
      The dataclass. Raises InputError, naming the valid keys, on an unknown key, and on a value of the wrong type.
    """
    if not isinstance(raw, dict):
        raise InputError(f"{where or 'the config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        prefix = f"{where}." if where else ""
        raise InputError(
            f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid keys{' in ' + where if where else ''}: {', '.join(sorted(fields))}"
        )
    values = {}
    for name, value in raw.items():
        key = f"{where}.{name}" if where else name
        hint = hints[name]
        values[name] = (
            build_config(hint, value, key) if dataclasses.is_dataclass(hint) else _check_type(value, hint, key)
        )
    return cls(**values)


def apply_override(raw: dict, override: str) -> None:
    """Applies one `section.key=value` override (the value is parsed as YAML) to a raw config dict in place."""
    if "=" not in override:
        raise InputError(f"override {override!r} is not of the form section.key=value")
    path, value = override.split("=", 1)
    keys = path.strip().split(".")
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise InputError(f"override {override!r}: {k} is not a section")
    node[keys[-1]] = yaml.safe_load(value)
