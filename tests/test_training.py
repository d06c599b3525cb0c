"""Training data, losses and the train step (tiny models; fast)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.init import init_heads
from medusa_jax.hf.load import load_pretrained
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.training import data as data_mod, losses
from medusa_jax.training.data import (DataConfig, EpochIterator, PackedRows, load_chat_data, pack, row_batch,
                                      row_iterator, tokenize_messages, top_token_ids)
from medusa_jax.training.teacher_forced import build_hidden_cache
from medusa_jax.training.sharegpt import DataError, read_conversation_file, read_conversations
from medusa_jax.training.trainer import TrainConfig, Trainer, backbone_hidden
from training_helpers import build_tiny_chat_model, chat_records, write_json


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="module")
def tokenizer(chat_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(chat_model)


# ---- reading -------------------------------------------------------------------------------------------

def test_truncated_json_array_keeps_complete_records(tmp_path):
    text = json.dumps(chat_records(3), indent=1)
    cut = text[: text.index('"c2"') + 30]  # inside the third record
    path = tmp_path / "cut.json"
    path.write_text(cut)
    records, report = read_conversation_file(path)
    assert [r["id"] for r in records] == ["c0", "c1"]
    assert report.records == 2 and report.kept == 2 and report.truncated_at_byte is not None
    assert "TRUNCATED" in report.summary() and "kept 2 of 2" in report.summary()


def test_complete_file_is_not_reported_truncated(tmp_path):
    records, report = read_conversation_file(write_json(tmp_path / "ok.json", chat_records(4)))
    assert len(records) == 4 and report.truncated_at_byte is None and "TRUNCATED" not in report.summary()


def test_jsonl_with_half_written_last_line(tmp_path):
    lines = [json.dumps(r) for r in chat_records(3)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines[:2]) + "\n" + lines[2][:25])
    records, report = read_conversation_file(path)
    assert len(records) == 2 and report.truncated_at_byte is not None


def test_broken_record_in_the_middle_is_an_error_naming_it(tmp_path):
    text = json.dumps(chat_records(3), indent=1)
    broken = text.replace('"c1",', '"c1" "oops",', 1)
    (tmp_path / "b.json").write_text(broken)
    with pytest.raises(DataError, match="record 1 is not valid JSON"):
        read_conversation_file(tmp_path / "b.json")


@pytest.mark.parametrize("record, message", [
    ({"id": "x9", "turns": []}, "record 1 \\(id 'x9'\\).*no 'conversations'"),
    ({"id": "x9", "conversations": [{"from": "alien", "value": "hi"}]}, "id 'x9'.*unknown role 'alien'"),
    ({"id": "x9", "conversations": [{"from": "human"}]}, "id 'x9'.*turn 0 needs string"),
    ("just text", "record 1.*expected an object"),
])
def test_malformed_records_name_the_record(tmp_path, record, message):
    path = write_json(tmp_path / "m.json", [chat_records(1)[0], record])
    with pytest.raises(DataError, match=message):
        read_conversation_file(path)


def test_empty_and_reply_less_data_are_errors(tmp_path):
    (tmp_path / "e.json").write_text("  ")
    with pytest.raises(DataError, match="empty"):
        read_conversation_file(tmp_path / "e.json")
    path = write_json(tmp_path / "n.json", [{"id": "a", "conversations": []},
                                            {"id": "b", "conversations": [{"from": "gpt", "value": "orphan"}]}])
    with pytest.raises(DataError, match="no usable conversations"):
        read_conversation_file(path)


def test_packaged_sharegpt_file_is_read_record_by_record():
    records, report = read_conversations("sharegpt")
    assert report.records == 17671 and report.truncated_at_byte is not None
    assert report.kept == len(records) > 17000
    assert all(r["messages"][0]["role"] in ("user", "system") for r in records[:500])


def test_datasets_folder_with_messages_column(tmp_path):
    import datasets

    rows = [{"id": "m0", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    records, report = read_conversations(str(tmp_path / "ds"))
    assert records == [{"id": "m0", "messages": rows[0]["messages"]}] and report.kept == 1


# ---- tokenisation, packing, split, batches -------------------------------------------------------------

def test_loss_mask_covers_exactly_the_assistant_replies(tokenizer):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"},
            {"role": "assistant", "content": "the cat sat"}, {"role": "user", "content": "why"},
            {"role": "assistant", "content": "birds sang songs"}]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids, mask = tokenize_messages(tokenizer, msgs, (eos,))
    assert ids == tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    spans, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    assert [tokenizer.decode(s) for s in spans] == ["the cat sat<|im_end|>", "birds sang songs<|im_end|>"]


def test_pack_keeps_every_conversation_once_with_its_own_positions():
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(3, 300, n).astype(np.int32), (rng.random(n) < 0.5).astype(np.int8))
            for n in rng.integers(1, 40, 30)]
    rows = pack(seqs, 48, pad_id=0)
    found = []
    for r in range(rows.num_rows):
        for s in range(1, rows.segment_ids_bt[r].max() + 1):
            sel = rows.segment_ids_bt[r] == s
            assert (rows.positions_bt[r][sel] == np.arange(sel.sum())).all()
            found.append((tuple(rows.tokens_bt[r][sel]), tuple(rows.loss_mask_bt[r][sel])))
        assert not rows.loss_mask_bt[r][rows.segment_ids_bt[r] == 0].any()
    assert sorted(found) == sorted((tuple(a), tuple(m.astype(bool))) for a, m in seqs)
    assert rows.num_rows <= 1 + sum(len(a) for a, _ in seqs) // 48 + 3  # first-fit packs densely


def test_load_chat_data_split_is_seeded_and_tokenisation_is_cached(tmp_path, tokenizer, monkeypatch):
    path = write_json(tmp_path / "d.json", chat_records(60))
    cfg = DataConfig(seq_len=128, heldout_fraction=0.1, seed=3, cache_dir=str(tmp_path / "cache"))
    eos = (tokenizer.eos_token_id,)
    a = load_chat_data(str(path), tokenizer, eos, cfg, log=lambda _: None)
    assert a.num_conversations == (54, 6)
    monkeypatch.setattr(data_mod, "tokenize_messages", lambda *a, **k: pytest.fail("tokenised again"))
    b = load_chat_data(str(path), tokenizer, eos, cfg, log=lambda _: None)
    np.testing.assert_array_equal(a.train.tokens_bt, b.train.tokens_bt)
    np.testing.assert_array_equal(a.heldout.tokens_bt, b.heldout.tokens_bt)
    def conversations(rows):
        return {tuple(r[s == k]) for r, s in zip(rows.tokens_bt, rows.segment_ids_bt) for k in range(1, s.max() + 1)}

    train_convs, held_convs = conversations(a.train), conversations(a.heldout)
    assert len(held_convs) == 6 and not train_convs & held_convs
    monkeypatch.undo()
    c = load_chat_data(str(path), tokenizer, eos, DataConfig(seq_len=128, heldout_fraction=0.1, seed=4,
                                                             cache_dir=str(tmp_path / "cache")), log=lambda _: None)
    assert not np.array_equal(c.heldout.tokens_bt, a.heldout.tokens_bt)


def test_epoch_iterator_resumes_and_splits_over_processes():
    rows = pack([(np.full(10, i, np.int32), np.ones(10, np.int8)) for i in range(40)], 10, 0)
    full = row_iterator(rows, 8, seed=1)
    seen = [next(full)["tokens"][:, 0].tolist() for _ in range(7)]  # crosses an epoch (5 batches)
    assert sorted(sum(seen[:5], [])) == list(range(40)) and seen[5] != seen[0]
    resumed = row_iterator(rows, 8, seed=1, epoch=1, index=0)
    assert next(resumed)["tokens"][:, 0].tolist() == seen[5]
    halves = [EpochIterator(40, lambda i: row_batch(rows.rows(i)), 8, 1, process_index=p, process_count=2)
              for p in (0, 1)]
    first = [next(h)["tokens"][:, 0].tolist() for h in halves]
    assert sorted(first[0] + first[1]) == sorted(seen[0]) and len(first[0]) == 4


def test_top_token_ids_are_the_most_frequent_loss_tokens():
    tokens = np.array([1, 5, 5, 5, 7, 7, 9, 1, 1], np.int32)
    rows = pack([(tokens, np.array([0, 1, 1, 1, 1, 1, 1, 0, 0], np.int8))], 9, 0)
    assert top_token_ids(rows.tokens_bt[rows.loss_mask_bt], 2, 16).tolist() == [5, 7]


# ---- losses against NumPy -----------------------------------------------------------------------------

def _np_targets(tokens, mask, seg, offset):
    b, t = tokens.shape
    out = np.full((b, t), -1)
    for i in range(b):
        for j in range(t - offset):
            if mask[i, j + offset] and seg[i, j + offset] == seg[i, j] and seg[i, j] > 0:
                out[i, j] = tokens[i, j + offset]
    return out


def test_head_targets_match_a_loop():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50, (3, 12))
    mask = rng.random((3, 12)) < 0.6
    seg = np.sort(rng.integers(0, 3, (3, 12)), axis=1)
    got = np.asarray(losses.head_targets(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(seg), 3))
    for k in range(3):
        np.testing.assert_array_equal(got[k], _np_targets(tokens, mask, seg, 2 + k))


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("truncated", [False, True])
def test_head_stats_and_loss_match_numpy(truncated):
    rng = np.random.default_rng(2)
    k, n, vocab = 3, 40, 30
    token_map = np.array([0, 3, 4, 8, 9, 12, 20, 29]) if truncated else None
    width = len(token_map) if truncated else vocab
    logits = rng.normal(size=(k, n, width)).astype(np.float32)
    targets = rng.integers(-1, vocab, (k, n))
    inverse = None if not truncated else losses.inverse_token_map(jnp.asarray(token_map), vocab)
    stats = losses.head_stats(jnp.asarray(logits), jnp.asarray(targets), inverse)
    for h in range(k):
        valid = targets[h] >= 0
        lut = {int(t): j for j, t in enumerate(token_map)} if truncated else {t: t for t in range(vocab)}
        idx = np.array([lut.get(int(t), -1) if v else -1 for t, v in zip(targets[h], valid)])
        inv = idx >= 0
        lsm = _np_log_softmax(logits[h].astype(np.float64))
        ce = -lsm[np.arange(n)[inv], idx[inv]]
        order = np.argsort(-logits[h], axis=-1)
        top1 = (order[:, 0] == idx) & inv
        top5 = np.array([idx[i] in order[i, :5] for i in range(n)]) & inv
        np.testing.assert_allclose(stats.loss_sum[h], ce.sum(), rtol=1e-5)
        assert stats.count[h] == inv.sum() and stats.total[h] == valid.sum()
        assert stats.top1[h] == top1.sum() and stats.top5[h] == top5.sum()
    means = [float(stats.loss_sum[h] / stats.count[h]) for h in range(k)]
    expected = sum(0.8 ** h * m for h, m in enumerate(means))
    np.testing.assert_allclose(losses.medusa_loss(stats, 0.8), expected, rtol=1e-6)
    if truncated:  # targets outside the map count as misses: accuracy denominators include them
        assert (stats.total > stats.count).all()


def test_kl_to_reference_matches_numpy():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(2, 5, 11)), rng.normal(size=(2, 5, 11))
    valid = rng.random((2, 5)) < 0.7
    total, count = losses.kl_to_reference(jnp.asarray(a), jnp.asarray(b), jnp.asarray(valid))
    p_ref = np.exp(_np_log_softmax(b))
    kl = (p_ref * (_np_log_softmax(b) - _np_log_softmax(a))).sum(-1)
    np.testing.assert_allclose(total, kl[valid].sum(), rtol=1e-5)
    assert count == valid.sum()


def test_distill_loss_matches_numpy_and_renormalises_over_a_token_map():
    rng = np.random.default_rng(4)
    teacher_full = rng.normal(size=(6, 20)) * 2
    token_map = np.array([1, 4, 5, 9, 13])
    student = rng.normal(size=(6, 5))
    mask = np.array([1, 1, 0, 1, 0, 1], bool)
    total, count = losses.distill_loss(jnp.asarray(student), jnp.asarray(teacher_full[:, token_map]),
                                       jnp.asarray(mask))
    p_full = np.exp(_np_log_softmax(teacher_full))
    p_map = p_full[:, token_map] / p_full[:, token_map].sum(-1, keepdims=True)  # the mass outside renormalised away
    kl = (p_map * (np.log(p_map) - _np_log_softmax(student))).sum(-1)
    np.testing.assert_allclose(total, kl[mask].sum(), rtol=1e-5)
    assert count == mask.sum()
    grad = jax.grad(lambda t: losses.distill_loss(jnp.asarray(student), t, jnp.asarray(mask))[0])(
        jnp.asarray(teacher_full[:, token_map]))
    assert not np.asarray(grad).any()  # the teacher gets no gradient


# ---- the train step -----------------------------------------------------------------------------------

def _tiny_batch(vocab, b=4, t=24, seed=0):
    rng = np.random.default_rng(seed)
    seg = np.repeat([[1] * 10 + [2] * (t - 10)], b, axis=0).astype(np.int32)
    return {"tokens": rng.integers(0, vocab, (b, t)).astype(np.int32), "segment_ids": seg,
            "positions": np.where(seg == 1, np.arange(t), np.arange(t) - 10).astype(np.int32),
            "loss_mask": rng.random((b, t)) < 0.7}


def _trainer(chat_model, lm_head="own", **train):
    base = load_pretrained(chat_model)
    cfg = base.config
    trunc = 32 if lm_head == "truncated" else None
    heads = init_heads(HeadsConfig(cfg.hidden_size, cfg.vocab_size, num_heads=3, lm_head=lm_head,
                                   truncated_vocab_size=trunc), base, seed=0,
                       token_map=np.arange(0, 64, 2) if trunc else None)
    train = {"warmup_steps": 0, "max_steps": 1000, **train}
    return base, heads, Trainer(base, heads, TrainConfig(**train), MeshConfig().make_mesh())


def _flat(tree):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(jax.device_get(tree))])


def test_medusa1_freezes_the_backbone_and_medusa2_trains_it_with_a_head_lr_multiplier(chat_model):
    base, heads, t1 = _trainer(chat_model)
    before_base, before_heads = _flat(nnx.state(base)), _flat(nnx.state(heads, nnx.Param))
    t1.train_step(_tiny_batch(base.config.vocab_size))
    np.testing.assert_array_equal(_flat(nnx.state(t1.base())), before_base)
    assert np.abs(_flat(nnx.state(t1.heads(), nnx.Param)) - before_heads).max() > 1e-4
    np.testing.assert_array_equal(_flat(nnx.state(heads, nnx.Param)), before_heads)  # caller's heads untouched

    _, _, t2 = _trainer(chat_model, medusa2=True, learning_rate=1e-4, head_lr_multiplier=4.0)
    m = t2.train_step(_tiny_batch(base.config.vocab_size))
    assert np.isfinite(m["base_loss"])
    base_step = np.abs(_flat(nnx.state(t2.base())) - before_base).max()
    head_step = np.abs(_flat(nnx.state(t2.heads(), nnx.Param)) - before_heads).max()
    # Adam's first step moves each weight by about its learning rate
    assert base_step == pytest.approx(1e-4, rel=0.05) and head_step == pytest.approx(4e-4, rel=0.05)


def test_training_drives_the_loss_down(chat_model):
    base, _, trainer = _trainer(chat_model, lm_head="truncated", learning_rate=1e-2)
    batch = _tiny_batch(base.config.vocab_size, seed=1)
    losses_seen = [float(trainer.train_step(batch)["loss"]) for _ in range(15)]
    assert losses_seen[-1] < 0.8 * losses_seen[0]


@pytest.mark.parametrize("lm_head", ["own", "shared", "truncated"])
def test_cached_hidden_states_give_the_same_statistics_as_the_backbone_in_the_step(chat_model, tmp_path, lm_head):
    base, _, trainer = _trainer(chat_model, lm_head=lm_head, head_loss="ce+kl")
    batch = _tiny_batch(base.config.vocab_size, b=4, seed=2)
    direct, _ = trainer.eval_stats(batch)
    rows = PackedRows(batch["tokens"], batch["segment_ids"], batch["positions"], batch["loss_mask"])
    examples = build_hidden_cache(base, rows, 3, tmp_path, batch_rows=2).examples()
    assert build_hidden_cache(base, rows, 3, tmp_path).folder == cache_folder(tmp_path)  # reused, not rebuilt
    cached, _ = trainer.eval_stats(examples.batch(np.arange(len(examples)), teacher=True))
    np.testing.assert_array_equal(cached.total, direct.total)
    np.testing.assert_array_equal(cached.count, direct.count)
    np.testing.assert_array_equal(cached.kl_count, direct.total)
    np.testing.assert_allclose(cached.loss_sum, direct.loss_sum, rtol=2e-3)  # float16 storage
    np.testing.assert_allclose(cached.kl_sum, direct.kl_sum, rtol=2e-3, atol=1e-3)
    assert (direct.kl_sum > 0).all()


@pytest.mark.parametrize("lm_head", ["own", "shared", "truncated"])
def test_distilled_head_loss_in_the_step_matches_numpy(chat_model, lm_head):
    """ce+kl: head i at t against the base's own distribution at t + 1 + i (truncated: over the token_map,
    renormalised), masked where the CE target is; weights and the decay as documented."""
    base, heads, trainer = _trainer(chat_model, lm_head=lm_head, head_loss="ce+kl", ce_weight=0.5, kl_weight=2.0)
    batch = _tiny_batch(base.config.vocab_size, b=3, seed=5)
    hidden = backbone_hidden(base, {k: jnp.asarray(v) for k, v in batch.items()})
    student = np.asarray(heads.logits(hidden, base), np.float64)  # [K, B, T, V_head]
    teacher = np.asarray(base.logits(hidden), np.float64)  # [B, T, V]
    token_map = None if heads.token_map is None else np.asarray(heads.token_map[...])
    if token_map is not None:
        teacher = teacher[..., token_map]
    expected, kl_sums = 0.0, []
    for i in range(3):
        tgt = _np_targets(batch["tokens"], batch["loss_mask"], batch["segment_ids"], 2 + i)
        valid = tgt >= 0
        logq = _np_log_softmax(student[i])
        logp = _np_log_softmax(np.concatenate([teacher[:, 1 + i:], np.zeros_like(teacher[:, :1 + i])], axis=1))
        kl = (np.exp(logp) * (logp - logq)).sum(-1)[valid]
        col = tgt if token_map is None else np.vectorize(
            lambda t: int(np.searchsorted(token_map, t)) if t in token_map else -1)(tgt)
        inside = col >= 0
        ce = -np.take_along_axis(logq, np.maximum(col, 0)[..., None], -1)[..., 0][inside]
        expected += 0.8 ** i * (0.5 * ce.mean() + 2.0 * kl.mean())
        kl_sums.append(kl.sum())
    stats, _ = trainer.eval_stats(batch)
    np.testing.assert_allclose(stats.kl_sum, kl_sums, rtol=1e-4)
    metrics = trainer.train_step(batch)  # the loss of the parameters before the update
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-4)
    assert len(metrics["stats"].summary()["head_kl"]) == 3


def cache_folder(root):
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    return folder


def test_frozen_lm_heads_keep_their_initial_rows_while_resblocks_train(chat_model):
    _, heads, trainer = _trainer(chat_model, lm_head="truncated", freeze_head_lm_heads=True)
    trainer.train_step(_tiny_batch(trainer.base().config.vocab_size))
    trained = trainer.heads()
    for before, after in zip(heads.heads, trained.heads):
        np.testing.assert_array_equal(after.lm_head.kernel[...], before.lm_head.kernel[...])
        assert np.abs(np.asarray(after.blocks[0].linear.kernel[...])).max() > 0  # zero-initialised, now moved
    assert "lm_head" not in str(jax.tree_util.tree_structure(trainer.params["heads"]))
