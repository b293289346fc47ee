"""Models and draft heads by Hugging Face Hub name, ORG/NAME[@REVISION], fetched once into the Hub cache.

Only the files specjax reads are downloaded (config, safetensors weights, tokenizer), into the cache huggingface_hub
uses (HF_HOME / HF_HUB_CACHE); with HF_HUB_OFFLINE=1 they are served from that cache alone. REVISION, after "@", is a
branch, tag or commit of the repo: `Qwen/Qwen2.5-0.5B-Instruct@main`. Gated and private repos read HF_TOKEN or the
token saved by `hf auth login`.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx2  # huggingface_hub's HTTP client
import huggingface_hub
from huggingface_hub.errors import (
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from specjax.errors import CheckpointError

HUB_URL = "https://huggingface.co"
# ORG/NAME, then an optional @REVISION (which may hold slashes: refs/pr/1). A leading ".", "/" or "~" makes a path.
HUB_NAME = re.compile(r"([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(.+))?")
# The top-level files each kind reads; subfolders (onnx/, original/, ...) are never downloaded.
PATTERNS = {
    "model": [
        "config.json",
        "generation_config.json",
        "*.safetensors",
        "*.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ],
    "draft": ["config.json", "*.safetensors", "*.safetensors.index.json"],
}


def _first_line(e: Exception) -> str:
    return str(e).strip().partition("\n")[0]


def _download(repo: str, revision: str | None, kind: str) -> Path:
    """snapshot_download of the files of `kind`, its failures turned into one-line CheckpointErrors."""
    name = f"{repo}@{revision}" if revision else repo
    try:
        return Path(
            huggingface_hub.snapshot_download(
                repo, revision=revision, allow_patterns=PATTERNS[kind], ignore_patterns=["*/*"]
            )
        )
    except GatedRepoError:
        raise CheckpointError(
            f"{repo} is a gated repo on the Hugging Face Hub; accept its terms at {HUB_URL}/{repo}, then log in with "
            "`hf auth login` or set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo} is neither a local path nor a repo on the Hugging Face Hub; check the name, or for a private repo "
            "log in with `hf auth login` or set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(
            f"{repo} has no revision {revision!r} on the Hugging Face Hub; pick a branch, tag or commit from "
            f"{HUB_URL}/{repo}/commits/main"
        ) from None
    except DisabledRepoError:
        raise CheckpointError(f"{repo} is disabled on the Hugging Face Hub by its owner; use another repo") from None
    except HFValidationError as e:
        raise CheckpointError(f"{name!r} is not a valid Hugging Face Hub repo name ({_first_line(e)})") from None
    except LocalEntryNotFoundError as e:
        if huggingface_hub.is_offline_mode():
            raise CheckpointError(
                f"{name} is not in the local Hugging Face cache (HF_HUB_OFFLINE is set); download it first with "
                f"`hf download {repo}{f' --revision {revision}' if revision else ''}`, or run once without "
                "HF_HUB_OFFLINE"
            ) from None
        reason = _first_line(e.__cause__ or e)
        raise CheckpointError(
            f"cannot reach the Hugging Face Hub to download {name} ({reason}); check the network, or set "
            "HF_HUB_OFFLINE=1 to use the local cache"
        ) from None
    except HfHubHTTPError as e:
        raise CheckpointError(f"the Hugging Face Hub failed to serve {name} ({_first_line(e)}); try again") from None
    except (OSError, httpx2.TransportError) as e:  # a full disk, a connection dropped: what is complete stays cached
        raise CheckpointError(f"downloading {name} failed ({_first_line(e)}); run again to resume") from None


def resolve(name_or_path: str, kind: str) -> Path:
    """The local folder of a model or draft head given by path or by Hugging Face Hub name.

    An existing path always wins, and anything that is not ORG/NAME[@REVISION] (or names a .gguf file) is returned as
    a path for the caller to judge.

    Args:
      name_or_path: a path, or a Hub repo id with an optional "@" and branch, tag or commit.
      kind: "model" (config, safetensors and tokenizer files) or "draft" (config and safetensors of a draft head).
    Returns:
      The path, or the repo's snapshot folder in the Hub cache, downloaded if needed. Raises CheckpointError on one
      line when the Hub or the cache cannot serve it, or the repo has no safetensors weights.
    """
    path = Path(name_or_path).expanduser()
    match = HUB_NAME.fullmatch(name_or_path)
    if path.exists() or match is None or match[1].lower().endswith(".gguf"):
        return path
    repo, revision = match.groups()
    folder = _download(repo, revision, kind)
    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(
            f"{repo} has no .safetensors weights; specjax loads safetensors only, never pickled .bin/.pt files "
            "(for a GGUF repo, download its .gguf file and pass that path)"
        )
    return folder
