"""Self-distillation on a tiny chat model: ShareGPT output, resume, the Arrow store of hidden states -> training
examples; the retired first npz format is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.hf.load import load_pretrained
from medusa_jax.training import hidden_store
from medusa_jax.training.hidden_store import StoreWriter, open_store
from medusa_jax.training.self_distill import DistillConfig, done_ids, self_distill, shard_output
from medusa_jax.training.sharegpt import DataError, read_conversation_file
from medusa_jax.training.sources import CachedHidden, ChatConversations, StoreHidden, open_source
from medusa_jax.training.objectives import backbone_hidden
from training_helpers import build_tiny_chat_model, chat_records, write_json


def test_self_distill_writes_sharegpt_resumes_and_keeps_hidden_states(tmp_path):
    from transformers import AutoTokenizer

    model = build_tiny_chat_model(tmp_path / "m")
    source = write_json(tmp_path / "src.json", chat_records(12, seed=2, turns=2))
    out = tmp_path / "distill.jsonl"
    cfg = DistillConfig(max_new_tokens=6, batch_size=4, turns=2, limit=5, save_hidden=True)
    first = self_distill(model, str(source), out, cfg, progress=False, log=lambda _: None)
    assert first["conversations"] == 5 and len(done_ids(out)) == 5
    with open(out, "a") as f:  # a run killed in the middle of writing a line
        f.write('{"id": "half')
    second = self_distill(model, str(source), out, DistillConfig(**{**cfg.__dict__, "limit": 8}), progress=False,
                          log=lambda _: None)
    assert second["conversations"] == 3
    records, report = read_conversation_file(out)
    assert report.truncated_at_byte is None and len({r["id"] for r in records}) == 8 == len(records)
    src = {r["id"]: r for r in json.loads(source.read_text())}
    conv = json.loads(out.read_text().splitlines()[0])["conversations"]
    for r in records:  # the human turns are the source's, the replies are regenerated
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        assert [m["content"] for m in r["messages"][::2]] == [t["value"] for t in src[r["id"]]["conversations"][::2]]
    assert conv[0]["from"] == "human" and conv[1]["from"] == "gpt"

    store = hidden_store.store_path(out)
    ds = hidden_store.open_dataset(store)
    assert len(ds) == 16 and sorted(set(ds["id"])) == sorted(r["id"] for r in records)  # 8 conversations x 2 turns
    ex = hidden_store.open_store(store).examples(num_heads=2)
    train, held, n_train, n_held = ex.split(0.25, seed=0)
    assert (n_train, n_held) == (6, 2) and not set(train.groups_x) & set(held.groups_x)
    assert not ex.hidden.chunks[0].flags.owndata  # a view of the memory-mapped Arrow buffer, not a copy
    # each row is the exact sequence the model saw, and its hidden states are the backbone's at the positions
    # that produced the reply tokens: recompute them with a full forward
    base = load_pretrained(model)
    tok = AutoTokenizer.from_pretrained(model)
    by_id = {r["id"]: r for r in records}
    for row in ds.select([0, 5, 11]):
        rec, turn = by_id[row["id"]], row["turn"]
        prompt = tok.apply_chat_template(rec["messages"][: 2 * turn + 1], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        full, mask = row["input_ids"], np.asarray(row["loss_mask"])
        assert full[: len(prompt)] == list(prompt) and not mask[: len(prompt)].any() and mask[len(prompt):].all()
        h = backbone_hidden(base, {"tokens": jnp.asarray([full]), "positions": jnp.arange(len(full))[None],
                                   "segment_ids": jnp.ones((1, len(full)), jnp.int32)})[0]
        np.testing.assert_allclose(np.asarray(row["hidden"], np.float32), np.asarray(h[len(prompt) - 1: -1]),
                                   atol=2e-2)


def test_sampled_replies_depend_on_their_conversation_not_on_the_batch(tmp_path):
    """At a temperature, each reply draws with its own seed (the run's seed, the conversation's id and the
    turn): batch sizes 1 and 3 write the same conversations, and they are not the greedy ones."""
    model = build_tiny_chat_model(tmp_path / "m")
    source = write_json(tmp_path / "src.json", chat_records(6, seed=8, turns=2))
    texts = {}
    for name, batch_size, temperature in (("one", 1, 1.0), ("three", 3, 1.0), ("greedy", 3, 0.0)):
        out = tmp_path / f"{name}.jsonl"
        self_distill(model, str(source), out, DistillConfig(max_new_tokens=6, batch_size=batch_size, turns=2,
                                                            temperature=temperature, seed=3),
                     progress=False, log=lambda _: None)
        texts[name] = sorted(out.read_text().splitlines())
    assert len(texts["one"]) == 6 and texts["one"] == texts["three"] != texts["greedy"]


def test_resume_drops_a_shard_whose_conversations_never_reached_the_jsonl(tmp_path):
    model = build_tiny_chat_model(tmp_path / "m")
    source = write_json(tmp_path / "src.json", chat_records(10, seed=4))
    out = tmp_path / "d.jsonl"
    cfg = DistillConfig(max_new_tokens=5, batch_size=2, limit=4, save_hidden=True)
    self_distill(model, str(source), out, cfg, progress=False, log=lambda _: None)
    writer = hidden_store.StoreWriter(hidden_store.store_path(out), 64)
    h = np.zeros((2, 64), np.float16)
    writer.append([("zz-orphan", 0, [1, 2], [3, 4], h)])  # written, then the run died before the JSONL
    messages = []
    self_distill(model, str(source), out, DistillConfig(**{**cfg.__dict__, "limit": 6}), progress=False,
                 log=messages.append)
    assert any("dropped 1 shard" in m for m in messages)
    ids = hidden_store.open_dataset(writer.folder)["id"]
    assert sorted(ids) == sorted(done_ids(out)) and len(ids) == 6


def test_the_retired_npz_format_is_refused_with_how_to_regenerate_it(tmp_path):
    """Hidden states of the first format (OUTPUT.hidden/batch-*.npz) are no longer read: training from them and
    resuming self-distillation into such an output stop with one line that says how to rebuild them."""
    out = tmp_path / "d.jsonl"
    out.write_text(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "q"},
                                                            {"from": "gpt", "value": "a"}]}) + "\n")
    old = tmp_path / "d.jsonl.hidden"
    old.mkdir()
    np.savez(old / "batch-a.npz", ids=np.asarray(["a"]))
    for data, cache_hidden in ((str(old), True), (str(old), False), (str(out), True)):
        with pytest.raises(DataError) as e:
            open_source(data, cache_hidden)
        assert "\n" not in str(e.value) and "self_distill.py --save-hidden" in str(e.value) and "npz" in str(e.value)
    assert open_source(str(out), False) == ChatConversations(str(out))  # the JSONL's conversations still train
    hidden_store.StoreWriter(hidden_store.store_path(out), 8)
    assert open_source(str(out), True) == StoreHidden(hidden_store.store_path(out))  # a store wins
    assert open_source("sharegpt", True) == CachedHidden(ChatConversations("sharegpt"))

    model = build_tiny_chat_model(tmp_path / "m")
    source = write_json(tmp_path / "src.json", chat_records(4, seed=5))
    with pytest.raises(DataError, match="first self-distillation format"):
        self_distill(model, str(source), out, DistillConfig(max_new_tokens=4, batch_size=2, save_hidden=True),
                     progress=False, log=lambda _: None)


MESH_CHILD = """
import json, os, sys
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
import jax, numpy as np
from medusa_jax.training import hidden_store
from medusa_jax.training.self_distill import DistillConfig, self_distill

assert len(jax.devices()) == 8
model, source, root = sys.argv[1:4]
out = {}
for mesh in ("", "data=4", "data=2,tensor=2"):
    path = os.path.join(root, (mesh or "single").replace("=", "").replace(",", "_") + ".jsonl")
    cfg = DistillConfig(max_new_tokens=8, batch_size=4, limit=6, save_hidden=True, mesh=mesh)
    self_distill(model, source, path, cfg, progress=False, log=lambda _: None)
    ds = hidden_store.open_dataset(hidden_store.store_path(path))
    rows = sorted(ds, key=lambda r: r["id"])
    out[mesh] = {"text": sorted(open(path).read().splitlines()),
                 "tokens": [r["input_ids"] for r in rows], "hidden": [np.asarray(r["hidden"]).tolist() for r in rows]}
print("RESULT" + json.dumps(out))
"""


def test_slots_over_a_device_mesh_and_processes_over_shards_generate_the_same_data(tmp_path):
    """--mesh splits the decode slots over 8 forced CPU devices; --num-shards splits the conversations over
    processes: both produce the single-device run's conversations and hidden states."""
    model = build_tiny_chat_model(tmp_path / "m")
    source = write_json(tmp_path / "src.json", chat_records(12, seed=6))
    proc = subprocess.run([sys.executable, "-c", MESH_CHILD, str(model), str(source), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=str(Path(__file__).parent),
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    single = result[""]
    assert len(single["text"]) == 6
    for mesh in ("data=4", "data=2,tensor=2"):
        assert result[mesh]["text"] == single["text"] and result[mesh]["tokens"] == single["tokens"], mesh
        for a, b in zip(result[mesh]["hidden"], single["hidden"]):
            np.testing.assert_allclose(a, b, atol=2e-3)

    merged = []
    for i in range(2):
        out = shard_output(tmp_path / "sharded.jsonl", i, 2)
        assert out.name == f"sharded.shard-{i}-of-2.jsonl"
        stats = self_distill(model, str(source), out, DistillConfig(max_new_tokens=8, batch_size=4, limit=6,
                                                                    num_shards=2, shard_index=i),
                             progress=False, log=lambda _: None)
        assert stats["conversations"] == 3
        merged += out.read_text().splitlines()
    assert sorted(merged) == single["text"]


def test_store_examples_match_a_loop(tmp_path):
    """Example j of a reply: head i's target is token j + 1 + i and its teacher the hidden row of that token,
    within the reply; with paths (Hydra heads) head i's path is tokens j .. j + i (no model needed)."""
    rng = np.random.default_rng(7)
    replies = [(f"r{i}", 0, [1, 2, 3], rng.integers(0, 90, n).tolist(), rng.normal(size=(n, 6)).astype(np.float16))
               for i, n in enumerate([1, 4, 9, 2])]
    writer = hidden_store.StoreWriter(tmp_path / "s", 6)
    writer.append(replies[:3])
    writer.append(replies[3:])
    ex = hidden_store.open_store(tmp_path / "s").examples(num_heads=3, with_path=True)
    batch = ex.batch(np.arange(len(ex)), teacher=True)
    expected_targets, expected_teacher, expected_hidden, expected_path = [], [], [], []
    for _, _, _, tokens, hidden in replies:
        for j in range(len(tokens) - 1):
            expected_hidden.append(hidden[j])
            expected_targets.append([tokens[j + 1 + i] if j + 1 + i < len(tokens) else -1 for i in range(3)])
            expected_teacher.append([hidden[j + 1 + i] if j + 1 + i < len(tokens) else hidden[j] for i in range(3)])
            expected_path.append([tokens[j + i] if j + i < len(tokens) else 0 for i in range(3)])
    np.testing.assert_array_equal(batch["targets"], expected_targets)
    np.testing.assert_array_equal(batch["hidden"], expected_hidden)
    np.testing.assert_array_equal(batch["teacher_hidden"], expected_teacher)
    np.testing.assert_array_equal(batch["path"], expected_path)


def test_an_empty_store_is_a_clear_data_error(tmp_path):
    StoreWriter(tmp_path / "d.jsonl.arrow", hidden_size=8)  # created by a run that has written no shard yet
    with pytest.raises(DataError, match="no replies yet"):
        open_store(tmp_path / "d.jsonl.arrow").examples(num_heads=2)
