"""Subprocess side of tests/test_stacked_load.py's mesh test (run as a script: the device count is set before JAX
loads).

    python tests/stacked_load_worker.py MODEL_DIR
        on fsdp=2 x tensor=4 of 8 forced CPU devices, loads the model straight into the stacked layout, each
        device reading its own slice: checks every stack's sharding (layer axis whole) and every device's shard
        against the one-device per-layer model stacked afterwards; prints "ok" last.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from medusa_jax.hf.load import load_pretrained  # noqa: E402
from medusa_jax.model.backbone import with_layer_execution  # noqa: E402
from medusa_jax.model.config import LayerExecution  # noqa: E402
from medusa_jax.model.param_paths import param_paths  # noqa: E402
from medusa_jax.model.sharding import MeshConfig, sharding_for  # noqa: E402

STACKED = LayerExecution(scan=True)


def main(model_dir: str) -> None:
    mesh = MeshConfig(fsdp=2, tensor=4).make_mesh()
    sharded = load_pretrained(model_dir, sharding_for=sharding_for(mesh), layers=STACKED)
    ref = dict(param_paths(nnx.state(with_layer_execution(load_pretrained(model_dir), STACKED), nnx.Param)))
    checked = 0
    for path, leaf in param_paths(nnx.state(sharded, nnx.Param)):
        full = np.asarray(ref[path])
        assert leaf.shape == full.shape, path
        if path[0] == "layers":
            spec = leaf.sharding.spec
            assert spec[0] is None, (path, spec)
            if path[-1] == "kernel":
                assert set(spec[1:]) == {"fsdp", "tensor"}, (path, spec)
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=str(path))
            checked += 1
    assert checked >= 8 * 9, checked
    print(f"{checked} shards equal")
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
