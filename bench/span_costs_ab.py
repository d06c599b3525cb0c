"""Draft sizes priced at the span a step attends over against one span's costs, in the real decode loop, in one
process: SmolLM2 with the shipped heads' mix `default+recycle+lookup` at 16 nodes (sizes 0, 2, 5, 16), BATCH rows,
greedy, 128 new tokens, the MT-Bench first turns PROMPTS (0-based), REPEATS interleaved rounds
(`bench.mixed_drafts.run_set`, the median), against plain decoding in the same rounds. Both arms take this machine's
calibration (`draft_size_cache.size_costs`: timed once at the spans of `draft_size.SPAN_CONTEXTS` and cached):

- "costs by span (shipped)": each step prices its sizes at its cache's or window's slots (`DraftSizes.at_span`);
- "costs of the first span": the costs timed over the first span (256 cached tokens) at every span, as before.

Prompts are padded to bench.mixed_drafts' width, 512 tokens (`BatchSettings.bucket`), so every call's cache holds
1,024 slots and each arm compiles one decode loop. At generate's width (64) the prompts' caches differ, each arm
compiles a loop per cache size, and on this 2-core machine (24 GiB) the compiler ran out of memory mappings
("LLVM compilation error: Cannot allocate memory") with three arms of 8 MT-Bench prompts.

  python bench/span_costs_ab.py      (writes bench/mixed_drafts/span_costs/results_bucket512_batchBATCH.{json,md};
                                      with PROMPTS set: results_bucket512_batchBATCH_promptsN, N prompts)

Environment: PROMPTS (default 0,1,...,7), REPEATS (3), BATCH (1).
"""

import json
import os
from pathlib import Path

from medusa_jax.bench import mixed_drafts
from medusa_jax.bench.bench_inputs import env_choices, env_int, prompt_texts, write_files
from medusa_jax.compile_cache import enable_compile_cache
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.inference.loaded_model import load_model
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.model.sharding import MeshConfig
from medusa_jax.trees.policy.calibration import machine_description

PROMPTS = [int(p) for p in env_choices("PROMPTS", tuple(str(i) for i in range(8)), tuple(str(i) for i in range(80)))]
REPEATS = env_int("REPEATS", 3, 1, 100)
BATCH = env_int("BATCH", 1, 1, 16)
BUCKET = mixed_drafts.PROMPT_WIDTH
OUT = Path(__file__).resolve().parent / "mixed_drafts" / "span_costs"


def main() -> None:
    texts = prompt_texts("mtbench", max(PROMPTS) + 1)
    enable_compile_cache()
    machine = machine_description()
    loaded = load_model("default", "default")
    models, sizes = {"plain": (ShardedModel(loaded.base, None, MeshConfig()), None)}, None
    for label in ("costs by span (shipped)", "costs of the first span"):
        mix, tree = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, 16, batch=BATCH)
        if sizes is None:
            sizes = tree
        else:  # the same calibration's costs over its first span, at every span
            tree = DraftSizes(tree.sizes, tree.costs, tree.depth)
        models[label] = (ShardedModel(loaded.base, mix, MeshConfig()), tree)
    prompts = loaded.encode_chat([texts[i] for i in PROMPTS])
    mixed_drafts.run_set(models, prompts[:BATCH], 128, loaded.eos_ids, loaded.pad_id, batch=BATCH,
                         bucket=BUCKET)  # compiles every arm's loops before the timed rounds
    rows = mixed_drafts.run_set(models, prompts, 128, loaded.eos_ids, loaded.pad_id, print, batch=BATCH,
                                repeats=REPEATS, bucket=BUCKET)
    results = {"machine": machine, "prompts": PROMPTS, "repeats": REPEATS, "batch": BATCH, "bucket": BUCKET,
               **sizes.record(), "methods": mixed_drafts.arm_figures(rows)}
    settings = " ".join(f"{k}={os.environ[k]}" for k in ("PROMPTS", "REPEATS", "BATCH") if k in os.environ)
    results["command"] = command = (settings + " " if settings else "") + "python bench/span_costs_ab.py"
    table = mixed_drafts.arm_table(f"Draft sizes priced by span against the first span's costs (batch {BATCH}, "
                                   f"prompts padded to {BUCKET})", command, machine, results)
    if results["costs_by_span"]:
        table += "\nCosts by span (slots: 0 / 2 / 5 / 16 nodes): " + "; ".join(
            f"{s}: {' / '.join(f'{c:.3f}' for c in costs)}" for s, costs in results["costs_by_span"].items()) + "\n"
    name = f"results_bucket{BUCKET}_batch{BATCH}" + (f"_prompts{len(PROMPTS)}" if "PROMPTS" in os.environ else "")
    write_files(OUT, {f"{name}.json": json.dumps(results, indent=1) + "\n", f"{name}.md": table})
    print(table)


if __name__ == "__main__":
    main()
