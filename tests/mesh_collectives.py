"""Run as a script with 8 fake CPU devices: the collectives XLA inserts into the compiled decode programs at
data=2,tensor=4, as JSON: for the plain decode loop, an EAGLE-3 chain loop and an EAGLE-3 tree loop, each collective's
kind, result shape and the operation it came from; and how the head's weights are placed (each one's shape and its
shape on one device). Argument: a work folder."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json
import re
from pathlib import Path

from mesh_decode import build

from specjax.decoding import batch, speculative
from specjax.decoding.autoregressive import generate
from specjax.drafters import drafter_from_spec
from specjax.drafters.tree import TreeSpec
from specjax.io.loading import load_model
from specjax.models.eagle3 import param_specs

COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(.*?"
    r'op_name="([^"]*)"'
)


SHAPE = re.compile(r"\w+\[[^\]]*\](?:\{[^}]*\})?")


def collectives(run) -> list[dict]:
    """The collectives of the program `run()` compiles, one per value moved (XLA may combine several into one)."""
    before = set(batch._EXECUTABLES)
    run()
    (key,) = set(batch._EXECUTABLES) - before
    text = batch._EXECUTABLES[key].as_text()
    return [dict(kind=m[2], shape=shape, op=m[3]) for m in COLLECTIVE.finditer(text) for shape in SHAPE.findall(m[1])]


def main(root: Path) -> None:
    drafters = build(root)
    model = load_model(str(root / "target"), mesh={"data": 2, "tensor": 4})
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12], [13, 14]]
    eagle3 = drafters["eagle3 chain"][1]
    kw = dict(max_new_tokens=8, batch_size=4)
    chain = drafter_from_spec(eagle3, model.weights, model.cfg)
    tree = drafter_from_spec(eagle3, model.weights, model.cfg, tree=TreeSpec.parse("3,2,6"))
    found = {
        "plain": collectives(lambda: generate(model.weights, model.cfg, prompts, **kw)),
        "chain": collectives(
            lambda: speculative.speculative_generate(
                model.weights, model.cfg, prompts, drafter=chain, num_draft_tokens=3, **kw
            )
        ),
        "tree": collectives(
            lambda: speculative.speculative_generate(
                model.weights, model.cfg, prompts, drafter=tree, num_draft_tokens=3, **kw
            )
        ),
    }
    head = chain.head
    placed = {name: getattr(head, name)[...] for name in param_specs(head.cfg)}
    placed["drafted_embed"] = chain.drafted_embed
    print(
        json.dumps(
            found | {"head placement": {n: [x.shape, x.sharding.shard_shape(x.shape)] for n, x in placed.items()}}
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
