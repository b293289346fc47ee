"""Plain decoding: prefill, then one target token per row per step, all in one jit around `lax.while_loop`.

The baseline every speculative result is checked against: greedy speculative output equals this token for token.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.batch import Completion, compiled, completions, is_eos, on_mesh, prepare_batch, to_host
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Weights, chunk_size, chunked_prefill, forward
from specjax.sampling import Sampling, sample, split_rows
from specjax.sharding import constrain, set_rows


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
    out_bn: jax.Array  # [B, S] generated tokens (pad after a row is done)
    num_new_b: jax.Array  # [B] tokens generated so far
    done_b: jax.Array  # [B] the row has produced EOS or reached its max_new
    cache: KVCache
    keys_b: jax.Array  # [B] typed PRNG keys: each row's own, split every step


def prefill_prompts(
    weights: Weights,
    cfg: ModelConfig,
    tokens_up: jax.Array,
    lengths_u: jax.Array,
    cache: KVCache,
    copies: int,
    chunk: int,
    tap_layers: tuple[int, ...] = (),
    see_chunk: Callable[[Any, jax.Array, jax.Array | None], Any] | None = None,
    seen: Any = None,
) -> tuple[jax.Array, Any, KVCache]:
    """Runs U padded prompts into an empty cache of U rows by chunks (`chunked_prefill`, which hands each chunk's taps
    of the U rows to `see_chunk`), then gives each prompt `copies` adjacent rows: N samples of a prompt share one
    prefill.

    Returns:
      (logits at each row's last prompt token [U * copies, V], `seen` after the last chunk, cache of U * copies rows
      with lengths = prompt lengths).
    """
    tokens_up = constrain(tokens_up, ("batch", None))  # rows over the data axis of a mesh
    logits, seen, cache = chunked_prefill(weights, cfg, tokens_up, lengths_u, cache, chunk, tap_layers, see_chunk, seen)
    if copies == 1:
        return logits, seen, cache
    return jnp.repeat(logits, copies, axis=0), seen, cache.repeat_rows(copies)


@functools.partial(jax.jit, static_argnames=("cfg", "eos_ids", "num_samples", "prefill_chunk"))
def decode(
    weights: Weights,
    tokens_up: jax.Array,
    lengths_u: jax.Array,
    max_new_b: jax.Array,
    keys_b: jax.Array,
    sampling: Sampling,
    *,
    cfg: ModelConfig,
    eos_ids: tuple[int, ...],
    num_samples: int = 1,
    prefill_chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """Autoregressive decoding of a padded batch, entirely on device: B = U * num_samples rows.

    Args:
      weights: the model weights.
      tokens_up: int32 [U, S] prompts right-padded to S = `num_slots(...)`, the cache's slots per row: the one shape
        that varies between requests.
      lengths_u: int32 [U] prompt lengths.
      max_new_b: int32 [B] the most tokens each row generates, at most S - its prompt length (data).
      keys_b: typed PRNG keys [B], one per row (unused when greedy): a row's draws come from its key alone.
      sampling: the rows' sampling values (data: a new value does not compile again).
      cfg: static model config.
      eos_ids: static; a row stops after producing one of these.
      num_samples: static; rows per prompt (adjacent), sharing the prompt's prefill.
      prefill_chunk: static; prompt tokens per prefill forward.
    Returns:
      (tokens [B, S], number generated per row [B]).
    """
    U, S = tokens_up.shape
    B = U * num_samples
    cache = KVCache.empty(cfg, U, S, weights.embed.dtype)
    logits_bv, _, cache = prefill_prompts(weights, cfg, tokens_up, lengths_u, cache, num_samples, prefill_chunk)
    keys_b, first_keys_b = split_rows(keys_b)
    first = sample(first_keys_b, logits_bv, sampling)
    pad = eos_ids[0] if eos_ids else 0
    state = DecodeState(
        out_bn=jnp.full((B, S), pad, jnp.int32).at[:, 0].set(first),
        num_new_b=jnp.ones((B,), jnp.int32),
        done_b=is_eos(first, eos_ids) | (max_new_b <= 1),
        cache=cache,
        keys_b=keys_b,
    )

    def step(s: DecodeState) -> DecodeState:
        last = jnp.take_along_axis(s.out_bn, (s.num_new_b - 1)[:, None], axis=1)  # [B, 1]
        logits, _, cache = forward(weights, cfg, last, s.cache.lengths[:, None], s.cache)
        cache = cache.advance(~s.done_b)
        keys_b, step_keys_b = split_rows(s.keys_b)
        token = jnp.where(s.done_b, pad, sample(step_keys_b, logits[:, 0], sampling))
        out = set_rows(s.out_bn, s.num_new_b, token)
        num_new = s.num_new_b + (~s.done_b)
        done = s.done_b | is_eos(token, eos_ids) | (num_new >= max_new_b)
        return DecodeState(out, num_new, done, cache, keys_b)

    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done_b), step, state)
    return state.out_bn, state.num_new_b


def generate(
    weights: Weights,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
    seed: int | Sequence[int] = 0,
    eos_ids: Sequence[int] | None = None,
    batch_size: int | None = None,
    num_samples: int = 1,
    prefill_chunk: int | None = None,
) -> GenerateResult:
    """Generates a continuation of each prompt (one batch).

    Args:
      weights: the model weights.
      cfg: the model config.
      prompts: token ids per prompt (different lengths are fine).
      max_new_tokens: the most tokens generated per prompt: one for every prompt, or one per prompt.
      sampling: one setting for every prompt, or one per prompt; greedy by default.
      seed: PRNG seed for sampling: one for the request (prompt i draws from fold_in(key(seed), i)), or one per
        prompt (prompt i from key(seed[i])); sample j of a prompt from fold_in(its key, j). A row's tokens depend
        on its own key alone, not on the rest of the batch.
      eos_ids: tokens that end a row; defaults to the config's EOS ids.
      batch_size: compiled prompts per call (>= len(prompts)); extra prompts are padding. Defaults to len(prompts).
      num_samples: rows per prompt, which share the prompt's prefill.
      prefill_chunk: prompt tokens per prefill forward; defaults to the platform's (`chunk_size`).
    Returns:
      A GenerateResult with num_samples Completions per prompt (adjacent), in prompt order.
    """
    req = prepare_batch(cfg, prompts, max_new_tokens, eos_ids, batch_size, sampling, num_samples, seed)
    args = (
        weights,
        jnp.asarray(req.tokens),
        jnp.asarray(req.lengths),
        jnp.asarray(req.max_new),
        req.keys,
        req.sampling,
    )
    static = dict(cfg=cfg, eos_ids=req.eos, num_samples=num_samples, prefill_chunk=chunk_size(prefill_chunk))
    args = on_mesh(args)
    executable, compile_seconds = compiled(decode, args, static)
    t0 = time.perf_counter()
    out, num_new = to_host(executable(*args))
    seconds = time.perf_counter() - t0
    return GenerateResult(completions(req.row_prompts, out, num_new, req.eos), seconds, compile_seconds)
