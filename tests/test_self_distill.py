"""Self-distillation on a tiny chat model: ShareGPT output, resume, the Arrow store of hidden states -> training
examples; the retired first npz format is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.api import generate
from medusa_jax.inference.refill import Slots, _admit_cost, admission_groups, admit, admit_prompts, run_chunk
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.training import hidden_store
from medusa_jax.training.hidden_store import StoreWriter, open_store
from medusa_jax.training.self_distill import DistillConfig, done_ids, self_distill, shard_output
from medusa_jax.training.sharegpt import DataError, read_conversation_file
from medusa_jax.training.sources import CachedHidden, ChatConversations, StoreHidden, open_source
from medusa_jax.training.trainer import backbone_hidden
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


def test_refilled_slots_generate_what_the_engine_generates(tmp_path):
    """Prompts admitted into free slots mid-run (next to rows still decoding) get the engine's greedy tokens,
    and each token comes with the hidden state that produced it."""
    base = load_pretrained(build_tiny_chat_model(tmp_path / "m", seed=3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 17, 9, 30, 3)]
    expected = [r.token_ids for r in generate(base, prompts, max_new_tokens=20, eos_ids=(), pad_id=0)]
    graphdef, params = nnx.split(base)
    slots = Slots.empty(base.config, 2, 64)
    got = {i: ([], []) for i in range(len(prompts))}
    queue, rows = list(range(len(prompts))), [None, None]
    greedy = SamplingConfig()
    while queue or any(r is not None for r in rows):
        free = [r for r in range(2) if rows[r] is None]
        take = [(r, queue.pop(0)) for r in free if queue]
        if take:
            width = max(len(prompts[i]) for _, i in take)
            p = np.zeros((len(take), width), np.int32)
            for j, (_, i) in enumerate(take):
                p[j, : len(prompts[i])] = prompts[i]
            slots, first, h0 = admit(graphdef, params, slots, jnp.asarray([r for r, _ in take]), jnp.asarray(p),
                                     jnp.asarray([len(prompts[i]) for _, i in take]), jax.random.key(0),
                                     sampling=greedy, eos_ids=())
            for j, (r, i) in enumerate(take):
                rows[r] = i
                got[i][0].append(int(first[j]))
                got[i][1].append(np.asarray(h0[j: j + 1]))
        slots, toks, hid, emitted = run_chunk(graphdef, params, slots, jax.random.key(1), steps=7,
                                              max_new_tokens=20, sampling=greedy, eos_ids=(), pad_id=0)
        for r, i in enumerate(rows):
            if i is None:
                continue
            e = int(emitted[r])
            got[i][0].extend(np.asarray(toks[r, :e]).tolist())
            got[i][1].append(np.asarray(hid[r, :e]))
            if len(got[i][0]) >= 20:
                rows[r] = None
    for i, prompt in enumerate(prompts):
        assert got[i][0] == expected[i], i
        full = prompt + got[i][0]
        h = backbone_hidden(base, {"tokens": jnp.asarray([full]), "positions": jnp.arange(len(full))[None],
                                   "segment_ids": jnp.ones((1, len(full)), jnp.int32)})[0]
        np.testing.assert_allclose(np.concatenate(got[i][1]), np.asarray(h[len(prompt) - 1: len(full) - 1]),
                                   rtol=1e-4, atol=1e-4)


def test_admission_groups_cut_prompts_by_length():
    """A 5-token prompt is not padded to the width of a 380-token one: admission splits by length, covers
    every prompt once, never costs more than one call, and keeps similar prompts in one call."""
    lengths = [60, 380, 62, 370, 5]
    groups = admission_groups(lengths, 64)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [sorted(g) for g in groups] == [[4], [0, 1, 2, 3]]  # rows come in buckets of >= 4: 5 waits alone
    assert admission_groups([60, 380, 62, 370, 5, 58, 375, 61], 64) == [[4, 5, 0, 7], [2, 3, 6, 1]]
    assert sum(_admit_cost(len(g), max(lengths[i] for i in g), 64) for g in groups) < _admit_cost(5, 380, 64)
    assert admission_groups([100] * 9, 64) == [list(range(9))]
    assert all(len(g) <= 4 for g in admission_groups(list(range(10, 210, 20)), 4))
    assert admission_groups([], 8) == []


def test_grouped_admission_matches_admitting_each_prompt_alone(tmp_path):
    base = load_pretrained(build_tiny_chat_model(tmp_path / "m", seed=3))
    graphdef, params = nnx.split(base)
    rng = np.random.default_rng(1)
    lengths = (5, 250, 7, 240, 6, 245, 9, 230)
    prompts = [rng.integers(3, 300, n).tolist() for n in lengths]
    assert len(admission_groups(list(lengths), 8)) == 2
    rows = [7, 0, 5, 2, 1, 3, 6, 4]
    kw = dict(pad_id=0, sampling=SamplingConfig(), eos_ids=())
    slots, first, hidden = admit_prompts(graphdef, params, Slots.empty(base.config, 8, 256), rows, prompts,
                                         jax.random.key(0), **kw)
    np.testing.assert_array_equal(np.asarray(slots.cache.lengths_b)[rows], lengths)
    for j in (0, 1, 6):
        row = rows[j]
        alone, f1, h1 = admit_prompts(graphdef, params, Slots.empty(base.config, 8, 256), [row], [prompts[j]],
                                      jax.random.key(0), **kw)
        assert first[j] == f1[0]
        np.testing.assert_allclose(hidden[j], h1[0], rtol=1e-4, atol=1e-5)
        n = len(prompts[j])
        np.testing.assert_allclose(np.asarray(slots.cache.k_bkhs[0][row, :, :, :n]),
                                   np.asarray(alone.cache.k_bkhs[0][row, :, :, :n]), rtol=1e-4, atol=1e-5)


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
