"""specjax: exact speculative decoding of Llama-family models in JAX.

The front door: load a model, set a run up (`prepare_decoding`: drafter, policy, memory plan), decode plainly or
speculatively with any drafter, fixed or adaptive drafting, and the errors every entry point raises. Everything
else is importable from its sub-package (docs/architecture.md).
"""

from specjax.adaptive import Adaptive, Fixed
from specjax.config import ModelConfig, RopeScaling, SamplingConfig
from specjax.decoding.autoregressive import GenerateResult, generate
from specjax.decoding.batch import Completion
from specjax.decoding.speculative import speculative_generate
from specjax.decoding.stats import SpecResult, SpecStats
from specjax.drafters import ChainDrafter, Drafter, TreeSpec, drafter_from_spec
from specjax.errors import CheckpointError, InputError, SpecjaxError, UnsupportedModelError
from specjax.io.gguf import load_gguf
from specjax.io.hf import load_hf, save_hf
from specjax.io.loading import LoadedModel, load_model
from specjax.io.tokenizer import Tokenizer
from specjax.measure.calibration import calibrated
from specjax.models.kv_cache import KVCache
from specjax.models.llama import (
    LayerWeights,
    Weights,
    forward,
    init_weights,
    shard_weights,
    weight_shardings,
    weight_specs,
    weights_from_hf,
)
from specjax.prepare import DecodeConfig, Decoding, load_decode_config, prepare_decoding
from specjax.sampling import Sampling, probabilities, process_logits, sample
from specjax.sharding import make_mesh

__all__ = [
    "Adaptive",
    "ChainDrafter",
    "CheckpointError",
    "Completion",
    "DecodeConfig",
    "Decoding",
    "Drafter",
    "Fixed",
    "GenerateResult",
    "InputError",
    "KVCache",
    "LayerWeights",
    "LoadedModel",
    "ModelConfig",
    "RopeScaling",
    "Sampling",
    "SamplingConfig",
    "SpecResult",
    "SpecStats",
    "SpecjaxError",
    "Tokenizer",
    "TreeSpec",
    "UnsupportedModelError",
    "Weights",
    "calibrated",
    "drafter_from_spec",
    "forward",
    "generate",
    "init_weights",
    "load_gguf",
    "load_decode_config",
    "load_hf",
    "load_model",
    "make_mesh",
    "prepare_decoding",
    "probabilities",
    "process_logits",
    "sample",
    "save_hf",
    "shard_weights",
    "speculative_generate",
    "weight_shardings",
    "weight_specs",
    "weights_from_hf",
]
