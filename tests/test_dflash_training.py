"""DFlash training: the block loss against the independent PyTorch reference's packed pass, packing equal to
separate rows, the anchors, and the DFlash settings' checks (the pipeline run is in test_trainer.py, beside the
EAGLE-3 smoke run whose data and features it reads)."""

import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from test_dflash import CFG, TARGET, random_draft  # noqa: E402

from specjax.io.dflash_checkpoint import save_dflash  # noqa: E402
from specjax.train.config import DFlashSection  # noqa: E402
from specjax.train.dflash_loss import block_loss, pick_anchors  # noqa: E402

T = 12
GAMMA = DFlashSection(block_size=CFG.block_size).loss_decay
HEAD_VD = TARGET.lm_head.T


def rows_of(tokens, loss_mask, segments):
    """Packed-row arrays (positions restart in every sample)."""
    segments = np.asarray(segments, np.int32)
    positions = np.zeros_like(segments)
    for b, row in enumerate(segments):
        for s in set(row.tolist()):
            positions[b, row == s] = np.arange((row == s).sum())
    return {
        "tokens": jnp.asarray(tokens, jnp.int32),
        "loss_mask": jnp.asarray(loss_mask, jnp.int32),
        "positions": jnp.asarray(positions),
        "segments": jnp.asarray(segments),
    }


def draft_index(vocab_ids):
    if vocab_ids is None:
        return jnp.arange(CFG.layers.vocab_size, dtype=jnp.int32)
    return jnp.full(CFG.layers.vocab_size, -1, jnp.int32).at[jnp.asarray(vocab_ids)].set(jnp.arange(len(vocab_ids)))


def loss_of(weights, rows, taps, anchors, ok):
    index = draft_index(None if weights.vocab_ids is None else np.asarray(weights.vocab_ids))
    return block_loss(
        weights, CFG, TARGET.embed, HEAD_VD, index, rows, taps, jnp.asarray(anchors, jnp.int32), jnp.asarray(ok), GAMMA
    )


@pytest.mark.parametrize("vocab", [None, [0, 2, 3, 5, 6]])
def test_block_loss_matches_the_reference_packed_pass(tmp_path, vocab):
    """The loss equals weighted cross entropy of the reference's packed training pass (which reads the saved
    checkpoint on its own), on the target's tokens, over the draft vocabulary; anchors near the end and a flagged
    anchor included."""
    torch = pytest.importorskip("torch")
    from dflash_reference import loss_weights, packed_forward
    from safetensors.torch import load_file

    weights = random_draft(3, vocab)
    save_dflash(tmp_path, CFG, weights, dtype=np.float32)
    ref_weights = load_file(str(tmp_path / "model.safetensors"))
    ref_config = json.loads((tmp_path / "config.json").read_text())

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 7, (2, T))
    loss_mask = np.array([[0] * 3 + [1] * 9, [0] * 2 + [1] * 7 + [0] * 3])
    taps = rng.standard_normal((2, T, len(CFG.tap_layers) * CFG.layers.hidden_size)).astype(np.float32)
    anchors = np.array([[3, 7, 10], [2, 5, 4]])
    ok = np.array([[True, True, True], [True, True, False]])
    loss, aux = loss_of(weights, rows_of(tokens, loss_mask, np.ones((2, T))), jnp.asarray(taps), anchors, ok)

    embed, head = (torch.from_numpy(np.array(w)) for w in (TARGET.embed, HEAD_VD))
    logits = packed_forward(
        ref_weights,
        ref_config,
        embed,
        head,
        torch.from_numpy(taps),
        torch.from_numpy(tokens),
        torch.from_numpy(anchors),
    )
    ids = list(range(CFG.layers.vocab_size)) if vocab is None else vocab
    logp = torch.log_softmax(logits[..., ids].double(), -1).numpy()
    w = loss_weights(CFG.block_size, GAMMA).numpy()
    total = weight = 0.0
    for b in range(2):
        for n, a in enumerate(anchors[b]):
            for k in range(1, CFG.block_size):
                t = a + k
                if ok[b, n] and t < T and loss_mask[b, t] and tokens[b, t] in ids:
                    total += w[k] * -logp[b, n, k, ids.index(tokens[b, t])]
                    weight += w[k]
    assert abs(float(loss) - total / weight) <= 1e-4 * total / weight
    assert float(aux["rows_k"][0]) == sum(
        ok[b, n] and loss_mask[b, a + 1] and tokens[b, a + 1] in ids for b in range(2) for n, a in enumerate(anchors[b])
    )


def test_a_packed_row_scores_like_its_samples_alone():
    """Two samples packed in one row (anchors near the seam, blocks running into the next sample) give the loss of
    the same samples in rows of their own."""
    rng = np.random.default_rng(1)
    a_len, b_len = 7, 5
    tokens = rng.integers(0, 7, a_len + b_len)
    mask = np.r_[[0, 0], np.ones(a_len - 2), [0], np.ones(b_len - 1)].astype(int)
    taps = rng.standard_normal((a_len + b_len, len(CFG.tap_layers) * CFG.layers.hidden_size)).astype(np.float32)
    weights = random_draft(4)

    packed = rows_of(tokens[None], mask[None], [[1] * a_len + [2] * b_len])
    loss_packed, aux_packed = loss_of(weights, packed, jnp.asarray(taps[None]), [[4, 5, a_len + 1]], [[True] * 3])

    own_tokens, own_mask = np.zeros((2, T), int), np.zeros((2, T), int)
    own_taps = np.zeros((2, T, taps.shape[1]), np.float32)
    for row, (lo, hi) in enumerate([(0, a_len), (a_len, a_len + b_len)]):
        n = hi - lo
        own_tokens[row, :n], own_mask[row, :n], own_taps[row, :n] = tokens[lo:hi], mask[lo:hi], taps[lo:hi]
    segments = [[1] * a_len + [0] * (T - a_len), [1] * b_len + [0] * (T - b_len)]
    alone = rows_of(own_tokens, own_mask, segments)
    anchors, ok = [[4, 5], [1, 1]], [[True, True], [True, False]]
    loss_alone, aux_alone = loss_of(weights, alone, jnp.asarray(own_taps), anchors, ok)

    np.testing.assert_allclose(float(loss_packed), float(loss_alone), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(aux_packed["rows_k"]), np.asarray(aux_alone["rows_k"]))


def test_anchors_are_distinct_valid_positions_and_short_rows_flag_the_rest():
    mask = np.array([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    segments = np.array([[1] * 4 + [2] * 8, [1] * 12])  # positions 3 | 4 straddle two samples
    rows = rows_of(np.zeros((2, T)), mask, segments)
    valid = [{2, 6, 7, 8}, {1}]
    seen = set()
    for seed in range(8):
        anchors, ok = (np.asarray(x) for x in pick_anchors(rows, jax.random.key(seed), 3))
        assert set(anchors[0].tolist()) <= valid[0] and len(set(anchors[0].tolist())) == 3 and ok[0].all()
        assert anchors[1][ok[1]].tolist() == [1] and ok[1].sum() == 1
        seen |= set(anchors[0].tolist())
    assert seen == valid[0]  # every valid position gets drawn


def test_dflash_settings_are_checked_before_anything_runs(tmp_path, capsys):
    from specjax.cli.train import entry

    base = ["--config", str(ROOT / "configs" / "smoke.yaml"), f"output_dir={tmp_path / 'run'}", "model.drafter=dflash"]
    for extra, message in [
        ([], "dflash.mask_token_id is required"),
        (["dflash.mask_token_id=999999"], "mask_token_id 999999 is outside the target's"),
        (["dflash.mask_token_id=5", "dflash.block_size=1"], r"dflash.block_size=1 \(must be >= 2\)"),
        (["dflash.mask_token_id=5", "model.tap_layers=[0]"], "target_layer_ids"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            entry([*base, *extra])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(message, err[0]), err
    assert not (tmp_path / "run").exists()
