"""Subprocess side of tests/test_mixed_drafts.py's mesh test (the device count is set before JAX loads):

    python tests/mixed_sharded_worker.py MODEL_DIR OUT.json

On 8 forced CPU devices: plain greedy on one device (the reference), then prompt lookup alone and mixed with random
Medusa heads on meshes (data, tensor) = (8, 1) and (2, 4), 8 ragged rows that repeat (so lookup hits; on one
device the mixes are tests/test_mixed_drafts.py's own cases).
Writes {"reference": [tokens per row], "<mix> <mesh>": {"tokens": [...], "accepts": [...]}}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402

from medusa_jax.model.sharding import MeshConfig, sharding_for  # noqa: E402
from medusa_jax.hf.load import load_pretrained  # noqa: E402
from medusa_jax.heads.config import HeadsConfig  # noqa: E402
from medusa_jax.heads.draft_merge import DraftSizes  # noqa: E402
from medusa_jax.heads.init import init_heads  # noqa: E402
from medusa_jax.heads.lookup import LookupConfig  # noqa: E402
from medusa_jax.heads.mixed import make_mix  # noqa: E402
from medusa_jax.trees.tree import DynamicTree  # noqa: E402
from medusa_jax.inference.api import BatchSettings, generate, generate_batch  # noqa: E402
from medusa_jax.inference.sharded import ShardedModel  # noqa: E402
from decode_helpers import randomise_kernels  # noqa: E402

MAX_NEW = 24
MESHES = ((8, 1), (2, 4))


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.RandomState(0)
    out = []
    for n in (3, 9, 14, 5, 20, 7, 11, 4):
        motif = rng.randint(1, vocab, size=rng.randint(2, 5)).tolist()
        out.append((motif * 8)[:n] + rng.randint(1, vocab, size=2).tolist())
    return out


def main(model_dir: str, out: str) -> None:
    base0 = load_pretrained(model_dir)
    rows = prompts(base0.config.vocab_size)
    report = {"reference": [r.token_ids for r in generate(base0, rows, max_new_tokens=MAX_NEW, eos_ids=())]}
    config = base0.config
    heads = init_heads(HeadsConfig(config.hidden_size, config.vocab_size, num_heads=3), base0, seed=0)
    randomise_kernels([block.linear for head in heads.heads for block in head.blocks], 0)
    for data, tensor in MESHES:
        mesh = MeshConfig(data=data, tensor=tensor).make_mesh()
        base = load_pretrained(model_dir, sharding_for=sharding_for(mesh))
        for name, trained in (("lookup", None), ("medusa+lookup", heads)):
            mix = make_mix(config.hidden_size, config.vocab_size, trained=trained,
                           trained_tree=DynamicTree(6, 2, 3) if trained is not None else None,
                           lookup=LookupConfig(length=6, branches=2))
            sizes = DraftSizes((0, 2, 8), (1.0, 1.1, 1.3), depth=mix.depth)
            settings = BatchSettings(batch_size=8, max_new_tokens=MAX_NEW, tree=sizes, bucket=16)
            run = generate_batch(ShardedModel(base, mix, mesh), rows, settings, progress=False)
            report[f"{name} {data},{tensor}"] = {"tokens": [r.token_ids for r in run.results],
                                                 "accepts": [r.accept_lengths for r in run.results]}
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
