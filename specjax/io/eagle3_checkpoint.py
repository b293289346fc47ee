"""EAGLE-3 head checkpoints in the published `LlamaForCausalLMEagle3` format (docs/eagle3-head.md, section 6).

A head folder holds config.json and safetensors with the keys `fc.weight`, `midlayer.*`, `norm.weight`,
`lm_head.weight`, `d2t` (int64 [Vd]), `t2d` (bool [V]) and, rarely, `embed_tokens.weight`, in PyTorch [out, in]
layout. On read, the vLLM / speculators renamings are accepted too (`model.` prefixes, `layers.0.` for `midlayer.`,
`draft_id_to_target_id` for `d2t`, fused `qkv_proj` / `gate_up_proj`); `t2d` may be absent (it follows from d2t).
Pickled `pytorch_model.bin` files are refused: loading them runs code.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from specjax.config import ModelConfig
from specjax.errors import CheckpointError, InputError
from specjax.host import write_file
from specjax.io.hf import _safetensors_files, open_tensors, read_json
from specjax.models.eagle3 import Eagle3Config, Eagle3Head

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
INT_DTYPES = ("I64", "I32", "U32", "I16")
_TORCH_DTYPE_NAMES = {
    np.dtype(np.float16): "float16",
    np.dtype(jnp.bfloat16): "bfloat16",
    np.dtype(np.float32): "float32",
}

# The midlayer keys of a published head, with the JAX-layout parameter each one becomes.
_MIDLAYER = {
    "input_layernorm.weight": "input_norm",
    "hidden_norm.weight": "hidden_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
_TOP = {"fc.weight": "fc", "norm.weight": "final_norm", "lm_head.weight": "lm_head"}
HF_TO_PARAM = {**_TOP, **{f"midlayer.{k}": v for k, v in _MIDLAYER.items()}}


def hf_tensor_specs(
    cfg: Eagle3Config, dtype=jnp.bfloat16, embedding: bool = False
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every tensor a published head of `cfg` stores: {key: (PyTorch [out, in] shape, dtype)}.

    Args:
      cfg: the head config.
      dtype: the dtype of the float weights (d2t is always int64 and t2d bool).
      embedding: whether the head stores its own `embed_tokens.weight`.
    Returns:
      The spec, in the key order `save_eagle3` writes.
    """
    D, F, N, K, Hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    fdt = np.dtype(dtype)
    shapes = {
        "fc.weight": (D, cfg.fc_in_features),
        "midlayer.input_layernorm.weight": (D,),
        "midlayer.hidden_norm.weight": (D,),
        "midlayer.self_attn.q_proj.weight": (N * Hd, 2 * D),
        "midlayer.self_attn.k_proj.weight": (K * Hd, 2 * D),
        "midlayer.self_attn.v_proj.weight": (K * Hd, 2 * D),
        "midlayer.self_attn.o_proj.weight": (D, N * Hd),
        "midlayer.post_attention_layernorm.weight": (D,),
        "midlayer.mlp.gate_proj.weight": (F, D),
        "midlayer.mlp.up_proj.weight": (F, D),
        "midlayer.mlp.down_proj.weight": (D, F),
        "norm.weight": (D,),
        "lm_head.weight": (cfg.draft_vocab_size, D),
    }
    spec = {name: (shape, fdt) for name, shape in shapes.items()}
    spec["d2t"] = ((cfg.draft_vocab_size,), np.dtype(np.int64))
    spec["t2d"] = ((cfg.vocab_size,), np.dtype(np.bool_))
    if embedding:
        spec["embed_tokens.weight"] = ((cfg.vocab_size, D), fdt)
    return spec


def head_to_hf(head: Eagle3Head) -> dict[str, jax.Array]:
    """The head's tensors under the published key names in PyTorch [out, in] layout (d2t int32 here, int64 on disk).

    Pure jnp, so `nnx.eval_shape(lambda: head_to_hf(Eagle3Head(cfg, rngs=...)))` gives the shapes without weights.
    """
    cfg = head.cfg
    D = cfg.hidden_size

    def torch_layout(param: str, w: jax.Array) -> jax.Array:
        if param in ("q", "k", "v"):  # [2D, heads, Hd] -> [heads*Hd, 2D]
            return w.reshape(2 * D, -1).T
        if param == "o":  # [N, Hd, D] -> [D, N*Hd]
            return w.reshape(-1, D).T
        return w if w.ndim == 1 else w.T

    out = {name: torch_layout(param, getattr(head, param)[...]) for name, param in HF_TO_PARAM.items()}
    out["d2t"] = head.d2t[...]
    out["t2d"] = head.t2d[...]
    if head.embed is not None:
        out["embed_tokens.weight"] = head.embed[...]
    return out


def _param_from_torch_layout(param: str, w: np.ndarray, cfg: Eagle3Config) -> np.ndarray:
    D = cfg.hidden_size
    if param in ("q", "k", "v"):
        return w.T.reshape(2 * D, -1, cfg.head_dim)
    if param == "o":
        return w.T.reshape(cfg.num_heads, cfg.head_dim, D)
    return w if w.ndim == 1 else w.T


# ---------------------------------------------------------------------------------------------------------------
# Reading.


def _read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (safetensors dtype, shape)} from a safetensors header, without touching the tensor data."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
        return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); re-download or re-export it") from None


def _canonical_name(name: str) -> str:
    """The published key of a tensor saved under a vLLM / speculators / SGLang-style name."""
    n = name[len("model.") :] if name.startswith("model.") else name
    if n.startswith("layers.0."):
        n = "midlayer." + n[len("layers.0.") :]
    if n == "draft_id_to_target_id":
        n = "d2t"
    return n


_FUSED = {
    "midlayer.self_attn.qkv_proj.weight": ("midlayer.self_attn.q_proj.weight", "k_proj", "v_proj"),
    "midlayer.mlp.gate_up_proj.weight": ("midlayer.mlp.gate_proj.weight", "up_proj"),
}


def _plan(
    cfg: Eagle3Config, headers: Mapping[str, tuple[str, tuple[int, ...]]], folder: Path
) -> tuple[dict[str, Callable[[Callable[[str], np.ndarray]], np.ndarray]], bool]:
    """Matches the stored tensors to the expected ones; raises one CheckpointError naming every problem.

    Returns:
      ({published key: read(get) -> numpy array in PyTorch layout}, whether the head stores an embedding).
    """
    D, K, Hd, F = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    has_embed = any(_canonical_name(n) == "embed_tokens.weight" for n in headers)
    spec = hf_tensor_specs(cfg, np.float32, embedding=has_embed)
    optional = {"t2d"} | ({"d2t"} if cfg.draft_vocab_size == cfg.vocab_size else set())
    readers: dict[str, Callable] = {}
    found: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # key -> (stored name, dtype, shape)
    extra, dupes, problems = [], [], []

    def add(key: str, stored: str, dt: str, shape: tuple[int, ...], read: Callable) -> None:
        if key in found:
            dupes.append(f"{found[key][0]} and {stored}")
            return
        found[key] = (stored, dt, shape)
        readers[key] = read

    for stored, (dt, shape) in headers.items():
        key = _canonical_name(stored)
        if key in _FUSED:
            first, *rest = _FUSED[key]
            prefix = first.rsplit(".", 2)[0]
            if key.endswith("qkv_proj.weight"):
                sizes = (cfg.num_heads * Hd, K * Hd, K * Hd)
                expected = (sum(sizes), 2 * D)
            else:
                sizes, expected = (F, F), (2 * F, D)
            if shape != expected:
                problems.append(f"{stored} has shape {list(shape)}, expected {list(expected)}")
                continue
            parts = [first] + [f"{prefix}.{r}.weight" for r in rest]
            bounds = np.cumsum((0, *sizes))
            for i, part in enumerate(parts):
                lo, hi = int(bounds[i]), int(bounds[i + 1])
                add(part, stored, dt, (hi - lo, expected[1]), lambda get, s=stored, lo=lo, hi=hi: get(s)[lo:hi])
        elif key in spec:
            add(key, stored, dt, shape, lambda get, s=stored: get(s))
        else:
            extra.append(stored)

    missing = [k for k in spec if k not in found and k not in optional]
    for key, (stored, dt, shape) in found.items():
        want_shape, want_dtype = spec[key]
        if shape != want_shape:
            problems.append(f"{stored} has shape {list(shape)}, expected {list(want_shape)}")
        kind = "bool" if key == "t2d" else "int" if key == "d2t" else "float"
        ok = dt == "BOOL" if kind == "bool" else dt in INT_DTYPES if kind == "int" else dt in FLOAT_DTYPES
        if not ok:
            problems.append(f"{stored} has dtype {dt}, expected {kind}")
    parts = []
    if missing:
        parts.append("missing " + ", ".join(missing))
    if extra:
        parts.append("unexpected " + ", ".join(sorted(extra)))
    if dupes:
        parts.append("stored twice: " + ", ".join(dupes))
    parts += problems
    if parts:
        raise CheckpointError(
            f"{folder} does not hold the EAGLE-3 head its config.json describes: {'; '.join(parts)}; "
            "re-export the head or fix config.json"
        )
    return readers, has_embed


def check_eagle3(folder: str | os.PathLike, target_cfg: ModelConfig) -> Eagle3Config:
    """Validates a head folder from config.json and the safetensors headers alone (no tensor data is read).

    Args:
      folder: the head folder.
      target_cfg: the config of the target model the head will draft for.
    Returns:
      The head config. Raises CheckpointError (naming every missing, unexpected or mis-shaped tensor at once) or
      UnsupportedModelError.
    """
    cfg, _, _ = _inspect(Path(folder), target_cfg)
    return cfg


def _inspect(folder: Path, target_cfg: ModelConfig):
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; pass a folder with config.json and model.safetensors")
    cfg = Eagle3Config.from_hf(read_json(folder / "config.json"), target_cfg, str(folder / "config.json"))
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in _safetensors_files(folder):
        headers.update(_read_header(path))
    readers, has_embed = _plan(cfg, headers, folder)
    return cfg, readers, has_embed


def load_eagle3(
    folder: str | os.PathLike, target_cfg: ModelConfig, dtype=jnp.float32
) -> tuple[Eagle3Config, Eagle3Head]:
    """Loads a published-format EAGLE-3 head (EAGLE, SpecForge, vLLM/speculators key names).

    Args:
      folder: holds config.json and model.safetensors (or shards / any *.safetensors).
      target_cfg: the config of the target model the head will draft for; a head made for a target of another
        hidden size or vocabulary is refused.
      dtype: the dtype of the head's weights and computation.
    Returns:
      (config, head). Raises CheckpointError for a missing, corrupt, incomplete or mismatched checkpoint and
      UnsupportedModelError for a head variant specjax does not run.
    """
    folder = Path(folder)
    cfg, readers, has_embed = _inspect(folder, target_cfg)
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    weights: dict[str, Any] = {}
    with open_tensors(folder) as get:
        for key, param in HF_TO_PARAM.items():
            w = np.asarray(readers[key](get), np.float32)
            if not np.isfinite(w).all():
                raise CheckpointError(f"{folder}: {key} holds NaN or infinite values; the head is corrupt, retrain it")
            weights[param] = jnp.asarray(_param_from_torch_layout(param, w, cfg), dtype)  # one tensor at a time
        if "d2t" in readers:
            d2t = np.asarray(readers["d2t"](get)).astype(np.int64)
        else:
            d2t = np.zeros((Vd,), np.int64)
        target_ids = d2t + np.arange(Vd)
        if Vd and (target_ids.min() < 0 or target_ids.max() >= V or np.any(np.diff(target_ids) <= 0)):
            raise CheckpointError(
                f"{folder}: d2t does not map the {Vd} draft ids to distinct ascending target ids in 0..{V - 1}; "
                "re-export the head"
            )
        if "t2d" in readers:
            t2d = np.asarray(readers["t2d"](get)).astype(bool)
            if not np.array_equal(np.flatnonzero(t2d), target_ids):
                raise CheckpointError(
                    f"{folder}: t2d and d2t describe different draft vocabularies; re-export the head"
                )
        if has_embed:
            embed = np.asarray(readers["embed_tokens.weight"](get), np.float32)
            # tpu-inference's convention: an all-zero stored embedding means "share the target's".
            if cfg.needs_own_embedding or np.any(embed):
                weights["embed"] = jnp.asarray(embed, dtype)
    weights["d2t"] = d2t.astype(np.int32)
    return cfg, Eagle3Head(cfg, dtype=dtype, weights=weights)


# ---------------------------------------------------------------------------------------------------------------
# Writing.


def save_eagle3(folder: str | os.PathLike, cfg: Eagle3Config, head: Eagle3Head, dtype=jnp.bfloat16) -> None:
    """Writes the head as config.json + model.safetensors in the published format, each file atomically.

    Keys, [out, in] shapes and dtypes are exactly `hf_tensor_specs(cfg, dtype, embedding=head has one)`: float
    weights in `dtype`, d2t int64, t2d bool. vLLM, SGLang, SpecForge and `load_eagle3` read the result.

    Args:
      folder: the destination (created if needed).
      cfg: the head config (must be the head's).
      head: the head.
      dtype: stored float dtype: jnp.bfloat16 (default), np.float16 or np.float32.
    """
    if cfg != head.cfg:
        raise InputError("save_eagle3: cfg is not the config of the head being saved; pass head.cfg")
    fdt = np.dtype(dtype)
    if fdt not in _TORCH_DTYPE_NAMES:
        raise InputError(f"save_eagle3: cannot store weights as {fdt}; use bfloat16, float16 or float32")
    spec = hf_tensor_specs(cfg, fdt, embedding=head.embed is not None)
    tensors = head_to_hf(head)
    stored: dict[str, np.ndarray] = {}
    for name, (shape, dt) in spec.items():
        arr = np.asarray(tensors[name]).astype(dt)
        assert arr.shape == shape, (name, arr.shape, shape)  # a converter bug, not a user error
        stored[name] = np.ascontiguousarray(arr)
    hf = cfg.to_hf()
    hf["torch_dtype"] = _TORCH_DTYPE_NAMES[fdt]
    folder = Path(folder)
    write_file(folder / "model.safetensors", lambda tmp: safetensors.numpy.save_file(stored, tmp, {"format": "pt"}))
    text = json.dumps(hf, indent=2)
    write_file(folder / "config.json", text)
