"""The TTT loss against an independent, row-by-row implementation; lean vs dense cross-step attention; remat and
memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.models.eagle3 import NORMS, Eagle3Config, Eagle3Head, param_specs
from specjax.train.ttt import dense_ttt_attention, ttt_attention, ttt_loss

V, D, VD = 64, 32, 24


def make_head(seed: int = 0, draft_vocab: int = VD) -> Eagle3Head:
    cfg = Eagle3Config(
        hidden_size=D,
        intermediate_size=48,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=V,
        draft_vocab_size=draft_vocab,
        target_num_layers=4,
        tap_layers=(1, 2, 3),
    )
    rng = np.random.default_rng(seed)  # numpy, not jax.random: no kernel to compile per weight shape
    weights = {
        name: (1 + 0.1 * rng.standard_normal(spec.shape) if name in NORMS else 0.2 * rng.standard_normal(spec.shape))
        for name, spec in param_specs(cfg).items()
    }
    head = Eagle3Head(cfg, weights=weights)
    used = np.sort(rng.choice(V, draft_vocab, replace=False))
    head.d2t[...] = jnp.asarray(used - np.arange(draft_vocab), jnp.int32)
    head.t2d[...] = jnp.zeros(V, bool).at[used].set(True)
    return head


def make_inputs(B: int, T: int, seed: int = 1, vocab_ids=None):
    """(embed, packed rows, taps, logits over the draft vocabulary): row 0 holds two samples, row 1 one sample
    then padding. With `vocab_ids`, every other token is drawn from them (the rest mostly fall outside)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    if vocab_ids is not None:
        tokens[:, ::2] = rng.choice(np.asarray(vocab_ids), (B, (T + 1) // 2))
    cut = T // 2
    segments = np.zeros((B, T), np.int32)
    segments[0, :cut], segments[0, cut:], segments[1, : T - 3] = 1, 2, 1
    positions = np.zeros((B, T), np.int32)
    positions[0, :cut], positions[0, cut:], positions[1, : T - 3] = np.arange(cut), np.arange(T - cut), np.arange(T - 3)
    mask = np.zeros((B, T), np.int32)
    mask[0, 2:cut], mask[0, cut + 1 :], mask[1, 2 : T - 3] = 1, 1, 1  # prompts of 2, 1 and 2 tokens
    tokens[1, T - 3 :] = 0
    rows = {"tokens": tokens, "loss_mask": mask, "positions": positions, "segments": segments}
    taps = rng.normal(size=(B, T, 3 * D)).astype(np.float32)
    logits = (3 * rng.normal(size=(B, T, VD if vocab_ids is None else len(vocab_ids)))).astype(np.float32)
    embed = (0.5 * rng.normal(size=(V, D))).astype(np.float32)
    return embed, rows, taps, logits


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_ttt(head, embed, rows, taps, Z, K, decay):
    """Row by row, step by step, straight from the alignment in specjax/train/ttt.py's docstring (and
    docs/eagle3-head.md, section 5).

    Step k, row t: embedding of x[t+1+k] (id 0 past the end), position p[t]+k, feature F[t] at k = 0 else the
    previous step's output; attention over the concatenated keys [step-0 rows s <= t of t's sample, step-1 row t,
    ..., step-k row t]; label softmax(Z[t+1+k]); counted when x[t+2+k] is assistant content of t's sample;
    contributes to the loss and accuracy only when x[t+2+k] is in the draft vocabulary; loss and accuracy are
    divided by the counted rows.
    """
    cfg = head.cfg
    tokens, mask, positions, segments = (rows[k] for k in ("tokens", "loss_mask", "positions", "segments"))
    B, T = tokens.shape
    N, G, Hd = cfg.num_heads, cfg.group_size, cfg.head_dim
    t2d = np.asarray(head.t2d[...])
    g = np.asarray(head.fuse(jnp.asarray(taps)))
    keys, values, losses, accs, rows_k = [], [], [], [], []
    for k in range(K):
        emb = np.zeros((B, T, D), np.float32)
        for b in range(B):
            for t in range(T):
                emb[b, t] = embed[tokens[b, t + 1 + k]] if t + 1 + k < T else embed[0]
        q, key, value = (
            np.asarray(a, np.float64) for a in head.qkv(jnp.asarray(emb), jnp.asarray(g), jnp.asarray(positions + k))
        )
        keys.append(key)
        values.append(value)
        attn = np.zeros((B, T, N, Hd))
        for b in range(B):
            for t in range(T):
                mine = [s for s in range(t + 1) if segments[b, s] == segments[b, t]]
                for n in range(N):
                    kv = n // G
                    later = range(1, k + 1)  # the step-i key of row t only
                    ks = np.concatenate([keys[0][b, mine, kv]] + [keys[i][b, t : t + 1, kv] for i in later])
                    vs = np.concatenate([values[0][b, mine, kv]] + [values[i][b, t : t + 1, kv] for i in later])
                    p = _softmax(ks @ q[b, t, n] / np.sqrt(Hd))
                    attn[b, t, n] = p @ vs
        logits, g = head.readout(head.finish(jnp.asarray(g), jnp.asarray(attn, jnp.float32)))
        logits, g = np.asarray(logits, np.float64), np.asarray(g)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        loss_sum, correct, counted = 0.0, 0, 0
        for b in range(B):
            for t in range(T):
                u = t + 2 + k
                if u >= T or not mask[b, u] or segments[b, u] != segments[b, t]:
                    continue
                counted += 1
                if not t2d[tokens[b, u]]:
                    continue  # the target's token is not in the draft vocabulary
                label = _softmax(Z[b, t + 1 + k].astype(np.float64))
                loss_sum += -np.sum(label * logp[b, t])
                correct += int(np.argmax(logp[b, t]) == np.argmax(label))
        losses.append(loss_sum / max(counted, 1))
        accs.append(correct / max(counted, 1))
        rows_k.append(counted)
    total = sum(decay**k * loss for k, loss in enumerate(losses))
    return total, np.array(losses), np.array(accs), np.array(rows_k)


@pytest.mark.parametrize("attention", [ttt_attention, dense_ttt_attention], ids=["lean", "dense"])
def test_ttt_loss_matches_row_by_row_reference(attention):
    head = make_head(draft_vocab=6)  # a small draft vocabulary, so that some argmaxes agree by chance
    embed, rows, taps, Z = make_inputs(2, 12, vocab_ids=np.asarray(head.target_ids_of_draft_vocab()))
    K, decay = 3, 0.8
    ref_total, ref_loss, ref_acc, ref_rows = reference_ttt(head, embed, rows, taps, Z, K, decay)
    # The inputs exercise every branch: counted rows, dropped (out-of-vocabulary) rows, and some correct argmaxes.
    in_vocab = np.asarray(head.t2d[...])[rows["tokens"]]
    assert in_vocab.any() and not in_vocab.all()

    @jax.jit
    def run(head, embed, rows, taps, Z):
        return ttt_loss(head, embed, rows, taps, Z, K, decay, attention=attention)

    total, aux = run(head, embed, rows, taps, Z)
    np.testing.assert_array_equal(np.asarray(aux["rows_k"]), ref_rows)
    np.testing.assert_allclose(np.asarray(aux["loss_k"]), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(aux["acc_k"]), ref_acc, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(total), ref_total, rtol=1e-5)
    assert (ref_acc > 0).any()


@pytest.mark.parametrize("n_steps", [1, 2, 3, 4, 5])
def test_lean_attention_equals_dense(n_steps):
    """k = 0..4: the query of step k attends to k + 1 key sets."""
    B, T, Kh, G, Hd = 2, 9, 2, 3, 8
    key = jax.random.key(n_steps)
    kq, kk, kv, kw = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, T, Kh, G, Hd))
    keys = jax.random.normal(kk, (n_steps, B, T, Kh, Hd)) * 2
    values = jax.random.normal(kv, (n_steps, B, T, Kh, Hd))
    segments = np.repeat([[1, 1, 1, 2, 2, 2, 2, 3, 3]], B, axis=0)
    seen = jnp.asarray((segments[:, :, None] == segments[:, None, :]) & np.tri(T, dtype=bool))
    lean = jax.jit(ttt_attention)(q, keys, values, seen)
    dense = jax.jit(dense_ttt_attention)(q, keys, values, seen)
    np.testing.assert_allclose(np.asarray(lean), np.asarray(dense), rtol=1e-5, atol=1e-6)
    # And their gradients with respect to every input.
    w = jax.random.normal(kw, lean.shape)

    def grads(attention):
        grad = jax.grad(lambda q, ks, vs: jnp.sum(attention(q, ks, vs, seen) * w), argnums=(0, 1, 2))
        return jax.jit(grad)(q, keys, values)

    for a, b in zip(jax.tree.leaves(grads(ttt_attention)), jax.tree.leaves(grads(dense_ttt_attention))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _temp_bytes(attention, K: int, T: int = 256, remat: bool = False) -> int:
    """Temporary memory of the compiled loss+grad, from XLA's memory analysis (not timed)."""
    head = make_head(draft_vocab=32)
    graphdef, params, rest = nnx.split(head, nnx.Param, ...)
    embed = make_inputs(2, 8)[0]
    row = jax.ShapeDtypeStruct((1, T), jnp.int32)
    rows = {"tokens": row, "loss_mask": row, "positions": row, "segments": row}
    taps = jax.ShapeDtypeStruct((1, T, 3 * D), jnp.float32)
    logits = jax.ShapeDtypeStruct((1, T, 32), jnp.float32)

    def loss(params, rows, taps, logits):
        h = nnx.merge(graphdef, params, rest)
        return ttt_loss(h, jnp.asarray(embed), rows, taps, logits, K, 0.8, attention=attention, remat=remat)[0]

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, rows, taps, logits).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_remat_keeps_one_steps_attention_scores_at_a_time(record_property):
    """XLA's memory analysis of the compiled loss+grad, T = 256: without remat the backward pass keeps every step's
    [T, T] attention scores; with remat it holds one step's at a time, so the lean attention's temporaries stay flat
    in K while the dense attention's grow with its last step's (k + 1) T^2 scores."""
    block = 4 * 256 * 256 * 4  # one set of [T, T] float32 scores: 4 query heads x T x T x float32, batch 1
    ks = (2, 4)
    lean = [_temp_bytes(ttt_attention, k) / block for k in ks]
    lean_remat = [_temp_bytes(ttt_attention, k, remat=True) / block for k in ks]
    dense_remat = [_temp_bytes(dense_ttt_attention, k, remat=True) / block for k in ks]
    record_property("temp_blocks", {"lean": lean, "lean_remat": lean_remat, "dense_remat": dense_remat})
    print(f"temporaries in [T, T] blocks, K={ks}: lean {lean}, with remat {lean_remat}, dense with remat {dense_remat}")
    assert lean[1] - lean[0] > 2 * (ks[1] - ks[0])  # at least two blocks per step kept
    assert lean_remat[1] - lean_remat[0] < 1 and lean_remat[1] < 0.5 * lean[1]
    assert dense_remat[1] - dense_remat[0] > ks[1] - ks[0] and lean_remat[1] < dense_remat[1]


def test_remat_gives_the_same_loss_and_gradients():
    """jax.checkpoint around each unrolled step: the loss, metrics and gradients are those without it."""
    head = make_head(draft_vocab=6)
    inputs = make_inputs(2, 12, vocab_ids=np.asarray(head.target_ids_of_draft_vocab()))
    embed, rows, taps, Z = jax.tree.map(jnp.asarray, inputs)
    graphdef, params, rest = nnx.split(head, nnx.Param, ...)

    def run(remat):
        def loss(params):
            return ttt_loss(nnx.merge(graphdef, params, rest), embed, rows, taps, Z, 4, 0.8, remat=remat)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (total, aux), grads = run(False)
    (total_r, aux_r), grads_r = run(True)
    np.testing.assert_allclose(float(total_r), float(total), rtol=1e-6)
    for a, b in zip(jax.tree.leaves((aux_r, grads_r)), jax.tree.leaves((aux, grads)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
