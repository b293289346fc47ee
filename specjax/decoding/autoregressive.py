"""Plain decoding: prefill, then one target token per row per step, all in one jit around `lax.while_loop`.

The baseline every speculative result is checked against: greedy speculative output equals this token for token.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.batch import Completion, compiled, completions, is_eos, on_mesh, prepare_batch, prng_key, to_host
from specjax.models.kv_cache import KVCache
from specjax.models.llama import Weights, forward
from specjax.sampling import Sampling, sample
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
    out_bn: jax.Array  # [B, max_new] generated tokens (pad after a row is done)
    num_new_b: jax.Array  # [B] tokens generated so far
    done_b: jax.Array  # [B] the row has produced EOS or reached max_new
    cache: KVCache
    key: jax.Array


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
    tokens_up = constrain(tokens_up, ("batch", None))  # rows over the data axis of a mesh
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (U, P))
    logits, taps, cache = forward(weights, cfg, tokens_up, positions, cache, logits_at=(lengths_u - 1)[:, None], **kw)
    cache = cache.at_lengths(lengths_u)
    if copies == 1:
        return logits[:, 0], taps, cache
    taps = None if taps is None else jnp.repeat(taps, copies, axis=0)
    return jnp.repeat(logits[:, 0], copies, axis=0), taps, cache.repeat_rows(copies)


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
        done_b=is_eos(first, eos_ids) | (max_new_tokens == 1),
        cache=cache,
        key=key,
    )

    def step(s: DecodeState) -> DecodeState:
        last = jnp.take_along_axis(s.out_bn, (s.num_new_b - 1)[:, None], axis=1)  # [B, 1]
        logits, _, cache = forward(weights, cfg, last, s.cache.lengths[:, None], s.cache)
        cache = cache.advance(~s.done_b)
        key, sub = jax.random.split(s.key)
        token = jnp.where(s.done_b, pad, sample(sub, logits[:, 0], sampling))
        out = set_rows(s.out_bn, s.num_new_b, token)
        num_new = s.num_new_b + (~s.done_b)
        done = s.done_b | is_eos(token, eos_ids) | (num_new >= max_new_tokens)
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
    args = (weights, jnp.asarray(req.tokens), jnp.asarray(req.lengths), prng_key(seed), req.sampling)
    static = dict(cfg=cfg, max_new_tokens=max_new_tokens, eos_ids=req.eos, num_samples=num_samples)
    args = on_mesh(args)
    executable, compile_seconds = compiled(decode, args, static)
    t0 = time.perf_counter()
    out, num_new = to_host(executable(*args))
    seconds = time.perf_counter() - t0
    return GenerateResult(completions(req.row_prompts, out, num_new, req.eos), seconds, compile_seconds)
