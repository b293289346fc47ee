"""specjax's compiled programs lower for GPUs and TPUs from this CPU (`jax.export` with platforms cuda and tpu): the
speculative loop with every registered drafter and an adaptive menu, greedy and sampled; the
autoregressive loop; the sharded training step on a mesh of 8 fake devices (exported in a subprocess). Their
modules hold no custom call that only a CPU runs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from drafters_fixture import drafter_params
from jax import export

import specjax.decoding.speculative as spec
from specjax.adaptive import Adaptive, Fixed
from specjax.config import ModelConfig, SamplingConfig
from specjax.decoding.autoregressive import decode
from specjax.drafters import NgramDrafter
from specjax.models.llama import init_weights
from specjax.sampling import Sampling

PLATFORMS = ("cuda", "tpu")
# Custom calls that every platform's compiler expands itself (sharding annotations). Any other target names a
# platform's own library: on the CPU, LAPACK (`lapack_*`, linear algebra), DUCC (`ducc_fft`), host callbacks
# (`xla_python_cpu_callback`, `xla_ffi_python_cpu_callback`); a module holding one would not run on a GPU or TPU.
PORTABLE_CUSTOM_CALLS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement"}
CPU_ONLY = re.compile(r"lapack|ducc|cpu|callback", re.IGNORECASE)

CFG = ModelConfig("llama", 64, 32, 64, 4, 4, 2, 8, max_position_embeddings=256, eos_token_ids=(1,))
WEIGHTS = init_weights(CFG, jax.random.key(0), scale=0.3)
BATCH, PROMPT = 2, 64
SAMPLING = {"greedy": SamplingConfig(), "sampled": SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)}


def custom_calls(module_text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w.$-]+)", module_text)) | set(
        re.findall(r'call_target_name = "([^"]+)"', module_text)
    )


def check_portable(platforms: tuple[str, ...], module_text: str) -> None:
    """Asserts that an artifact targets cuda and tpu and calls nothing CPU-only."""
    assert tuple(platforms) == PLATFORMS
    calls = custom_calls(module_text)
    assert not {c for c in calls if CPU_ONLY.search(c)}, calls
    assert calls <= PORTABLE_CUSTOM_CALLS, calls


def exported_text(exported: export.Exported) -> str:
    """The artifact's module text, checked (`check_portable`)."""
    text = exported.mlir_module()
    check_portable(exported.platforms, text)
    return text


def loop_inputs(sampling: SamplingConfig):
    tokens = jnp.zeros((BATCH, PROMPT), jnp.int32)
    limits = jnp.full((BATCH,), 8, jnp.int32)
    keys = jax.random.split(jax.random.key(0), BATCH)
    return tokens, jnp.array([3, 21], jnp.int32), limits, keys, Sampling.of(sampling, BATCH)


ADAPTIVE = Adaptive.of([0, 1, 3], [1.0, 1.3, 1.6])  # with the n-gram drafter: a menu with a plain step
# Registered drafters whose export CI leaves to -m slow, with the case that lowers the same operations.
SLOW = {
    "model": "layerskip: the same drafting code (specjax.drafters.model) over the target's first layers",
    "repeat": "ngram: a one-hot chain from the committed text, with no state",
}


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("case", [*drafter_params(SLOW), pytest.param(None, id="ngram-adaptive")])
def test_speculative_loop_exports_for_gpu_and_tpu(case, sampling):
    """Every registered drafter (`drafters_fixture`) drafting 3, and the n-gram drafter with an adaptive menu."""
    drafter, adaptive = (NgramDrafter(max_n=2), ADAPTIVE) if case is None else (case.build(WEIGHTS, CFG), None)
    exported = export.export(spec.speculative_decode, platforms=PLATFORMS)(
        WEIGHTS,
        drafter,
        adaptive or Fixed(3),
        *loop_inputs(SAMPLING[sampling]),
        cfg=CFG,
        eos_ids=(1,),
        prefill_chunk=16,
    )
    text = exported_text(exported)
    assert "stablehlo.while" in text  # the whole loop is in the artifact, not unrolled on the host
    if adaptive:
        assert "stablehlo.case" in text  # the menu's rounds, switched on device


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_autoregressive_loop_exports_for_gpu_and_tpu(sampling):
    exported = export.export(decode, platforms=PLATFORMS)(
        WEIGHTS, *loop_inputs(SAMPLING[sampling]), cfg=CFG, eos_ids=(1,), prefill_chunk=16
    )
    assert "stablehlo.while" in exported_text(exported)


def test_sharded_training_step_exports_for_gpu_and_tpu(tmp_path):
    script = Path(__file__).with_name("export_sharded.py")
    out = tmp_path / "step.mlir"
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = json.loads(proc.stdout)
    text = out.read_text()
    check_portable(exported["platforms"], text)
    assert exported["nr_devices"] == 8 and "mhlo.num_partitions = 8" in text
    # The weights stay split over the mesh in the artifact (the FSDP and tensor axes of the training rules).
    assert re.search(r'sdy\.sharding<@mesh, \[\{"fsdp"\}, \{"tensor"\}\]>', text)


def test_the_check_catches_a_cpu_only_custom_call():
    exported = export.export(jax.jit(jnp.linalg.cholesky), platforms=("cpu",))(jnp.eye(4))
    assert any("lapack" in c for c in custom_calls(exported.mlir_module()))
    with pytest.raises(AssertionError):
        check_portable(PLATFORMS, exported.mlir_module())
