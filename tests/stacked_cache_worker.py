"""Subprocess side of tests/test_stacked_cache.py's mesh test (run as a script: the device count is set before JAX
loads).

    python tests/stacked_cache_worker.py MODEL_DIR
        on data=2 x tensor=4 of 8 forced CPU devices, a stacked model (LayerExecution(scan=True)) decodes over a
        stacked KV cache: its shardings (layers whole, rows over data, KV heads over tensor) and its plain and
        Medusa greedy tokens against the one-device per-layer model's; prints "ok" last.
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from medusa_jax.heads.config import HeadsConfig  # noqa: E402
from medusa_jax.heads.init import init_heads  # noqa: E402
from medusa_jax.hf.load import load_pretrained  # noqa: E402
from medusa_jax.inference.api import BatchSettings, generate, generate_batch, generate_medusa  # noqa: E402
from medusa_jax.inference.sharded import ShardedModel  # noqa: E402
from medusa_jax.model.backbone import with_layer_execution  # noqa: E402
from medusa_jax.model.config import LayerExecution  # noqa: E402
from medusa_jax.model.sharding import MeshConfig  # noqa: E402
from medusa_jax.trees.tree import load_tree  # noqa: E402
from decode_helpers import randomise_kernels  # noqa: E402

MAX_NEW = 16


def main(model_dir: str) -> None:
    base = load_pretrained(model_dir)
    heads = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=3), base, seed=1)
    randomise_kernels([block.linear for head in heads.heads for block in head.blocks], 1)
    tree = load_tree("mc_sim_7b_16", num_heads=3)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, base.config.vocab_size, size=rng.randint(3, 20)).tolist() for _ in range(8)]
    ref_plain = [r.token_ids for r in generate(base, prompts, max_new_tokens=MAX_NEW, eos_ids=())]
    ref_medusa = [r.token_ids for r in generate_medusa(base, heads, prompts, tree=tree, max_new_tokens=MAX_NEW,
                                                       eos_ids=())]
    mesh = MeshConfig(data=2, tensor=4).make_mesh()
    model = ShardedModel(with_layer_execution(base, LayerExecution(scan=True)), heads, mesh)
    spec = model.cache_sharding(8, 64)
    assert spec.stacked and spec.k_bkhs.spec == P(None, ("data", "fsdp"), "tensor", None, None), spec.k_bkhs.spec
    assert spec.v_bksh.spec == spec.k_bkhs.spec and spec.lengths_b.spec == P(("data", "fsdp"))
    settings = BatchSettings(batch_size=8, max_new_tokens=MAX_NEW, eos_ids=(), bucket=16)
    plain = [r.token_ids for r in generate_batch(model, prompts, settings, progress=False).results]
    medusa = [r.token_ids for r in generate_batch(model, prompts, dataclasses.replace(settings, tree=tree),
                                                  progress=False).results]
    assert plain == ref_plain, (plain, ref_plain)
    assert medusa == ref_medusa, (medusa, ref_medusa)
    # generate_batch runs the generation engine; a direct decode call keeps its donated-and-returned cache
    prompt_bt = np.zeros((8, 32), np.int32)
    for i, p in enumerate(prompts):
        prompt_bt[i, : len(p)] = p
    direct, _, _, _ = model.medusa_decode(prompt_bt, np.array([len(p) for p in prompts], np.int32), tree=tree,
                                          cache_size=64, max_new_tokens=MAX_NEW)
    assert direct[:, :MAX_NEW].tolist() == [r[:MAX_NEW] for r in ref_medusa], direct
    cache = model._spare_cache  # the cache the direct call returned: stacked, in its sharding
    assert cache.stacked and cache.k_bkhs.sharding.spec == spec.k_bkhs.spec, cache.k_bkhs.sharding
    shard = cache.k_bkhs.addressable_shards[0].data.shape
    assert shard[:3] == (base.config.num_layers, 4, base.config.num_kv_heads // 4), shard
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
