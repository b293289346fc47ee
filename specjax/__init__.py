"""specjax: exact speculative decoding of Llama-family models in JAX.

The public API, re-exported explicitly.
"""

from specjax.config import ModelConfig, RopeScaling, SamplingConfig
from specjax.decoding.autoregressive import Completion, GenerateResult
from specjax.errors import CheckpointError, InputError, SpecjaxError, UnsupportedModelError
from specjax.io.gguf import load_gguf
from specjax.io.hf import load_hf, save_hf
from specjax.io.loading import LoadedModel, load_model
from specjax.io.tokenizer import Tokenizer
from specjax.models.kv_cache import KVCache
from specjax.models.llama import LayerWeights, Weights, forward, init_weights, weight_specs, weights_from_hf
from specjax.sampling import Sampling, probabilities, process_logits, sample
from specjax.sharding import make_mesh, shard_weights, weight_shardings

__all__ = [
    "CheckpointError",
    "Completion",
    "GenerateResult",
    "InputError",
    "KVCache",
    "LayerWeights",
    "LoadedModel",
    "ModelConfig",
    "RopeScaling",
    "Sampling",
    "SamplingConfig",
    "SpecjaxError",
    "Tokenizer",
    "UnsupportedModelError",
    "Weights",
    "forward",
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
    "weight_shardings",
    "weight_specs",
    "weights_from_hf",
]
