"""Tree choice calibrated on first use (medusa_jax/trees/policy/calibration.py): step costs timed on this machine once, cached
per machine / model / heads / batch size, combined with the accuracy stored in the heads' trees.json; plain
decoding whenever no tree is predicted to pay; --calibration auto / redo / skip."""

from __future__ import annotations

import dataclasses
import json
import types

import jax
import numpy as np
import pytest
from flax import nnx

from medusa_jax.trees import trees_file
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.folder import save_heads
from medusa_jax.heads.init import init_heads
from medusa_jax.heads.load import load_heads
from medusa_jax.trees.tree import DynamicTree
from medusa_jax.hf.load import load_pretrained
from medusa_jax.trees.policy import calibration, tree_choice
from medusa_jax.inference.api import HEADS_TREE, BatchSettings, generate_batch
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.trees.policy.choose import choose_tree
from medusa_jax.trees.policy import step_cost
from medusa_jax.trees.policy.step_cost import StepCostTable
from medusa_jax.inference import draft_size

ORDER = [[0], [1], [0, 0], [2], [0, 1], [1, 0], [0, 0, 0]]
SHIPPED = [[0], [1], [0, 0]]  # what the trees.json says for batch 1 (chosen elsewhere)


def choose_heads_tree(model, batch_size, calibration, progress=True):
    """The heads' own tree of `model` (no tree given), as generate_batch asks for it with HEADS_TREE."""
    return choose_tree(model.heads_config, model.heads_trees, batch_size, model=model, calibration=calibration,
                       progress=progress)


def built_record() -> dict:
    accuracy = np.zeros((3, 4))
    accuracy[:, 0], accuracy[:, 1], accuracy[:, 2] = [0.6, 0.5, 0.4], 0.1, 0.05
    return {"head_accuracy": accuracy.tolist(), "greedy_order": ORDER, "accuracy_scale": 1.0, "min_speedup": 1.1,
            "timing": {"context": 256, "repeats": 5, "tree_tokens": [2, 4, 8]}}


@pytest.fixture(scope="module")
def heads_folder(tiny_model_dir, tmp_path_factory):
    base = load_pretrained(tiny_model_dir("llama", initializer_range=0.3))
    folder = tmp_path_factory.mktemp("calibrated-heads")
    save_heads(init_heads(HeadsConfig(64, 128, num_heads=3, lm_head="own"), base, seed=3), folder)
    document = trees_file.trees_document(None, jax.default_backend(), {1: SHIPPED, 2: SHIPPED}, built_record())
    (folder / "trees.json").write_text(json.dumps(document))
    return base, folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "calibration"


def fake_measure(calls: list, plain: float, tree_seconds: tuple[float, ...], dynamic_seconds: tuple[float, ...] = ()):
    def measure(base, heads, accuracy, batch, progress=None):
        calls.append(batch)
        names = tuple(g.tree.name for g in accuracy.dynamic)
        return StepCostTable(batch, 256, 512, plain, accuracy.tree_tokens, tree_seconds, names,
                             dynamic_seconds[: len(names)])
    return measure


def test_first_use_measures_once_then_reads_the_cache_and_redo_measures_again(heads_folder, cache, monkeypatch,
                                                                              capsys):
    base, folder = heads_folder
    model = ShardedModel(base, load_heads(folder, base=base))
    calls = []
    # a cheap tree step: the largest tree (7 nodes, T = 8) pays best
    monkeypatch.setattr(calibration, "measure", fake_measure(calls, 1.0, (1.05, 1.1, 1.2)))
    first = choose_heads_tree(model, 1, "auto")
    assert calls == [1] and "calibrating tree choice for this machine at batch 1" in capsys.readouterr().err
    assert first.tree is not None and len(first.tree.paths) == 7 and "measured now" in first.note
    assert len(list(cache.glob("*.json"))) == 1
    again = choose_heads_tree(model, 1, "auto")
    assert calls == [1] and again.tree == first.tree and "cached" in again.note  # read, not measured
    choose_heads_tree(model, 2, "auto")
    assert calls == [1, 2] and len(list(cache.glob("*.json"))) == 2  # one entry per batch size
    monkeypatch.setattr(calibration, "measure", fake_measure(calls, 1.0, (3.0, 4.0, 5.0)))  # the machine changed
    redone = choose_heads_tree(model, 1, "redo")
    assert calls == [1, 2, 1] and redone.tree is None and "no tree is predicted to pay" in redone.note
    assert choose_heads_tree(model, 1, "auto").tree is None  # the redone entry replaced the old one
    skipped = choose_heads_tree(model, 1, "skip")  # the shipped trees.json as it is
    assert calls == [1, 2, 1] and len(skipped.tree.paths) == len(SHIPPED) and "calibrated" not in skipped.note


def test_calibration_chooses_plain_decoding_and_the_output_is_plain_greedy(heads_folder, cache, monkeypatch):
    base, folder = heads_folder
    heads = load_heads(folder, base=base)
    prompts = [[5, 9, 17, 3], [40, 2, 8]]
    settings = BatchSettings(batch_size=1, max_new_tokens=10)
    plain = generate_batch(ShardedModel(base, None), prompts, settings, progress=False)
    model = ShardedModel(base, heads)
    monkeypatch.setattr(calibration, "measure", fake_measure([], 1.0, (2.0, 3.0, 4.0)))  # no tree pays
    run = generate_batch(model, prompts, BatchSettings(batch_size=1, max_new_tokens=10, tree=HEADS_TREE,
                                                       calibration="auto"), progress=False)
    assert run.tree_choice.tree is None and "plain decoding: calibrated" in run.tree_choice.note
    assert [r.token_ids for r in run.results] == [r.token_ids for r in plain.results]
    monkeypatch.setattr(calibration, "measure", fake_measure([], 1.0, (1.01, 1.02, 1.03)))  # trees pay
    run = generate_batch(model, prompts, BatchSettings(batch_size=1, max_new_tokens=10, tree=HEADS_TREE,
                                                       calibration="redo"), progress=False)
    assert run.tree_choice.tree is not None and len(run.tree_choice.tree.paths) == 7
    assert [r.token_ids for r in run.results] == [r.token_ids for r in plain.results]  # greedy: lossless


def test_real_measurement_writes_a_readable_cache_entry(heads_folder, cache):
    base, folder = heads_folder
    model = ShardedModel(base, load_heads(folder, base=base))
    chosen = choose_heads_tree(model, 1, "auto", progress=False)  # times the tiny model's steps here
    [entry] = cache.glob("*.json")
    doc = json.loads(entry.read_text())
    assert doc["format"] == calibration.FORMAT and doc["machine"]["backend"]
    costs = calibration.read_costs(entry)
    assert costs.num_tree_tokens == (2, 4, 8) and costs.plain_seconds > 0 and min(costs.medusa_seconds) > 0
    assert chosen.note.startswith(("the heads' tree", "plain decoding: calibrated"))
    entry.write_text("not json")  # a damaged entry is measured again, not trusted
    assert calibration.read_costs(entry) is None
    choose_heads_tree(model, 1, "auto", progress=False)
    assert calibration.read_costs(entry) is not None


def test_heads_without_an_accuracy_record_keep_the_shipped_choice(heads_folder, cache, tmp_path, monkeypatch):
    base, folder = heads_folder
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in folder.iterdir():
        (bare / f.name).write_bytes(f.read_bytes())
    document = trees_file.trees_document(None, jax.default_backend(), {1: SHIPPED}, {"date": "by hand"})
    (bare / "trees.json").write_text(json.dumps(document))
    calls = []
    monkeypatch.setattr(calibration, "measure", fake_measure(calls, 1.0, (1.0, 1.0, 1.0)))
    chosen = choose_heads_tree(ShardedModel(base, load_heads(bare, base=base)), 1, "auto")
    assert calls == [] and len(chosen.tree.paths) == len(SHIPPED)


def test_a_dynamic_tree_named_by_trees_json_stands(heads_folder, cache, tmp_path, monkeypatch):
    """Calibration prices static trees only: where trees.json names a dynamic tree for the batch size, it is kept."""
    base, folder = heads_folder
    dyn = tmp_path / "dynamic"
    dyn.mkdir()
    for f in folder.iterdir():
        (dyn / f.name).write_bytes(f.read_bytes())
    document = trees_file.trees_document(None, jax.default_backend(), {1: DynamicTree(4, 2, 2), 2: SHIPPED},
                                         built_record())
    (dyn / "trees.json").write_text(json.dumps(document))
    calls = []
    monkeypatch.setattr(calibration, "measure", fake_measure(calls, 1.0, (1.05, 1.1, 1.2)))
    model = ShardedModel(base, load_heads(dyn, base=base))
    chosen = choose_heads_tree(model, 1, "auto")
    assert calls == [] and chosen.tree == DynamicTree(4, 2, 2) and "dynamic tree" in chosen.note
    assert choose_heads_tree(model, 2, "auto").tree is not None and calls == [2]  # a static entry is calibrated


def test_pick_weighs_dynamic_trees_by_predicted_tokens_per_second():
    """A dynamic tree is predicted from the static tree of its size (its accepted part scaled by what it accepted
    over that tree on the held-out text) and kept when it predicts the most tokens per second."""
    accuracy = np.asarray(built_record()["head_accuracy"])
    costs = StepCostTable(1, 256, 512, 1.0, (2, 4, 8), (1.05, 1.1, 1.2), ("dynamic:4,k=2,d=2",), (1.12,))
    static_paths, static_record = calibration.pick_for_batch(accuracy, costs, len(ORDER), 1.0)
    assert "dynamic" not in static_record and not isinstance(static_paths, DynamicTree)
    greedy_4 = [p for p, _ in tree_choice.greedy_tree(accuracy, 4)]
    static_4 = tree_choice.expected_tokens_per_step(greedy_4, accuracy)  # the greedy static tree of 4 nodes
    better = calibration.DynamicGain(DynamicTree(4, 2, 2), 2.2, 1.6)  # accepts 2x the static tree's extra tokens
    chosen, record = calibration.pick_for_batch(accuracy, costs, len(ORDER), 1.0, dynamic=[better])
    assert chosen == DynamicTree(4, 2, 2) and record["tree"] == "dynamic:4,k=2,d=2" and record["num_nodes"] == 4
    [dyn] = record["dynamic"]
    assert dyn["predicted_tokens_per_step"] == pytest.approx(1 + 2 * (static_4 - 1))
    assert record["predicted_speedup_vs_plain"] == pytest.approx(dyn["predicted_tokens_per_step"] / 1.12)
    worse = calibration.DynamicGain(DynamicTree(4, 2, 2), 1.5, 1.6)
    chosen, record = calibration.pick_for_batch(accuracy, costs, len(ORDER), 1.0, dynamic=[worse])
    assert chosen == static_paths and record["dynamic"][0]["predicted_speedup_vs_plain"] < record[
        "predicted_speedup_vs_plain"]
    untimed = dataclasses.replace(costs, dynamic_trees=(), dynamic_seconds=())  # not timed: not weighed
    assert calibration.pick_for_batch(accuracy, untimed, len(ORDER), 1.0, dynamic=[better])[0] == static_paths
    # nothing pays, dynamic or static: plain
    assert calibration.pick_for_batch(accuracy, costs, len(ORDER), 10.0, dynamic=[better])[0] == ()


def test_calibration_picks_a_measured_dynamic_tree_and_decodes_losslessly(heads_folder, cache, tmp_path,
                                                                          monkeypatch):
    base, folder = heads_folder
    dyn = tmp_path / "with-dynamic"
    dyn.mkdir()
    for f in folder.iterdir():
        (dyn / f.name).write_bytes(f.read_bytes())
    record = {**built_record(), "dynamic": [calibration.DynamicGain(DynamicTree(4, 2, 2), 2.5, 1.5).to_json()]}
    (dyn / "trees.json").write_text(json.dumps(trees_file.trees_document(None, jax.default_backend(),
                                                                         {1: SHIPPED}, record)))
    calls = []
    monkeypatch.setattr(calibration, "measure", fake_measure(calls, 1.0, (1.05, 1.1, 1.2), (1.1,)))
    model = ShardedModel(base, load_heads(dyn, base=base))
    chosen = choose_heads_tree(model, 1, "auto")
    assert calls == [1] and chosen.tree == DynamicTree(4, 2, 2) and "dynamic tree dynamic:4,k=2,d=2" in chosen.note
    prompts = [[5, 9, 17, 3], [40, 2, 8]]
    plain = generate_batch(ShardedModel(base, None), prompts, BatchSettings(batch_size=1, max_new_tokens=10),
                           progress=False)
    run = generate_batch(model, prompts, BatchSettings(batch_size=1, max_new_tokens=10, tree=HEADS_TREE,
                                                       calibration="auto"), progress=False)
    assert run.tree_choice.tree == DynamicTree(4, 2, 2) and calls == [1]  # read from the cache
    assert [r.token_ids for r in run.results] == [r.token_ids for r in plain.results]
    # the real step of a dynamic tree is timed beside the static ones and cached with them
    costs = calibration.measure(base, model_heads(model), calibration.Accuracy.from_built(record), 1)
    assert costs.dynamic_trees == ("dynamic:4,k=2,d=2",) and costs.dynamic_seconds[0] > 0
    path = cache / "entry.json"
    calibration.write_costs(path, costs, {"cpu": "test"})
    assert calibration.read_costs(path) == costs


def model_heads(model):
    return nnx.merge(model.medusa_graphdef, model.medusa_params).heads


def test_modes_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="calibration must be one of"):
        BatchSettings(calibration="sometimes")
    monkeypatch.setenv(calibration.ENV, "never")
    with pytest.raises(ValueError, match="MEDUSA_JAX_CALIBRATION"):
        calibration.default_mode()
    monkeypatch.setenv(calibration.ENV, "redo")
    assert calibration.check_mode(None) == "redo" and calibration.check_mode("skip") == "skip"
    monkeypatch.setenv(draft_size.SECONDS_ENV, "soon")
    with pytest.raises(ValueError, match="MEDUSA_JAX_CALIBRATION_SECONDS must be a number of seconds >= 0"):
        draft_size.default_budget()
    monkeypatch.setenv(draft_size.SECONDS_ENV, "2.5")
    assert draft_size.default_budget() == draft_size.TimingBudget(seconds=2.5)
    monkeypatch.delenv(draft_size.SECONDS_ENV)
    assert draft_size.default_budget() == draft_size.TimingBudget()


class FakeSteps:
    """A fake clock and step calls that advance it: call c of round r takes load_r * seconds_c * noise (a load
    that changes from round to round, per-call jitter and rare spikes of one call), drawn from a seeded stream."""

    def __init__(self, seconds_c, load=(1.0, 1.0), jitter=0.0, spikes=0.0, seed=0):
        self.now, self.rng, self.seconds_c = 0.0, np.random.default_rng(seed), seconds_c
        self.load, self.jitter, self.spikes, self.round_load = load, jitter, spikes, 1.0
        self.round_starts = []  # the clock as each round (warm-up included) began

    def __call__(self):
        return self.now

    def call(self, c):
        def step():
            if c == 0:  # each round starts with the plain step: the load of this round
                self.round_starts.append(self.now)
                self.round_load = self.rng.uniform(*self.load)
            spike = 3.0 if self.rng.random() < self.spikes else 1.0
            self.now += self.round_load * self.seconds_c[c] * spike * (1 + self.jitter * self.rng.standard_normal())
        return step

    def calls(self):
        return [self.call(c) for c in range(len(self.seconds_c))]


def test_interquartile_mean_leaves_out_the_outer_quarters():
    assert draft_size.interquartile_mean([1, 2, 3, 4, 100, 5, 6, 7])[0] == 4.5  # the middle half: 3, 4, 5, 6
    assert draft_size.interquartile_mean([2.0] * 9) == (2.0, 0.0) and draft_size.interquartile_mean([3.0])[1] == np.inf


def test_size_costs_are_per_round_ratios_robust_to_load_changes_and_spikes(monkeypatch):
    """A load that changes up to 3x between rounds, 5% jitter and 10% of calls 3x slower, ten seeds: each size's
    cost within 3% of its true ratio to the plain step every time; the old estimate (each call's median over 7
    rounds, their ratio) on the same kind of timings misses by more than 5% in most of them."""
    truth = np.array((1.13, 1.45, 1.62))
    errors = {"old": [], "new": []}
    for seed in range(10):
        steps = FakeSteps((0.02, *(0.02 * truth)), load=(1.0, 3.0), jitter=0.05, spikes=0.1, seed=seed)
        costs, rounds = draft_size.timed_ratios(steps.calls(), draft_size.TimingBudget(), clock=steps)
        assert rounds >= draft_size.TimingBudget().min_rounds
        errors["new"].append(np.abs(np.array(costs) / truth - 1).max())
        old = FakeSteps(steps.seconds_c, load=(1.0, 3.0), jitter=0.05, spikes=0.1, seed=seed)
        monkeypatch.setattr(step_cost, "time", types.SimpleNamespace(perf_counter=old))
        plain, *seconds = step_cost.time_interleaved(old.calls(), 7)
        errors["old"].append(np.abs(np.array(seconds) / plain / truth - 1).max())
    assert max(errors["new"]) < 0.03 and np.median(errors["old"]) > 0.05


def test_timing_stops_when_stable_or_when_the_budget_is_spent():
    quiet = FakeSteps((0.01, 0.012, 0.02), jitter=0.001)
    budget = draft_size.TimingBudget(min_rounds=12, max_rounds=50, seconds=10.0, tolerance=0.01)
    assert draft_size.timed_ratios(quiet.calls(), budget, clock=quiet)[1] == 12  # stable from the first check on
    noisy = FakeSteps((0.1, 0.12, 0.2), jitter=0.3, seed=2)
    _, rounds = draft_size.timed_ratios(noisy.calls(), dataclasses.replace(budget, max_rounds=1000), clock=noisy)
    timed = noisy.round_starts[draft_size.WARM_UP_CALLS:]  # the warm-up calls are not counted
    assert 12 < rounds == len(timed) < 1000 and timed[-1] - timed[0] < 10.0 <= noisy.now - timed[0]
    noisy = FakeSteps((0.1, 0.12, 0.2), jitter=0.3, seed=3)
    assert draft_size.timed_ratios(noisy.calls(), dataclasses.replace(budget, seconds=1e9), clock=noisy)[1] == 50
