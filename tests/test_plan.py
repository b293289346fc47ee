"""The memory plan against XLA's compiled memory analysis on the CPU, and the one-line refusal of a run that does not
fit (through both CLIs, with the device's memory made small)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_eagle3_checkpoint import LLAMA31_8B

import specjax.decoding.autoregressive as ar_loop
import specjax.decoding.speculative as spec
from specjax import prepare
from specjax.adaptive import Fixed
from specjax.cli import bench
from specjax.cli import generate as generate_cli
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.autoregressive import decode
from specjax.decoding.batch import num_slots
from specjax.drafters import Eagle3Drafter
from specjax.drafters.tree import TreeSpec
from specjax.errors import InputError
from specjax.measure import memory as plan
from specjax.models import llama
from specjax.models.eagle3 import NORMS, Eagle3Config, Eagle3Head, param_specs
from specjax.models.llama import ACCELERATOR_PREFILL_CHUNK, init_weights
from specjax.sampling import Sampling
from specjax.sharding import larger_meshes


def random_head(cfg: ModelConfig) -> Eagle3Head:
    """A random EAGLE-3 head from numpy weights (its own random init compiles a kernel per shape: slow here)."""
    head_cfg = Eagle3Config.default_for(cfg)
    rng = np.random.default_rng(0)
    return Eagle3Head(
        head_cfg,
        weights={
            n: np.ones(s.shape, np.float32) if n in NORMS else 0.05 * rng.standard_normal(s.shape, np.float32)
            for n, s in param_specs(head_cfg).items()
        },
    )


def measured_bytes(lowered, shared_bytes: int = 0) -> int:
    """Arguments + outputs + temporaries of the compiled executable; an array passed twice (the target's embedding
    inside the drafter) is one buffer on the device, so it is counted once."""
    m = lowered.compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - shared_bytes


def inputs(cfg: ModelConfig, batch: int, prompt_len: int, max_new: int):
    """The loops' arguments after the weights (and drafter), prompts packed as `prepare_batch` packs them."""
    tokens = jnp.zeros((batch, num_slots(cfg, prompt_len + max_new)), jnp.int32)
    lengths, limits = jnp.full((batch,), prompt_len, jnp.int32), jnp.full((batch,), max_new, jnp.int32)
    return tokens, lengths, limits, jax.random.split(jax.random.key(0), batch), Sampling.of(SamplingConfig(), batch)


@pytest.mark.parametrize("batch, prompt_len, slots", [(8, 100, 256), (2, 1000, 2048)])
def test_plan_of_autoregressive_decoding_matches_compiled_memory(batch, prompt_len, slots):
    """A buffer of one attention block, and one of four (2048 slots), whose prefill scores each 64-token chunk over
    itself and then a block at a time: the plan counts no tokens x slots array, and neither does XLA."""
    cfg = ModelConfig("llama", 2048, 256, 768, 6, 8, 2, 32, max_position_embeddings=2048)
    weights = jax.eval_shape(lambda: init_weights(cfg, jax.random.key(0)))
    max_new = 128
    lowered = decode.lower(weights, *inputs(cfg, batch, prompt_len, max_new), cfg=cfg, eos_ids=(1,), prefill_chunk=64)
    p = plan.memory_plan(cfg, jnp.float32, batch=batch, prompt_len=prompt_len, max_new_tokens=max_new, prefill_chunk=64)
    assert p.num_slots == slots and p.kv_cache == 2 * 6 * batch * slots * 2 * 32 * 4 and p.drafter == 0
    assert p.weights == sum(x.size * 4 for x in jax.tree.leaves(weights))
    assert p.activations > 0  # a prefill chunk's scores, keys and values: the plan is not weights + KV alone
    assert p.total == pytest.approx(measured_bytes(lowered), rel=0.10)


def test_plan_of_eagle3_chain_decoding_matches_compiled_memory():
    cfg = ModelConfig("llama", 1024, 128, 384, 4, 4, 2, 32, max_position_embeddings=512)
    weights = init_weights(cfg, jax.random.key(0))
    drafter = Eagle3Drafter.create(random_head(cfg), weights.embed)
    batch, prompt_len, max_new, k = 4, 64, 64, 4
    lowered = spec.speculative_decode.lower(
        weights,
        drafter,
        Fixed(k),
        *inputs(cfg, batch, prompt_len, max_new),
        cfg=cfg,
        eos_ids=(1,),
        prefill_chunk=64,
    )
    p = plan.memory_plan(
        cfg,
        jnp.float32,
        batch=batch,
        prompt_len=prompt_len,
        max_new_tokens=max_new,
        drafter=drafter,
        draft_shape=TreeSpec.chain(k),
        target_weights=weights,
        prefill_chunk=64,
    )
    assert p.num_slots == 256 + k + 1  # S: 64 + 64 up to the smallest width, and a round's draft
    head_cache = 2 * batch * p.num_slots * 1 * 2 * 32 * 4  # the head's one layer
    assert p.drafter > head_cache + sum(x.size * 4 for x in jax.tree.leaves(drafter.params))
    shared = 0 if drafter.target_embed is None else drafter.target_embed.size * 4
    assert p.total == pytest.approx(measured_bytes(lowered, shared), rel=0.10)


@pytest.mark.parametrize("batch, prompt_len", [(8, 8192), (1, 32768)])
def test_llama31_8b_long_context_plans_fit_an_80gb_device(batch, prompt_len):
    """Llama-3.1-8B in bfloat16 with an EAGLE-3 head of the published shape (a 5,8,32 tree), 256 new tokens, the
    accelerators' 512-token prefill chunk: weights, cache and one chunk's or one verification's work fit 80 GB. A
    prefill of the whole prompt at once would not: its scores of the prompt over itself."""
    cfg = dataclasses.replace(LLAMA31_8B, max_position_embeddings=131072)
    head_cfg = Eagle3Config.default_for(cfg, draft_vocab_size=32000)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Eagle3Head(head_cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)))
    embed = jax.ShapeDtypeStruct((cfg.vocab_size, cfg.hidden_size), jnp.bfloat16)
    tree = TreeSpec.parse("5,8,32")
    drafter = Eagle3Drafter(params, embed, graphdef, tree, None, None)

    def plan_at(chunk):
        return plan.memory_plan(
            cfg,
            jnp.bfloat16,
            batch=batch,
            prompt_len=prompt_len,
            max_new_tokens=256,
            drafter=drafter,
            draft_shape=tree,
            target_weights=embed,
            prefill_chunk=chunk,
        )

    chunked = plan_at(ACCELERATOR_PREFILL_CHUNK)
    assert chunked.num_slots == 2 * prompt_len + tree.capacity  # the next power of two, and a round's draft
    assert chunked.total < 80e9 < plan_at(prompt_len).total


def test_check_fits_names_the_largest_batch():
    cfg = ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16)

    def plan_at(batch):
        return plan.memory_plan(cfg, jnp.float32, batch=batch, prompt_len=10, max_new_tokens=64)

    available = plan_at(5).total
    assert plan.check_fits(plan_at, 5, available) == plan_at(5)
    with pytest.raises(InputError, match=r"the device holds .* GiB; a batch of 5 would fit"):
        plan.check_fits(plan_at, 16, available)
    with pytest.raises(InputError, match="not even one row fits"):
        plan.check_fits(plan_at, 2, plan_at(1).total - 1)


def test_a_run_that_does_not_fit_names_the_smallest_mesh_that_does():
    cfg = ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16)

    def plan_at(batch, mesh=None):
        return plan.memory_plan(cfg, jnp.float32, batch=batch, prompt_len=10, max_new_tokens=64, mesh=mesh)

    assert larger_meshes(1, 8)[:4] == [
        {"data": 1, "tensor": 2},
        {"data": 2, "tensor": 1},
        {"data": 1, "tensor": 4},
        {"data": 2, "tensor": 2},
    ]
    available = plan_at(4, {"data": 1, "tensor": 4}).total
    assert plan_at(4, {"data": 2, "tensor": 1}).total > available  # so the tensor=4 mesh is the first that fits
    with pytest.raises(
        InputError, match=r"a batch of \d would fit, or mesh=\{'data': 1, 'tensor': 4\} \(4 devices\) would$"
    ):
        plan.check_fits(plan_at, 4, available, devices=8)


@pytest.mark.parametrize("main", [generate_cli.entry, bench.entry])
def test_a_run_that_does_not_fit_is_refused_in_one_line(main, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(prepare, "device_memory", lambda: 40 * 2**20)  # the tiny model's weights take 25 MiB
    for loops in (ar_loop, spec):  # nothing compiles
        monkeypatch.setattr(loops, "compiled", lambda *a: pytest.fail("compiled"))
    argv = ["--model", "tiny-random", *["--prompt", "Hi"] * 8, "--batch-size", "8", "--max-new-tokens", "1000"]
    if main is bench.entry:
        argv += ["--modes", "ar,ngram", "--out-dir", str(tmp_path)]
    else:
        argv += ["--drafter", "ngram", "--num-draft-tokens", "3"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert "the device holds 0.04 GiB; a batch of" in err and "would fit" in err, err


def test_weights_that_would_not_fit_are_refused_before_a_tensor_is_read(monkeypatch):
    # Llama-3.1-8B's shapes, 14.96 GiB in bfloat16, against devices of 12 GiB: its int8 weights (7.97 GiB) would fit.
    cfg = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, max_position_embeddings=131072)
    monkeypatch.setattr(llama, "device_memory", lambda: 12 * 2**30)
    read = []
    with pytest.raises(
        InputError,
        match=r"^8b: the weights need 14\.96 GiB on each device but one holds 12\.00 GiB; "
        r"quantize='int8' would$",
    ):
        llama.weights_from_hf(cfg, read.append, jnp.bfloat16, source="8b")
    assert read == []


def test_generate_refuses_a_target_too_large_for_the_device_in_one_line(monkeypatch, capsys, tiny_folder):
    monkeypatch.setattr(llama, "device_memory", lambda: 2**10)
    with pytest.raises(SystemExit) as exit_info:
        generate_cli.entry(["--model", str(tiny_folder), "--prompt", "Hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "the weights need" in err[0], err


def test_generate_plan_prints_the_table_and_decodes_nothing(monkeypatch, capsys):
    monkeypatch.setattr(generate_cli, "generate", lambda *a, **k: pytest.fail("decoded"))
    generate_cli.main(["--model", "tiny-random", "--prompt", "Hi", "--drafter", "ngram", "--plan"])
    out = capsys.readouterr().out
    assert "| weights |" in out and "| total |" in out and "| device memory |" in out
    assert out.count("\n") == 2 + 6


def test_generate_plan_is_at_the_batch_asked_for_even_with_fewer_prompts(capsys):
    generate_cli.main(["--model", "tiny-random", "--prompt", "Hi", "--batch-size", "8", "--plan"])
    assert "KV cache (batch 8," in capsys.readouterr().out


def test_a_plan_on_a_mesh_splits_weights_and_cache_by_their_axes():
    # Llama-3.1-8B's shapes: 32 layers of 4096, 32 query heads over 8 KV heads of 128, MLP 14336, vocabulary 128256.
    cfg = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, max_position_embeddings=131072)
    whole = plan.memory_plan(cfg, jnp.bfloat16, batch=8, prompt_len=1000, max_new_tokens=1024)
    split = plan.memory_plan(
        cfg, jnp.bfloat16, batch=8, prompt_len=1000, max_new_tokens=1024, mesh={"data": 2, "tensor": 4}
    )
    L, D, F, V, H = 32, 4096, 14336, 128256, 128
    per_layer = 2 * D + (D * 32 * H + 2 * D * 8 * H + 32 * H * D + 3 * D * F) // 4  # norms whole, the rest over tensor
    assert split.weights == 2 * (L * per_layer + D + 2 * V * D // 4)  # embedding and LM head over tensor too
    assert whole.weights == 2 * (L * (2 * D + D * 32 * H + 2 * D * 8 * H + 32 * H * D + 3 * D * F) + D + 2 * V * D)
    assert split.kv_cache * 8 == whole.kv_cache  # rows over data, KV heads over tensor
    # Scores, new keys and values and logits over rows and heads (or the vocabulary), the residual stream over rows.
    assert whole.activations / 8 < split.activations < whole.activations / 2
    assert split.mesh == (("data", 2), ("tensor", 4))
    assert "per device (mesh data=2, tensor=4)" in split.table()
