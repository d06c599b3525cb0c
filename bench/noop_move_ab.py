"""A/B of skipping the no-op cache move (`medusa.move_cache_slots` as shipped: skipped when every entry is a no-op,
and since 2026-12-07 made at its width, bench/move_width_ab.py) against always making it (the code before:
`kv_cache.move_slots` in every layer at every step), in one process: SmolLM2 with the shipped heads'
mix `default+recycle+lookup` at 16 nodes and `draft_size.default_costs` (both arms the same costs, nudged by a part
in a million so that each compiles its own loop), batch 1, greedy, 128 new tokens, MT-Bench first turns PROMPTS
(0-based), REPEATS interleaved rounds (`bench.mixed_drafts.run_set`, the median), against plain decoding in the
same rounds. Each arm's loop is traced with its own move (the swap is undone after its first call compiles it).

  python bench/noop_move_ab.py            (writes bench/mixed_drafts/noop_move/{results.json,README.md})

Environment: PROMPTS (default 0,1,...,7), REPEATS (3), NEVER_DRAFT=1: every step of both arms is the mix's skip
branch (`medusa.skipped_step`, as bench/never_drafting_loop.py), so the loop's own per-step cost is compared.
"""

import json
import os
from pathlib import Path


from medusa_jax.bench import mixed_drafts
from medusa_jax.bench.bench_inputs import env_choices, env_int, mtbench_questions, write_files
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.inference import draft_size, medusa
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model.kv_cache import move_slots
from medusa_jax.model.sharding import MeshConfig, map_cache_rows
from medusa_jax.trees.policy.calibration import machine_description

PROMPTS = [int(p) for p in env_choices("PROMPTS", tuple(str(i) for i in range(8)), tuple(str(i) for i in range(80)))]
REPEATS = env_int("REPEATS", 3, 1, 100)
NEVER_DRAFT = env_int("NEVER_DRAFT", 0, 0, 1) == 1
OUT = Path(__file__).resolve().parent / "mixed_drafts" / "noop_move"
SKIPPED_MOVE = medusa.move_cache_slots


def always_move(cache, src_be, dst_be):
    """The move as it was: made in every layer at every step, no-op or not."""
    return map_cache_rows(move_slots, cache, src_be, dst_be)


def main() -> None:
    if NEVER_DRAFT:
        medusa.mixed_step = mixed_drafts.never_drafting_step
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    arms = {"plain": (None, SKIPPED_MOVE), "skipped no-op move": (0, SKIPPED_MOVE), "always moved": (1, always_move)}
    models, sizes = {}, None
    for label, (nudge, _) in arms.items():
        if nudge is None:
            models[label] = (ShardedModel(loaded.base, None, MeshConfig()), None)
            continue
        mix, sizes = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, 16,
                               costs=lambda s, n=nudge: tuple(c * (1 + 1e-6 * (n + 1))
                                                              for c in draft_size.default_costs(s)))
        models[label] = (ShardedModel(loaded.base, mix, MeshConfig()), sizes)
    questions = mtbench_questions(max(PROMPTS) + 1)
    prompts = loaded.encode_chat([questions[i].first_turn for i in PROMPTS])
    mixed_drafts.compile_with(models, {label: fn for label, (_, fn) in arms.items()}, prompts, loaded.eos_ids,
                                    loaded.pad_id)
    rows = mixed_drafts.run_set(models, prompts, 128, loaded.eos_ids, loaded.pad_id, print, repeats=REPEATS)
    results = {"machine": machine, "prompts": PROMPTS, "repeats": REPEATS, "never_draft": NEVER_DRAFT,
               "sizes": list(sizes.sizes), "costs": [round(c, 3) for c in sizes.costs],
               "methods": mixed_drafts.arm_figures(rows)}
    settings = " ".join(f"{k}={os.environ[k]}" for k in ("PROMPTS", "REPEATS", "NEVER_DRAFT") if k in os.environ)
    results["command"] = command = (settings + " " if settings else "") + "python bench/noop_move_ab.py"
    name = "results_never_draft" if NEVER_DRAFT else "results"
    title = "Never drafting (every step the skip branch)" if NEVER_DRAFT else "The mix as shipped"
    table = mixed_drafts.arm_table(title, command, machine, results)
    write_files(OUT, {f"{name}.json": json.dumps(results, indent=1) + "\n", f"{name}.md": table})
    print(table)


if __name__ == "__main__":
    main()
