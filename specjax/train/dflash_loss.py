"""The DFlash training loss (docs/dflash.md, section 6): blocks at random anchors of the packed rows, all run in one
pass of the draft, and position-weighted cross entropy against the target's own tokens.

A block anchored at row a (a and a + 1 assistant tokens of one sample) holds [x_a, MASK * (Bs - 1)] at positions
p[a] .. p[a] + Bs - 1. Its rows see the context rows of their sample before a (the target's features there) and
their own block in both directions, which is exactly the inference pass of a block whose pending token is x_a. Row k
is supervised by x_{a+k} when that token is assistant content of the same sample inside the row and in the draft
vocabulary, with weight exp(-(k - 1) / gamma).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.attention import slots_where
from specjax.models.dflash import (
    DFlashConfig,
    DFlashWeights,
    block_hidden,
    block_inputs,
    context_kv,
    draft_logits,
    scored_head,
)


def pick_anchors(rows: dict[str, jax.Array], key: jax.Array, num_anchors: int) -> tuple[jax.Array, jax.Array]:
    """Up to `num_anchors` anchors per row, uniformly without replacement among the valid positions.

    Returns:
      (anchors [B, N] int32, ok [B, N] bool: False where the row has fewer valid positions than N).
    """
    mask, segments = rows["loss_mask"], rows["segments"]
    valid = (mask[:, :-1] > 0) & (mask[:, 1:] > 0) & (segments[:, :-1] == segments[:, 1:])
    valid = jnp.pad(valid, [(0, 0), (0, 1)])
    scores = jnp.where(valid, jax.random.uniform(key, valid.shape), -1.0)
    top, anchors = jax.lax.top_k(scores, num_anchors)  # the top N of i.i.d. uniforms: a uniform subset
    return anchors.astype(jnp.int32), top >= 0


def block_masks(segments_bt: jax.Array, anchors_bn: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """(context mask [B, N*Bs, T]: rows before the anchor in its sample; block mask [B, N*Bs, N*Bs]: own block)."""
    B, T = segments_bt.shape
    anchor_q = jnp.repeat(anchors_bn, block_size, axis=1)  # [B, Q]
    sample_q = jnp.take_along_axis(segments_bt, anchor_q, axis=1)
    context = (jnp.arange(T) < anchor_q[..., None]) & (segments_bt[:, None, :] == sample_q[..., None])
    Q = anchors_bn.shape[1] * block_size
    block = jnp.arange(Q) // block_size
    return context, jnp.broadcast_to(block[:, None] == block[None, :], (B, Q, Q))


def block_loss(
    w: DFlashWeights,
    cfg: DFlashConfig,
    embed_vd: jax.Array,
    head_vd: jax.Array,
    draft_index_v: jax.Array,
    rows: dict[str, jax.Array],
    taps_btf: jax.Array,
    anchors_bn: jax.Array,
    ok_bn: jax.Array,
    gamma: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DFlash loss of one batch.

    Args:
      w, cfg: the draft (`w.vocab_ids`: the draft vocabulary, or None for all V).
      embed_vd, head_vd: the target's embedding and LM head, both [V, D].
      draft_index_v: int32 [V], each target id's index among the draft's scored ids, -1 where it has none.
      rows: packed rows, int32 [B, T] each (specjax/train/batches.py).
      taps_btf: the target's features at the draft's taps [B, T, F] (stop-gradient).
      anchors_bn, ok_bn: N block anchors per row and which of them count (`pick_anchors`).
      gamma: the decay of the position weights.
    Returns:
      (loss, {"loss_k": [Bs-1], "acc_k": [Bs-1], "rows_k": [Bs-1] supervised rows per block position}).
    """
    Bs = cfg.block_size
    tokens, segments, positions = rows["tokens"], rows["segments"], rows["positions"]
    B, T = tokens.shape
    anchors, ok, num_anchors = anchors_bn, ok_bn, anchors_bn.shape[1]
    ids, block_positions = block_inputs(
        cfg, jnp.take_along_axis(positions, anchors, 1), jnp.take_along_axis(tokens, anchors, 1)
    )
    ctx_k, ctx_v = context_kv(w, cfg, taps_btf, positions)
    context_mask, own_block = block_masks(segments, anchors, Bs)
    drafts = np.flatnonzero(np.arange(num_anchors * Bs) % Bs)  # every block row but the anchors
    h = block_hidden(w, cfg, embed_vd, ids, block_positions, ctx_k, ctx_v, slots_where(context_mask), own_block, drafts)
    logp = jax.nn.log_softmax(draft_logits(scored_head(w, head_vd), h).reshape(B, num_anchors, Bs - 1, -1), axis=-1)

    at = anchors[..., None] + jnp.arange(Bs)  # [B, N, Bs]: the row each block position predicts
    inside = at < T
    at = jnp.minimum(at, T - 1).reshape(B, -1)
    label = draft_index_v[jnp.take_along_axis(tokens, at, 1)].reshape(B, num_anchors, Bs)
    same_sample = (
        jnp.take_along_axis(segments, at, 1).reshape(B, num_anchors, Bs)
        == jnp.take_along_axis(segments, anchors, 1)[..., None]
    )
    assistant = jnp.take_along_axis(rows["loss_mask"], at, 1).reshape(B, num_anchors, Bs) > 0
    supervised = (ok[..., None] & inside & same_sample & assistant & (label >= 0))[..., 1:].astype(jnp.float32)

    label = label[..., 1:]
    nll = -jnp.take_along_axis(logp, jnp.maximum(label, 0)[..., None], axis=-1)[..., 0]
    agree = jnp.argmax(logp, axis=-1) == label
    weight = supervised * jnp.exp(-jnp.arange(Bs - 1) / gamma)
    loss = jnp.sum(weight * nll) / jnp.maximum(weight.sum(), 1e-6)
    counted = supervised.sum((0, 1))
    per_position = jnp.maximum(counted, 1.0)
    aux = {
        "loss_k": jnp.sum(supervised * nll, (0, 1)) / per_position,
        "acc_k": jnp.sum(supervised * agree, (0, 1)) / per_position,
        "rows_k": counted,
    }
    return loss, aux
