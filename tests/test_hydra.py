"""Hydra heads: each tree node's children are drafted from its own path; fresh heads equal Medusa heads; our
format saves and loads them and the PyTorch export refuses them; teacher-forcing inputs match the data; a
tiny training run (packed rows and cached hidden states) lowers the loss and resumes exactly.
(Greedy losslessness with Hydra heads: the head_type-parametrised tests in test_medusa.py.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from medusa_jax.hf.load import load_pretrained
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.export import ExportError, export_heads
from medusa_jax.heads.folder import heads_tensors, load_native_heads, save_heads
from medusa_jax.heads.hydra import HydraHeads, path_tokens
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.load import load_heads
from medusa_jax.trees.tree import load_tree
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.policy import step_cost as whole_step
from medusa_jax.training import trainer as trainer_mod
from medusa_jax.training.hidden_examples import HiddenRows, reply_examples
from medusa_jax.training.chunked_loss import hydra_head_stats
from medusa_jax.training.losses import distill_loss, head_targets
from medusa_jax.training.objectives import backbone_hidden
from medusa_jax.training.trainer import TrainConfig, Trainer
from medusa_jax.bench import step_cost
from medusa_jax.trees.search.head_accuracy import measure_head_accuracy

from decode_helpers import randomise_kernels
from training_helpers import build_tiny_chat_model, chat_records, write_json


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return load_pretrained(tiny_model_dir("llama", initializer_range=0.3))


def hydra(base, seed=0, **kw) -> HydraHeads:
    heads = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=3, head_type="hydra",
                                   **kw), base, seed=seed)
    linears = [lin for head in heads.heads for lin in [head.input_proj] + [b.linear for b in head.blocks]]
    randomise_kernels(linears, seed)
    return heads


@pytest.mark.parametrize("hydra_input", ["add", "concat"])
def test_each_node_is_drafted_from_its_own_path(base, hydra_input):
    heads = hydra(base, hydra_input=hydra_input)
    tree = load_tree("mc_sim_7b_32")
    hidden_bd = jnp.asarray(np.random.RandomState(1).normal(size=(2, base.config.hidden_size)), jnp.float32)
    root_b = jnp.asarray([5, 77], jnp.int32)
    tokens_bt = np.asarray(jax.jit(lambda h, r: heads.tree_tokens(h, r, base, tree))(hidden_bd, root_b))
    node_of = {p: i + 1 for i, p in enumerate(tree.paths)}
    assert (tokens_bt[:, 0] == [5, 77]).all()
    for path, t in node_of.items():
        parents = [0] + [node_of[path[:k]] for k in range(1, len(path))]
        for b in range(2):  # the reference: head len(path)-1 on exactly this node's path, one node at a time
            logits = heads.head_logits(len(path) - 1, hidden_bd[b], jnp.asarray(tokens_bt[b, parents]), base)
            assert tokens_bt[b, t] == int(jnp.argsort(-logits)[path[-1]]), (path, b)
    # the children of different parents differ: they really depend on the path
    under = {a: [tokens_bt[b, t] for (p, t) in node_of.items() for b in range(2) if p[:-1] == (a,) and p[-1] < 2]
             for a in (0, 1)}
    assert len(under[0]) == len(under[1]) == 4 and under[0] != under[1]


def test_fresh_hydra_heads_are_medusa_heads(base):
    """Both input combinations start by ignoring the embeddings, so training starts from Medusa heads."""
    medusa = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=3), base)
    hidden_d = jnp.asarray(np.random.RandomState(2).normal(size=base.config.hidden_size), jnp.float32)
    expect_kv = medusa.logits(hidden_d, base)
    for hydra_input in ("add", "concat"):
        fresh = init_heads(HeadsConfig(base.config.hidden_size, base.config.vocab_size, num_heads=3,
                                       head_type="hydra", hydra_input=hydra_input), base)
        for i in range(3):
            got = fresh.head_logits(i, hidden_d, jnp.arange(i + 1) + 7, base)
            np.testing.assert_allclose(got, expect_kv[i], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lm_head", ["own", "truncated"])
def test_our_format_round_trips_and_pytorch_export_refuses(base, tmp_path, lm_head, capsys):
    kw = {"truncated_vocab_size": 40} if lm_head == "truncated" else {}
    heads = hydra(base, seed=4, lm_head=lm_head, hydra_input="concat", **kw)
    save_heads(heads, tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    assert raw["medusa_jax"]["head_type"] == "hydra" and "medusa_num_heads" not in raw
    loaded = load_heads(tmp_path / "h", base_config=base.config)
    assert isinstance(loaded, HydraHeads) and loaded.config == heads.config
    a, b = heads_tensors(heads), heads_tensors(loaded)
    assert sorted(a) == sorted(b) and "heads.2.input_proj.kernel" in a
    assert all(np.array_equal(a[k], b[k]) for k in a)

    with pytest.raises(ExportError, match="hydra heads .* cannot be exported"):
        export_heads(loaded, tmp_path / "out")
    from scripts_export import main
    assert main(["--heads", str(tmp_path / "h"), "--out", str(tmp_path / "out2")]) == 2
    assert "error: these are hydra heads" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


def test_teacher_forcing_paths_of_rows_and_of_self_distilled_replies_agree():
    tokens = np.arange(10, 20, dtype=np.int32)
    path = path_tokens(tokens[None], 3)[0]  # position t: tokens t + 1, t + 2, t + 3 (0 past the end)
    assert path[0].tolist() == [11, 12, 13] and path[8].tolist() == [19, 0, 0]
    # a reply's h_j produced token j: its path starts at token j (the root), and matches the row's path at j - 1
    # (two replies back to back: the second's paths never reach into the first)
    both = np.concatenate([tokens, tokens + 100])
    examples = reply_examples(HiddenRows([np.zeros((20, 4), np.float16)]), [10, 10], both, 3, with_path=True)
    assert reply_examples(examples.hidden, [10, 10], both, 3).path_xe is None  # only when asked
    for r, ex in enumerate((examples.subset(slice(0, 9)), examples.subset(slice(9, 18)))):
        assert ex.path_xe[0].tolist() == [10 + 100 * r, 11 + 100 * r, 12 + 100 * r]
        np.testing.assert_array_equal(ex.path_xe[1:], path_tokens(tokens[None] + 100 * r, 3)[0][:8])
        # each head's last path token is the previous head's target (teacher forcing)
        np.testing.assert_array_equal(ex.path_xe[:7, 1:], ex.targets_xm[:7, :-1])
        assert set(ex.batch(np.arange(3), teacher=True)) == {"hidden", "targets", "teacher_hidden", "path"}


# ---- training runs -------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _scripts(monkeypatch):
    for name, file in (("scripts_train_heads", "train_heads.py"), ("scripts_export", "export_heads.py")):
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("hydra_run")
    return build_tiny_chat_model(root / "model"), write_json(root / "chat.json", chat_records(80, seed=1))


def _train(chat, out, monkeypatch, tmp_path, *extra):
    from scripts_train_heads import main

    model, data = chat
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))
    main(["--model", str(model), "--data", str(data), "--output", str(out), "--batch-size", "4", "--seq-len",
          "128", "--heldout-fraction", "0.1", "--log-every", "1", "--no-progress", "--num-proc", "1",
          "--head-type", "hydra", "--num-heads", "3", "--learning-rate", "1e-2", "--warmup-steps", "2", *extra])
    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra", [["--lm-head", "truncated:64"],
                                   ["--lm-head", "truncated:64", "--cache-hidden", "--cached-batch-size", "64",
                                    "--head-loss", "ce+kl"]])
def test_hydra_training_lowers_the_loss_and_resumes_exactly(chat, tmp_path, monkeypatch, extra):
    common = ["--max-steps", "16", "--save-every", "6", "--eval-every", "16", *extra]
    log = _train(chat, tmp_path / "a", monkeypatch, tmp_path, *common)
    losses = [r["loss"] for r in log if r["kind"] == "train"]
    assert len(losses) == 16 and np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.2, losses
    if "ce+kl" in extra:  # the cached path also gives Hydra heads their teacher rows: a KL is trained and logged
        kl = [r["head_kl"] for r in log if r["kind"] == "train"]
        assert len(kl) == 16 and all(np.isfinite(k).all() and min(k) > 0 for k in kl), kl
    heads = load_native_heads(tmp_path / "a")
    assert isinstance(heads, HydraHeads) and heads.config.num_heads == 3
    assert json.loads((tmp_path / "a" / "config.json").read_text())["training"]["head_type"] == "hydra"

    real_step = trainer_mod.Trainer.train_step

    def crash_at_eight(self, batch):
        if self.step == 8:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, batch)

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", crash_at_eight)
    with pytest.raises(KeyboardInterrupt):
        _train(chat, tmp_path / "b", monkeypatch, tmp_path, *common)
    monkeypatch.setattr(trainer_mod.Trainer, "train_step", real_step)
    resumed = _train(chat, tmp_path / "b", monkeypatch, tmp_path, *common, "--resume")
    resumed = [r for r in resumed if r["kind"] == "train"]
    # the log is cut back to the restored checkpoint (step 6), so each step appears once, as uninterrupted
    assert [r["step"] for r in resumed] == list(range(1, 17))
    for r in resumed[6:]:
        assert r["loss"] == pytest.approx(losses[r["step"] - 1], abs=1e-6), r["step"]


def test_hydra_with_medusa2_is_a_clear_cli_error(chat, tmp_path, monkeypatch, capsys):
    from scripts_train_heads import main

    model, data = chat
    code = main(["--model", str(model), "--data", str(data), "--output", str(tmp_path / "x"), "--head-type", "hydra",
                 "--medusa2"])
    assert code == 2 and "error: --head-type hydra trains with a frozen backbone" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_head_accuracy_and_training_stats_agree_on_teacher_forced_top1(base):
    """bench/head_accuracy (the benchmarks' held-out top-k) and the trainer's statistics score the same
    teacher-forced Hydra predictions."""
    heads = hydra(base, seed=5, hydra_input="concat")
    tokens = np.random.RandomState(6).randint(0, base.config.vocab_size, (3, 24)).astype(np.int32)
    table = measure_head_accuracy(base, heads, tokens.tolist(), [0, 0, 0], top_k=4)
    ones = np.ones_like(tokens)
    batch = {"tokens": jnp.asarray(tokens), "positions": jnp.asarray(np.cumsum(ones, 1) - 1),
             "segment_ids": jnp.asarray(ones)}
    stats = hydra_head_stats(heads, base, backbone_hidden(base, batch), path_tokens(batch["tokens"], 3),
                             head_targets(batch["tokens"], jnp.asarray(ones, bool), batch["segment_ids"], 3))
    assert table.positions_m.tolist() == np.asarray(stats.total).astype(int).tolist() == [66, 63, 60]
    np.testing.assert_allclose(table.top1_m, np.asarray(stats.top1) / np.asarray(stats.total), atol=1e-6)
    assert np.asarray(stats.top1).sum() > 0


def test_hydra_heads_take_the_distilled_kl_loss(base):
    """Hydra head i's KL is to the base's distribution at t + 1 + i (as Medusa head i's): the stats equal a direct
    computation, and a few KL-only steps on cached hidden states bring each head's KL down."""
    heads, d, v = hydra(base, seed=8), base.config.hidden_size, base.config.vocab_size
    rng = np.random.RandomState(9)
    hidden_xd = jnp.asarray(rng.normal(size=(12, d)), jnp.float32)
    path_xe = jnp.asarray(rng.randint(0, v, (12, 3)), jnp.int32)
    targets_mx = jnp.asarray(rng.randint(-1, v, (3, 12)), jnp.int32)
    teacher_mxd = jnp.asarray(rng.normal(size=(3, 12, d)), jnp.float32)
    stats = hydra_head_stats(heads, base, hidden_xd, path_xe, targets_mx, teacher_mxd)
    for i in range(3):
        student = heads.head_logits(i, hidden_xd, path_xe[:, : i + 1], base)
        kl, count = distill_loss(student, base.logits(teacher_mxd[i]), targets_mx[i] >= 0)
        np.testing.assert_allclose(stats.kl_sum[i], kl, rtol=1e-4)
        assert stats.kl_count[i] == count == int((targets_mx[i] >= 0).sum()) and kl > 0

    batch = {"hidden": np.asarray(hidden_xd, np.float16), "targets": np.asarray(targets_mx).T,
             "teacher_hidden": np.moveaxis(np.asarray(teacher_mxd, np.float16), 0, 1), "path": np.asarray(path_xe)}
    mesh = MeshConfig(1, 1, 1).make_mesh(jax.devices()[:1])
    trainer = Trainer(base, heads, TrainConfig(learning_rate=1e-2, warmup_steps=0, max_steps=20, head_loss="kl"),
                      mesh)
    kl = [np.asarray(trainer.train_step(batch)["stats"].mean_kl()) for _ in range(12)]
    assert (kl[-1] < 0.7 * kl[0]).all(), kl


def test_step_cost_times_a_hydra_step(base):
    heads, tree = hydra(base, seed=7), load_tree("mc_sim_7b_8")
    pieces = step_cost.piece_seconds(base, heads, tree, 1, 20, 64, repeats=1)
    assert set(pieces) == set(step_cost.PIECES) and min(pieces.values()) > 0
    assert whole_step.medusa_step_seconds(base, heads, tree, 1, 20, 64, repeats=1) > 0
