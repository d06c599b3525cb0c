"""Subprocess side of tests/test_serve_mesh.py (run as a script: the device count is set before JAX loads).

    python tests/engine_mesh_worker.py MODEL_DIR OUT.json
        the generation engine on 8 forced CPU devices, plain, with random Medusa heads, with Token Recycling (its
        table replicated) and with a mix of Medusa heads, recycling and prompt lookup (DraftSizes) on the meshes
        data=2 x tensor=2 and data=4, plain on one device: every request's greedy tokens, rows refilled mid-run;
        and the mesh that does not split the rows (MeshError).
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
from medusa_jax.heads.draft_merge import DraftSizes  # noqa: E402
from medusa_jax.heads.init import init_heads  # noqa: E402
from medusa_jax.heads.lookup import LookupConfig  # noqa: E402
from medusa_jax.heads.mixed import make_mix, template_spec  # noqa: E402
from medusa_jax.heads.recycle import RANK_ACCEPTANCE, RecycleConfig, RecycleDrafter, template_tree  # noqa: E402
from medusa_jax.trees.tree import DynamicTree, load_tree  # noqa: E402
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine  # noqa: E402
from medusa_jax.inference.engine_requests import RequestParams  # noqa: E402

def drafters(model, heads, tree):
    """method -> (drafter, tree), each drafter new (a fresh recycling table per engine)."""
    config = model.config

    def recycler():
        return RecycleDrafter(RecycleConfig(config.hidden_size, config.vocab_size))

    def mix():
        drafter = make_mix(config.hidden_size, config.vocab_size, trained=heads,
                           trained_tree=DynamicTree(6, top_k=2, depth=3), lookup=LookupConfig(length=6, branches=2),
                           template=(recycler(), template_spec(template_tree("recycle_8"), RANK_ACCEPTANCE)))
        return drafter, DraftSizes((0, 2, 6, 12), (1.0, 1.05, 1.1, 1.2), depth=drafter.depth)

    return {"plain": lambda: (None, None), "medusa": lambda: (heads, tree),
            "recycle": lambda: (recycler(), template_tree("recycle_8")), "mix": mix}


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
        for method, make in drafters(model, heads, tree).items():
            if mesh is None and method != "plain":  # one device: plain, the reference (drafters vs plain on one
                continue  # device: tests/test_generation_engine.py, test_engine_drafts.py)
            drafter, drafter_tree = make()
            engine = GenerationEngine(model, config, eos_ids=(), heads=drafter, tree=drafter_tree, mesh=mesh)
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
