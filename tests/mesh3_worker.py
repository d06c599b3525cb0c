"""Subprocess side of tests/test_first_use.py::test_tensor3_mesh_suits_the_heads (6 forced CPU devices).

    python tests/mesh3_worker.py MODEL_DIR OUT.json
A model with 3 KV heads on mesh data=2 x tensor=3, with truncated heads over 64 tokens (64 does not divide by
3): batch Medusa decoding on the mesh vs generate_medusa on one device, one prompt on that mesh (padded with a
filler row) vs one device, and the heads' parameter layouts.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=6").strip()

import numpy as np  # noqa: E402

from medusa_jax.model.sharding import MeshConfig, sharding_for  # noqa: E402
from medusa_jax.hf.load import load_pretrained  # noqa: E402
from medusa_jax.heads.config import HeadsConfig  # noqa: E402
from medusa_jax.heads.init import init_heads  # noqa: E402
from medusa_jax.trees.tree import load_tree  # noqa: E402
from medusa_jax.inference.api import BatchSettings, generate, generate_batch, generate_medusa  # noqa: E402
from medusa_jax.inference.sharded import ShardedModel  # noqa: E402

MAX_NEW, NUM_HEADS, HEAD_VOCAB = 12, 3, 64


def main(model_dir: str, out: str) -> None:
    base0 = load_pretrained(model_dir)
    vocab = base0.config.vocab_size
    rng = np.random.RandomState(0)
    token_map = np.sort(rng.choice(vocab, HEAD_VOCAB, replace=False)).astype(np.int32)
    heads = init_heads(HeadsConfig(base0.config.hidden_size, vocab, NUM_HEADS, lm_head="truncated",
                                   truncated_vocab_size=HEAD_VOCAB), base0, seed=1, token_map=token_map)
    tree = load_tree("mc_sim_7b_16", num_heads=NUM_HEADS, max_top_k=HEAD_VOCAB)
    prompts = [rng.randint(1, vocab, size=rng.randint(3, 20)).tolist() for _ in range(4)]
    ref = generate_medusa(base0, heads, prompts, tree=tree, max_new_tokens=MAX_NEW, eos_ids=())
    mesh = MeshConfig(data=2, tensor=3).make_mesh()
    model = ShardedModel(load_pretrained(model_dir, sharding_for=sharding_for(mesh)), heads, mesh)
    run = generate_batch(model, prompts, BatchSettings(batch_size=4, max_new_tokens=MAX_NEW, tree=tree, bucket=16),
                         progress=False)
    one = generate_batch(model, prompts[:1], BatchSettings(batch_size=1, max_new_tokens=MAX_NEW, tree=tree, bucket=16),
                         progress=False)  # one prompt on data=2 x tensor=3: padded with a filler row
    one_plain = generate_batch(model, prompts[:1], BatchSettings(batch_size=1, max_new_tokens=MAX_NEW, bucket=16),
                               progress=False)
    ref_plain = generate(base0, prompts[:1], max_new_tokens=MAX_NEW, eos_ids=())
    head0 = model.medusa_params["heads"]["heads"][0]
    specs = {name: [list(a) if isinstance(a, tuple) else a for a in leaf[...].sharding.spec]
             for name, leaf in (("lm_head", head0["lm_head"]["kernel"]),
                                ("block", head0["blocks"][0]["linear"]["kernel"]))}
    with open(out, "w") as f:
        json.dump({"reference": [r.token_ids for r in ref], "mesh": [r.token_ids for r in run.results],
                   "one": [r.token_ids for r in one.results], "one_plain": [r.token_ids for r in one_plain.results],
                   "reference_plain": [r.token_ids for r in ref_plain],
                   "specs": specs}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
