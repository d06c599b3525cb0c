"""Which drafter pays on this machine, for one prompt: plain decoding against each drafter with its own tree policy,
timed in the same run, and the fastest chosen, or plain with the reason (the README demo, scripts/demo_drafters.py);
the run's rules are in docs/modules.md."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.heads.load import load_heads
from medusa_jax.heads.recycle import DEFAULT_TEMPLATE, recycle_drafter, template_tree
from medusa_jax.trees.policy.choose import HEADS_TREE
from medusa_jax.inference.api import BatchSettings, generate_batch
from medusa_jax.inference.loaded_model import LoadedModel
from medusa_jax.inference.mixed_decoding import DEFAULT_BUDGET, build_mix, parse_mix
from medusa_jax.inference.sharded import ShardedModel

CANDIDATES = ("default", "recycle", "lookup", "default+recycle+lookup")  # --heads names the demo races
MIN_SPEEDUP = 1.05  # a drafter is chosen only this much above plain (one prompt's timing is noisy)
ROUNDS = 2  # timed decodes per drafter, alternating with plain ones; each keeps its fastest


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """Greedy decodes of the prompt: what drafted them (None: plain), with which tree, and the fastest's time."""

    drafter: str | None
    tree: str  # the tree or sizes used, or why its policy decoded plainly
    token_ids: tuple[int, ...]
    steps: int  # forward passes, prefill included
    seconds: float  # the fastest of its timed runs, compilation excluded
    drafted: bool = True  # False: plain decoding (its policy found no tree that pays here)

    @property
    def tokens_per_step(self) -> float:
        return len(self.token_ids) / max(self.steps, 1)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / max(self.seconds, 1e-9)


@dataclasses.dataclass(frozen=True)
class Choice:
    run: DecodeRun | None  # None: plain
    speedup: float  # the chosen run's over plain (1.0 for plain)
    reason: str


def drafter_model(loaded: LoadedModel, name: str, heads_of: Callable[[str], object],
                  budget: int = DEFAULT_BUDGET) -> tuple[ShardedModel, object]:
    """(the model, its tree setting) of a --heads name at batch 1: a heads folder (`default`; heads_of(location)
    loads it) with its own tree, `recycle` on its default template, anything else a mix (`build_mix`)."""
    if name == "recycle":
        drafter = recycle_drafter(loaded.base)
        return ShardedModel(loaded.base, drafter), template_tree(DEFAULT_TEMPLATE, drafter.config.top_k)
    untrained, trained = parse_mix(name)
    if not untrained:
        return ShardedModel(loaded.base, heads_of(trained)), HEADS_TREE
    mix, sizes = build_mix(loaded.base, untrained, heads_of(trained) if trained is not None else None, budget,
                           batch=1)
    return ShardedModel(loaded.base, mix), sizes


def decode(loaded: LoadedModel, model: ShardedModel, tree, prompt: Sequence[int], max_new_tokens: int,
           drafter: str | None) -> DecodeRun:
    settings = BatchSettings(batch_size=1, max_new_tokens=max_new_tokens, tree=tree, eos_ids=loaded.eos_ids,
                             pad_id=loaded.pad_id)
    run = generate_batch(model, [list(prompt)], settings, progress=False)
    result = run.results[0]
    choice = run.tree_choice
    return DecodeRun(drafter, choice.note if choice is not None else "plain", tuple(result.token_ids), result.steps,
                     run.seconds - run.compile_seconds, drafted=choice is not None and choice.tree is not None)


def choose(plain: DecodeRun, runs: Sequence[DecodeRun], min_speedup: float = MIN_SPEEDUP) -> Choice:
    """The fastest drafted run that wrote plain's tokens, if at least min_speedup x plain; else plain and why."""
    drafted = [run for run in runs if run.drafted]
    speed = {run.drafter: run.tokens_per_second / plain.tokens_per_second for run in drafted
             if run.token_ids == plain.token_ids}
    if not speed:
        return Choice(None, 1.0, "plain: no drafter drafted here" if not drafted else
                      "plain: no drafter wrote plain's tokens")
    best = max((run for run in drafted if run.drafter in speed), key=lambda run: speed[run.drafter])
    if speed[best.drafter] < min_speedup:
        return Choice(None, 1.0, f"plain: no drafter pays on this machine (best {best.drafter} "
                                 f"x{speed[best.drafter]:.3f} < {min_speedup})")  # 3 places: x1.048, not x1.05
    return Choice(best, speed[best.drafter], f"{best.drafter} ({best.tree}): x{speed[best.drafter]:.2f} over plain, "
                                             f"{best.tokens_per_step:.2f} tokens/step")


def race(loaded: LoadedModel, prompt: Sequence[int], max_new_tokens: int, candidates: Sequence[str] = CANDIDATES,
         rounds: int = ROUNDS, say: Callable[[str], None] = print) -> tuple[DecodeRun, list[DecodeRun]]:
    """Plain, then every candidate, on `prompt` (docs/modules.md): each candidate's decodes alternate with
    plain ones, `rounds` of each (the first call of each compiles, which is excluded), and every method keeps its
    fastest (a loaded machine only ever slows a run down). A candidate whose policy decodes plainly runs once.
    `say` gets one line per candidate and one for plain."""
    plain_model = ShardedModel(loaded.base, None)
    plains = [decode(loaded, plain_model, None, prompt, max_new_tokens, None)]
    loaded_heads = {}

    def heads_of(location: str):  # each heads folder loaded once
        if location not in loaded_heads:
            loaded_heads[location] = load_heads(resolve_heads_dir(location), base=loaded.base)
        return loaded_heads[location]

    runs = []
    for name in candidates:
        model, tree = drafter_model(loaded, name, heads_of)
        tries = [decode(loaded, model, tree, prompt, max_new_tokens, name)]
        while tries[0].drafted and len(tries) < rounds:
            plains.append(decode(loaded, plain_model, None, prompt, max_new_tokens, None))
            tries.append(decode(loaded, model, tree, prompt, max_new_tokens, name))
        run = min(tries, key=lambda r: r.seconds)
        same = "" if run.token_ids == plains[0].token_ids else " (DIFFERS from plain: never chosen)"
        say(f"{name}: {run.tokens_per_second:.1f} tokens/s, {run.tokens_per_step:.2f} tokens/step; {run.tree}{same}")
        runs.append(run)
    plain = min(plains, key=lambda r: r.seconds)
    say(f"plain: {plain.tokens_per_second:.1f} tokens/s (the fastest of {len(plains)} runs)")
    return plain, runs
