"""Does Token Recycling's refresh from the prompt (`recycle.prompt_update`: each prompt token's table row set to the
top-r of the base's logits there) pay? SmolLM2, greedy, 128 new tokens.

1. In the mix default+recycle+lookup@BUDGET as shipped (the refresh left out beside prompt lookup:
   `mixed.prompt_readers`) against the same mix with the refresh put back, plain beside, on MT-Bench first turns
   and the input-grounded prompts: `bench.mixed_drafts.run_set` (methods interleaved call by call, REPEATS rounds,
   the median; each round from the same recycling table), first token timed apart.
2. Token Recycling alone on its static templates (TEMPLATES), with and without the refresh: tokens per step only
   (one call per prompt, the table carried from call to call as a generator keeps it).

  python bench/prompt_refresh.py            (writes bench/mixed_drafts/prompt_refresh/{results.json,README.md})

Environment: QUESTIONS (default 8), GROUNDED (4), REPEATS (3), BUDGET (16), TEMPLATES (recycle_16,recycle_64).
"""

import json
import os
from pathlib import Path

from medusa_jax.bench import grounded_prompts, mixed_drafts
from medusa_jax.bench.bench_inputs import env_choices, env_int, mtbench_questions, write_files
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.heads.recycle import TEMPLATES as RECYCLE_TEMPLATES, RecycleDrafter, recycle_drafter, \
    template_tree
from medusa_jax.inference.api import generate_medusa
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.policy.calibration import machine_description

QUESTIONS, GROUNDED = env_int("QUESTIONS", 8, 1, 80), env_int("GROUNDED", 4, 1, len(grounded_prompts.load()))
REPEATS, BUDGET = env_int("REPEATS", 3, 1, 100), env_int("BUDGET", 16, 1, 256)
TEMPLATES = env_choices("TEMPLATES", ("recycle_16", "recycle_64"), tuple(RECYCLE_TEMPLATES))
OUT = Path(__file__).resolve().parent / "mixed_drafts" / "prompt_refresh"
MIX = f"default+recycle+lookup@{BUDGET}"
WITH_REFRESH = f"{MIX} with the refresh"


class NoPromptRefresh(RecycleDrafter):
    """Token Recycling with the refresh from the prompt left out (its table as the last call left it)."""

    needs_prompt_hidden = False

    def init_draft(self, base, prompt_bt, prompt_lens_b, hidden_btd, cache_size: int, max_depth: int):
        return self.recycle_table[...]


def mix_with_refresh(loaded):
    """The shipped mix with every member that needs the prompt's hidden states given them (set before the model
    is split: the flag is part of its graphdef)."""
    mix, sizes = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, BUDGET)
    mix.prompt_readers = tuple(bool(getattr(d, "needs_prompt_hidden", False)) for d in mix.drafters)
    mix.needs_prompt_hidden = any(mix.prompt_readers)
    return ShardedModel(loaded.base, mix, MeshConfig()), sizes


def recycle_alone(loaded, sets: dict) -> list[dict]:
    rows = []
    for name in TEMPLATES:
        tree = template_tree(name)
        for refresh in (True, False):
            drafter = recycle_drafter(loaded.base)  # the shipped warm table
            if not refresh:
                drafter.__class__ = NoPromptRefresh
            for set_name, prompts in sets.items():
                tokens = steps = 0
                for prompt in prompts:
                    r = generate_medusa(loaded.base, drafter, [prompt], tree=tree, max_new_tokens=128,
                                        eos_ids=loaded.eos_ids, pad_id=loaded.pad_id)[0]
                    tokens, steps = tokens + r.new_tokens, steps + r.steps
                rows.append({"template": name, "refresh": refresh, "set": set_name, "new_tokens": tokens,
                             "steps": steps, "tokens_per_step": round(tokens / steps, 3)})
                print(rows[-1], flush=True)
    return rows


def markdown(results: dict, command: str) -> str:
    m = results["machine"]
    lines = ["# Token Recycling's refresh from the prompt: in the mix and alone (SmolLM2-135M-Instruct, greedy)", "",
             f"Command: `{command}`", "",
             f"Machine: {m['cpu']}, {m['cpu_count']} cores, {m['backend']}, JAX {m['jax']}, load average "
             f"{m['load_average_1m']:.1f} at the start; {results['date']}.", "",
             f"## 1. In the mix {MIX} ({REPEATS} rounds, the median; 128 new tokens)", "",
             "| set | method | tokens/step | speedup vs plain | worst prompt | first token (s) | speedup after the "
             "first token | mismatches |", "|---|---|---|---|---|---|---|---|"]
    for set_name, summary in results["mix"].items():
        for row in summary:
            lines.append(f"| {set_name} | {row['method']} | {row['tokens_per_step']:.2f} | {row['speedup']:.2f}x | "
                         f"{row['min_prompt_speedup']:.2f}x | {row['first_token_seconds']:.3f} | "
                         f"{row['speedup_after_first_token']:.2f}x | {row['mismatches']} |")
    lines += ["", "## 2. Token Recycling alone, static templates (tokens per step; the table carried across calls)",
              "", "| template | set | with the refresh | without |", "|---|---|---|---|"]
    alone = results["recycle_alone"]
    for row in alone:
        if row["refresh"]:
            other = next(r for r in alone if r["template"] == row["template"] and r["set"] == row["set"]
                         and not r["refresh"])
            lines.append(f"| {row['template']} | {row['set']} | {row['tokens_per_step']:.3f} | "
                         f"{other['tokens_per_step']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    chosen = mixed_drafts.methods([MIX], [BUDGET])
    models = mixed_drafts.build_models(loaded, chosen, lambda where: loaded.heads)
    models[WITH_REFRESH] = mix_with_refresh(loaded)
    sets = {"MT-Bench": loaded.encode_chat([q.first_turn for q in mtbench_questions(QUESTIONS)]),
            "input-grounded": loaded.encode_chat([r["prompt"] for r in grounded_prompts.load()[:GROUNDED]])}
    results = {"date": machine["date"], "machine": machine, "mix": {}, "recycle_alone": None}
    for name, prompts in sets.items():
        rows = mixed_drafts.run_set(models, prompts, 128, loaded.eos_ids, loaded.pad_id, print, repeats=REPEATS,
                                    first_token=True)
        results["mix"][name] = mixed_drafts.summarise(rows, {})
        print(json.dumps(results["mix"][name]), flush=True)
    results["recycle_alone"] = recycle_alone(loaded, sets)
    settings = " ".join(f"{k}={os.environ[k]}" for k in ("QUESTIONS", "GROUNDED", "REPEATS", "BUDGET", "TEMPLATES")
                        if k in os.environ)
    command = (settings + " " if settings else "") + "python bench/prompt_refresh.py"
    write_files(OUT, {"results.json": json.dumps(results, indent=1) + "\n", "README.md": markdown(results, command)})


if __name__ == "__main__":
    main()
