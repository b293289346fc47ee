"""Weight-only int8 (`--quantize int8`): the target's matrices as int8 values with one scale per output channel.

A matrix w becomes `Int8Matrix(values, scale)`, w ~ values * scale: symmetric, scale = max |w| over the contracted
(input) axes / 127, in the run's dtype, its shape w's with those axes of size 1. Quantized are the layers' q, k, v,
o, gate, up and down and the LM head: the untied `lm_head`, or the tied embedding per vocabulary row, which serves
both the lookup and the head. Norm scales and biases stay in the run's dtype.

The forward reads every matrix through `weight_einsum` and every embedding row through `embed_rows`; both take plain
arrays too, so one forward serves float and int8 weights.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import InputError

Weights = Any  # a `specjax.models.llama.Weights` (llama reads its matrices through this module)

QUANTIZE_CHOICES = ("none", "int8")
LAYER_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
# The contracted (input) axes of each quantizable matrix, counted from the end (the same with or without the L axis).
CONTRACTED = {
    "q": (-3,),
    "k": (-3,),
    "v": (-3,),
    "o": (-3, -2),
    "gate": (-2,),
    "up": (-2,),
    "down": (-2,),
    "lm_head": (-2,),
    "embed": (-1,),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Matrix:
    """A weight as int8 values and per-output-channel scales. `dtype` is what it stands for (its scales' dtype).
    Indexing and `.T` apply to both arrays alike: they are meant for output and layer axes (rows of a head)."""

    values: Any  # int8, the weight's shape
    scale: Any  # the weight's shape with the contracted axes of size 1, in the run's dtype

    @property
    def dtype(self):
        return self.scale.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def T(self) -> Int8Matrix:
        return Int8Matrix(self.values.T, self.scale.T)

    def __getitem__(self, index) -> Int8Matrix:
        return Int8Matrix(self.values[index], self.scale[index])


def check_quantize(quantize: str) -> None:
    if quantize not in QUANTIZE_CHOICES:
        raise InputError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}; got {quantize!r}")


def quantize_matrix(w, contracted: tuple[int, ...], dtype) -> Int8Matrix:
    """`w` (numpy or JAX, any float dtype) as an Int8Matrix with scales in `dtype`, over the `contracted` axes. The
    values are rounded against the scales as stored, so |w - values * scale| <= scale / 2. numpy stays numpy (a loader
    quantizes on the host, before placing)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w32 = xp.asarray(w, np.float32)
    # Times float32 1/127: what XLA makes of a division by 127, so numpy and a jitted JAX agree to the bit.
    scale = (xp.abs(w32).max(axis=contracted, keepdims=True) * np.float32(1 / 127)).astype(dtype)
    s32 = scale.astype(np.float32)
    values = xp.clip(xp.round(w32 / xp.where(s32 > 0, s32, 1)), -127, 127).astype(np.int8)
    return Int8Matrix(values, scale)


def map_matrices(weights: Weights, fn: Callable[[Any, tuple[int, ...]], Any]) -> Weights:
    """`weights` (a Weights pytree of arrays or of ArraySpecs) with fn(matrix, its contracted axes) in place of each
    matrix int8 quantizes."""
    layers = weights.layers
    head = "embed" if weights.lm_head is None else "lm_head"
    quantized = {n: fn(getattr(layers, n), CONTRACTED[n]) for n in LAYER_MATRICES}
    return dataclasses.replace(
        weights, layers=dataclasses.replace(layers, **quantized), **{head: fn(getattr(weights, head), CONTRACTED[head])}
    )


def quantize_weights(weights: Weights, quantize: str = "int8") -> Weights:
    """`weights` with their matrices as Int8Matrix (scales in the weights' dtype), or as they are for "none"."""
    check_quantize(quantize)
    if quantize == "none":
        return weights
    return _int8(weights, weights.final_norm.dtype)


@functools.partial(jax.jit, static_argnums=1)
def _int8(weights: Weights, dtype) -> Weights:
    return map_matrices(weights, lambda w, contracted: quantize_matrix(w, contracted, dtype))


def quantization(weights: Weights) -> str:
    """The quantization of `weights`: "int8" for those of `quantize_weights` or of loading with int8, else "none"."""
    return "int8" if isinstance(weights.layers.q, Int8Matrix) else "none"


def dequantize(w) -> jax.Array:
    """The array `w` stands for: itself, or an Int8Matrix's values times its scales, in its dtype."""
    return w.values.astype(w.dtype) * w.scale if isinstance(w, Int8Matrix) else w


def embed_rows(table_vd, ids) -> jax.Array:
    """Rows `ids` of an embedding table [V, D] (an array, or an Int8Matrix with a scale per row): [..., D]."""
    return dequantize(table_vd[ids])


def weight_einsum(spec: str, x: jax.Array, w, **kwargs) -> jax.Array:
    """`jnp.einsum(spec, x, w)` (letters only, x first) for a weight that may be an Int8Matrix: then x times its int8
    values in x's dtype, and that times the output channels' scales; no dequantized copy of w is made."""
    if not isinstance(w, Int8Matrix):
        return jnp.einsum(spec, x, w, **kwargs)
    y = jnp.einsum(spec, x, w.values.astype(x.dtype), **kwargs)
    w_axes, out = spec.split(",")[1].split("->")
    kept = [a for a in w_axes if a in out]
    scale = jnp.squeeze(w.scale, [i for i, a in enumerate(w_axes) if a not in out])  # the output channels' scales
    scale = jnp.transpose(scale, [kept.index(a) for a in out if a in kept])  # in the output's order
    return y * jnp.expand_dims(scale, [i for i, a in enumerate(out) if a not in kept]).astype(y.dtype)
