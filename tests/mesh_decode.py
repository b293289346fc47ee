"""Run as a script on fake CPU devices (8 unless XLA_FLAGS sets a count): `specjax-generate --mesh M` against one
device, for each drafter, on a random target built in a work folder.

  mesh_decode.py WORK compare MESH... [--only NAME,NAME]
                                           one line per mesh: whether every drafter's (or each named one's) greedy
                                           tokens are one device's
  mesh_decode.py WORK tokens DRAFTER MESH [FLAG...]   the tokens of one drafter (by name) as JSON, from process 0
                                           (FLAGs go to specjax-generate: --coordinator and the like)
"""

import os
import sys

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from specjax.cli.generate import main as generate
from specjax.config import ModelConfig
from specjax.io.dflash_checkpoint import save_dflash
from specjax.io.eagle3_checkpoint import save_eagle3
from specjax.io.hf import save_hf
from specjax.io.loading import tiny_random_model
from specjax.models.dflash import DFlashConfig, init_dflash
from specjax.models.eagle3 import Eagle3Config, Eagle3Head
from specjax.models.llama import init_weights

PROMPTS = [
    "def add(a, b):",
    "The capital of France",
    "1, 2, 3, 4,",
    "Hello",
    "for i in range(",
    "a b a b a b",
    "import numpy as np",
    "Once upon a time",
]


def build(root: Path) -> dict[str, list[str]]:
    """A random 3-layer target with 8 heads over 4 KV heads (so tensor=4 splits the cache), a random EAGLE-3 head and
    a random DFlash draft for it, built once; the drafter flags to test."""
    eagle3 = f"eagle3:{root / 'eagle3'}"
    drafters = {
        "ngram": ["--drafter", "ngram"],
        "eagle3 chain": ["--drafter", eagle3],
        "eagle3 tree": ["--drafter", eagle3, "--tree", "3,2,6"],
        "lookup first": ["--drafter", f"ngram+{eagle3}"],
        "dflash": ["--drafter", f"dflash:{root / 'dflash'}"],
    }
    if (root / "dflash").is_dir():
        return drafters
    tokenizer = tiny_random_model().tokenizer
    cfg = ModelConfig(
        "llama",
        tokenizer.vocab_size,
        64,
        128,
        3,
        8,
        4,
        8,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    save_hf(root / "target", cfg, init_weights(cfg, jax.random.key(0), scale=0.1))
    tokenizer.to_folder(root / "target")
    head_cfg = Eagle3Config.default_for(cfg, draft_vocab_size=512)
    save_eagle3(root / "eagle3", head_cfg, Eagle3Head(head_cfg, rngs=nnx.Rngs(0)), dtype=np.float32)
    dflash_cfg = DFlashConfig.default_for(cfg, mask_token_id=0, num_layers=1, block_size=4)
    save_dflash(root / "dflash", dflash_cfg, init_dflash(dflash_cfg, jax.random.key(1), scale=0.3), dtype=np.float32)
    return drafters


def tokens(root: Path, mesh: str, drafter: list[str], *flags: str) -> list[list[int]] | None:
    """The greedy tokens of each prompt; None on a process other than 0 (which writes nothing)."""
    out = root / f"out-{mesh}.json"
    out.unlink(missing_ok=True)
    prompts = [arg for p in PROMPTS for arg in ("--prompt", p)]
    generate(
        [
            "--model",
            str(root / "target"),
            *prompts,
            "--raw",
            "--max-new-tokens",
            "12",
            "--batch-size",
            "8",
            "--num-draft-tokens",
            "3",
            "--mesh",
            mesh,
            *drafter,
            "--json",
            str(out),
            *flags,
        ]
    )
    return [r["output_ids"] for r in json.loads(out.read_text())["results"]] if out.exists() else None


def main(root: Path, command: str, args: list[str]) -> None:
    drafters = build(root)
    if command == "tokens":
        name, mesh, *flags = args
        found = tokens(root, mesh, drafters[name], *flags)
        if found is not None:
            print(json.dumps(found), flush=True)
        return
    assert len(jax.devices()) == 8, jax.devices()
    if "--only" in args:
        at = args.index("--only")
        drafters = {name: drafters[name] for name in args[at + 1].split(",")}
        args = args[:at]
    one = {name: tokens(root, "data=1", flags) for name, flags in drafters.items()}
    for mesh in args:
        same = {name: tokens(root, mesh, flags) == one[name] for name, flags in drafters.items()}
        print(f"{mesh}: {'identical' if all(same.values()) else 'DIFFERENT'} {same}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
