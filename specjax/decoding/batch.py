"""A generation request, validated and packed into fixed shapes; its rows turned back into completions.

A request's one varying static size is S = `num_slots`: the next power of two at or above its longest row's prompt
plus new tokens (at least MIN_SLOTS, at most the model's maximum length). Prompts are right-padded to S tokens, the
cache holds S slots per row (the speculative loop adds its deepest draft's capacity), the output buffer holds S, and
each row's max_new_tokens is data, so requests of one S share one program whatever their prompt lengths and limits.
Every executable is compiled once per (static arguments, shapes, dtypes, shardings) and reused (`compiled`), and
each compilation is counted per loop (`compilations`).

Every row draws from a PRNG key of its own (`row_keys`), so a row's sampled tokens depend on its seed, prompt and
settings alone, not on the batch it shares or its place in it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import numbers
import time
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from specjax.config import ModelConfig, SamplingConfig
from specjax.errors import InputError
from specjax.host import status
from specjax.sampling import Sampling
from specjax.sharding import mesh_of

MIN_SLOTS = 256


@dataclasses.dataclass(frozen=True)
class Completion:
    """One row's result."""

    prompt_ids: list[int]
    output_ids: list[int]  # generated ids only; the EOS token is included when one was produced
    finish_reason: str  # "stop" (an EOS token) or "length" (max_new_tokens reached)


def num_slots(cfg: ModelConfig, context: int) -> int:
    """S, the slots per row of a request whose longest row holds `context` tokens (prompt + new tokens): the next
    power of two, at least MIN_SLOTS, at most the model's maximum length (which `prepare_batch` checks it holds)."""
    return min(max(MIN_SLOTS, 1 << (context - 1).bit_length()), cfg.max_position_embeddings)


def pack_prompts(
    prompts: Sequence[Sequence[int]], batch: int, width: int, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts into int32 [batch, width]; rows past len(prompts) repeat the first prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("every prompt must contain at least one token")
    rows = list(prompts) + [prompts[0]] * (batch - len(prompts))
    lengths = np.array([len(p) for p in rows], np.int32)
    tokens = np.full((batch, width), pad_id, np.int32)
    for i, p in enumerate(rows):
        tokens[i, : len(p)] = p
    return tokens, lengths


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated generation request, packed: U prompt rows, each decoded by num_samples adjacent rows (B = U *
    num_samples); rows past the real ones are padding."""

    tokens: np.ndarray  # int32 [U, S] right-padded prompts, S = num_slots
    lengths: np.ndarray  # int32 [U]
    max_new: np.ndarray  # int32 [B] each row's most new tokens
    eos: tuple[int, ...]
    sampling: Sampling  # [B]
    keys: jax.Array  # [B] typed PRNG keys, one per row (`row_keys`)
    active: np.ndarray  # bool [B]: a real row, not padding
    row_prompts: list[Sequence[int]]  # the prompt of each real row, in row order


def prepare_batch(
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    eos_ids: Sequence[int] | None,
    batch_size: int | None,
    sampling: SamplingConfig | Sequence[SamplingConfig],
    num_samples: int = 1,
    seed: int | Sequence[int] = 0,
) -> Request:
    """Validates a generation request (one max_new_tokens for every prompt, or one per prompt; one seed, or one per
    prompt) and packs its prompts, their rows' limits, sampling values and PRNG keys. Raises InputError."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, numbers.Integral) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise InputError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts; give one, or one per prompt")
    if min(limits, default=1) < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {min(limits)}")
    if num_samples < 1:
        raise InputError(f"num_samples must be >= 1, got {num_samples}")
    batch = batch_size or len(prompts)
    if batch < len(prompts):
        raise InputError(f"{len(prompts)} prompts do not fit in a batch of {batch}")
    eos = tuple(int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids))
    context, longest = max(((len(p) + n, len(p)) for p, n in zip(prompts, limits)), default=(1, 0))
    if context > cfg.max_position_embeddings:
        raise InputError(
            f"a prompt of {longest} tokens plus {context - longest} new tokens exceeds the model's maximum length "
            f"{cfg.max_position_embeddings}; shorten the prompt or lower max_new_tokens"
        )
    tokens, lengths = pack_prompts(prompts, batch, num_slots(cfg, context))
    ids = np.concatenate([np.asarray(p, np.int64) for p in prompts])
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        bad = int(ids[(ids < 0) | (ids >= cfg.vocab_size)][0])
        raise InputError(f"token id {bad} is outside the model's vocabulary 0..{cfg.vocab_size - 1}")
    if not isinstance(sampling, SamplingConfig):
        if len(sampling) != len(prompts):
            raise InputError(
                f"{len(sampling)} sampling settings for {len(prompts)} prompts; give one, or one per prompt"
            )
        sampling = [s for s in sampling for _ in range(num_samples)]
    rows = batch * num_samples
    max_new = np.repeat(np.array(limits + limits[:1] * (batch - len(prompts)), np.int32), num_samples)
    return Request(
        tokens,
        lengths,
        max_new,
        eos,
        Sampling.of(sampling, rows),
        row_keys(seed, len(prompts), batch, num_samples),
        np.arange(rows) < len(prompts) * num_samples,
        [p for p in prompts for _ in range(num_samples)],
    )


SEED_END = 2**63  # JAX's PRNG takes a 64-bit seed


def row_keys(seed: int | Sequence[int], num_prompts: int, batch: int, num_samples: int = 1) -> jax.Array:
    """The typed PRNG keys [batch * num_samples] of a request's rows, prompt by prompt (its samples adjacent).

    Prompt i's key is `key(seed[i])` for a seed per prompt, `fold_in(key(seed), i)` for one seed; its sample j's is
    `fold_in(prompt key, j)`. Padding prompts (past num_prompts) take the first prompt's seed, or their index. A seed
    is an integer in 0..2**63-1. Raises InputError.
    """
    if isinstance(seed, numbers.Integral) or isinstance(seed, (str, bytes)) or not isinstance(seed, Iterable):
        prompt_keys = _fold_in_each(jax.random.key(checked_seed(seed))[None], batch)[0]
    else:
        seeds = [checked_seed(s) for s in seed]
        if len(seeds) != num_prompts:
            raise InputError(f"{len(seeds)} seeds for {num_prompts} prompts; give one, or one per prompt")
        prompt_keys = jnp.stack([jax.random.key(s) for s in seeds + seeds[:1] * (batch - num_prompts)])
    return _fold_in_each(prompt_keys, num_samples).reshape(-1)


def checked_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < SEED_END:
        raise InputError(f"seed must be an integer in 0..2**63-1 (or a sequence of them, one per prompt), got {seed!r}")
    return int(seed)


@functools.partial(jax.jit, static_argnums=1)
def _fold_in_each(keys_u: jax.Array, count: int) -> jax.Array:
    """[U, count] keys: entry [u, j] is fold_in(keys_u[u], j)."""
    return jax.vmap(lambda key: jax.vmap(functools.partial(jax.random.fold_in, key))(jnp.arange(count)))(keys_u)


def completions(prompts: Sequence[Sequence[int]], out_bn, num_new_b, eos: tuple[int, ...]) -> list[Completion]:
    """One Completion per row (of prompt `prompts[i]`) from the decoded token buffer and per-row counts."""
    result = []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in np.asarray(out_bn[i, : num_new_b[i]])]
        result.append(Completion(list(prompt), ids, "stop" if ids and ids[-1] in eos else "length"))
    return result


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """bool, of the shape of `tokens`: which are end-of-sequence ids."""
    return jnp.isin(tokens, jnp.array(eos_ids or (-1,), jnp.int32))


def on_mesh(args):
    """`args` with every array not yet on the mesh of its sharded ones (the weights) replicated onto it: the prompts,
    keys and sampling values, a drafter's weights. So a program spans every device, of every process, of that mesh."""
    mesh = mesh_of(args)
    if mesh is None:
        return args
    whole = NamedSharding(mesh, PartitionSpec())

    def place(x):
        if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh:
            return x
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(place(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        return jax.device_put(np.asarray(x), whole)  # from the host: every process holds the same values

    return jax.tree.map(place, args)


def to_host(tree):
    """numpy copies of a program's outputs, gathered from every process where they are split across processes."""
    return jax.tree.map(
        lambda x: np.asarray(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True)), tree
    )


_EXECUTABLES: dict = {}
_COMPILATIONS: collections.Counter = collections.Counter()  # programs compiled, per function name
_COMPILE_SECONDS: collections.Counter = collections.Counter()  # and the seconds they took


def compilations() -> dict[str, int]:
    """Programs `compiled` has compiled in this process so far, per function name."""
    return dict(_COMPILATIONS)


def compilation_summary() -> str:
    """One line: how many programs were compiled, of which functions, in how long."""
    total = sum(_COMPILATIONS.values())
    each = ", ".join(f"{name} x{n}" for name, n in _COMPILATIONS.items())
    return f"compiled {total} program{'s' * (total != 1)}" + (
        f" ({each}) in {sum(_COMPILE_SECONDS.values()):.1f} s" if each else ""
    )


def compiled(fn, args, static: dict):
    """AOT-compiles `fn` once per (static args, shapes, dtypes, shardings), so timing excludes compilation.

    Arguments placed on a mesh (sharded weights) make it the traced mesh, so caches and batches take their logical
    axes on it (`specjax.sharding.constrain`).

    Returns:
      (executable, seconds spent tracing and compiling now: 0 when it was cached).
    """
    leaves, treedef = jax.tree.flatten(args)
    signature = tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)
    key = (fn, treedef, signature, tuple(sorted(static.items())))
    if key in _EXECUTABLES:
        return _EXECUTABLES[key], 0.0
    status(f"compiling {fn.__name__} (once per batch size, number of slots and loop options)")
    t0 = time.perf_counter()
    mesh = mesh_of(args)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        _EXECUTABLES[key] = fn.lower(*args, **static).compile()
    seconds = time.perf_counter() - t0
    _COMPILATIONS[fn.__name__] += 1
    _COMPILE_SECONDS[fn.__name__] += seconds
    return _EXECUTABLES[key], seconds
