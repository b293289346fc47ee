"""Static configuration: frozen, hashable dataclasses that jit treats as compile-time constants."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from specjax.errors import CheckpointError, InputError, UnsupportedModelError

# HF `model_type` -> the features that family uses. Everything else is read from config.json.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling (`rope_type: llama3`) or plain linear scaling."""

    rope_type: str  # "llama3" or "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2)."""

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

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from the dict of an HF `config.json`.

        Args:
          hf: the parsed config.json.
        Returns:
          The ModelConfig. Raises UnsupportedModelError for a model type or rope scaling specjax does not implement.
        """
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; specjax runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            use_window = hf.get("use_sliding_window", model_type == "mistral")
            window = hf.get("sliding_window") if use_window else None
            return cls(
                model_type=model_type,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6 if model_type.startswith("qwen") else 1e-5)),
                rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
                rope_scaling=rope_scaling_from_hf(hf.get("rope_scaling") or hf.get("rope_parameters")),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type == "qwen3",
                sliding_window=int(window) if window else None,
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json lacks the required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config.json has a malformed field ({e}); fix or re-download it") from None

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
            hf["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        if self.model_type in ("mistral", "qwen2", "qwen3"):
            hf["sliding_window"] = self.sliding_window
            hf["use_sliding_window"] = self.sliding_window is not None
        return hf


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def rope_scaling_from_hf(raw: Mapping[str, Any] | None) -> RopeScaling | None:
    """The RopeScaling of a config.json `rope_scaling` entry (None for none or the default); UnsupportedModelError for
    a type specjax does not implement."""
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            float(raw["factor"]),
            float(raw.get("low_freq_factor", 1.0)),
            float(raw.get("high_freq_factor", 4.0)),
            int(raw.get("original_max_position_embeddings", 8192)),
        )
    if rope_type == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported; specjax implements llama3 and linear")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy (argmax); top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InputError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
