"""Models and draft heads by Hugging Face Hub name, served from a Hub cache laid out in tmp_path: never the network."""

import hashlib
import socket
import subprocess
import sys
from pathlib import Path

import httpx2
import huggingface_hub
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import (
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from specjax.drafters import Eagle3Drafter, draft_folder, drafter_from_spec
from specjax.drafters.registry import SHIPPED_DRAFTS
from specjax.errors import CheckpointError
from specjax.io.hf import save_hf
from specjax.io.hub import resolve
from specjax.io.loading import load_model, tiny_random_model
from specjax.models.kv_cache import KVCache
from specjax.models.llama import forward

MAIN = "a" * 40  # the commit refs/main points at
OLD = "b" * 40  # an older commit, tagged v1


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny-random llama as an HF folder: config, safetensors and SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("tiny")
    model = tiny_random_model()
    save_hf(folder, model.cfg, model.weights)
    model.tokenizer.to_folder(folder)
    return folder


def cache_repo(cache: Path, repo: str, source: Path, commit: str, ref: str = "main") -> Path:
    """Lays out the files of `source` as huggingface_hub caches `repo` at `commit`: blobs named by hash, a snapshot
    of links to them, and refs/`ref` holding the commit. Returns the snapshot folder."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for file in source.iterdir():
        if file.is_file():
            blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            blob.write_bytes(file.read_bytes())
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    return snapshot.resolve()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache, offline. huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE once at import, so its
    constants are patched as well as the environment (which the CLI subprocesses read)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    return cache


def generate(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "specjax.cli.generate", "--raw", "--prompt", "hi", "--max-new-tokens", "4", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def logits(model) -> np.ndarray:
    ids = jnp.asarray(model.tokenizer.encode("Hello from the Hub"))[None]
    T = ids.shape[1]
    out, _, _ = forward(model.weights, model.cfg, ids, jnp.arange(T)[None], KVCache.empty(model.cfg, 1, T))
    return np.asarray(out)


def test_a_hub_name_loads_offline_from_the_cache(hub_cache, tiny_folder):
    snapshot = cache_repo(hub_cache, "org/tiny", tiny_folder, MAIN)
    model = load_model("org/tiny")
    assert model.source == str(snapshot)
    np.testing.assert_array_equal(logits(model), logits(load_model(str(tiny_folder))))


def test_a_revision_pins_a_snapshot_and_a_local_path_wins(hub_cache, tiny_folder, tmp_path, monkeypatch):
    main = cache_repo(hub_cache, "org/tiny", tiny_folder, MAIN)
    old = cache_repo(hub_cache, "org/tiny", tiny_folder, OLD, ref="v1")
    assert resolve("org/tiny", "model") == main
    assert resolve(f"org/tiny@{OLD}", "model") == resolve("org/tiny@v1", "model") == old
    with pytest.raises(CheckpointError, match="--revision v2") as e:
        resolve("org/tiny@v2", "model")
    assert "not in the local Hugging Face cache" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert resolve("org/tiny", "model") == Path("org/tiny")
    assert resolve("./missing/x", "model") == Path("./missing/x")  # not a Hub name: the caller judges the path


def test_a_repo_without_safetensors_is_refused(hub_cache, tmp_path):
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text("{}")
    cache_repo(hub_cache, "org/pickled", tmp_path / "pickled", MAIN)
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_model("org/pickled")


def http_error(cls: type[HfHubHTTPError], status: int) -> HfHubHTTPError:
    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/x")
    return cls(f"{status} Client Error\nmore detail", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize(
    "error, message",
    [
        (http_error(GatedRepoError, 403), "gated repo on the Hugging Face Hub; accept its terms at"),
        (http_error(RepositoryNotFoundError, 404), "neither a local path nor a repo on the Hugging Face Hub"),
        (http_error(RevisionNotFoundError, 404), "has no revision 'dev'"),
        (http_error(DisabledRepoError, 403), "disabled on the Hugging Face Hub"),
        (http_error(HfHubHTTPError, 500), "failed to serve org/x@dev (500 Client Error)"),
        (HFValidationError("Repo id must be valid\nmore detail"), "not a valid Hugging Face Hub repo name"),
        (
            httpx2.RemoteProtocolError("peer closed connection\nmore detail"),
            "failed (peer closed connection); run again",
        ),
        (OSError(28, "No space left on device"), "failed ([Errno 28] No space left on device); run again"),
    ],
)
def test_hub_failures_are_one_line(monkeypatch, error, message):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(CheckpointError) as e:
        resolve("org/x@dev", "model")
    assert message in str(e.value) and "org/x" in str(e.value) and "\n" not in str(e.value), e.value


def test_the_cli_runs_a_hub_model_offline_and_names_what_is_missing(hub_cache, tiny_folder):
    cache_repo(hub_cache, "org/tiny", tiny_folder, MAIN)
    done = generate("--model", "org/tiny", "--drafter", "ngram", "--num-draft-tokens", "2")
    assert done.returncode == 0, done.stderr
    missing = generate("--model", "org/absent")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "org/absent is not in the local Hugging Face cache (HF_HUB_OFFLINE is set)" in missing.stderr


def test_the_cli_without_network_says_so_on_one_line(hub_cache, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in ("HF_HUB_OFFLINE", "0"), ("HF_HUB_ETAG_TIMEOUT", "1"), ("HF_HUB_DOWNLOAD_TIMEOUT", "1"):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    done = generate("--model", "org/absent")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot reach the Hugging Face Hub to download org/absent" in done.stderr
    assert "set HF_HUB_OFFLINE=1" in done.stderr


def test_an_eagle3_head_by_hub_name(hub_cache, smollm2):
    snapshot = cache_repo(hub_cache, "org/head", SHIPPED_DRAFTS["eagle3", "smollm2-135m"], MAIN)
    assert draft_folder("eagle3", "org/head") == snapshot
    drafter = drafter_from_spec("eagle3:org/head", smollm2.weights, smollm2.cfg)
    shipped = drafter_from_spec("eagle3:smollm2-135m", smollm2.weights, smollm2.cfg)
    assert isinstance(drafter, Eagle3Drafter)
    jax.tree.map(np.testing.assert_array_equal, drafter.params, shipped.params)
