import subprocess
import sys
from pathlib import Path

import pytest

from specjax.errors import InputError
from specjax.sharding import make_mesh, partition_spec


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
