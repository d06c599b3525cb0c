"""Which rows a batch's size choice counts (`size_choice.SizeChoiceState.counted_rows`), in the real decode loop, in
one process: SmolLM2 with the shipped heads' mix `default+recycle+lookup` at 16 nodes (sizes 0, 2, 5, 16), the step
costs calibrated on this machine at BATCH rows, greedy, 128 new tokens, the prompts PROMPTS of SET (0-based) in calls
of BATCH (`bench.mixed_drafts.run_set`, sorted batches through the engine), REPEATS interleaved rounds (the median),
against plain decoding in the same rounds. Arms:

- "rows with the most tokens left counted (shipped)": the rows of a call end together, so a step's choice counts
  only the rows with the most tokens left;
- "every active row counted (until 2026-12-07)": the engine told that its rows do not end together (as a server's).

Both arms run one mix and one compiled loop: whether the rows end together is an argument of the engine's chunk.

  python bench/batch_rows_ab.py           (writes bench/mixed_drafts_batch4/counted_rows/{results.json,results.md})

Environment: PROMPTS (default 0,1,...,23), REPEATS (2), BATCH (4), SET: mtbench (the default; first turns), grounded
(`bench.grounded_prompts`) or humaneval (`bench.humaneval`), written to results_SET.{json,md} for a set other than
mtbench.
"""

import json
import os
from pathlib import Path

from medusa_jax.bench import mixed_drafts
from medusa_jax.bench.bench_inputs import (PROMPT_SETS, env_choice, env_choices, env_int, prompt_texts, usage_error,
                                           write_files)
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.inference import generation_engine
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.policy.calibration import machine_description

PROMPTS = [int(p) for p in env_choices("PROMPTS", tuple(str(i) for i in range(24)), tuple(str(i) for i in range(164)))]
REPEATS = env_int("REPEATS", 2, 1, 100)
BATCH = env_int("BATCH", 4, 2, 64)
SET = env_choice("SET", "mtbench", PROMPT_SETS, "one set")
OUT = Path(__file__).resolve().parent / "mixed_drafts_batch4" / "counted_rows"
SHIPPED_ARM, EVERY_ROW_ARM = "rows with the most tokens left counted (shipped)", \
    "every active row counted (until 2026-12-07)"
SHIPPED_RULE = generation_engine.GenerationEngine._rows_end_together


def main() -> None:
    texts = prompt_texts(SET, max(PROMPTS) + 1)
    if max(PROMPTS) >= len(texts):
        usage_error(f"$PROMPTS={','.join(map(str, PROMPTS))}: the {SET} set has {len(texts)} prompts")
    if len(PROMPTS) % BATCH:
        usage_error(f"$PROMPTS: {len(PROMPTS)} prompts do not fill calls of $BATCH={BATCH}; give a multiple")
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    mix, sizes = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, 16, batch=BATCH)
    shipped, every_row = (ShardedModel(loaded.base, mix, MeshConfig()) for _ in range(2))  # one mix, one loop
    models = {"plain": (ShardedModel(loaded.base, None, MeshConfig()), None), SHIPPED_ARM: (shipped, sizes),
              EVERY_ROW_ARM: (every_row, sizes)}
    running = {"model": None}
    run_call = mixed_drafts.generate_batch

    def call(model, group, settings, **kw):  # run_set's call: the arm is its model
        running["model"] = model
        return run_call(model, group, settings, **kw)

    generation_engine.GenerationEngine._rows_end_together = \
        lambda self: False if running["model"] is every_row else SHIPPED_RULE(self)
    mixed_drafts.generate_batch = call
    try:
        prompts = loaded.encode_chat([texts[i] for i in PROMPTS])
        cold = {label: model.draft_snapshot() for label, (model, _) in models.items()}
        mixed_drafts.run_set(models, prompts[:BATCH], 128, loaded.eos_ids, loaded.pad_id, batch=BATCH)  # compile
        for label, (model, _) in models.items():  # the timed rounds' table has not seen the first answers
            model.restore_draft(cold[label])
        rows = mixed_drafts.run_set(models, prompts, 128, loaded.eos_ids, loaded.pad_id, print, batch=BATCH,
                                    repeats=REPEATS)
    finally:
        generation_engine.GenerationEngine._rows_end_together = SHIPPED_RULE
        mixed_drafts.generate_batch = run_call
    results = {"machine": machine, "prompts": PROMPTS, "batch": BATCH, "repeats": REPEATS,
               "sizes": list(sizes.sizes), "costs": [round(c, 3) for c in sizes.costs],
               "methods": mixed_drafts.arm_figures(rows)}
    settings = " ".join(f"{k}={os.environ[k]}" for k in ("PROMPTS", "REPEATS", "BATCH", "SET") if k in os.environ)
    results["command"] = command = (settings + " " if settings else "") + "python bench/batch_rows_ab.py"
    results["set"] = SET
    name = "results" + ("" if SET == "mtbench" else f"_{SET}")
    table = mixed_drafts.arm_table(f"Which rows a batch's size choice counts ({SET}, batch {BATCH}, 16 nodes; "
                                   "per call of the batch)", command, machine, results)
    write_files(OUT, {f"{name}.json": json.dumps(results, indent=1) + "\n", f"{name}.md": table})
    print(table)


if __name__ == "__main__":
    main()
