"""Subprocess side of tests/test_recycle_mesh.py (the device count is set before JAX loads).

    python tests/recycle_mesh_worker.py MODEL_DIR OUT.json
On 8 forced CPU devices: (1) `recycle_update` on row-sharded tokens and vocabulary-sharded logits with a
replicated table, against the same call on one device; (2) Token Recycling greedy decoding of 8 ragged prompts
(an EOS mid-way), two calls in a row (the second from the table the first ended with), on one device and on the
meshes (data, tensor) = (8, 1) and (2, 4): tokens, steps, accept lengths and the tables after each call; then
a third call from the table of the first (`ShardedModel.restore_draft` of a `draft_snapshot` taken before it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from medusa_jax.model.sharding import MeshConfig, sharding_for  # noqa: E402
from medusa_jax.hf.load import load_pretrained  # noqa: E402
from medusa_jax.heads.recycle import RecycleConfig, RecycleDrafter, recycle_update, template_tree  # noqa: E402
from medusa_jax.inference.api import BatchSettings, generate, generate_batch  # noqa: E402
from medusa_jax.inference.sharded import ShardedModel  # noqa: E402

MAX_NEW = 24


def digest(table) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(table, np.int32)).tobytes()).hexdigest()


def update_on_meshes(vocab: int) -> dict:
    rng = np.random.default_rng(0)
    tokens_bt = rng.integers(0, 12, (8, 16)).astype(np.int32)  # few distinct ids: many rows write the same id
    logits_btv = rng.normal(size=(8, 16, vocab)).astype(np.float32)
    active_b = np.asarray([True] * 6 + [False] * 2)
    table = rng.integers(0, vocab, (vocab, 8)).astype(np.int32)
    update = jax.jit(recycle_update)
    one = np.asarray(update(table, tokens_bt, logits_btv, active_b))
    out = {}
    for data, tensor in ((8, 1), (2, 4)):
        mesh = MeshConfig(data=data, tensor=tensor).make_mesh()
        put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
        with jax.set_mesh(mesh):
            got = jax.jit(recycle_update, out_shardings=NamedSharding(mesh, P()))(
                put(table, P()), put(tokens_bt, P("data")), put(logits_btv, P("data", None, "tensor")),
                put(active_b, P("data")))
        shards_equal = all((np.asarray(s.data) == one).all() for s in got.addressable_shards)
        out[f"{data},{tensor}"] = {"equal": bool((np.asarray(got) == one).all()), "every_device": shards_equal}
    return out


def main(model_dir: str, out: str) -> None:
    base0 = load_pretrained(model_dir)
    config = RecycleConfig(base0.config.hidden_size, base0.config.vocab_size)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1, base0.config.vocab_size, size=rng.randint(3, 28)).tolist() for _ in range(8)]
    free = generate(base0, prompts, max_new_tokens=MAX_NEW, eos_ids=())
    eos = (free[3].token_ids[MAX_NEW // 2],)
    plain = [r.token_ids for r in generate(base0, prompts, max_new_tokens=MAX_NEW, eos_ids=eos)]
    settings = BatchSettings(batch_size=8, max_new_tokens=MAX_NEW, eos_ids=eos, bucket=16,
                             tree=template_tree("recycle_16"))
    report = {"plain": plain, "update": update_on_meshes(base0.config.vocab_size), "decode": {}, "restored": {}}
    for data, tensor in ((1, 1), (8, 1), (2, 4)):
        mesh = MeshConfig(data=data, tensor=tensor).make_mesh()
        base = base0 if data * tensor == 1 else load_pretrained(model_dir, sharding_for=sharding_for(mesh))
        drafter = RecycleDrafter(config)
        model = ShardedModel(base, drafter, mesh)
        snapshot = model.draft_snapshot()

        def call():
            run = generate_batch(model, prompts, settings, progress=False)
            return {"tokens": [r.token_ids for r in run.results], "steps": [r.steps for r in run.results],
                    "accepts": [r.accept_lengths for r in run.results], "table": digest(drafter.table),
                    "table_replicated": model.medusa_params["heads"]["recycle_table"][...].sharding
                    .is_fully_replicated}

        report["decode"][f"{data},{tensor}"] = [call(), call()]
        model.restore_draft(snapshot)  # the third call starts from the first one's (empty) table again
        report["restored"][f"{data},{tensor}"] = call()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
