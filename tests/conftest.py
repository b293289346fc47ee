import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

import jax
import pytest
import repeat_drafter  # noqa: F401  registers a drafter only the tests know, which the shared drafter tests then run

from specjax.cli.common import prefer_onednn_dots
from specjax.decoding import batch

# Tests run on the CPU, in float32, with the XLA setting the decoding tools use (docs/cpu.md), and with XLA's CPU
# code generation set for compile time: LLVM's optimizations off and the older loop emitters for fusions. The suite's
# programs are small and compile far longer than they run (test_engine, test_adaptive and test_smollm2_generate took
# 132 s instead of 236), and the programs are the same (the options change the machine code XLA emits, not what it
# computes).
COMPILE_FAST = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"  # also for XLA_FLAGS tests set
os.environ.setdefault("JAX_PLATFORMS", "cpu")
for flag in COMPILE_FAST.split():
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
prefer_onednn_dots()

REPO = Path(__file__).resolve().parent.parent


def fake_devices(n: int) -> str:
    """XLA_FLAGS for a process a test starts: the suite's compile settings and `n` CPU devices."""
    return f"{COMPILE_FAST} --xla_force_host_platform_device_count={n}"


# One persistent compilation cache for the whole run, shared by both workers and by every process a test starts:
# many tests compile the same programs (the embedded model's prefill and rounds through each command line), and
# XLA compiles each once. The first process (xdist's controller, whose environment the workers inherit) names it
# and removes it at the end.
RUN = os.environ.setdefault("SPECJAX_TESTS_RUN", str(os.getpid()))
RUN_CACHE = Path(tempfile.gettempdir()) / f"specjax-tests-{RUN}"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(RUN_CACHE / "jax"))
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
# Every program, however quick to compile (without LLVM's optimizations most take under the default second).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
)


# xdist hands whole files to its workers in collection order: the longest files first (by a full run on 2 cores) keep
# both workers busy to the end, where alphabetical order left the longest ones running alone last. Order only.
LONGEST_FIRST = (
    "test_trainer.py",
    "test_engine.py",
    "test_eagle3_decoding.py",
    "test_speculative.py",
    "test_readme.py",
    "test_cli.py",
    "test_attention.py",
    "test_serve_hosts.py",
    "test_run_folder.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def pytest_unconfigure(config):
    if RUN == str(os.getpid()):
        shutil.rmtree(RUN_CACHE, ignore_errors=True)


def load_script(relative: str) -> ModuleType:
    """A script of the checkout (decode/ or train/) imported as a module, by its path from the repository root."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drops a test file's compiled programs after it: a worker runs many files, and their executables would
    otherwise stay in memory for the whole run."""
    yield
    batch._EXECUTABLES.clear()
    jax.clear_caches()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct, converted once into the user cache and loaded from there."""
    from specjax.io.loading import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own GGUF conversion of the same file (what from_pretrained(gguf_file=...) does, minus its
    accelerate requirement), as a float32 PyTorch model: an independent dequantization and un-permutation."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from specjax.io.loading import embedded_gguf

    path = embedded_gguf("smollm2-135m")
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()}, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # lm_head is tied to the embedding
    return model.eval()


@pytest.fixture(scope="session")
def save_tiny_llama(smollm2):
    """save(folder, num_layers, max_len=96): writes a tiny random llama HF folder (16 wide, 2 heads over 1 KV head, at
    most max_len tokens, EOS 2) with SmolLM2's tokenizer, and returns its config."""
    import jax

    from specjax.config import ModelConfig
    from specjax.io.hf import save_hf
    from specjax.models.llama import init_weights

    tokenizer = smollm2.tokenizer

    def save(folder, num_layers: int, max_len: int = 96):
        cfg = ModelConfig(
            "llama",
            tokenizer.vocab_size,
            16,
            32,
            num_layers,
            2,
            1,
            8,
            max_position_embeddings=max_len,
            eos_token_ids=(2,),
        )
        save_hf(folder, cfg, init_weights(cfg, jax.random.key(0)))
        tokenizer.to_folder(folder)
        return cfg

    return save


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, save_tiny_llama):
    """A tiny random 2-layer llama HF folder (`save_tiny_llama`)."""
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(folder, 2)
    return folder
