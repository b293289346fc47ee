"""Memory plan: the bytes a decoding run holds on its device, from shapes alone, before anything compiles.

The loops of `specjax.decoding.autoregressive` and `specjax.decoding.speculative` hold four things at their peak:
- the target's weights;
- the KV buffers: batch x slots x layers x KV heads x head dim x 2 (K and V), where slots = S (`num_slots`: prompt +
  max_new_tokens up to a power of two) (+ the largest round's draft capacity in the speculative loop), as the loops
  size them;
- the drafter's own weights and its state (exact: the shapes `drafter.init` returns, traced without running);
- the activations of the largest forward, one prefill chunk or one verification: float32 attention
  scores and probabilities of the new tokens over themselves or over one block of cache slots (`attend` reads the
  cache by blocks: never tokens x slots), the new keys and values of all layers before they enter the cache, one
  layer's weights (the layer scan slices them), the residual stream, and float32 logits where they are computed.

The speculative loop's XLA buffers also hold half its cache twice (its keys or its values), which the plan adds to
the activations. On the CPU this is within 10% of what XLA's compiled memory analysis reports (tests/test_plan.py),
for buffers of one block and of several.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.batch import num_slots
from specjax.drafters.base import Drafter
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError
from specjax.host import GIB
from specjax.models.attention import KV_BLOCK
from specjax.models.llama import Weights, chunk_size, weight_bytes
from specjax.sampling import Sampling
from specjax.sharding import CACHE_AXES, larger_meshes, shard_fraction


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes of one run's peak on each device, by what holds them."""

    batch: int  # rows
    num_slots: int  # KV slots per row
    mesh: tuple[tuple[str, int], ...]  # the mesh's axis sizes; () for one device
    weights: int
    kv_cache: int
    drafter: int  # the drafter's own weights and its state
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.drafter + self.activations

    def table(self, device_bytes: int | None = None) -> str:
        """A Markdown table of the parts and the total (and the device's memory when given)."""
        rows = [
            ("weights", self.weights),
            (f"KV cache (batch {self.batch}, {self.num_slots} slots)", self.kv_cache),
            ("drafter (weights + state)", self.drafter),
            ("activations (largest forward)", self.activations),
            ("total", self.total),
        ]
        if device_bytes is not None:
            rows.append(("device memory", device_bytes))
        where = f" per device (mesh {', '.join(f'{a}={n}' for a, n in self.mesh)})" if self.mesh else ""
        lines = [f"| memory{where} | GiB |", "|---|---:|", *(f"| {name} | {b / GIB:.3f} |" for name, b in rows)]
        return "\n".join(lines) + "\n"


def _nbytes(tree) -> int:
    """Bytes on one device of a tree's arrays (or `jax.ShapeDtypeStruct`s): each one's shard where it has a sharding."""

    def shard(x) -> tuple[int, ...]:
        sharding = getattr(x, "sharding", None)
        return sharding.shard_shape(x.shape) if sharding is not None else x.shape

    return sum(math.prod(shard(x)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def forward_activations(
    cfg: ModelConfig,
    dtype,
    batch: int,
    tokens: int,
    slots: int,
    logit_rows: int,
    taps: int = 0,
    mesh: Mapping[str, int] | None = None,
) -> int:
    """Peak bytes of one target forward over `tokens` new tokens per row against `slots` cache slots, computing
    float32 logits at `logit_rows` positions per row and returning `taps` tapped residual streams (besides the cache
    it writes); on each device of a mesh of these axis sizes when given."""
    size = jnp.dtype(dtype).itemsize
    B, T, L = batch, tokens, cfg.num_layers
    mesh = mesh or {}

    def split(*axes_and_dims: tuple[str, int]) -> int:
        return shard_fraction(*zip(*axes_and_dims), mesh) if mesh else 1

    rows = ("batch", B)
    # float32 scores and probabilities of the new tokens over themselves, then over one block of cache slots at a time
    keys = max(T, min(KV_BLOCK, slots))
    scores = 2 * B * cfg.num_heads * T * keys * 4 // split(rows, ("heads", cfg.num_heads))
    new_kv = 2 * L * B * T * cfg.num_kv_heads * cfg.head_dim * size // split(rows, ("kv_heads", cfg.num_kv_heads))
    none = dataclasses.replace(cfg, num_layers=0)
    layer = (weight_bytes(cfg, dtype, mesh) - weight_bytes(none, dtype, mesh)) // L
    hidden = (2 + taps) * B * T * cfg.hidden_size * size // split(rows)  # residual stream, its norm, the taps
    logits = B * logit_rows * cfg.vocab_size * 4 // split(rows, ("vocab", cfg.vocab_size))
    return scores + new_kv + layer + hidden + logits


def memory_plan(
    cfg: ModelConfig,
    dtype,
    *,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    drafter: Drafter | None = None,
    draft_shape: TreeSpec | None = None,
    target_weights: Weights | None = None,
    mesh: Mapping[str, int] | None = None,
    quantize: str = "none",
    prefill_chunk: int | None = None,
) -> MemoryPlan:
    """The memory plan of a decoding run, on each device of its mesh.

    Args:
      cfg: the target config.
      dtype: the target's weight (and KV) dtype.
      batch: rows decoded together (prompts x samples).
      prompt_len: the longest prompt, in tokens (padded to the loops' width S here).
      max_new_tokens: tokens generated per row.
      drafter: the speculative loop's drafter; None for autoregressive decoding.
      draft_shape: the largest round's draft (`drafter.draft_shape(K)`, or of the largest adaptive entry).
      target_weights: the target's arrays, when the drafter shares some (layer-skip, an EAGLE-3 head's embedding):
        those are counted once, as weights.
      mesh: the mesh's axis sizes ({"data": 2, "tensor": 4}); None for one device. The weights and the KV cache are
        split by their logical axes (`specjax.sharding`), and so are the activations; the drafter's arrays count as
        they are placed (a head split by its own logical axes), its state and work whole on every device.
      quantize: the target's quantization ("none", "int8"): int8 weights count their values and scales (the
        activations still count one layer's weights in `dtype`, for the operands its matmuls convert from int8).
      prefill_chunk: prompt tokens per prefill forward (`chunk_size`); None: the platform's.
    Returns:
      A MemoryPlan.
    """
    P = num_slots(cfg, prompt_len + max_new_tokens)
    capacity = draft_shape.capacity if drafter is not None else 0
    slots = P + capacity
    size = jnp.dtype(dtype).itemsize
    cache_shape = (cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
    kv = 2 * math.prod(cache_shape) * size
    taps = len(drafter.traits.tap_layers) if drafter is not None else 0
    chunk = chunk_size(prefill_chunk, P)
    activations = forward_activations(cfg, dtype, batch, chunk, slots, 1, taps, mesh)
    drafter_bytes = 0
    if drafter is not None:
        verified = draft_shape.budget
        # The round's logits, and the draft distributions beside them ([B, T, V] float32 each).
        activations = max(
            activations, forward_activations(cfg, dtype, batch, verified, slots, 2 * verified, taps, mesh)
        )
        shared = {id(x) for x in jax.tree.leaves(target_weights)}
        own = [x for x in jax.tree.leaves(drafter) if id(x) not in shared]
        state, drafter_work = _drafter_state_and_work(cfg, dtype, drafter, draft_shape, batch, P, chunk, slots)
        drafter_bytes = _nbytes(own) + _nbytes(state)
        # XLA holds a second copy of half the target's cache (its keys or its values) across the loop's writes.
        activations = max(activations, drafter_work) + kv // 2
    if not mesh:
        return MemoryPlan(batch, slots, (), weight_bytes(cfg, dtype, quantize=quantize), kv, drafter_bytes, activations)
    kv_split = shard_fraction(CACHE_AXES, cache_shape, mesh)
    return MemoryPlan(
        batch,
        slots,
        tuple(mesh.items()),
        weight_bytes(cfg, dtype, mesh, quantize),
        kv // kv_split,
        drafter_bytes,
        activations,
    )


def _drafter_state_and_work(
    cfg: ModelConfig, dtype, drafter: Drafter, shape: TreeSpec, batch: int, prompt: int, chunk: int, slots: int
) -> tuple[object, int]:
    """The drafter's state (abstract: `init` traced, not run) and the largest value its work computes: its commit of
    one prefill chunk, or its proposal of a round's draft (greedy)."""
    B = batch
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    # The drafter is an argument, not a constant, of what is traced: its arrays may be abstract (shapes alone).
    state = jax.eval_shape(
        lambda d, *a: d.init(*a, num_slots=slots), drafter, jax.ShapeDtypeStruct((B, prompt), jnp.int32), lengths
    )
    tokens = jax.ShapeDtypeStruct((B, chunk), jnp.int32)
    taps = jax.ShapeDtypeStruct((B, chunk, len(drafter.traits.tap_layers) * cfg.hidden_size), dtype)
    commit = jax.make_jaxpr(lambda d, *a: d.commit(*a))(
        drafter, state, tokens, taps if drafter.traits.tap_layers else None, lengths
    )
    sampling = Sampling.of(SamplingConfig(), B)
    propose = jax.make_jaxpr(lambda d, *a: d.propose(*a, shape=shape, vocab_size=cfg.vocab_size, sampling=sampling))(
        drafter, state, jax.ShapeDtypeStruct((B, slots), jnp.int32), lengths, jax.random.split(jax.random.key(0), B)
    )
    return state, max(_largest_value(commit.jaxpr), _largest_value(propose.jaxpr))


def _largest_value(jaxpr: jax_core.Jaxpr) -> int:
    """Bytes of the largest array a jaxpr, or one nested in it (a scan's body, a branch), computes."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                largest = max(largest, math.prod(aval.shape) * aval.dtype.itemsize)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, jax_core.ClosedJaxpr):
                    largest = max(largest, _largest_value(sub.jaxpr))
                elif isinstance(sub, jax_core.Jaxpr):
                    largest = max(largest, _largest_value(sub))
    return largest


def check_fits(plan_at: Callable[..., MemoryPlan], batch: int, available: int, devices: int = 1) -> MemoryPlan:
    """The plan at `batch` rows; raises InputError when it exceeds `available` bytes, naming the largest batch that
    would fit and the first larger mesh of `devices` devices (`larger_meshes`; `plan_at(batch, mesh)` plans on one)
    that would."""
    plan = plan_at(batch)
    if plan.total <= available:
        return plan
    low, high = 0, batch  # plan_at(low) fits (or low == 0), plan_at(high) does not: the total grows with the batch
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if plan_at(mid).total <= available else (low, mid)
    advice = [f"a batch of {low} would fit"] if low else []
    used = math.prod(n for _, n in plan.mesh)
    mesh = next((m for m in larger_meshes(used, devices) if plan_at(batch, m).total <= available), None)
    if mesh is not None:
        advice.append(f"{{mesh}} ({math.prod(mesh.values())} devices) would")
    raise InputError(
        f"this run needs {plan.total / GIB:.2f} GiB (weights {plan.weights / GIB:.2f}, KV cache "
        f"{plan.kv_cache / GIB:.2f}, drafter {plan.drafter / GIB:.2f}, activations {plan.activations / GIB:.2f}) but "
        f"the device holds {available / GIB:.2f} GiB; "
        + (", or ".join(advice) if advice else "not even one row fits: lower {max_new_tokens}"),
        settings={"mesh": mesh, "max_new_tokens": None},
    )
