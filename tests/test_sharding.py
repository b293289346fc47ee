import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fake_devices

from specjax.config import ModelConfig
from specjax.errors import InputError
from specjax.models.dflash import DFlashConfig, weight_specs_of
from specjax.models.eagle3 import Eagle3Config, param_specs
from specjax.models.llama import weight_specs
from specjax.sharding import (
    CACHE_AXES,
    DEFAULT_RULES,
    LOGICAL_AXES,
    ArraySpec,
    default_mesh_axes,
    make_mesh,
    merged_rules,
    mesh_for,
    parse_mesh,
    partition_spec,
    set_rows,
    shard_fraction,
    shardings_of,
)


@pytest.mark.slow  # the mesh runs of every drafter below cover it in CI
@pytest.mark.parametrize("data,tensor", [(1, 8), (2, 4)])
def test_tensor_parallel_equals_single_device(data, tensor):
    script = Path(__file__).with_name("sharded_decode.py")
    proc = subprocess.run([sys.executable, str(script), str(data), str(tensor)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


def test_mesh_must_divide_devices():
    with pytest.raises(InputError, match="needs 3 devices"):
        make_mesh({"data": 3})


def test_indivisible_or_reused_axes_are_replicated():
    mesh = make_mesh({"data": 1, "tensor": 1})
    spec = partition_spec(("heads", "kv_heads"), (9, 3), mesh)
    assert tuple(spec) == ("tensor", None)


def test_rules_merge_over_the_defaults_and_move_where_a_weight_lands():
    rules = merged_rules({"vocab": None, "mlp": ["tensor", "fsdp"], "layers": "data"}, ("data", "fsdp", "tensor"))
    table = dict(rules)
    assert table["vocab"] is None and table["mlp"] == ("tensor", "fsdp") and table["layers"] == "data"
    assert {k: v for k, v in table.items() if k not in ("vocab", "mlp", "layers")} == {
        k: v for k, v in DEFAULT_RULES if k not in ("vocab", "mlp")
    }
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    specs = {
        "embed": ArraySpec((96, 32), ("vocab", "embed")),
        "gate": ArraySpec((4, 32, 64), ("layers", "embed", "mlp")),
    }
    default, override = shardings_of(specs, mesh), shardings_of(specs, mesh, rules)
    assert tuple(default["embed"].spec) == ("tensor", "fsdp") and tuple(override["embed"].spec) == (None, "fsdp")
    assert tuple(default["gate"].spec) == (None, "fsdp", "tensor")
    assert tuple(override["gate"].spec) == ("data", "fsdp", "tensor")  # mlp: fsdp taken by embed, tensor left
    # What a device holds follows the rules: the vocabulary whole at tensor=4, a quarter of it by default.
    assert shard_fraction(("vocab", "embed"), (96, 32), {"tensor": 4}) == 4
    assert shard_fraction(("vocab", "embed"), (96, 32), {"tensor": 4}, rules) == 1


def test_unknown_axes_in_rules_are_one_error_naming_them_all():
    with pytest.raises(
        InputError, match="unknown logical axis 'vocabulary', an unknown mesh axis 'model' \\(for mlp\\)"
    ):
        merged_rules({"vocabulary": None, "mlp": ["tensor", "model"]}, ("data", "tensor"))


def test_every_declared_logical_axis_has_a_name_rules_may_use():
    target = ModelConfig("llama", 96, 32, 64, 6, 4, 2, 8, attention_bias=True, qk_norm=True)
    trees = [
        weight_specs(target, "int8"),
        param_specs(Eagle3Config.default_for(target, 48)),
        weight_specs_of(DFlashConfig.default_for(target, 0)),
    ]
    declared = (
        {
            a
            for tree in trees
            for spec in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, ArraySpec))
            for a in spec.axes
        }
        | set(CACHE_AXES)
        | {name for name, _ in DEFAULT_RULES}
    )
    assert declared - {None} <= set(LOGICAL_AXES), declared - set(LOGICAL_AXES)


def run_script(name: str, *args) -> str:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(name)), *map(str, args)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# CI: the EAGLE-3 tree and DFlash on one mesh (a head's state and a draft model's cache, both split over tensor);
# -m slow: every drafter on three meshes.
@pytest.mark.parametrize(
    "meshes",
    [
        ["data=2,tensor=4", "--only", "eagle3 tree,dflash"],
        pytest.param(["data=2,tensor=4", "tensor=8", "data=8"], marks=pytest.mark.slow),
    ],
)
def test_generate_on_a_mesh_gives_one_devices_tokens_for_every_drafter(tmp_path, meshes):
    lines = run_script("mesh_decode.py", tmp_path, "compare", *meshes).splitlines()
    meshes = meshes[: meshes.index("--only")] if "--only" in meshes else meshes
    lines = [line for line in lines if line.endswith("}")]
    assert [line.split(":")[0] for line in lines] == meshes
    assert all(": identical" in line for line in lines), lines


def category(collective: dict) -> tuple[str, str]:
    """(kind, the operation it came from, without the jit and loop prefixes)."""
    return collective["kind"], collective["op"].removesuffix("/dot_general").rpartition("/")[2]


# The test head (width 64, 8 heads over 4 KV heads of 8, MLP 128, 512 draft tokens, 3 taps) at tensor=4: heads, KV
# heads, MLP columns and the draft vocabulary split four ways; fc, the norms and the drafted tokens' embedding whole.
HEAD_PLACEMENT = {
    "fc": [[192, 64], [192, 64]],
    **{norm: [[64], [64]] for norm in ("input_norm", "hidden_norm", "mlp_norm", "final_norm")},
    "q": [[128, 8, 8], [128, 2, 8]],
    "k": [[128, 4, 8], [128, 1, 8]],
    "v": [[128, 4, 8], [128, 1, 8]],
    "o": [[8, 8, 64], [2, 8, 64]],
    "gate": [[64, 128], [64, 32]],
    "up": [[64, 128], [64, 32]],
    "down": [[128, 64], [32, 64]],
    "lm_head": [[64, 512], [64, 128]],
    "drafted_embed": [[512, 64], [512, 64]],
}


def test_decode_programs_hold_only_the_collectives_tensor_parallelism_needs(tmp_path):
    found = json.loads(run_script("mesh_collectives.py", tmp_path).splitlines()[-1])
    programs = {name: sorted("{}:{}".format(*category(c)) for c in found[name]) for name in ("plain", "chain", "tree")}
    out_proj, mlp_down = "all-reduce:btnh,nhd->btd", "all-reduce:btf,fd->btd"
    # A target forward (the prefill; a step or a verification): in the layer scan one reduction after attention and
    # one after the MLP; one for the embedding lookup of the vocabulary-split table; the argmax over the
    # vocabulary-split logits, values and ids from each tensor shard. The loop's "all rows done" over the data axis.
    # The cache is written and read shard by shard: no other collective. (These buffers are one attention block; a
    # longer one adds the longest row's length over the data axis, a scalar that bounds the blocks read.)
    forward = [out_proj, mlp_down, "all-reduce:gather", "all-gather:reduce", "all-gather:reduce"]
    assert programs["plain"] == sorted(forward * 2 + ["all-reduce:reduce_and"])
    # The speculative loop adds the acceptance histogram over the data axis, and the head split by its own rules: its
    # commit's embedding lookup (in each prefill chunk, for the first token, after each verification; XLA may combine
    # the chunk's with the target's into one all-reduce) and, per pass of its layer (the root, then the chain's scanned
    # step or each tree level), the two reductions and the draft logits' gather (the chain's argmax values and ids, a
    # tree level's logits for top-k). No draft step looks up the vocabulary-split embedding.
    speculative = sorted(forward * 2 + ["all-reduce:reduce_and", "all-reduce:reduce_sum"] + ["all-reduce:gather"] * 3)
    head_pass = [out_proj, mlp_down, "all-gather:reduce", "all-gather:reduce"]
    assert programs["chain"] == sorted(speculative + head_pass * 2)
    assert programs["tree"] == sorted(speculative + [out_proj, mlp_down, "all-gather:sharding_constraint"] * 3)
    # Each moves one data shard's own rows (2 of the 4) of activations or logits, never a weight or another shard's
    # rows; besides, "all rows done" and the histogram.
    moved = [c["shape"] for name in programs for c in found[name]]
    assert all(re.match(r"\w+\[2,", shape) or shape in ("pred[]", "s32[]", "s32[4]{0}") for shape in moved), moved
    assert found["head placement"] == HEAD_PLACEMENT


def test_mesh_flags_and_defaults():
    assert parse_mesh("data=2,tensor=4") == {"data": 2, "tensor": 4}
    assert parse_mesh("tensor=-1") == {"data": 1, "tensor": -1}
    for bad in ("model=2", "data=two", "data=0", "data=-2"):
        with pytest.raises(InputError, match=f"^mesh='{bad}': "):
            parse_mesh(bad)
    assert default_mesh_axes(8, 8) == {"data": 1, "tensor": 8}
    assert default_mesh_axes(8, 2) == {"data": 4, "tensor": 2}
    assert default_mesh_axes(8, 3) == {"data": 8, "tensor": 1}
    assert mesh_for("auto", 4) is None and mesh_for(None, 4) is None  # one device here: unsharded, as before


def test_set_rows_writes_what_a_per_row_scatter_writes():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 7, 2)), jnp.float32)
    index = jnp.asarray([[0, 6, 9], [2, 3, 4], [7, 1, 1]])  # 9 and 7 past the end: dropped
    values = jnp.asarray(rng.normal(size=(3, 3, 2)), jnp.float32)
    rows = jnp.arange(3)[:, None]
    np.testing.assert_array_equal(set_rows(x, index[:, :2], values[:, :2]), x.at[rows, index[:, :2]].set(values[:, :2]))
    np.testing.assert_array_equal(set_rows(x, index, 1.5), x.at[rows, index].set(1.5, mode="drop"))
    flat = jnp.zeros((3, 5), jnp.int32)
    np.testing.assert_array_equal(
        set_rows(flat, jnp.asarray([4, 0, 5]), 7), flat.at[jnp.arange(3), [4, 0, 5]].set(7, mode="drop")
    )


@pytest.mark.slow  # two processes run in CI in the trainer's kill-and-resume test
def test_generate_across_two_processes_gives_one_devices_tokens(tmp_path):
    """Two local processes of 4 fake devices each (jax.distributed on 127.0.0.1), one data=2,tensor=4 mesh: the EAGLE-3
    tree loop's greedy tokens are one device's; process 0 writes them."""
    script = str(Path(__file__).with_name("mesh_decode.py"))
    reference = json.loads(run_script("mesh_decode.py", tmp_path, "tokens", "eagle3 tree", "data=1").splitlines()[-1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": fake_devices(4)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                script,
                str(tmp_path),
                "tokens",
                "eagle3 tree",
                "data=2,tensor=4",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    assert json.loads(outputs[0][0].splitlines()[-1]) == reference
