"""Batched autoregressive decoding: prefill, then one token per row per step, all in one jit around lax.while_loop."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig, SamplingConfig
from specjax.errors import InputError
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Weights, forward
from specjax.sampling import Sampling, sample

PROMPT_BUCKET = 64


@dataclasses.dataclass(frozen=True)
class Completion:
    """One row's result."""

    prompt_ids: list[int]
    output_ids: list[int]  # generated ids only; the EOS token is included when one was produced
    finish_reason: str  # "stop" (an EOS token) or "length" (max_new_tokens reached)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    completions: list[Completion]
    seconds: float  # wall time of the decoding itself
    compile_seconds: float  # tracing and compilation, 0 when the executable was cached

    @property
    def new_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.completions)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    out_bn: jax.Array  # [B, max_new] generated tokens (pad after a row is done)
    num_new_b: jax.Array  # [B] tokens generated so far
    done_b: jax.Array  # [B] the row has produced EOS or reached max_new
    cache: KVCache
    key: jax.Array


def prompt_bucket(max_prompt_len: int) -> int:
    """Prompts are right-padded to a multiple of 64, so similar lengths share one compilation."""
    return -(-max_prompt_len // PROMPT_BUCKET) * PROMPT_BUCKET


def pack_prompts(prompts: Sequence[Sequence[int]], batch: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts into int32 [batch, bucket]; rows past len(prompts) repeat the first prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("every prompt must contain at least one token")
    rows = list(prompts) + [prompts[0]] * (batch - len(prompts))
    lengths = np.array([len(p) for p in rows], np.int32)
    tokens = np.full((batch, prompt_bucket(int(lengths.max()))), pad_id, np.int32)
    for i, p in enumerate(rows):
        tokens[i, : len(p)] = p
    return tokens, lengths


def prefill(
    weights: Weights,
    cfg: ModelConfig,
    tokens_up: jax.Array,
    lengths_u: jax.Array,
    cache: KVCache,
    copies: int = 1,
    **kw,
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Runs U padded prompts into an empty cache of U rows, then gives each prompt `copies` adjacent rows: N samples
    of a prompt share one prefill.

    Returns:
      (logits at each row's last prompt token [U * copies, V], taps [U * copies, P, F] or None, cache of U * copies
      rows with lengths = prompt lengths).
    """
    U, P = tokens_up.shape
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (U, P))
    logits, taps, cache = forward(weights, cfg, tokens_up, positions, cache, logits_at=(lengths_u - 1)[:, None], **kw)
    cache = dataclasses.replace(cache, lengths=lengths_u)
    if copies == 1:
        return logits[:, 0], taps, cache
    taps = None if taps is None else jnp.repeat(taps, copies, axis=0)
    return jnp.repeat(logits[:, 0], copies, axis=0), taps, cache.repeat_rows(copies)


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    return jnp.isin(tokens, jnp.array(eos_ids or (-1,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "eos_ids", "num_samples"))
def decode(
    weights: Weights,
    tokens_up: jax.Array,
    lengths_u: jax.Array,
    key: jax.Array,
    sampling: Sampling,
    *,
    cfg: ModelConfig,
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    num_samples: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Autoregressive decoding of a padded batch, entirely on device: B = U * num_samples rows.

    Args:
      weights: the model weights.
      tokens_up: int32 [U, P] right-padded prompts.
      lengths_u: int32 [U] prompt lengths.
      key: PRNG key (unused when greedy).
      sampling: the rows' sampling values (data: a new value does not compile again).
      cfg: static model config.
      max_new_tokens: static; at most this many tokens per row.
      eos_ids: static; a row stops after producing one of these.
      num_samples: static; rows per prompt (adjacent), sharing the prompt's prefill.
    Returns:
      (tokens [B, max_new_tokens], number generated per row [B]).
    """
    U, P = tokens_up.shape
    B = U * num_samples
    cache = KVCache.empty(cfg, U, P + max_new_tokens, weights.embed.dtype)
    logits_bv, _, cache = prefill(weights, cfg, tokens_up, lengths_u, cache, num_samples)
    key, sub = jax.random.split(key)
    first = sample(sub, logits_bv, sampling)
    pad = eos_ids[0] if eos_ids else 0
    state = DecodeState(
        out_bn=jnp.full((B, max_new_tokens), pad, jnp.int32).at[:, 0].set(first),
        num_new_b=jnp.ones((B,), jnp.int32),
        done_b=_is_eos(first, eos_ids) | (max_new_tokens == 1),
        cache=cache,
        key=key,
    )

    def step(s: DecodeState) -> DecodeState:
        last = jnp.take_along_axis(s.out_bn, (s.num_new_b - 1)[:, None], axis=1)  # [B, 1]
        logits, _, cache = forward(weights, cfg, last, s.cache.lengths[:, None], s.cache)
        cache = cache.advance(~s.done_b)
        key, sub = jax.random.split(s.key)
        token = jnp.where(s.done_b, pad, sample(sub, logits[:, 0], sampling))
        out = s.out_bn.at[jnp.arange(B), s.num_new_b].set(token, mode="drop")
        num_new = s.num_new_b + (~s.done_b)
        done = s.done_b | _is_eos(token, eos_ids) | (num_new >= max_new_tokens)
        return DecodeState(out, num_new, done, cache, key)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done_b), step, state)
    return state.out_bn, state.num_new_b


def generate(
    weights: Weights,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    batch_size: int | None = None,
    num_samples: int = 1,
) -> GenerateResult:
    """Generates a continuation of each prompt (one batch).

    Args:
      weights: the model weights.
      cfg: the model config.
      prompts: token ids per prompt (different lengths are fine).
      max_new_tokens: the most tokens generated per prompt.
      sampling: one setting for every prompt, or one per prompt; greedy by default.
      seed: PRNG seed for sampling.
      eos_ids: tokens that end a row; defaults to the config's EOS ids.
      batch_size: compiled prompts per call (>= len(prompts)); extra prompts are padding. Defaults to len(prompts).
      num_samples: rows per prompt, which share the prompt's prefill.
    Returns:
      A GenerateResult with num_samples Completions per prompt (adjacent), in prompt order.
    """
    req = prepare_batch(cfg, prompts, max_new_tokens, eos_ids, batch_size, sampling, num_samples)
    args = (weights, jnp.asarray(req.tokens), jnp.asarray(req.lengths), jax.random.key(seed), req.sampling)
    static = dict(cfg=cfg, max_new_tokens=max_new_tokens, eos_ids=req.eos, num_samples=num_samples)
    compiled, compile_seconds = _compiled(decode, args, static)
    t0 = time.perf_counter()
    out, num_new = jax.device_get(compiled(*args))
    seconds = time.perf_counter() - t0
    return GenerateResult(completions(req.row_prompts, out, num_new, req.eos), seconds, compile_seconds)


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated generation request, packed: U prompt rows, each decoded by num_samples adjacent rows (B = U *
    num_samples); rows past the real ones are padding."""

    tokens: np.ndarray  # int32 [U, bucket] right-padded prompts
    lengths: np.ndarray  # int32 [U]
    eos: tuple[int, ...]
    sampling: Sampling  # [B]
    active: np.ndarray  # bool [B]: a real row, not padding
    row_prompts: list[Sequence[int]]  # the prompt of each real row, in row order


def prepare_batch(
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int] | None,
    batch_size: int | None,
    sampling: SamplingConfig | Sequence[SamplingConfig],
    num_samples: int = 1,
) -> Request:
    """Validates a generation request and packs its prompts and their rows' sampling values. Raises InputError."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_samples < 1:
        raise InputError(f"num_samples must be >= 1, got {num_samples}")
    batch = batch_size or len(prompts)
    if batch < len(prompts):
        raise InputError(f"{len(prompts)} prompts do not fit in a batch of {batch}")
    eos = tuple(int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids))
    tokens, lengths = pack_prompts(prompts, batch)
    ids = np.concatenate([np.asarray(p, np.int64) for p in prompts])
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        bad = int(ids[(ids < 0) | (ids >= cfg.vocab_size)][0])
        raise InputError(f"token id {bad} is outside the model's vocabulary 0..{cfg.vocab_size - 1}")
    longest = int(lengths.max())
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise InputError(
            f"a prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds the model's maximum length "
            f"{cfg.max_position_embeddings}; shorten the prompt or lower max_new_tokens"
        )
    if not isinstance(sampling, SamplingConfig):
        if len(sampling) != len(prompts):
            raise InputError(
                f"{len(sampling)} sampling settings for {len(prompts)} prompts; give one, or one per prompt"
            )
        sampling = [s for s in sampling for _ in range(num_samples)]
    rows = batch * num_samples
    return Request(
        tokens, lengths, eos, Sampling.of(sampling, rows), np.arange(rows) < len(prompts) * num_samples,
        [p for p in prompts for _ in range(num_samples)],
    )  # fmt: skip


def completions(prompts: Sequence[Sequence[int]], out_bn, num_new_b, eos: tuple[int, ...]) -> list[Completion]:
    """One Completion per row (of prompt `prompts[i]`) from the decoded token buffer and per-row counts."""
    result = []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in np.asarray(out_bn[i, : num_new_b[i]])]
        result.append(Completion(list(prompt), ids, "stop" if ids and ids[-1] in eos else "length"))
    return result


_EXECUTABLES: dict = {}


def _compiled(fn, args, static: dict):
    """AOT-compiles `fn` once per (static args, shapes, dtypes, shardings), so timing excludes compilation.

    Returns:
      (executable, seconds spent tracing and compiling now: 0 when it was cached).
    """
    leaves, treedef = jax.tree.flatten(args)
    signature = tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)
    key = (fn, treedef, signature, tuple(sorted(static.items())))
    if key in _EXECUTABLES:
        return _EXECUTABLES[key], 0.0
    t0 = time.perf_counter()
    _EXECUTABLES[key] = fn.lower(*args, **static).compile()
    return _EXECUTABLES[key], time.perf_counter() - t0
