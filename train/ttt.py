"""The EAGLE-3 training-time-test (TTT) loss: K unrolled draft steps against the frozen target's distribution.

Alignment (x = token ids, F = target tap features, Z = target logits, Z[t] predicts x[t+1]):
  step k, row t: embedding of x[t+1+k], feature F[t] at k = 0 else the head's own previous output, rotary position
  t+k; it predicts x[t+2+k], supervised by softmax(Z[t+1+k]) over the draft vocabulary. The loss mask is shifted
  together with the labels: the row counts when x[t+2+k] is assistant content (published trainers leave the mask
  unshifted, which drops the first row used at inference and supervises one row past each span).

Attention across steps (EAGLE3.md section 5): the query of step k at row t sees the step-0 keys of rows <= t and
the step-i keys (i = 1..k) of row t only. It is computed as causal attention plus k per-row diagonal terms, so
memory grows linearly in K; `dense_ttt_attention` is the straightforward [T, (k+1) T] mask version, for tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.eagle3 import Eagle3Head


def shift_left(x: jax.Array, n: int) -> jax.Array:
    """x[:, n:] zero-filled back to length T along axis 1."""
    if n == 0:
        return x
    pad = jnp.zeros((x.shape[0], n, *x.shape[2:]), x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def ttt_attention(q_btkgh: jax.Array, keys: list[jax.Array], values: list[jax.Array]) -> jax.Array:
    """Attention of one TTT step: causal over the step-0 keys, plus the same row of every later step.

    Args:
      q_btkgh: queries of the current step [B, T, K, G, H].
      keys: [k_0, ..., k_k], each [B, T, K, H] (k_0 from step 0, the rest one per later step).
      values: likewise.
    Returns:
      [B, T, K, G, H].
    """
    T = q_btkgh.shape[1]
    scale = q_btkgh.shape[-1] ** -0.5
    s0 = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, keys[0], preferred_element_type=jnp.float32) * scale
    s0 = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s0, -jnp.inf)
    diag = jnp.stack(
        [jnp.einsum("btkgh,btkh->bkgt", q_btkgh, k, preferred_element_type=jnp.float32) * scale for k in keys[1:]]
        or [jnp.full(s0.shape[:-1], -jnp.inf)]
    )  # [n, B, K, G, T]
    m = jnp.maximum(s0.max(-1), diag.max(0))
    p0, pd = jnp.exp(s0 - m[..., None]), jnp.exp(diag - m)
    denom = p0.sum(-1) + pd.sum(0)
    dtype = values[0].dtype
    out = jnp.einsum("bkgts,bskh->btkgh", (p0 / denom[..., None]).astype(dtype), values[0])
    if len(values) > 1:
        out += jnp.einsum("nbkgt,nbtkh->btkgh", (pd / denom).astype(dtype), jnp.stack(values[1:]))
    return out


def dense_ttt_attention(q_btkgh: jax.Array, keys: list[jax.Array], values: list[jax.Array]) -> jax.Array:
    """Reference: concatenate all steps' keys and apply the [T, (k+1) T] TTT mask."""
    T = q_btkgh.shape[1]
    k_all, v_all = jnp.concatenate(keys, axis=1), jnp.concatenate(values, axis=1)
    q_pos, kv_pos = jnp.arange(T)[:, None], jnp.arange(T * len(keys))[None, :]
    mask = jnp.where(kv_pos < T, q_pos >= kv_pos, kv_pos % T == q_pos)
    s = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_all, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(jnp.where(mask, s * q_btkgh.shape[-1] ** -0.5, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bskh->btkgh", p.astype(v_all.dtype), v_all)


def ttt_loss(
    head: Eagle3Head,
    target_embed_vd: jax.Array,
    tokens_bt: jax.Array,
    loss_mask_bt: jax.Array,
    taps_btf: jax.Array,
    target_logits_btv: jax.Array,
    ttt_length: int,
    step_decay: float,
    attention=ttt_attention,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The TTT loss of one batch.

    Args:
      head: the draft head (its trainable weights are what the loss is differentiated by).
      target_embed_vd: the target's embedding [V, D], used when the head has none of its own.
      tokens_bt: int32 token ids [B, T] (right-padded).
      loss_mask_bt: 1 where the token is assistant content [B, T].
      taps_btf: the target's tap features [B, T, n*Ht] (stop-gradient).
      target_logits_btv: the target's logits [B, T, V] (stop-gradient).
      ttt_length: K, the number of unrolled steps.
      step_decay: weight of step k is step_decay**k.
      attention: the cross-step attention (memory-lean by default; `dense_ttt_attention` for tests).
    Returns:
      (weighted total loss, {"loss_k": [K], "acc_k": [K], "rows_k": [K] supervised rows per step}).
    """
    cfg = head.cfg
    B, T = tokens_bt.shape
    vocab_ids = head.target_ids_of_draft_vocab()  # [Vd]
    target_argmax = jnp.argmax(target_logits_btv, axis=-1)  # [B, T]
    target_draft_logits = target_logits_btv[..., vocab_ids]  # [B, T, Vd]
    in_draft_vocab = head.t2d[...][target_argmax]  # the target's choice is representable by the draft
    g = head.fuse(taps_btf)
    keys, values, losses, accs, rows = [], [], [], [], []
    for k in range(ttt_length):
        ids = shift_left(tokens_bt, 1 + k)
        positions = jnp.broadcast_to(jnp.arange(T) + k, (B, T))
        q, key, value = head.qkv(head.embed_tokens(ids, target_embed_vd), g, positions)
        keys.append(key)
        values.append(value)
        q = q.reshape(B, T, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
        attn = attention(q, keys, values).reshape(B, T, cfg.num_heads, cfg.head_dim)
        g = head.finish(g, attn)
        logp = jax.nn.log_softmax(head.logits(g), axis=-1)
        labels = jax.nn.softmax(shift_left(target_draft_logits, 1 + k).astype(jnp.float32), axis=-1)
        mask = shift_left(loss_mask_bt, 2 + k).astype(jnp.float32)
        supervised = mask * shift_left(in_draft_vocab, 1 + k)
        n = jnp.maximum(mask.sum(), 1.0)
        losses.append(jnp.sum(supervised * -jnp.sum(labels * logp, axis=-1)) / n)
        agree = jnp.argmax(logp, axis=-1) == jnp.argmax(labels, axis=-1)
        accs.append(jnp.sum(supervised * agree) / n)
        rows.append(mask.sum())
    loss_k = jnp.stack(losses)
    total = jnp.sum(loss_k * step_decay ** jnp.arange(ttt_length))
    return total, {"loss_k": loss_k, "acc_k": jnp.stack(accs), "rows_k": jnp.stack(rows)}
