"""Mixed drafts on a real model: plain decoding against prompt lookup, the trained heads through the mix, and their
mix, at several node budgets, on MT-Bench (first turns, and second turns after plain's own first answer), HumanEval
(`bench.humaneval`) and the input-grounded set (`bench.grounded_prompts`).

Every method decodes the prompts greedily in calls of `batch` prompts (1: each alone); the methods take turns call
by call, so a change in machine load hits them alike; with `repeats` > 1 each call runs that many rounds of all
methods and keeps its median time (one prompt's timing on a shared VM varies by +-10%, which alone puts the worst
prompt's speedup far below the typical one). Per prompt set and method: tokens/step = new tokens / the rows' forward
passes (prefill included), tokens/s of whole calls without compilation (`timed_call`), speedup = tokens/s over
plain's in the same run, and mismatches: answers that differ from plain greedy by one token or more, in any round
(must be 0). `lookup_acceptance` measures, on the plain answers, how often prompt lookup's drafted tokens are right
after an n-token match: the acceptance `heads.lookup.MATCH_ACCEPTANCE` predicts with.
"""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import contextmanager
from typing import Sequence

import numpy as np

from medusa_jax.model.sharding import MeshConfig
from medusa_jax.heads.lookup import LookupConfig
from medusa_jax.inference import medusa
from medusa_jax.inference.api import BatchSettings, generate_batch
from medusa_jax.inference.draft_size import forced_sizes
from medusa_jax.inference.mixed_decoding import build_mix, parse_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.inference.loaded_model import LoadedModel


@dataclasses.dataclass(frozen=True)
class Method:
    label: str  # e.g. "default+lookup@16"
    parts: str | None  # a --heads mix ("lookup", "default+lookup"); None: plain
    budget: int = 0


EVERY_STEP = " every step"  # the label's suffix of a mix that drafts its full budget at every step


def methods(mixes: Sequence[str], budgets: Sequence[int], every_step: bool = False) -> list[Method]:
    """Plain, then each mix at each budget ("MIX@N": at N only); with `every_step` each mix's label says so
    (`build_models` then gives it one draft size)."""
    out = [Method("plain", None)]
    for m in mixes:
        name, _, nodes = m.partition("@")
        out += [Method(f"{name}@{b}{EVERY_STEP if every_step else ''}", name, b)
                for b in ((int(nodes),) if nodes else budgets)]
    return out


def build_models(loaded: LoadedModel, chosen: Sequence[Method], heads_of,
                 batch: int = 1) -> dict[str, tuple[ShardedModel, object]]:
    """label -> (ShardedModel, tree setting); heads_of(location) loads a trained part (the loaded heads for
    'default'); the draft sizes' step costs are measured at `batch` rows. A method labelled `EVERY_STEP` gets
    one draft size instead, its full budget (nothing timed): every step drafts and verifies it, so its
    tokens/step are the drafts' own at that budget, with no size choice between them and the machine."""
    out = {}
    for m in chosen:
        if m.parts is None:
            out[m.label] = (ShardedModel(loaded.base, None, MeshConfig()), None)
            continue
        untrained, trained = parse_mix(m.parts)
        every_step = m.label.endswith(EVERY_STEP)
        mix, sizes = build_mix(loaded.base, untrained, heads_of(trained) if trained else None, m.budget,
                               batch=batch, costs=(lambda s: (1.0,) * len(s)) if every_step else None)
        if every_step:
            sizes = forced_sizes((sizes.nodes,), sizes.depth)[0]
        out[m.label] = (ShardedModel(loaded.base, mix, MeshConfig()), sizes)
    return out


# the padded width of every prompt up to 512 tokens: one cache size, one compilation of the decode steps per method
# (the mixed steps compile slowly); each prompt is still prefilled at its own width of `engine.width_ladder`. Every
# step then attends over a wider cache than generate's bucket (64) gives: plain decoding ran 13% slower and
# the mix's speedup on 8 MT-Bench first turns fell from 1.25x to 1.16x (2026-12-07)
PROMPT_WIDTH = 512


@contextmanager
def traced_with(fn, name: str = "move_cache_slots"):
    """`medusa.<name>` replaced by `fn` while a decode loop is traced (the A/Bs of the cache move,
    bench/noop_move_ab.py and bench/move_width_ab.py, and of the mixed step's branch inputs,
    bench/branch_inputs_ab.py), the shipped function back after."""
    kept = getattr(medusa, name)
    setattr(medusa, name, fn)
    try:
        yield
    finally:
        setattr(medusa, name, kept)


def compile_with(models: dict, swaps: dict, prompts: list[list[int]], eos_ids, pad_id: int, batch: int = 1,
                 name: str = "move_cache_slots") -> None:
    """Each arm's loop (`run_set`'s models) traced and compiled by one call on the first `batch` prompts with its
    own `medusa.<name>` (`swaps[label]`, `traced_with`), before the timed rounds."""
    for label, (model, tree) in models.items():
        with traced_with(swaps[label], name):
            run_set({label: (model, tree)}, prompts[:batch], 128, eos_ids, pad_id, batch=batch)


def never_drafting_step(model, state, proposer, inputs, sizes, acceptance, eos_ids):
    """`medusa.mixed_step` with its decision fixed to "skip the drafting" (`medusa.skipped_step`): swapped in for
    it before anything is traced, a mix's loop never drafts (bench/never_drafting_loop.py, bench/noop_move_ab.py)."""
    return medusa.skipped_step(model, state, sizes=sizes, acceptance=acceptance, eos_ids=eos_ids)


def run_set(models: dict, prompts: list[list[int]], max_new_tokens: int, eos_ids, pad_id: int,
            progress=None, batch: int = 1, repeats: int = 1, first_token: bool = False,
            bucket: int = PROMPT_WIDTH) -> dict[str, list[dict]]:
    """label -> per call of `batch` prompts {tokens, steps, seconds (`timed_call`, the median of `repeats` rounds),
    token_ids (one list per prompt; a round that answers differently is kept as `other_token_ids`, counted by
    `summarise` as a mismatch), steps_each_round}; every round starts from the drafter states (Token Recycling's
    table) the call's first round started from; methods interleaved call by call and round by round, so a change in
    machine load hits them alike. `bucket`: the narrowest padded prompt width (`BatchSettings.bucket`).
    With `first_token`, each round also times the same call stopped after its first token (the prefill and the
    drafters' admission): `first_seconds`, its median, so `summarise` can give the speed after the first token."""
    rows = {label: [] for label in models}
    for i in range(0, len(prompts), batch):
        group = prompts[i: i + batch]
        runs = {label: [] for label in models}
        firsts = {label: [] for label in models}
        kept = {label: model.draft_snapshot() for label, (model, _) in models.items()}
        for _ in range(repeats):
            for label, (model, tree) in models.items():
                # every round starts from the drafter state the first did: a later round must not draft from a
                model.restore_draft(kept[label])  # table that saw this answer
                settings = BatchSettings(batch_size=batch, max_new_tokens=max_new_tokens, tree=tree,
                                         eos_ids=tuple(eos_ids), pad_id=pad_id, engine="batches",
                                         bucket=bucket)
                runs[label].append(timed_call(model, group, settings))
                if first_token:
                    one = dataclasses.replace(settings, max_new_tokens=1)
                    firsts[label].append(timed_call(model, group, one)[1])
        for label, per_round in runs.items():
            first = per_round[0][0]
            ids = [r.token_ids for r in first]
            rows[label].append({"tokens": sum(r.new_tokens for r in first), "steps": sum(r.steps for r in first),
                                "steps_each_round": [sum(r.steps for r in results) for results, _ in per_round],
                                "seconds": float(np.median([seconds for _, seconds in per_round])),
                                "token_ids": ids,
                                "other_token_ids": [[r.token_ids for r in results] for results, _ in per_round[1:]
                                                    if [r.token_ids for r in results] != ids],
                                **({"first_seconds": float(np.median(firsts[label]))} if first_token else {})})
        if progress is not None:
            progress(f"prompts {i + len(group)}/{len(prompts)}")
    return rows


def timed_call(model: ShardedModel, prompts: list[list[int]], settings: BatchSettings) -> tuple[list, float]:
    """(results, seconds) of one `generate_batch` call, timed whole (the engine's set-up and the drafter state's
    handoff included) less its compilation. A call that asked for any executable runs again from the same drafter
    state, and only the second run counts: an executable's first run pays costs (e.g. loading it from the
    persistent cache) that the compile time does not hold."""
    kept = model.draft_snapshot()
    for attempt in range(2):
        model.restore_draft(kept)
        start = time.perf_counter()
        run = generate_batch(model, prompts, settings, progress=False)
        seconds = time.perf_counter() - start - run.compile_seconds
        if run.compiles is None or run.compiles.requests == 0:
            break
    return run.results, seconds


def _after_first(calls: list[dict]) -> float:
    """Tokens/s after each call's first token: the tokens past each row's first over the time past the first."""
    return (sum(r["tokens"] - len(r["token_ids"]) for r in calls)
            / max(sum(r["seconds"] - r["first_seconds"] for r in calls), 1e-9))


def summarise(rows: dict[str, list[dict]], budgets_of: dict[str, int]) -> list[dict]:
    """Per method: tokens/step (new tokens over each row's forward passes), tokens/s, speedup over plain's in the
    same run, each call's speedup, the worst, how many are below 1, and mismatches (answers differing from plain
    greedy)."""
    plain = rows["plain"]
    plain_rate = sum(r["tokens"] for r in plain) / max(sum(r["seconds"] for r in plain), 1e-9)
    out = []
    for label, per in rows.items():
        tokens, steps, seconds = (sum(r[k] for r in per) for k in ("tokens", "steps", "seconds"))
        rate = tokens / max(seconds, 1e-9)
        speedups = [(r["tokens"] / max(r["seconds"], 1e-9)) / (p["tokens"] / max(p["seconds"], 1e-9))
                    for r, p in zip(per, plain)]
        out.append({"method": label, "nodes": budgets_of.get(label, 0),
                    "prompts": sum(len(r["token_ids"]) for r in per), "new_tokens": tokens,
                    "tokens_per_step": round(tokens / max(steps, 1), 3), "tokens_per_second": round(rate, 2),
                    "speedup": round(rate / plain_rate, 3), "min_prompt_speedup": round(min(speedups), 3),
                    "calls_below_plain": sum(x < 1 for x in speedups),
                    "call_speedups": [round(x, 3) for x in speedups],
                    "mismatches": sum(a != b for r, p in zip(per, plain)
                                      for answers in (r["token_ids"], *r.get("other_token_ids", ()))
                                      for a, b in zip(answers, p["token_ids"]))})
        if all("first_seconds" in r for r in per + plain):
            out[-1].update(first_token_seconds=round(sum(r["first_seconds"] for r in per) / len(per), 3),
                           speedup_after_first_token=round(_after_first(per) / _after_first(plain), 3))
    return out


def arm_figures(rows: dict[str, list[dict]]) -> dict[str, dict]:
    """Per arm of an in-process A/B (`run_set`'s rows, "plain" among them): tokens/step, the mean and worst of the
    per-prompt speeds against plain's, the per-prompt speeds and the mismatches (an answer, in any round, that is not
    plain's)."""
    out = {}
    for label, calls in rows.items():
        mismatches = sum(c["token_ids"] != p["token_ids"] or bool(c["other_token_ids"])
                         for c, p in zip(calls, rows["plain"]))
        speeds = [p["seconds"] / c["seconds"] for c, p in zip(calls, rows["plain"])]
        out[label] = {"tokens_per_step": round(sum(c["tokens"] for c in calls) / sum(c["steps"] for c in calls), 3),
                      "mean_speed_vs_plain": round(float(np.mean(speeds)), 3), "worst": round(min(speeds), 3),
                      "per_prompt": [round(s, 3) for s in speeds], "mismatches": mismatches}
    return out


def arm_table(title: str, command: str, machine: dict, results: dict) -> str:
    """The Markdown report of an in-process A/B: `results` holds prompts, repeats, sizes, costs, `arm_figures`'
    methods and, for calls of several prompts, their batch size (each speed is then one call's)."""
    batch, prompts = results.get("batch", 1), results["prompts"]
    calls = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]
    lines = [f"## {title}", "", f"Command: `{command}`", "",
             f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, JAX {machine['jax']}, load average "
             f"{machine['load_average_1m']:.1f} at the start. Sizes {results['sizes']}, costs {results['costs']} "
             f"plain steps. {results['repeats']} interleaved rounds per call, the median.", "",
             f"| arm | tokens/step | mean speed vs plain | worst | per {'prompt' if batch == 1 else 'call'} ("
             + ", ".join("#" + "+".join(map(str, call)) for call in calls) + ") | mismatches |",
             "|---|---|---|---|---|---|"]
    for label, r in results["methods"].items():
        lines.append(f"| {label} | {r['tokens_per_step']:.2f} | {r['mean_speed_vs_plain']:.3f}x | {r['worst']:.3f}x | "
                     + " ".join(f"{s:.3f}" for s in r["per_prompt"]) + f" | {r['mismatches']} |")
    return "\n".join(lines) + "\n"


def answers(rows: dict[str, list[dict]], label: str = "plain") -> list[list[int]]:
    """One method's answers (token ids), prompt by prompt."""
    return [ids for call in rows[label] for ids in call["token_ids"]]


def second_turn_messages(first_turn: str, answer: str, second_turn: str) -> list[dict[str, str]]:
    """MT-Bench's second turn: the question, the model's own (plain greedy) first answer, the follow-up."""
    return [{"role": "user", "content": first_turn}, {"role": "assistant", "content": answer},
            {"role": "user", "content": second_turn}]


def lookup_acceptance(sequences: Sequence[Sequence[int]], starts: Sequence[int], config: LookupConfig) -> dict:
    """On greedy sequences (prompt + answer; the answer from starts[i]): at each answer position, the latest
    longest match (as `heads.lookup` finds it) and its drafted chain; per match length n, drafted tokens tried
    (the first, and each one after an accepted one) and accepted. {n: {"tried", "accepted", "rate"}}."""
    tried, accepted = np.zeros(config.n_max + 1, int), np.zeros(config.n_max + 1, int)
    for seq, start in zip(sequences, starts):
        seq = list(seq)
        for end in range(max(start, 1), len(seq) - 1):  # the root is seq[end - 1]; the answer continues at end
            known = seq[:end]
            best = None
            for c in range(end - 1, 0, -1):
                ns = [n for n in range(config.n_min, config.n_max + 1) if n <= c and known[c - n: c] == known[-n:]]
                if ns and (best is None or max(ns) > best[1]):
                    best = (c, max(ns))
                    if best[1] == config.n_max:
                        break
            if best is None:
                continue
            c, n = best
            for i in range(config.length):
                if c + i >= end or end + i >= len(seq):
                    break
                tried[n] += 1
                if known[c + i] != seq[end + i]:
                    break
                accepted[n] += 1
    return {n: {"tried": int(tried[n]), "accepted": int(accepted[n]),
                "rate": round(accepted[n] / tried[n], 3) if tried[n] else None}
            for n in range(config.n_min, config.n_max + 1)}


def markdown(results: dict, machine: dict, command: str) -> str:
    lines = ["# Mixed drafts: prompt lookup, the shipped heads and their mix (SmolLM2-135M-Instruct, greedy)", "",
             f"Command: `{command}`", "",
             *([f"Each call ran {results['repeats']} rounds of every method, interleaved; its time is the median."
                , ""] if results.get("repeats", 1) > 1 else []),
             f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, {machine['backend']}, JAX {machine['jax']}, "
             f"load average {machine['load_average_1m']:.1f} at the start (shared with other jobs: the speedups are "
             f"ratios measured in the same run, methods interleaved prompt by prompt).", ""]
    for name, summary in results["sets"].items():
        batch = results.get("batch_size", 1)
        worst = "worst prompt" if batch == 1 else f"worst batch of {batch}"
        below = "prompts below plain" if batch == 1 else "batches below plain"
        split = "speedup_after_first_token" in summary[0]
        lines += [f"## {name} ({summary[0]['prompts']} prompts, batch {batch}, {results['max_new_tokens']} new "
                  f"tokens)", "",
                  f"| method | nodes | tokens/step | tokens/s | speedup vs plain | {worst} | {below} | mismatches |"
                  + (" first token (s) | speedup after the first token |" if split else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|---|" if split else "")]
        for row in summary:
            lines.append(f"| {row['method']} | {row['nodes'] or '-'} | {row['tokens_per_step']:.2f} | "
                         f"{row['tokens_per_second']:.1f} | {row['speedup']:.2f}x | {row['min_prompt_speedup']:.2f}x | "
                         f"{row['calls_below_plain']} | {row['mismatches']} |"
                         + (f" {row['first_token_seconds']:.2f} | {row['speedup_after_first_token']:.2f}x |"
                            if split else ""))
        if split:
            lines += ["", "First token: the median time of the same call stopped after one token (the prefill of "
                      "the prompt padded to the narrowest of 64, 96, 128, 192, 256, 384, 512, ... tokens that holds "
                      "it, and the drafters' admission), averaged over the calls; after the first token: the other "
                      "tokens over the rest of the time."]
        lines.append("")
    lines += ["## Prompt lookup's acceptance by match length (on the plain answers, all sets)", "",
              "| n | drafted tokens tried | accepted | rate |", "|---|---|---|---|"]
    for n, row in results["lookup_acceptance"].items():
        lines.append(f"| {n} | {row['tried']} | {row['accepted']} | {row['rate']} |")
    return "\n".join(lines) + "\n"


def to_json(results: dict) -> str:
    return json.dumps(results, indent=1) + "\n"
