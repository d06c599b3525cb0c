"""The mixed drafts' size rule (`inference.size_choice`) against fixed sizes, in the real decode loop, in one process:
SmolLM2 with the shipped heads' mix `default+recycle+lookup` at BUDGET nodes (16: sizes 0, 2, 5, 16) and
`draft_size.default_costs`, batch 1, greedy, 128 new tokens, the MT-Bench first turns PROMPTS (0-based; or another
SET's prompts), REPEATS interleaved rounds (`bench.mixed_drafts.run_set`, the median), against plain decoding in the
same rounds. Arms:

- "size choice (shipped)": each step chooses among the sizes (`SizeChoiceState`: the step's prediction for each
  size scaled by the size's ratio of accepted to predicted tokens in this run, lookup's chains as a floor, the
  backoff);
- "every step N nodes" (N = the largest size below the budget, 5 at 16 nodes, and the budget): every step drafts
  and verifies N nodes, no
  choice and no backoff (`SizeChoiceState.drafted` a no-op while its loop is traced).

  python bench/size_rule_ab.py            (writes bench/mixed_drafts/size_rule/{results.json,results.md})

Environment: PROMPTS (default 0,1,...,7), REPEATS (2), BUDGET (16; 4 or 64: written to results_budgetN.*), SET:
mtbench (the default), grounded (the input-grounded set, `bench.grounded_prompts`) or humaneval (`bench.humaneval`):
the prompts PROMPTS of that set, written to results_SET.{json,md} for a set other than mtbench.
"""

import json
import os
from contextlib import contextmanager
from pathlib import Path

from medusa_jax.bench import mixed_drafts
from medusa_jax.bench.bench_inputs import (PROMPT_SETS, env_choice, env_choices, env_int, prompt_texts, usage_error,
                                           write_files)
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.inference import draft_size, size_choice
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix, sizes_for
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.policy.calibration import machine_description

PROMPTS = [int(p) for p in env_choices("PROMPTS", tuple(str(i) for i in range(8)), tuple(str(i) for i in range(80)))]
REPEATS = env_int("REPEATS", 2, 1, 100)
SET = env_choice("SET", "mtbench", PROMPT_SETS, "one set")
OUT = Path(__file__).resolve().parent / "mixed_drafts" / "size_rule"
BUDGET = int(env_choice("BUDGET", "16", ("4", "16", "64"), "one budget"))
FIXED = sizes_for(BUDGET)[-2:]  # the largest size below the budget and the budget (16 nodes: 0, 2, 5, 16 -> 5, 16)
SHIPPED = size_choice.SizeChoiceState.drafted


@contextmanager
def fixed_size(on: bool):
    """While a loop is traced: with `on`, the size choice never learns, so every step drafts (its only size)."""
    size_choice.SizeChoiceState.drafted = (lambda self, *args: self) if on else SHIPPED
    try:
        yield
    finally:
        size_choice.SizeChoiceState.drafted = SHIPPED


def main() -> None:
    texts = prompt_texts(SET, max(PROMPTS) + 1)
    if max(PROMPTS) >= len(texts):
        usage_error(f"$PROMPTS={','.join(map(str, PROMPTS))}: the {SET} set has {len(texts)} prompts")
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    arms = {"plain": None, "size choice (shipped)": 0, **{f"every step {n} nodes": n for n in FIXED}}
    models, sizes = {}, None
    for nudge, (label, fixed) in enumerate(arms.items()):
        if fixed is None:
            models[label] = (ShardedModel(loaded.base, None, MeshConfig()), None)
            continue
        mix, tree = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, BUDGET,
                              costs=lambda s, n=nudge: tuple(c * (1 + 1e-6 * n) for c in draft_size.default_costs(s)))
        if fixed:
            tree = DraftSizes((fixed,), (1.0 + 1e-6 * nudge,), tree.depth)
        else:
            sizes = tree
        models[label] = (ShardedModel(loaded.base, mix, MeshConfig()), tree)
    prompts = loaded.encode_chat([texts[i] for i in PROMPTS])
    for label, (model, tree) in models.items():  # each loop traced and compiled with its own rule
        with fixed_size(bool(arms[label])):
            mixed_drafts.run_set({label: (model, tree)}, prompts[:1], 128, loaded.eos_ids, loaded.pad_id)
    rows = mixed_drafts.run_set(models, prompts, 128, loaded.eos_ids, loaded.pad_id, print, repeats=REPEATS)
    results = {"machine": machine, "prompts": PROMPTS, "repeats": REPEATS, "sizes": list(sizes.sizes),
               "costs": [round(c, 3) for c in sizes.costs], "methods": mixed_drafts.arm_figures(rows)}
    settings = " ".join(f"{k}={os.environ[k]}" for k in ("PROMPTS", "REPEATS", "SET", "BUDGET") if k in os.environ)
    results["command"] = command = (settings + " " if settings else "") + "python bench/size_rule_ab.py"
    results["set"], results["budget"] = SET, BUDGET
    name = "results" + ("" if SET == "mtbench" else f"_{SET}") + ("" if BUDGET == 16 else f"_budget{BUDGET}")
    table = mixed_drafts.arm_table(f"The size rule of the mixed drafts against fixed sizes ({SET}, {BUDGET} nodes)",
                                   command, machine, results)
    write_files(OUT, {f"{name}.json": json.dumps(results, indent=1) + "\n", f"{name}.md": table})
    print(table)


if __name__ == "__main__":
    main()
