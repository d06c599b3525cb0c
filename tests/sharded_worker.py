"""Subprocess side of tests/test_sharded_decode.py (run as a script; the device count is set before JAX loads).

    python tests/sharded_worker.py meshes MODEL_DIR OUT.json
        1-device references (api.generate / generate_medusa: a mesh of one device) vs ShardedModel on meshes
        (data, tensor) in (8,1), (2,4), (1,8) on 8 forced CPU devices (and Hydra heads, the EAGLE drafter and
        dynamic trees on (2,4)); loop collectives; mesh errors; batch API order.
    python tests/sharded_worker.py multihost MODEL_DIR OUT.json
        one of 2 processes (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set), 4 CPU devices
        each, mesh data=2 x tensor=4 spanning both: batch generation results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

MODE = sys.argv[1]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +  # the suite's flags (conftest) plus the devices
                           f" --xla_force_host_platform_device_count={8 if MODE == 'meshes' else 4}").strip()

from medusa_jax.scripts import distributed  # noqa: E402

if MODE == "multihost":
    distributed.initialize(distributed.DistributedConfig.from_sources())

import jax  # noqa: E402
import numpy as np  # noqa: E402

from medusa_jax.model.sharding import MeshConfig, MeshError, sharding_for  # noqa: E402
from medusa_jax.hf.load import load_pretrained  # noqa: E402
from medusa_jax.heads.config import HeadsConfig  # noqa: E402
from medusa_jax.heads.init import init_heads  # noqa: E402
from medusa_jax.trees.tree import load_tree  # noqa: E402
from medusa_jax.trees.dynamic_tree import scratch_slots  # noqa: E402
from medusa_jax.inference.acceptance import AcceptanceConfig, DecodeConfig  # noqa: E402
from medusa_jax.inference.api import BatchSettings, generate, generate_batch, generate_medusa  # noqa: E402
from medusa_jax.inference.engine import cache_size_for, pad_prompts  # noqa: E402
from medusa_jax.inference.sampling import SamplingConfig  # noqa: E402
from medusa_jax.inference.sharded import ShardedModel  # noqa: E402
from medusa_jax.training.hlo_collectives import invariant_gathers, loop_collectives  # noqa: E402
from decode_helpers import randomise_kernels  # noqa: E402

MAX_NEW = 20
EXACT = DecodeConfig(SamplingConfig(0.7, top_k=40), AcceptanceConfig("exact"))
BUCKET = 16
NUM_HEADS = 3
DYNAMIC = "dynamic:10,k=3,d=3"


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(1, vocab, size=rng.randint(3, 28)).tolist() for _ in range(n)]


def rows(run) -> list[dict]:
    return [{"tokens": r.token_ids, "steps": r.steps, "accepts": r.accept_lengths} for r in run.results]


def main_meshes(model_dir: str, out: str) -> None:
    base0 = load_pretrained(model_dir)
    heads_cfg = HeadsConfig(base0.config.hidden_size, base0.config.vocab_size, num_heads=NUM_HEADS)
    heads = init_heads(heads_cfg, base0, seed=1)
    tree = load_tree("mc_sim_7b_16", num_heads=NUM_HEADS)
    prompts = make_prompts(8, base0.config.vocab_size, 0)
    # an EOS id that ends some rows early: a token row 3 produces mid-way without EOS
    free = generate(base0, prompts, max_new_tokens=MAX_NEW, eos_ids=())
    eos = (free[3].token_ids[MAX_NEW // 2],)
    ref_plain = generate(base0, prompts, max_new_tokens=MAX_NEW, eos_ids=eos)
    ref_medusa = generate_medusa(base0, heads, prompts, tree=tree, max_new_tokens=MAX_NEW, eos_ids=eos)
    hydra = init_heads(dataclasses.replace(heads_cfg, head_type="hydra"), base0, seed=1)
    for head in hydra.heads:  # random path projections: the drafts depend on the path
        shape = head.input_proj.kernel.shape
        head.input_proj.kernel[...] = jax.numpy.asarray(np.random.RandomState(2).normal(0, 0.3, shape), "float32")
    ref_hydra = generate_medusa(base0, hydra, prompts, tree=tree, max_new_tokens=MAX_NEW, eos_ids=eos)
    eagle = init_heads(dataclasses.replace(heads_cfg, head_type="eagle", lm_head="shared"), base0, seed=1)
    randomise_kernels([eagle.fc] + [getattr(eagle.layers[0].self_attn, n) for n in ("q_proj", "k_proj", "v_proj",
                                                                              "o_proj")], 3)  # varied drafts
    ref_eagle = generate_medusa(base0, eagle, prompts, tree=tree, max_new_tokens=MAX_NEW, eos_ids=eos)
    # EAGLE-3: fused taps of every layer of the 2-layer base, read from the verify forward under the mesh
    eagle3 = init_heads(dataclasses.replace(heads_cfg, head_type="eagle3", lm_head="shared", feature_layers=(0, 1, 2)),
                        base0, seed=1)
    randomise_kernels([eagle3.fc] + [getattr(eagle3.layers[0].self_attn, n) for n in ("q_proj", "k_proj", "v_proj",
                                                                                "o_proj")], 4)
    ref_eagle3 = generate_medusa(base0, eagle3, prompts, tree=tree, max_new_tokens=MAX_NEW, eos_ids=eos)
    dynamic = load_tree(DYNAMIC, num_heads=NUM_HEADS)
    ref_dynamic = {name: generate_medusa(base0, h, prompts, tree=dynamic, max_new_tokens=MAX_NEW, eos_ids=eos)
                   for name, h in (("medusa", heads), ("hydra", hydra))}
    ref_exact = generate_medusa(base0, heads, prompts, tree=tree, max_new_tokens=MAX_NEW, eos_ids=eos,
                                sampling=EXACT.sampling, acceptance=EXACT.acceptance, seed=5)
    report = {"eos": list(eos), "reference": {
        "plain": [{"tokens": r.token_ids, "steps": r.steps} for r in ref_plain],
        "medusa": [{"tokens": r.token_ids, "steps": r.steps, "accepts": r.accept_lengths} for r in ref_medusa],
        "exact": [r.token_ids for r in ref_exact],
        "hydra": [{"tokens": r.token_ids, "steps": r.steps, "accepts": r.accept_lengths} for r in ref_hydra],
        "eagle": [{"tokens": r.token_ids, "steps": r.steps, "accepts": r.accept_lengths} for r in ref_eagle],
        "eagle3": [{"tokens": r.token_ids, "steps": r.steps, "accepts": r.accept_lengths} for r in ref_eagle3],
        **{f"{name}_dynamic": [{"tokens": r.token_ids, "steps": r.steps, "accepts": r.accept_lengths} for r in run]
           for name, run in ref_dynamic.items()}},
        "meshes": {}}
    settings = BatchSettings(batch_size=8, max_new_tokens=MAX_NEW, eos_ids=eos, bucket=BUCKET)
    padded = pad_prompts(prompts, 0, 8, BUCKET)  # the one batch generate_batch makes of them, and its cache sizes
    plain_cache = cache_size_for(padded.tokens_bt.shape[1], MAX_NEW, 0, BUCKET)
    medusa_cache = cache_size_for(padded.tokens_bt.shape[1], MAX_NEW, scratch_slots(tree), BUCKET)
    for data, tensor in ((8, 1), (2, 4), (1, 8)):  # the one-device references are a mesh of one
        mesh = MeshConfig(data=data, tensor=tensor).make_mesh()
        base = load_pretrained(model_dir, sharding_for=sharding_for(mesh))
        model = ShardedModel(base, heads, mesh)
        plain = generate_batch(model, prompts, settings, progress=False)
        medusa = generate_batch(model, prompts, dataclasses.replace(settings, tree=tree), progress=False)
        entry = {"plain": rows(plain), "medusa": rows(medusa),
                 "k_sharding": [list(a) if isinstance(a, tuple) else a
                                for a in model.cache_sharding(8, 64).k_bkhs[0].spec],
                 "q_proj_shards": len(base.layers[0].self_attn.q_proj.kernel[...].addressable_shards)}
        if (data, tensor) == (2, 4):  # Hydra heads, the EAGLE drafter, dynamic trees: the same loop, data x tensor
            for name, drafter in (("hydra", hydra), ("eagle", eagle), ("eagle3", eagle3)):
                entry[name] = rows(generate_batch(ShardedModel(base, drafter, mesh), prompts,
                                                  dataclasses.replace(settings, tree=tree), progress=False))
            for name, h in (("medusa", heads), ("hydra", hydra)):
                entry[f"{name}_dynamic"] = rows(generate_batch(ShardedModel(base, h, mesh), prompts,
                                                               dataclasses.replace(settings, tree=dynamic),
                                                               progress=False))
        if (data, tensor) in ((2, 4), (1, 8)):
            # the programs generate_batch just ran (its padded width, cache sizes and EOS), so that their
            # executables are reused rather than compiled again for the HLO checks
            batch, lens = padded.tokens_bt, padded.lengths_b
            common = dict(max_new_tokens=MAX_NEW, eos_ids=eos, lowered_only=True)
            for name, lowered in (
                    ("plain", model.plain_decode(batch, lens, cache_size=plain_cache, **common)),
                    ("medusa", model.medusa_decode(batch, lens, tree=tree, cache_size=medusa_cache, **common))):
                hlo = lowered.compile().as_text()
                entry[f"{name}_loop_ops"] = sorted({c.op for c in loop_collectives(hlo)})
                entry[f"{name}_invariant_gathers"] = [c.shape for c in invariant_gathers(hlo)]
        if (data, tensor) == (2, 4):  # exact sampling under the mesh: the same draws as on one device
            exact = dataclasses.replace(settings, tree=tree, sampling=EXACT.sampling, acceptance=EXACT.acceptance,
                                        seed=5)
            entry["exact"] = [r.token_ids for r in generate_batch(model, prompts, exact, progress=False).results]
        report["meshes"][f"{data},{tensor}"] = entry

    errors = {}
    for name, make in (("tensor3", lambda: ShardedModel(base0, None, MeshConfig(tensor=3))),
                       ("fsdp3", lambda: ShardedModel(base0, None, MeshConfig(fsdp=3)))):
        try:
            make()
            errors[name] = None
        except MeshError as e:
            errors[name] = str(e)
    report["errors"] = errors
    # a batch that does not divide the mesh's rows is padded with filler rows, not refused: 6 on data=4, and
    # one prompt on data=2 x tensor=4 (plain and Medusa), against one device
    padded = generate_batch(ShardedModel(base0, None, MeshConfig(data=4)), prompts,
                            BatchSettings(batch_size=6, max_new_tokens=MAX_NEW, eos_ids=eos, bucket=BUCKET),
                            progress=False)
    one = ShardedModel(base0, heads, MeshConfig(data=2, tensor=4))
    single = BatchSettings(batch_size=1, max_new_tokens=MAX_NEW, eos_ids=eos, bucket=BUCKET)
    report["padded"] = {
        "batch6_data4": [r.token_ids for r in padded.results],
        "expected6": [r.token_ids for r in generate(base0, prompts, max_new_tokens=MAX_NEW, eos_ids=eos)],
        "one_plain": [r.token_ids for r in generate_batch(one, prompts[:1], single, progress=False).results],
        "one_medusa": [r.token_ids for r in generate_batch(one, prompts[:1], dataclasses.replace(single, tree=tree),
                                                           progress=False).results],
        "expected_plain": [ref_plain[0].token_ids], "expected_medusa": [ref_medusa[0].token_ids]}

    # batch API: 11 ragged prompts, batches of 4 (3 batches, the last padded), on data=2 x tensor=4
    many = make_prompts(11, base0.config.vocab_size, 1)
    model = ShardedModel(base0, heads, MeshConfig(data=2, tensor=4))
    run = generate_batch(model, many, BatchSettings(batch_size=4, max_new_tokens=MAX_NEW, eos_ids=eos,
                                                    bucket=BUCKET), progress=False)
    report["order"] = {
        "indices": [r.index for r in run.results], "prompt_tokens": [r.prompt_tokens for r in run.results],
        "lengths": [len(p) for p in many], "batches": [r.batch for r in run.results],
        "tokens": [r.token_ids for r in run.results],
        "expected": [r.token_ids for r in generate(base0, many, max_new_tokens=MAX_NEW, eos_ids=eos)],
        "num_batches": run.num_batches, "num_shapes": run.num_shapes}
    with open(out, "w") as f:
        json.dump(report, f)


def main_multihost(model_dir: str, out: str) -> None:
    eos = tuple(json.loads(os.environ["SHARDED_TEST_EOS"]))
    base0 = load_pretrained(model_dir)
    heads = init_heads(HeadsConfig(base0.config.hidden_size, base0.config.vocab_size, num_heads=NUM_HEADS),
                       base0, seed=1)
    mesh = MeshConfig(data=2, tensor=4).make_mesh()
    base = load_pretrained(model_dir, sharding_for=sharding_for(mesh))
    model = ShardedModel(base, heads, mesh)
    prompts = make_prompts(8, base0.config.vocab_size, 0)
    settings = BatchSettings(batch_size=8, max_new_tokens=MAX_NEW, eos_ids=eos, bucket=BUCKET)
    plain = generate_batch(model, prompts, settings, progress=False)
    tree = load_tree("mc_sim_7b_16", num_heads=NUM_HEADS)
    medusa = generate_batch(model, prompts, dataclasses.replace(settings, tree=tree), progress=False)
    with open(out, "w") as f:
        json.dump({"process_index": jax.process_index(), "process_count": jax.process_count(),
                   "device_count": jax.device_count(), "local_devices": jax.local_device_count(),
                   "plain": rows(plain), "medusa": rows(medusa)}, f)


if __name__ == "__main__":
    {"meshes": main_meshes, "multihost": main_multihost}[MODE](sys.argv[2], sys.argv[3])
