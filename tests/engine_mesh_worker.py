"""Subprocess side of tests/test_serve_mesh.py (run as a script: the device count is set before JAX loads).

    python tests/engine_mesh_worker.py MODEL_DIR OUT.json
        the generation engine on 8 forced CPU devices, plain and with random Medusa heads, on one device and on
        the meshes data=2 x tensor=2 and data=4: every request's greedy tokens, rows refilled mid-run; and the
        mesh that does not split the rows (MeshError).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402

from medusa_jax.model.sharding import MeshConfig, MeshError  # noqa: E402
from medusa_jax.hf.load import load_pretrained  # noqa: E402
from medusa_jax.heads.config import HeadsConfig  # noqa: E402
from medusa_jax.heads.init import init_heads  # noqa: E402
from medusa_jax.trees.tree import load_tree  # noqa: E402
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine, RequestParams  # noqa: E402

MESHES = {"one": None, "2,2": MeshConfig(data=2, tensor=2), "4,1": MeshConfig(data=4)}


def main(folder: str, out: str) -> None:
    model = load_pretrained(folder)
    heads = init_heads(HeadsConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3), model, seed=0)
    tree = load_tree("mc_sim_7b_8", num_heads=3, max_top_k=heads.config.head_vocab_size)
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 128, size=n).tolist() for n in (5, 40, 9, 2, 17, 30)]
    config = EngineConfig(rows=4, context=64, chunk_steps=3)
    report = {}
    for name, mesh_config in MESHES.items():
        mesh = None if mesh_config is None else mesh_config.make_mesh()
        for method, drafter in (("plain", None), ("medusa", heads)):
            engine = GenerationEngine(model, config, eos_ids=(), heads=drafter, tree=tree if drafter else None,
                                      mesh=mesh)
            report[f"{name}/{method}"] = engine.generate_all(prompts, RequestParams(max_tokens=12))
    try:
        GenerationEngine(model, EngineConfig(rows=3, context=64), eos_ids=(), mesh=MESHES["2,2"].make_mesh())
        report["indivisible"] = "accepted"
    except MeshError as e:
        report["indivisible"] = str(e)
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
