"""specjax: exact speculative decoding of Llama-family models in JAX.

The front door: load a model, decode plainly or speculatively with any drafter, fixed or adaptive drafting, and the
errors every entry point raises. Everything else is importable from its sub-package (docs/architecture.md).
"""

from specjax.adaptive import Adaptive, Fixed
from specjax.config import ModelConfig, RopeScaling, SamplingConfig
from specjax.decoding.autoregressive import GenerateResult, generate
from specjax.decoding.batch import Completion
from specjax.decoding.speculative import generate as speculative_generate
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
from specjax.sampling import Sampling, probabilities, process_logits, sample
from specjax.sharding import make_mesh

__all__ = [
    "Adaptive",
    "ChainDrafter",
    "CheckpointError",
    "Completion",
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
    "load_hf",
    "load_model",
    "make_mesh",
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
