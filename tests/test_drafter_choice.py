"""The README demo's pieces (inference/drafter_choice.py, scripts/demo_drafters.py): the choice follows the figures of
the run, a drafter that does not write plain's tokens is never chosen, and the race decodes every kind of drafter
losslessly on a tiny model."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from medusa_jax.inference import drafter_choice
from medusa_jax.inference.drafter_choice import DecodeRun, choose, race
from medusa_jax.inference.loaded_model import load_model

from test_benchmark import tiny_chat_model  # noqa: F401 (the fixture: a tiny chat model and random heads)

TOKENS = tuple(range(12))


def run(name, seconds, token_ids=TOKENS, steps=6):
    return DecodeRun(name, f"tree of {name}", token_ids, steps, seconds)


def test_the_fastest_drafter_at_or_above_the_margin_is_chosen_with_its_figures():
    plain = run(None, 1.0, steps=12)
    choice = choose(plain, [run("lookup", 0.9), run("mix", 0.8), run("recycle", 1.2)], min_speedup=1.05)
    assert choice.run.drafter == "mix" and choice.speedup == pytest.approx(1.25)
    assert choice.reason == "mix (tree of mix): x1.25 over plain, 2.00 tokens/step"


def test_plain_when_no_drafter_pays_and_the_reason_names_the_best():
    plain = run(None, 1.0, steps=12)
    choice = choose(plain, [run("lookup", 1.03), run("default", 1.25)], min_speedup=1.05)
    assert choice.run is None and choice.speedup == 1.0
    assert choice.reason == "plain: no drafter pays on this machine (best lookup x0.971 < 1.05)"


def test_a_drafter_that_changed_the_answer_is_never_chosen():
    plain = run(None, 1.0, steps=12)
    wrong = run("mix", 0.1, token_ids=TOKENS[:-1] + (99,))
    choice = choose(plain, [wrong, run("lookup", 0.5)])
    assert choice.run.drafter == "lookup" and choice.speedup == pytest.approx(2.0)
    assert choose(plain, [wrong]).reason == "plain: no drafter wrote plain's tokens"
    policy_plain = dataclasses.replace(run("default", 0.1), drafted=False)  # its tree policy decoded plainly
    assert choose(plain, [policy_plain]).reason == "plain: no drafter drafted here"
    assert choose(plain, [policy_plain, run("lookup", 0.5)]).run.drafter == "lookup"


def draft_size_costs(sizes):
    """Step costs of the draft sizes over a plain step, growing with the size (given, not timed: timing them
    compiles a step per size of each mix, most of this file's time; test_mixed_drafts tests the timing)."""
    return tuple(1.0 + 0.02 * size for size in sizes)


def test_the_race_decodes_heads_recycle_lookup_and_their_mix_like_plain(tiny_chat_model, monkeypatch):  # noqa: F811
    folder, heads_dir = tiny_chat_model
    build_mix = drafter_choice.build_mix
    monkeypatch.setattr(drafter_choice, "build_mix",
                        lambda *args, **kw: build_mix(*args, **{**kw, "costs": draft_size_costs}))
    loaded = load_model(folder, None)
    prompt = loaded.encode_chat(["the cat the dog the cat the dog the cat"])[0]
    lines = []
    names = (str(heads_dir), "recycle", "lookup", f"{heads_dir}+recycle+lookup")
    plain, runs = race(loaded, prompt, 12, candidates=names, rounds=2, say=lines.append)
    assert [r.drafter for r in runs] == list(names) and len(lines) == 1 + len(names)
    assert lines[-1].startswith(f"plain: {plain.tokens_per_second:.1f} tokens/s (the fastest of ")
    assert all(r.token_ids == plain.token_ids for r in runs)  # greedy tree decoding is lossless
    assert all(r.steps <= plain.steps and r.seconds > 0 for r in runs)
    assert "mixed drafts" in runs[2].tree and "recycle_4" in runs[1].tree
    for mix in runs[2:]:  # the mixes' sizes, 16 nodes at most, carry the given costs
        assert "up to 16 nodes" in mix.tree and "costs 1.00/1.04/1.10/1.32" in mix.tree, mix.tree
    assert all(r.drafted for r in runs[1:])  # recycle, lookup and the mix draft whatever the machine
    choice = choose(plain, runs, min_speedup=1.0)
    best = max(r.tokens_per_second for r in runs if r.drafted)
    assert (choice.run is None) == (best < plain.tokens_per_second)
    if choice.run is not None:  # the printed figure is the run's own ratio
        assert choice.speedup == pytest.approx(choice.run.tokens_per_second / plain.tokens_per_second)
        assert f"x{choice.speedup:.2f}" in choice.reason


def test_the_demo_script_refuses_bad_flags_in_one_line(capsys):
    spec = importlib.util.spec_from_file_location("demo_drafters", Path(__file__).parents[1] / "scripts" /
                                                  "demo_drafters.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for flags, message in ((["--min-speedup", "0.5"], "--min-speedup 0.5: must be a finite number >= 1.0"),
                           (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
                           (["--min-speedup", "nan"], "--min-speedup nan: must be a finite number")):
        with pytest.raises(SystemExit) as e:
            script.main(flags)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and message in err, err
