"""Weight-only int8 (`specjax.models.quantize`): the bytes, the rounding bound, the forward against the float one,
exact speculative decoding on an int8 target, the CLI flag, and int8 weights read straight into their shards."""

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters_fixture import drafter_cases

import specjax.decoding.speculative as spec
from specjax.cli.generate import entry
from specjax.config import ModelConfig
from specjax.decoding.autoregressive import generate as ar_generate
from specjax.errors import InputError
from specjax.io.loading import load_model
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward, init_weights, weight_bytes
from specjax.models.quantize import CONTRACTED, LAYER_MATRICES, Int8Matrix, dequantize, quantize_weights

TIED = ModelConfig(
    "llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=128, eos_token_ids=(1,), tie_word_embeddings=True
)
UNTIED = dataclasses.replace(TIED, tie_word_embeddings=False)
CONFIGS = pytest.mark.parametrize("cfg", [TIED, UNTIED], ids=["tied", "untied"])


def matrices(weights) -> dict:
    """The matrices int8 quantizes, by field: the layers' projections and the LM head (the embedding when tied)."""
    head = "embed" if weights.lm_head is None else "lm_head"
    return {n: getattr(weights.layers, n) for n in LAYER_MATRICES} | {head: getattr(weights, head)}


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def is_int8(x) -> bool:
    return isinstance(x, Int8Matrix)


@functools.partial(jax.jit, static_argnums=1)
def logits_of(weights, cfg, tokens_bt):
    B, T = tokens_bt.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    return forward(weights, cfg, tokens_bt, positions, KVCache.empty(cfg, B, T, weights.final_norm.dtype))[0]


@CONFIGS
def test_int8_weights_take_half_the_bytes_of_bfloat16_plus_their_scales(cfg):
    bf16 = init_weights(cfg, jax.random.key(0), jnp.bfloat16)
    int8 = quantize_weights(bf16)
    quantized = list(matrices(int8).values())
    assert all(is_int8(m) and m.values.dtype == jnp.int8 and m.scale.dtype == jnp.bfloat16 for m in quantized)
    scales = sum(m.scale.nbytes for m in quantized)
    kept = nbytes(bf16) - nbytes(matrices(bf16))  # norms, and an untied model's embedding, stay bfloat16
    assert 2 * sum(m.values.nbytes for m in quantized) == nbytes(matrices(bf16))
    assert nbytes(int8) <= 0.5 * (nbytes(bf16) - kept) + scales + kept
    assert weight_bytes(cfg, jnp.bfloat16, quantize="int8") == nbytes(int8)  # the memory plan counts these arrays


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dequantized_weights_are_within_half_a_step_of_the_originals(dtype):
    weights = init_weights(UNTIED, jax.random.key(1), dtype, scale=0.3)
    weights = dataclasses.replace(weights, lm_head=weights.lm_head.at[:, 5].set(0))  # a zero channel: scale 0
    int8 = quantize_weights(weights)
    for name, m in matrices(int8).items():
        w = np.asarray(matrices(weights)[name], np.float64)
        values, scale = np.asarray(m.values, np.float64), np.asarray(m.scale, np.float64)
        contracted = [i % w.ndim for i in CONTRACTED[name]]
        assert scale.shape == tuple(1 if i in contracted else n for i, n in enumerate(w.shape)), name
        assert np.abs(values).max() == 127
        # Per output channel: half a step of its scale (float32's rounding of w / scale aside).
        assert (np.abs(w - values * scale) <= scale * (0.5 + 1e-6)).all(), name
    deq = np.asarray(dequantize(int8.lm_head))
    assert np.isfinite(deq).all() and not deq[:, 5].any()


@CONFIGS
def test_the_int8_forward_is_the_float_forward_of_the_dequantized_weights(cfg):
    weights = quantize_weights(init_weights(cfg, jax.random.key(2), scale=0.3))
    dequantized = jax.tree.map(dequantize, weights, is_leaf=is_int8)
    tokens = jnp.array([[3, 9, 27, 17, 51, 25, 11, 4]])
    expected = logits_of(dequantized, cfg, tokens)
    # (x @ int8) * scale against x @ (int8 * scale): the same products, rounded in another order.
    np.testing.assert_allclose(logits_of(weights, cfg, tokens), expected, atol=1e-5 * float(jnp.abs(expected).max()))


def test_int8_logits_move_as_the_rounding_predicts():
    """Each weight moves by at most half its channel's step s, and for random weights like uniform noise on
    [-s/2, s/2] (variance s^2 / 12). To first order, a logit then moves by at most the sum over weights of
    |d logit / d weight| s / 2, and by a normal error of variance the sum of (d logit / d weight)^2 s^2 / 12. The
    last token's int8 logits stay within the first bound and within 5 standard deviations of the second."""
    weights = init_weights(TIED, jax.random.key(3), scale=0.3)
    int8 = quantize_weights(weights)
    tokens = jnp.array([[5, 6, 7, 42]])
    jacobian = jax.jit(jax.jacrev(lambda w: logits_of(w, TIED, tokens)[0, -1]))(weights)  # leaves [V, *weight]
    step = jax.tree.map(lambda w, q: jnp.broadcast_to(q.scale, w.shape) if is_int8(q) else 0 * w, weights, int8)
    pairs = list(zip(jax.tree.leaves(jacobian), jax.tree.leaves(step)))
    worst = sum(jnp.einsum("v...,...->v", jnp.abs(j), s / 2) for j, s in pairs)
    sigma = jnp.sqrt(sum(jnp.einsum("v...,...->v", j**2, s**2 / 12) for j, s in pairs))
    moved = jnp.abs(logits_of(int8, TIED, tokens)[0, -1] - logits_of(weights, TIED, tokens)[0, -1])
    assert bool((moved <= worst).all()) and bool((moved <= 5 * sigma).all()), float((moved / sigma).max())
    assert bool((moved > 0).any())


# The registered drafters that read the int8 target's arrays: its layers, its embedding, its LM head.
READ_THE_TARGET = ("layerskip", "eagle3-chain", "dflash")


@pytest.mark.parametrize("name", READ_THE_TARGET)
def test_speculative_greedy_on_an_int8_target_is_its_plain_greedy(name):
    cfg = dataclasses.replace(TIED, num_layers=4)  # EAGLE-3 taps three layers
    target = quantize_weights(init_weights(cfg, jax.random.key(5), scale=0.3))
    prompts = [[5, 6, 7], list(range(10, 31)), [42]]
    plain = ar_generate(target, cfg, prompts, max_new_tokens=12, eos_ids=())
    drafter = drafter_cases()[name].build(target, cfg)
    out = spec.speculative_generate(
        target, cfg, prompts, drafter=drafter, num_draft_tokens=3, max_new_tokens=12, eos_ids=()
    )
    assert [c.output_ids for c in out.completions] == [c.output_ids for c in plain.completions]


def test_loading_quantizes_each_matrix_as_quantize_weights_does(tiny_folder):
    loaded = load_model(str(tiny_folder), quantize="int8").weights
    expected = quantize_weights(load_model(str(tiny_folder)).weights)
    assert jax.tree.structure(loaded) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(InputError, match="int4"):
        load_model(str(tiny_folder), quantize="int4")


def test_generate_quantize_int8_runs_and_int4_is_one_line(tiny_folder, tmp_path, capsys):
    out = tmp_path / "out.json"
    entry(
        [
            "--model",
            str(tiny_folder),
            "--quantize",
            "int8",
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "6",
            "--drafter",
            "layerskip:1",
            "--num-draft-tokens",
            "2",
            "--compare-ar",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())["results"][0]
    assert len(result["output_ids"]) >= 1 and result["stats"]["identical_to_ar"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        entry(["--model", str(tiny_folder), "--quantize", "int4"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "int4" in err, err


@pytest.mark.slow  # a subprocess on 8 fake devices
def test_int8_weights_load_into_their_shards_and_decode_as_on_one_device(tmp_path):
    script = Path(__file__).with_name("mesh_quantize.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["tokens_mesh"] == found["tokens_one"]
    assert found["bytes_per_device"] == found["planned_per_device"]
    assert found["scale_specs"] == found["value_specs_of_output_axes"]
