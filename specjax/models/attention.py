"""Attention by blocks of cache slots, up to the live length: what a forward costs grows with the text, not the buffer.

Every attention of the package (the target's prefill chunks, one-token steps, chains and trees; the draft heads'
cached steps) is `attend`: the new tokens' scores first, then the cached keys read `KV_BLOCK` slots at a time with an
online softmax (a running max and sum in float32, as flash attention keeps them), for as many blocks as the slots
any query can see fill (`CachedKeys.live`), and the rest of them `KV_TAIL` slots at a time. A buffer of 8k slots
with 300 live tokens reads 384 slots, not 8k; an empty cache (a prefill's first chunk) reads none.

The cache's part has two implementations of one signature: `read_blocks`, the pure-JAX loop, and `read_fused`, one
Pallas kernel that reads each row's own blocks only. The kernel applies to a cache that `CachedKeys.below` made (row
b's first counts[b] slots, from a first slot per query: the target's cache, Mistral's sliding window included) read
by at most `FUSED_MAX_TOKENS` new tokens; everything else (a prefill chunk, a visibility function: the draft heads'
trees, training's masks) takes the loop. Where the kernel applies, the `attention` choice (`ModelConfig.attention`)
picks: "blocks" the loop; "pallas" the kernel (compiled by Mosaic on TPU, interpreted elsewhere), an InputError if it
fails; "auto" the kernel on `KERNEL_PLATFORMS` (TPU) only, and only once it has passed its check there: its first use
for a shape class on a device compiles it and compares it with the loop on a small input (`kernel_failure`). If that
fails, one warning, and the loop for the rest of the process on that device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from specjax.errors import InputError
from specjax.host import log
from specjax.sharding import CACHE_AXES, partition_spec

KV_BLOCK = 512  # cache slots read per block
KV_TAIL = 128  # per block past the last whole one: a short text reads little beyond its end (read through a whole
# 512-slot block, a plain step of 8 short rows of SmolLM2 took 1.5x as long on a CPU)
FUSED_MAX_TOKENS = 64  # the kernel's state for all new tokens of a row stays in VMEM: prefill chunks take the loop
KERNEL_PLATFORMS = ("tpu",)  # where "auto" considers the kernel (the tests add "cpu", where it runs interpreted)
NEG = float(jnp.finfo(jnp.float32).min)  # the loop's score of a slot not seen; the kernel's first running max

State = tuple[jax.Array, jax.Array, jax.Array]  # online softmax: max, sum [B, K, G, T], weighted values [B, K, G, T, H]


@dataclasses.dataclass(frozen=True)
class CachedKeys:
    """The cached keys and values one attention reads, and which slots each query sees."""

    k: jax.Array  # [B, S, K, H], or every layer's [L, B, S, K, H], read at `layer`
    v: jax.Array
    visible: Callable[[jax.Array], jax.Array]  # slot ids [Sb] -> bool [B, T, Sb]: which of them each query sees
    # No query sees a slot >= live, so blocks past it are not read; None: all S. Traced (the target's cache) over more
    # than one block, it makes a loop that reverse-mode differentiation cannot go through (training passes None).
    live: jax.Array | int | None = None
    layer: jax.Array | None = None
    counts: jax.Array | None = None  # [B], set by `below`: `visible` is slots [first[b, t], counts[b]) of row b
    first: jax.Array | None = None  # [B, T], set by `below`; None: 0

    @classmethod
    def below(
        cls,
        k: jax.Array,
        v: jax.Array,
        counts_b: jax.Array,
        first_bt: jax.Array | None = None,
        layer: jax.Array | int | None = None,
    ) -> CachedKeys:
        """Row b's first counts_b[b] slots, each query t seeing those at or past first_bt[b, t] when given (a sliding
        window): the visibility the fused kernel reads from `counts` and `first`."""

        def visible(slots):
            seen = slots_below(counts_b)(slots)
            return seen if first_bt is None else seen & (slots[None, None, :] >= first_bt[:, :, None])

        return cls(k, v, visible, jnp.max(counts_b), layer, counts_b, first_bt)

    @property
    def num_slots(self) -> int:
        return self.k.shape[-3]

    def read(self, start: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, size, K, H] of slots start .. start + size - 1 (of `layer` when stacked)."""
        if self.layer is None:
            return tuple(jax.lax.dynamic_slice_in_dim(x, start, size, axis=1) for x in (self.k, self.v))
        B, K, H = self.k.shape[1], *self.k.shape[3:]
        corner = (jnp.asarray(self.layer, jnp.int32), 0, jnp.asarray(start, jnp.int32), 0, 0)
        return tuple(jax.lax.dynamic_slice(x, corner, (1, B, size, K, H))[0] for x in (self.k, self.v))


def slots_below(counts_b: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """`CachedKeys.visible` for a row's first counts_b[b] slots, seen by each of its queries."""
    return lambda slots: slots[None, None, :] < counts_b[:, None, None]


def slots_where(mask_bts: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """`CachedKeys.visible` of a mask [B, T, S] given whole (training, where S is a short context)."""
    return lambda slots: jnp.take(mask_bts, slots, axis=2)


def attend(
    q_btkgh: jax.Array,
    k_new_btkh: jax.Array,
    v_new_btkh: jax.Array,
    new_mask_btt: jax.Array,
    cached: CachedKeys,
    attention: str = "auto",
) -> jax.Array:
    """Softmax attention of T new queries over the new tokens and the visible cache slots, never concatenating them.

    Args:
      q_btkgh: queries [B, T, K, G, H], rotary already applied.
      k_new_btkh, v_new_btkh: the new tokens' keys/values [B, T, K, H].
      new_mask_btt: bool [B, T, T], which new tokens each query sees; each sees at least itself.
      cached: the cache's keys/values, read by blocks up to `cached.live` (cast to the new values' dtype).
      attention: "auto", "blocks" or "pallas": whether the fused kernel reads the cache where it applies (see the
        module's docstring and `kernel_reads`).
    Returns:
      [B, T, K, G, H] in the dtype of the values; scores, softmax statistics and sums in float32.
    """
    read = read_blocks
    if kernel_reads(attention, q_btkgh, cached, v_new_btkh.dtype):
        read = functools.partial(read_fused, interpret=jax.default_backend() != "tpu")
    return attend_reading(read, q_btkgh, k_new_btkh, v_new_btkh, new_mask_btt, cached)


def attend_reading(
    read: Callable[..., State],
    q_btkgh: jax.Array,
    k_new_btkh: jax.Array,
    v_new_btkh: jax.Array,
    new_mask_btt: jax.Array,
    cached: CachedKeys,
) -> jax.Array:
    """`attend` with the cache's part of the softmax read by `read` (`read_blocks` or `read_fused`)."""
    s = scores(q_btkgh, k_new_btkh, new_mask_btt)
    m = s.max(-1)  # [B, K, G, T]; finite, as every query sees itself
    p = jnp.exp(s - m[..., None])
    _, total, acc = read(q_btkgh, cached, (m, p.sum(-1), weighted(p, v_new_btkh)), v_new_btkh.dtype)
    return jnp.einsum("bkgth->btkgh", acc / total[..., None]).astype(v_new_btkh.dtype)


class KernelShape(NamedTuple):
    """What Mosaic compiles the fused kernel for on one device: its new tokens, KV heads (a device's share on a
    mesh), queries per KV head, head size, the slots of its check's cache (one or two blocks, the last one as partial
    as the real cache's) and the cache's and the computation's dtypes."""

    tokens: int
    kv_heads: int
    group: int
    head_dim: int
    slots: int
    cache_dtype: str
    dtype: str


# (platform, device kind, shape) -> None where the kernel passed its check, else why it failed: for the process.
KERNEL_CHECKS: dict[tuple[str, str, KernelShape], str | None] = {}


def kernel_reads(attention: str, q_btkgh: jax.Array, cached: CachedKeys, dtype) -> bool:
    """Whether the fused kernel reads `cached` for these queries: where it applies (a cache `CachedKeys.below` made,
    at most FUSED_MAX_TOKENS new tokens), with "pallas", or with "auto" on KERNEL_PLATFORMS once it has passed its
    check there (run here, at trace time, on its first use for a shape; after a failure, one warning and the loop
    from then on). "pallas" raises InputError where the kernel fails its check."""
    if attention == "blocks" or cached.counts is None or q_btkgh.shape[1] > FUSED_MAX_TOKENS:
        return False
    if attention == "auto" and (jax.default_backend() not in KERNEL_PLATFORMS or kernel_failed_here()):
        return False
    _, T, K, G, H = q_btkgh.shape
    S = cached.num_slots
    size = min(KV_BLOCK, S)
    shards = kernel_shards(cached.k.shape if cached.layer is not None else (1, *cached.k.shape))
    shape = KernelShape(
        T,
        K // (1 if shards is None else shards[2]),
        G,
        H,
        S if S <= 2 * size else size + (S % size or size),
        jnp.dtype(cached.k.dtype).name,
        jnp.dtype(dtype).name,
    )
    key = (*device_kind(), shape)
    if key not in KERNEL_CHECKS:
        KERNEL_CHECKS[key] = failure = kernel_failure(shape)
        if failure is not None and attention == "auto":
            log.warning(
                f"warning: the Pallas attention kernel failed its check on {key[1]} ({failure}); the cache is read "
                "by the pure-JAX block loop from now on in this process"
            )
    failure = KERNEL_CHECKS[key]
    if failure is not None and attention == "pallas":
        raise InputError(
            f"attention 'pallas': the Pallas attention kernel failed its check on {key[1]} ({failure}); "
            "choose attention 'auto' or 'blocks', which read the cache by the pure-JAX block loop"
        )
    return failure is None


def device_kind() -> tuple[str, str]:
    """(platform, device kind) of this process's first device: what a kernel check holds for."""
    device = jax.devices()[0]
    return device.platform, device.device_kind


def kernel_failed_here() -> bool:
    """Whether the fused kernel has failed a check on this process's device kind."""
    here = device_kind()
    return any(failure is not None for (*where, _), failure in KERNEL_CHECKS.items() if tuple(where) == here)


def attention_path(attention: str) -> str:
    """Which implementation reads the cache of one-token steps, chains and trees with this choice on this process's
    device: "pallas" or "blocks" ("auto": the loop off KERNEL_PLATFORMS and once the kernel has failed its check
    here). A prefill chunk of more than FUSED_MAX_TOKENS tokens takes the loop whatever the choice."""
    on_kernel = attention == "pallas" or (
        attention == "auto" and jax.default_backend() in KERNEL_PLATFORMS and not kernel_failed_here()
    )
    return "pallas" if on_kernel else "blocks"


def compile_probe(fn: Callable, *args) -> Callable:
    """The kernel check's compile step: `fn` compiled for `args` (the tests replace it to inject a failure)."""
    return jax.jit(fn).lower(*args).compile()


def kernel_failure(shape: KernelShape) -> str | None:
    """Compiles the fused kernel for `shape` on this device and runs it against the block loop on a small random
    input (2 rows, a full cache and a partial one, a causal chain of new tokens, a stacked cache read at layer 1).

    Runs at once, off any mesh it is called on (`kernel_reads` calls it while tracing a forward).

    Returns:
      None where it compiles, runs and agrees with the loop; else one line saying why not.
    """
    rng = np.random.default_rng(0)
    B, T, K, G, H, S = 2, shape.tokens, shape.kv_heads, shape.group, shape.head_dim, shape.slots

    def draw(dtype, *dims):
        return np.asarray(rng.standard_normal(dims), jnp.dtype(dtype))

    args = (
        draw(shape.dtype, B, T, K, G, H),
        draw(shape.dtype, B, T, K, H),
        draw(shape.dtype, B, T, K, H),
        draw(shape.cache_dtype, 2, B, S, K, H),
        draw(shape.cache_dtype, 2, B, S, K, H),
        np.array([S, S // 2 + 1], np.int32),
    )

    def run(read):
        def attend_cache(q, k_new, v_new, k, v, counts):
            causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
            return attend_reading(read, q, k_new, v_new, causal, CachedKeys.below(k, v, counts, layer=1))

        return attend_cache

    fused = functools.partial(read_fused, interpret=jax.default_backend() != "tpu")
    # Compiled executables called on NumPy arrays run at once, even while a forward is being traced.
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        try:
            got = np.asarray(compile_probe(run(fused), *args)(*args), np.float32)
        except Exception as e:  # noqa: BLE001 - Mosaic and the runtime fail in many ways: each is the kernel failing
            lines = str(e).strip().splitlines() or [""]
            return f"{type(e).__name__}: {lines[0][:200]}"
        want = np.asarray(jax.jit(run(read_blocks)).lower(*args).compile()(*args), np.float32)
    # Loose enough for bfloat16 and TPU's default float32 matmul precision; a broken kernel is off by O(1) or NaN.
    if not np.allclose(got, want, rtol=3e-2, atol=3e-2):
        return f"its output is off the block loop's by up to {np.nanmax(np.abs(got - want), initial=np.inf):.3g}"
    return None


def scores(q_btkgh: jax.Array, k_bskh: jax.Array, seen_bts: jax.Array) -> jax.Array:
    """Scaled float32 scores [B, K, G, T, S], NEG where a query does not see a key."""
    s = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    return jnp.where(seen_bts[:, None, None], s * q_btkgh.shape[-1] ** -0.5, NEG)


def weighted(p_bkgts: jax.Array, v_bskh: jax.Array) -> jax.Array:
    """Values weighted by probabilities p (in the values' dtype): float32 [B, K, G, T, H]."""
    return jnp.einsum("bkgts,bskh->bkgth", p_bkgts.astype(v_bskh.dtype), v_bskh, preferred_element_type=jnp.float32)


def read_blocks(q_btkgh: jax.Array, cached: CachedKeys, state: State, dtype) -> State:
    """The online softmax `state` carried over the cache's blocks up to `cached.live` (keys and values cast to
    `dtype`): the whole blocks of `KV_BLOCK` slots below it, then the rest by blocks of `KV_TAIL`, in loops of as many
    trips as they are."""
    S = cached.num_slots
    size = min(KV_BLOCK, S)

    def blocks_of(size, offset):
        def block(j, state):
            m, total, acc = state
            first = offset + j * size
            start = jnp.minimum(first, S - size)  # a last block may overlap the one before it: those slots are masked
            k, v = (x.astype(dtype) for x in cached.read(start, size))
            slots = start + jnp.arange(size)
            s = scores(q_btkgh, k, cached.visible(slots) & (slots >= first)[None, None, :])
            m_new = jnp.maximum(m, s.max(-1))
            rescale, p = jnp.exp(m - m_new), jnp.exp(s - m_new[..., None])
            return m_new, total * rescale + p.sum(-1), acc * rescale[..., None] + weighted(p, v)

        return block

    every = -(-S // size)
    if cached.live is None or (every == 1 and not isinstance(cached.live, int)):
        return jax.lax.fori_loop(0, every, blocks_of(size, 0), state)  # static, so reverse-mode differentiation works
    # static for an int; traced, loops of forward-mode differentiation only
    whole = cached.live // size
    state = jax.lax.fori_loop(0, whole, blocks_of(size, 0), state)
    tail = min(KV_TAIL, size)
    return jax.lax.fori_loop(0, -(-(cached.live - whole * size) // tail), blocks_of(tail, whole * size), state)


def read_fused(q_btkgh: jax.Array, cached: CachedKeys, state: State, dtype, interpret: bool = False) -> State:
    """`read_blocks` for a cache made by `CachedKeys.below`: the cache's part of the online softmax by
    `cache_partials` (the Pallas kernel, interpreted with `interpret`; on a mesh, each device on its rows and KV
    heads), merged with `state`."""
    B, T, K, G, H = q_btkgh.shape
    k, v = (x if cached.layer is not None else x[None] for x in (cached.k, cached.v))
    first_bt = jnp.zeros((B, T), jnp.int32) if cached.first is None else cached.first.astype(jnp.int32)
    args = (
        cached.counts.astype(jnp.int32),
        jnp.maximum(first_bt.min(1), 0),  # the first slot any query of the row sees
        jnp.reshape(0 if cached.layer is None else cached.layer, (1,)).astype(jnp.int32),
        jnp.einsum("btkgh->bkgth", q_btkgh).reshape(B, K, G * T, H),  # a KV head's query rows (g, t)
        jnp.broadcast_to(first_bt[:, None, :], (B, G, T)).reshape(B, G * T, 1),
        k,
        v,
    )
    partials = functools.partial(cache_partials, size=min(KV_BLOCK, k.shape[2]), dtype=dtype, interpret=interpret)
    shards = kernel_shards(k.shape)
    if shards is not None:
        rows, heads, _ = shards
        cache = P(None, rows, None, heads)
        in_specs = (P(rows), P(rows), P(), P(rows, heads), P(rows), cache, cache)
        partials = jax.shard_map(partials, in_specs=in_specs, out_specs=(P(rows, heads),) * 3, check_vma=False)
    m_c, total_c, acc_c = (x.reshape(B, K, G, T, -1) for x in partials(*args))
    m, total, acc = state
    m_new = jnp.maximum(m, m_c[..., 0])
    a, c = jnp.exp(m - m_new), jnp.exp(m_c[..., 0] - m_new)
    return m_new, total * a + total_c[..., 0] * c, acc * a[..., None] + acc_c * c[..., None]


def kernel_shards(cache_shape: tuple[int, ...]) -> tuple | None:
    """On a mesh of more than one device, where each device runs the kernel on its own rows and KV heads of a
    stacked cache [L, B, S, K, H]: (the mesh axes of the rows, those of the KV heads, how many shards the KV heads
    are split into); None off a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    _, rows, _, heads, _ = partition_spec(CACHE_AXES, cache_shape, mesh)
    head_axes = () if heads is None else (heads,) if isinstance(heads, str) else heads
    return rows, heads, math.prod(mesh.shape[a] for a in head_axes)


def cache_partials(
    counts, lows, layer, q, first, k, v, *, size: int, dtype, interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Pallas TPU kernel (interpreted with `interpret`, on any platform): the online softmax (max, sum
    [B, K, R, 1], weighted values [B, K, R, H], float32) of queries q [B, K, R, H] over the cache k, v [L, B, S, K, H]
    at `layer`, row b seeing slots [first[b, r], counts[b]) (lows[b]: the least first[b, :], at least 0).

    Grid (B, blocks of `size` slots), the block axis sequential: step (b, j) reads slots j * size .. (j + 1) * size - 1
    of row b, all KV heads at once (a [size, K, H] block, its last two dims whole: the cache is read in place, never
    transposed), each head's keys and values by strided loads. Counts, lows and the layer come by scalar prefetch:
    steps outside the blocks row b sees compute nothing, and their index map repeats a block it sees, so no copy is
    issued for them. The running state stays in VMEM scratch along the row's steps and is written out at its last.
    """
    B, K, R, H = q.shape
    S = k.shape[2]

    def kernel(
        counts_ref, lows_ref, layer_ref, q_ref, first_ref, k_ref, v_ref, m_out, l_out, acc_out, m_ref, l_ref, acc_ref
    ):
        b, j = pl.program_id(0), pl.program_id(1)
        count = counts_ref[b]

        @pl.when(j == 0)
        def _():
            m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)  # finite: p is 0, not NaN, while nothing is seen
            l_ref[...], acc_ref[...] = jnp.zeros(l_ref.shape, jnp.float32), jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when((j * size < count) & ((j + 1) * size > lows_ref[b]))
        def _():
            slots = j * size + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)
            seen = (slots < count) & (slots >= first_ref[...])  # [R, size]
            keys, values = (ref.reshape(size * K, H) for ref in (k_ref, v_ref))  # head h of slot s: row s * K + h
            for h in range(K):
                k_h, v_h = (head_rows(x, h, K).astype(dtype) for x in (keys, values))
                if S % size:  # the last block is partial: its values past the buffer are anything, even NaN
                    v_h = jnp.where(j * size + jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0) < S, v_h, 0)
                s = jax.lax.dot_general(q_ref[h], k_h, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                s = jnp.where(seen, s * H**-0.5, -jnp.inf)
                m = m_ref[h]
                m_new = jnp.maximum(m, s.max(1, keepdims=True))
                rescale, p = jnp.exp(m - m_new), jnp.exp(s - m_new)
                m_ref[h], l_ref[h] = m_new, l_ref[h] * rescale + p.sum(1, keepdims=True)
                acc_ref[h] = acc_ref[h] * rescale + jnp.dot(p.astype(dtype), v_h, preferred_element_type=jnp.float32)

        @pl.when(j == pl.num_programs(1) - 1)
        def _():
            m_out[...], l_out[...], acc_out[...] = m_ref[...], l_ref[...], acc_ref[...]

    def kv_block(b, j, counts_ref, lows_ref, layer_ref):  # j clamped to the blocks row b sees
        last = jnp.maximum(jax.lax.div(counts_ref[b] + size - 1, size) - 1, 0)
        return layer_ref[0], b, jnp.minimum(jnp.maximum(j, jax.lax.div(lows_ref[b], size)), last), 0, 0

    def per_row(*shape):
        return pl.BlockSpec((None, *shape), lambda b, j, *_: (b,) + (0,) * len(shape))

    shapes = ((K, R, 1), (K, R, 1), (K, R, H))
    cache_block = pl.BlockSpec((None, None, size, K, H), kv_block)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, pl.cdiv(S, size)),
            in_specs=[per_row(K, R, H), per_row(R, 1), cache_block, cache_block],
            out_specs=tuple(per_row(*shape) for shape in shapes),
            scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for shape in shapes],
        ),
        out_shape=tuple(jax.ShapeDtypeStruct((B, *shape), jnp.float32) for shape in shapes),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(counts, lows, layer, q, first, k, v)


def head_rows(ref, h: int, K: int) -> jax.Array:
    """Rows h, h + K, h + 2K, ... of a [n * K, H] ref: head h's keys or values [n, H] of n slots. bfloat16 is read
    as 32-bit words (two heads each) and the head's half taken, as JAX's ragged paged attention kernel does instead
    of Mosaic's strided loads of a packed type."""
    n = ref.shape[0] // K
    if ref.dtype != jnp.bfloat16 or K % 2:
        return ref[pl.ds(h, n, stride=K), :]
    words = ref.bitcast(jnp.uint32)[pl.ds(h // 2, n, stride=K // 2), :]
    return pltpu.bitcast(words << 16 if h % 2 == 0 else words & jnp.uint32(0xFFFF0000), jnp.float32).astype(ref.dtype)
